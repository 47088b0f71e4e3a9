"""FedProx, FedNova and Elastic aggregation against hand computations from their update equations.

Every expected value is computed here from plain torch arithmetic on the toy softmax regression
(full-batch steps), never with the implementations' own helpers.
"""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsight import registry as R
from fedsight.api import build_simulation
from fedsight.config import validate
from fedsight.training import Component
from fedsight.records import ClientResult
from fedsight.rng import torch_gen

from helpers import ToyTask, tiny, toy_sim


class Recorder(Component):
    """Records, per client, what it received and what it sent (put it after the tested component)."""

    name = "recorder"

    def __init__(self):
        self.seen = {}

    def client_end(self, ctx, result):
        self.seen[ctx.client_id] = {
            "global": {k: v.clone() for k, v in ctx.global_params.items()},
            "delta": {k: v.clone() for k, v in result.delta.items()},
            "buffers": {k: v.clone() for k, v in result.buffers.items()},
            "steps": result.num_steps,
            "n": result.num_examples,
            "extras": copy.deepcopy(result.extras),
        }


def comp(name, **params):
    return R.build(R.COMPONENTS, name, params)


def global_params(sim):
    return {k: v.detach().clone() for k, v in sim.global_model.named_parameters()}


def run_round(sim, *components):
    """One round; returns (global before, global after, recorder)."""
    rec = Recorder()
    sim.recipe.components.extend([*components, rec])
    before = global_params(sim)
    sim.run(stop_after=sim.round + 1)
    return before, global_params(sim), rec


def toy_loss(W, b, x, y):
    """The toy task's loss, F_k(W, b) = mean cross-entropy of softmax(x W^T + b), written independently."""
    return F.cross_entropy(x @ W.T + b, y)


def toy_grad(W, b, x, y):
    W = W.detach().clone().requires_grad_(True)
    b = b.detach().clone().requires_grad_(True)
    gW, gb = torch.autograd.grad(toy_loss(W, b, x, y), [W, b])
    return gW, gb


def p_weights(rec):
    n = torch.tensor([float(rec.seen[c]["n"]) for c in sorted(rec.seen)], dtype=torch.float64)
    return n / n.sum()


# -- FedProx (Li et al. 2020, eq. (2)) --------------------------------------------------------------


