"""Untrusted clients: a node's ClientApp tampers with its train reply (after the honest client computed it;
the reply then crosses Flower's serialisation), and FedSight's real ServerApp must finish the run, reject the
reply with a reason naming the client, and end with the global model of the run where that client's node
never answered. The reply contract itself (``fedsight.engine.contract``) is checked on the in-process path
with Hypothesis."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Message, MetricRecord
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from fedsight.api import build_simulation
from fedsight.config import validate
from fedsight.engine.contract import check_result
from fedsight.engine.simulation import sample_clients
from fedsight.flower.client_app import make_client_app
from fedsight.records import ClientResult

from flower_direct import run_direct
from helpers import tiny
from test_adapter import _wire

pytestmark = pytest.mark.flower

CFG = {"partition.num_clients": 3, "server.clients_per_round": 3, "server.rounds": 1, "eval.every": 1,
       "eval.local": False, "engine.threads": 1}
VICTIM = 1


def _first_key(rec: ArrayRecord) -> str:
    return next(iter(rec.keys()))


def _set_meta(content, key: str, value: Any) -> None:
    meta = dict(content["meta"])
    meta[key] = value
    content["meta"] = MetricRecord(meta)


#: each attack: name -> function editing the reply's RecordDict in place
ATTACKS = {
    "wrong shape": lambda c: c["delta"].__setitem__(_first_key(c["delta"]), Array(np.zeros(1, np.float32))),
    "missing key": lambda c: c["delta"].__delitem__(_first_key(c["delta"])),
    "extra key": lambda c: c["delta"].__setitem__("evil.weight", Array(np.ones(3, np.float32))),
    "float64 tensor": lambda c: c["delta"].__setitem__(
        _first_key(c["delta"]), Array(c["delta"][_first_key(c["delta"])].numpy().astype(np.float64))),
    "int64 tensor": lambda c: c["delta"].__setitem__(
        _first_key(c["delta"]), Array(c["delta"][_first_key(c["delta"])].numpy().astype(np.int64))),
    "nan": lambda c: c["delta"].__setitem__(
        _first_key(c["delta"]), Array(np.full_like(c["delta"][_first_key(c["delta"])].numpy(), np.nan))),
    "negative examples": lambda c: _set_meta(c, "num-examples", -5),
    "inflated examples": lambda c: _set_meta(c, "num-examples", 10**15),
    "float examples": lambda c: _set_meta(c, "num-examples", 1e30),
    "negative flops": lambda c: _set_meta(c, "flops", -1.0),
    "negative steps": lambda c: _set_meta(c, "num-steps", -3),
    "other client id": lambda c: _set_meta(c, "client-id", 0),
    "string metric": lambda c: c.__setitem__("metrics", MetricRecord({"train/loss": [1.0, 2.0]})),
    "no meta": lambda c: c.__delitem__("meta"),
    "no delta": lambda c: c.__delitem__("delta"),
    "no metrics": lambda c: c.__delitem__("metrics"),
    "huge tensor": lambda c: c["delta"].__setitem__(_first_key(c["delta"]), Array(np.zeros(3_000_000, np.float32))),
    "undeclared extras": lambda c: c.__setitem__("extras:scaffold", ArrayRecord({"w": Array(np.ones(3, np.float32))})),
}


def tampering_app(attack):
    honest = make_client_app()

    def app(msg: Message, ctx) -> Message:
        reply = honest(msg, ctx)
        if msg.metadata.message_type == "train" and int(ctx.node_config["partition-id"]) == VICTIM \
                and not reply.has_error() and "delta" in reply.content:
            content = _wire(reply.content)
            attack(content)
            return Message(_wire(content), reply_to=msg)
        return reply

    return app


def _run(tmp_path, name: str, app=None, kill=None):
    cfg = validate(tiny(**CFG))
    import fedsight.flower.client_app as client_app

    original = client_app.make_client_app
    if app is not None:
        client_app.make_client_app = lambda: app
    try:
        run_direct(cfg, tmp_path / name, tmp_path / f"{name}-nodes", kill_hook=kill,
                   options={"max-reply-mb": 8.0, "round-timeout": 0.5})
    finally:
        client_app.make_client_app = original
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return load_file(str(tmp_path / name / "model.safetensors")), rows


@pytest.fixture(scope="module")
def without_victim(tmp_path_factory):
    """The run in which the victim's node never answers its training instruction."""
    assert VICTIM in sample_clients(0, 1, 3, 3)

    def kill(grid, msg):
        if msg.metadata.message_type == "train" and msg.metadata.dst_node_id == 1000 + VICTIM:
            grid.dead.add(1000 + VICTIM)

    model, rows = _run(tmp_path_factory.mktemp("ref"), "ref", kill=kill)
    assert [e["client"] for e in rows if e.get("event") == "client_lost"] == [VICTIM]
    return model


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_a_tampered_reply_is_rejected_and_the_run_equals_the_run_without_that_client(tmp_path, attack,
                                                                                  without_victim) -> None:
    model, rows = _run(tmp_path, "attacked", app=tampering_app(ATTACKS[attack]))
    status = json.loads((tmp_path / "attacked" / "status.json").read_text())
    assert status["state"] == "complete"
    rejected = [e for e in rows if e.get("event") == "rejected_update"]
    lost = [e["client"] for e in rows if e.get("event") == "client_lost"]
    assert len(rejected) == 1 and rejected[0]["reason"] and rejected[0]["node"] == 1000 + VICTIM, rows
    if attack == "no meta":  # a first reply without identity: the node is named, its client counts as lost
        assert rejected[0]["client"] is None and lost == [VICTIM], rows
    else:
        assert rejected[0]["client"] == VICTIM and not lost, rows
    for k in without_victim:
        assert torch.equal(model[k], without_victim[k]), (attack, k)


