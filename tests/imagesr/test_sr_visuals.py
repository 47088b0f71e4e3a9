"""SR and VSR crops as paper figures: LR | bicubic | ours | ground truth, each output titled with its PSNR in dB on
the reported channel (Y or RGB), the figure's title naming the channel."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fedsight.tasks.image_sr as tsr
from fedsight.api import build_task
from fedsight.functional.resize import imresize
from fedsight.tasks.sr_visuals import _crop_psnr, _read_png, sr_figure

from test_image_sr_task import Bicubic, config  # noqa: F401  (registers tiny_sr_test)


def _rows(seed=0):
    g = np.random.default_rng(seed)
    gt = g.integers(0, 256, (16, 16, 3), dtype=np.uint8)
    noisy = np.clip(gt.astype(int) + g.integers(-20, 21, gt.shape), 0, 255).astype(np.uint8)
    return gt, noisy, [("a", [("LR", noisy), ("bicubic", noisy), ("ours", gt), ("ground truth", gt)])]


@pytest.mark.parametrize("channel, name", [("y", "Y"), ("rgb", "RGB")])
def test_every_output_panel_gives_its_psnr_in_db_on_the_named_channel(channel, name):
    gt, noisy, rows = _rows()
    fig = sr_figure(rows, ref_col=3, channel=channel)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles[0] == "LR" and titles[3] == "ground truth"  # the input and the reference carry no PSNR
    assert titles[1] == f"bicubic\n{_crop_psnr(noisy, gt, channel):.2f} dB ({name})"
    assert titles[2] == f"ours\n{_crop_psnr(gt, gt, channel):.2f} dB ({name})"  # inf: identical crops
    assert ("luma Y" if channel == "y" else "on RGB") in fig._suptitle.get_text()
    assert _crop_psnr(noisy, gt, "y") != _crop_psnr(noisy, gt, "rgb")


@pytest.mark.parametrize("metric", ["y", "rgb"])
def test_image_sr_visuals_have_a_bicubic_column_of_matlab_imresize(tmp_path, monkeypatch, metric):
    task = build_task(config(tmp_path, task={"name": "image_sr", "metric": metric, "visual_images": 2}))
    drawn = {}
    monkeypatch.setattr(tsr, "_plot_rows", lambda rows, path, **kw: drawn.update(rows=rows, **kw))
    task.save_visuals(Bicubic(2), tmp_path / "plots" / "visuals.png")
    assert drawn["channel"] == metric and drawn["ref_col"] == 3
    for label, panels in drawn["rows"]:
        assert [t for t, _ in panels] == ["LR input (x2 nearest)", "bicubic", "ours", "ground truth"]
    # the bicubic column is MATLAB's imresize of the whole LR image, cropped where the others are
    import json

    meta = json.loads((tmp_path / "plots" / "visuals.json").read_text())[0]
    im = task.eval_images(meta["split"])[0]
    _, lr = im.pair()
    up = imresize(lr.unsqueeze(0).to(torch.float64) / 255, 2.0)[0].clamp(0, 1)
    t, l, s = meta["top"], meta["left"], meta["size"]
    want = (up[:, t:t + s, l:l + s] * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    got = _read_png(tmp_path / "plots" / "visuals" / "image0_bicubic.png")
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 1  # float32 vs float64 rounding
