"""DP-SGD (``dp_sgd``) against independent references: per-example gradients computed one example at a time
with plain autograd, the Gaussian noise's variance, and the (epsilon, delta) of Opacus's and Google's
dp-accounting accountants for the same (noise multiplier, sample rate, steps)."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from fedsight import registry as R
from fedsight.config import validate
from fedsight.errors import ConfigError
from fedsight.training import ClientContext, Component
from fedsight.training.context import ClientState
from fedsight.training.local import LocalTraining

from helpers import ToyTask, tiny, toy_sim


def toy_grad(W, b, x, y):
    """The toy task's cross-entropy gradient by plain autograd."""
    W = W.detach().clone().requires_grad_(True)
    b = b.detach().clone().requires_grad_(True)
    return torch.autograd.grad(torch.nn.functional.cross_entropy(x @ W.T + b, y), [W, b])


def dp(**params):
    return R.build(R.COMPONENTS, "dp_sgd", params)


class Recorder(Component):
    name = "recorder"

    def __init__(self):
        self.delta, self.metrics = {}, {}

    def client_end(self, ctx, result):
        self.delta[ctx.client_id] = {k: v.clone() for k, v in result.delta.items()}
        self.metrics[ctx.client_id] = dict(result.metrics)


def one_round(*components, **kw):
    rec = Recorder()
    sim = toy_sim(components=[*components, rec], **kw)
    g = {k: v.detach().clone() for k, v in sim.global_model.named_parameters()}
    events = []
    sim.run(on_round=lambda r, row, ev: events.extend(ev))
    return sim, g, rec, events


@settings(max_examples=8, deadline=None)
@given(lr=st.floats(0.01, 1.0), steps=st.integers(1, 3), seed=st.integers(0, 50))
def test_noise_zero_without_clipping_equals_plain_sgd(lr, steps, seed):
    """Opacus's per-example gradients, unclipped and noiseless, average back to the batch gradient."""
    _, _, plain, _ = one_round(lr=lr, steps=steps, batch_size=2, seed=seed)
    _, _, priv, _ = one_round(dp(noise_multiplier=0.0, max_grad_norm=1e9, sampling="shuffle"), lr=lr, steps=steps,
                              batch_size=2, seed=seed)
    for c in plain.delta:
        for k in plain.delta[c]:
            torch.testing.assert_close(priv.delta[c][k], plain.delta[c][k], rtol=1e-5, atol=1e-6)


class Ridge(Component):
    """A data-independent term lam * ||W||^2 (as a watermark or proximal term): its gradient must pass unclipped."""

    name = "ridge"

    def __init__(self, lam):
        self.lam = lam

    def loss_term(self, ctx, outputs, targets):
        return self.lam * ctx.model.head.weight.pow(2).sum()


