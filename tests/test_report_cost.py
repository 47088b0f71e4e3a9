"""Cost figures and cost to a target (issue 47; thesis Figs. 3.10-3.13, Tables 4.7-4.10): the first round a run
reaches a target and the cumulative bytes and client FLOPs spent by then, checked against hand-written metric
lines; the seeds' mean and 95% interval against scipy; "not reached" instead of a number; the report's table and
figure; and a bad --target refused in one line with nothing written."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from scipy import stats
from typer.testing import CliRunner

from fedsight.cli import app
from fedsight.errors import ConfigError
from fedsight.reporting import report
from fedsight.reporting.cost_target import TargetRow, parse_targets, reach
from fedsight.reporting.runs_view import _Run

DIRECTIONS = {"test/acc": True, "test/loss": False, "cost/*": False, "clients/*": None}
runner = CliRunner()


def write_run(root: Path, name: str, seed: int, accs: list[float], *, up: float = 100.0, down: float = 50.0,
              flops: float = 1e6, clients: int = 10, every: int = 1) -> Path:
    """A run of len(accs) rounds that spends ``up``/``down`` bytes and ``flops`` a round, evaluated every
    ``every`` rounds (test/acc = accs[r - 1], test/loss = 1 - acc)."""
    d = root / "runs" / name / f"seed{seed}"
    d.mkdir(parents=True)
    cfg = {"seed": seed, "run": {"name": name}, "task": {"name": "classification"}, "data": {"name": "digits"},
           "partition": {"name": "dirichlet", "num_clients": clients}, "model": {"name": "cnn"},
           "train": {"lr": sum(map(ord, name)) / 1000}}
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "run.json").write_text(json.dumps({"format": 1, "primary": "test/acc", "metrics": DIRECTIONS}))
    rows = []
    for r, acc in enumerate(accs, start=1):
        row = {"round": r, "stage": "fed", "clients/sampled": 3, "cost/total_up_bytes": up * r,
               "cost/total_down_bytes": down * r, "cost/total_flops": flops * r}
        if r % every == 0:
            row.update({"test/acc": acc, "test/loss": 1 - acc})
        rows.append(row)
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in rows) + "\n")
    return d


def test_reach_is_the_first_evaluated_round_at_the_target_with_the_costs_spent_by_then(tmp_path: Path) -> None:
    run = _Run.load(write_run(tmp_path, "a", 0, [0.2, 0.5, 0.7, 0.6, 0.9], up=100, down=50, flops=2e6, clients=4))
    got = reach(run, "test/acc", 0.7, True)
    assert got is not None and got.round == 3  # the first round >= 0.7, not the best (5) nor the last
    assert got.bytes == 3 * (100 + 50) and got.flops == 3 * 2e6 and got.flops_per_client == 3 * 2e6 / 4
    assert reach(run, "test/acc", 0.5, True).round == 2  # equal to the target reaches it
    assert reach(run, "test/acc", 0.95, True) is None
    # lower is better: test/loss = 1 - acc reaches 0.35 at round 3 (0.3 <= 0.35)
    assert reach(run, "test/loss", 0.35, False).round == 3
    # evaluated every 2 rounds: round 2 (0.5) and 4 (0.6); 0.55 is first reached at round 4
    sparse = _Run.load(write_run(tmp_path, "b", 0, [0.9, 0.5, 0.9, 0.6], every=2))
    assert reach(sparse, "test/acc", 0.55, True).round == 4 and reach(sparse, "test/acc", 0.55, True).bytes == 4 * 150


def test_a_nan_evaluation_never_reaches_and_an_initial_evaluation_costs_nothing(tmp_path: Path) -> None:
    d = write_run(tmp_path, "a", 0, [0.3, 0.8])
    lines = d.joinpath("metrics.jsonl").read_text().splitlines()
    first = json.loads(lines[0]) | {"test/acc": float("nan")}
    lines = [json.dumps({"round": 0, "stage": "fed", "test/acc": 0.75}), json.dumps(first), *lines[1:]]
    d.joinpath("metrics.jsonl").write_text("\n".join(lines) + "\n")
    run = _Run.load(d)
    zero = reach(run, "test/acc", 0.7, True)
    assert zero.round == 0 and zero.bytes == 0 and zero.flops == 0
    assert reach(run, "test/acc", 0.79, True).round == 2  # NaN at round 1 does not count as reached


def test_group_mean_and_interval_match_scipy_and_a_missed_seed_gives_no_number(tmp_path: Path) -> None:
    runs = [_Run.load(write_run(tmp_path, "m", s, accs)) for s, accs in
            enumerate([[0.1, 0.8], [0.1, 0.2, 0.9], [0.1, 0.2, 0.3, 0.95]])]
    row = TargetRow("m", "test/acc", 0.75, True, tuple(reach(r, "test/acc", 0.75, True) for r in runs))
    mean, (lo, hi) = row.stat("round")
    ref = stats.t.interval(0.95, 2, loc=3.0, scale=stats.sem([2, 3, 4]))
    assert mean == 3.0 and math.isclose(lo, ref[0]) and math.isclose(hi, ref[1])
    b_mean, _ = row.stat("bytes")
    assert b_mean == 3.0 * 150
    assert row.cells()[:2] == ["3/3", f"3.0 [{ref[0]:.1f}, {ref[1]:.1f}]"]
    missed = TargetRow("m", "test/acc", 0.85, True, tuple(reach(r, "test/acc", 0.85, True) for r in runs))
    assert missed.reached == 2 and missed.stat("round") is None
    assert missed.cells() == ["2/3", "not reached by 1 of 3 seeds", "—", "—", "—"]
    one = TargetRow("m", "test/acc", 0.85, True, (reach(runs[1], "test/acc", 0.85, True),))
    assert one.cells()[1] == "3.0" and one.cells()[2] == "450 B"  # one seed: no interval


def test_report_tabulates_targets_and_draws_metric_against_cost(tmp_path: Path) -> None:
    dirs = [write_run(tmp_path, "fast", s, [0.5, 0.8, 0.9]) for s in (0, 1)]
    dirs += [write_run(tmp_path, "slow", s, [0.2, 0.4, 0.6]) for s in (0, 1)]
    rep = report(dirs, tmp_path / "rep", targets=["0.7", "test/loss=0.45"])
    (s,) = rep.sections
    assert [(t.group, t.metric, t.value, t.reached) for t in s.targets] == [
        ("fast", "test/acc", 0.7, 2), ("slow", "test/acc", 0.7, 0), ("fast", "test/loss", 0.45, 2),
        ("slow", "test/loss", 0.45, 2)]
    md = (tmp_path / "rep" / "report.md").read_text()
    assert ("| test/acc ↑ ≥ 0.7 | fast | 2/2 | 2.0 [2.0, 2.0] | 300 B [300 B, 300 B] | 2.00 MFLOP [2.00 MFLOP, "
            "2.00 MFLOP] | 200 kFLOP [200 kFLOP, 200 kFLOP] |") in md  # 10 clients: 2 MFLOP / 10 a client
    assert "| test/acc ↑ ≥ 0.7 | slow | 0/2 | not reached by 2 of 2 seeds | — | — | — |" in md
    assert "![metric against cost](cost.png)" in md and s.cost_metrics == ("test/acc", "test/loss")
    png = (tmp_path / "rep" / "cost.png").read_bytes()
    assert png.startswith(b"\x89PNG") and "cost.png" in rep.files
    assert "Cost to target" in (tmp_path / "rep" / "report.html").read_text()


def test_runs_without_costs_get_no_cost_figure(tmp_path: Path) -> None:
    d = write_run(tmp_path, "a", 0, [0.5, 0.8])
    rows = [{k: v for k, v in json.loads(x).items() if not k.startswith("cost/")}
            for x in d.joinpath("metrics.jsonl").read_text().splitlines()]
    d.joinpath("metrics.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    rep = report([d], tmp_path / "rep", targets=["0.7"])
    assert rep.sections[0].cost_curves is None and not (tmp_path / "rep" / "cost.png").exists()
    assert rep.sections[0].targets[0].cells() == ["1/1", "2.0", "—", "—", "—"]


def test_parse_targets() -> None:
    assert [(t.metric, t.value) for t in parse_targets(["0.9", "test/acc=0.8", "a=b=1e3"])] == [
        (None, 0.9), ("test/acc", 0.8), ("a=b", 1000.0)]
    for bad in ("x", "test/acc=", "=0.9", "nan", "test/acc=inf"):
        with pytest.raises(ConfigError, match=f"--target {bad}: expected VALUE or METRIC=VALUE"):
            parse_targets([bad])


@pytest.mark.parametrize("target,message", [
    ("high", "error: --target high: expected VALUE or METRIC=VALUE with a finite number"),
    ("test/nope=1", "error: --target test/nope=1: no run logs test/nope"),
    ("clients/sampled=3", "error: --target clients/sampled=3: clients/sampled has no direction in the runs' "
                          "run.json, so 'reached' is undefined"),
])
def test_bad_target_is_one_line_and_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str,
                                                   message: str) -> None:
    write_run(tmp_path, "a", 0, [0.5, 0.8])
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, ["report", "runs", "--out", "rep", "--target", target], terminal_width=300)
    assert res.exit_code == 2, res.output
    assert len(res.output.strip().splitlines()) == 1 and res.output.startswith(message), res.output
    assert not (tmp_path / "rep").exists()


def test_run_curves_draw_the_4_byte_count_once_where_it_equals_the_bytes_sent() -> None:
    from test_run_plots import _plan, sr_rows

    rows = sr_rows()
    for r in rows:
        r["cost/up_bytes_fp32"], r["cost/total_up_bytes_fp32"] = r["cost/up_bytes"], r["cost/total_up_bytes"]
    panels, notes = _plan(rows)
    drawn = {ln.label for p in panels for ln in p.lines}
    assert "cost/total_up_bytes_fp32" not in drawn and "cost/total_up_bytes" in drawn
    assert any("cost/total_up_bytes_fp32 = cost/total_up_bytes" in n for n in notes)
    for r in rows:  # float64 statistics: half the bytes at 4 a number, drawn beside them
        r["cost/up_bytes_fp32"], r["cost/total_up_bytes_fp32"] = r["cost/up_bytes"] / 2, r["cost/total_up_bytes"] / 2
    (total,) = [p for p in _plan(rows)[0] if p.title.startswith("Cumulative communication")]
    assert "cost/total_up_bytes_fp32" in [ln.label for ln in total.lines]


def test_a_bare_target_applies_to_the_primary_metric_even_when_the_table_shows_others(tmp_path: Path) -> None:
    dirs = [write_run(tmp_path, "a", s, [0.5, 0.8]) for s in (0, 1)]
    rep = report(dirs, tmp_path / "rep", ["test/loss"], targets=["0.7"])
    assert [(t.metric, [r.round for r in t.reaches]) for t in rep.sections[0].targets] == [("test/acc", [2, 2])]
    assert rep.sections[0].cost_metrics == ("test/acc", "test/loss")  # the target's, then the asked
