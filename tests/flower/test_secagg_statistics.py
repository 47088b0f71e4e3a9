"""Fed3R's and FedNCM's statistics under SecAgg+ (issue 43, item 4), on FedSight's real ServerApp and ClientApp with
messages through Flower's serialisation (``flower_direct.DirectGrid``): each client's statistics go into Flower's
masked sum as two limbs on Flower's own quantisation grid (``secagg_stats.encode_statistic``), the server unmasks only
their sum (``decode_sum``), which is within ``m * bound / Q**2`` per entry of the plain sum (counts exact), and the
classifier is the plain run's; a sum no honest group can give is rejected for the whole group; statistics the
server needs one by one are refused before anything starts."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
import torch
from flwr.common.secure_aggregation.quantization import dequantize, quantize
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from fedsight.config import validate
from fedsight.errors import ConfigError
from fedsight.flower.client_app import make_client_app
from fedsight.flower.secagg import SecAggSettings, check_secagg
from fedsight.flower.secagg_node import is_secagg
from fedsight.flower.secagg_stats import MODULUS, decode_sum, encode_statistic, stats_levels, sum_error
from fedsight.flower.options import preflight
from fedsight.recipe.fed3r import pow2_at_least

from flower_direct import run_direct
from helpers import tiny

pytestmark = pytest.mark.flower

#: a fedncm stage (all 6 clients in one round) then a fed3r stage (3 a round): both heads, each evaluated at its
#: stage's end
BASE = {"partition.num_clients": 6, "server.clients_per_round": 3, "server.rounds": 3, "eval.every": 3,
        "eval.local": False, "engine.threads": 1, "model.hidden": 8}
CFG = {**BASE, "stages": [{"name": "ncm", "rounds": 1, "server": {"clients_per_round": 6},
                           "recipe": {"components": ["fedncm"]}},
                          {"name": "ridge", "rounds": 2, "recipe": {"components": ["fed3r"]}}]}
#: one statistics round of 3 clients
ONE = {"recipe.components": ["fedncm"], "server.rounds": 1, "eval.every": 1}
SECAGG = {"secagg": True}


def _flower_sum(limbs: list[np.ndarray], levels: int) -> np.ndarray:
    """What Flower's SecAgg+ gives the server for these clients' limbs: its quantisation of each (clipping range
    1), the integer sum (the masks cancel mod 2**32), and its unmask stage's arithmetic
    (``SecAggPlusWorkflow.unmask``: dequantize, the offset of m clients, divided by the summed weight factors)."""
    m = len(limbs)
    total = sum(quantize([x], 1.0, levels)[0].astype(np.int64) for x in limbs) % MODULUS
    [vec] = dequantize([total], 1.0, levels)
    vec += -(m - 1) * 1.0
    vec *= levels / (m * levels)  # each client's weight factor is Q (weight 1 of max_weight 1)
    return vec


@settings(max_examples=60, deadline=None)
@given(m=st.integers(3, 40), exp=st.integers(-8, 40), seed=st.integers(0, 2**31 - 1),
       scale=st.sampled_from([1.0, 1e-3, 1e-9, 0.999]))
def test_two_limbs_through_flowers_quantisation_sum_within_m_bound_over_q_squared(m, exp, seed, scale) -> None:
    rng = np.random.default_rng(seed)
    bound = 2.0 ** exp
    levels = stats_levels(m)
    assert m * levels < MODULUS and levels & (levels - 1) == 0
    xs = [rng.uniform(-1, 1, size=(3, 5)) * bound * scale for _ in range(m)]
    xs[0][0, 0] = bound  # the edges of the range
    xs[-1][0, 1] = -bound
    limbs = [encode_statistic(x, bound, levels)[0] for x in xs]
    # on Flower's grid: its stochastic rounding has nothing to round, whatever its generator draws
    np.random.seed(1)
    first = [quantize([v], 1.0, levels)[0] for v in limbs]
    np.random.seed(2)
    assert all(np.array_equal(a, quantize([v], 1.0, levels)[0]) for a, v in zip(first, limbs))
    got = decode_sum(_flower_sum(limbs, levels), m, bound, levels)
    exact = np.array([[math.fsum(float(x[i, j]) for x in xs) for j in range(5)] for i in range(3)])
    err = np.abs(got - exact)
    assert (err <= sum_error(m, bound, levels) + np.spacing(np.abs(exact))).all(), (err.max(), sum_error(m, bound, levels))
    # one limb alone (Flower's own quantisation of x / bound) is off by up to m / Q of the bound: the second limb
    # is what makes the sum exact to m bound / Q**2
    assert sum_error(m, bound, levels) <= m * bound / levels / levels


def test_whole_counts_come_back_exactly() -> None:
    m, levels, bound = 5, stats_levels(5), pow2_at_least(300)
    counts = [np.array([0.0, 17.0, 300.0, 1.0]) for _ in range(m)]
    limbs = [encode_statistic(c, bound, levels)[0] for c in counts]
    assert np.array_equal(decode_sum(_flower_sum(limbs, levels), m, bound, levels), sum(counts))


def _run(path, name, *, options=None, app=None, base=CFG, **over):
    import fedsight.flower.client_app as client_app

    cfg = validate(tiny(**{**base, **over}))
    original = client_app.make_client_app
    if app is not None:
        client_app.make_client_app = lambda: app
    try:
        grid = run_direct(cfg, path / name, path / f"{name}-nodes", options={"round-timeout": 1.0, **(options or {})})
    finally:
        client_app.make_client_app = original
    rows = [json.loads(x) for x in (path / name / "metrics.jsonl").read_text().splitlines()]
    state = load_file(str(path / name / "checkpoints" / f"round-{cfg.server.rounds:06d}.safetensors"))
    return rows, state, grid


def _capturing_app(seen: list):
    """The honest ClientApp, recording every masked-vector reply it sends the server."""
    honest = make_client_app()

    def app(msg, ctx):
        stage = str(msg.content.config_records[RECORD_KEY_CONFIGS][Key.STAGE]) if is_secagg(msg.content) else None
        reply = honest(msg, ctx)  # (the protocol's mod takes the stage out of the message)
        if stage == Stage.COLLECT_MASKED_VECTORS and not reply.has_error():
            seen.append(reply.content)
        return reply

    return app


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("secagg-stats")
    seen: list = []
    return {"plain": _run(d, "plain"), "secagg": _run(d, "secagg", options=SECAGG, app=_capturing_app(seen)),
            "seen": seen}


def test_fedncm_and_fed3r_under_secagg_equal_the_plain_run(runs) -> None:
    """Refused on the code before (``trains nothing``); now the summed statistics are the plain ones within the
    bound, the counts exactly, and each stage's classifier scores what the plain one scores."""
    (plain_rows, plain, _), (rows, secagg, _) = runs["plain"], runs["secagg"]
    assert not [r for r in rows if "event" in r], rows
    assert [r["clients/aggregated"] for r in rows if "event" not in r and "clients/aggregated" in r] == [6, 3, 3]
    acc = lambda rs: [r["test/acc"] for r in rs if "test/acc" in r and r["round"] > 0]  # noqa: E731 (each stage's end)
    assert len(acc(rows)) == 2 and acc(rows) == pytest.approx(acc(plain_rows), abs=1e-9)
    key = "s/components/0:fed3r/acc/"
    assert torch.equal(secagg[key + "counts"], plain[key + "counts"])
    # the bounds: 2 rounds of 3 clients, levels 2**30, n_max examples, features within 1024 (the default)
    from fedsight.api import build_server

    server = build_server(validate(tiny(**CFG)))
    n = max(server.task.num_train_examples(c) for c in range(6))
    levels = stats_levels(3)
    q = 9  # 8 features and the bias
    err_b = 2 * sum_error(3, pow2_at_least(n * 1024.0), levels)
    err_a = 2 * (q + 1) * sum_error(3, pow2_at_least(n * 1024.0**2), levels)  # (+ its PSD projection's, <= q err)
    gap_b = float((secagg[key + "B"] - plain[key + "B"]).abs().max())
    gap_a = float((secagg[key + "A"] - plain[key + "A"]).abs().max())
    slack = 1e-12 * float(plain[key + "A"].abs().max())  # float64 rounding of the plain sums themselves
    assert gap_b <= err_b + slack and gap_a <= err_a + slack, (gap_b, err_b, gap_a, err_a)
    assert 0 < gap_a  # went through the quantised path
    heads = [k for k in plain if k.startswith("s/model/head")]
    assert max(float((secagg[k] - plain[k]).abs().max()) for k in heads) < 1e-5