def test_fedprox_two_full_batch_steps_match_hand_computation():
    mu, lr = 0.7, 0.3
    sim = toy_sim(lr=lr, steps=2)
    _, _, rec = run_round(sim, comp("fedprox", mu=mu))
    task = sim.task
    for c in range(task.num_clients):
        g = rec.seen[c]["global"]
        Wg, bg = g["head.weight"].double(), g["head.bias"].double()
        x, y = task.xs[c].double(), task.ys[c]
        # step 1: w == w^t, so the proximal gradient mu (w - w^t) vanishes
        gW, gb = toy_grad(Wg, bg, x, y)
        W1, b1 = Wg - lr * gW, bg - lr * gb
        # step 2: grad h_k = grad F_k(w) + mu (w - w^t)
        gW, gb = toy_grad(W1, b1, x, y)
        W2 = W1 - lr * (gW + mu * (W1 - Wg))
        b2 = b1 - lr * (gb + mu * (b1 - bg))
        d = rec.seen[c]["delta"]
        torch.testing.assert_close(d["head.weight"].double(), W2 - Wg, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(d["head.bias"].double(), b2 - bg, rtol=1e-5, atol=1e-6)
        # and the proximal term really mattered at step 2
        W2_plain = W1 - lr * gW
        assert (W2 - W2_plain).abs().max() > 1e-4


def test_fedprox_mu_zero_equals_plain_training():
    kw = dict(lr=0.2, steps=3, batch_size=2, momentum=0.5, rounds=2)
    a = toy_sim(components=[comp("fedprox", mu=0.0)], **kw)
    b = toy_sim(**kw)
    a.run()
    b.run()
    for (k, pa), pb in zip(a.global_model.state_dict().items(), b.global_model.state_dict().values()):
        assert torch.equal(pa, pb), k


def test_fedprox_large_mu_keeps_clients_closer_to_the_global_model():
    def norms(mu):
        sim = toy_sim(lr=0.1, steps=8)
        _, _, rec = run_round(sim, comp("fedprox", mu=mu))
        return [
            torch.sqrt(sum(d.pow(2).sum() for d in rec.seen[c]["delta"].values())).item() for c in sorted(rec.seen)
        ]

    free, prox = norms(0.0), norms(5.0)
    for f, p in zip(free, prox):
        assert p < 0.8 * f


# -- FedNova (Wang et al. 2020, Sec. 4) -------------------------------------------------------------


def fednova_expected(rec, before, key):
    """x^{t+1} = x^t + tau_eff sum_k p_k Delta_k / a_k, tau_eff = sum_k p_k a_k (vanilla SGD: a_k = tau_k)."""
    cl = sorted(rec.seen)
    p = p_weights(rec)
    a = torch.tensor([float(rec.seen[c]["steps"]) for c in cl], dtype=torch.float64)
    tau_eff = (p * a).sum()
    upd = sum(p[i] * rec.seen[c]["delta"][key].double() / a[i] for i, c in enumerate(cl))
    return before[key].double() + tau_eff * upd


def test_fednova_heterogeneous_steps_aggregate_matches_hand_formula():
    nova = comp("fednova")
    sim = toy_sim(steps_range=(1, 4), aggregator=nova.aggregator(), lr=0.2, seed=3)
    before, after, rec = run_round(sim, nova)
    steps = [rec.seen[c]["steps"] for c in sorted(rec.seen)]
    assert len(set(steps)) > 1, steps  # the test is about heterogeneous local work
    for c in rec.seen:
        assert float(rec.seen[c]["extras"]["fednova"]["a"]) == rec.seen[c]["steps"]
    p = p_weights(rec)
    for key in before:
        want = fednova_expected(rec, before, key)
        torch.testing.assert_close(after[key].double(), want, rtol=1e-5, atol=1e-7)
        deltas = [rec.seen[c]["delta"][key].double() for c in sorted(rec.seen)]
        fedavg = before[key].double() + sum(p[i] * d for i, d in enumerate(deltas))
        assert (want - fedavg).abs().max() > 1e-4  # FedNova is not FedAvg here


@settings(max_examples=15)
@given(steps=st.integers(1, 4), momentum=st.sampled_from([0.0, 0.5, 0.9]), prox=st.sampled_from([0.0, 0.3]),
       seed=st.integers(0, 5))
def test_fednova_equal_steps_equals_fedavg(steps, momentum, prox, seed):
    kw = dict(steps=steps, momentum=momentum, lr=0.2, seed=seed, rounds=2)
    nova = comp("fednova", prox_mu=prox)
    a = toy_sim(components=[nova], aggregator=nova.aggregator(), **kw)
    b = toy_sim(**kw)
    a.run()
    b.run()
    for (k, pa), pb in zip(a.global_model.state_dict().items(), b.global_model.state_dict().values()):
        # float32 parameters: the two aggregations round differently at ~1 ulp of the largest entry
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-7, msg=k)


def sgd_displacement_factor(steps, lr, momentum, prox_mu=0.0):
    """Run torch SGD(momentum) on f(w) = g.w + (prox_mu/2)||w - w0||^2 from w0: the displacement is
    -lr * (sum of the step weights) * g by linearity, so return -disp / (lr g): ||a||_1 while every step
    weight is positive (true for these few steps)."""
    g = torch.tensor([0.7, -1.3], dtype=torch.float64)
    w0 = torch.tensor([0.2, 0.4], dtype=torch.float64)
    w = w0.clone().requires_grad_(True)
    opt = torch.optim.SGD([w], lr=lr, momentum=momentum)
    for _ in range(steps):
        opt.zero_grad()
        (g @ w + 0.5 * prox_mu * (w - w0).pow(2).sum()).backward()
        opt.step()
    ratio = -(w.detach() - w0) / (lr * g)
    assert torch.allclose(ratio[0], ratio[1], rtol=1e-10)
    return float(ratio[0])


