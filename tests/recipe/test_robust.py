"""Robust aggregators (coordinate-wise median, trimmed mean, Krum / Multi-Krum) and the attack component.

References are written independently here: numpy's ``np.median``, ``scipy.stats.trim_mean``, explicit
distance arithmetic for Krum (Blanchard et al. 2017, Section 4), and a brute-force numpy Multi-Krum.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import scipy.stats
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from fedsight import registry as R
from fedsight.api import build_simulation
from fedsight.config import ConfigError, validate
from fedsight.functional.robust import coordinate_median, krum_scores, krum_select, trimmed_mean
from fedsight.recipe.aggregators import TooFewUpdates
from fedsight.training import Component
from fedsight.records import ClientResult
from fedsight.rng import np_rng

from helpers import ToyTask, tiny, toy_sim


finite = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False, width=64)


def stacks(min_k=1, max_k=9, max_d=6):
    return st.tuples(st.integers(min_k, max_k), st.integers(1, max_d)).flatmap(
        lambda kd: arrays(np.float64, kd, elements=finite)
    )


def results_from(rows: list[dict[str, np.ndarray]], ids=None, sizes=None) -> list[ClientResult]:
    ids = ids if ids is not None else list(range(len(rows)))
    sizes = sizes if sizes is not None else [1] * len(rows)
    return [
        ClientResult(client_id=i, num_examples=n, delta={k: torch.as_tensor(v) for k, v in row.items()})
        for i, n, row in zip(ids, sizes, rows)
    ]


# -- coordinate-wise median and trimmed mean (Yin et al. 2018, Definitions 1 and 2) ----------------


@given(stacks())
def test_median_equals_numpy_median(x):
    out = coordinate_median(torch.from_numpy(x))
    np.testing.assert_allclose(out.numpy(), np.median(x, axis=0), rtol=1e-12, atol=1e-12)


def test_median_even_k_is_mean_of_middle_values_not_lower():
    x = torch.tensor([[0.0, 4.0], [1.0, 8.0], [3.0, 2.0], [10.0, 6.0]])
    # sorted columns: [0, 1, 3, 10] -> (1 + 3) / 2 = 2;  [2, 4, 6, 8] -> (4 + 6) / 2 = 5
    assert coordinate_median(x).tolist() == [2.0, 5.0]
    assert torch.median(x, dim=0).values.tolist() == [1.0, 4.0]  # what torch.median would have given


def test_median_keeps_dtype():
    x = torch.randn(4, 3, dtype=torch.float32)
    assert coordinate_median(x).dtype == torch.float32
    assert trimmed_mean(x, 0.25).dtype == torch.float32


@given(stacks(), st.floats(0.0, 0.49))
def test_trimmed_mean_equals_scipy_trim_mean(x, trim):
    out = trimmed_mean(torch.from_numpy(x), trim)
    np.testing.assert_allclose(out.numpy(), scipy.stats.trim_mean(x, trim, axis=0), rtol=1e-10, atol=1e-9)


def test_trimmed_mean_hand_example():
    # K = 5, trim 0.2 -> drop floor(1.0) = 1 value at each end: mean of the middle three
    x = torch.tensor([[1.0], [100.0], [2.0], [-50.0], [3.0]])
    assert trimmed_mean(x, 0.2).item() == pytest.approx(2.0)
    # trim 0.19 -> floor(0.95) = 0: the plain mean
    assert trimmed_mean(x, 0.19).item() == pytest.approx(56.0 / 5)
    with pytest.raises(ValueError, match="trim"):
        trimmed_mean(x, 0.5)


@given(stacks(), st.randoms(use_true_random=False), st.floats(0.0, 0.49))
def test_median_and_trimmed_mean_invariant_to_client_order(x, rnd, trim):
    perm = list(range(x.shape[0]))
    rnd.shuffle(perm)
    t, tp = torch.from_numpy(x), torch.from_numpy(x[perm])
    assert torch.equal(coordinate_median(t), coordinate_median(tp))
    assert torch.equal(trimmed_mean(t, trim), trimmed_mean(tp, trim))


@given(stacks(min_k=2, max_k=8), st.floats(-1e12, 1e12, allow_nan=False), st.integers(0, 8))
def test_single_outlier_moves_median_at_most_by_honest_spread(honest, outlier, pos):
    """With >= 2 honest clients (>= 3 in all), one arbitrary update keeps every coordinate of the
    median inside the honest range, so it moves by at most max - min of the honest values."""
    pos = pos % (honest.shape[0] + 1)
    x = np.insert(honest, pos, np.full(honest.shape[1], outlier), axis=0)
    med_all = coordinate_median(torch.from_numpy(x)).numpy()
    med_honest = np.median(honest, axis=0)
    lo, hi = honest.min(0), honest.max(0)
    assert np.all(med_all >= lo - 1e-9) and np.all(med_all <= hi + 1e-9)
    assert np.all(np.abs(med_all - med_honest) <= hi - lo + 1e-9)


@given(stacks(min_k=4, max_k=9), st.floats(-1e12, 1e12, allow_nan=False))
def test_single_outlier_stays_inside_honest_range_for_trimmed_mean(honest, outlier):
    x = np.vstack([honest, np.full((1, honest.shape[1]), outlier)])
    trim = 1.0 / x.shape[0] + 1e-9  # drops exactly one value at each end
    tm = trimmed_mean(torch.from_numpy(x), trim).numpy()
    assert np.all(tm >= honest.min(0) - 1e-9) and np.all(tm <= honest.max(0) + 1e-9)


def test_median_aggregator_per_tensor_and_ignores_weights():
    rng = np.random.default_rng(0)
    rows = [{"w": rng.normal(size=(2, 3)), "b": rng.normal(size=(3,))} for _ in range(4)]
    agg = R.build(R.AGGREGATORS, "median")
    out1 = agg.aggregate(results_from(rows), torch.tensor([1.0, 1.0, 1.0, 1.0]))
    out2 = agg.aggregate(results_from(rows), torch.tensor([100.0, 1.0, 0.0, 3.0]))
    for k in ("w", "b"):
        ref = np.median(np.stack([r[k] for r in rows]), axis=0)
        np.testing.assert_allclose(out1[k].numpy(), ref)
        assert out1[k].shape == rows[0][k].shape
        assert torch.equal(out1[k], out2[k])


def test_trimmed_mean_aggregator_matches_scipy():
    rng = np.random.default_rng(1)
    rows = [{"w": rng.normal(size=(2, 2))} for _ in range(7)]
    agg = R.build(R.AGGREGATORS, "trimmed_mean", {"trim": 0.3})
    out = agg.aggregate(results_from(rows), torch.ones(7))
    ref = scipy.stats.trim_mean(np.stack([r["w"] for r in rows]), 0.3, axis=0)
    np.testing.assert_allclose(out["w"].numpy(), ref, rtol=1e-12)


def _toy_grads(task, model, c):
    """Full-batch softmax-regression gradient of client c at the model's weights, by fresh autograd."""
    W = model.head.weight.detach().clone().requires_grad_(True)
    b = model.head.bias.detach().clone().requires_grad_(True)
    loss = F.cross_entropy(task.xs[c] @ W.T + b, task.ys[c])
    gW, gb = torch.autograd.grad(loss, (W, b))
    return {"head.weight": gW, "head.bias": gb}


