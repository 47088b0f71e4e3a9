"""Segmentation overlays carry a colour legend: the names of the classes shown, in their overlay colours."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fedsight.tasks.seg_visuals import CITYSCAPES_COLOURS, SegRow, palette, save_segmentation_visuals, segmentation_figure

from test_seg_task import make_set, make_task, split


def _legend(fig):
    (legend,) = fig.legends
    return [t.get_text() for t in legend.get_texts()], [tuple(np.round(np.asarray(p.get_facecolor()[:3]) * 255))
                                                        for p in legend.get_patches()]


def test_the_legend_names_the_classes_shown_in_their_colours():
    names = ["road", "sidewalk", "building", "sky"]
    colours = palette(names)
    img = np.zeros((4, 4, 3), np.uint8)
    rows = [SegRow("a", img, img, img, 0.5, frozenset({2, 0}), False),
            SegRow("b", img, img, img, 0.5, frozenset({3}), True)]
    texts, faces = _legend(segmentation_figure(rows, names, colours, "test: 2 images"))
    assert texts == ["road", "building", "sky", "ignored (not labelled)"]  # class order; sidewalk is not shown
    assert faces[:3] == [CITYSCAPES_COLOURS[n] for n in ("road", "building", "sky")]


class ConstantModel(nn.Module):
    """Predicts class ``c`` everywhere."""

    def __init__(self, c: int, classes: int):
        super().__init__()
        self.c, self.classes = c, classes
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        out = torch.zeros(x.shape[0], self.classes, *x.shape[-2:]) + 0 * self.w
        out[:, self.c] = 1.0
        return out


def test_a_runs_visuals_legend_lists_ground_truth_and_predicted_classes(tmp_path, monkeypatch):
    train = make_set([(8, 8)] * 4, classes=2, seed=0)  # ground truth uses classes 0 and 1 (and ignored pixels)
    task = make_task(train, split([0, 1], [2, 3]), classes=4, visual_images=2)
    import fedsight.tasks.seg_visuals as sv

    figs = []
    monkeypatch.setattr(sv, "_save_png", lambda fig, path: figs.append(fig))
    save_segmentation_visuals(task, ConstantModel(3, 4), tmp_path / "plots" / "visuals.png")
    texts, _ = _legend(figs[0])
    assert texts == ["c0", "c1", "c3", "ignored (not labelled)"]  # c2: in neither ground truth nor prediction