@pytest.mark.parametrize("momentum,prox", [(0.9, 0.0), (0.5, 0.0), (0.0, 0.4), (0.9, 0.4)])
def test_fednova_momentum_factor_matches_effective_step_weights(momentum, prox):
    nova = comp("fednova", prox_mu=prox)
    lr = 0.1
    sim = toy_sim(steps_range=(1, 6), momentum=momentum, lr=lr, aggregator=nova.aggregator(), seed=1)
    before, after, rec = run_round(sim, nova)
    cl = sorted(rec.seen)
    a = []
    for c in cl:
        tau = rec.seen[c]["steps"]
        want = sgd_displacement_factor(tau, lr, momentum, prox)
        if prox == 0.0:  # the paper's closed form for SGD with momentum
            closed = (tau - momentum * (1 - momentum**tau) / (1 - momentum)) / (1 - momentum)
            assert want == pytest.approx(closed, rel=1e-12)
        got = float(rec.seen[c]["extras"]["fednova"]["a"])
        assert got == pytest.approx(want, rel=1e-9), (c, tau)
        a.append(want)
    # the aggregate uses those factors
    p = p_weights(rec)
    a = torch.tensor(a, dtype=torch.float64)
    tau_eff = (p * a).sum()
    for key in before:
        upd = sum(p[i] * rec.seen[c]["delta"][key].double() / a[i] for i, c in enumerate(cl))
        torch.testing.assert_close(after[key].double(), before[key].double() + tau_eff * upd, rtol=1e-5, atol=1e-7)


@settings(max_examples=30)
@given(w=st.lists(st.floats(0.1, 10.0), min_size=3, max_size=3), scale=st.floats(0.01, 100.0),
       perm=st.permutations([0, 1, 2]))
def test_fednova_aggregator_invariant_to_order_and_weight_scale(w, scale, perm):
    g = torch.Generator().manual_seed(0)
    results = [
        ClientResult(client_id=i, num_examples=1, delta={"x": torch.randn(4, generator=g)},
                     extras={"fednova": {"a": torch.tensor(float(i + 1), dtype=torch.float64)}})
        for i in range(3)
    ]
    agg = comp("fednova").aggregator()
    ref = agg.aggregate(results, torch.tensor(w, dtype=torch.float64))
    other = agg.aggregate([results[i] for i in perm], torch.tensor([w[i] * scale for i in perm], dtype=torch.float64))
    torch.testing.assert_close(ref["x"], other["x"], rtol=1e-5, atol=1e-6)


# -- Elastic aggregation (Chen et al. 2023, Algorithm 1; FedVG's baseline) ---------------------------


def test_elastic_sensitivity_full_sample_single_batch():
    # sample_ratio 1 and a batch larger than every client: the sample is the whole client set in one
    # batch, so S_i = (1 - mu) ||dF/dtheta_i||^2 at the received global model
    mu = 0.8
    sim = toy_sim(lr=0.1)
    _, _, rec = run_round(sim, comp("elastic", mu=mu, sample_ratio=1.0))
    for c in rec.seen:
        g = rec.seen[c]["global"]
        gW, gb = toy_grad(g["head.weight"].double(), g["head.bias"].double(), sim.task.xs[c].double(), sim.task.ys[c])
        s = rec.seen[c]["extras"]["elastic"]
        assert float(s["head.weight"]) == pytest.approx((1 - mu) * float(gW.pow(2).sum()), rel=1e-5)
        assert float(s["head.bias"]) == pytest.approx((1 - mu) * float(gb.pow(2).sum()), rel=1e-5)


