"""The keypoint task's pictures: skeleton overlays at every rung (plots/visuals.png) and the per-run curves of a run
at several input sizes (one panel per metric, PCKh against input size, PCKh in percent)."""

from __future__ import annotations

import matplotlib.colors
import numpy as np
import pytest
import torch
from torch import nn

from fedsight.api import build_task, execute
from fedsight.config import validate
from fedsight.plugins import load_builtin
from fedsight.reporting.plots import _panel_groups, line_style
from fedsight.reporting.partition import read_partition
from fedsight.reporting.run_panels import plan_panels
from fedsight.reporting.runs_view import _display_order, _is_headline, _Run
from fedsight.tasks.keypoint_visuals import GT_COLOUR, PRED_COLOUR, keypoint_figure, person_score

load_builtin()

LADDER = [[64, 48], [48, 36], [32, 24]]
MODEL = {"name": "vitpose", "patch": 4, "dim": 16, "depth": 1, "heads": 2, "deconv_filters": 8}


def raw_config(tmp_path, **task):
    return {
        "seed": 0,
        "run": {"name": "kp", "output_dir": str(tmp_path), "checkpoint_keep": 0},
        "task": {"name": "keypoints", "ladder": LADDER, **task},
        "data": {"name": "builtin_pose", "num_train": 12, "num_test": 4, "image_size": [96, 72]},
        "partition": {"name": "iid", "num_clients": 3, "local_test_fraction": 0.0},
        "model": dict(MODEL),
        "train": {"steps": 1, "batch_size": 4, "lr": 0.001},
        "server": {"rounds": 2, "clients_per_round": 3},
        "eval": {"every": 1, "initial": False},
    }


class Oracle(nn.Module):
    """Returns the ground-truth heatmaps of the persons the figure shows, whatever the input size (found by the
    input's shape): a model whose every joint is right."""

    def __init__(self, task, picks):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))
        data = next(iter(task.splits.tests.values()))
        self.by_size = {tuple(s): next(task.instance_batches(data, np.asarray(picks), tuple(s), len(picks)))[1]["heatmaps"]
                        for s in task.ladder}

    def forward(self, x):
        return self.by_size[tuple(x.shape[-2:])] + 0 * self.w


def _titles(fig):
    return [ax.get_title() for ax in fig.axes if ax.get_title()]


def test_skeleton_overlays_at_every_rung_score_a_perfect_model_100(tmp_path):
    task = build_task(validate(raw_config(tmp_path, flip_test=False, visual_instances=2)))
    fig = keypoint_figure(task, Oracle(task, [0, 3]))
    titles = _titles(fig)
    assert len(titles) == 2 * 3  # 2 persons x 3 rungs
    for (h, w), rung in zip(LADDER, range(3)):
        assert sum(t.startswith(f"{h}x{w} (rung {rung}), PCKh@0.5") for t in titles) == 2
    # at the top rung the decoded joints are exact (at lower rungs the heatmap grid, 8x6 at 32x24, rounds them)
    assert all(t.endswith(" 100%") for t in titles if t.startswith("64x48")), titles
    assert all(0 <= float(t.rsplit(" ", 1)[1].rstrip("%")) <= 100 for t in titles)
    # every panel draws both skeletons: ground truth solid green, prediction dashed red
    ax = fig.axes[0]
    colours = {(line.get_color(), line.get_linestyle()) for line in ax.get_lines()}
    assert (GT_COLOUR, "-") in colours and (PRED_COLOUR, "--") in colours
    # the crop is shown at the rung's own resolution (a low rung is a small image, enlarged)
    shapes = [ax.get_images()[0].get_array().shape[:2] for ax in fig.axes if ax.get_images()]
    assert shapes[:3] == [tuple(s) for s in LADDER]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["ground truth", "prediction"]


class Peak(nn.Module):
    """Every joint's heatmap peaks at heatmap pixel (row 2, column 3), at any input size."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        out = torch.zeros(x.shape[0], 16, x.shape[-2] // 4, x.shape[-1] // 4) + 0 * self.w
        out[..., 2, 3] = 1.0
        return out


def test_the_red_skeleton_is_the_prediction_and_the_green_one_the_truth(tmp_path):
    task = build_task(validate(raw_config(tmp_path, flip_test=False, refine=False, visual_instances=1)))
    fig = keypoint_figure(task, Peak())
    for ax in fig.axes:
        dots = {tuple(np.round(c.get_facecolor()[0][:3], 3)): c.get_offsets() for c in ax.collections}
        red = np.asarray(dots[tuple(np.round(matplotlib.colors.to_rgb(PRED_COLOUR), 3))])
        green = np.asarray(dots[tuple(np.round(matplotlib.colors.to_rgb(GT_COLOUR), 3))])
        assert np.allclose(red, [3 * 4, 2 * 4])  # every predicted joint at the peak, in input pixels (stride 4)
        assert green.std(0).min() > 1  # the true joints are spread over the person


def test_person_score_counts_labelled_joints_within_the_threshold():
    gt = np.array([[0, 0, 2], [10, 0, 2], [0, 10, 0], [5, 5, 1]], dtype=np.float32)
    pred = np.array([[1, 0], [10, 9], [50, 50], [5, 5]], dtype=np.float32)
    assert person_score(pred, gt, 10.0, 0.5) == pytest.approx(100 * 2 / 3)  # joint 2 unlabelled, joint 1 is 9 px off (> 5)
    assert person_score(pred, gt, 10.0, 0.5, exclude=(1,)) == 100.0
    assert np.isnan(person_score(pred, gt, float("nan"), 0.5))


def test_no_persons_no_figure(tmp_path):
    task = build_task(validate(raw_config(tmp_path, visual_instances=0)))
    assert keypoint_figure(task, task.build_model()) is None


def test_a_run_writes_overlays_and_curves_with_a_panel_per_metric(tmp_path):
    raw = raw_config(tmp_path, visual_instances=1)
    out = execute(validate(raw), tmp_path / "run")
    assert out.status == "complete"
    plots = tmp_path / "run" / "plots"
    assert (plots / "visuals.png").stat().st_size > 5000 and (plots / "curves.png").stat().st_size > 5000
    run = _Run.load(tmp_path / "run")
    keys = _display_order([k for k in run.series if _is_headline(k)])
    panels, notes = plan_panels(keys, run.series, run.direction, lambda ks: _panel_groups(ks, run.series, run.direction),
                                task="keypoints", primary=run.primary, partition=read_partition(run.path),
                                style=line_style)
    titles = [p.title for p in panels]
    # the primary against input size first, smallest size left, the ladder's rungs marked with their clients
    first = panels[0]
    assert first.x == "size" and first.title.startswith("test/pckh against input size")
    assert first.ylabel == "pckh (%)" and first.xticks[0] == "32x24" and first.xticks[-1] == "96x72"
    assert sorted(s[2] for s in first.spans) == ["rung 0: client 0", "rung 1: client 1", "rung 2: client 2"]
    # one panel per metric with a line per input size (5 sizes: the ladder + 2 unseen), not a panel per size
    pckh = next(p for p in panels if p.title.startswith("test/pckh (%) by input size"))
    assert [ln.label for ln in pckh.lines] == ["96x72 (unseen)", "80x60 (unseen)", "64x48 (rung 0)", "48x36 (rung 1)",
                                               "32x24 (rung 2)"]
    assert not any(t.startswith("Test (48x36)") for t in titles)
    assert len(panels) <= 12, titles
    # the clients panel is constant: named in the note, not drawn
    assert not any("Clients" in t for t in titles)
    assert any("clients/sampled = 3" in n for n in notes)