@pytest.mark.parametrize("agg_name, params, ref", [
    ("median", {}, lambda s: np.median(s, axis=0)),
    ("trimmed_mean", {"trim": 0.2}, lambda s: scipy.stats.trim_mean(s, 0.2, axis=0)),
])
def test_one_engine_round_is_robust_statistic_of_local_sgd_steps(agg_name, params, ref):
    """Yin et al. 2018 Algorithm 1 with one local step: w+ = w - lr * med/trmean_k(g_k), i.e. the
    robust statistic of the deltas -lr * g_k, here over 6 toy clients (even K for the median)."""
    task = ToyTask(sizes=(4, 6, 5, 3, 7, 5), seed=3)
    lr = 0.5
    sim = toy_sim(task=task, aggregator=R.build(R.AGGREGATORS, agg_name, params), lr=lr)
    w0 = {k: v.detach().clone() for k, v in sim.global_model.named_parameters()}
    grads = [_toy_grads(task, sim.global_model, c) for c in range(task.num_clients)]
    sim.run()
    for k, p in sim.global_model.named_parameters():
        stacked = np.stack([(-lr * g[k]).numpy().astype(np.float64) for g in grads])
        np.testing.assert_allclose(p.detach().numpy(), w0[k].numpy() + ref(stacked), rtol=1e-5, atol=1e-6)


