"""Engine equivalences: FedAvg is the weighted mean, one client is plain training, resume and seeds."""

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedsight.api import build_simulation, execute
from fedsight.config import validate
from fedsight.training import Component
from fedsight.rng import torch_gen
from fedsight.runs import RunDir

from helpers import tiny


class Recorder(Component):
    """Records each client's local parameters (received global + delta)."""

    name = "recorder"

    def __init__(self):
        self.local = {}

    def client_end(self, ctx, result):
        self.local[ctx.client_id] = (
            result.num_examples,
            {k: (ctx.global_params[k] + d).clone() for k, d in result.delta.items()},
        )


def test_server_sgd_lr1_equals_weighted_mean_of_client_models():
    cfg = validate(tiny(**{"server.clients_per_round": 6, "server.rounds": 1}))
    sim = build_simulation(cfg)
    rec = Recorder()
    sim.recipe.components.append(rec)
    sim.run()
    assert sorted(rec.local) == list(range(6))
    n = np.array([rec.local[c][0] for c in range(6)], dtype=np.float64)
    for name, p in sim.global_model.named_parameters():
        stack = np.stack([rec.local[c][1][name].numpy() for c in range(6)])
        ref = np.average(stack, axis=0, weights=n)
        np.testing.assert_allclose(p.detach().numpy(), ref, rtol=1e-5, atol=1e-6)


def test_one_client_one_round_equals_plain_local_training():
    cfg = validate(
        tiny(**{"partition.name": "iid", "partition.num_clients": 1, "server.rounds": 1, "server.clients_per_round": 1,
                "train.epochs": 2, "eval.local": False})
    )
    sim = build_simulation(cfg)
    # a plain PyTorch loop from the same initial weights over the client's data
    model = sim.task.build_model()
    model.load_state_dict(sim.global_model.state_dict())
    task = sim.task
    x, y = task.train_batch(0, torch.arange(task.num_train_examples(0)))
    opt = torch.optim.SGD(model.parameters(), lr=cfg.train.lr)
    g = torch_gen(cfg.seed, "shuffle", 1, 0)  # the engine's documented shuffle stream
    for _ in range(2):
        perm = torch.randperm(len(y), generator=g)
        for s in range(0, len(y), cfg.train.batch_size):
            idx = perm[s : s + cfg.train.batch_size]
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    sim.run()
    for (name, a), b in zip(sim.global_model.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)


def test_round_zero_evaluates_the_initial_model_and_changes_no_later_round(tmp_path):
    """Every run evaluates the model it starts from as round 0 (``eval.initial``): the row holds exactly what
    an evaluation of the initial weights gives, and rounds 1.. are bit-identical to a run without it."""
    raw = tiny(**{"server.rounds": 3, "server.clients_per_round": 3, "eval.initial": True})
    on = execute(validate(raw), tmp_path / "on")
    off = execute(validate(tiny(**{"server.rounds": 3, "server.clients_per_round": 3})), tmp_path / "off")
    rows_on = [r for r in _final(on.run_dir)[2] if "event" not in r]
    rows_off = [r for r in _final(off.run_dir)[2] if "event" not in r]
    assert [r["round"] for r in rows_on] == [0, 1, 2, 3] and [r["round"] for r in rows_off] == [1, 2, 3]
    assert rows_on[1:] == rows_off
    sim = build_simulation(validate(raw))  # untrained: the seeded initial model
    expected = sim.evaluate()
    assert {k: v for k, v in rows_on[0].items() if "/" in k} == pytest.approx(expected, rel=0, abs=0)
    assert rows_on[0]["test/acc"] != rows_on[-1]["test/acc"]
    client_rounds = [r["round"] for r in RunDir(on.run_dir).read_client_metrics()]
    assert client_rounds[0] == 0 and client_rounds == [r["round"] for r in rows_on if "test/acc" in r]