# -- the contract on the in-process path --------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    sim = build_simulation(validate(tiny(**CFG)))
    return sim.server


def honest(server, client: int = 1) -> ClientResult:
    state = server.global_model.state_dict()
    return ClientResult(
        client_id=client, num_examples=server.task.num_train_examples(client),
        delta={k: torch.zeros_like(state[k]) for k in server.shared_params},
        buffers={k: state[k].clone() for k in server.shared_buffers},
        metrics={"train/loss": 0.5}, num_steps=3, flops=10.0)


TAMPER = st.sampled_from([
    ("delta_shape", None), ("delta_dtype", torch.float64), ("delta_dtype", torch.float16),
    ("delta_dtype", torch.int64), ("delta_missing", None), ("delta_extra", None), ("delta_inf", None),
    ("num_examples", -1), ("num_examples", 0), ("num_examples", True), ("num_examples", 2.5), ("num_examples", 10**12),
    ("num_steps", -1), ("flops", float("nan")), ("flops", -2.0), ("metric", "x"), ("metric", float("inf")),
    ("metric", [1.0]), ("client_id", 2), ("extras_nan", None), ("extras_type", None),
])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tamper=TAMPER, which=st.integers(0, 10**6))
def test_the_contract_refuses_every_tampering_and_accepts_the_honest_result(server, tamper, which) -> None:
    res = honest(server)
    assert check_result(res, 1, server.contract()) is None
    kind, value = tamper
    keys = list(res.delta)
    k = keys[which % len(keys)]
    if kind == "delta_shape":
        res.delta[k] = torch.zeros(res.delta[k].numel() + 1)
    elif kind == "delta_dtype":
        res.delta[k] = res.delta[k].to(value)
    elif kind == "delta_missing":
        del res.delta[k]
    elif kind == "delta_extra":
        res.delta["evil"] = torch.zeros(1)
    elif kind == "delta_inf":
        res.delta[k] = res.delta[k].clone().fill_(float("inf"))
    elif kind == "metric":
        res.metrics["train/loss"] = value
    elif kind == "extras_nan":
        res.extras["x"] = {"a": torch.tensor([float("nan")])}
    elif kind == "extras_type":
        res.extras["x"] = {"a": [1, 2]}
    else:
        setattr(res, kind, value)
    why = check_result(res, 1, server.contract())
    assert why, tamper


def test_without_known_sizes_the_count_is_bounded(server) -> None:
    res = honest(server)
    res.num_examples = 10**6
    server.sizes_known, server.max_examples = False, 10**6
    try:
        assert check_result(res, 1, server.contract()) is None
        res.num_examples = 10**6 + 1
        assert "exceeds the bound" in check_result(res, 1, server.contract())
    finally:
        server.sizes_known, server.max_examples = True, 10**9


