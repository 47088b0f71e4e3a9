"""MLflow tracking of runs (``run.mlflow = true``), read back with MLflow's own client."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import tomli_w
from typer.testing import CliRunner

pytest.importorskip("mlflow")
import mlflow  # noqa: E402
from mlflow.entities import Metric  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from fedsight.api import execute  # noqa: E402
from fedsight.cli import app  # noqa: E402
from fedsight.config import ConfigError, validate  # noqa: E402
from fedsight.errors import TrackingError  # noqa: E402
from fedsight.mlflow_tracking import MlflowLog, metric_name  # noqa: E402
from fuzz_helpers import cli, error_problems  # noqa: E402
from helpers import tiny  # noqa: E402


def _rows(run_dir):
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "event" not in r]


def _client(run_dir):
    rec = json.loads((run_dir / "mlflow.json").read_text())
    return MlflowClient(tracking_uri=rec["uri"]), rec["run_id"]


def _history(run_dir, key):
    client, run_id = _client(run_dir)
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, metric_name(key)))


def _expected(run_dir, key):
    return [(r["round"], pytest.approx(r[key], rel=1e-12)) for r in _rows(run_dir) if key in r]


def test_every_rounds_metrics_the_config_tags_and_plots_are_in_the_mlflow_run(tmp_path):
    cfg = validate(tiny(**{"server.rounds": 3, "eval.every": 1, "eval.initial": True, "run.mlflow": True,
                           "run.plots": True}))
    run_dir = tmp_path / "run"
    assert execute(cfg, run_dir).status == "complete"
    assert (run_dir / "mlflow").is_dir()  # the default store: inside the run directory
    for key in ("test/acc", "train/loss", "local/wma", "test/acc/3", "cost/total_up_bytes"):
        assert _history(run_dir, key) == _expected(run_dir, key), key
    assert [s for s, _ in _history(run_dir, "test/acc")] == [0, 1, 2, 3]
    client, run_id = _client(run_dir)
    mlflow.set_tracking_uri(json.loads((run_dir / "mlflow.json").read_text())["uri"])
    try:
        (found,) = mlflow.search_runs(experiment_names=["fedsight"], output_format="list")
    finally:
        mlflow.set_tracking_uri(None)
    assert found.info.run_id == run_id and found.info.status == "FINISHED"
    params, tags = found.data.params, found.data.tags
    assert params["train.lr"] == str(cfg.train.lr) and params["partition.name"] == "dirichlet"
    assert params["model.channels"] == "[8]" and params["seed"] == "0"
    assert tags["fedsight.seed"] == "0" and tags["fedsight.variant"] == "tiny" and tags["mlflow.runName"] == "tiny/seed0"
    assert len(tags.get("fedsight.commit", "0" * 40).removesuffix("-dirty")) == 40
    arts = {a.path for a in client.list_artifacts(run_id)} | {a.path for a in client.list_artifacts(run_id, "plots")}
    assert {"summary.md", "config.toml", "plots/curves.png"} <= arts


def test_a_stopped_and_resumed_run_logs_every_round_once(tmp_path):
    cfg = validate(tiny(**{"server.rounds": 3, "eval.every": 1, "run.mlflow": True}))
    run_dir = tmp_path / "run"
    assert execute(cfg, run_dir, stop_after=2).status == "stopped"
    client, run_id = _client(run_dir)
    assert client.get_run(run_id).info.status == "KILLED"
    assert [s for s, _ in _history(run_dir, "test/acc")] == [1, 2]
    assert execute(cfg, run_dir).status == "complete"
    assert _client(run_dir)[1] == run_id  # the same MLflow run, continued
    for key in ("test/acc", "train/loss", "clients/aggregated"):
        assert _history(run_dir, key) == _expected(run_dir, key), key
    assert client.get_run(run_id).info.status == "FINISHED"
    # read from another process as docs/tracking.md does (MLflow 3 opens a file store only with its opt-in)
    code = ("import json, os; os.environ.setdefault('MLFLOW_ALLOW_FILE_STORE', 'true'); "
            "from mlflow.tracking import MlflowClient; rec = json.load(open('mlflow.json')); "
            "c = MlflowClient(tracking_uri=rec['uri']); "
            "print(json.dumps([[m.step, m.value] for m in c.get_metric_history(rec['run_id'], 'test/acc')]))")
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_ALLOW_FILE_STORE"}
    out = subprocess.run([sys.executable, "-c", code], cwd=run_dir, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert [tuple(x) for x in json.loads(out.stdout)] == _expected(run_dir, "test/acc")


def test_a_round_checkpointed_but_not_logged_is_logged_on_resume(tmp_path, monkeypatch):
    cfg = validate(tiny(**{"server.rounds": 3, "eval.every": 1, "run.mlflow": True}))
    run_dir = tmp_path / "run"
    real = MlflowLog.round

    def killed_at_2(self, r, row):
        if r == 2:
            raise KeyboardInterrupt  # after round 2's checkpoint, before MLflow has it
        real(self, r, row)

    monkeypatch.setattr(MlflowLog, "round", killed_at_2)
    with pytest.raises(KeyboardInterrupt):
        execute(cfg, run_dir)
    assert [s for s, _ in _history(run_dir, "test/acc")] == [1]
    monkeypatch.setattr(MlflowLog, "round", real)
    assert execute(cfg, run_dir).status == "complete"
    assert _history(run_dir, "test/acc") == _expected(run_dir, "test/acc")
    assert [s for s, _ in _history(run_dir, "test/acc")] == [1, 2, 3]


def test_rounds_logged_past_the_checkpoint_start_a_new_mlflow_run(tmp_path):
    cfg = validate(tiny(**{"server.rounds": 3, "eval.every": 1, "run.mlflow": True}))
    run_dir = tmp_path / "run"
    execute(cfg, run_dir, stop_after=2)
    client, stale = _client(run_dir)
    # a session killed after logging round 3 past its last kept checkpoint: MLflow cannot drop that value
    client.log_batch(stale, metrics=[Metric("test/acc", -1.0, 0, 3)], synchronous=True)
    assert execute(cfg, run_dir).status == "complete"
    _, fresh = _client(run_dir)
    assert fresh != stale and client.get_run(stale).info.lifecycle_stage == "deleted"
    for key in ("test/acc", "train/loss"):
        assert _history(run_dir, key) == _expected(run_dir, key), key


def test_a_run_started_over_in_the_same_process_tracks_into_a_fresh_store(tmp_path):
    cfg = validate(tiny(**{"server.rounds": 1, "run.mlflow": True}))
    run_dir = tmp_path / "run"
    execute(cfg, run_dir)
    _, first = _client(run_dir)
    assert execute(cfg, run_dir, overwrite=True).status == "complete"  # the old folder, store included, is gone
    client, second = _client(run_dir)
    assert second != first and [r.info.run_id for r in client.search_runs(
        [client.get_experiment_by_name("fedsight").experiment_id])] == [second]
    assert _history(run_dir, "test/acc") == _expected(run_dir, "test/acc")


def test_turning_mlflow_on_at_resume_logs_the_earlier_rounds(tmp_path):
    run_dir = tmp_path / "run"
    execute(validate(tiny(**{"server.rounds": 3, "eval.every": 1})), run_dir, stop_after=2)
    assert not (run_dir / "mlflow.json").exists()
    execute(validate(tiny(**{"server.rounds": 3, "eval.every": 1, "run.mlflow": True})), run_dir)
    assert _history(run_dir, "test/acc") == _expected(run_dir, "test/acc")
    assert [s for s, _ in _history(run_dir, "test/acc")] == [1, 2, 3]


def test_a_shared_store_holds_a_sweeps_runs_side_by_side(tmp_path):
    store = (tmp_path / "shared").as_uri()
    for seed in (0, 1):
        execute(validate(tiny(**{"seed": seed, "server.rounds": 1, "run.mlflow": True, "run.mlflow_uri": store,
                                 "run.mlflow_experiment": "sweep"})), tmp_path / f"seed{seed}")
    client = MlflowClient(tracking_uri=store)
    runs = client.search_runs([client.get_experiment_by_name("sweep").experiment_id])
    assert sorted(r.data.tags["fedsight.seed"] for r in runs) == ["0", "1"]
    assert not (tmp_path / "seed0" / "mlflow").exists()
    assert {json.loads((tmp_path / f"seed{s}" / "mlflow.json").read_text())["run_id"] for s in (0, 1)} == \
        {r.info.run_id for r in runs}
    acc = [m.value for m in client.get_metric_history(runs[0].info.run_id, "test/acc")]
    assert len(acc) == 1 and math.isfinite(acc[0])


def test_mlflow_without_the_extra_fails_at_validation_and_the_cli_writes_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr("fedsight.mlflow_tracking.available", lambda: False)
    with pytest.raises(ConfigError, match=r"run.mlflow = True: needs the mlflow extra: pip install 'fedsight\[mlflow\]'"):
        validate(tiny(**{"run.mlflow": True}))
    cfg = tmp_path / "c.toml"
    cfg.write_text(tomli_w.dumps(tiny(**{"server.rounds": 1, "run.output_dir": str(tmp_path / "runs")})))
    res = CliRunner().invoke(app, ["run", str(cfg), "--set", "run.mlflow=true"])
    assert res.exit_code == 2 and "needs the mlflow extra" in res.output, res.output
    assert not (tmp_path / "runs").exists()


def test_mlflow_settings_without_mlflow_are_refused():
    with pytest.raises(ConfigError, match=r"run.mlflow_uri is set but run.mlflow = false"):
        validate(tiny(**{"run.mlflow_uri": "sqlite:///x.db"}))


def test_a_run_without_mlflow_never_imports_it(tmp_path, monkeypatch):
    plain, tracked = (validate(tiny(**{"server.rounds": 1, "run.mlflow": on})) for on in (False, True))
    monkeypatch.setitem(sys.modules, "mlflow", None)  # any `import mlflow` now raises ImportError
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    assert execute(plain, tmp_path / "run").status == "complete"
    with pytest.raises(TrackingError, match="import of mlflow"):  # (the check can fail: a tracked run imports it)
        execute(tracked, tmp_path / "tracked")


def test_an_unreachable_store_stops_the_run_before_its_first_round_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # MLflow's own retries would take minutes
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    uri = "http://127.0.0.1:9"  # the discard port: nothing listens there
    cfg = tmp_path / "c.toml"
    cfg.write_text(tomli_w.dumps(tiny(**{"server.rounds": 2, "run.output_dir": str(tmp_path / "runs"),
                                         "run.mlflow": True, "run.mlflow_uri": uri})))
    res = cli(["run", str(cfg)])  # the console script's function, its error boundary included
    assert error_problems(res, codes=(1,)) == [] and f"error: MLflow tracking at {uri}: " in res.err, res.show()
    run_dir = next((tmp_path / "runs").rglob("run.json")).parent
    rounds = [r["round"] for r in _rows(run_dir)] if (run_dir / "metrics.jsonl").exists() else []
    assert max(rounds, default=0) == 0 and not list(run_dir.glob("checkpoint*"))  # no round trained


def test_a_failure_mid_run_stops_after_the_rounds_checkpoint_marks_the_run_failed_and_resumes(tmp_path, monkeypatch):
    cfg = validate(tiny(**{"server.rounds": 3, "eval.every": 1, "run.mlflow": True}))
    run_dir = tmp_path / "run"
    real = MlflowLog._log

    def store_gone_at_2(self, values):
        if any(r == 2 for _, _, r in values):
            raise OSError("connection reset by peer")  # as the client's call into an unreachable store
        real(self, values)

    monkeypatch.setattr(MlflowLog, "_log", store_gone_at_2)
    with pytest.raises(TrackingError, match=r"MLflow tracking at .*connection reset by peer"):
        execute(cfg, run_dir)
    client, run_id = _client(run_dir)
    assert client.get_run(run_id).info.status == "FAILED"
    assert [r["round"] for r in _rows(run_dir)][-1] == 2  # round 2 was checkpointed before MLflow failed
    monkeypatch.setattr(MlflowLog, "_log", real)
    assert execute(cfg, run_dir).status == "complete"
    assert client.get_run(run_id).info.status == "FINISHED"
    assert [s for s, _ in _history(run_dir, "test/acc")] == [1, 2, 3]
    assert _history(run_dir, "test/acc") == _expected(run_dir, "test/acc")