# -- Krum / Multi-Krum (Blanchard et al. 2017, Section 4) ------------------------------------------


HAND = np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [10.0, 10.0]])


def test_krum_hand_example():
    """K = 5, f = 1: each score sums the K - f - 2 = 2 smallest squared distances to the others."""
    # squared distances, written out:
    #   p0=(0,0): to p1 1, p2 1, p3 2, p4 200          -> 1 + 1 = 2
    #   p1=(1,0): to p0 1, p2 2, p3 1, p4 81+100=181   -> 1 + 1 = 2
    #   p2=(0,1): to p0 1, p1 2, p3 1, p4 181          -> 2
    #   p3=(1,1): to p0 2, p1 1, p2 1, p4 162          -> 2
    #   p4=(10,10): to p0 200, p1 181, p2 181, p3 162  -> 162 + 181 = 343
    hand_scores = [2.0, 2.0, 2.0, 2.0, 343.0]
    assert krum_scores(torch.tensor(HAND), 1).tolist() == hand_scores
    # break the four-way tie: move p3 slightly towards the centre of the cluster
    x = HAND.copy()
    x[3] = [0.6, 0.6]
    # p3=(.6,.6): to p0 .72, p1 .16+.36=.52, p2 .52 -> .52 + .52 = 1.04
    # p0: to p1 1, p2 1, p3 .72 -> .72 + 1 = 1.72; p1: to p0 1, p2 2, p3 .52 -> 1.52; p2 likewise 1.52
    d = lambda i, j: float(((x[i] - x[j]) ** 2).sum())  # noqa: E731
    scores = [sum(sorted(d(i, j) for j in range(5) if j != i)[:2]) for i in range(5)]
    np.testing.assert_allclose(scores, [1.72, 1.52, 1.52, 1.04, 2 * 9.4**2 + 181], rtol=1e-12)
    assert krum_select(torch.tensor(x), byzantine=1) == [3]
    agg = R.build(R.AGGREGATORS, "krum", {"byzantine": 1})
    res = results_from([{"p": r} for r in x], ids=[10, 11, 12, 13, 14])
    out = agg.aggregate(res, torch.ones(5))
    np.testing.assert_allclose(out["p"].numpy(), x[3])
    assert agg.last_selected == [13]


def brute_multi_krum(x: np.ndarray, f: int, m: int, w: np.ndarray | None = None):
    k = len(x)
    scores = []
    for i in range(k):
        ds = sorted(float(np.sum((x[i] - x[j]) ** 2)) for j in range(k) if j != i)
        scores.append(sum(ds[: k - f - 2]))
    order = sorted(range(k), key=lambda i: (scores[i], i))[:m]
    ww = np.ones(m) if w is None else w[order]
    return order, (ww[:, None] * x[order]).sum(0) / ww.sum(), np.array(scores)


@given(st.integers(0, 2).flatmap(lambda f: st.tuples(
    st.just(f), arrays(np.float64, st.tuples(st.integers(2 * f + 3, 9), st.integers(1, 5)), elements=finite))),
    st.data())
def test_multi_krum_equals_brute_force(fx, data):
    f, x = fx
    k = len(x)
    m = data.draw(st.integers(1, k - f))
    w = np.array(data.draw(st.lists(st.floats(0.1, 10.0), min_size=k, max_size=k)))
    rows = [{"a": r[:1], "b": r[1:]} for r in x]  # split across two tensors: Krum uses the whole vector
    order, ref_u, scores = brute_multi_krum(x, f, m)
    _, ref_w, _ = brute_multi_krum(x, f, m, w)
    for weighted, ref in ((False, ref_u), (True, ref_w)):
        agg = R.build(R.AGGREGATORS, "krum", {"byzantine": f, "multi": m, "weighted": weighted})
        out = agg.aggregate(results_from(rows, ids=list(range(100, 100 + k))), torch.tensor(w))
        got = np.concatenate([out["a"].numpy(), out["b"].numpy()])
        sel = [i - 100 for i in agg.last_selected]
        if sorted(order) == sorted(sel):
            np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-6)
        else:
            # scores from a Gram matrix can differ from the brute force in the last bits, which may
            # only swap near-tied clients at the selection boundary
            tol = 1e-9 * (1 + np.abs(scores).max())
            assert scores[sel].max() <= np.sort(scores)[m - 1] + tol


