"""Comparisons carry their uncertainty (issue 42, item 3): every group against a baseline, paired by seed, with a
95% Student-t interval checked against scipy's paired t-test; the selection protocols (final, best, last:N);
budget metrics without a "best"; and bad --baseline / --select input refused in one line with nothing written.
Run directories are written here as the engines write them (config.json, run.json, metrics.jsonl)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from scipy import stats
from typer.testing import CliRunner

from fedsight.cli import app
from fedsight.errors import ConfigError
from fedsight.metric_table import is_budget
from fedsight.reporting import compare, report, write_summary
from fedsight.reporting.paired import paired_difference
from fedsight.reporting.selection import Selection

DIRECTIONS = {"test/acc": True, "test/loss": False, "val/acc": True, "local/wma": True, "train/*": False,
              "cost/*": False, "time/*": False, "dp/epsilon": False, "privacy/epsilon_max": False, "clients/*": None}

runner = CliRunner()


def config(name: str, seed: int, *, lr: float = 0.1, alpha: float = 0.3) -> dict:
    return {"seed": seed, "run": {"name": name, "output_dir": "runs"}, "task": {"name": "classification"},
            "data": {"name": "digits"}, "partition": {"name": "dirichlet", "alpha": alpha, "num_clients": 10},
            "model": {"name": "cnn_small"}, "train": {"lr": lr}, "server": {"rounds": 4}}


def write_run(root: Path, rel: str, cfg: dict, rows: list[dict]) -> Path:
    d = root / rel
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(cfg))
    meta = {"format": 1, "primary": "test/acc", "metrics": DIRECTIONS, "sessions": [{"backend": "in-process"}]}
    (d / "run.json").write_text(json.dumps(meta))
    (d / "metrics.jsonl").write_text("\n".join(json.dumps({"stage": "fed", **r}) for r in rows) + "\n")
    return d


def curve_rows(accs: list[float], **extra: float) -> list[dict]:
    """One row per round: test/acc as given, test/loss = 1 - acc, and time and cost that grow each round."""
    return [{"round": i, "test/acc": a, "test/loss": 1 - a, "time/round_s": 1.0 + i / 10,
             "cost/total_up_bytes": 100.0 * i, **extra} for i, a in enumerate(accs, start=1)]


def method(root: Path, name: str, finals: dict[int, float], *, lr: float, alpha: float = 0.3,
           order: list[int] | None = None) -> list[Path]:
    """One group: a run per seed (in ``order``), each ending at ``finals[seed]`` after 0.3 and a peak of 0.95."""
    return [write_run(root, f"runs/{name}/seed{s}", config(name, s, lr=lr, alpha=alpha),
                      curve_rows([0.3, 0.95, finals[s]]))
            for s in (order or list(finals))]


def comparison(table, group: str, metric: str = "test/acc"):
    (c,) = [c for c in table.comparisons if c.group == group and c.metric == metric]
    return c


# ------------------------------------------------------------------------------------- paired statistics


def test_paired_ci_matches_scipy_ttest_rel_on_the_seeds_both_groups_have(tmp_path: Path) -> None:
    # the baseline has seeds 0-4, the method 1-5, given in another order: pairs are seeds 1-4, by seed
    base = {0: 0.70, 1: 0.74, 2: 0.69, 3: 0.80, 4: 0.72}
    other = {1: 0.79, 2: 0.70, 3: 0.86, 4: 0.77, 5: 0.10}
    dirs = method(tmp_path, "base", base, lr=0.1) + method(tmp_path, "other", other, lr=0.2, order=[5, 3, 1, 4, 2])
    c = comparison(compare(dirs), "other")
    seeds = [1, 2, 3, 4]
    a, b = np.array([other[s] for s in seeds]), np.array([base[s] for s in seeds])
    ref = stats.ttest_rel(a, b)
    lo, hi = ref.confidence_interval(confidence_level=0.95)
    assert c.baseline == "base" and c.stats.seeds == (1, 2, 3, 4) and c.stats.n == 4
    assert c.stats.differences == pytest.approx(list(a - b), abs=1e-12)
    assert c.stats.mean == pytest.approx(float(np.mean(a - b)), abs=1e-12)
    assert c.stats.ci == pytest.approx((lo, hi), abs=1e-12)
    # the unpaired (Welch) interval of the same values is another one: pairing is what is checked
    welch = stats.ttest_ind(a, b, equal_var=False).confidence_interval()
    assert not np.allclose(c.stats.ci, (welch.low, welch.high), atol=1e-3)
    assert c.stats.verdict == ("better" if ref.pvalue < 0.05 else "within noise") == "better"


def test_verdicts_follow_the_metrics_direction(tmp_path: Path) -> None:
    base = {0: 0.70, 1: 0.74, 2: 0.71}
    dirs = (method(tmp_path, "base", base, lr=0.1)
            + method(tmp_path, "up", {s: v + 0.05 + s / 1000 for s, v in base.items()}, lr=0.2)
            + method(tmp_path, "down", {s: v - 0.05 + s / 1000 for s, v in base.items()}, lr=0.3)
            + method(tmp_path, "noisy", {0: 0.75, 1: 0.70, 2: 0.73}, lr=0.4))
    table = compare(dirs, metrics=["test/acc", "test/loss"])
    assert [c.group for c in table.comparisons] == ["up", "down", "noisy"] * 2  # the baseline is not compared
    verdicts = {(c.group, c.metric): c.stats.verdict for c in table.comparisons}
    assert verdicts == {("up", "test/acc"): "better", ("down", "test/acc"): "worse",
                        ("noisy", "test/acc"): "within noise",
                        # loss = 1 - acc, lower is better: the same verdicts, from negative differences
                        ("up", "test/loss"): "better", ("down", "test/loss"): "worse",
                        ("noisy", "test/loss"): "within noise"}
    assert comparison(table, "up", "test/loss").stats.mean == pytest.approx(-comparison(table, "up").stats.mean)
    lo, hi = comparison(table, "noisy").stats.ci
    assert lo < 0 < hi


def test_one_common_seed_has_no_interval_and_says_so(tmp_path: Path) -> None:
    dirs = (method(tmp_path, "base", {0: 0.7, 1: 0.8}, lr=0.1) + method(tmp_path, "one", {1: 0.9, 2: 0.5}, lr=0.2)
            + method(tmp_path, "none", {5: 0.9, 6: 0.95}, lr=0.3))
    table = report(dirs, tmp_path / "rep", metrics=["test/acc"]).table
    c = comparison(table, "one")
    assert (c.stats.n, c.stats.ci, c.stats.verdict) == (1, None, "n < 2: no interval")
    assert c.stats.mean == pytest.approx(0.1)
    assert comparison(table, "none").stats.n == 0 and comparison(table, "none").stats.mean is None
    md = (tmp_path / "rep" / "report.md").read_text()
    (line,) = [ln for ln in md.splitlines() if ln.startswith("| test/acc ↑ | one | base |")]
    assert line.endswith("| 1 | +0.1000 | n/a (1 seed) | n < 2: no interval | — |")  # no Wilcoxon p either
    (line,) = [ln for ln in md.splitlines() if ln.startswith("| test/acc ↑ | none | base |")]
    assert line.endswith("| 0 | — | n/a (no common seed) | n < 2: no interval | — |")


finite = st.floats(min_value=-100, max_value=100, allow_nan=False, allow_subnormal=False)


@given(st.lists(st.tuples(finite, finite), min_size=2, max_size=12), st.booleans())
def test_paired_interval_properties(pairs: list[tuple[float, float]], higher: bool) -> None:
    a = {seed: x for seed, (x, _) in enumerate(pairs)}
    b = {seed: y for seed, (_, y) in enumerate(pairs)}
    d = paired_difference(a, b, higher)
    diffs = np.array([x - y for x, y in pairs])
    spread = float(np.ptp(diffs))
    assume(spread == 0 or spread > 1e-6 * max(1.0, float(np.abs(diffs).max())))  # not cancellation noise
    lo, hi = d.ci
    assert d.n == len(pairs) and lo <= d.mean <= hi
    # swapping the groups negates the difference and its interval, and turns better into worse
    s = paired_difference(b, a, higher)
    assert s.mean == pytest.approx(-d.mean, abs=1e-9) and s.ci == pytest.approx((-hi, -lo), abs=1e-9)
    assert {d.verdict, s.verdict} in ({"within noise"}, {"better", "worse"})
    if spread > 0:  # scipy's paired t-test agrees on the interval and on significance at 5%
        ref = stats.ttest_rel(list(a.values()), list(b.values()))
        ci = ref.confidence_interval()
        assert (lo, hi) == pytest.approx((ci.low, ci.high), rel=1e-6, abs=1e-9)
        assume(abs(ref.pvalue - 0.05) > 1e-6)
        assert (d.verdict != "within noise") == (ref.pvalue < 0.05)
        if d.verdict != "within noise":
            assert (d.verdict == "better") == ((d.mean > 0) == higher)


# ---------------------------------------------------------------------------------------- selection protocols


def test_selection_protocols_pick_final_best_or_the_mean_of_the_last_n(tmp_path: Path) -> None:
    accs = {"base": {0: [0.3, 0.9, 0.6, 0.7], 1: [0.2, 0.8, 0.7, 0.5], 2: [0.4, 0.85, 0.8, 0.6]},
            "other": {0: [0.5, 0.7, 0.9, 0.8], 1: [0.1, 0.95, 0.6, 0.9], 2: [0.3, 0.6, 0.7, 0.75]}}
    dirs = [write_run(tmp_path, f"{name}/s{s}", config(name, s, lr=0.1 if name == "base" else 0.2),
                      curve_rows(a, **{"val/acc": a[0]}))
            for name, by_seed in accs.items() for s, a in by_seed.items()]
    picks = {"final": lambda a: a[-1], "best": max, "last:2": lambda a: np.mean(a[-2:]),
             "last:4": lambda a: np.mean(a)}
    for select, pick in picks.items():
        table = compare(dirs, metrics=["test/acc", "val/acc", "time/round_s"], select=select)
        c = comparison(table, "other")
        diffs = [pick(accs["other"][s]) - pick(accs["base"][s]) for s in range(3)]
        ci = stats.ttest_rel([pick(accs["other"][s]) for s in range(3)],
                             [pick(accs["base"][s]) for s in range(3)]).confidence_interval()
        assert c.stats.differences == pytest.approx(diffs, abs=1e-12), select
        assert c.stats.ci == pytest.approx((ci.low, ci.high), abs=1e-12), select
        (row,) = [r for r in table.rows if r.group == "other" and r.metric == "test/acc"]
        assert row.selected_mean == pytest.approx(np.mean([pick(a) for a in accs["other"].values()])), select
    best = compare(dirs, metrics=["test/acc", "val/acc", "time/round_s"], select="best")
    assert comparison(best, "other").selection == "best round, selected on the test set"
    assert comparison(best, "other", "val/acc").selection == "best round, selected on the validation set"
    # round time is a budget: no best; the protocol keeps its final value
    time_c = comparison(best, "other", "time/round_s")
    assert time_c.selection == "final (no best for this metric)" and time_c.stats.mean == pytest.approx(0.0)
    assert comparison(compare(dirs, select="last:3"), "other").selection == "mean of last 3 evaluations"
    assert comparison(compare(dirs), "other").selection == "final"
    # the tables say which values they hold
    md = best.comparison_markdown()
    assert "| metric | run | baseline | selection | n | Δ | 95% CI | verdict |" in md
    assert "| test/acc ↑ | other | base | best round, selected on the test set | 3 |" in md
    # bold marks the top group on the selected value: final by default, best under --select best
    for table, bold_col in ((compare(dirs, metrics=["test/acc"]), 4), (best, 5)):
        (line,) = [ln for ln in table.to_markdown().splitlines() if ln.startswith("| test/acc ↑ | other |")]
        assert [i for i, cell in enumerate(line.split(" | ")) if "**" in cell] == [bold_col], line
    last = compare(dirs, metrics=["test/acc"], select="last:2").to_markdown()
    assert "| metric | run | n | rounds | final | best | last 2 |" in last
    assert "mean of each run's last 2 evaluations" in last


def test_selection_parses_the_protocols_and_nothing_else() -> None:
    assert Selection.parse("final") == Selection("final") and Selection.parse("best") == Selection("best")
    assert Selection.parse("last:5") == Selection("last", 5) and str(Selection.parse("last:5")) == "last:5"
    for bad in ("last:0", "last:", "last:-1", "last", "mean", "Best", "last:2.5", ""):
        with pytest.raises(ConfigError, match="--select"):
            Selection.parse(bad)


# -------------------------------------------------------------------------------------------- budget metrics


@pytest.mark.parametrize("key,budget", [
    ("cost/total_up_bytes", True), ("cost/flops", True), ("time/round_s", True), ("dp/epsilon", True),
    ("privacy/epsilon_max", True), ("fedvg/server_passes", True), ("test/acc", False), ("train/loss", False),
    ("local/worst10", False), ("test/miou", False), ("val/loss", False)])
def test_budget_metrics_are_classified_in_one_place(key: str, budget: bool) -> None:
    assert is_budget(key) is budget


def test_budget_metrics_have_no_best_in_summaries_and_tables(tmp_path: Path) -> None:
    rows = curve_rows([0.3, 0.9, 0.8])
    for i, r in enumerate(rows, start=1):
        r.update({"dp/epsilon": 0.5 * i, "privacy/epsilon_max": 0.7 * i, "train/loss": 1.0 / i})
    d = write_run(tmp_path, "r/seed0", config("r", 0), rows)
    text = write_summary(d, plot=False).read_text()
    lines = {ln.split(" | ")[0][2:]: ln for ln in text.splitlines() if ln.startswith("| ")}
    for key in ("cost/total_up_bytes ↓", "dp/epsilon ↓", "privacy/epsilon_max ↓", "time/round_s ↓"):
        assert lines[key].endswith("| 3 | — | — |"), lines[key]  # final at round 3, no best
    assert lines["test/acc ↑"].endswith("| 0.9 | 2 |") and lines["train/loss ↓"].endswith("| 3 |")
    table = compare([d], metrics=["test/acc", "cost/total_up_bytes", "dp/epsilon"])
    best = {r.metric: r.best_mean for r in table.rows}
    assert best == {"test/acc": pytest.approx(0.9), "cost/total_up_bytes": None, "dp/epsilon": None}


# ------------------------------------------------------------------------------------------------ baselines


def test_baseline_by_name_default_first_and_per_grid_point(tmp_path: Path) -> None:
    dirs = (method(tmp_path, "a", {0: 0.7, 1: 0.72}, lr=0.1) + method(tmp_path, "b", {0: 0.8, 1: 0.81}, lr=0.2)
            + method(tmp_path, "c", {0: 0.6, 1: 0.66}, lr=0.3))
    assert [(c.group, c.baseline) for c in compare(dirs, metrics=["test/acc"]).comparisons] == [("b", "a"), ("c", "a")]
    table = compare(dirs, metrics=["test/acc"], baseline="b")
    assert [(c.group, c.baseline) for c in table.comparisons] == [("a", "b"), ("c", "b")]
    assert comparison(table, "a").stats.mean == pytest.approx(-0.095)
    # a sweep's grid: each grid point's groups against the baseline variant at the same point
    grid = []
    for name, lr in (("fedavg", 0.1), ("fedprox", 0.2)):
        for alpha in (0.1, 1.0):
            label = f"{name}[alpha={alpha}]"
            grid += [write_run(tmp_path, f"sweep/{name}/{alpha}/seed{s}", config(label, s, lr=lr, alpha=alpha),
                               curve_rows([0.5, alpha / 2 + lr + s / 100])) for s in range(2)]
    pairs = [(c.group, c.baseline, c.stats.mean) for c in compare(grid, metrics=["test/acc"]).comparisons]
    assert pairs == [("fedprox[alpha=0.1]", "fedavg[alpha=0.1]", pytest.approx(0.1)),
                     ("fedprox[alpha=1.0]", "fedavg[alpha=1.0]", pytest.approx(0.1))]
    one = compare(grid, metrics=["test/acc"], baseline="fedprox[alpha=1.0]")
    assert {c.baseline for c in one.comparisons} == {"fedprox[alpha=1.0]"} and len(one.comparisons) == 3


def test_report_md_and_the_console_carry_the_comparison(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    method(tmp_path, "base", {0: 0.70, 1: 0.74, 2: 0.71}, lr=0.1)
    method(tmp_path, "better", {0: 0.80, 1: 0.83, 2: 0.82}, lr=0.2)
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, ["report", "runs", "--out", "rep", "--metric", "test/acc"], terminal_width=200)
    assert res.exit_code == 0, res.output
    assert "Compared with the baseline base" in res.output and "95% CI" in res.output
    diffs = np.array([0.10, 0.09, 0.11])
    half = stats.t.ppf(0.975, 2) * diffs.std(ddof=1) / math.sqrt(3)
    ci = f"[{diffs.mean() - half:+.4f}, {diffs.mean() + half:+.4f}]"
    assert f"│ +0.1000 │ {ci} │ better" in res.output
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "## Compared with the baseline (base)" in md
    assert f"| test/acc ↑ | better | base | final | 3 | +0.1000 | {ci} | better |" in md


# ---------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("args,message", [
    (["--baseline", "nope"], "error: --baseline nope: no such group; the groups are base, other"),
    (["--select", "last:4"], "error: --select last:4: run runs/base/seed0 has 3 evaluations of test/acc, fewer "
                             "than 4"),
    (["--select", "median"], "error: --select median: unknown selection protocol; choose final, best or last:N"),
])
def test_bad_baseline_or_select_is_one_line_and_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               args: list[str], message: str) -> None:
    method(tmp_path, "base", {0: 0.7, 1: 0.8}, lr=0.1)
    method(tmp_path, "other", {0: 0.75, 1: 0.85}, lr=0.2)
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, ["report", "runs", "--out", "rep", "--csv", "all.csv", *args], terminal_width=300)
    assert res.exit_code == 2
    assert len(res.output.strip().splitlines()) == 1 and res.output.startswith(message), res.output
    assert not (tmp_path / "rep").exists() and not (tmp_path / "all.csv").exists()


def test_last_n_counts_each_runs_evaluations_of_each_metric(tmp_path: Path) -> None:
    ok = method(tmp_path, "base", {0: 0.7, 1: 0.8}, lr=0.1)
    short = write_run(tmp_path, "runs/short/seed0", config("short", 0, lr=0.2), curve_rows([0.5, 0.6]))
    assert compare(ok, select="last:3").selection == Selection("last", 3)
    with pytest.raises(ConfigError, match=r"--select last:3: run .*short/seed0 has 2 evaluations of test/acc"):
        compare([*ok, short], select="last:3")
    with pytest.raises(ConfigError, match="--baseline x: no such group; the groups are base, short"):
        report([*ok, short], tmp_path / "rep", baseline="x")
    assert not (tmp_path / "rep").exists()


def test_report_md_says_which_commit_command_and_machine_produced_its_numbers(tmp_path: Path) -> None:
    """The provenance section lists each distinct commit, command and CPU of the runs' sessions, with counts."""
    from fedsight.reporting import report

    dirs = method(tmp_path, "a", {0: 0.9, 1: 0.8}, lr=0.1) + method(tmp_path, "b", {0: 0.7, 1: 0.6}, lr=0.2)
    machines = [{"cpu": "AMD EPYC 7B13", "cpu_capability": "AVX2", "blas": "mkl"},
                {"cpu": "Intel Xeon", "cpu_capability": "AVX512", "blas": "mkl"}]
    for i, d in enumerate(dirs):
        meta = json.loads((d / "run.json").read_text())
        program = "__main__.py" if i == 1 else "fedsight"  # (``python -m fedsight`` as runs recorded it before)
        meta["sessions"] = [{"backend": "in-process", "command": [program, "run", "c.toml", "--set", "x=1 2"],
                             "git": {"fedsight": {"commit": "0123456789abcdef", "dirty": i == 3}},
                             "torch": "2.13.0+cpu", "python": "3.11.7", "device": "cpu", "threads": 1,
                             "machine": machines[i % 2]}]
        (d / "run.json").write_text(json.dumps(meta))
    report(dirs, tmp_path / "out")
    text = (tmp_path / "out" / "report.md").read_text()
    prov = text[text.index("## Provenance"):]
    assert "From the `run.json` of the 4 runs" in prov
    assert "  - `0123456789ab` (3 runs)" in prov and "  - `0123456789ab (with uncommitted changes)` (1 run)" in prov
    assert "- command: `fedsight run c.toml --set 'x=1 2'`" in prov and "__main__" not in prov
    assert "  - `AMD EPYC 7B13 (cpu_capability AVX2, blas mkl)` (2 runs)" in prov
    assert "  - `Intel Xeon (cpu_capability AVX512, blas mkl)` (2 runs)" in prov
    assert "- device, threads: `cpu, 1 thread`" in prov


