"""Secure aggregation (SecAgg+ through Flower's workflow and mod) on FedSight's real ServerApp and ClientApp,
messages through Flower's serialisation (``flower_direct.DirectGrid``): the run equals the plain FedAvg run to
the quantisation's tolerance; a node that tampers with any stage's reply, or drops out mid-protocol, is left
out and the protocol still unmasks the others' mean (the run then equals the plain run without that client);
shares that do not reconstruct skip the round, never the run; recipes that need each update are refused
before anything starts."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.app import ConfigRecord, Message
from safetensors.torch import load_file

from fedsight.api import build_server
from fedsight.config import validate
from fedsight.engine.simulation import sample_clients
from fedsight.errors import ConfigError
from fedsight.flower.client_app import make_client_app
from fedsight.flower.secagg_node import is_secagg
from fedsight.flower.options import preflight

from flower_direct import run_direct
from helpers import tiny

pytestmark = pytest.mark.flower

CFG = {"partition.num_clients": 3, "server.clients_per_round": 3, "server.rounds": 2, "eval.every": 2,
       "eval.local": False, "engine.threads": 1, "recipe.weighting": "uniform"}
VICTIM = 1
SECAGG = {"secagg": True}
#: one quantisation level is 2 * 8 / 2**22 = 3.8e-6 per value and round; two rounds of SGD on the tiny CNN
#: stay well inside this
TOL = 1e-4


def _run(tmp_path, name: str, *, options=None, app=None, kill=None, **over):
    import fedsight.flower.client_app as client_app

    cfg = validate(tiny(**{**CFG, **over}))
    original = client_app.make_client_app
    if app is not None:
        client_app.make_client_app = lambda: app
    try:
        grid = run_direct(cfg, tmp_path / name, tmp_path / f"{name}-nodes", kill_hook=kill,
                          options={"round-timeout": 0.5, **(options or {})})
    finally:
        client_app.make_client_app = original
    rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return load_file(str(tmp_path / name / "model.safetensors")), rows, grid


def _gap(a, b) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _kill_in_training(grid, msg):
    if msg.metadata.message_type == "train" and msg.metadata.dst_node_id == 1000 + VICTIM:
        grid.dead.add(1000 + VICTIM)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> (model, rows): the plain runs (all clients; the victim's node dead) and the SecAgg run."""
    d = tmp_path_factory.mktemp("secagg")
    assert all(VICTIM in sample_clients(0, r, 3, 3) for r in (1, 2))
    out = {"plain": _run(d, "plain"), "without": _run(d, "without", kill=_kill_in_training),
           "secagg": _run(d, "secagg", options=SECAGG), "again": _run(d, "again", options=SECAGG)}
    return {k: v[:2] for k, v in out.items()} | {"grid": out["secagg"][2]}


def test_a_secagg_run_equals_the_plain_run_to_the_quantisation_and_is_reproducible(runs) -> None:
    plain, secagg = runs["plain"][0], runs["secagg"][0]
    gap = _gap(plain, secagg)
    assert 0 < gap < TOL  # quantised (not the plain path), within a few levels of it
    assert all(torch.equal(secagg[k], runs["again"][0][k]) for k in secagg)  # seeded stochastic rounding
    rows = [r for r in runs["secagg"][1] if "event" not in r]
    assert [r["clients/aggregated"] for r in rows] == [3, 3]
    assert not [r for r in runs["secagg"][1] if "event" in r]
    assert rows[-1]["test/acc"] == pytest.approx([r for r in runs["plain"][1] if "event" not in r][-1]["test/acc"],
                                                 abs=0.01)
    # four protocol exchanges a round with each node (setup, share keys, masked vectors, unmask), after one
    # identification message per node
    sent = [n for t, n in runs["grid"].sent if t == "train"]
    assert sorted(sent) == sorted([1000, 1001, 1002] * (1 + 4 * 2))
    # the upload cost is what crossed: one int64 per value plus the weight factor, and keys and shares
    values = 1 + sum(v.numel() for v in plain.values())
    assert all(3 * 8 * values < r["cost/up_bytes"] < 3 * (8 * values + 8192) for r in rows), rows