def test_multi_krum_with_k_minus_f_hand_check():
    """m = K - f on the hand example: every point but the far one, averaged uniformly."""
    agg = R.build(R.AGGREGATORS, "krum", {"byzantine": 1, "multi": 4})
    out = agg.aggregate(results_from([{"p": r} for r in HAND]), torch.ones(5))
    np.testing.assert_allclose(out["p"].numpy(), [0.5, 0.5])
    assert sorted(agg.last_selected) == [0, 1, 2, 3]


@pytest.mark.parametrize("k, f", [(4, 1), (2, 0), (6, 2), (5, 3)])
def test_krum_needs_more_than_2f_plus_2_clients(k, f):
    agg = R.build(R.AGGREGATORS, "krum", {"byzantine": f})
    res = results_from([{"p": np.ones(2) * i} for i in range(k)])
    with pytest.raises(ValueError, match=rf"byzantine = {f}.*K = {k}"):
        agg.aggregate(res, torch.ones(k))
    agg = R.build(R.AGGREGATORS, "krum", {"byzantine": f})
    agg.aggregate(results_from([{"p": np.ones(2) * i} for i in range(2 * f + 3)]), torch.ones(2 * f + 3))


def test_krum_invariant_to_client_order():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(7, 4))
    x[2] += 20
    sel = krum_select(torch.from_numpy(x), 2, 3)
    for perm in itertools.islice(itertools.permutations(range(7)), 0, 5040, 97):
        selp = krum_select(torch.from_numpy(x[list(perm)]), 2, 3)
        assert sorted(perm[i] for i in selp) == sorted(sel)


def test_config_validates_aggregator_params():
    with pytest.raises(ConfigError, match="trim"):
        validate(tiny(**{"recipe.aggregator": {"name": "trimmed_mean", "trim": 0.5}}))
    with pytest.raises(ConfigError, match="byzantine"):
        validate(tiny(**{"recipe.aggregator": {"name": "krum", "byzantine": -1}}))


# -- the attack component -------------------------------------------------------------------------


class Capture(Component):
    """Records every upload after the components before it (the attack) transformed it."""

    name = "capture"

    def __init__(self):
        self.seen = {}

    def client_end(self, ctx, result):
        self.seen[(ctx.round, ctx.client_id)] = (
            result.metrics.get("attack/malicious"),
            {k: v.clone() for k, v in result.delta.items()},
        )


def _attack(**p):
    return R.build(R.COMPONENTS, "attack", p)


def _run_toy(components, *, k=10, rounds=3, seed=0, dim=3, classes=3):
    task = ToyTask(sizes=tuple(3 + i % 4 for i in range(k)), dim=dim, classes=classes, seed=1)
    cap = Capture()
    sim = toy_sim(task=task, components=[*components, cap], rounds=rounds, seed=seed)
    sim.run()
    return cap.seen


def _malicious_by_round(seen):
    out = {}
    for (r, c), (flag, _) in seen.items():
        assert flag in (0.0, 1.0)
        if flag == 1.0:
            out.setdefault(r, set()).add(c)
    return out


@pytest.mark.parametrize("fraction, k", [(0.2, 10), (0.3, 10), (0.25, 7), (0.0, 5), (1.0, 4)])
def test_attack_picks_round_fraction_k_clients_same_every_round(fraction, k):
    seen = _run_toy([_attack(fraction=fraction)], k=k, rounds=3)
    by_round = _malicious_by_round(seen)
    expected = math.floor(fraction * k + 0.5)
    sets = [by_round.get(r, set()) for r in (1, 2, 3)]
    assert all(len(s) == expected for s in sets)
    assert sets[0] == sets[1] == sets[2]


