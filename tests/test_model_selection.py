"""Model selection (``eval.select = "best"``): the global model best on the validation set is kept, resumes, and is
reported with its test metrics (``fedsight.model_selection``)."""

from __future__ import annotations

import json

import pytest
import tomli_w
from safetensors.torch import load_file
from typer.testing import CliRunner

from fedsight.api import execute
from fedsight.cli import app
from fedsight.config import ConfigError, validate
from helpers import tiny

#: 5 rounds at lr 0.5: validation accuracy peaks at round 4 and dips at round 5 (checked in the first test), so the
#: selected model is not the last one
SELECTING = {"server.rounds": 5, "train.lr": 0.5, "eval.every": 1, "eval.initial": True, "eval.local": False,
             "eval.select": "best", "validation.source": "carve"}


def _rows(run_dir):
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "event" not in r]


def _best_round(rows, key="val/acc"):
    best = max(r[key] for r in rows)
    return next(r["round"] for r in rows if r[key] == best)  # ties: the earliest round


@pytest.fixture(scope="module")
def selected_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("sel") / "run"
    cfg = validate(tiny(**{**SELECTING, "run.checkpoint_keep": 0}))
    assert execute(cfg, run_dir).status == "complete"
    return run_dir


def test_the_kept_model_is_the_validation_argmax_not_the_last(selected_run):
    rows = _rows(selected_run)
    best = _best_round(rows)
    assert [r["round"] for r in rows] == [0, 1, 2, 3, 4, 5] and best not in (0, 5)
    rec = json.loads((selected_run / "best.json").read_text())
    assert rec == {"round": best, "metric": "val/acc", "value": rows[best]["val/acc"], "higher_is_better": True,
                   "selected_on": "validation"}
    # the kept weights are that round's global model (its checkpoint's), not the last one's
    kept = load_file(selected_run / "best.safetensors")
    from fedsight.runs import unpack_state

    meta = json.loads((selected_run / "checkpoints" / f"round-{best:06d}.json").read_text())
    state = unpack_state(meta["state"], load_file(selected_run / "checkpoints" / f"round-{best:06d}.safetensors"))
    last = load_file(selected_run / "model.safetensors")
    assert kept.keys() == state["model"].keys()
    assert all(kept[k].equal(state["model"][k]) for k in kept)
    assert not all(kept[k].equal(last[k]) for k in kept)


def test_the_last_row_reports_the_selected_models_test_metrics(selected_run):
    rows = _rows(selected_run)
    best, final = _best_round(rows), rows[-1]
    assert final["selected/round"] == best and final["selected/val/acc"] == rows[best]["val/acc"]
    # the selected model evaluated on test at the end scores what it scored in its own round (same model and data)
    for key in ("test/acc", "test/loss", "test/acc/3"):
        assert final[f"selected/{key}"] == rows[best][key]
    assert final["test/acc"] != final["selected/test/acc"]  # test/* stays the last model's
    assert not any(k.startswith("selected/") for r in rows[:-1] for k in r)
    summary = (selected_run / "summary.md").read_text()
    line = (f"- **selected on validation:** round {best}, val/acc = {rows[best]['val/acc']:.4g}; its test metrics: "
            f"test/acc = {rows[best]['test/acc']:.4g}, test/loss = {rows[best]['test/loss']:.4g} (`best.safetensors`)")
    assert line in summary.splitlines()
    meta = json.loads((selected_run / "run.json").read_text())
    assert meta["metrics"]["selected/test/acc"] is True and meta["metrics"]["selected/test/loss"] is False


def test_last_is_the_default_and_logs_no_validation_metric(tmp_path):
    cfg = validate(tiny(**{"server.rounds": 1, "validation.source": "carve"}))
    assert cfg.eval.select == "last"
    execute(cfg, tmp_path / "run")
    assert not any(k.startswith(("val/", "selected/")) for k in _rows(tmp_path / "run")[-1])
    assert not (tmp_path / "run" / "best.json").exists()


def test_a_resumed_run_keeps_the_best_so_far_and_ends_as_an_uninterrupted_one(tmp_path, selected_run):
    cfg = validate(tiny(**{**SELECTING, "run.checkpoint_keep": 0}))
    rows = _rows(selected_run)
    best = _best_round(rows)
    run_dir = tmp_path / "run"
    assert execute(cfg, run_dir, stop_after=best).status == "stopped"
    assert json.loads((run_dir / "best.json").read_text())["round"] == best
    # a kill after the checkpoint, before the best files: the best so far is in the checkpoint, not lost
    (run_dir / "best.safetensors").unlink()
    (run_dir / "best.json").write_text('{"round": 1, "metric": "val/acc", "value": 0.0}')
    assert execute(cfg, run_dir).status == "complete"
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rs]  # noqa: E731
    assert strip(_rows(run_dir)) == strip(rows)  # bit-identical, the selected model's test metrics included
    assert (run_dir / "best.json").read_text() == (selected_run / "best.json").read_text()
    assert (run_dir / "best.safetensors").read_bytes() == (selected_run / "best.safetensors").read_bytes()


