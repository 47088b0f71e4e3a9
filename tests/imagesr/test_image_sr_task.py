"""The image SR task: aligned training patches, whole-image evaluation against scikit-image, several named
test sets, and federated runs from a config dict and from a TOML file."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from pydantic import Field
from safetensors.torch import load_file
from skimage.metrics import peak_signal_noise_ratio, structural_similarity
from torch import nn

import fedsight.data.image_sr  # noqa: F401  (registers the image SR loaders)
import fedsight.tasks.image_sr as tsr
from fedsight.api import build_task, execute
from fedsight.config import ConfigError, validate
from fedsight.sweep import load
from fedsight.models.base import FedModel
from fedsight.registry import MODELS, Params

# -- a tiny SR model (the real ones live in another module) -------------------------------------------


class TinySR(FedModel):
    """conv-ReLU-conv-PixelShuffle plus a nearest-neighbour skip: receptive radius 2 LR pixels."""

    split_head = False

    def __init__(self, scale: int, channels: int):
        super().__init__()
        self.scale = scale
        self.backbone = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.ReLU())
        self.head = nn.Sequential(nn.Conv2d(channels, 3 * scale * scale, 3, padding=1), nn.PixelShuffle(scale))
        self.feature_dim = channels

    def forward(self, x):
        return self.head(self.features(x)) + F.interpolate(x, scale_factor=self.scale, mode="nearest")


class TinySRParams(Params):
    channels: int = Field(4, ge=1)


if "tiny_sr_test" not in MODELS:
    MODELS.register("tiny_sr_test", params=TinySRParams, task="image_sr", provides=frozenset({"parameter_groups"}))(
        lambda params, *, io: TinySR(io.scale, params.channels))


class Bicubic(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        return F.interpolate(x, scale_factor=self.scale, mode="bicubic", align_corners=False)


DATA = {
    "name": "builtin_sr", "sources": ["chelsea", "coffee", "astronaut"], "tile": 64, "train_max_side": 192, "scale": 2,
    "patch_size": 8, "test_sets": {"photos": ["flower", "grace_hopper"], "textures": ["brick", "camera"]}, "test_max_side": 48,
}


def raw_config(tmp_path, **over):
    raw = {
        "seed": 0,
        "run": {"name": "isr", "output_dir": str(tmp_path), "checkpoint_keep": 1},
        "task": {"name": "image_sr"},
        "data": dict(DATA),
        "partition": {"name": "iid", "num_clients": 4, "local_test_fraction": 0.0},
        "model": {"name": "tiny_sr_test"},
        "train": {"steps": 2, "batch_size": 4, "lr": 0.05},
        "server": {"rounds": 2, "clients_per_round": 2},
        "eval": {"every": 1},
    }
    raw.update(over)
    return raw


def config(tmp_path, **over):
    return validate(raw_config(tmp_path, **over))


def test_federated_run_reports_every_test_set(tmp_path):
    cfg = config(tmp_path, partition={"name": "iid", "num_clients": 4, "local_test_fraction": 0.25})
    out = execute(cfg, tmp_path / "run")
    assert out.status == "complete"
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "event" not in r]
    assert [r["round"] for r in rows] == [0, 1, 2]  # round 0: the initial model
    metrics = ("psnr", "ssim", "psnr_y", "ssim_y", "psnr_rgb", "ssim_rgb", "loss")
    for split in ("test", "test_textures"):
        for m in metrics:
            assert all(np.isfinite(r[f"{split}/{m}"]) for r in rows), f"{split}/{m}"
    assert all(np.isfinite(r["local/wma"]) for r in rows)
    assert all(np.isfinite(r["train/loss"]) for r in rows[1:])
    # the logged numbers are the final global model's on each test set
    task = build_task(cfg)
    torch.manual_seed(0)
    model = task.build_model()
    model.load_state_dict(load_file(str(tmp_path / "run" / "model.safetensors")))
    for split in task.test_splits:
        final = task.evaluate(model, split, 1)
        for m in metrics:
            assert rows[-1][f"{split}/{m}"] == pytest.approx(final[m], abs=1e-9), (split, m)
    assert rows[-1]["test/psnr"] == rows[-1]["test/psnr_y"] != rows[-1]["test/psnr_rgb"]
    part = json.loads((tmp_path / "run" / "partition.json").read_text())
    assert {k: v["name"] for k, v in part["test_sets"].items()} == {"test": "photos", "test_textures": "textures"}
    local = sum(task.num_test_examples(k) for k in range(4))
    assert local > 0 and np.sum(part["client_label_counts"]) + local == 21  # every tile (6 + 6 + 9) dealt once
    assert (tmp_path / "run" / "plots" / "visuals.png").stat().st_size > 1000
    shown = json.loads((tmp_path / "run" / "plots" / "visuals.json").read_text())
    assert [m["set"] for m in shown] == ["photos", "textures", "photos"]  # round robin over the test sets


def test_config_from_a_toml_file(tmp_path):
    (tmp_path / "isr.toml").write_text(f"""
