"""Video SR crops: LR | bicubic | ours | ground truth with PSNR on the reported channel, and the side-by-side
figure of several runs with the bicubic column."""

from __future__ import annotations

import numpy as np
import torch

import fedsight.tasks.video_sr as tvsr
from fedsight.api import build_task

from test_video_task import config


def test_video_sr_visuals_and_side_by_side_have_a_bicubic_column(tmp_path, monkeypatch):
    task = build_task(config(tmp_path, task={"name": "video_sr", "metric": "rgb", "visual_clips": 1}))

    class Up(torch.nn.Module):
        def forward(self, lrs):
            b, t, c, h, w = lrs.shape
            up = torch.nn.functional.interpolate(lrs.reshape(b * t, c, h, w), scale_factor=4, mode="bicubic",
                                                 align_corners=False)
            return up.view(b, t, c, h * 4, w * 4)

    drawn = []
    monkeypatch.setattr(tvsr, "_plot_rows", lambda rows, path, **kw: drawn.append((rows, kw)))
    run = tmp_path / "run"
    task.save_visuals(Up(), run / "plots" / "visuals.png")
    (rows, kw), = drawn
    assert kw["channel"] == "rgb" and kw["ref_col"] == 3
    panels = dict(rows[0][1])
    assert list(panels) == ["LR input (x4 nearest)", "bicubic", "ours", "ground truth"]
    assert np.array_equal(panels["bicubic"], panels["ours"])  # the model is bicubic upsampling itself
    tvsr.assemble_visuals({"a": run, "b": run}, tmp_path / "side.png")
    rows, kw = drawn[1]
    assert [t for t, _ in rows[0][1]] == ["LR (nearest)", "bicubic", "a", "b", "ground truth"] and kw["ref_col"] == 4