def test_a_run_killed_after_its_round_zero_evaluation_resumes_without_a_second_one(tmp_path):
    cfg = validate(tiny(**{"server.rounds": 2, "eval.initial": True}))
    execute(cfg, tmp_path / "full")
    run = RunDir(tmp_path / "cut")
    seen = []

    def kill_after_round_zero(r, row):
        seen.append(r)
        if r == 0:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        execute(cfg, run.path, on_round=kill_after_round_zero)
    assert seen == [0] and [r["round"] for r in run.read_metrics() if "event" not in r] == [0]
    execute(cfg, run.path, resume=True)
    full = [r for r in _final(tmp_path / "full")[2] if "event" not in r]
    cut = [r for r in _final(run.path)[2] if "event" not in r]
    assert [r["round"] for r in cut] == [0, 1, 2] and cut == full


def _final(run_dir):
    run = RunDir(run_dir)
    rnd, state = run.load_latest_checkpoint()
    rows = [{k: v for k, v in r.items() if not k.startswith("time/")} for r in run.read_metrics()]
    return rnd, state["model"], rows


def test_resume_after_interruption_is_bit_identical(tmp_path):
    raw = tiny(**{"server.optimizer": {"name": "fedadam", "lr": 0.01}, "server.rounds": 4, "eval.initial": True})
    cfg = validate(raw)
    execute(cfg, tmp_path / "full")
    out = execute(cfg, tmp_path / "cut", stop_after=2)
    assert out.status == "stopped"
    # a kill after round 3's metrics line but before its checkpoint: the line must be dropped on resume
    RunDir(tmp_path / "cut").append_metrics({"round": 3, "stage": "federated", "test/acc": -1.0})
    out = execute(cfg, tmp_path / "cut", resume=True)
    assert out.status == "complete"
    ra, ma, rows_a = _final(tmp_path / "full")
    rb, mb, rows_b = _final(tmp_path / "cut")
    assert ra == rb == 4
    for k in ma:
        assert torch.equal(ma[k], mb[k]), k
    assert rows_a == rows_b
    assert [r["round"] for r in rows_b] == [0, 1, 2, 3, 4]


def test_same_seed_same_numbers_other_seed_differs(tmp_path):
    a = execute(validate(tiny()), tmp_path / "a")
    b = execute(validate(tiny()), tmp_path / "b")
    c = execute(validate(tiny(seed=1)), tmp_path / "c")
    _, ma, ra = _final(a.run_dir)
    _, mb, rb = _final(b.run_dir)
    _, mc, _ = _final(c.run_dir)
    assert all(torch.equal(ma[k], mb[k]) for k in ma) and ra == rb
    assert not all(torch.equal(ma[k], mc[k]) for k in ma)


def test_rerun_of_same_config_skips_and_other_config_is_refused(tmp_path, monkeypatch):
    from fedsight import api

    cfg = validate(tiny(**{"server.rounds": 2}))
    assert execute(cfg, tmp_path / "r").status == "complete"
    assert api.is_complete(cfg, tmp_path / "r") and not api.is_complete(cfg, tmp_path / "none")

    def build(*a, **kw):
        raise AssertionError("a complete run is skipped before its data is loaded")

    with monkeypatch.context() as m:
        m.setattr(api, "build_simulation", build)
        assert execute(cfg, tmp_path / "r").status == "skipped"
    other = validate(tiny(**{"server.rounds": 3}))
    assert not api.is_complete(other, tmp_path / "r")
    try:
        execute(other, tmp_path / "r")
    except ValueError as exc:
        assert "different config" in str(exc)
    else:
        raise AssertionError("a different config must not overwrite a run directory")
    assert json.loads((tmp_path / "r" / "config.json").read_text())["server"]["rounds"] == 2


def test_run_written_before_a_section_existed_is_still_the_same_config(tmp_path):
    cfg = validate(tiny(**{"server.rounds": 2}))
    assert execute(cfg, tmp_path / "r").status == "complete"
    path = tmp_path / "r" / "config.json"
    old = json.loads(path.read_text())
    del old["pretrain"], old["train"]["temperature"]  # as written by an older FedSight
    path.write_text(json.dumps(old))
    assert execute(cfg, tmp_path / "r").status == "skipped"
    old["pretrain"] = {"source": "bogus"}  # not valid any more: a different config, refused
    path.write_text(json.dumps(old))
    with pytest.raises(ValueError, match="different config"):
        execute(cfg, tmp_path / "r")