def test_the_server_receives_only_masked_integers(runs) -> None:
    """Every masked-vector reply holds integer arrays in [0, 2**32) (the weight factor, then two limbs per
    statistic) and plain scalars; read as an unmasked vector, one client's reply is nothing like its statistics."""
    seen = runs["seen"]
    assert len(seen) == 6 + 3 + 3
    for content in seen:
        arrays = [np.load(io.BytesIO(b), allow_pickle=False) for b in
                  content.config_records[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS]]
        assert all(a.dtype.kind in "iu" for a in arrays)
        assert set(content.config_records["fitres.metrics"]) == {
            "meta/client-id", "meta/num-examples", "meta/num-steps", "meta/flops", "meta/secagg-clipped",
            "meta/round", "meta/nonce"}  # (the instruction's round and nonce, echoed: a replay is refused)
        # unmasked, every level is at most Q <= 2**30; masked, the values are uniform in [0, 2**32)
        assert float((arrays[1] > 2**30).mean()) > 0.5


def _shift_counts(content) -> None:
    rec = content.config_records[RECORD_KEY_CONFIGS]
    arrays = list(rec[Key.MASKED_PARAMETERS])
    counts = np.load(io.BytesIO(arrays[2]), allow_pickle=False)
    counts[0] = (counts[0] + 1) % MODULUS  # one level more on every class's count (hi limb)
    buf = io.BytesIO()
    np.save(buf, counts)
    arrays[2] = buf.getvalue()
    rec[Key.MASKED_PARAMETERS] = arrays