def test_attack_set_deterministic_across_runs_and_seed_dependent():
    a = _malicious_by_round(_run_toy([_attack(fraction=0.3)], rounds=1, seed=4))
    b = _malicious_by_round(_run_toy([_attack(fraction=0.3)], rounds=1, seed=4))
    assert a == b
    # the documented stream: round(0.3 * 10) = 3 distinct ids drawn once from ("attackers",)
    assert a[1] == set(int(i) for i in np_rng(4, "attackers").choice(10, size=3, replace=False))
    # explicit num_clients (no broadcast) gives the same set as the broadcast count
    c = _malicious_by_round(_run_toy([_attack(fraction=0.3, num_clients=10)], rounds=1, seed=4))
    assert a == c
    others = {frozenset(_malicious_by_round(_run_toy([_attack(fraction=0.3)], rounds=1, seed=s))[1]) for s in range(5)}
    assert len(others) > 1


def test_attack_broadcasts_num_clients_only_when_unset():
    from fedsight.training import ServerContext

    sctx = ServerContext(round=1, model=torch.nn.Linear(1, 1), num_clients=13, sampled=[0], seed=0)
    sent = _attack().server_broadcast(sctx)
    assert int(sent["num_clients"]) == 13
    assert _attack(num_clients=13).server_broadcast(sctx) is None


@pytest.mark.parametrize("kind, factor", [("flip", -10.0), ("scale", 10.0)])
def test_attack_scale_and_flip_transform_the_honest_upload(kind, factor):
    clean = _run_toy([], rounds=1)
    att = _run_toy([_attack(fraction=0.2, kind=kind, scale=10.0)], rounds=1)
    bad = _malicious_by_round(att)[1]
    assert len(bad) == 2
    for (r, c), (_, delta) in att.items():
        for k, v in delta.items():
            want = clean[(r, c)][1][k] * (factor if c in bad else 1.0)
            torch.testing.assert_close(v, want, rtol=1e-6, atol=1e-7)


def test_attack_gaussian_is_seeded_noise_of_scale():
    att = _run_toy([_attack(fraction=0.2, kind="gaussian", scale=3.0)], rounds=2, dim=40, classes=10)
    again = _run_toy([_attack(fraction=0.2, kind="gaussian", scale=3.0)], rounds=2, dim=40, classes=10)
    clean = _run_toy([], rounds=1, dim=40, classes=10)
    bad = _malicious_by_round(att)[1]
    c = min(bad)
    noise = torch.cat([v.flatten() for v in att[(1, c)][1].values()])
    assert noise.numel() == 410
    assert abs(float(noise.std()) - 3.0) < 0.4 and abs(float(noise.mean())) < 0.5
    assert not torch.allclose(att[(1, c)][1]["head.weight"], att[(2, c)][1]["head.weight"])  # fresh per round
    for key in att:
        for k in att[key][1]:
            assert torch.equal(att[key][1][k], again[key][1][k])
    honest = min(set(range(10)) - bad)
    torch.testing.assert_close(att[(1, honest)][1]["head.weight"], clean[(1, honest)][1]["head.weight"])


# -- robustness on real data ----------------------------------------------------------------------

# A tiny digits federation: 10 IID clients, all participating every round, 15 rounds of 2 local epochs.
# The CNN has two conv blocks (a single block pooled to 2x2 learns digits too slowly for a short test).
# Accuracy is the mean test accuracy after rounds 13, 14 and 15, because the accuracy after one round
# swings by up to ~8 points. Measured with seeds 0-3 (clean FedAvg 0.91-0.94; gap to the clean run,
# worst over the seeds): FedAvg under the attack 0.81-0.84 (chance level), median 0.024, trimmed mean
# 0.057, Krum 0.074. The margins below leave headroom over those worst cases.
ROUNDS = 15
ROBUST_CFG = {
    "partition": {"name": "iid", "num_clients": 10, "local_test_fraction": 0.2},
    "model": {"name": "cnn", "channels": [8, 16], "hidden": 32},
    "train": {"epochs": 2, "batch_size": 16, "lr": 0.2},
    "server.rounds": ROUNDS,
    "server.clients_per_round": 10,
    "eval.every": ROUNDS,
    "eval.local": False,
}
ATTACK = [{"name": "attack", "fraction": 0.2, "kind": "flip", "scale": 10.0}]


def _digits_acc(aggregator, components):
    cfg = validate(tiny(**ROBUST_CFG, **{"recipe.aggregator": aggregator, "recipe.components": components}))
    sim = build_simulation(cfg)
    accs = []
    for r in range(ROUNDS - 2, ROUNDS + 1):
        sim.run(stop_after=r)
        accs.append(sim.evaluate()["test/acc"])
    return sum(accs) / len(accs)