# -- identities bound to node keys ---------------------------------------------------------------------------

KEYS = [bytes([i]) * 32 for i in range(5)]


def _events(run_dir, kind: str) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("event") == kind]


def test_a_node_claiming_a_bound_client_is_rejected_and_changes_nothing(tmp_path) -> None:
    """A fourth authenticated node answers as client 0 (same data, another key): client 0 is bound to the key
    of the node that answered for it first, so the impostor's replies are rejected every round and the run
    equals the run without the impostor bit for bit."""
    cfg = validate(tiny(**{**CFG, "server.rounds": 2, "server.clients_per_round": 2}))
    run_direct(cfg, tmp_path / "honest", tmp_path / "honest-nodes", keys=KEYS[:3])
    run_direct(cfg, tmp_path / "attacked", tmp_path / "attacked-nodes", num_nodes=4, keys=KEYS[:4],
               node_extra=[{}, {}, {}, {"partition-id": 0}])
    a = load_file(str(tmp_path / "honest" / "model.safetensors"))
    b = load_file(str(tmp_path / "attacked" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    rejected = _events(tmp_path / "attacked", "rejected_update")
    assert rejected and all(e["node"] == 1003 and e["client"] == 0 and "bound to another node key" in e["reason"]
                            for e in rejected)
    assert not _events(tmp_path / "attacked", "client_moved")
    bound = json.loads((tmp_path / "attacked" / "identities.json").read_text())
    assert bound == {str(c): KEYS[c].hex() for c in range(3)}


@pytest.mark.parametrize("same_key", [True, False])
def test_a_restarted_node_reclaims_its_client_only_with_its_key(tmp_path, same_key) -> None:
    """Client 1's SuperNode dies after round 1 and comes back under a new node id: with the same key it
    reclaims its client (``client_moved``); with another key it is refused and the client is lost."""
    from flwr.app import Context, RecordDict

    cfg = validate(tiny(**{**CFG, "server.rounds": 2}))

    def restart(grid):
        if sum(t == "train" for t, _ in grid.sent) >= 3 and 1003 not in grid.contexts:
            old = grid.contexts[1001]
            grid.dead.add(1001)
            grid.contexts[1003] = Context(run_id=7, node_id=1003, node_config=dict(old.node_config),
                                          state=RecordDict(), run_config=dict(old.run_config))
            grid.keys[1003] = KEYS[1] if same_key else KEYS[4]

    run_direct(cfg, tmp_path / "run", tmp_path / "nodes", keys=KEYS[:3], nodes_hook=restart,
               options={"round-timeout": 0.5})
    moved = _events(tmp_path / "run", "client_moved")
    lost = _events(tmp_path / "run", "client_lost")
    if same_key:
        assert [(e["client"], e["to_node"]) for e in moved] == [(1, 1003)] and not lost
    else:
        assert not moved and [e["client"] for e in lost] == [1]
        assert [e["node"] for e in _events(tmp_path / "run", "rejected_update")] == [1003]


# -- destructive options ---------------------------------------------------------------------------------------


def test_flower_overwrite_replaces_only_a_run_directory(tmp_path) -> None:
    """``overwrite = true`` on the ServerApp refuses a directory that is not a FedSight run (its files stay),
    and replaces a run directory only after the new run recorded a round (nothing is left aside)."""
    cfg = validate(tiny(**CFG))
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="not a FedSight run directory"):
        run_direct(cfg, other, tmp_path / "n1", options={"overwrite": True})
    assert (other / "notes.txt").read_text() == "keep"
    run_direct(cfg, tmp_path / "run", tmp_path / "n2")
    run_direct(validate(tiny(**{**CFG, "server.rounds": 2})), tmp_path / "run", tmp_path / "n3",
               options={"overwrite": True})
    assert json.loads((tmp_path / "run" / "config.json").read_text())["server"]["rounds"] == 2
    assert not list(tmp_path.glob(".run.replaced"))


@st.composite
def tamperings(draw):
    """A random edit of a train reply's records: a tensor's shape, dtype or values, a key, a count or a
    metric of the wrong kind."""
    kind = draw(st.sampled_from(["shape", "dtype", "values", "key", "count", "metric"]))
    if kind == "shape":
        shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=4)))
        return kind, lambda c: c["delta"].__setitem__(_first_key(c["delta"]), Array(np.zeros(shape, np.float32)))
    if kind == "dtype":
        dt = draw(st.sampled_from([np.float16, np.float64, np.int32, np.int64, np.bool_, np.complex64]))
        return kind, lambda c: c["delta"].__setitem__(
            _first_key(c["delta"]), Array(c["delta"][_first_key(c["delta"])].numpy().astype(dt)))
    if kind == "values":
        v = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
        return kind, lambda c: c["delta"].__setitem__(
            _first_key(c["delta"]), Array(np.full_like(c["delta"][_first_key(c["delta"])].numpy(), v)))
    if kind == "key":
        name = draw(st.text(min_size=1, max_size=12).filter(lambda s: not s.startswith(("backbone", "head"))))
        return kind, lambda c: c["delta"].__setitem__(name, Array(np.zeros(2, np.float32)))
    if kind == "count":  # (a large num-steps is not drawn: only cost metrics read it, so it is accepted)
        field = draw(st.sampled_from(["num-examples", "num-steps", "client-id", "partition-id"]))
        large = st.integers(10**7, 10**15) if field != "num-steps" else st.nothing()
        value = draw(st.one_of(st.integers(-10**12, -1), large, st.floats(0.1, 0.9)))
        return kind, lambda c: _set_meta(c, field, value)
    value = draw(st.one_of(st.lists(st.floats(allow_nan=False), min_size=1, max_size=3),
                           st.lists(st.integers(-5, 5), min_size=1, max_size=3)))
    return kind, lambda c: c.__setitem__("metrics", MetricRecord({"train/loss": value}))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tampering=tamperings())