class Poison(Component):
    name = "poison"

    def client_end(self, ctx, result):
        if ctx.client_id == min(self.victims):
            for v in result.delta.values():
                v.fill_(float("nan"))

    victims = ()


def test_non_finite_update_is_rejected_and_reported(tmp_path):
    cfg = validate(tiny(**{"server.rounds": 1, "server.clients_per_round": 6}))
    sim = build_simulation(cfg)
    p = Poison()
    p.victims = (2,)
    sim.recipe.components.append(p)
    rows, events = [], []
    sim.run(on_round=lambda r, row, ev: (rows.append(row), events.extend(ev)))
    assert rows[0]["clients/aggregated"] == 5
    assert [e for e in events if e["event"] != "client_metrics"] == [
        {"round": 1, "event": "rejected_update", "client": 2, "reason": "non-finite values"}]
    clients = next(e["clients"] for e in events if e["event"] == "client_metrics")
    assert sorted(clients, key=int) == [str(c) for c in range(6)]  # local evaluation still covers the rejected one
    assert all(torch.isfinite(p_).all() for p_ in sim.global_model.parameters())


@pytest.mark.parametrize("vectorize", [False, True])
def test_only_updates_found_finite_in_process_are_sealed_and_a_changed_one_is_checked_again(vectorize):
    """The in-process backend seals a reply (``FiniteSeal``: the server then does not read its values again)
    exactly when every uploaded tensor is finite: the poisoned client's is not, and the server rejects it. A sealed
    result whose tensor is then changed in place, or replaced, is checked in full and rejected."""
    cfg = validate(tiny(**{"server.rounds": 1, "server.clients_per_round": 6, "engine.vectorize": vectorize}))
    sim = build_simulation(cfg)
    p = Poison()
    p.victims = (3,)
    sim.recipe.components.append(p)
    sim.server.enter_round(1)
    sim.backend.enter_round(1)
    plan = sim.server.begin_round(1)
    replies, _ = sim.backend.train(plan)
    sealed = {rep.client: rep.finite_seal is not None and rep.finite_seal.holds(rep.result) for rep in replies}
    assert sealed == {rep.client: all(bool(torch.isfinite(t).all()) for t in rep.result.delta.values())
                      for rep in replies}
    assert sorted(c for c, m in sealed.items() if not m) == [3]
    changed, replaced = [rep for rep in replies if rep.client != 3][:2]
    next(iter(changed.result.delta.values()))[0] = float("inf")
    key = next(iter(replaced.result.delta))
    replaced.result.delta[key] = torch.full_like(replaced.result.delta[key], float("nan"))
    events = []
    results, _ = sim.server.collect(plan, replies, events)
    assert sorted(r.client_id for r in results) == sorted(set(sealed) - {3, changed.client, replaced.client})
    assert {e["client"]: e["reason"] for e in events} == {
        3: "non-finite values", changed.client: f"delta {next(iter(changed.result.delta))!r} has non-finite values",
        replaced.client: f"delta {key!r} has non-finite values"}


def test_rejected_update_leaves_no_client_state():
    """SCAFFOLD saves c_i in every client's state; the poisoned client's save must not take effect."""
    cfg = validate(tiny(**{"server.rounds": 1, "server.clients_per_round": 6, "recipe.components": ["scaffold"]}))
    sim = build_simulation(cfg)
    p = Poison()
    p.victims = (2,)
    sim.recipe.components.append(p)  # after scaffold: it poisons the upload scaffold already prepared
    sim.run()
    assert sim.store.clients("scaffold") == [0, 1, 3, 4, 5]