@pytest.fixture(scope="module")
def clean_acc():
    return _digits_acc({"name": "mean"}, [])


def test_fedavg_collapses_under_sign_flipping_attack_on_digits(clean_acc):
    assert clean_acc > 0.85
    attacked = _digits_acc({"name": "mean"}, ATTACK)
    assert attacked < 0.3 and clean_acc - attacked > 0.5, (attacked, clean_acc)


@pytest.mark.parametrize("aggregator, margin", [
    ({"name": "median"}, 0.06),
    ({"name": "trimmed_mean", "trim": 0.2}, 0.10),
    ({"name": "krum", "byzantine": 2}, 0.12),
], ids=["median", "trimmed_mean", "krum"])
def test_robust_aggregator_survives_sign_flipping_attack_on_digits(clean_acc, aggregator, margin):
    acc = _digits_acc(aggregator, ATTACK)
    assert acc > clean_acc - margin, (acc, clean_acc)


# -- norm bounding (Sun et al. 2019) ----------------------------------------------------------------------


class _Raw(Component):
    """Listed before norm_bound: records the raw accepted results and the global model before the round."""

    name = "raw_spy"

    def __init__(self, seen):
        self.seen = seen

    def server_results(self, sctx, results):
        self.seen.append(([{k: v.clone() for k, v in r.delta.items()} for r in results],
                          [float(r.num_examples) for r in results],
                          {k: v.detach().clone() for k, v in sctx.model.state_dict().items()}))
        return results


def _norm(delta) -> float:
    return math.sqrt(sum(float((v.double() ** 2).sum()) for v in delta.values()))


@pytest.mark.parametrize("params", [{"bound": 0.05}, {"quantile": 0.5}, {"quantile": 1.0}])
def test_norm_bound_clips_each_update_before_the_weighted_mean(params) -> None:
    """The global step equals sum_k w_k Delta_k min(1, M / ||Delta_k||) with M fixed or the round's quantile
    (numpy), computed from the raw updates; every clipped update is an event; a flipping attacker's scaled
    update is bounded like any other."""
    seen: list = []
    raw = tiny(**{"server.rounds": 2, "server.clients_per_round": 5,
                  "recipe.components": [{"name": "attack", "fraction": 0.2, "kind": "flip"}]})
    sim = build_simulation(validate(raw))
    stage = sim.server.stages[0]
    stage.recipe.components.append(_Raw(seen))
    stage.recipe.components.append(R.build(R.COMPONENTS, "norm_bound", params))
    rows = []
    sim.run(on_round=lambda r, row, ev: rows.append((row, ev)))
    final = {k: v.detach().clone() for k, v in sim.global_model.state_dict().items()}
    for i, (deltas, n, before) in enumerate(seen):
        norms = np.array([_norm(d) for d in deltas])
        bound = params.get("bound") or float(np.quantile(norms, params["quantile"]))
        w = np.array(n) / sum(n)
        after = final if i == len(seen) - 1 else seen[i + 1][2]
        for k in deltas[0]:
            want = before[k].double() + sum(wi * d[k].double() * min(1.0, bound / nk) for wi, d, nk in zip(w, deltas, norms))
            torch.testing.assert_close(after[k].double(), want, rtol=1e-5, atol=1e-7)
        row, events = rows[i]
        clipped = [e for e in events if e["event"] == "update_clipped"]
        assert len(clipped) == int((norms > bound).sum()) == row["norm_bound/clipped"]
        assert row["norm_bound/bound"] == pytest.approx(bound)
        assert all(e["norm"] > e["bound"] for e in clipped)
    if params == {"quantile": 1.0}:
        assert all(r["norm_bound/clipped"] == 0 for r, _ in rows)


def test_norm_bound_above_every_norm_leaves_the_run_bit_identical() -> None:
    plain = build_simulation(validate(tiny(**{"server.rounds": 2})))
    plain.run()
    bounded = build_simulation(validate(tiny(**{"server.rounds": 2, "recipe.components": [{"name": "norm_bound", "bound": 1e9}]})))
    bounded.run()
    for k, v in plain.global_model.state_dict().items():
        assert torch.equal(v, bounded.global_model.state_dict()[k]), k


