"""Client failure as a setting of the in-process engine: dropout, stragglers past a deadline and min_clients;
runs complete under FedAvg, SCAFFOLD and Krum with the events in metrics.jsonl and the summary."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fedsight.api import build_simulation, execute
from fedsight.config import ConfigError, validate
from fedsight.engine.loop import client_speed
from fedsight.engine.plan import sample_clients

from helpers import tiny

BASE = {"server.rounds": 3, "server.clients_per_round": 6, "eval.every": 3}


def _events(run_dir, kind):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("event") == kind], [r for r in rows if "event" not in r]


@pytest.mark.parametrize("recipe", [{}, {"recipe.components": ["scaffold"]},
                                    {"recipe.aggregator": {"name": "krum", "byzantine": 0}}])
def test_thirty_percent_dropout_completes_and_is_logged(tmp_path, recipe) -> None:
    out = execute(validate(tiny(**{**BASE, "server.dropout": 0.3, **recipe})), tmp_path / "r")
    assert out.status == "complete"
    lost, rows = _events(out.run_dir, "client_lost")
    assert lost and all(e["reason"].startswith("dropped out") for e in lost)
    for row in rows:  # every sampled client either arrived (and was aggregated) or is a lost event of its round
        mine = [e for e in lost if e["round"] == row["round"]]
        skipped = row["clients/aggregated"] == 0
        assert skipped or row["clients/aggregated"] + len(mine) == row["clients/sampled"]
    summary = (out.run_dir / "summary.md").read_text()
    assert "## Events" in summary and f"| client_lost | {len(lost)} |" in summary


def test_dropped_clients_do_not_train_nor_keep_state() -> None:
    """SCAFFOLD stores c_i for every client that trained and was accepted; a client that dropped out in every
    round it was sampled holds none, and a run at dropout 0 differs from one with dropouts."""
    cfg = validate(tiny(**{**BASE, "server.rounds": 2, "server.dropout": 0.5, "recipe.components": ["scaffold"]}))
    sim = build_simulation(cfg)
    log = []
    sim.run(on_round=lambda r, row, ev: log.extend(ev))
    lost = {(e["round"], e["client"]) for e in log if e["event"] == "client_lost"}
    arrived = {c for r in (1, 2) for c in sample_clients(0, r, 6, 6) if (r, c) not in lost}
    assert lost and sorted(sim.store.clients("scaffold")) == sorted(arrived)


def test_stragglers_past_the_deadline_are_lost_and_the_rest_aggregated(tmp_path) -> None:
    """Speeds LogNormal(0, 1) per client; an update whose local steps over the client's speed exceed the
    deadline is lost with the reason; the others are aggregated."""
    cfg = validate(tiny(**{**BASE, "server.speed_sigma": 1.0, "server.deadline": 12.0}))
    sim = build_simulation(cfg)
    steps = {}

    from fedsight.training import Component

    class Steps(Component):
        name = "steps_spy"

        def client_end(self, ctx, result):
            steps[(ctx.round, ctx.client_id)] = result.num_steps

    sim.server.stages[0].recipe.components.append(Steps())  # (the client runtime shares the stage objects)
    log = []
    sim.run(on_round=lambda r, row, ev: log.append((row, ev)))
    speeds = np.array([client_speed(0, c, 1.0) for c in range(6)])
    assert speeds.min() < 1 < speeds.max()  # the test needs slow and fast clients
    slow = {k for k, n in steps.items() if n / speeds[k[1]] > 12.0}
    lost = {(e["round"], e["client"]) for _, ev in log for e in ev if e["event"] == "client_lost"}
    assert slow and lost == slow
    assert all("straggler" in e["reason"] for _, ev in log for e in ev if e["event"] == "client_lost")


def test_min_clients_skips_a_round_and_leaves_the_model() -> None:
    cfg = validate(tiny(**{**BASE, "server.rounds": 1, "server.dropout": 0.7, "server.min_clients": 6}))
    sim = build_simulation(cfg)
    before = {k: v.clone() for k, v in sim.global_model.state_dict().items()}
    log = []
    sim.run(on_round=lambda r, row, ev: log.append((row, ev)))
    row, events = log[0]
    kinds = [e["event"] for e in events]
    assert "too_few_clients" in kinds and "round_skipped" in kinds and row["clients/aggregated"] == 0
    assert all(torch.equal(v, before[k]) for k, v in sim.global_model.state_dict().items())


def test_min_clients_above_the_sampled_clients_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="min_clients = 7 exceeds"):
        validate(tiny(**{**BASE, "server.min_clients": 7}))