@pytest.mark.parametrize("lam", [0.0, 0.5])
def test_one_step_is_the_mean_of_clipped_per_example_gradients(lam):
    """One full-batch step with noise 0: delta = -lr (mean_i g_i min(1, C/||g_i||) + grad of the
    data-independent term), each g_i from autograd on example i alone."""
    task = ToyTask(sizes=(5, 7))
    C, lr = 0.3, 0.5
    sim, g, rec, _ = one_round(dp(noise_multiplier=0.0, max_grad_norm=C, sampling="shuffle"), Ridge(lam),
                               task=task, lr=lr, steps=1)
    W, b = g["head.weight"], g["head.bias"]
    for c in range(task.num_clients):
        x, y = task.xs[c], task.ys[c]
        per = [toy_grad(W, b, x[i : i + 1], y[i : i + 1]) for i in range(len(y))]
        clipped = []
        for gw, gb in per:
            norm = math.sqrt(float(gw.pow(2).sum() + gb.pow(2).sum()))
            f = min(1.0, C / (norm + 1e-6))
            clipped.append((gw * f, gb * f))
        want_w = -lr * (sum(a for a, _ in clipped) / len(y) + 2 * lam * W)
        want_b = -lr * sum(b_ for _, b_ in clipped) / len(y)
        torch.testing.assert_close(rec.delta[c]["head.weight"], want_w, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(rec.delta[c]["head.bias"], want_b, rtol=1e-5, atol=1e-6)


def _ctx(model, n, batch, seed=0):
    local = LocalTraining(batch_size=batch, lr=0.1, steps=1)
    return ClientContext(client_id=0, round=1, model=model, global_params={}, num_examples=n, seed=seed,
                         num_steps=1, local=local)


@pytest.mark.parametrize("sampling", ["poisson", "shuffle"])
def test_noise_has_variance_z_c_over_expected_batch(sampling):
    """With zero per-example gradients the step's gradient is pure noise N(0, (z C / E[B])^2): its sample
    variance over 20,000 coordinates lies in the chi-square 99.9% interval."""
    model = torch.nn.Linear(100, 200)
    z, C, n, batch = 1.3, 0.7, 40, 8
    comp = dp(noise_multiplier=z, max_grad_norm=C, sampling=sampling)
    ctx = _ctx(model, n, batch)
    comp.client_start(ctx)
    x = torch.zeros(batch, 100)
    model(x).sum().mul(0).backward()  # per-example gradients exist and are zero
    comp.after_backward(ctx)
    comp._release()
    expected = (batch / n) * n if sampling == "poisson" else batch
    sd = z * C / expected
    g = torch.cat([p.grad.flatten() for p in model.parameters()]).double().numpy()
    k = g.size
    lo, hi = stats.chi2.ppf([0.0005, 0.9995], k) / k
    assert lo < np.mean(g**2) / sd**2 < hi
    assert abs(g.mean()) < 4 * sd / math.sqrt(k)


def test_hooks_are_removed_after_the_client():
    """The work model is shared by every client: no Opacus hook or per-example gradient stays on it."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    hooks_before = [len(m._forward_hooks) + len(m._backward_hooks) for m in model.modules()]
    _, _, rec, _ = one_round(dp(noise_multiplier=1.0), rounds=2)
    comp = dp(noise_multiplier=1.0)
    ctx = _ctx(model, 10, 2)
    comp.client_start(ctx)
    comp.client_start(ctx)  # a client whose training raised left its hooks: the next one removes them first
    comp._release()
    assert [len(m._forward_hooks) + len(m._backward_hooks) for m in model.modules()] == hooks_before
    assert not any(hasattr(p, "grad_sample") and p.grad_sample is not None for p in model.parameters())


def _opacus_eps(history, delta, accountant="rdp"):
    from opacus.accountants import PRVAccountant, RDPAccountant

    acc = RDPAccountant() if accountant == "rdp" else PRVAccountant()
    for z, q, steps in history:
        for _ in range(steps):
            acc.step(noise_multiplier=z, sample_rate=q)
    return acc.get_epsilon(delta)


def _google_rdp_eps(history, delta, orders=None):
    import dp_accounting as dpa
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    acc = rdp.RdpAccountant(orders)
    for z, q, steps in history:
        acc.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), steps)
    return acc.get_epsilon(delta)


def test_epsilon_per_client_and_round_equals_the_accountants():
    """Each round's ``privacy_spent`` event: the client's epsilon over every step it took so far equals Opacus's
    accountant stepped one step at a time, and Google's independent RDP accountant within 3%."""
    task = ToyTask(sizes=(20, 30, 25))
    rounds, batch, steps, z, delta = 3, 5, 4, 1.1, 1e-5
    sim, _, _, events = one_round(dp(noise_multiplier=z, delta=delta), task=task, rounds=rounds, batch_size=batch,
                                  steps=steps, clients_per_round=2)
    spent = [e for e in events if e["event"] == "privacy_spent"]
    assert len(spent) == rounds * 2
    taken = {c: 0 for c in range(3)}
    for e in spent:
        c = e["client"]
        taken[c] += 1
        q = batch / task.num_train_examples(c)
        history = [(z, q, steps)] * taken[c]
        assert e["sample_rate"] == pytest.approx(q)
        assert e["epsilon"] == pytest.approx(_opacus_eps(history, delta), rel=1e-9)
        assert e["epsilon"] == pytest.approx(_google_rdp_eps(history, delta), rel=0.03)


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_target_epsilon_calibration_and_both_accountants(accountant):
    """``target_epsilon`` with ``planned_rounds`` (RDP: the calibration is cheap): a client trained in every
    planned round ends at the target, within Opacus's calibration tolerance; with PRV (a given multiplier: its
    calibration takes seconds) the reported epsilon is Opacus's PRV accountant's."""
    task = ToyTask(sizes=(40, 50))
    rounds, target = 2, 3.0
    params = {"target_epsilon": target, "planned_rounds": rounds} if accountant == "rdp" else {"noise_multiplier": 1.2}
    _, _, rec, events = one_round(dp(accountant=accountant, **params), task=task, rounds=rounds, batch_size=8, steps=3)
    last = {e["client"]: e for e in events if e["event"] == "privacy_spent"}
    for c, e in last.items():
        assert e["accountant"] == accountant
        q = 8 / task.num_train_examples(c)
        want = _opacus_eps([(e["noise_multiplier"], q, 3)] * rounds, 1e-5, accountant)
        assert e["epsilon"] == pytest.approx(want, rel=1e-6)
        if accountant == "rdp":
            assert target * 0.97 <= e["epsilon"] <= target * 1.001


def test_poisson_batches_vary_and_empty_batches_are_noise_only_steps():
    """q = B / n: batch sizes are Binomial(n, q); with q tiny most batches are empty and the client still
    takes every step (accounted), moving only by noise."""
    task = ToyTask(sizes=(200,))
    comp = dp(noise_multiplier=1.0)
    ctx = _ctx(task.build_model(), 200, 10)
    comp.client_start(ctx)
    batches = comp.batch_positions(ctx, 2000, torch.Generator().manual_seed(0))
    comp._release()
    sizes = np.array([len(b) for b in batches])
    assert abs(sizes.mean() - 10) < 4 * math.sqrt(10 * 0.95 / 2000)
    assert stats.kstest(sizes, stats.binom(200, 0.05).cdf).pvalue > 1e-3 or abs(sizes.var() - 9.5) < 1.5
    tiny_task = ToyTask(sizes=(3,))
    _, g, rec, events = one_round(dp(noise_multiplier=0.5), task=tiny_task, batch_size=1, steps=6, lr=0.1)
    assert any(v.abs().sum() > 0 for v in rec.delta[0].values())
    (e,) = [e for e in events if e["event"] == "privacy_spent"]
    assert e["epsilon"] == pytest.approx(_opacus_eps([(0.5, 1 / 3, 6)], 1e-5), rel=1e-9)


class Poison(Component):
    name = "poison"

    def client_end(self, ctx, result):
        for v in result.delta.values():
            v.fill_(float("nan"))


def test_privacy_spent_is_kept_when_the_update_is_rejected():
    """A non-finite update is dropped with the client's state, but not the privacy history it spent."""
    sim, _, _, _ = one_round(dp(noise_multiplier=1.0), Poison(), rounds=2, batch_size=2, steps=2)
    for c in range(sim.server.task.num_clients):
        held = sim.runtime.store.get("dp_sgd", c)
        assert held is not None and held["history"].shape == (2, 3)
        assert held["history"][:, 2].tolist() == [2.0, 2.0]


def test_batchnorm_model_refused_at_config_time():
    raw = tiny(**{"model.norm": "batch", "recipe.components": [{"name": "dp_sgd", "noise_multiplier": 1.0}]})
    with pytest.raises(ConfigError, match=r"recipe.components\[0\]: .dp_sgd. needs per-example gradients.*BatchNorm"):
        validate(raw)
    validate(tiny(**{"model.norm": "group", "recipe.components": [{"name": "dp_sgd", "noise_multiplier": 1.0}]}))


def test_a_model_folding_frames_into_the_batch_is_refused_unless_vectorised():
    """A declared video model (``folds_batch``) at config time, naming what to set; one that folds without declaring
    it (a plugin) at its first step, from the rows Opacus saw: 4 rows for a batch of 2 clips of 2 frames."""
    from fedsight.recipe.dp_sgd import DPSGD, DPSGDParams

    def cfg(vectorize):
        return {"task": "video_sr", "seed": 0,
                "data": {"name": "synthetic_video", "sources": ["astronaut"], "clips_per_source": 2, "clip_length": 3,
                         "frame_size": 24, "scale": 2, "num_frames": 2, "patch_size": 6},
                "partition": {"name": "iid", "num_clients": 2}, "model": {"name": "sliding_vsr", "channels": 4, "blocks": 1},
                "train": {"steps": 1, "batch_size": 2, "lr": 0.05}, "server": {"rounds": 1, "clients_per_round": 2},
                "engine": {"vectorize": vectorize}, "recipe": {"components": [{"name": "dp_sgd", "noise_multiplier": 1.0}]}}

    for vectorize in ("auto", False):
        with pytest.raises(ConfigError, match=r"'dp_sgd' needs per-example gradients.*folds a clip's frames.*"
                                              r"engine.vectorize = true"):
            validate(cfg(vectorize))
    validate(cfg(True))
    dp = DPSGD(DPSGDParams(noise_multiplier=1.0))
    with pytest.raises(ConfigError, match="compute on 4 rows for a batch of 2 examples"):
        dp._check_rows(4, (torch.zeros(2, 2, 3, 8, 8),))
    dp._check_rows(2, (torch.zeros(2, 2, 3, 8, 8),))


@pytest.mark.parametrize("bad,match", [({}, "exactly one"), ({"noise_multiplier": 1.0, "target_epsilon": 2.0}, "exactly one"),
                                       ({"target_epsilon": 2.0}, "planned_rounds")])
def test_params_are_checked(bad, match):
    with pytest.raises(Exception, match=match):
        dp(**bad)


def test_client_state_always_entries_survive_a_rejected_commit():
    class Store(dict):
        def put(self, key, client, round, tensors):
            self[key] = tensors

        def get(self, key, client):
            return dict.get(self, key)

    store = Store()
    st_ = ClientState(store, 0, 1)
    st_.save("a", {"x": torch.ones(1)})
    st_.save("b", {"x": torch.ones(1)}, always=True)
    st_.commit(only_always=True)
    assert set(store) == {"b"}


@pytest.mark.parametrize("z, q, steps", [(20.0, 0.1, 10), (50.0, 1.0, 1), (1.1, 0.2, 30)])
def test_epsilon_searches_orders_above_63(z, q, steps):
    """With much noise the optimal RDP order lies above Opacus's default grid (which ends at 63 and warns): the
    reported epsilon is Google's RDP accountant's on the same orders within 1%, never above Opacus's default
    grid's, and no "largest alpha" warning reaches the user."""
    import warnings

    from opacus.accountants import RDPAccountant

    from fedsight.recipe.dp_sgd import RDP_ORDERS, epsilon

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eps = epsilon([(z, q, steps)], 1e-5)
    orders = list(RDPAccountant.DEFAULT_ALPHAS) + RDP_ORDERS
    assert eps == pytest.approx(_google_rdp_eps([(z, q, steps)], 1e-5, orders), rel=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert eps <= _opacus_eps([(z, q, 1)] * steps, 1e-5) * (1 + 1e-9)
