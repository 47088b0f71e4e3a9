"""Encryption-then-lossy-compression (fedsight.functional.etlc, `fedsight etlc`): the down-sampled ciphertext
decrypts to the down-sampled plaintext bit for bit, the ciphertext histogram is flat without the key, the
uniform down-sampling constraint keeps the kept pixels exactly, and the CLI refuses bad input with one line."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image
from scipy.stats import chisquare
from torch import nn
from typer.testing import CliRunner

from fedsight.cli import app
from fedsight.data.photos import load_photo
from fedsight.functional.etlc import (
    compress, decrypt, decrypt_subsampled, encrypt, key_check, keystream, reconstruct, write_back,
)
from fedsight.models import save_weights
from fedsight.registry import MODELS, Entry, NoParams

runner = CliRunner()
KEY = bytes(range(100, 132))  # 32 bytes
HEX = "00112233445566778899aabbccddeeff0123"


def astronaut(size: int | None = None) -> np.ndarray:
    x = load_photo("astronaut").permute(1, 2, 0).to(torch.uint8).numpy()
    return np.ascontiguousarray(x[:size, :size]) if size else x


class Bicubic(nn.Module):
    """A stand-in SR model: bicubic up-sampling (one buffer, so it has weights to save and load)."""

    def __init__(self, scale: int):
        super().__init__()
        self.scale = scale
        self.register_buffer("gain", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(x, scale_factor=self.scale, mode="bicubic", align_corners=False) * self.gain


# -- the cipher ---------------------------------------------------------------------------------------------


@st.composite
def cases(draw):
    s = draw(st.integers(2, 4))
    h, w = draw(st.integers(1, 6)) * s, draw(st.integers(1, 6)) * s
    shape = draw(st.sampled_from([(h, w, 3), (h, w), (h, w, 1)]))
    img = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).integers(0, 256, shape, dtype=np.uint8)
    key = draw(st.one_of(st.binary(min_size=1, max_size=40), st.text(min_size=1, max_size=12)))
    return img, s, draw(st.integers(0, s - 1)), key, draw(st.binary(max_size=24))


@given(cases())
def test_decrypting_the_subsampled_ciphertext_equals_subsampling_the_plaintext(case):
    img, s, o, key, nonce = case
    kept = decrypt_subsampled(compress(encrypt(img, key, nonce), s, o), key, nonce, img.shape, s, o)
    assert kept.dtype == np.uint8
    assert np.array_equal(kept, img[o::s, o::s])
    assert np.array_equal(kept, compress(img, s, o))


@given(cases())
def test_decrypt_inverts_encrypt_and_ciphertext_is_addition_mod_256(case):
    img, _, _, key, nonce = case
    c = encrypt(img, key, nonce)
    assert c.shape == img.shape and c.dtype == np.uint8
    assert np.array_equal(decrypt(c, key, nonce), img)
    want = (img.astype(np.int64) + keystream(key, img.shape, nonce).astype(np.int64)) % 256
    assert np.array_equal(c, want)


def test_keystream_is_shake256_of_the_documented_header():
    key, nonce, shape = b"k" * 16, b"nonce", (2, 4, 3)

    def field(b):
        return len(b).to_bytes(8, "big") + b

    header = field(b"fedsight/etlc/keystream/shake256/v1") + field(key) + field(nonce) + (3).to_bytes(8, "big")
    header += b"".join(d.to_bytes(8, "big") for d in shape)
    want = np.frombuffer(hashlib.shake_256(header).digest(24), dtype=np.uint8).reshape(shape)
    got = keystream(key, shape, nonce)
    assert got.dtype == np.uint8 and got.shape == shape and np.array_equal(got, want)
    assert np.array_equal(keystream(key, shape, nonce), got)  # deterministic
    assert np.array_equal(keystream("k" * 16, shape, "nonce"), got)  # str = its UTF-8 bytes


def test_different_keys_nonces_or_shapes_give_unrelated_streams():
    base = keystream(KEY, (64, 64, 3), b"n1")
    others = [keystream(KEY[:-1] + b"\x00", (64, 64, 3), b"n1"), keystream(KEY, (64, 64, 3), b"n2"),
              keystream(KEY, (64, 64, 3)), keystream(KEY, (64, 192), b"n1")]
    for other in others:
        assert abs((other.reshape(-1) == base.reshape(-1)).mean() - 1 / 256) < 0.01  # chance agreement only
    # length-prefixed fields: moving a byte from the key to the nonce changes the stream
    assert not np.array_equal(keystream(b"ab", 32, b"c"), keystream(b"a", 32, b"bc"))
    with pytest.raises(ValueError, match="key is empty"):
        keystream(b"", 4)


def _flat_p(values: np.ndarray) -> float:
    return float(chisquare(np.bincount(values.reshape(-1), minlength=256)).pvalue)


def test_ciphertext_histogram_is_flat_without_the_key():
    const = np.full((256, 256, 3), 200, dtype=np.uint8)
    photo = astronaut()
    assert _flat_p(photo) < 1e-10  # the test can fail: the plaintext photo's histogram is far from flat
    for img in (const, photo):
        c = encrypt(img, KEY, b"histogram")
        assert _flat_p(c) > 1e-3
        assert _flat_p(compress(c, 2, 1)) > 1e-3  # the down-sampled ciphertext too


def test_compress_needs_multiples_of_the_scale():
    with pytest.raises(ValueError, match=r"the image is 10x12 \(HxW\); down-sampling by 3 .*crop it to 9x12"):
        compress(np.zeros((10, 12, 3), np.uint8), 3)
    with pytest.raises(ValueError, match="offset must be an integer in 0..1"):
        compress(np.zeros((4, 4, 3), np.uint8), 2, 2)
    with pytest.raises(ValueError, match="uint8"):
        encrypt(np.zeros((4, 4, 3), np.float32), KEY)
    with pytest.raises(ValueError, match=r"down-sampled by 2 is \(2, 2, 3\)"):
        decrypt_subsampled(np.zeros((3, 2, 3), np.uint8), KEY, b"", (4, 4, 3), 2)


# -- the uniform down-sampling constraint ----------------------------------------------------------------------


@pytest.mark.parametrize("s,o", [(2, 0), (2, 1), (3, 2), (4, 1)])
def test_write_back_keeps_the_kept_pixels_and_leaves_the_rest(s, o):
    g = torch.Generator().manual_seed(s * 10 + o)
    sr, kept = torch.rand(2, 3, 5 * s, 4 * s, generator=g), torch.rand(2, 3, 5, 4, generator=g)
    before = sr.clone()
    out = write_back(sr, kept, s, o)
    assert torch.equal(sr, before) and out.data_ptr() != sr.data_ptr()  # a new tensor
    assert torch.equal(out[..., o::s, o::s], kept)
    mask = torch.ones_like(sr, dtype=torch.bool)
    mask[..., o::s, o::s] = False
    assert torch.equal(out[mask], sr[mask])
    with pytest.raises(ValueError, match="SR output"):
        write_back(sr, torch.rand(2, 3, 4, 4), s, o)


@pytest.mark.parametrize("s,o", [(2, 0), (3, 1), (4, 3)])
def test_reconstruct_with_a_bicubic_model_writes_the_kept_pixels_back_exactly(s, o):
    x = astronaut(96)
    model = Bicubic(s).train()
    kept = compress(x, s, o)
    hr = reconstruct(model, kept, s, o)
    assert hr.dtype == np.uint8 and hr.shape == x.shape
    assert np.array_equal(hr[o::s, o::s], kept)
    assert model.training  # mode restored
    mse = ((hr.astype(np.float64) - x) ** 2).mean()
    assert 10 * np.log10(255**2 / mse) > 18  # a real reconstruction, not noise
    batch = reconstruct(model, np.stack([kept, kept[::-1].copy()]), s, o)
    assert batch.shape == (2, *x.shape) and np.array_equal(batch[0], hr)
    with pytest.raises(ValueError, match="a model of another scale"):
        reconstruct(Bicubic(s + 1), kept, s, o)


# -- the command line ---------------------------------------------------------------------------------------


def _png(path, arr):
    Image.fromarray(arr).save(path)
    return path


def _read(path):
    return np.asarray(Image.open(path))


@pytest.fixture()
def files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "K").write_bytes(KEY)
    return tmp_path, astronaut(60)


def ok(args):
    res = runner.invoke(app, ["etlc", *map(str, args)])
    assert res.exit_code == 0, res.output
    return res


def refused(args, *needles, code=None):
    res = runner.invoke(app, ["etlc", *map(str, args)])
    assert res.exit_code != 0 and (code is None or res.exit_code == code), res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception  # no traceback
    text = " ".join(res.output.split())
    assert "Traceback" not in text and text.startswith("error:"), res.output
    for n in needles:
        assert n in text, (n, res.output)
    return text


@pytest.mark.parametrize("s,o", [(2, 0), (3, 2)])
def test_cli_encrypt_compress_decrypt_gives_the_subsampled_plaintext(files, s, o):
    tmp, x = files
    _png(tmp / "img.png", x)
    out = ok(["encrypt", "img.png", "--key", HEX, "-o", "c.png"]).output
    assert HEX not in out and HEX not in (tmp / "c.png.json").read_text()
    ok(["encrypt", "img.png", "--key-file", "K", "-o", "c.png", "--force"])
    c = _read(tmp / "c.png")
    assert c.shape == x.shape and (c != x).mean() > 0.9
    meta = json.loads((tmp / "c.png.json").read_text())
    assert meta["kind"] == "ciphertext" and meta["shape"] == [60, 60, 3] and len(meta["nonce"]) == 32
    ok(["compress", "c.png", "--scale", s, "--offset", o, "-o", "small.png"])
    assert _read(tmp / "small.png").shape == (60 // s, 60 // s, 3)
    res = ok(["decrypt", "small.png", "--key-file", "K", "-o", "kept.png"])
    assert np.array_equal(_read(tmp / "kept.png"), x[o::s, o::s]), res.output
    kmeta = json.loads((tmp / "kept.png.json").read_text())
    assert (kmeta["kind"], kmeta["scale"], kmeta["offset"]) == ("kept", s, o) and "nonce" not in kmeta
    ok(["decrypt", "c.png", "--key-file", "K", "-o", "plain.png"])  # a full ciphertext decrypts to the original
    assert np.array_equal(_read(tmp / "plain.png"), x)
    # two encryptions of one image use fresh nonces: different ciphertexts
    ok(["encrypt", "img.png", "--key-file", "K", "-o", "c2.png"])
    assert (_read(tmp / "c2.png") != c).mean() > 0.9


def _run_dir(path, task="image_sr", scale=2, **model):
    path.mkdir()
    cfg = {"task": {"name": task}, "data": {"scale": scale}, "model": {"name": "etlc_test_bicubic", **model}, "seed": 0}
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "status.json").write_text(json.dumps({"state": "complete", "round": 1, "rounds": 1}))
    save_weights(Bicubic(scale), path / "model.safetensors")
    return path


@pytest.fixture()
def sr_run(files, monkeypatch):
    """A cheap stand-in for a finished image_sr run: its config, status and final model (a bicubic module
    registered as a model for the test only)."""
    entry = Entry("etlc_test_bicubic", lambda params, io: Bicubic(io.scale), NoParams, "bicubic (test)", "image_sr")
    monkeypatch.setitem(MODELS._entries, "etlc_test_bicubic", entry)
    return _run_dir(files[0] / "run")


def test_cli_reconstruct_and_roundtrip_with_a_run_directory(files, sr_run):
    tmp, x = files
    _png(tmp / "img.png", x)
    ok(["encrypt", "img.png", "--key-file", "K", "-o", "c.png"])
    ok(["compress", "c.png", "--scale", 2, "--offset", 1, "-o", "s.png"])
    ok(["decrypt", "s.png", "--key-file", "K", "-o", "kept.png"])
    ok(["reconstruct", "kept.png", "--run", sr_run, "-o", "out.png", "--device", "cpu"])
    hr = _read(tmp / "out.png")
    want = reconstruct(Bicubic(2), x[1::2, 1::2].copy(), 2, 1)
    assert np.array_equal(hr, want) and np.array_equal(hr[1::2, 1::2], x[1::2, 1::2])
    res = ok(["roundtrip", "img.png", "--key-file", "K", "--scale", 2, "--offset", 1, "--run", sr_run, "-o", "rt.png"])
    assert np.array_equal(_read(tmp / "rt.png"), want)
    mse = ((want.astype(np.float64) - x) ** 2).mean()
    assert f"{10 * np.log10(255**2 / mse):.2f} dB (RGB)" in res.output and "(Y)" in res.output
    # runs of another task or scale, and outputs inside a run, are refused
    refused(["reconstruct", "kept.png", "--run", _run_dir(tmp / "seg", task="segmentation"), "-o", "o.png"],
            "--run", "segmentation", "image_sr")
    refused(["reconstruct", "kept.png", "--run", _run_dir(tmp / "x3", scale=3), "-o", "o.png"],
            "up-samples by 3", "down-sampled by 2")
    refused(["reconstruct", "kept.png", "--run", _run_dir(tmp / "udc0", udc=True, udc_offset=0), "-o", "o.png"],
            "offset 0 (model.udc_offset)", "down-sampled at offset 1")
    refused(["reconstruct", "kept.png", "--run", sr_run, "-o", sr_run / "o.png"], "inside the run directory")
    refused(["reconstruct", "c.png", "--run", sr_run, "-o", "o.png"], "c.png is a full ciphertext")
    refused(["roundtrip", "img.png", "--key-file", "K", "--scale", 4, "--run", sr_run, "-o", "o.png"], "up-samples by 2")
    (sr_run / "model.safetensors").unlink()
    refused(["reconstruct", "kept.png", "--run", sr_run, "-o", "o.png"], "no model.safetensors")
    assert not (tmp / "o.png").exists()


def test_cli_refuses_bad_input_with_one_line(files):
    tmp, x = files
    _png(tmp / "img.png", x)
    _png(tmp / "odd.png", x[:59])
    ok(["encrypt", "img.png", "--key-file", "K", "-o", "c.png"])
    ok(["compress", "c.png", "--scale", 2, "-o", "s.png"])
    (tmp / "short").write_bytes(b"0123")
    Image.fromarray(_read(tmp / "c.png")).save(tmp / "c.jpg")

    # keys: missing, twice, short, not hex, wrong; never echoed
    refused(["encrypt", "img.png", "-o", "e.png"], "no key", "--key-file", code=2)
    refused(["encrypt", "img.png", "--key-file", "K", "--key", HEX, "-o", "e.png"], "not both", code=2)
    refused(["encrypt", "img.png", "--key-file", "short", "-o", "e.png"], "--key-file short", "4 bytes")
    refused(["encrypt", "img.png", "--key-file", "nokey", "-o", "e.png"], "--key-file nokey: no such file")
    assert "zz11" not in refused(["encrypt", "img.png", "--key", "zz11" * 9, "-o", "e.png"], "--key: not a hex", code=2)
    text = refused(["decrypt", "s.png", "--key", HEX, "-o", "d.png"], "--key: not the key s.png was encrypted with")
    assert HEX not in text
    # inputs: missing, not PNG, wrong size, sidecar missing / damaged / of another image, wrong kind
    refused(["encrypt", "missing.png", "--key-file", "K", "-o", "e.png"], "missing.png: no such file")
    refused(["compress", "c.jpg", "--scale", 2, "-o", "e.png"], "c.jpg: a JPEG file, not a PNG")
    ok(["encrypt", "odd.png", "--key-file", "K", "-o", "odd_c.png"])
    refused(["compress", "odd_c.png", "--scale", 2, "-o", "e.png"], "odd_c.png", "59x60", "multiples of 2")
    refused(["compress", "c.png", "--scale", 2, "--offset", 2, "-o", "e.png"], "offset", code=2)
    refused(["compress", "s.png", "--scale", 2, "-o", "e.png"], "s.png is a down-sampled ciphertext")
    refused(["compress", "img.png", "--scale", 2, "-o", "e.png"], "img.png.json: missing")
    (tmp / "odd_c.png.json").write_text((tmp / "c.png.json").read_text())  # a sidecar of another image
    refused(["decrypt", "odd_c.png", "--key-file", "K", "-o", "e.png"], "odd_c.png is 59x60", "do not belong together")
    _png(tmp / "other.png", np.zeros_like(x))
    (tmp / "other.png.json").write_text((tmp / "c.png.json").read_text())
    refused(["decrypt", "other.png", "--key-file", "K", "-o", "e.png"], "other.png: its pixels are not those")
    (tmp / "other.png.json").write_text("{not json")
    refused(["decrypt", "other.png", "--key-file", "K", "-o", "e.png"], "other.png.json: not valid JSON")
    # outputs: existing (PNG or its sidecar) without --force, not *.png, an input
    (tmp / "taken.png").write_bytes(b"keep me")
    refused(["decrypt", "s.png", "--key-file", "K", "-o", "taken.png"], "--out taken.png exists", "--force")
    assert (tmp / "taken.png").read_bytes() == b"keep me"
    (tmp / "side.png.json").write_text("{}")
    refused(["encrypt", "img.png", "--key-file", "K", "-o", "side.png"], "its sidecar side.png.json exists")
    refused(["encrypt", "img.png", "--key-file", "K", "-o", "c.txt"], "*.png", code=2)
    refused(["compress", "c.png", "--scale", 2, "-o", "c.png", "--force"], "would overwrite the input c.png", code=2)
    refused(["keygen", "-o", "K"], "--out K exists")
    assert (tmp / "K").read_bytes() == KEY
    for name in ("e.png", "d.png", "e.png.json"):
        assert not (tmp / name).exists()
    ok(["decrypt", "s.png", "--key-file", "K", "-o", "taken.png", "--force"])
    assert np.array_equal(_read(tmp / "taken.png"), x[::2, ::2])


def test_cli_keygen_writes_a_private_random_key(files):
    tmp, _ = files
    ok(["keygen", "-o", "k1"])
    ok(["keygen", "-o", "k2"])
    k1, k2 = (tmp / "k1").read_bytes(), (tmp / "k2").read_bytes()
    assert len(k1) == 32 and k1 != k2
    assert (tmp / "k1").stat().st_mode & 0o077 == 0
    assert key_check(k1) != key_check(k2)