def test_random_tamperings_never_end_the_run_nor_move_the_model(tmp_path_factory, tampering, without_victim) -> None:
    kind, attack = tampering
    d = tmp_path_factory.mktemp("hyp")
    model, rows = _run(d, "attacked", app=tampering_app(attack))
    assert json.loads((d / "attacked" / "status.json").read_text())["state"] == "complete"
    assert [e["node"] for e in rows if e.get("event") == "rejected_update"] == [1000 + VICTIM], (kind, rows)
    for k in without_victim:
        assert torch.equal(model[k], without_victim[k]), (kind, k)


@pytest.mark.parametrize("args,msg", [(["--round-timeout", "-5"], "--round-timeout = -5.0 must be > 0"),
                                      (["--dp-noise", "nan"], "--dp-noise = nan must be a finite number"),
                                      (["--min-clients", "50"], "--min-clients = 50 exceeds")])
def test_flower_options_are_validated_before_anything_starts(tmp_path, args, msg) -> None:
    import tomli_w
    from typer.testing import CliRunner

    from fedsight.cli import app

    cfg = tmp_path / "c.toml"
    cfg.write_text(tomli_w.dumps(tiny(**CFG)))
    res = CliRunner().invoke(app, ["flower", "local", str(cfg), "--run-dir", str(tmp_path / "r"), *args])
    assert res.exit_code != 0 and msg in res.output, res.output
    assert not (tmp_path / "r").exists()


# -- secrets stay with the party they protect (issue 43, item 1) --------------------------------------------------

DP_CFG = {**CFG, "server.rounds": 2, "recipe.weighting": "uniform"}


def _recover_mean_from_the_seed(dp, seed: int, deltas: list[dict]) -> float:
    """The attack of issue 43: a participant holding the config regenerates the server's noise from the seed
    (a probe mechanism fed updates it knows) and subtracts it from the release. Returns the error of its estimate
    of the true (unclipped, all norms < C) mean update, in max-abs."""
    from fedsight.flower.dp import CentralDP

    m = len(deltas)
    released = dp.aggregate([ClientResult(k, 1, d) for k, d in enumerate(deltas)], torch.ones(m))
    known = [{k: torch.full_like(v, 1e-3) for k, v in deltas[0].items()} for _ in range(m)]
    probe = CentralDP(dp.global_params, noise_multiplier=dp.noise_multiplier, clipping_norm=dp.clipping_norm,
                      num_sampled=m, population=dp.accountant.population, delta=dp.accountant.delta, seed=seed)
    noise = {k: v - 1e-3 for k, v in probe.aggregate([ClientResult(k, 1, d) for k, d in enumerate(known)],
                                                     torch.ones(m)).items()}
    true = {k: sum(d[k] for d in deltas) / m for k in deltas[0]}
    return max(float((released[k] - noise[k] - true[k]).abs().max()) for k in true)