def test_the_comparison_says_where_the_dp_noise_came_from_and_where_runs_differ_in_it(tmp_path: Path) -> None:
    """``privacy_noise`` of the runs' sessions (``[privacy] noise``: simulated or secret, and the parts drawing
    it) heads the paired comparison, shared or group by group where the groups differ, and is a provenance line;
    runs drawing no protecting noise say nothing of it."""
    from fedsight.secret import SECRET_NOTE, SIMULATED_NOTE

    dirs = method(tmp_path, "a", {0: 0.9, 1: 0.8}, lr=0.1) + method(tmp_path, "b", {0: 0.7, 1: 0.6}, lr=0.2)
    plain = compare(dirs)
    assert "rivacy noise" not in plain.comparison_note() + plain.comparison_markdown()

    def noise(notes: list[str]) -> None:
        for d, note in zip(dirs, notes):
            meta = json.loads((d / "run.json").read_text())
            meta["sessions"] = [{"backend": "in-process", "privacy_noise": f"{note} (dct_dp)"}]
            (d / "run.json").write_text(json.dumps(meta))

    noise([SIMULATED_NOTE] * 4)
    table = compare(dirs)
    assert f"Privacy noise (run.json), every run: {SIMULATED_NOTE} (dct_dp)." in table.comparison_markdown()
    assert "differs" not in table.noise_note()
    noise([SIMULATED_NOTE] * 2 + [SECRET_NOTE] * 2)
    table = report(dirs, tmp_path / "out").table
    note = (f"Privacy noise differs between the compared runs (run.json): a: {SIMULATED_NOTE} (dct_dp); "
            f"b: {SECRET_NOTE} (dct_dp).")
    assert note in table.comparison_note(selection_column=False)
    text = (tmp_path / "out" / "report.md").read_text()
    assert note in text[text.index("## Compared with the baseline"):text.index("## Groups")]
    prov = text[text.index("## Provenance"):]
    assert f"  - `{SIMULATED_NOTE} (dct_dp)` (2 runs)" in prov and f"  - `{SECRET_NOTE} (dct_dp)` (2 runs)" in prov
    # on the command line too: the caption of the paired comparison's table
    res = runner.invoke(app, ["report", *map(str, dirs), "--out", str(tmp_path / "cli")], terminal_width=300)
    assert res.exit_code == 0 and "Privacy noise differs between the compared runs" in " ".join(res.output.split())
