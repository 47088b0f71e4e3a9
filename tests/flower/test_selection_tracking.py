"""Model selection (``eval.select = "best"``) and MLflow tracking on the Flower path: the ServerApp selects on the
server-held validation set exactly as the simulator does, and tracks every round once."""

from __future__ import annotations

import json

import pytest

from fedsight.api import execute
from fedsight.config import validate

from flower_direct import run_direct
from helpers import tiny

pytestmark = pytest.mark.flower


def _rows(run_dir):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "flower/"))}
            for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "event" not in r]


def test_selection_and_mlflow_over_flower_messages_equal_in_process(tmp_path):
    mlflow_tracking = pytest.importorskip("mlflow.tracking")
    cfg = validate(tiny(**{"partition.num_clients": 3, "server.clients_per_round": 2, "server.rounds": 3,
                           "eval.every": 1, "eval.local": False, "engine.threads": 1, "train.lr": 0.5,
                           "eval.select": "best", "validation.source": "carve", "run.mlflow": True}))
    execute(cfg, tmp_path / "inproc")
    run_direct(cfg, tmp_path / "flower", tmp_path / "nodes")
    assert _rows(tmp_path / "flower") == _rows(tmp_path / "inproc")
    assert "selected/test/acc" in _rows(tmp_path / "flower")[-1]
    for name in ("best.json", "best.safetensors"):
        assert (tmp_path / "flower" / name).read_bytes() == (tmp_path / "inproc" / name).read_bytes()
    rec = json.loads((tmp_path / "flower" / "mlflow.json").read_text())
    client = mlflow_tracking.MlflowClient(tracking_uri=rec["uri"])
    assert client.get_run(rec["run_id"]).info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(rec["run_id"], "val/acc")] == [1, 2, 3]