def test_a_sum_no_honest_group_can_give_rejects_the_group_and_changes_nothing(tmp_path, runs) -> None:
    honest, tampered = make_client_app(), []

    def app(msg, ctx):  # the first node to send its masked vector adds one level to it
        stage = str(msg.content.config_records[RECORD_KEY_CONFIGS][Key.STAGE]) if is_secagg(msg.content) else None
        reply = honest(msg, ctx)
        if stage == Stage.COLLECT_MASKED_VECTORS and not tampered:
            _shift_counts(reply.content)
            tampered.append(ctx.node_id)
        return reply

    rows, state, _ = _run(tmp_path, "shifted", options=SECAGG, app=app, base=BASE, **ONE)
    rejected = [e for e in rows if e.get("event") == "rejected_update"]
    assert len(rejected) == 3 and all("summed counts are not whole numbers" in e["reason"] for e in rejected), rows
    assert [r["clients/aggregated"] for r in rows if "clients/aggregated" in r] == [0]
    from fedsight.api import build_server

    initial = build_server(validate(tiny(**{**BASE, **ONE}))).global_model.state_dict()
    assert all(torch.equal(state[f"s/model/{k}"], initial[k]) for k in ("head.weight", "head.bias"))


def test_features_beyond_the_bound_are_clipped_and_reported(tmp_path) -> None:
    rows, _, _ = _run(tmp_path, "clipped", options={**SECAGG, "secagg-feature-bound": 1e-6}, base=BASE, **ONE)
    clipped = [e for e in rows if e.get("event") == "secagg_clipped"]
    assert len(clipped) == 3 and all(e["values"] > 0 for e in clipped), rows
    assert [r["clients/aggregated"] for r in rows if "clients/aggregated" in r] == [3]


def test_statistics_the_server_needs_one_by_one_are_refused_in_one_line(tmp_path) -> None:
    from fedsight.api import build_server

    server = build_server(validate(tiny(**{**BASE, **ONE})))

    class Styles:  # a statistics trainer whose component has no secure sum (as LADD's client styles)
        trains, name, component = False, "client_styles", object()

    server.stages[0].recipe.trainer = Styles()
    with pytest.raises(ConfigError, match=r"^secure aggregation sums what the clients upload, but stage 'federated'"
                                          r"'s trainer 'client_styles' uploads statistics the server needs one by one"):
        check_secagg(server, SecAggSettings())
    with pytest.raises(ConfigError, match="secagg-feature-bound = -1.0 must be a finite number > 0"):
        preflight(validate(tiny(**CFG)), {**SECAGG, "secagg-feature-bound": -1.0}, tmp_path / "run")
    assert not (tmp_path / "run").exists()
    preflight(validate(tiny(**CFG)), SECAGG, tmp_path / "ok")  # Fed3R and FedNCM pass (refused before)


@pytest.mark.slow
@pytest.mark.parametrize("component", [{"name": "fed3r", "sync": True}, {"name": "fed3r", "rff_dim": 32, "rff_sigma": 4.0},
                                       {"name": "fedncm", "normalize": True}])
def test_every_closed_form_variant_under_secagg_equals_the_plain_run(tmp_path, component) -> None:
    over = {"recipe.components": [component], "server.rounds": 2, "eval.every": 2}
    plain_rows, plain, _ = _run(tmp_path, "plain", base=BASE, **over)
    rows, secagg, _ = _run(tmp_path, "secagg", options=SECAGG, base=BASE, **over)
    assert not [r for r in rows if "event" in r], rows
    acc = lambda rs: [r["test/acc"] for r in rs if "test/acc" in r]  # noqa: E731
    assert acc(rows) == pytest.approx(acc(plain_rows), abs=1e-9)
    heads = [k for k in plain if k.startswith("s/model/head")]
    assert max(float((secagg[k] - plain[k]).abs().max()) for k in heads) < 1e-5