def test_data_size_weighting_inside_the_mask_equals_the_plain_weighted_run(tmp_path) -> None:
    plain, _, _ = _run(tmp_path, "plain", **{"recipe.weighting": "data_size"})
    secagg, rows, _ = _run(tmp_path, "secagg", options=SECAGG, **{"recipe.weighting": "data_size"})
    assert 0 < _gap(plain, secagg) < TOL
    uniform, _, _ = _run(tmp_path, "uniform")
    assert _gap(plain, uniform) > 10 * TOL  # the weighting matters at this tolerance


def _secagg_record(content) -> ConfigRecord:
    return content.config_records[RECORD_KEY_CONFIGS]


def _array_bytes(arr: np.ndarray, allow_pickle: bool = False) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=allow_pickle)
    return buf.getvalue()


def _masked(content, edit) -> None:
    rec = _secagg_record(content)
    arrays = list(rec[Key.MASKED_PARAMETERS])
    edit(arrays)
    rec[Key.MASKED_PARAMETERS] = arrays


def _metric(content, key, value) -> None:
    rec = content.config_records["fitres.metrics"]
    rec[key] = value


#: stage -> tampering name -> edit of the victim's reply content (in place)
TAMPERINGS = {
    (Stage.SETUP, "garbage public key"): lambda c: _secagg_record(c).__setitem__(Key.PUBLIC_KEY_1, b"not a key"),
    (Stage.SHARE_KEYS, "share sent to a stranger"): lambda c: _secagg_record(c).__setitem__(
        Key.DESTINATION_LIST, [99_999] * len(_secagg_record(c)[Key.DESTINATION_LIST])),
    (Stage.COLLECT_MASKED_VECTORS, "wrong shape"): lambda c: _masked(c, lambda a: a.__setitem__(
        1, _array_bytes(np.zeros(1, np.int64)))),
    (Stage.COLLECT_MASKED_VECTORS, "missing array"): lambda c: _masked(c, lambda a: a.pop()),
    (Stage.COLLECT_MASKED_VECTORS, "float array"): lambda c: _masked(c, lambda a: a.__setitem__(
        1, _array_bytes(np.load(io.BytesIO(a[1])).astype(np.float64)))),
    (Stage.COLLECT_MASKED_VECTORS, "values beyond the modulus"): lambda c: _masked(c, lambda a: a.__setitem__(
        1, _array_bytes(np.load(io.BytesIO(a[1])) + 2**40))),
    (Stage.COLLECT_MASKED_VECTORS, "pickled object array"): lambda c: _masked(c, lambda a: a.__setitem__(
        1, _array_bytes(np.array([{"x": 1}], dtype=object), allow_pickle=True))),
    (Stage.COLLECT_MASKED_VECTORS, "over the size limit"): lambda c: _masked(c, lambda a: a.__setitem__(
        1, _array_bytes(np.zeros(600_000, np.int64)))),
    (Stage.COLLECT_MASKED_VECTORS, "answers as another client"): lambda c: _metric(c, "meta/client-id", 0),
    (Stage.COLLECT_MASKED_VECTORS, "string metric"): lambda c: _metric(c, "train/loss", "low"),
    (Stage.UNMASK, "shares of a node it was not asked for"): lambda c: (
        _secagg_record(c).__setitem__(Key.NODE_ID_LIST, [*_secagg_record(c)[Key.NODE_ID_LIST], 99_999]),
        _secagg_record(c).__setitem__(Key.SHARE_LIST, [*_secagg_record(c)[Key.SHARE_LIST], b"x" * 8])),
}


def tampering_app(stage: str, edit):
    honest = make_client_app()

    def app(msg: Message, ctx) -> Message:
        asked = str(_secagg_record(msg.content)[Key.STAGE]) if is_secagg(msg.content) else None
        reply = honest(msg, ctx)
        if asked == stage and int(ctx.node_config["partition-id"]) == VICTIM and not reply.has_error():
            edit(reply.content)
        return reply

    return app