def independent_sensitivity(task, c, g, seed, round, ratio, mu, bs, element=False):
    """EMA over mini-batches of the documented sample (first floor(ratio n) of the ("elastic", round,
    client) permutation, in order) of squared gradients of the global model."""
    n = len(task.ys[c])
    m = max(1, int(ratio * n))
    idx = torch.randperm(n, generator=torch_gen(seed, "elastic", round, c))[:m]
    W, b = g["head.weight"].double(), g["head.bias"].double()
    SW = torch.zeros_like(W) if element else torch.zeros((), dtype=torch.float64)
    Sb = torch.zeros_like(b) if element else torch.zeros((), dtype=torch.float64)
    batches = 0
    for s in range(0, m, bs):
        j = idx[s : s + bs]
        gW, gb = toy_grad(W, b, task.xs[c][j].double(), task.ys[c][j])
        SW = mu * SW + (1 - mu) * (gW.pow(2) if element else gW.pow(2).sum())
        Sb = mu * Sb + (1 - mu) * (gb.pow(2) if element else gb.pow(2).sum())
        batches += 1
    return {"head.weight": SW, "head.bias": Sb}, batches


@pytest.mark.parametrize("granularity", ["tensor", "element"])
def test_elastic_sensitivity_ema_over_minibatches(granularity):
    task = ToyTask(sizes=(10, 12, 9))
    mu, ratio, bs = 0.7, 0.6, 2
    sim = toy_sim(task=task, batch_size=bs, steps=2, seed=4)
    _, _, rec = run_round(sim, comp("elastic", mu=mu, sample_ratio=ratio, granularity=granularity))
    for c in rec.seen:
        want, batches = independent_sensitivity(task, c, rec.seen[c]["global"], 4, 1, ratio, mu, bs,
                                                element=granularity == "element")
        assert batches >= 3
        got = rec.seen[c]["extras"]["elastic"]
        for k in want:
            assert got[k].shape == (want[k].shape if granularity == "element" else ())
            torch.testing.assert_close(got[k].double(), want[k], rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("granularity", ["tensor", "element"])
def test_elastic_zeta_and_aggregate_match_hand_computation(granularity):
    tau = 0.3
    task = ToyTask(sizes=(10, 12, 9))
    sim = toy_sim(task=task, batch_size=3, steps=3, lr=0.3, seed=2)
    el = comp("elastic", tau=tau, mu=0.9, sample_ratio=0.5, granularity=granularity)
    sim.recipe.aggregator = el.aggregator()
    before, after, rec = run_round(sim, el)
    cl = sorted(rec.seen)
    p = p_weights(rec)
    for key in before:
        S = torch.stack([rec.seen[c]["extras"]["elastic"][key].double() for c in cl])
        wmean = sum(p[i] * S[i] for i in range(len(cl)))
        zeta = 1 + tau - wmean / S.max(dim=0).values
        assert (zeta >= tau - 1e-12).all() and (zeta <= 1 + tau).all()
        mean_delta = sum(p[i] * rec.seen[c]["delta"][key].double() for i, c in enumerate(cl))
        torch.testing.assert_close(after[key].double(), before[key].double() + zeta * mean_delta, rtol=1e-5, atol=1e-7)
        assert (zeta - 1).abs().max() > 1e-3  # elastic is not FedAvg here


@settings(max_examples=30)
@given(w=st.lists(st.floats(0.1, 10.0), min_size=2, max_size=4), sens=st.floats(1e-6, 1e3),
       tau=st.floats(0.0, 1.0))
def test_elastic_equal_sensitivity_gives_zeta_tau(w, sens, tau):
    g = torch.Generator().manual_seed(1)
    results = [
        ClientResult(client_id=i, num_examples=1,
                     delta={"a": torch.randn(3, generator=g), "b": torch.randn(2, 2, generator=g)},
                     extras={"elastic": {"a": torch.tensor(sens), "b": torch.full((2, 2), sens)}})
        for i in range(len(w))
    ]
    out = comp("elastic", tau=tau).aggregator().aggregate(results, torch.tensor(w, dtype=torch.float64))
    wt = torch.tensor(w, dtype=torch.float64) / sum(w)
    for k in ("a", "b"):
        mean = sum(wt[i] * r.delta[k].double() for i, r in enumerate(results))
        torch.testing.assert_close(out[k].double(), tau * mean, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("bn", [False, True])
def test_elastic_does_not_change_local_training(bn):
    kw = dict(task=ToyTask(sizes=(10, 12, 8), bn=bn), batch_size=4, steps=3, momentum=0.5, seed=5)
    _, _, with_el = run_round(toy_sim(**kw), comp("elastic", sample_ratio=0.5))
    _, _, without = run_round(toy_sim(**kw))
    for c in without.seen:
        assert with_el.seen[c]["extras"]["elastic"]  # the pass ran
        for part in ("delta", "buffers"):
            for k, v in without.seen[c][part].items():
                assert torch.equal(with_el.seen[c][part][k], v), (c, part, k)
    if bn:
        assert without.seen[0]["buffers"]  # BatchNorm statistics were compared too


# -- configuration ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "components,aggregator",
    [
        ([{"name": "fedprox", "mu": 0.01}], "MeanAggregator"),
        ([{"name": "fednova"}], "FedNovaAggregator"),
        ([{"name": "elastic", "tau": 0.5, "sample_ratio": 0.3}], "ElasticAggregator"),
        ([{"name": "fedprox", "mu": 0.01}, {"name": "fednova", "prox_mu": 0.01}], "FedNovaAggregator"),
    ],
)
def test_components_build_from_config_and_run(components, aggregator):
    cfg = validate(tiny(**{"recipe.components": components, "server.rounds": 1, "eval.every": 1}))
    sim = build_simulation(cfg)
    assert type(sim.recipe.aggregator).__name__ == aggregator
    sim.run()
    assert all(torch.isfinite(p).all() for p in sim.global_model.parameters())


def test_bad_params_are_config_errors():
    from fedsight.config import ConfigError

    for bad in ({"name": "fedprox", "mu": -1.0}, {"name": "elastic", "granularity": "layer"},
                {"name": "elastic", "sample_ratio": 0.0}, {"name": "fednova", "prox": 1.0}):
        with pytest.raises(ConfigError):
            validate(tiny(**{"recipe.components": [bad]}))


def test_fednova_norm_is_the_l1_norm_of_per_step_weights_with_momentum_and_prox():
    """||a||_1 (Wang et al. 2020, Sec. 4) from torch's own SGD: a_j is the final displacement caused by a unit
    gradient at step j alone (with the proximal term active throughout), divided by -lr. With momentum and a
    proximal term some a_j are negative, so the norm exceeds the signed sum (the issue's 213.858 vs 200.705)."""
    from fedsight.recipe.fednova import normalizing_factor

    tau, lr, rho, mu = 100, 0.05, 0.9, 0.1
    a = []
    for j in range(tau):
        w = torch.zeros(1, dtype=torch.float64, requires_grad=True)
        opt = torch.optim.SGD([w], lr=lr, momentum=rho)
        for step in range(tau):
            opt.zero_grad()
            g = 1.0 if step == j else 0.0
            (g * w.sum() + 0.5 * mu * w.pow(2).sum()).backward()
            opt.step()
        a.append(-float(w.detach()) / lr)
    a = np.array(a)
    assert (a < 0).any()  # the case where the norm and the signed sum differ
    assert normalizing_factor(tau, lr, rho, mu) == pytest.approx(np.abs(a).sum(), rel=1e-10)
    assert normalizing_factor(100, 0.05, 0.9, 0.1) == pytest.approx(213.858, abs=1e-3)