def test_central_dp_noise_cannot_be_regenerated_from_the_config() -> None:
    """The ServerApp's mechanism (``install_central_dp``) draws its noise from the server's own secret: the
    seed's holder recovers the true mean from a seed-derived release (error ~1e-7), and nothing from the real one
    (error of the order of the noise, z C / m)."""
    from fedsight.api import build_server
    from fedsight.flower.dp import CentralDP, install_central_dp

    from flower_direct import set_identity

    set_identity()  # (Flower's wrapper builds messages)
    cfg = validate(tiny(**DP_CFG))
    server = build_server(cfg)
    dp = install_central_dp(server, noise_multiplier=1.0, clipping_norm=1.0, delta=None)
    assert dp.secret is not None and len(dp.secret) == 32
    g = torch.Generator().manual_seed(3)
    deltas = [{k: torch.randn(v.shape, generator=g) * 1e-4 for k, v in dp.global_params().items()} for _ in range(3)]
    std = 1.0 * 1.0 / 3
    assert _recover_mean_from_the_seed(dp, cfg.seed, deltas) > std  # max over many coordinates of N(0, std^2)
    simulated = CentralDP(dp.global_params, noise_multiplier=1.0, clipping_norm=1.0, num_sampled=3, population=3,
                          delta=1e-5, seed=cfg.seed)  # the old seed-derived stream: the attack works
    assert _recover_mean_from_the_seed(simulated, cfg.seed, deltas) < 1e-5


def test_local_dp_noise_on_nodes_is_each_nodes_secret(tmp_path) -> None:
    """DP-SGD on Flower nodes: the config says nothing about noise (in-process that means simulated), yet every
    node draws its own secret into its state folder, so two runs of one config and seed differ, and the server's
    run directory holds none of the nodes' secrets."""
    dp = {"name": "dp_sgd", "noise_multiplier": 1.0, "sampling": "shuffle"}
    cfg = validate(tiny(**{**CFG, "server.rounds": 1, "model.norm": "group", "recipe.components": [dp]}))
    assert cfg.privacy.noise == "simulated"
    for name in ("a", "b"):
        run_direct(cfg, tmp_path / name, tmp_path / f"nodes-{name}")
    a, b = (load_file(str(tmp_path / n / "model.safetensors")) for n in ("a", "b"))
    assert not all(torch.equal(a[k], b[k]) for k in a)
    secrets = sorted((tmp_path / "nodes-a").rglob("secret/*.key"))
    assert [p.name for p in secrets] == [f"client-{c:07d}.key" for c in range(3)]
    served = [p.read_bytes() for p in (tmp_path / "a").rglob("*") if p.is_file()]
    for key in secrets:
        s = key.read_bytes()
        assert not any(s in data or s.hex().encode() in data for data in served)
    session = json.loads((tmp_path / "a" / "run.json").read_text())["sessions"][0]
    assert session["privacy_noise"].startswith("secret:")


def test_a_watermark_without_a_key_file_is_refused_on_flower(tmp_path) -> None:
    from fedsight.config import ConfigError
    from fedsight.flower.server_app import preflight

    wm = {"name": "watermark", "p": 0.2, "min_carriers": 20}
    for extra in ({}, {"key": "ab" * 16}):
        cfg = validate(tiny(**{**CFG, "recipe.components": [{**wm, **extra}]}))
        with pytest.raises(ConfigError, match="watermark on Flower needs key_file"):
            preflight(cfg, {}, tmp_path / "r")
    preflight(validate(tiny(**{**CFG, "recipe.components": [{**wm, "key_file": str(tmp_path / "absent.key")}]})),
              {}, tmp_path / "r")  # the server never reads the clients' key file
