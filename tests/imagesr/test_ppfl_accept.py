"""PPFL-RDSN's client-side acceptance (section 3, "Local EtLC"): the performance test of the received model against
the client's own, and the two fallbacks after a refusal (keep the own model; re-initiate local training).

Expected values are read off the client state store and the models themselves (bit-for-bit equality, FedAvg's mean
written out by hand), never from the component's own helpers.
"""

import dataclasses

import pytest
import torch
from helpers import ToyTask, toy_sim, tiny

from fedsight.api import build_simulation
from fedsight.config import validate
from fedsight.recipe import ppfl
from fedsight.recipe.ppfl_accept import OWN, PerfTest, PerfTestParams

KEY = "00112233445566778899aabbccddeeff"

SR = {
    "seed": 0,
    "run": {"name": "acc", "output_dir": "runs", "checkpoint_keep": 0, "plots": False},
    "task": {"name": "image_sr"},
    "data": {"name": "builtin_sr", "sources": ["chelsea", "coffee"], "tile": 32, "train_max_side": 96, "scale": 2,
             "patch_size": 8, "test_sets": {"photos": ["flower"]}, "test_max_side": 32},
    "partition": {"name": "iid", "num_clients": 3, "local_test_fraction": 0.0},
    "model": {"name": "rdsn", "features": 8, "blocks": 1, "layers": 2, "growth": 4},
    "train": {"steps": 3, "batch_size": 4, "lr": 0.001},
    "server": {"rounds": 3, "clients_per_round": 3},
    "eval": {"every": 10, "initial": False, "local": False},
    "engine": {"threads": 1},
}


def sr_sim(components):
    raw = {**SR, "recipe": {"components": [*components, {"name": "local_adam"}]}}
    return build_simulation(validate(raw))


def degrade(model, seed=1):
    """A poisoned global model: every parameter replaced by noise."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def own_models(sim):
    return {c: sim.store.get(OWN, c) for c in range(3)}


def run_rounds(sim, **kw):
    rows, events = [], []
    sim.run(on_round=lambda r, row, ev: (rows.append(row), events.extend(ev)), **kw)
    return rows, events


def test_an_honest_aggregate_passes_and_a_degraded_one_is_refused_keeping_the_own_model_bit_for_bit():
    sim = sr_sim([{"name": "perf_test", "examples": 8}])
    rows, events = run_rounds(sim, stop_after=2)
    # round 1: no own model yet, nothing tested; round 2: the honest aggregate passes the test
    assert "perf/received" not in rows[0] and rows[1]["perf/received"] >= rows[1]["perf/own"] - 0.5
    assert rows[0]["clients/refused"] == rows[1]["clients/refused"] == 0
    assert not [e for e in events if e["event"] == "model_refused"]
    before = own_models(sim)
    assert all(v is not None for v in before.values())
    g_before = {k: v.clone() for k, v in sim.global_model.state_dict().items()}
    degrade(sim.global_model)
    g_bad = {k: v.clone() for k, v in sim.global_model.state_dict().items()}
    assert any(not torch.equal(g_before[k], g_bad[k]) for k in g_bad)
    rows, events = run_rounds(sim)
    refused = [e for e in events if e["event"] == "model_refused"]
    assert sorted(e["client"] for e in refused) == [0, 1, 2] and rows[-1]["clients/refused"] == 3
    assert all(e["fallback"] == "keep_own" and e["received"] < e["own"] - 0.5 for e in refused)
    assert "performance test failed: psnr" in refused[0]["reason"]
    after = own_models(sim)
    for c in range(3):  # the clients keep their own models, bit for bit
        assert before[c].keys() == after[c].keys()
        assert all(torch.equal(before[c][k], after[c][k]) for k in before[c]), c
    # nobody trained: the (poisoned) global model is not moved by anyone's update
    assert all(torch.equal(sim.global_model.state_dict()[k], g_bad[k]) for k in g_bad)


def test_reinitiate_trains_from_the_own_model_and_fedavg_averages_the_own_models():
    """With lr = 0 local training moves nothing, so each upload is (own - received) and FedAvg's new global is the
    data-size-weighted mean of the clients' own models, whatever the server sent."""
    comp = PerfTest(PerfTestParams(metric="loss", tolerance=0.0, fallback="reinitiate", from_round=2))
    task = ToyTask(sizes=(4, 6, 5))
    sim = toy_sim(components=[comp], task=task, lr=0.5, steps=2, rounds=3)
    sim.run(stop_after=1)
    own = {c: sim.store.get(OWN, c) for c in range(3)}
    assert all(v is not None for v in own.values())
    with torch.no_grad():  # the server sends a model much worse than every client's own
        for p in sim.global_model.parameters():
            p.mul_(0).add_(5.0)
    sim.stages[0].local = dataclasses.replace(sim.stages[0].local, lr=0.0)
    rows = []
    sim.run(stop_after=2, on_round=lambda r, row, ev: rows.append(row))
    assert rows[-1]["clients/refused"] == 3
    n = torch.tensor([4.0, 6.0, 5.0])
    for k, v in sim.global_model.state_dict().items():
        want = sum(n[c] * own[c][k] for c in range(3)) / n.sum()
        assert torch.allclose(v, want, atol=1e-6), k


