"""FedDrive's avg_last_100 (``eval.last_rounds``, ``eval.last_every``; ``fedsight.reporting.last_window``): the
evaluation rounds the authors' code picks, and the mean and population std of the metrics (not of the weights)
over them, as summary.md prints them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedsight.api import execute
from fedsight.config import validate
from fedsight.reporting.last_window import in_window, window_rounds

from helpers import tiny


def test_the_window_is_the_codes_condition_with_both_ends() -> None:
    """``(r + 1) >= num_rounds - 100 and (r + 1) % 5 == 0`` over r = 0..1599: rounds 1500..1600, 21 of them."""
    code = [r + 1 for r in range(1600) if (r + 1) >= 1600 - 100 and (r + 1) % 5 == 0]
    assert window_rounds(1600, 100, 5) == code and len(code) == 21 and code[0] == 1500
    assert window_rounds(1600, 0, 5) == [] and not in_window(1600, 1600, 0, 5)
    assert window_rounds(7, 100, 5) == [5]  # a run shorter than the window: every fifth round


def test_a_run_evaluates_in_the_window_and_summary_gives_mean_and_population_std(tmp_path) -> None:
    cfg = validate(tiny(**{"server.rounds": 7, "eval.every": 100, "eval.last_rounds": 3, "eval.last_every": 2}))
    out = execute(cfg, tmp_path / "run")
    rows = [json.loads(line) for line in (out.run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r["round"] for r in rows if "test/acc" in r]
    assert evaluated == [4, 6, 7]  # the window's 4 and 6, and the last round (eval.every = 100)
    acc = np.array([r["test/acc"] for r in rows if r.get("round") in (4, 6) and "test/acc" in r])
    summary = (out.run_dir / "summary.md").read_text()
    assert "## Last 3 rounds (FedDrive's avg_last_100)" in summary
    line = next(ln for ln in summary.splitlines() if ln.startswith("| test/acc |"))
    mean, std, n = (c.strip() for c in line.strip("|").split("|")[1:])
    assert float(mean) == pytest.approx(acc.mean(), rel=1e-3, abs=1e-4)
    assert float(std) == pytest.approx(acc.std(ddof=0), rel=1e-2, abs=1e-4) and n == "2"


def test_without_a_window_summary_has_no_such_section(tmp_path) -> None:
    out = execute(validate(tiny(**{"server.rounds": 2})), tmp_path / "run")
    assert "avg_last_100" not in (out.run_dir / "summary.md").read_text()
