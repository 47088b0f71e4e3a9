"""Every client's local-test metrics of every evaluated round, in RUN_DIR/client_metrics.jsonl."""

import json

import pytest

from fedsight.api import execute
from fedsight.config import validate
from fedsight.runs import RunDir
from helpers import tiny


def test_client_metrics_are_the_numbers_behind_local_wma_and_survive_a_resume(tmp_path):
    cfg = validate(tiny(**{"server.rounds": 4, "eval.every": 2}))
    full = execute(cfg, tmp_path / "full").run_dir
    records = RunDir(full).read_client_metrics()
    rows = {r["round"]: r for r in RunDir(full).read_metrics() if "event" not in r}
    assert [c["round"] for c in records] == [2, 4]
    for rec in records:
        clients = rec["clients"]
        assert len(clients) == 6  # tiny(): 6 clients, each with a local test set
        n = sum(c["n"] for c in clients.values())
        wma = sum(c["n"] * c["acc"] for c in clients.values()) / n  # thesis eq. 4.4, from the per-client values
        assert wma == pytest.approx(rows[rec["round"]]["local/wma"], rel=1e-12)
        assert min(c["acc"] for c in clients.values()) == pytest.approx(rows[rec["round"]]["local/worst10"])
    assert not any(r.get("event") == "client_metrics" for r in RunDir(full).read_metrics())
    cut = tmp_path / "cut"
    execute(cfg, cut, stop_after=3)
    with open(cut / "client_metrics.jsonl", "a") as f:  # a killed session wrote round 4 after its checkpoint
        f.write(json.dumps({"round": 4, "stage": "federated", "clients": {"0": {"n": 1, "acc": -1.0}}}) + "\n")
    (cut / "status.json").write_text(json.dumps({"state": "running", "round": 3, "rounds": 4}))
    execute(cfg, cut, resume=True)
    assert RunDir(cut).read_client_metrics() == records