def test_reinitiate_without_an_own_model_reinitialises_theta0():
    """A client refused before it ever trained (the watermark refuses a substituted model in round 1 here) starts
    from a fresh initialisation drawn from its own stream: not the received model, the same on a rerun, another for
    another client."""
    from fedsight.recipe.ppfl_accept import reinitialise
    from fedsight.training import ClientContext

    task = ToyTask()
    params = ppfl.WatermarkParams(key=KEY, p=0.5, min_carriers=2, beta=1.0, verify_from=1, fallback="reinitiate")
    comp = ppfl.Watermark(params)
    starts = []
    for client in (0, 0, 1):
        torch.manual_seed(0)
        model = task.build_model()
        received = {k: v.clone() for k, v in model.state_dict().items()}
        ctx = ClientContext(client_id=client, round=1, model=model, global_params={}, num_examples=4, seed=7,
                            global_state=received)
        comp.client_start(ctx)  # an unmarked model: S ~ 0 < beta / 2
        assert ctx.scratch["clients/refused"]["from"] == "init"
        start = model.state_dict()
        assert not torch.equal(start["head.weight"], received["head.weight"])
        bound = 1 / task.dim ** 0.5  # nn.Linear's reset_parameters: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
        assert float(start["head.weight"].abs().max()) <= bound
        starts.append(start)
    assert torch.equal(starts[0]["head.weight"], starts[1]["head.weight"])
    assert not torch.equal(starts[0]["head.weight"], starts[2]["head.weight"])
    torch.manual_seed(0)
    again = task.build_model()
    reinitialise(again, 7, 1, 0)
    assert torch.equal(again.state_dict()["head.weight"], starts[0]["head.weight"])


def test_watermark_reinitiate_fallback_in_a_run_trains_the_refusing_clients():
    raw = tiny(**{"server.rounds": 3, "eval.every": 10, "train.epochs": 3, "model.channels": [16],
                  "model.hidden": 64, "engine.threads": 1})
    raw["recipe"] = {"components": [{"name": "watermark", "key": KEY, "p": 0.1, "beta": 0.05,
                                     "fallback": "reinitiate"}]}
    sim = build_simulation(validate(raw))
    rows, events = run_rounds(sim, stop_after=2)
    assert [r["clients/refused"] for r in rows] == [0, 0]
    with torch.no_grad():  # a malicious server substitutes a fresh model
        for p in sim.global_model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    rows2, events2 = run_rounds(sim)
    assert rows2[-1]["clients/refused"] == 3 and rows2[-1]["clients/aggregated"] == 3
    assert not [e for e in events2 if e["event"] == "model_refused"]  # they trained instead of skipping
    assert rows2[-1]["wm/local_score"] > 0.025  # trained from their own (marked) models


def test_perf_test_psnr_needs_image_outputs():
    from fedsight.errors import ConfigError

    comp = PerfTest(PerfTestParams(metric="psnr", tolerance=0.0))
    sim = toy_sim(components=[comp], task=ToyTask(), rounds=2)
    with pytest.raises(ConfigError, match='perf_test: metric = "psnr" needs RGB image outputs'):
        sim.run()


def test_psnr_on_a_task_without_image_outputs_is_refused_when_the_run_is_configured():
    from fedsight.errors import ConfigError

    raw = tiny()
    raw["recipe"] = {"components": [{"name": "perf_test"}]}
    with pytest.raises(ConfigError, match=r"'perf_test' with metric = \"psnr\" needs an image task .*not task 'classification'"):
        validate(raw)
    raw["recipe"] = {"components": [{"name": "perf_test", "metric": "loss"}]}
    validate(raw)
