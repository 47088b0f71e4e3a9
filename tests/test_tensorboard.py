"""TensorBoard event files of a run, read back with TensorBoard's own event reader."""

import json
import math

import pytest

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.plugins.hparams import plugin_data_pb2  # noqa: E402

from fedsight.api import execute  # noqa: E402
from fedsight.config import ConfigError, validate  # noqa: E402
from helpers import tiny  # noqa: E402


def _read(folder):
    ea = EventAccumulator(str(folder), size_guidance={"images": 0, "scalars": 0, "tensors": 0})
    ea.Reload()
    return ea


def _rows(run_dir):
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "event" not in r]


def test_every_rounds_metrics_plots_and_hparams_are_in_the_event_files(tmp_path):
    cfg = validate(tiny(**{"server.rounds": 3, "eval.every": 1, "run.tensorboard": True, "run.plots": True}))
    run_dir = tmp_path / "run"
    assert execute(cfg, run_dir).status == "complete"
    ea = _read(run_dir / "tensorboard")
    rows = _rows(run_dir)
    for key in ("test/acc", "train/loss", "local/wma"):
        logged = [(e.step, e.value) for e in ea.Scalars(key)]
        assert [s for s, _ in logged] == [r["round"] for r in rows]
        assert all(math.isclose(v, r[key], rel_tol=1e-6) for (_, v), r in zip(logged, rows))
    assert "plots/curves" in ea.Tags()["images"]
    hp = _read(run_dir / "tensorboard" / "hparams")
    start = hp.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(start).session_start_info.hparams
    assert hparams["train.lr"].number_value == cfg.train.lr and hparams["partition.name"].string_value == "dirichlet"
    assert math.isclose(hp.Scalars("final/test/acc")[-1].value, rows[-1]["test/acc"], rel_tol=1e-6)


def test_a_resumed_run_logs_every_round_once_with_the_values_of_metrics_jsonl(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    cfg = validate(tiny(**{"server.rounds": 4, "eval.every": 1, "run.tensorboard": True}))
    run_dir = tmp_path / "run"
    execute(cfg, run_dir, stop_after=2)
    stale = SummaryWriter(str(run_dir / "tensorboard"))  # a killed session logged round 3 after its checkpoint
    stale.add_scalar("test/acc", -1.0, 3)
    stale.close()
    assert execute(cfg, run_dir).status == "complete"
    ea = _read(run_dir / "tensorboard")
    logged = [(e.step, e.value) for e in ea.Scalars("test/acc")]
    assert logged == [(r["round"], pytest.approx(r["test/acc"], rel=1e-6)) for r in _rows(run_dir)]


def test_tensorboard_turned_on_at_resume_holds_the_earlier_rounds_too(tmp_path):
    """Turned on for a resumed run, the event files held only this session's rounds (MLflow logged the earlier
    ones); on, off and on again, the rounds of the session without it were missing."""
    run_dir = tmp_path / "run"
    raw = tiny(**{"server.rounds": 6, "eval.every": 1})
    execute(validate(raw), run_dir, stop_after=2)
    execute(validate({**raw, "run": {**raw.get("run", {}), "tensorboard": True}}), run_dir, stop_after=3)
    execute(validate(raw), run_dir, stop_after=4)  # a session without it
    assert execute(validate({**raw, "run": {**raw.get("run", {}), "tensorboard": True}}), run_dir).status == "complete"
    ea = _read(run_dir / "tensorboard")
    for key in ("test/acc", "train/loss"):
        logged = [(e.step, e.value) for e in ea.Scalars(key)]
        assert logged == [(r["round"], pytest.approx(r[key], rel=1e-6)) for r in _rows(run_dir) if key in r], key
    assert [e.step for e in ea.Scalars("test/acc")] == [1, 2, 3, 4, 5, 6]


def test_tensorboard_without_the_package_fails_at_validation(monkeypatch):
    monkeypatch.setattr("fedsight.tensorboard.available", lambda: False)
    with pytest.raises(ConfigError, match=r"run.tensorboard = True: needs the tensorboard package"):
        validate(tiny(**{"run.tensorboard": True}))
    assert validate(tiny()).run.tensorboard is False