def test_norm_bound_needs_exactly_one_rule() -> None:
    for bad in ({}, {"bound": 1.0, "quantile": 0.5}):
        with pytest.raises(ConfigError, match="exactly one of bound or quantile"):
            validate(tiny(**{"recipe.components": [{"name": "norm_bound", **bad}]}))


def test_krum_with_too_few_updates_skips_the_round_instead_of_ending_the_run() -> None:
    """f = 1 needs K > 4: with 5 sampled clients and one non-finite (rejected) update, round 1 is skipped
    with an event naming Krum's precondition and the global model is left as it was; the run goes on."""

    from fedsight.engine.plan import sample_clients

    first = sample_clients(0, 1, 6, 5)[0]

    class Nan(Component):
        name = "nan_once"

        def client_end(self, ctx, result):
            if ctx.round == 1 and ctx.client_id == first:
                result.delta = {k: torch.full_like(v, float("nan")) for k, v in result.delta.items()}

    raw = tiny(**{"server.rounds": 2, "server.clients_per_round": 5,
                  "recipe.aggregator": {"name": "krum", "byzantine": 1}})
    sim = build_simulation(validate(raw))
    sim.server.stages[0].recipe.components.append(Nan())
    before = {k: v.clone() for k, v in sim.global_model.state_dict().items()}
    log = []
    sim.run(on_round=lambda r, row, ev: log.append((dict(row), list(ev))), stop_after=1)
    row, events = log[0]
    assert [e["event"] for e in events] == ["rejected_update", "round_skipped"]
    assert "2 * byzantine + 2" in events[1]["reason"] and row["clients/aggregated"] == 0
    assert all(torch.equal(v, before[k]) for k, v in sim.global_model.state_dict().items())
    sim.run(on_round=lambda r, row, ev: log.append((dict(row), list(ev))))
    assert log[-1][0]["clients/aggregated"] == 5


@given(st.integers(1, 3).flatmap(lambda f: st.tuples(
    st.just(f), arrays(np.float64, st.tuples(st.integers(3, 2 * f + 2), st.integers(1, 4)), elements=finite))))
@settings(max_examples=30, deadline=None)
def test_krum_degrade_is_krum_with_the_largest_valid_f(fx) -> None:
    """``too_few = "degrade"``: a round with K <= 2f + 2 updates is aggregated as Krum with the largest f' that
    K > 2f' + 2 allows (the brute-force Krum of that f'), and says so; ``"skip"`` refuses it."""
    f, x = fx
    k = len(x)
    f2 = (k - 3) // 2
    assert k > 2 * f2 + 2 and not k > 2 * (f2 + 1) + 2  # the largest valid f', by the precondition itself
    rows = [{"a": r} for r in x]
    agg = R.build(R.AGGREGATORS, "krum", {"byzantine": f, "too_few": "degrade"})
    out = agg.aggregate(results_from(rows, ids=list(range(k))), torch.ones(k))
    _, ref, scores = brute_multi_krum(x, f2, 1)
    # a tie of the best scores (equal pairwise distances) is broken by rounding, not by the rule
    best, second = np.sort(scores)[:2]
    assume(second - best > 1e-9 * max(1.0, abs(second)))
    np.testing.assert_allclose(out["a"].numpy(), ref, rtol=1e-9, atol=1e-9)
    assert agg.degraded and f"byzantine {f} -> {f2}" in agg.degraded
    with pytest.raises(TooFewUpdates):
        R.build(R.AGGREGATORS, "krum", {"byzantine": f}).aggregate(results_from(rows, ids=list(range(k))), torch.ones(k))


def test_krum_degrade_round_is_an_event_and_the_config_allows_it() -> None:
    raw = tiny(**{"server.rounds": 1, "server.clients_per_round": 4,
                  "recipe.aggregator": {"name": "krum", "byzantine": 2, "too_few": "degrade"}})
    log = []
    build_simulation(validate(raw)).run(on_round=lambda r, row, ev: log.append((dict(row), list(ev))))
    row, events = log[0]
    events = [e for e in events if e["event"] != "client_metrics"]  # the local evaluation's per-client numbers
    assert [e["event"] for e in events] == ["aggregator_degraded"] and row["clients/aggregated"] == 4
    assert "byzantine 2 -> 0" in events[0]["reason"]
