"""Live progress (issue 45): a phase while no round is recorded ("loading data", ...), a bar and times that stay whole
at 80 columns once metrics appear (metrics on a second line), "run k of N" in a sweep."""

from __future__ import annotations

import io
import json
import re

import tomli_w
from rich.console import Console, Group
from typer.testing import CliRunner

from fedsight.api import execute
from fedsight.cli import app
from fedsight.config import validate

from helpers import tiny

KEYS = [("test/acc", "acc"), ("local/wma", "wma"), ("test/loss", "loss"), ("train/loss", "train")]
ROW = {"clients/aggregated": 3, "test/acc": 0.81234, "local/wma": 0.80111, "test/loss": 0.51234, "train/loss": 0.44}


def _frame(progress, width=80) -> list[str]:
    """What the display shows now, at ``width`` columns on a terminal."""
    con = Console(record=True, width=width, force_terminal=True, file=io.StringIO())
    con.print(Group(*progress.get_renderables()))
    return con.export_text().splitlines()


def test_bar_and_times_stay_whole_at_80_columns_with_the_metrics_and_phase_below():
    from fedsight.live import RunView, make_progress

    con = Console(width=80, force_terminal=True, file=io.StringIO())
    progress = make_progress(con)
    view = RunView(progress, print, "run 2/4 fedavg-with-a-long-variant-name alpha=0.05 seed 1", 100, KEYS)
    view.phase("loading data")
    first = _frame(progress)
    assert first[1].strip() == "loading data", first
    for r in range(1, 13):
        view.round(r, {"round": r, **ROW})
    line1, line2 = _frame(progress)
    assert len(line1) <= 80 and line1.count("━") + line1.count("╸") + line1.count("╺") >= 20, line1  # the whole bar
    assert re.search(r" 12/100 +\d+:\d\d:\d\d +(\d+:\d\d:\d\d|-:--:--)$", line1), line1  # times not cut
    assert line1.startswith("run 2/4 ") and "seed 1" in line1  # cut in the middle: both ends stay
    assert line2.startswith("  round 13: training  |  round 12: 3 clients  acc 0.8123  wma 0.8011"), line2
    assert len(line2) <= 80


def test_execute_reports_its_phases_in_order(tmp_path):
    """A new run stopped after round 1, then resumed: each says what it does before its first round is recorded."""
    cfg = validate(tiny(**{"server.rounds": 2, "eval.initial": True}))
    phases: list[str] = []
    rounds: list[int] = []
    execute(cfg, tmp_path / "r", stop_after=1, on_phase=phases.append, on_round=lambda r, row: rounds.append(r))
    assert phases == ["loading data", "building the model", "round 0: evaluating the initial model",
                      "writing the model"]
    assert rounds == [0, 1]
    resumed: list[str] = []
    execute(cfg, tmp_path / "r", on_phase=resumed.append)
    assert resumed == ["loading data", "building the model", "round 2: training", "writing the model, plots and summary"]


def test_a_sweep_says_run_k_of_n_and_its_phases_off_a_terminal(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    raw = tiny(**{"server.rounds": 1})
    raw["sweep"] = {"seeds": [0, 1]}
    (tmp_path / "c.toml").write_text(tomli_w.dumps(raw))
    res = CliRunner().invoke(app, ["run", "c.toml"])  # no terminal: whole lines
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    for k, seed in ((1, 0), (2, 1)):
        label = f"run {k}/2 tiny seed {seed}"
        assert [x for x in lines if x.startswith(label + ":")] == [
            f"{label}: loading data", f"{label}: building the model", f"{label}: writing the model, plots and summary"]
        assert any(x.startswith(f"{label} round 1/1  3 clients  acc ") for x in lines), lines


def test_a_run_on_a_terminal_shows_the_bar_and_the_last_round(tmp_path, monkeypatch):
    from fedsight import cli_common

    monkeypatch.chdir(tmp_path)
    raw = tiny(**{"server.rounds": 2, "eval.every": 1})
    raw["sweep"] = {"seeds": [0, 1]}
    (tmp_path / "c.toml").write_text(tomli_w.dumps(raw))
    con = Console(width=80, force_terminal=True, record=True, file=io.StringIO())
    monkeypatch.setattr(cli_common, "console", con)
    res = CliRunner().invoke(app, ["run", "c.toml"])
    assert res.exit_code == 0, res.output
    text = con.export_text()
    acc = json.loads((tmp_path / "runs/tiny/seed1/metrics.jsonl").read_text().splitlines()[-1])["test/acc"]
    assert re.search(r"run 2/2 tiny seed 1 +━{20} +2/2 +\d:\d\d:\d\d +\d:\d\d:\d\d\n", text), text
    assert f"  complete  |  round 2: 3 clients  acc {acc:.4f}" in text  # the last frame: complete, not a phase
