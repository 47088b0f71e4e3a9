"""A SuperNode trains on its node config's ``device`` (else the run's ``engine.device``)."""

from __future__ import annotations

import json

import pytest
import torch

from fedsight.config import validate

from flower_direct import run_direct
from helpers import tiny

pytestmark = pytest.mark.flower

RUN = {"partition.num_clients": 3, "server.clients_per_round": 3, "server.rounds": 1, "eval.local": False,
       "engine.threads": 1}


def test_a_node_trains_where_its_node_config_says(tmp_path, monkeypatch):
    from fedsight.engine import client_runtime

    seen = []
    real = client_runtime.ClientRuntime.__init__

    def spy(self, task, stages, seed, store, device="cpu", *args, **kwargs):
        seen.append(str(device))
        real(self, task, stages, seed, store, device, *args, **kwargs)

    monkeypatch.setattr(client_runtime.ClientRuntime, "__init__", spy)
    cfg = validate(tiny(**RUN))
    bad = "cuda:7" if not torch.cuda.is_available() else "cuda:999"  # a device this machine does not have
    extra = [{"device": "cpu"}, {"device": bad}, {}]
    run_direct(cfg, tmp_path / "flower", tmp_path / "nodes", node_extra=extra, options={"round-timeout": 5})
    rows = [json.loads(x) for x in (tmp_path / "flower" / "metrics.jsonl").read_text().splitlines()]
    lost = [r for r in rows if r.get("event") == "client_lost"]
    # node 1 asked for a device it does not have: its ClientApp refuses, naming the setting; the round goes on
    assert [e["client"] for e in lost] == [1] and "node config device" in lost[0]["reason"] and bad in lost[0]["reason"]
    assert rows[-1]["clients/aggregated"] == 2
    assert "cpu" in seen  # node 0 (and node 2, by the run's "auto" on this machine) built their runtimes