def test_metrics_and_artifacts_written(tmp_path):
    out = execute(validate(tiny(**{"eval.initial": True, "run.plots": True})), tmp_path / "r")
    rows = RunDir(out.run_dir).read_metrics()
    assert [r["round"] for r in rows] == [0, 1, 2, 3, 4]
    # the initial model (round 0), then every 2 rounds
    assert "test/acc" in rows[0] and "test/acc" in rows[2] and "test/acc" not in rows[1]
    assert {"local/wma", "local/worst10", "train/loss", "time/round_s"} <= set(rows[4])
    for f in ("config.json", "config.toml", "summary.md", "plots/curves.png", "status.json"):
        assert (out.run_dir / f).is_file(), f
    assert json.loads((out.run_dir / "status.json").read_text())["state"] == "complete"


def test_run_plots_false_draws_no_figure_and_the_summary_links_none(tmp_path):
    out = execute(validate(tiny(**{"server.rounds": 1, "run.plots": False})), tmp_path / "r")
    assert not list(out.run_dir.rglob("*.png"))
    summary = (out.run_dir / "summary.md").read_text()
    assert "## Metrics" in summary and "## Curves" not in summary and ".png" not in summary


def test_final_model_is_saved_and_can_initialise_another_run(tmp_path):
    from safetensors.torch import load_file

    out = execute(validate(tiny(**{"server.rounds": 2})), tmp_path / "a")
    saved = load_file(str(out.run_dir / "model.safetensors"))
    _, final, _ = _final(out.run_dir)
    assert saved.keys() == final.keys() and all(torch.equal(saved[k], final[k]) for k in saved)
    sim = build_simulation(validate(tiny(**{"init.weights": str(out.run_dir / "model.safetensors")})))
    assert all(torch.equal(v, saved[k]) for k, v in sim.global_model.state_dict().items())
    fresh = build_simulation(validate(tiny()))
    assert not all(torch.equal(v, saved[k]) for k, v in fresh.global_model.state_dict().items())


def test_missing_init_weights_file_is_named(tmp_path):
    import pytest

    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        build_simulation(validate(tiny(**{"init.weights": str(tmp_path / "nope.safetensors")})))


def test_server_only_rounds_facts_and_server_steps_resume_bit_identically(tmp_path) -> None:
    """A component that picks no client makes a server-only round (no 'round_skipped' event) whose
    ``server_step`` trains the global model on server data and records a fact; facts are checkpointed, so
    a run killed after such a round resumes to the same numbers."""
    import torch

    from fedsight.api import execute
    from fedsight.config import validate
    from fedsight.registry import COMPONENTS, NoParams
    from fedsight.training import Component

    class ServerSide(Component):
        name = "server_side"

        def sample(self, round, num_clients, m, seed):
            return [] if round <= 2 else None

        def server_step(self, sctx):
            if sctx.round <= 2:  # one SGD step on the server's view of client 0's data
                model = sctx.model
                x, y = sctx.task.train_batch(0, torch.arange(8))
                loss = torch.nn.functional.cross_entropy(model(x.to(next(model.parameters()).device)), y)
                loss.backward()
                with torch.no_grad():
                    for p in model.parameters():
                        p -= 0.1 * p.grad
                        p.grad = None
                sctx.facts["steps"] = sctx.facts.get("steps", torch.zeros(())) + 1
            sctx.metrics["server/steps"] = float(sctx.facts["steps"])

    if "server_side" not in COMPONENTS.names():
        COMPONENTS.register("server_side", params=NoParams)(lambda params: ServerSide())
    raw = tiny(**{"server.rounds": 4, "eval.every": 1, "recipe.components": ["server_side"]})
    whole = execute(validate(raw), tmp_path / "whole")
    rows = [json.loads(line) for line in (whole.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in rows if r.get("event") == "round_skipped"]
    by_round = {r["round"]: r for r in rows if "event" not in r}
    assert [by_round[r]["clients/sampled"] for r in (1, 2, 3, 4)] == [0, 0, 3, 3]
    assert [by_round[r]["server/steps"] for r in (1, 2, 3, 4)] == [1.0, 2.0, 2.0, 2.0]
    assert by_round[1]["test/acc"] != by_round[2]["test/acc"]  # the server's steps moved the model
    cfg = validate(raw)
    part = execute(cfg, tmp_path / "part", stop_after=2)
    assert part.status == "stopped"
    resumed = execute(cfg, tmp_path / "part", resume=True)
    again = [json.loads(line) for line in (resumed.run_dir / "metrics.jsonl").read_text().splitlines()]
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows if "event" not in r]  # noqa: E731
    assert strip(again) == strip(rows)


