"""One run's curves and summary read as a paper's figure would: whole-number round ticks, units (MB, GFLOP, dB, %),
no series drawn twice, constant bookkeeping said in words, upload and download told apart (issue 45)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedsight.reporting import write_summary
from fedsight.reporting.plots import _panel_groups, _style_axes, line_style
from fedsight.reporting.run_panels import plan_panels
from fedsight.reporting.runs_view import _Series
from fedsight.reporting.units import human, metric_unit

DIRECTIONS = {"test/psnr": True, "test/psnr_y": True, "test/psnr_rgb": True, "test/loss": False, "train/*": False,
              "cost/*": False, "time/*": False, "clients/*": None}


def _series(rows: list[dict]) -> dict[str, _Series]:
    keys = [k for k in rows[0] if k != "round"]
    return {k: _Series(np.array([r["round"] for r in rows if k in r]), np.array([r[k] for r in rows if k in r], float))
            for k in keys}


def sr_rows(n: int = 3) -> list[dict]:
    out = []
    for r in range(1, n + 1):
        out.append({"round": r, "test/psnr": 25.0 + r, "test/psnr_y": 25.0 + r, "test/psnr_rgb": 23.0 + r,
                    "test/loss": 0.1 / r, "clients/sampled": 10, "cost/up_bytes": 892_000.0,
                    "cost/down_bytes": 892_000.0, "cost/total_up_bytes": 892_000.0 * r,
                    "cost/total_down_bytes": 892_000.0 * r, "cost/flops": 3.15e9, "train/loss": 1.0 / r,
                    "time/round_s": 2.0 + r})
    return out


def _plan(rows, task="image_sr", primary="test/psnr"):
    series = _series(rows)
    direction = lambda k: DIRECTIONS.get(k, DIRECTIONS.get(k.split("/")[0] + "/*"))  # noqa: E731
    return plan_panels(list(series), series, direction, lambda ks: _panel_groups(ks, series, direction),
                       task=task, primary=primary, style=line_style)


def test_a_series_equal_to_its_channel_is_drawn_once_and_legends_name_the_channel():
    panels, notes = _plan(sr_rows())
    labels = [ln.label for p in panels for ln in p.lines]
    assert "test/psnr" not in labels and "test/psnr_y (Y)" in labels and "test/psnr_rgb (RGB)" in labels
    assert any("test/psnr = test/psnr_y" in n for n in notes)
    psnr = next(p for p in panels if "test/psnr_y (Y)" in [ln.label for ln in p.lines])
    assert psnr.ylabel == "psnr (dB)"
    # a psnr that differs from both channels (another metric setting) is drawn
    rows = sr_rows()
    rows[-1]["test/psnr"] += 1
    labels = [ln.label for p in _plan(rows)[0] for ln in p.lines]
    assert "test/psnr" in labels


def test_constant_bookkeeping_is_named_in_human_units_not_drawn():
    panels, notes = _plan(sr_rows())
    drawn = {ln.label for p in panels for ln in p.lines}
    assert not drawn & {"clients/sampled", "cost/up_bytes", "cost/down_bytes", "cost/flops"}
    (note,) = [n for n in notes if n.startswith("constant every round")]
    assert "clients/sampled = 10" in note and "cost/up_bytes = 892 kB" in note and "cost/flops = 3.15 GFLOP" in note
    # a flat evaluation curve is a result: drawn
    rows = sr_rows()
    for r in rows:
        r["test/loss"] = 0.5
    assert "test/loss" in {ln.label for p in _plan(rows)[0] for ln in p.lines}


def test_upload_and_download_differ_in_style_and_the_title_says_when_they_are_equal():
    panels, _ = _plan(sr_rows())
    (total,) = [p for p in panels if p.title.startswith("Cumulative communication")]
    assert "up = down" in total.title and total.ylabel == "MB"
    up, down = (next(ln for ln in total.lines if w in ln.label) for w in ("up", "down"))
    assert (up.style["linestyle"], up.style["marker"]) != (down.style["linestyle"], down.style["marker"])
    assert up.y[-1] == pytest.approx(2.676)  # MB
    rows = sr_rows()
    rows[-1]["cost/total_down_bytes"] *= 2
    (total,) = [p for p in _plan(rows)[0] if p.title.startswith("Cumulative communication")]
    assert "up = down" not in total.title


def test_round_axes_show_whole_numbers_even_for_one_evaluated_round():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2)
    axes[0].plot([2], [25.3], marker="o")
    axes[1].plot(np.arange(1, 101), np.ones(100))
    for ax in axes:
        _style_axes(ax, "t", "y")
    fig.canvas.draw()
    for ax in axes:
        lo, hi = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
    plt.close(fig)


def test_units():
    assert human(2.497e9, "B") == "2.50 GB" and human(18.91e9, "FLOP") == "18.9 GFLOP" and human(75, "s") == "1m 15s"
    assert metric_unit("test_96x72/pckh", "keypoints") == "%" and metric_unit("test/pckh", "classification") == ""
    assert metric_unit("local/wma", "keypoints", "test/pckh") == "%" and metric_unit("local/wma", "image_sr", "test/psnr") == "dB"
    assert metric_unit("cost/total_up_bytes") == "B" and metric_unit("time/round_s") == "s"


def test_summary_gives_human_units_and_names_what_psnr_repeats(tmp_path: Path):
    d = tmp_path / "run"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"seed": 0, "run": {"name": "sr"}, "task": {"name": "image_sr"}}))
    (d / "run.json").write_text(json.dumps({"format": 1, "primary": "test/psnr", "metrics": DIRECTIONS, "sessions": []}))
    rows = sr_rows()
    rows[-1]["cost/total_up_bytes"] = 2.497e9
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    text = write_summary(d, plot=True).read_text()
    assert "e+0" not in text
    assert "| cost/total_up_bytes ↓ | 2.50 GB |" in text and "| cost/flops ↓ | 3.15 GFLOP |" in text
    assert "| test/psnr (dB) ↑, = test/psnr_y | 28 |" in text and "| test/psnr_rgb (dB, RGB) ↑ |" in text
    assert (d / "plots" / "curves.png").stat().st_size > 5000
