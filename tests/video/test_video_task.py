"""The video SR task: training windows, whole-sequence evaluation, and a federated run from config."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from skimage.metrics import peak_signal_noise_ratio, structural_similarity
from torch import nn

from fedsight.api import build_task, execute
from fedsight.config import ConfigError, validate
from fedsight.tasks.video_sr import assemble_visuals

DATA = {
    "name": "synthetic_video", "sources": ["astronaut", "coffee", "chelsea", "rocket"], "test_sources": ["china"],
    "clips_per_source": 2, "test_clips_per_source": 2, "clip_length": 5, "frame_size": 48, "scale": 4,
    "num_frames": 3, "patch_size": 6,
}


def config(tmp_path, **over):
    raw = {
        "seed": 0,
        "run": {"name": "vsr", "output_dir": str(tmp_path), "checkpoint_keep": 1},
        "task": {"name": "video_sr"},
        "data": dict(DATA),
        "partition": {"name": "iid", "num_clients": 4, "local_test_fraction": 0.0},
        "model": {"name": "basicvsr", "channels": 6, "blocks": 1, "flow_channels": 4, "flow_levels": 2},
        "train": {"steps": 2, "batch_size": 2, "lr": 0.05},
        "server": {"rounds": 2, "clients_per_round": 2},
        "eval": {"every": 1},
    }
    raw.update(over)
    return validate(raw)


def test_federated_run_from_config(tmp_path):
    cfg = config(tmp_path, recipe={"weighting": "fedvsr", "components": [{"name": "dwt_loss", "lambda_hifr": 0.5}]})
    out = execute(cfg, tmp_path / "run")
    assert out.status == "complete"
    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "event" not in r]
    assert [r["round"] for r in rows] == [0, 1, 2]  # round 0: the initial model
    for key in ("test/psnr", "test/ssim", "test/psnr_rgb", "test/ssim_y", "train/loss", "fedvsr/exponent"):
        assert all(np.isfinite(r[key]) for r in rows if r["round"] or key.startswith("test/")), key
    # the logged test metrics are the final global model's, evaluated by the task on the test clips
    task = build_task(cfg)
    torch.manual_seed(0)
    model = task.build_model()
    model.load_state_dict(load_file(str(tmp_path / "run" / "model.safetensors")))
    final = task.evaluate(model, "test", 1)
    for key in ("psnr", "ssim", "psnr_rgb", "ssim_rgb", "loss"):
        assert rows[-1][f"test/{key}"] == pytest.approx(final[key], abs=1e-9), key
    assert rows[-1]["test/psnr"] == rows[-1]["test/psnr_y"]  # metric = "y" by default
    assert rows[1]["fedvsr/exponent"] == pytest.approx(0.5) and rows[2]["fedvsr/exponent"] == 0.0
    assert (tmp_path / "run" / "plots" / "visuals.png").stat().st_size > 1000
    # two runs' crops side by side
    cfg2 = config(tmp_path, seed=1)
    execute(cfg2, tmp_path / "run2")
    path = assemble_visuals({"fedvsr": tmp_path / "run", "fedavg": tmp_path / "run2"}, tmp_path / "side.png")
    assert path.stat().st_size > 1000


def test_family_mismatch_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="video_sr"):
        config(tmp_path, model={"name": "cnn"})


def test_training_windows(tmp_path):
    cfg = config(tmp_path, task={"name": "video_sr", "augment": False})
    task = build_task(cfg)
    clips = task.splits.train.clips
    assert sum(task.num_train_examples(k) for k in range(4)) == len(clips) * (5 - 3 + 1)
    torch.manual_seed(3)
    x, y = task.train_batch(0, torch.tensor([0, 2]))
    torch.manual_seed(3)
    x2, y2 = task.train_batch(0, torch.tensor([0, 2]))
    assert torch.equal(x, x2) and torch.equal(y, y2)  # a function of torch's (engine-seeded) generator
    assert x.shape == (2, 3, 3, 6, 6) and y.shape == (2, 3, 3, 24, 24)
    # the HR patch is the scale-times larger region of the LR patch: locate the LR patch, check the HR one
    ci, start = task.client_rows(0)[0].tolist()
    lr_full, hr_full = clips[ci].lr(start, 3).float() / 255, clips[ci].hr(start, 3).float() / 255
    hits = [(t, l) for t in range(12 - 6 + 1) for l in range(12 - 6 + 1) if torch.equal(lr_full[..., t:t + 6, l:l + 6], x[0])]
    assert hits
    t, l = hits[0]
    assert torch.equal(hr_full[..., 4 * t:4 * t + 24, 4 * l:4 * l + 24], y[0])


class _Bicubic(nn.Module):
    def forward(self, x):
        b, t, c, h, w = x.shape
        return F.interpolate(x.reshape(b * t, c, h, w), scale_factor=4, mode="bicubic", align_corners=False).view(b, t, c, 4 * h, 4 * w)


def test_evaluation_protocol_matches_scikit_image(tmp_path):
    """Per frame (8-bit outputs, Y and RGB, border crop), then mean per clip, then mean over clips."""
    cfg = config(tmp_path, task={"name": "video_sr", "crop_border": 2})
    task = build_task(cfg)
    got = task.evaluate(_Bicubic(), "test", 1)
    per_clip = {"psnr_y": [], "ssim_y": [], "psnr_rgb": [], "ssim_rgb": []}
    for clip in task.splits.test.clips:
        lr = clip.lr(0, len(clip)).float() / 255
        out = _Bicubic()(lr.unsqueeze(0))[0]
        out = (out.clamp(0, 1) * 255).round().double().permute(0, 2, 3, 1).numpy()[:, 2:-2, 2:-2]
        gt = clip.hr(0, len(clip)).double().permute(0, 2, 3, 1).numpy()[:, 2:-2, 2:-2]
        yc = np.array([65.481, 128.553, 24.966]) / 255.0
        frames = {k: [] for k in per_clip}
        for o, g in zip(out, gt):
            oy, gy = 16 + o @ yc, 16 + g @ yc
            frames["psnr_y"].append(peak_signal_noise_ratio(gy, oy, data_range=255))
            frames["ssim_y"].append(structural_similarity(gy, oy, data_range=255, gaussian_weights=True, sigma=1.5, use_sample_covariance=False))
            frames["psnr_rgb"].append(peak_signal_noise_ratio(g, o, data_range=255))
            frames["ssim_rgb"].append(structural_similarity(g, o, data_range=255, gaussian_weights=True, sigma=1.5,
                                                            use_sample_covariance=False, channel_axis=-1))
        for k in per_clip:
            per_clip[k].append(np.mean(frames[k]))
    for k, v in per_clip.items():
        assert got[k] == pytest.approx(np.mean(v), abs=1e-4), k
    assert got["psnr"] == got["psnr_y"] and got["ssim"] == got["ssim_y"]  # metric = "y" by default


def test_local_test_clips_and_category_partition(tmp_path):
    cfg = config(tmp_path, partition={"name": "classes", "classes_per_client": 1, "num_clients": 4, "local_test_fraction": 0.5})
    task = build_task(cfg)
    labels = task.splits.train.labels
    for k in range(4):
        held = np.concatenate([task.clients[k].train, task.clients[k].test])
        assert len(set(labels[held])) == 1  # one source photo per client
        assert task.num_test_examples(k) == 1 and task.num_train_examples(k) == 3
    state = task.eval_state(_Bicubic(), 0, 1)
    assert float(state.get("psnr.count")) == 1.0 and np.isfinite(task.metrics.compute(state)["psnr"])