def test_a_client_broadcast_reaches_only_its_client_and_is_counted_in_the_download() -> None:
    import torch

    from fedsight.registry import COMPONENTS, NoParams
    from fedsight.training import Component

    seen: dict[int, float] = {}

    class PerClient(Component):
        name = "per_client"

        def server_broadcast(self, sctx):
            return {"common": torch.zeros(3)}

        def client_broadcast(self, sctx, client):
            return {"mine": torch.full((5,), float(client), dtype=torch.float64)} if client % 2 == 0 else None

        def client_start(self, ctx):
            got = ctx.broadcast[self.name]
            assert torch.equal(got["common"], torch.zeros(3))
            seen[ctx.client_id] = float(got["mine"][0]) if "mine" in got else -1.0

    if "per_client" not in COMPONENTS.names():
        COMPONENTS.register("per_client", params=NoParams)(lambda params: PerClient())
    rows = []
    plain = build_simulation(validate(tiny(**{"server.rounds": 1})))
    plain.run(on_round=lambda r, row, ev: rows.append(row))
    sim = build_simulation(validate(tiny(**{"server.rounds": 1, "recipe.components": ["per_client"]})))
    sim.run(on_round=lambda r, row, ev: rows.append(row))
    sampled = sorted(seen)
    assert all(seen[c] == (c if c % 2 == 0 else -1.0) for c in sampled) and len(sampled) == 3
    evens = sum(1 for c in sampled if c % 2 == 0)
    assert rows[1]["cost/down_bytes"] - rows[0]["cost/down_bytes"] == 3 * 3 * 4 + evens * 5 * 8


def test_a_component_can_evaluate_a_split_in_parts_and_merge_the_states() -> None:
    """``Component.evaluate``: evaluating the global test set in two halves and merging the states gives the
    numbers of one evaluation (metric states merge exactly); the halves really are evaluated apart."""
    import numpy as np

    from fedsight.engine.client_runtime import evaluate_split
    from fedsight.training import Component

    calls: list[int] = []

    class Halves(Component):
        name = "halves"

        def evaluate(self, model, ctx, run):
            n = len(ctx.task.test_y)
            parts = [np.arange(0, n // 2), np.arange(n // 2, n)]
            states = []
            for p in parts:
                calls.append(len(p))
                states.append(run(dataclasses.replace(ctx, subset=p)))
            return ctx.task.metrics.merge(states)

    cfg = validate(tiny(**{"server.rounds": 1}))
    sim = build_simulation(cfg)
    sim.run()
    whole = sim.server.evaluate_global(sim.store)
    stage = sim.stages[0]
    stage.recipe.components.append(Halves())
    try:
        state = evaluate_split(stage, sim.global_model, sim.server.eval_context("test", sim.store))
    finally:
        stage.recipe.components.pop()
    assert calls == [len(sim.task.test_y) // 2, len(sim.task.test_y) - len(sim.task.test_y) // 2]
    got = sim.task.metrics.compute(state)
    # (accuracy counts merge exactly. The loss is a mean of float32 per-example losses summed in float32 per batch:
    # the whole split is one forward of 360 examples (eval batch 512), the halves two of 180, and matrix products of
    # other shapes round differently, by CPU kernel too (AVX-512, AVX2, scalar); the 360-term and 180-term float32
    # sums round like log2(512) = 9 additions. Allowed: 4 x 9 float32 ulps relative, 4.3e-6, while one example's
    # loss left out or counted twice moves the mean by about 1/360, 3e-3.)
    rel = 4 * math.ceil(math.log2(cfg.eval.batch_size)) * torch.finfo(torch.float32).eps
    assert got["acc"] == whole["test/acc"] and got["loss"] == pytest.approx(whole["test/loss"], rel=rel)