seed = 0
[run]
name = "isr"
output_dir = "{tmp_path}"
[task]
name = "image_sr"
loss = "charbonnier"
crop_border = 3
metric = "rgb"
[data]
name = "builtin_sr"
sources = ["chelsea", "coffee"]
tile = 64
train_max_side = 192
scale = 2
patch_size = 8
lr = "decimate"
test_max_side = 48
test_sets = {{ bench = ["flower"], grey = ["brick", "camera"] }}
[partition]
name = "classes"
classes_per_client = 1
num_clients = 2
[model]
name = "tiny_sr_test"
channels = 3
[train]
steps = 1
[server]
rounds = 1
""")
    (spec,) = load(tmp_path / "isr.toml")
    task = build_task(spec.config)
    assert isinstance(task, tsr.ImageSRTask) and task.test_splits == ("test", "test_grey")
    assert task.crop_border == 3 and task.params.loss == "charbonnier" and task.params.metric == "rgb"
    assert task.splits.train.images[0].lr_mode == "decimate"
    for k in range(2):  # one source photo per client
        assert len(set(task.client_labels(k).tolist())) == 1
    got = task.evaluate(Bicubic(2), "test_grey", 1)
    assert got["psnr"] == got["psnr_rgb"] != got["psnr_y"]


def test_family_mismatch_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="image_sr"):
        config(tmp_path, model={"name": "cnn"})


def y_channel(img):
    """BT.601 luma (MATLAB rgb2ycbcr) of [H, W, 3] images on the 0..255 scale."""
    return 16 + img @ (np.array([65.481, 128.553, 24.966]) / 255.0)


@pytest.mark.parametrize("crop_border", [None, 3])
def test_metrics_match_scikit_image(tmp_path, crop_border):
    cfg = config(tmp_path, task={"name": "image_sr", "crop_border": crop_border})
    task = build_task(cfg)
    cb = 2 if crop_border is None else crop_border  # default: the scale
    model = Bicubic(2)
    for split in task.test_splits:
        got = task.evaluate(model, split, 1)
        ref = {"psnr_y": [], "ssim_y": [], "psnr_rgb": [], "ssim_rgb": []}
        for im in task.eval_images(split):
            out = model(im.lr().float().unsqueeze(0) / 255)[0]
            out = (out.clamp(0, 1) * 255).round().double().permute(1, 2, 0).numpy()[cb:-cb, cb:-cb]
            gt = im.hr().double().permute(1, 2, 0).numpy()[cb:-cb, cb:-cb]
            kw = {"data_range": 255, "gaussian_weights": True, "sigma": 1.5, "use_sample_covariance": False}
            ref["psnr_y"].append(peak_signal_noise_ratio(y_channel(gt), y_channel(out), data_range=255))
            ref["ssim_y"].append(structural_similarity(y_channel(gt), y_channel(out), **kw))
            ref["psnr_rgb"].append(peak_signal_noise_ratio(gt, out, data_range=255))
            ref["ssim_rgb"].append(structural_similarity(gt, out, channel_axis=-1, **kw))
        for k, v in ref.items():
            assert got[k] == pytest.approx(np.mean(v), abs=1e-6), (split, k)
        assert got["psnr"] == got["psnr_y"] and got["ssim"] == got["ssim_y"]


def test_a_test_image_too_small_for_the_border_is_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"test set 'photos': flower is .*crop_border=20"):
        build_task(config(tmp_path, task={"name": "image_sr", "crop_border": 20}))


@pytest.mark.parametrize("augment", [False, True])
@pytest.mark.parametrize("offset", [0, 1])
def test_decimated_training_patches_align(tmp_path, augment, offset):
    data = {**DATA, "lr": "decimate", "decimate_offset": offset}
    task = build_task(config(tmp_path, data=data, task={"name": "image_sr", "augment": augment}))
    torch.manual_seed(1)
    for _ in range(4):
        x, y = task.train_batch(1, torch.arange(task.num_train_examples(1)))
        assert x.shape[1:] == (3, 8, 8) and y.shape[1:] == (3, 16, 16)
        assert torch.equal(x, y[..., offset::2, offset::2])


def test_bicubic_training_patches_are_the_same_area(tmp_path):
    task = build_task(config(tmp_path, task={"name": "image_sr", "augment": False}))
    torch.manual_seed(3)
    x, y = task.train_batch(0, torch.tensor([0, 2]))
    assert x.shape == (2, 3, 8, 8) and y.shape == (2, 3, 16, 16) and x.dtype == torch.float32
    for b, pos in enumerate([0, 2]):
        im = task.splits.train.images[int(task.clients[0].train[pos])]
        lr, hr = im.lr().float() / 255, im.hr().float() / 255
        h, w = lr.shape[-2:]
        hits = [(t, l) for t in range(h - 7) for l in range(w - 7) if torch.equal(lr[:, t : t + 8, l : l + 8], x[b])]
        assert hits
        t, l = hits[0]
        assert torch.equal(hr[:, 2 * t : 2 * t + 16, 2 * l : 2 * l + 16], y[b])


def test_batches_are_a_function_of_the_torch_seed(tmp_path):
    task = build_task(config(tmp_path))
    pos = torch.tensor([0, 1, 2])
    torch.manual_seed(5)
    a = task.train_batch(0, pos)
    torch.manual_seed(5)
    b = task.train_batch(0, pos)
    torch.manual_seed(6)
    c = task.train_batch(0, pos)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[1], c[1])


@pytest.mark.parametrize("loss", ["l1", "l2", "charbonnier"])
def test_losses(tmp_path, loss):
    task = build_task(config(tmp_path, task={"name": "image_sr", "loss": loss, "charbonnier_eps": 1e-3}))
    torch.manual_seed(0)
    out, gt = torch.rand(2, 3, 16, 16), torch.rand(2, 3, 16, 16)
    d = out - gt
    want = {"l1": d.abs().mean(), "l2": (d * d).mean(), "charbonnier": torch.sqrt(d * d + 1e-6).mean()}[loss]
    assert float(task.loss(out, gt)) == pytest.approx(float(want), rel=1e-6)
    with pytest.raises(ValueError, match="shape"):
        task.loss(out, gt[..., :8])


def test_tiled_evaluation_equals_whole_images(tmp_path):
    torch.manual_seed(0)
    model = TinySR(2, 4).eval()
    lr = torch.rand(1, 3, 23, 30)
    with torch.no_grad():
        whole = model(lr)
        tiled = tsr.tiled_forward(model, lr, 2, tile=8, overlap=2)
        cut = tsr.tiled_forward(model, lr, 2, tile=8, overlap=0)
    torch.testing.assert_close(tiled, whole, rtol=0, atol=1e-5)
    assert not torch.allclose(cut, whole, atol=1e-3)  # without context the tile seams differ
    base = build_task(config(tmp_path))
    tiles = build_task(config(tmp_path, task={"name": "image_sr", "eval_tile": 10, "eval_tile_overlap": 2}))
    for k, v in base.evaluate(model, "test", 1).items():
        assert tiles.evaluate(model, "test", 1)[k] == pytest.approx(v, abs=1e-6), k


def test_server_validation_carve_and_local_tests(tmp_path):
    cfg = config(tmp_path, validation={"source": "carve", "fraction": 0.25},
                 partition={"name": "iid", "num_clients": 3, "local_test_fraction": 0.5})
    task = build_task(cfg)
    pool = {im.name for im in task.splits.train.images}
    val = {im.name for im in task.eval_images("val")}
    assert val and not val & pool
    assert len(val) + len(pool) == 21  # 6 + 6 + 9 tiles
    assert task.data_description()["validation"]["size"] == len(val)
    state = task.eval_state(Bicubic(2), 0, 1)
    assert float(state.get("psnr.count")) == task.num_test_examples(0) > 0
    with pytest.raises(ValueError, match="no evaluation split 'test_nope'"):
        task.evaluate(Bicubic(2), "test_nope")


def test_matlab_bicubic_baseline_beats_nearest_on_every_test_set(tmp_path):
    task = build_task(config(tmp_path))
    bic, near = tsr.interpolation_baseline(task), tsr.interpolation_baseline(task, "nearest")
    assert set(bic) == set(near) == {f"{s}/{m}" for s in task.test_splits for m in task.metrics.compute(
        task.eval_state(Bicubic(2), "test", 1))}
    for split in task.test_splits:
        assert bic[f"{split}/psnr"] > near[f"{split}/psnr"]