@pytest.mark.parametrize("stage,name", sorted(TAMPERINGS))
def test_a_tampered_protocol_reply_leaves_its_node_out_and_the_rest_are_unmasked(tmp_path, runs, stage, name) -> None:
    model, rows, _ = _run(tmp_path, "attacked", app=tampering_app(stage, TAMPERINGS[stage, name]),
                          options={**SECAGG, "max-reply-mb": 1.0})
    assert json.loads((tmp_path / "attacked" / "status.json").read_text())["state"] == "complete"
    if stage == Stage.UNMASK:  # its masked vector was in the sum already; the other nodes' shares suffice
        flagged = [e for e in rows if e.get("event") == "secagg_reply_rejected"]
        reference = runs["plain"][0]
    else:  # left out before its vector counted: the mean of the other two
        flagged = [e for e in rows if e.get("event") == "rejected_update"]
        reference = runs["without"][0]
        assert [r["clients/aggregated"] for r in rows if "event" not in r] == [2, 2]
    assert [(e["client"], e["node"]) for e in flagged] == [(VICTIM, 1000 + VICTIM)] * 2, rows
    assert all(e["reason"].startswith(f"secure aggregation: {stage}: ") or e["reason"].startswith(f"{stage}: ")
               for e in flagged), flagged
    assert _gap(model, reference) < TOL


def test_a_node_that_drops_out_before_its_masked_vector_is_unmasked_away(tmp_path, runs) -> None:
    def kill(grid, msg):
        if is_secagg(msg.content) and msg.metadata.dst_node_id == 1000 + VICTIM and \
                _secagg_record(msg.content)[Key.STAGE] == Stage.COLLECT_MASKED_VECTORS:
            grid.dead.add(1000 + VICTIM)

    model, rows, _ = _run(tmp_path, "dropped", kill=kill, options=SECAGG)
    lost = [e for e in rows if e.get("event") == "client_lost"]
    assert [e["client"] for e in lost] == [VICTIM, VICTIM] and "no reply within" in lost[0]["reason"], rows
    assert _gap(model, runs["without"][0]) < TOL


def test_shares_that_do_not_reconstruct_skip_the_round_not_the_run(tmp_path) -> None:
    def garbage(c):
        rec = _secagg_record(c)
        rec[Key.SHARE_LIST] = [bytes(len(s)) for s in rec[Key.SHARE_LIST]]

    model, rows, _ = _run(tmp_path, "garbled", app=tampering_app(Stage.UNMASK, garbage), options=SECAGG)
    assert json.loads((tmp_path / "garbled" / "status.json").read_text())["state"] == "complete"
    assert [r["clients/aggregated"] for r in rows if "event" not in r] == [0, 0]
    assert {e["event"] for e in rows if "event" in e} >= {"round_skipped"}
    reasons = [e for e in rows if e.get("event") in ("secagg_failed", "rejected_update")]
    assert reasons, rows
    initial = build_server(validate(tiny(**CFG))).global_model.state_dict()
    assert all(torch.equal(model[k], initial[k]) for k in model)


