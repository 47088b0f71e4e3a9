"""Tests for fedsight.reporting on fake run directories written here."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from fedsight.metrics import MetricSpec, direction
from fedsight.reporting import (
    compare,
    group_runs,
    mean_curve,
    plot_comparison,
    plot_run,
    read_config,
    read_metrics,
    report,
    write_summary,
)
from fedsight.reporting.plots import _panel_groups
from fedsight.reporting.runs_view import _Run, _Series

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_config(name: str, seed: int, *, lr: float = 0.1, mu: float = 0.0) -> dict:
    return {
        "seed": seed,
        "run": {"name": name, "output_dir": f"runs/{name}-s{seed}"},
        "task": {"name": "classification"},
        "data": {"name": "digits", "root": None},
        "partition": {"name": "dirichlet", "alpha": 0.3, "num_clients": 20},
        "model": {"name": "cnn_small", "width": 16},
        "train": {"rounds": 10, "clients_per_round": 5, "lr": lr, "local_epochs": 1},
        "server": {"optimizer": {"name": "sgd", "lr": 1.0}},
        "recipe": {"objective": [{"name": "task"}, {"name": "fedprox", "mu": mu}], "weighting": "data_size"},
        "eval": {"every": 1},
    }


#: what a classification run of the current code records in run.json (``fedsight.api.metric_directions``)
DIRECTIONS = {
    "test/acc": True, "local/acc": True, "val/acc": True, "test/loss": False, "local/loss": False,
    "val/loss": False, "local/wma": True, "local/worst10": True, "train/*": False, "cost/*": False,
    "time/*": False, "clients/*": None, "flower/*": None, "dp/epsilon": False, "dp/*": None,
}


def write_run_meta(run_dir: Path, metrics: dict, primary: str = "test/acc") -> None:
    meta = {"format": 1, "primary": primary, "metrics": metrics, "sessions": []}
    (run_dir / "run.json").write_text(json.dumps(meta))


def acc_curve(rounds: int, peak: float, final: float) -> list[float]:
    """Rises to ``peak`` at the middle round, then drops to ``final`` at the last round."""
    mid = rounds // 2
    up = np.linspace(0.1, peak, mid)
    down = np.linspace(peak, final, rounds - mid + 1)[1:]
    return [float(v) for v in np.concatenate([up, down])]


def make_run(
    root: Path,
    dirname: str,
    config: dict,
    *,
    acc: list[float],
    loss: list[float] | None = None,
    eval_every: int = 1,
    round_s: float = 2.0,
    extra_lines: list[str] | None = None,
    directions: dict | None = DIRECTIONS,
    primary: str = "test/acc",
) -> Path:
    """A fake run directory; ``directions`` (None: no run.json, as before it existed) go to run.json."""
    d = root / dirname
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(config, indent=2))
    if directions is not None:
        write_run_meta(d, directions, primary)
    loss = loss if loss is not None else [1.0 - a / 2 for a in acc]
    lines = []
    for i, (a, lo) in enumerate(zip(acc, loss), start=1):
        rec = {"round": i, "stage": "fed", "train/loss": 2.0 / i, "time/round_s": round_s, "time/train_s": round_s / 2}
        if i % eval_every == 0:
            rec.update({"test/acc": a, "test/loss": lo, "local/wma": a - 0.05, "local/worst10": a - 0.2})
        lines.append(json.dumps(rec))
    lines += extra_lines or []
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return d


@pytest.fixture
def two_experiments(tmp_path: Path) -> dict:
    """Experiment A (3 seeds) and B (2 seeds, different lr), given interleaved."""
    finals = {"A": [0.70, 0.74, 0.71], "B": [0.60, 0.66]}
    peaks = {"A": [0.80, 0.83, 0.79], "B": [0.68, 0.69]}
    dirs = []
    seeds = {"A": [0, 1, 2], "B": [7, 8]}
    for i in range(3):
        for name, lr in (("A", 0.1), ("B", 0.01)):
            if i >= len(seeds[name]):
                continue
            s = seeds[name][i]
            cfg = make_config(name, s, lr=lr)
            acc = acc_curve(10, peaks[name][i], finals[name][i])
            dirs.append(make_run(tmp_path, f"{name}-s{s}", cfg, acc=acc))
    return {"dirs": dirs, "finals": finals, "peaks": peaks, "seeds": seeds}


def row(table, group: str, metric: str):
    (r,) = [r for r in table.rows if r.group == group and r.metric == metric]
    return r


# ----------------------------------------------------------------------------------------------- reading


def test_read_metrics_skips_blank_lines_and_keeps_events(tmp_path: Path) -> None:
    d = tmp_path / "r"
    d.mkdir()
    (d / "metrics.jsonl").write_text(
        '{"round": 1, "stage": "fed", "test/acc": 0.5}\n\n   \n{"event": "resumed", "round": 1}\n'
        '{"round": 2, "stage": "fed", "test/acc": 0.6}\n'
    )
    recs = read_metrics(d)
    assert [r.get("round") for r in recs] == [1, 1, 2]
    assert recs[1]["event"] == "resumed"


def test_a_torn_last_line_reads_as_the_complete_rounds_and_a_finished_bad_last_line_is_an_error(tmp_path: Path) -> None:
    """A crash in the middle of an append leaves a last line without its newline: read as the rounds before it (as
    ``resume`` drops it); the same text followed by a newline was written whole, and is an error naming the line."""
    d = tmp_path / "r"
    d.mkdir()
    good = '{"round": 1, "stage": "fed", "test/acc": 0.5}\n'
    (d / "metrics.jsonl").write_text(good + '{"round": 2, "stage": "fed", "te')
    assert [r["round"] for r in read_metrics(d)] == [1]
    (d / "metrics.jsonl").write_text(good + '{"round": 2, "stage": "fed", "te\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2: invalid JSON"):
        read_metrics(d)
    from fedsight.runs import RunDir  # the other logs of a round read the same way

    (d / "client_weights.jsonl").write_text('{"round": 1, "clients": [0], "weights": [1.0]}\n{"round": 2, "cli')
    assert [r["round"] for r in RunDir(d).read_client_weights()] == [1]


@pytest.mark.parametrize(
    "bad_line",
    ['{"round": 3, "stage": "fed", "test/acc": 0.', "[1, 2]", '{"stage": "fed", "test/acc": 0.5}'],
    ids=["truncated-json", "not-an-object", "no-round"],
)
def test_malformed_metrics_line_names_file_and_line(tmp_path: Path, bad_line: str) -> None:
    d = tmp_path / "run"
    d.mkdir()
    good = '{"round": 1, "stage": "fed", "test/acc": 0.5}'
    (d / "metrics.jsonl").write_text(f"{good}\n\n{bad_line}\n{good}\n")
    with pytest.raises(ValueError) as exc:
        read_metrics(d)
    msg = str(exc.value)
    assert f"{d / 'metrics.jsonl'}:3:" in msg


def test_read_config_errors_name_the_file(tmp_path: Path) -> None:
    d = tmp_path / "run"
    d.mkdir()
    with pytest.raises(FileNotFoundError, match=re.escape(str(d / "config.json"))):
        read_config(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=re.escape(str(d / "config.json"))):
        read_config(d)
    (d / "config.json").write_text("[1]")
    with pytest.raises(ValueError, match=re.escape(str(d / "config.json"))):
        read_config(d)
    (d / "config.json").write_text('{"seed": 3}')
    assert read_config(d) == {"seed": 3}


# ---------------------------------------------------------------------------------------------- grouping


def test_group_runs_by_config_minus_seed_and_run(two_experiments: dict) -> None:
    groups = group_runs(two_experiments["dirs"])
    assert [g.label for g in groups] == ["A", "B"]
    a, b = groups
    assert a.seeds == (0, 1, 2)
    assert b.seeds == (7, 8)
    assert [p.name for p in a.run_dirs] == ["A-s0", "A-s1", "A-s2"]
    assert [p.name for p in b.run_dirs] == ["B-s7", "B-s8"]
    assert "seed" not in a.config and "run" not in a.config


def test_groups_sharing_a_name_get_distinct_labels(tmp_path: Path) -> None:
    acc = acc_curve(10, 0.8, 0.7)
    d1 = make_run(tmp_path, "x1", make_config("fedprox", 0, mu=0.01), acc=acc)
    d2 = make_run(tmp_path, "x2", make_config("fedprox", 1, mu=0.01), acc=acc)
    d3 = make_run(tmp_path, "y1", make_config("fedprox", 0, mu=0.1), acc=acc)
    groups = group_runs([d1, d2, d3])
    labels = [g.label for g in groups]
    assert len(groups) == 2 and len(set(labels)) == 2
    assert all(label.startswith("fedprox") for label in labels)
    assert [len(g.run_dirs) for g in groups] == [2, 1]
    # labels like "fedprox [a1b2c3]" must survive rich markup
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(compare([d1, d2, d3]).to_rich())
    text = console.export_text()
    assert all(label in text for label in labels)


def test_integral_floats_do_not_split_a_group(tmp_path: Path) -> None:
    acc = acc_curve(10, 0.8, 0.7)
    c1 = make_config("A", 0)
    c2 = make_config("A", 1)
    c2["server"]["optimizer"]["lr"] = 1  # int instead of 1.0
    groups = group_runs([make_run(tmp_path, "a", c1, acc=acc), make_run(tmp_path, "b", c2, acc=acc)])
    assert len(groups) == 1


# -------------------------------------------------------------------------------------------- comparison


def test_compare_mean_std_of_finals_match_numpy(two_experiments: dict) -> None:
    table = compare(two_experiments["dirs"])
    for name in ("A", "B"):
        finals = np.array(two_experiments["finals"][name])
        r = row(table, name, "test/acc")
        assert r.n_runs == len(finals)
        assert r.final_mean == pytest.approx(finals.mean(), abs=1e-12)
        assert r.final_std == pytest.approx(finals.std(ddof=1), abs=1e-12)
        assert r.seeds == tuple(two_experiments["seeds"][name])
        assert r.rounds == (10,) * len(finals)


def test_best_follows_run_json_directions_not_metric_names(tmp_path: Path) -> None:
    # run.json says NME is lower-is-better (no "loss" in its name) and "test/count" has no direction
    directions = {**DIRECTIONS, "test/nme": False, "test/count": None}
    nme = {"A": [[0.30, 0.12, 0.20], [0.28, 0.10, 0.18]], "B": [[0.40, 0.25, 0.26], [0.35, 0.22, 0.30]]}
    count = {"A": [[5.0, 9.0, 7.0], [4.0, 8.0, 6.0]], "B": [[3.0, 2.0, 1.0], [6.0, 5.0, 4.0]]}
    accs = {"A": [[0.5, 0.9, 0.6], [0.4, 0.8, 0.5]], "B": [[0.3, 0.4, 0.35], [0.2, 0.45, 0.3]]}
    dirs = []
    for name, lr in (("A", 0.1), ("B", 0.2)):
        for s in range(2):
            extra = [json.dumps({"round": r + 1, "stage": "fed", "test/nme": nme[name][s][r],
                                 "test/count": count[name][s][r]}) for r in range(3)]
            dirs.append(make_run(tmp_path, f"{name}{s}", make_config(name, s, lr=lr), acc=accs[name][s],
                                 extra_lines=extra, directions=directions))
    table = compare(dirs, metrics=["test/acc", "test/nme", "test/count"])
    for name in ("A", "B"):
        acc_row, nme_row, count_row = (row(table, name, m) for m in ("test/acc", "test/nme", "test/count"))
        assert acc_row.higher_is_better is True and nme_row.higher_is_better is False
        assert count_row.higher_is_better is None
        assert acc_row.best_mean == pytest.approx(np.mean([max(a) for a in accs[name]]))
        assert acc_row.best_std == pytest.approx(np.std([max(a) for a in accs[name]], ddof=1))
        assert nme_row.best_mean == pytest.approx(np.mean([min(v) for v in nme[name]]))  # min, not max
        assert nme_row.best_std == pytest.approx(np.std([min(v) for v in nme[name]], ddof=1))
        assert nme_row.final_mean == pytest.approx(np.mean([v[-1] for v in nme[name]]))
        assert count_row.best_mean is None and count_row.best_std is None  # no direction: no best
        assert count_row.final_mean == pytest.approx(np.mean([v[-1] for v in count[name]]))
    md = table.to_markdown()
    lines = md.splitlines()
    # A has the lower final NME (0.19 vs 0.28): A is bold, B is not
    (nme_a,) = [ln for ln in lines if ln.startswith("| test/nme ↓ | A |")]
    (nme_b,) = [ln for ln in lines if ln.startswith("| test/nme ↓ | B |")]
    assert "| **0.1900 ± " in nme_a and "**" not in nme_b
    # no direction: no arrow, best shown as "—", never bold although A's and B's finals differ
    count_lines = [ln for ln in lines if ln.startswith("| test/count |")]
    assert len(count_lines) == 2
    assert all(ln.endswith("| — |") and "**" not in ln for ln in count_lines)
    # the single-run summary agrees: min for NME at its round, "—" for the count
    text = write_summary(dirs[0], plot=False).read_text()
    (nme_line,) = [ln for ln in text.splitlines() if ln.startswith("| test/nme")]
    assert nme_line == "| test/nme ↓ | 0.2 | 3 | 0.12 | 2 |"
    (count_line,) = [ln for ln in text.splitlines() if ln.startswith("| test/count")]
    assert count_line == "| test/count | 7 | 3 | — | — |"


def test_family_and_exact_directions_from_run_json(tmp_path: Path) -> None:
    # "test/*" says lower is better, the exact key "test/acc" overrides it; "train/loss" is declared
    # higher-is-better (an odd choice, but the file decides, not the name)
    directions = {"test/*": False, "test/acc": True, "train/loss": True}
    d = make_run(tmp_path, "r", make_config("A", 0), acc=[0.2, 0.6, 0.4], loss=[0.9, 0.5, 0.7],
                 directions=directions)
    run = _Run.load(d)
    assert run.direction("test/acc") is True
    assert run.direction("test/loss") is False
    assert run.direction("train/loss") is True
    assert run.direction("local/wma") is None  # not listed
    table = compare([d], metrics=["test/acc", "test/loss", "train/loss", "local/wma"])
    assert row(table, "A", "test/acc").best_mean == pytest.approx(0.6)
    assert row(table, "A", "test/loss").best_mean == pytest.approx(0.5)
    assert row(table, "A", "train/loss").best_mean == pytest.approx(2.0)  # train/loss = 2 / round: max at 1
    assert row(table, "A", "local/wma").best_mean is None


def test_runs_disagreeing_on_a_direction_leave_it_without_one(tmp_path: Path) -> None:
    extra = [json.dumps({"round": r, "stage": "fed", "test/nme": v}) for r, v in ((1, 0.3), (2, 0.1), (3, 0.2))]
    da = make_run(tmp_path, "a", make_config("A", 0), acc=[0.2, 0.5, 0.4], extra_lines=extra,
                  directions={**DIRECTIONS, "test/nme": False})
    db = make_run(tmp_path, "b", make_config("B", 0, lr=0.5), acc=[0.1, 0.3, 0.2], extra_lines=extra[:2],
                  directions={**DIRECTIONS, "test/nme": True})
    table = compare([da, db], metrics=["test/nme", "test/acc"])
    for name in ("A", "B"):
        r = row(table, name, "test/nme")
        assert r.higher_is_better is None and r.best_mean is None
    assert row(table, "A", "test/acc").higher_is_better is True  # they agree on acc
    nme_lines = [ln for ln in table.to_markdown().splitlines() if ln.startswith("| test/nme")]
    assert len(nme_lines) == 2 and all(ln.startswith("| test/nme |") and "**" not in ln for ln in nme_lines)


def test_default_metrics_put_the_primary_metric_first(tmp_path: Path) -> None:
    acc = acc_curve(6, 0.8, 0.7)
    dirs = [make_run(tmp_path, f"r{s}", make_config("A", s), acc=acc, primary="local/wma") for s in range(2)]
    metrics = compare(dirs).metrics
    assert metrics[0] == "local/wma" and metrics[1] == "test/acc"
    # runs that disagree on the primary metric: the first run's wins
    other = make_run(tmp_path, "o", make_config("A", 9), acc=acc, primary="test/loss")
    assert compare([other, *dirs]).metrics[0] == "test/loss"
    assert compare([*dirs, other]).metrics[0] == "local/wma"


def test_run_without_run_json_gets_directions_from_its_config(tmp_path: Path) -> None:
    from helpers import tiny

    from fedsight.api import execute, metric_directions
    from fedsight.config import validate

    cfg = validate(tiny(**{"server.rounds": 2, "eval.every": 1, "run.name": "legacy"}))
    d = execute(cfg, tmp_path / "legacy").run_dir
    (d / "run.json").unlink()  # as written before run.json existed
    run = _Run.load(d)
    table, primary = metric_directions(validate(read_config(d)))
    assert run.primary == primary == "test/acc"
    assert run.specs == tuple(MetricSpec(k, v) for k, v in table.items())
    assert run.direction("test/loss") is False and run.direction("test/acc") is True
    assert run.direction("time/round_s") is False and run.direction("clients/sampled") is None

    loss = [r["test/loss"] for r in read_metrics(d) if "test/loss" in r]
    acc = [r["test/acc"] for r in read_metrics(d) if "test/acc" in r]
    assert len(loss) == 2
    t = compare([d], metrics=["test/loss", "test/acc", "clients/sampled"])
    assert row(t, "legacy", "test/loss").higher_is_better is False
    assert row(t, "legacy", "test/loss").best_mean == pytest.approx(min(loss))
    assert row(t, "legacy", "test/acc").best_mean == pytest.approx(max(acc))
    assert row(t, "legacy", "clients/sampled").best_mean is None
    assert compare([d]).metrics[0] == "test/acc"

    # a config that no longer validates: no directions, no primary, no best
    bad = make_run(tmp_path, "bad", make_config("bad", 0), acc=[0.3, 0.5, 0.4], directions=None)
    run = _Run.load(bad)
    assert run.specs == () and run.primary is None
    r = row(compare([bad], metrics=["test/acc"]), "bad", "test/acc")
    assert r.higher_is_better is None and r.best_mean is None and r.final_mean == pytest.approx(0.4)


def test_default_metrics_eval_in_any_run_acc_first_plus_round_time(tmp_path: Path) -> None:
    acc = acc_curve(6, 0.8, 0.7)
    only_one = [json.dumps({"round": 6, "stage": "fed", "test/miou": 0.4, "clients/sampled": 5})]
    d1 = make_run(tmp_path, "a", make_config("A", 0), acc=acc, extra_lines=only_one)
    counter = [json.dumps({"round": 6, "stage": "fed", "clients/sampled": 5})]  # in both runs, not eval
    d2 = make_run(tmp_path, "b", make_config("A", 1), acc=acc, extra_lines=counter)
    table = compare([d1, d2])
    assert table.metrics[0] == "test/acc"
    assert table.metrics[-1] == "time/round_s"
    # an eval metric of one run only is tabulated too (over the runs that logged it); counters are not
    assert set(table.metrics) == {"test/acc", "test/loss", "test/miou", "local/wma", "local/worst10", "time/round_s"}
    assert row(table, "A", "test/miou").n_runs == 1


def test_single_run_group_shows_mean_only(tmp_path: Path) -> None:
    d = make_run(tmp_path, "solo", make_config("solo", 0), acc=acc_curve(10, 0.8, 0.75))
    table = compare([d], metrics=["test/acc"])
    r = row(table, "solo", "test/acc")
    assert r.final_mean == pytest.approx(0.75) and r.final_std is None
    (line,) = [ln for ln in table.to_markdown().splitlines() if "| solo |" in ln]
    assert "±" not in line and "| 0.7500 |" in line


def test_final_uses_each_runs_last_evaluated_round(tmp_path: Path) -> None:
    # seed 0: 10 rounds, eval every 3 -> last eval at round 9; seed 1 interrupted after 7 -> round 6
    a0 = [0.1 * i for i in range(1, 11)]
    a1 = [0.05 * i for i in range(1, 8)]
    d0 = make_run(tmp_path, "s0", make_config("A", 0), acc=a0, eval_every=3)
    d1 = make_run(tmp_path, "s1", make_config("A", 1), acc=a1, eval_every=3)
    r = row(compare([d0, d1], metrics=["test/acc"]), "A", "test/acc")
    assert r.final_mean == pytest.approx(np.mean([a0[8], a1[5]]))
    assert r.rounds == (10, 7)
    rounds, mean, std = mean_curve([d0, d1], "test/acc")
    assert rounds.tolist() == [3, 6]  # aligned on rounds both runs evaluated
    assert mean.tolist() == pytest.approx([(a0[2] + a1[2]) / 2, (a0[5] + a1[5]) / 2])
    assert std.tolist() == pytest.approx([np.std([a0[2], a1[2]], ddof=1), np.std([a0[5], a1[5]], ddof=1)])


def test_the_std_band_never_shows_a_negative_value_of_a_metric_that_is_never_negative() -> None:
    """mean ± std of two runs' seconds a round (0.1 and 1.9: std 1.27 > mean 1.0) is clipped at 0 below; a metric
    with a negative value keeps its whole band."""
    from fedsight.reporting.plots import _mean_curve_runs, std_band

    runs = [_Run(Path(f"r{i}"), {}, [{"round": 1, "time/round_s": t, "delta": t - 1.5}]) for i, t in enumerate((0.1, 1.9))]
    _, mean, std = _mean_curve_runs(runs, "time/round_s")
    lo, hi = std_band(runs, "time/round_s", mean, std)
    assert lo.tolist() == [0.0] and hi.tolist() == pytest.approx([1.0 + np.std([0.1, 1.9], ddof=1)])
    _, mean, std = _mean_curve_runs(runs, "delta")
    lo, _ = std_band(runs, "delta", mean, std)
    assert lo.tolist() == pytest.approx([-0.5 - np.std([0.1, 1.9], ddof=1)])


def test_event_lines_are_ignored(tmp_path: Path) -> None:
    acc = acc_curve(10, 0.8, 0.7)
    events = [
        json.dumps({"event": "client_failed", "round": 4, "stage": "fed", "client": 7, "test/acc": 99.0}),
        json.dumps({"event": "done", "wall_s": 123.0}),
    ]
    d = make_run(tmp_path, "r", make_config("A", 0), acc=acc, extra_lines=events)
    table = compare([d])
    assert "client" not in table.metrics and "wall_s" not in table.metrics
    r = row(table, "A", "test/acc")
    assert r.final_mean == pytest.approx(0.7) and r.best_mean == pytest.approx(0.8)
    summary = write_summary(d, plot=False).read_text()
    metrics, _, events = summary.partition("## Events")
    assert "| client" not in metrics and "| wall_s" not in metrics and "99" not in summary
    # events are listed in their own section, never as metrics
    assert "| client_failed | 1 | 4 | — |" in events and "| done | 1 | — | — |" in events
    assert plot_run(d).read_bytes().startswith(PNG_MAGIC)


def test_repeated_round_last_line_wins(tmp_path: Path) -> None:
    # a resumed run re-logs round 3 after its checkpoint at round 2
    acc = [0.1, 0.2, 0.3]
    rewrite = [json.dumps({"event": "resumed", "round": 2}),
               json.dumps({"round": 3, "stage": "fed", "test/acc": 0.35, "time/round_s": 2.0})]
    d = make_run(tmp_path, "r", make_config("A", 0), acc=acc, extra_lines=rewrite)
    rounds, mean, _ = mean_curve([d], "test/acc")
    assert rounds.tolist() == [1, 2, 3]
    assert mean.tolist() == pytest.approx([0.1, 0.2, 0.35])


def test_unknown_metric_is_an_error(two_experiments: dict) -> None:
    with pytest.raises(ValueError, match="test/nope"):
        compare(two_experiments["dirs"], metrics=["test/acc", "test/nope"])


def test_markdown_and_rich(two_experiments: dict) -> None:
    table = compare(two_experiments["dirs"])
    md = table.to_markdown()
    assert "mean ± std" in md
    assert "over N seeds" in md  # groups of 3 and 2 seeds
    for label in ("A", "B"):
        assert re.search(rf"\| {label} \|", md)
    # one row per (metric, group), and A's mean ± std of finals is printed
    assert len([ln for ln in md.splitlines() if ln.startswith("| test/acc")]) == 2
    finals = np.array(two_experiments["finals"]["A"])
    assert f"{finals.mean():.4f} ± {finals.std(ddof=1):.4f}" in md
    # the best final per metric is bold: A for acc (higher) and for loss (lower; loss = 1 - acc/2)
    assert f"**{finals.mean():.4f} ± " in md
    loss_a = 1 - finals.mean() / 2
    assert f"**{loss_a:.4f} ± " in md
    b_final = np.mean(two_experiments["finals"]["B"])
    assert f"| B | 2 | 10 | {b_final:.4f} ± " in md  # B is not bold
    # worst10 = acc - 0.2 for both: no tie here, but time/round_s is 2.0 everywhere -> nobody bold
    assert not [ln for ln in md.splitlines() if ln.startswith("| time/round_s") and "**" in ln]

    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(table.to_rich())
    text = console.export_text()
    assert "mean ± std" in text and "test/acc" in text and "B" in text


def test_markdown_uniform_seed_count(tmp_path: Path) -> None:
    dirs = [make_run(tmp_path, f"{n}{s}", make_config(n, s, lr=lr), acc=acc_curve(6, 0.8, 0.7 + s / 100))
            for n, lr in (("A", 0.1), ("B", 0.2)) for s in range(3)]
    assert "mean ± std over 3 seeds" in compare(dirs).to_markdown()


# ------------------------------------------------------------------------------------ summaries and plots


def test_write_summary(two_experiments: dict) -> None:
    d = two_experiments["dirs"][0]  # A seed 0
    path = write_summary(d)
    assert path == d / "summary.md"
    text = path.read_text()
    assert text.startswith("# A\n")
    assert "**seed:** 0" in text
    assert "dirichlet (alpha=0.3), 20 clients" in text
    for fragment in ("digits", "cnn_small", "**rounds:** 10",
                     "**clients per round:** 5", "fedprox(mu=0.0)", "weighting: data_size",
                     "**server optimizer:** sgd(lr=1.0)", "lr=0.1"):
        assert fragment in text, fragment
    acc = acc_curve(10, two_experiments["peaks"]["A"][0], two_experiments["finals"]["A"][0])
    (acc_line,) = [ln for ln in text.splitlines() if ln.startswith("| test/acc")]
    assert acc_line == f"| test/acc ↑ | {acc[-1]:.4g} | 10 | {max(acc):.4g} | {int(np.argmax(acc)) + 1} |"
    (loss_line,) = [ln for ln in text.splitlines() if ln.startswith("| train/loss")]
    assert loss_line == "| train/loss ↓ | 0.2 | 10 | 0.2 | 10 |"
    assert "**total time:** 20 s" in text  # 10 rounds x 2 s
    assert "(plots/curves.png)" in text
    assert (d / "plots" / "curves.png").read_bytes().startswith(PNG_MAGIC)


def test_summary_of_sparse_config(tmp_path: Path) -> None:
    d = make_run(tmp_path, "r", {"seed": 5, "run": {"name": "bare"}}, acc=[0.5, 0.6])
    text = write_summary(d, plot=False).read_text()
    assert text.startswith("# bare\n") and "**seed:** 5" in text
    assert "partition" not in text and "recipe" not in text


def test_plot_run_writes_png(two_experiments: dict) -> None:
    d = two_experiments["dirs"][0]
    path = plot_run(d)
    assert path == d / "plots" / "curves.png"
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    assert plot_run(d, keys=["test/acc"]).read_bytes().startswith(PNG_MAGIC)
    with pytest.raises(ValueError, match="test/nope"):
        plot_run(d, keys=["test/nope"])


def test_panel_groups_split_losses_and_scales() -> None:
    s = _Series
    r = np.arange(1, 4)
    series = {k: s(r, np.array(v, float)) for k, v in {
        "test/acc": [0.2, 0.5, 0.8], "test/psnr": [20, 25, 28], "test/ssim": [0.5, 0.7, 0.9],
        "test/loss": [2, 1, 0.5], "time/round_s": [2, 2, 2], "time/eval_s": [0.05, 0.05, 0.05],
    }.items()}
    series["local/wma"] = s(r, np.array([0.3, 0.4, 0.5]))
    series["local/worst10"] = s(r, np.zeros(3))  # all zero: must still share the local axes
    series["clients/sampled"] = s(r, np.full(3, 10.0))
    specs = [MetricSpec(k, v) for k, v in {**DIRECTIONS, "test/psnr": True, "test/ssim": True}.items()]
    panels = _panel_groups(list(series), series, lambda k: direction(specs, k))
    assert [ks for _, ks in panels] == [["test/acc", "test/ssim"], ["test/psnr"], ["test/loss"],
                                        ["time/round_s", "time/eval_s"], ["local/wma", "local/worst10"],
                                        ["clients/sampled"]]
    titles = dict((ks[0], t) for t, ks in panels)
    assert "higher is better" in titles["test/acc"] and "lower is better" in titles["test/loss"]
    assert "better" not in titles["clients/sampled"]  # counters have no direction


def test_panel_titles_follow_declared_directions() -> None:
    r = np.arange(1, 4)
    series = {k: _Series(r, np.array([0.3, 0.2, 0.1])) for k in ("test/acc", "test/nme", "test/count")}
    declared = {"test/acc": True, "test/nme": False, "test/count": None}
    panels = _panel_groups(list(series), series, declared.get)
    assert panels == [("Test metrics (higher is better)", ["test/acc"]),
                      ("Test metrics (lower is better)", ["test/nme"]),
                      ("Test metrics", ["test/count"])]


def test_plot_comparison_and_report(two_experiments: dict, tmp_path: Path) -> None:
    out = plot_comparison(two_experiments["dirs"], tmp_path / "cmp" / "cmp.png")
    assert out.read_bytes().startswith(PNG_MAGIC) and out.stat().st_size > 10_000
    table = report(two_experiments["dirs"], tmp_path / "rep").table
    md = (tmp_path / "rep" / "report.md").read_text()
    assert table.to_markdown() in md
    assert "![comparison curves](curves.png)" in md
    assert "seeds 0, 1, 2" in md and "seeds 7, 8" in md
    assert (tmp_path / "rep" / "curves.png").read_bytes().startswith(PNG_MAGIC)
    only_acc = report(two_experiments["dirs"], tmp_path / "rep2", metrics=["test/acc"]).table
    assert only_acc.metrics == ("test/acc",) and len(only_acc.rows) == 2
