"""`fedsight partition` (issue 45): the heatmap's title is never cut at the figure's edges, the server validation
set prints as a readable line, not a Python dict (the sweep's shared heatmaps: tests/test_cli_sweep.py)."""

from __future__ import annotations

import numpy as np
import tomli_w
from typer.testing import CliRunner

from fedsight.cli import app
from fedsight.reporting import plot_partition_heatmap
from fedsight.reporting.partition import describe_split

from helpers import tiny


def test_a_long_heatmap_title_wraps_inside_the_figure(tmp_path):
    """The title row's outermost pixel columns stay background: a title wider than the figure ran off both edges."""
    from matplotlib.image import imread

    title = ("digits / dirichlet (fedavg/alpha=0.05, fedvg/alpha=0.05, fedprox/alpha=0.05, fedprox_fedvg/alpha=0.05, "
             "scaffold/alpha=0.05)")
    plot_partition_heatmap(np.arange(40).reshape(4, 10), tmp_path / "h.png", title=title)
    img = imread(tmp_path / "h.png")[..., :3]
    top = img[: img.shape[0] // 8]  # the title's rows
    assert (top[:, :4] > 0.95).all() and (top[:, -4:] > 0.95).all()  # no text at the left or right edge
    assert (top < 0.5).any()  # and there is a title


def test_the_validation_set_prints_as_a_readable_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    raw = tiny(**{"validation": {"source": "carve", "fraction": 0.1, "stratified": True}})
    (tmp_path / "c.toml").write_text(tomli_w.dumps(raw))
    res = CliRunner().invoke(app, ["partition", "c.toml", "--out", "p.png"])
    assert res.exit_code == 0, res.output
    [line] = [x for x in res.output.splitlines() if x.startswith("server validation set:")]
    assert "{" not in line and "'" not in line, line
    assert " examples, carved from the training pool; per class 0: " in line and ", 9: " in line, line


def test_describe_split_names_its_extras():
    split = {"source": "dataset", "size": 30, "class_counts": [10, 20], "class_names": ["cat", "dog"],
             "imbalance": 0.5}
    assert describe_split(split) == "30 examples, from another dataset (imbalance 0.5); per class cat: 10, dog: 20"
    assert describe_split({**split, "imbalance": None, "source": "carve"}) == \
        "30 examples, carved from the training pool; per class cat: 10, dog: 20"