@pytest.mark.parametrize("over,options,msg", [
    ({"recipe.aggregator": "median"}, {}, "recipe.aggregator = 'median'"),
    ({"recipe.weighting": "fedvg", "validation.source": "carve"}, {}, "recipe.weighting = 'fedvg'"),
    ({"recipe.components": [{"name": "norm_bound", "bound": 1.0}]}, {}, "recipe.components norm_bound"),
    ({"recipe.components": ["scaffold"]}, {}, "recipe.components scaffold"),
    ({"recipe.components": [{"name": "feddyn"}], "recipe.weighting": "data_size"}, {}, "recipe.weighting = 'uniform'"),
    ({"model.norm": "batch"}, {}, "num_batches_tracked"),
    ({"server.clients_per_round": 2}, {}, "at least 3 clients"),
    ({}, {"secagg-num-shares": 5}, "secagg-num-shares = 5 exceeds"),
    ({}, {"secagg-num-shares": 2}, "secagg-num-shares = 2 must be"),
    ({}, {"secagg-reconstruction-threshold": 3}, "must be below secagg-num-shares"),
    ({}, {"secagg-clipping-range": -1.0}, "secagg-clipping-range"),
    ({}, {"secagg-quantization-range": 2**31}, "too large for 3 clients"),
    ({}, {"dp-noise-multiplier": 1.0}, "central DP"),
])
def test_recipes_that_need_each_update_are_refused_before_anything_starts(tmp_path, over, options, msg) -> None:
    cfg = validate(tiny(**{**CFG, **over}))
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace("[", r"\[")):
        preflight(cfg, {**SECAGG, **options}, tmp_path / "run")
    assert not (tmp_path / "run").exists()
    preflight(validate(tiny(**CFG)), SECAGG, tmp_path / "ok")  # the plain recipe passes


@pytest.mark.parametrize("given,want", [(0.5, 0.5), (1.0, 1.0), (3.0, 3), (4, 4)])
def test_share_options_stay_a_count_or_a_fraction_through_the_app(tmp_path, given, want) -> None:
    from fedsight.flower.app import app_config
    from fedsight.flower.options import ServerOptions

    rc = app_config(validate(tiny(**CFG)), tmp_path, {"secagg": True, "secagg-num-shares": given,
                                                      "secagg-reconstruction-threshold": 0.5})
    assert rc["secagg-num-shares"] == want and type(rc["secagg-num-shares"]) is type(want)
    settings = ServerOptions.from_run_config(rc).secagg_settings()
    assert settings.num_shares == want and type(settings.num_shares) is type(want)


def test_fractions_of_the_sampled_clients_as_shares_and_threshold(tmp_path, runs) -> None:
    model, rows, _ = _run(tmp_path, "fractions", options={**SECAGG, "secagg-num-shares": 1.0,
                                                          "secagg-reconstruction-threshold": 0.5})
    assert [r["clients/aggregated"] for r in rows if "event" not in r] == [3, 3]
    assert 0 < _gap(model, runs["plain"][0]) < TOL


@pytest.mark.parametrize("stage", [Stage.SETUP, Stage.COLLECT_MASKED_VECTORS])
def test_a_protocol_reply_resent_from_an_earlier_round_is_refused(tmp_path, stage) -> None:
    """Issue 43: SecAgg+ replies carried no round or nonce, so a node could resend its round-1 reply in round 2 (its
    masked vector then unmasks to garbage in the sum, unnoticed). Now a masked vector echoes the round and the
    server's fresh nonce, and a setup reply's public keys must never have been used before in the run: the
    resent reply is a ``rejected_update`` naming the replay, and the round is aggregated without that node."""
    from flower_direct import wire

    honest, kept = make_client_app(), {}

    def app(msg: Message, ctx) -> Message:
        asked = str(_secagg_record(msg.content)[Key.STAGE]) if is_secagg(msg.content) else None
        reply = honest(msg, ctx)
        if asked != stage or int(ctx.node_config["partition-id"]) != VICTIM or reply.has_error():
            return reply
        if "round 1" not in kept:
            kept["round 1"] = wire(reply.content)
            return reply
        return Message(wire(kept["round 1"]), reply_to=msg)

    _, rows, _ = _run(tmp_path, "replayed", app=app, options=SECAGG)
    assert json.loads((tmp_path / "replayed" / "status.json").read_text())["state"] == "complete"
    rejected = [e for e in rows if e.get("event") == "rejected_update"]
    assert [(e["round"], e["client"]) for e in rejected] == [(2, VICTIM)], rows
    assert "replay" in rejected[0]["reason"] and stage in rejected[0]["reason"], rejected
    assert [r["clients/aggregated"] for r in rows if "event" not in r] == [3, 2]
