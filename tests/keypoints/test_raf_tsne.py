"""examples/raf_tsne.py (RAF Figs. 11-12): last-block features of test crops at every resolution, their t-SNE and
the figure, on a tiny keypoint run."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

import fedsight
from fedsight.api import build_task
from fedsight.config import validate

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
LADDER = [[32, 24], [24, 16]]
SIZES = [(24, 16), (32, 24), (40, 32)]  # the ladder (lowest first) and an unseen size


def _raw(tmp_path: Path) -> dict:
    return {
        "seed": 0,
        "run": {"name": "kp", "output_dir": str(tmp_path), "checkpoint_keep": 0, "plots": False},
        "task": {"name": "keypoints", "ladder": LADDER, "eval_sizes": [list(s) for s in SIZES]},
        "data": {"name": "builtin_pose", "num_train": 8, "num_test": 7, "image_size": [64, 48]},
        "partition": {"name": "iid", "num_clients": 2, "local_test_fraction": 0.0},
        "model": {"name": "vitpose", "patch": 4, "dim": 16, "depth": 2, "heads": 2, "deconv_filters": 8},
        "train": {"steps": 1, "batch_size": 4, "lr": 0.001},
        "server": {"rounds": 1, "clients_per_round": 2},
        "eval": {"every": 1, "initial": False},
    }


@pytest.fixture
def tsne(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import raf_tsne

    return raf_tsne


def test_features_are_the_token_mean_of_the_last_block_at_every_size(tsne, tmp_path):
    task = build_task(validate(_raw(tmp_path)))
    torch.manual_seed(0)
    model = task.build_model().train()
    feats = tsne.last_block_features(model, task, SIZES, batch_size=3)  # 7 crops: batches of 3, 3, 1
    assert list(feats) == SIZES
    assert all(f.shape == (7, 16) for f in feats.values())
    assert model.training  # the model's mode is restored
    assert not model.backbone.blocks[-1]._forward_hooks  # and the hook removed
    # independently: the backbone without its final LayerNorm returns the last block's tokens as [B, D, h, w]
    bare = copy.deepcopy(model).eval()
    bare.backbone.norm = nn.Identity()
    data = next(iter(task.splits.tests.values()))
    for size in SIZES:
        x = torch.cat([x for x, _ in task.instance_batches(data, np.arange(7), size, 64)])
        with torch.no_grad():
            expect = bare.backbone(x).mean((2, 3))
        torch.testing.assert_close(torch.from_numpy(feats[size]), expect, rtol=1e-4, atol=1e-5)
    # features of different sizes differ (the crops are not the same pixels)
    assert not np.allclose(feats[SIZES[0]], feats[SIZES[-1]])
    with pytest.raises(ValueError, match="no transformer blocks"):
        tsne.last_block(nn.Sequential(nn.Conv2d(3, 3, 1)))


def test_embedding_and_silhouette(tsne):
    rng = np.random.default_rng(0)
    apart = {(8, 6): rng.normal(0, 0.1, (10, 4)), (16, 12): rng.normal(5, 0.1, (10, 4))}
    points, labels, sil = tsne.embed(apart, perplexity=30.0)
    assert points.shape == (20, 2) and labels.tolist() == [0] * 10 + [1] * 10
    assert sil > 0.9  # two separate clusters
    mixed = {(8, 6): rng.normal(0, 1, (10, 4)), (16, 12): rng.normal(0, 1, (10, 4))}
    assert abs(tsne.embed(mixed)[2]) < 0.2


def test_script_writes_the_figure_of_finished_runs(tsne, tmp_path, capsys):
    res = fedsight.run(_raw(tmp_path))
    assert res.status == "complete"
    out = tmp_path / "fig" / "tsne.png"
    assert tsne.main([str(res.run_dir), str(res.run_dir), "-o", str(out), "--perplexity", "5"]) == 0
    text = capsys.readouterr().out
    assert text.count("silhouette by resolution") == 2 and "(21 crops)" in text and str(out) in text
    with Image.open(out) as im:
        w, h = im.size
    assert w > 1.5 * h  # two panels side by side
    assert tsne.main([str(tmp_path / "nothing"), "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "nothing" in err and "model.safetensors" in err
    assert not (tmp_path / "x.png").exists()
