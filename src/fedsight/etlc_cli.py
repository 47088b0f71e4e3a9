"""``fedsight etlc ...``: encryption-then-lossy-compression of images (PPFL-RDSN's pipeline).

The scheme and what it protects are described in :mod:`fedsight.functional.etlc`. A session::

    fedsight etlc keygen -o K                                   # 32 random bytes (file mode 0600)
    fedsight etlc encrypt IMG --key-file K -o c.png             # sender: c.png + c.png.json
    fedsight etlc compress c.png --scale 2 -o c_small.png       # anyone, no key: 1/4 of the pixels kept
    fedsight etlc decrypt c_small.png --key-file K -o kept.png  # receiver: the kept plaintext pixels
    fedsight etlc reconstruct kept.png --run RUN_DIR -o out.png # SR model of an image_sr run, kept pixels exact
    fedsight etlc roundtrip IMG --key-file K --scale 2 --run RUN_DIR -o out.png   # all of it, prints PSNR

Each file a command writes is an 8-bit RGB PNG. Ciphertexts and kept images also get a JSON sidecar beside
them (``c.png.json``). It records the kind, the full image shape, the scale and offset, the nonce, a 32-bit
key check value and the SHA-256 of the PNG's pixels. The pixel hash pairs the PNG with its sidecar; it is
not authentication. The nonce is drawn fresh (16 random bytes) for every encryption. Nothing here prints a
key. Every input is read and checked before anything is written. An existing output (or its sidecar) is
replaced only with ``--force``, as in ``fedsight pretrain``. No output is written inside a run directory
or over one of the command's inputs.

Wired into the main CLI as ``app.add_typer(etlc_app, name="etlc")``.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer
from rich.console import Console
from rich.markup import escape

if TYPE_CHECKING:
    import numpy as np
    import torch

etlc_app = typer.Typer(
    help="Encryption-then-lossy-compression of images (PPFL-RDSN): encrypt with a key stream, down-sample the "
    "ciphertext, decrypt the kept pixels, reconstruct with an image_sr run's model.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err = Console(stderr=True)

FORMAT, VERSION = "fedsight-etlc", 1
MIN_KEY_BYTES = 16
KINDS = {"ciphertext": "a full ciphertext (`fedsight etlc encrypt`)",
         "compressed": "a down-sampled ciphertext (`fedsight etlc compress`)",
         "kept": "decrypted kept pixels (`fedsight etlc decrypt` of a down-sampled ciphertext)"}

KeyFileOpt = Annotated[Optional[Path], typer.Option("--key-file", help="File holding the key's raw bytes (at least 16).")]
KeyOpt = Annotated[Optional[str], typer.Option(
    "--key", help="The key as hex (at least 32 hex digits). Prefer --key-file: a command line shows in process "
    "lists and shell history.")]
OutOpt = Annotated[Path, typer.Option("--out", "-o", help="The PNG to write (with a .json sidecar beside it when a "
                                                          "later command needs one).")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Replace an existing output and its .json sidecar.")]
ScaleOpt = Annotated[int, typer.Option("--scale", min=2, help="Down-sampling factor s: keep every s-th pixel "
                                                               "in each direction (1/s^2 of them).")]
OffsetOpt = Annotated[int, typer.Option("--offset", min=0, help="Position of the kept pixel in each s x s block "
                                                                 "(0..s-1, the same in both directions).")]
RunOpt = Annotated[Path, typer.Option("--run", help="A run directory of an image_sr run at the same scale; its final "
                                                     "global model (model.safetensors) is used.")]
DeviceOpt = Annotated[str, typer.Option("--device", help='Where the SR model runs: "auto", "cpu", "cuda", "cuda:N".')]


class _Refused(Exception):
    """A problem with the user's input: one line (naming the file or option), and the exit code."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def _fail(msg: str, code: int = 1) -> None:
    err.print(f"[bold red]error:[/] {escape(msg)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@contextlib.contextmanager
def _errors() -> Iterator[None]:
    """Expected failures become one line on stderr: exit 2 for a bad option, 1 for a bad file."""
    from .errors import ConfigError, FedSightError

    try:
        yield
    except _Refused as exc:
        _fail(str(exc), exc.code)
    except (FedSightError, ValueError, FileNotFoundError) as exc:
        _fail(" ".join(str(exc).split()), 2 if isinstance(exc, ConfigError) else 1)
    except OSError as exc:  # permissions, a full disk: the OS's reason and the file
        _fail(f"{exc.strerror or type(exc).__name__}: {exc.filename}" if exc.filename else str(exc), 1)


# -- keys ---------------------------------------------------------------------------------------------------


def _key(key_file: Path | None, key_hex: str | None) -> bytes:
    """The key from --key-file or --key, checked. No message quotes any of it."""
    if key_file is not None and key_hex is not None:
        raise _Refused("give the key once: --key-file or --key, not both", 2)
    if key_file is None and key_hex is None:
        raise _Refused("no key: give --key-file FILE (raw bytes; `fedsight etlc keygen -o FILE` makes one) or --key HEX", 2)
    if key_file is not None:
        if not key_file.is_file():
            raise _Refused(f"--key-file {key_file}: no such file")
        key, where = key_file.read_bytes(), f"--key-file {key_file}"
    else:
        text = "".join((key_hex or "").split())
        text = text[2:] if text[:2].lower() == "0x" else text
        try:
            key = bytes.fromhex(text)
        except ValueError:
            raise _Refused("--key: not a hex string (digits 0-9, a-f; an even number of them)", 2) from None
        where = "--key"
    if len(key) < MIN_KEY_BYTES:
        raise _Refused(f"{where}: the key has {len(key)} bytes; use at least {MIN_KEY_BYTES} random bytes "
                       "(`fedsight etlc keygen -o FILE`)", 2 if key_hex is not None else 1)
    return key


def _key_source(key_file: Path | None) -> str:
    return f"--key-file {key_file}" if key_file is not None else "--key"


# -- files ------------------------------------------------------------------------------------------------


def sidecar_path(png: Path) -> Path:
    """The JSON sidecar of a PNG written by these commands: ``c.png`` -> ``c.png.json``."""
    return png.with_name(png.name + ".json")


def _read_plain(path: Path) -> np.ndarray:
    """A plaintext image (any format Pillow reads) as uint8 RGB ``[H, W, 3]``."""
    from .data.images import load_image

    if not path.is_file():
        raise _Refused(f"{path}: no such file")
    return load_image(path, None, 3)  # a ValueError naming the file when Pillow cannot read it


def _read_png(path: Path) -> np.ndarray:
    """A PNG written by these commands: 8-bit RGB, ``[H, W, 3]``."""
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    if not path.is_file():
        raise _Refused(f"{path}: no such file")
    try:
        with Image.open(path) as im:
            fmt, mode = im.format, im.mode
            if fmt == "PNG" and mode == "RGB":
                im.load()
                return np.asarray(im, dtype=np.uint8).copy()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise _Refused(f"{path}: not a readable image ({type(exc).__name__}: {' '.join(str(exc).split())})") from None
    if fmt != "PNG":
        raise _Refused(f"{path}: a {fmt} file, not a PNG; these commands read the PNGs `fedsight etlc` writes "
                       "(a lossy format would change ciphertext bytes)")
    raise _Refused(f"{path}: a PNG of mode {mode}; expected 8-bit RGB, as `fedsight etlc` writes")


def _digest(arr: np.ndarray) -> str:
    return hashlib.sha256(arr.tobytes()).hexdigest()


def _is_hex(value: Any, length: int | None = None) -> bool:
    if not isinstance(value, str) or (length is not None and len(value) != length) or len(value) % 2:
        return False
    try:
        bytes.fromhex(value)
    except ValueError:
        return False
    return True


def _read_sidecar(png: Path, command: str, kinds: tuple[str, ...]) -> dict[str, Any]:
    """The sidecar of ``png``, checked, of one of ``kinds``; ``command`` names the command for messages."""
    from .functional.etlc import CIPHER_NAME, check_divisible

    side = sidecar_path(png)
    if not side.is_file():
        raise _Refused(f"{side}: missing; `fedsight etlc {command}` needs the .json sidecar written beside {png} "
                       "(it records the full size, scale, offset and nonce)")
    try:
        meta = json.loads(side.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _Refused(f"{side}: not valid JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise _Refused(f"{side}: not a `fedsight etlc` sidecar (no \"format\": \"{FORMAT}\")")
    if meta.get("version") != VERSION:
        raise _Refused(f"{side}: sidecar version {meta.get('version')!r}; this FedSight reads version {VERSION}")
    kind = meta.get("kind")
    if kind not in KINDS:
        raise _Refused(f"{side}: unknown kind {kind!r}")
    if kind not in kinds:
        raise _Refused(f"{png} is {KINDS[kind]}; `fedsight etlc {command}` takes "
                       + " or ".join(KINDS[k] for k in kinds))
    shape, scale, offset = meta.get("shape"), meta.get("scale"), meta.get("offset")
    ints = isinstance(shape, list) and len(shape) == 3 and all(type(d) is int and d > 0 for d in shape)
    if not ints or shape[2] != 3 or type(scale) is not int or type(offset) is not int:
        raise _Refused(f"{side}: damaged (expected \"shape\": [H, W, 3], integer \"scale\" and \"offset\")")
    try:
        check_divisible(shape, scale, offset)
    except ValueError as exc:
        raise _Refused(f"{side}: {exc}") from None
    if (kind == "ciphertext") != (scale == 1 and offset == 0):
        raise _Refused(f"{side}: damaged (a {kind} with scale {scale}, offset {offset})")
    if kind != "kept":
        if meta.get("cipher") != CIPHER_NAME:
            raise _Refused(f"{side}: cipher {meta.get('cipher')!r}; this FedSight decrypts {CIPHER_NAME!r}")
        if not _is_hex(meta.get("nonce")) or not _is_hex(meta.get("key_check"), 8):
            raise _Refused(f"{side}: damaged (expected a hex \"nonce\" and an 8-digit hex \"key_check\")")
    if not _is_hex(meta.get("pixels_sha256"), 64):
        raise _Refused(f"{side}: damaged (expected a SHA-256 hex \"pixels_sha256\")")
    return meta


def _check_pair(png: Path, arr: np.ndarray, meta: dict[str, Any]) -> None:
    """The PNG is the image its sidecar describes: size, then pixel hash."""
    h, w, _ = meta["shape"]
    s = meta["scale"]
    want = (h // s, w // s, 3)
    if arr.shape != want:
        what = f"a {h}x{w} image" + (f" down-sampled by {s} ({want[0]}x{want[1]})" if s > 1 else "")
        raise _Refused(f"{png} is {arr.shape[0]}x{arr.shape[1]}, but its sidecar {sidecar_path(png)} describes {what}; "
                       "the PNG and the sidecar do not belong together")
    if _digest(arr) != meta["pixels_sha256"]:
        raise _Refused(f"{png}: its pixels are not those its sidecar {sidecar_path(png)} was written for "
                       "(edited, or another file of the same size?)")


def _plan_output(out: Path, force: bool, inputs: list[Path | None], png: bool = True) -> None:
    """Refuse an output that is not a .png, lies in a run directory, is one of the inputs, or exists
    (it or its sidecar) without --force."""
    from .safe_write import enclosing_run

    if png and out.suffix.lower() != ".png":
        raise _Refused(f"--out {out}: the output is a PNG; name it *.png", 2)
    if out.is_dir():
        raise _Refused(f"--out {out}: a directory; name the file to write", 2)
    run = enclosing_run(out)
    if run is not None:
        raise _Refused(f"--out {out} is inside the run directory {run}; choose a path outside it", 2)
    targets = [out, sidecar_path(out)] if png else [out]
    from .errors import OutputPathError
    from .safe_write import check_output

    for t in targets:  # a device, FIFO, socket or symbolic link is never replaced, even with --force
        try:
            check_output(t, "--out" if t == out else "", force=True)
        except OutputPathError as exc:
            raise _Refused(str(exc), 2) from None
    for p in inputs:
        if p is not None and any(t.absolute().resolve() == p.absolute().resolve() for t in targets):
            raise _Refused(f"--out {out} would overwrite the input {p}; choose another path", 2)
    existing = [t for t in targets if t.exists()]
    if existing and not force:
        what = "" if existing[0] == out else f": its sidecar {existing[0]}"
        raise _Refused(f"--out {out}{what} exists; pass --force to replace it", 1)


def _write_png(out: Path, arr: np.ndarray, meta: dict[str, Any] | None) -> None:
    """Write ``arr`` as an RGB PNG (atomically) and its sidecar ``meta`` (or remove a stale one)."""
    from PIL import Image

    from .safe_write import atomic_write_bytes, atomic_write_text

    buf = io.BytesIO()
    Image.fromarray(arr, "RGB").save(buf, format="PNG", compress_level=6)
    atomic_write_bytes(out, buf.getvalue())
    if meta is not None:
        atomic_write_text(sidecar_path(out), json.dumps(meta) + "\n")
    else:
        sidecar_path(out).unlink(missing_ok=True)


def _meta(kind: str, arr: np.ndarray, shape: tuple[int, ...], scale: int, offset: int, **extra: str) -> dict[str, Any]:
    from .functional.etlc import CIPHER_NAME

    meta: dict[str, Any] = {"format": FORMAT, "version": VERSION, "kind": kind, "shape": [int(d) for d in shape],
                            "scale": int(scale), "offset": int(offset)}
    if kind != "kept":
        meta["cipher"] = CIPHER_NAME
    return {**meta, **extra, "pixels_sha256": _digest(arr)}


def _hw(shape: Any) -> str:
    return f"{shape[0]}x{shape[1]}"


# -- the SR model of a run --------------------------------------------------------------------------------


def _device(spec: str) -> torch.device:
    from .device import resolve_device

    return resolve_device(spec, key="--device")  # a ConfigError naming --device when it is not there


def run_scale(raw: dict[str, Any], run: Path) -> int:
    """The scale an image_sr run was trained for, from its config: ``task.scale`` or ``data.scale``."""
    found = {}
    for section in ("task", "data"):
        part = raw.get(section)
        if isinstance(part, dict) and part.get("scale") is not None:
            found[f"{section}.scale"] = part["scale"]
    if not found:
        raise _Refused(f"--run {run}: its config.json records no scale (task.scale or data.scale)")
    values = set(map(str, found.values()))
    if len(values) > 1 or any(type(v) is not int for v in found.values()):
        raise _Refused(f"--run {run}: config.json has {', '.join(f'{k} = {v!r}' for k, v in found.items())}; "
                       "expected one integer scale")
    return next(iter(found.values()))


def load_run_model(run: Path, scale: int, offset: int, device: torch.device) -> torch.nn.Module:
    """The final global model of the image_sr run in ``run`` (``model.safetensors``), built from the run's
    config (model name and parameters, 3 -> 3 channels at ``scale``), on ``device`` and in eval mode. A run
    of another task or scale, a model whose own UDC keeps another ``offset`` (``model.udc_offset``), or a run
    without a final model is refused with a message naming ``--run``. A model trained on other LR images
    (bicubic, or decimated at another offset) is used with a note."""
    from .models import build_model, load_weights
    from .runs import read_config, read_status

    if not run.is_dir():
        raise _Refused(f"--run {run}: no such directory")
    raw = read_config(run)  # names config.json when it is missing or damaged
    task = raw.get("task") if isinstance(raw.get("task"), dict) else {}
    if task.get("name") != "image_sr":
        raise _Refused(f"--run {run}: a run of task {task.get('name')!r}; reconstruction needs an image_sr run "
                       f"(a super-resolution model of scale {scale})")
    rs = run_scale(raw, run)
    if rs != scale:
        raise _Refused(f"--run {run}: its model up-samples by {rs}, but the image was down-sampled by {scale}; use a run "
                       f"of scale {scale}")
    weights = run / "model.safetensors"
    if not weights.is_file():
        raise _Refused(f"--run {run}: no model.safetensors (the final global model is written when the run completes "
                       f"or stops; finish it with `fedsight resume {run}`)")
    status = read_status(run)
    spec = raw.get("model")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise _Refused(f"--run {run}: config.json names no model")
    params = {k: v for k, v in spec.items() if k != "name"}
    if params.get("udc") and params.get("udc_offset", 0) != offset:
        raise _Refused(f"--run {run}: its model keeps the input pixels at offset {params.get('udc_offset', 0)} "
                       f"(model.udc_offset), but the image was down-sampled at offset {offset}; use --offset "
                       f"{params.get('udc_offset', 0)} or a run of udc_offset {offset}")
    try:
        model = build_model(spec["name"], params, family="image_sr", in_channels=3, num_outputs=3, scale=scale)
    except (KeyError, ValueError, TypeError) as exc:
        text = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
        raise _Refused(f"--run {run}: cannot build its model {spec['name']!r} ({' '.join(str(text).split())[:300]})") from None
    load_weights(model, weights)  # a ValueError naming the file when the weights do not fit
    data = raw.get("data") if isinstance(raw.get("data"), dict) else {}
    lr = data.get("lr")
    if lr is not None and (lr != "decimate" or data.get("decimate_offset", 0) != offset):
        trained = (f"LR images decimated at offset {data.get('decimate_offset', 0)}" if data.get("lr") == "decimate"
                   else f"{data.get('lr')} LR images (data.lr)")
        err.print(f"note: {run} was trained on {trained}; these kept pixels are decimated at offset {offset}",
                  highlight=False, soft_wrap=True, markup=False)
    if status and status.get("state") != "complete":
        err.print(f"note: {run} is {status['state']} at round {status['round']} of {status['rounds']}; using its "
                  "model as of then", highlight=False, soft_wrap=True, markup=False)
    return model.to(device).eval()


# -- commands ---------------------------------------------------------------------------------------------


@etlc_app.command()
def keygen(
    out: Annotated[Path, typer.Option("--out", "-o", help="The key file to write (32 random bytes, mode 0600).")],
    force: ForceOpt = False,
) -> None:
    """Write a fresh random key for --key-file (32 bytes from the OS).

    Share it with the receiver over a secure channel; key exchange is out of scope (as in the paper)."""
    from .safe_write import atomic_write_bytes

    with _errors():
        _plan_output(out, force, [], png=False)
        atomic_write_bytes(out, os.urandom(32), mode=0o600)  # a secret: 0600 from the start, whatever it replaces
    console.print(f"wrote a 32-byte key to {out}; keep it secret", highlight=False, soft_wrap=True, markup=False)


@etlc_app.command("encrypt")
def encrypt_(
    image: Annotated[Path, typer.Argument(help="The plaintext image (PNG, or any 8-bit format Pillow reads; as RGB).")],
    out: OutOpt,
    key_file: KeyFileOpt = None,
    key: KeyOpt = None,
    force: ForceOpt = False,
) -> None:
    """Encrypt an image: add a key stream modulo 256 (fresh nonce).

    The key stream is SHAKE-256 of the key, a fresh random nonce and the image shape. Writes the
    ciphertext PNG and its sidecar (shape, nonce, key check)."""
    from .functional.etlc import encrypt, key_check

    with _errors():
        k = _key(key_file, key)
        x = _read_plain(image)
        _plan_output(out, force, [image, key_file])
        nonce = os.urandom(16)
        c = encrypt(x, k, nonce)
        _write_png(out, c, _meta("ciphertext", c, c.shape, 1, 0, nonce=nonce.hex(), key_check=key_check(k)))
    console.print(f"wrote {out} ({_hw(c.shape)} ciphertext) and {sidecar_path(out)}", highlight=False, soft_wrap=True,
                  markup=False)


@etlc_app.command("compress")
def compress_(
    cipher: Annotated[Path, typer.Argument(help="A ciphertext PNG written by `fedsight etlc encrypt` (with its sidecar).")],
    scale: ScaleOpt,
    out: OutOpt,
    offset: OffsetOpt = 0,
    force: ForceOpt = False,
) -> None:
    """Down-sample a ciphertext uniformly: the lossy compression (no key needed).

    Keeps pixel (o + y s, o + x s) of every s x s block. Height and width must be multiples of s."""
    from .functional.etlc import check_divisible, compress

    with _errors():
        c = _read_png(cipher)
        meta = _read_sidecar(cipher, "compress", ("ciphertext",))
        _check_pair(cipher, c, meta)
        try:
            check_divisible(c.shape, scale, offset)
        except ValueError as exc:
            raise _Refused(f"{cipher}: {exc}; see --scale/--offset", 2 if "offset" in str(exc) else 1) from None
        _plan_output(out, force, [cipher])
        small = compress(c, scale, offset)
        extra = {k: meta[k] for k in ("nonce", "key_check")}
        _write_png(out, small, _meta("compressed", small, c.shape, scale, offset, **extra))
    console.print(f"wrote {out} ({_hw(small.shape)}, 1/{scale * scale} of the {_hw(c.shape)} ciphertext) and "
                  f"{sidecar_path(out)}", highlight=False, soft_wrap=True, markup=False)


@etlc_app.command("decrypt")
def decrypt_(
    cipher: Annotated[Path, typer.Argument(help="A ciphertext PNG (full or down-sampled) with its sidecar.")],
    out: OutOpt,
    key_file: KeyFileOpt = None,
    key: KeyOpt = None,
    force: ForceOpt = False,
) -> None:
    """Decrypt a ciphertext, full or down-sampled.

    A down-sampled one gives the kept plaintext pixels (with a sidecar for `reconstruct`), equal bit for
    bit to down-sampling the original; a full one gives the original."""
    from .functional.etlc import decrypt, decrypt_subsampled, key_check

    with _errors():
        k = _key(key_file, key)
        c = _read_png(cipher)
        meta = _read_sidecar(cipher, "decrypt", ("ciphertext", "compressed"))
        _check_pair(cipher, c, meta)
        if key_check(k) != meta["key_check"]:
            raise _Refused(f"{_key_source(key_file)}: not the key {cipher} was encrypted with (the key check in "
                           f"{sidecar_path(cipher)} differs)")
        _plan_output(out, force, [cipher, key_file])
        nonce, shape, s, o = bytes.fromhex(meta["nonce"]), tuple(meta["shape"]), meta["scale"], meta["offset"]
        if meta["kind"] == "ciphertext":
            plain = decrypt(c, k, nonce)
            _write_png(out, plain, None)
        else:
            plain = decrypt_subsampled(c, k, nonce, shape, s, o)
            _write_png(out, plain, _meta("kept", plain, shape, s, o))
    if meta["kind"] == "ciphertext":
        console.print(f"wrote {out} ({_hw(plain.shape)} plaintext)", highlight=False, soft_wrap=True, markup=False)
    else:
        console.print(f"wrote {out} ({_hw(plain.shape)} kept pixels of a {_hw(shape)} image, scale {s}) and "
                      f"{sidecar_path(out)}; reconstruct with: fedsight etlc reconstruct {out} --run RUN_DIR -o OUT.png",
                      highlight=False, soft_wrap=True, markup=False)


@etlc_app.command("reconstruct")
def reconstruct_(
    kept: Annotated[Path, typer.Argument(help="Kept pixels written by `fedsight etlc decrypt` (with its sidecar).")],
    run: RunOpt,
    out: OutOpt,
    device: DeviceOpt = "auto",
    force: ForceOpt = False,
) -> None:
    """Reconstruct the full-size image from kept pixels with an image_sr run's model.

    The run's final global model up-samples; under the uniform down-sampling constraint the kept pixels
    are then written back exactly, and the rest is the model's."""
    from .functional.etlc import reconstruct

    with _errors():
        x = _read_png(kept)
        meta = _read_sidecar(kept, "reconstruct", ("kept",))
        _check_pair(kept, x, meta)
        s, o = meta["scale"], meta["offset"]
        dev = _device(device)
        _plan_output(out, force, [kept])
        model = load_run_model(run, s, o, dev)
        hr = reconstruct(model, x, s, o, dev)
        _write_png(out, hr, None)
    console.print(f"wrote {out} ({_hw(hr.shape)} from {_hw(x.shape)} kept pixels, scale {s})", highlight=False,
                  soft_wrap=True, markup=False)


@etlc_app.command("roundtrip")
def roundtrip(
    image: Annotated[Path, typer.Argument(help="The plaintext image; height and width multiples of --scale.")],
    scale: ScaleOpt,
    run: RunOpt,
    out: OutOpt,
    key_file: KeyFileOpt = None,
    key: KeyOpt = None,
    offset: OffsetOpt = 0,
    device: DeviceOpt = "auto",
    force: ForceOpt = False,
) -> None:
    """Encrypt, down-sample, decrypt and reconstruct an image in one go; print the PSNR.

    Everything stays in memory (fresh nonce); writes the reconstruction and prints its PSNR (RGB and Y)
    against the original."""
    import numpy as np
    import torch

    from .functional.etlc import check_divisible, compress, decrypt_subsampled, encrypt, reconstruct
    from .functional.image_metrics import psnr

    with _errors():
        k = _key(key_file, key)
        x = _read_plain(image)
        try:
            check_divisible(x.shape, scale, offset)
        except ValueError as exc:
            raise _Refused(f"{image}: {exc}; see --scale/--offset", 2 if "offset" in str(exc) else 1) from None
        dev = _device(device)
        _plan_output(out, force, [image, key_file])
        model = load_run_model(run, scale, offset, dev)
        nonce = os.urandom(16)
        kept = decrypt_subsampled(compress(encrypt(x, k, nonce), scale, offset), k, nonce, x.shape, scale, offset)
        if not np.array_equal(kept, x[offset::scale, offset::scale]):
            raise RuntimeError("decrypting the down-sampled ciphertext did not give the kept plaintext pixels")
        hr = reconstruct(model, kept, scale, offset, dev)
        _write_png(out, hr, None)
    a, b = (torch.from_numpy(v).permute(2, 0, 1).to(torch.float64) / 255.0 for v in (hr, x))
    rgb, y = float(psnr(a, b, channel="rgb")), float(psnr(a, b, channel="y"))
    console.print(f"wrote {out}: {_hw(x.shape)} from {_hw(kept.shape)} kept pixels (scale {scale}, offset {offset}, "
                  f"1/{scale * scale} of the ciphertext)", highlight=False, soft_wrap=True, markup=False)
    console.print(f"PSNR vs {image}: {rgb:.2f} dB (RGB), {y:.2f} dB (Y)", highlight=False, soft_wrap=True, markup=False)