def test_a_lower_is_better_metric_selects_the_minimum(tmp_path):
    cfg = validate(tiny(**{**SELECTING, "server.rounds": 3, "eval.select_metric": "val/loss"}))
    execute(cfg, tmp_path / "run")
    rows = _rows(tmp_path / "run")
    low = min(r["val/loss"] for r in rows)
    rec = json.loads((tmp_path / "run" / "best.json").read_text())
    assert rec["metric"] == "val/loss" and rec["value"] == low and rec["higher_is_better"] is False
    assert rows[-1]["selected/val/loss"] == low


@pytest.mark.parametrize("over, words", [
    ({"eval.select": "best"}, ["eval.select = 'best' needs a server-held validation set", "validation.source"]),
    ({"eval.select": "best", "validation.source": "carve", "eval.select_metric": "test/acc"},
     ["eval.select_metric = 'test/acc'", "never on test data", "val/acc, val/loss"]),
    ({"eval.select": "best", "validation.source": "carve", "eval.select_metric": "val/miou"},
     ["eval.select_metric = 'val/miou'", "no such validation metric", "val/acc, val/loss"]),
    ({"eval.select": "best", "validation.source": "carve", "eval.select_metric": "val/acc/3"},
     ["no such validation metric"]),
    ({"validation.source": "carve", "eval.select_metric": "val/acc"}, ["eval.select = 'last'"]),
])
def test_bad_selection_settings_are_one_line_naming_the_key(over, words):
    with pytest.raises(ConfigError) as err:
        validate(tiny(**over))
    msg = str(err.value)
    assert len(msg.splitlines()) == 1 and all(w in msg for w in words), msg


def test_the_cli_refuses_selection_without_validation_and_writes_nothing(tmp_path):
    raw = tiny(**{"server.rounds": 1, "run.output_dir": str(tmp_path / "runs")})
    cfg = tmp_path / "c.toml"
    cfg.write_text(tomli_w.dumps(raw))
    res = CliRunner().invoke(app, ["run", str(cfg), "--set", "eval.select=best"])
    assert res.exit_code == 2, res.output
    assert "eval.select = 'best' needs a server-held validation set" in res.output
    assert not (tmp_path / "runs").exists()


def test_the_curves_leave_out_the_selected_models_numbers(selected_run, monkeypatch):
    import fedsight.reporting.plots as plots

    drawn = []

    def stop(keys, *args, **kw):
        drawn.extend(keys)
        raise StopIteration  # (no figure needed: which keys would be drawn is the point)

    monkeypatch.setattr(plots, "_panel_groups", stop)
    with pytest.raises(StopIteration):
        plots.plot_run(selected_run)
    assert "val/acc" in drawn and not [k for k in drawn if k.startswith("selected/")]


def test_a_tie_keeps_the_earlier_round_and_nan_never_wins():
    import torch

    from fedsight.model_selection import Selection

    sel = Selection("val/loss", higher=False)
    for r, v in enumerate([2.0, float("nan"), 1.5, 1.5, 1.7]):
        sel.offer(r, {"val/loss": v}, {"w": torch.full((2,), float(r))})
    assert (sel.round, sel.value) == (2, 1.5) and sel.model["w"].tolist() == [2.0, 2.0]
    assert not Selection("val/acc", higher=True).offer(0, {"val/acc": float("nan")}, {"w": torch.zeros(1)})


def test_the_python_api_reads_the_selection_back(selected_run):
    import torch

    from fedsight import load_run

    res = load_run(selected_run)
    best = _best_round(_rows(selected_run))
    assert res.selected["round"] == best and res.final["selected/round"] == best
    kept = load_file(selected_run / "best.safetensors")
    got = res.selected_model.state_dict()
    assert all(torch.equal(got[k], kept[k]) for k in kept)
    assert not all(torch.equal(res.model.state_dict()[k], kept[k]) for k in kept)


def test_evaluate_model_best_is_the_selected_model_of_a_real_selecting_run(selected_run):
    """``fedsight evaluate RUN --model best`` (cross-site evaluation) reads what ``eval.select = "best"`` wrote: the
    round best.json names, and the test metrics the run reported for its selected model."""
    from fedsight.crosseval import evaluate_run

    best = json.loads((selected_run / "best.json").read_text())
    last = _rows(selected_run)[-1]
    r, metrics = evaluate_run(selected_run, model="best")
    assert r == best["round"] == last["selected/round"] != last["round"]
    assert metrics["test/acc"] == pytest.approx(last["selected/test/acc"], abs=1e-12)


def test_the_selected_models_numbers_reach_tensorboard_and_the_comparison_table(tmp_path, selected_run):
    """What the docs promise beyond metrics.jsonl and summary.md: ``selected/*`` scalars in the TensorBoard event
    files at the last round, with metrics.jsonl's values, and ``selected/test/*`` rows in ``fedsight report``."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "tb"
    assert execute(validate(tiny(**{**SELECTING, "run.tensorboard": True})), run_dir).status == "complete"
    final = _rows(run_dir)[-1]
    ea = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    ea.Reload()
    for key in ("selected/round", "selected/val/acc", "selected/test/acc"):
        (event,) = ea.Scalars(key)
        assert event.step == final["round"] and event.value == pytest.approx(final[key], rel=1e-6)
    result = CliRunner().invoke(app, ["report", str(selected_run), "--out", str(tmp_path / "report")])
    assert result.exit_code == 0, result.output
    table = (tmp_path / "report" / "report.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| selected/test/acc"))
    assert f"{_rows(selected_run)[-1]['selected/test/acc']:.4f}" in row
