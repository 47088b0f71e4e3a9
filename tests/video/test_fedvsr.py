"""FedVSR: the loss-aware weighting (Algorithm 1 lines 15-21) and the DWT loss component (eq. (11))."""

from __future__ import annotations


import numpy as np
import pytest
import pywt
import torch
import torch.nn.functional as F
from torch import nn

from fedsight.training.local import LocalTraining, train_client
from fedsight.training import ServerContext
from fedsight.recipe.fedvsr import DWTLoss, DWTLossParams, FedVSRWeighting
from fedsight.records import ClientResult
from fedsight.registry import COMPONENTS, WEIGHTINGS, build
from helpers import ToyTask, toy_sim


def _results(losses):
    return [
        ClientResult(client_id=i, num_examples=10 * (i + 1), delta={}, metrics={"train/loss": float(l)})
        for i, l in enumerate(losses)
    ]


def _sctx(t, T):
    return ServerContext(round=t, model=nn.Linear(1, 1), num_clients=5, sampled=[0, 1, 2], rounds=T)


def _norm(w):
    w = torch.as_tensor(w, dtype=torch.float64)
    return w / w.sum()


LOSSES = [0.05, 0.2, 0.1]


def test_weights_are_inverse_losses_at_t0_and_uniform_at_T():
    wt = build(WEIGHTINGS, "fedvsr")
    T = 10
    at0 = _norm(wt.weights(_results(LOSSES), _sctx(0, T)))
    inv = [1 / 0.05, 1 / 0.2, 1 / 0.1]  # 20, 5, 10 -> 4/7, 1/7, 2/7
    torch.testing.assert_close(at0, torch.tensor([4 / 7, 1 / 7, 2 / 7], dtype=torch.float64))
    torch.testing.assert_close(at0, _norm(inv))
    atT = _norm(wt.weights(_results(LOSSES), _sctx(T, T)))
    torch.testing.assert_close(atT, torch.full((3,), 1 / 3, dtype=torch.float64))


def test_linear_decay_in_between():
    wt = build(WEIGHTINGS, "fedvsr", {"decay": "linear", "alpha": 2.0})
    T, t = 8, 3
    gamma = 2.0 * (1 - 3 / 8)  # 1.25
    expected = _norm([(1 / l) ** gamma for l in LOSSES])
    sctx = _sctx(t, T)
    torch.testing.assert_close(_norm(wt.weights(_results(LOSSES), sctx)), expected)
    assert sctx.metrics["fedvsr/exponent"] == pytest.approx(1.25)
    # lower loss -> larger weight; data sizes play no part
    w = _norm(wt.weights(_results(LOSSES), sctx))
    assert w[0] > w[2] > w[1]


def test_paper_rule_applies_alpha_then_decays_it():
    T, alpha0 = 5, 3.0
    wt = build(WEIGHTINGS, "fedvsr", {"decay": "paper", "alpha": alpha0})
    alpha = alpha0
    for t in range(1, T + 1):  # Algorithm 1: aggregate with alpha (lines 16-20), then alpha = alpha^(1 - t/T) (line 21)
        expected = _norm([(1 / l) ** alpha for l in LOSSES])
        torch.testing.assert_close(_norm(wt.weights(_results(LOSSES), _sctx(t, T))), expected)
        alpha = alpha ** (1 - t / T)
    # with alpha0 = 1 the written rule never moves: pure inverse loss in every round
    one = build(WEIGHTINGS, "fedvsr", {"decay": "paper"})
    torch.testing.assert_close(_norm(one.weights(_results(LOSSES), _sctx(4, T))), _norm([20, 5, 10]))


def test_f_gla_is_the_normalised_inverse_loss_in_every_round():
    """F-GLA (Table 2; decay = "none", alpha = 1): w_i = (1/L_i) / sum_j (1/L_j) at every round, closed form
    4/7, 1/7, 2/7 for the losses 0.05, 0.2, 0.1, while the default schedule has moved towards uniform."""
    gla = build(WEIGHTINGS, "fedvsr", {"decay": "none", "alpha": 1.0})
    T = 10
    for t in (0, 1, 5, T):
        sctx = _sctx(t, T)
        torch.testing.assert_close(_norm(gla.weights(_results(LOSSES), sctx)),
                                   torch.tensor([4 / 7, 1 / 7, 2 / 7], dtype=torch.float64))
        assert sctx.metrics["fedvsr/exponent"] == 1.0
        assert sctx.metrics["fedvsr/max_weight"] == pytest.approx(4 / 7)
    linear = _norm(build(WEIGHTINGS, "fedvsr").weights(_results(LOSSES), _sctx(5, T)))
    assert float(linear[0]) < 4 / 7 - 0.1


def test_no_decay_is_greedy_and_large_exponents_do_not_overflow():
    wt = build(WEIGHTINGS, "fedvsr", {"decay": "none", "alpha": 500.0})
    w = _norm(wt.weights(_results(LOSSES), _sctx(9, 10)))
    assert torch.isfinite(w).all()
    assert float(w[0]) == pytest.approx(1.0)  # the lowest-loss client takes everything


def test_engine_round_is_inverse_loss_weighted_model_average():
    """One round over ToyTask (softmax regression, one full-batch SGD step per client): the new global
    model is sum_i w_i W_i with w_i = (1/L_i)^(1 - t/T) normalised and L_i the client's loss at the
    received model (its mean loss over its single step), computed here by hand."""
    lr, T = 0.5, 4
    sim = toy_sim(weighting=build(WEIGHTINGS, "fedvsr"), lr=lr, rounds=T)
    task: ToyTask = sim.task
    W0 = sim.global_model.head.weight.detach().clone()
    b0 = sim.global_model.head.bias.detach().clone()
    models, losses = [], []
    for x, y in zip(task.xs, task.ys):
        W = W0.clone().requires_grad_(True)
        b = b0.clone().requires_grad_(True)
        loss = F.cross_entropy(x @ W.T + b, y)
        gW, gb = torch.autograd.grad(loss, (W, b))
        models.append((W0 - lr * gW, b0 - lr * gb))
        losses.append(float(loss.detach()))
    gamma = 1 - 1 / T  # round t = 1
    w = _norm([(1 / l) ** gamma for l in losses]).to(torch.float32)
    expected_W = sum(wi * m[0] for wi, m in zip(w, models))
    expected_b = sum(wi * m[1] for wi, m in zip(w, models))
    sim.run(stop_after=1)
    torch.testing.assert_close(sim.global_model.head.weight.detach(), expected_W, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(sim.global_model.head.bias.detach(), expected_b, atol=1e-6, rtol=1e-5)
    ids, weights = sim.last_weights
    torch.testing.assert_close(torch.as_tensor(weights, dtype=torch.float64), _norm([(1 / l) ** gamma for l in losses]))


# ------------------------------------------------------------------------------------- dwt_loss


def _haar_high_by_hand(x: torch.Tensor) -> torch.Tensor:
    """LH, HL, HH of every 2x2 block with explicit +-1/2 kernels (stride-2 convolution), [N, C*3, h, w]."""
    k = torch.tensor(
        [[[1, 1], [-1, -1]], [[1, -1], [1, -1]], [[1, -1], [-1, 1]]], dtype=x.dtype
    ) / 2.0
    n, c, h, w = x.shape
    weight = k.unsqueeze(1).repeat(c, 1, 1, 1)  # [3C, 1, 2, 2], grouped per channel
    return F.conv2d(x, weight, stride=2, groups=c)


class _FixedTask:
    """A stand-in task: one fixed LR/HR batch of 2-frame clips and a Charbonnier pixel loss."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x = torch.rand(2, 2, 3, 4, 4, generator=g)
        self.y = torch.rand(2, 2, 3, 8, 8, generator=g)

    def num_train_examples(self, client):
        return 2

    def train_batch(self, client, positions):
        return self.x[positions], self.y[positions]

    def train_batches(self, client, batches, *, seed=0, round=0):
        return (self.train_batch(client, p) for p in batches)

    def loss(self, out, target):
        return torch.sqrt((out - target) ** 2 + 1e-6**2).mean()


class _TinySR(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 12, 3, padding=1)

    def forward(self, x):
        b, t, c, h, w = x.shape
        return F.pixel_shuffle(self.conv(x.reshape(b * t, c, h, w)), 2).view(b, t, 3, 2 * h, 2 * w)


@pytest.mark.parametrize("lam_vsr,lam_hifr", [(1.0, 1.0), (0.5, 0.5), (1.0, 0.0)])
def test_dwt_loss_objective_and_step(lam_vsr, lam_hifr):
    """With one full-batch step the reported mean loss is eq. (11) at the received model and the step is
    -lr times its gradient; both computed here from a hand-written Haar transform and fresh autograd."""
    torch.manual_seed(0)
    task, model = _FixedTask(), _TinySR()
    w0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    eps, lr = 1e-3, 0.1
    comp = build(COMPONENTS, "dwt_loss", {"lambda_vsr": lam_vsr, "lambda_hifr": lam_hifr, "eps": eps})

    ref = _TinySR()
    ref.load_state_dict(model.state_dict())
    out = ref(task.x)
    pix = torch.sqrt((out - task.y) ** 2 + 1e-12).mean()
    d = (out - task.y).reshape(-1, 3, 8, 8)
    hifr = torch.sqrt(_haar_high_by_hand(d) ** 2 + eps**2).mean()
    objective = lam_vsr * pix + lam_hifr * hifr
    grads = torch.autograd.grad(objective, list(ref.parameters()))

    res = train_client(
        task, model, 0, 1, 0, LocalTraining(batch_size=10, lr=lr, epochs=None, steps=1), [comp], w0, [],
    )
    assert res.metrics["train/loss"] == pytest.approx(float(objective.detach()), rel=1e-5)
    for (k, p), g in zip(model.named_parameters(), grads):
        torch.testing.assert_close(p.detach(), w0[k] - lr * g, atol=1e-6, rtol=1e-5)


def test_dwt_loss_term_against_pywavelets():
    rng = np.random.default_rng(0)
    out, gt = rng.random((1, 2, 3, 6, 8)), rng.random((1, 2, 3, 6, 8))
    comp = DWTLoss(DWTLossParams(lambda_hifr=0.7, eps=1e-4))
    term = comp.loss_term(None, torch.from_numpy(out), torch.from_numpy(gt))
    _, (h1, v1, d1) = pywt.dwt2(out, "haar", mode="zero")
    _, (h2, v2, d2) = pywt.dwt2(gt, "haar", mode="zero")
    res = np.stack([h1 - h2, v1 - v2, d1 - d2])
    assert float(term) == pytest.approx(0.7 * np.sqrt(res**2 + 1e-8).mean(), rel=1e-10)


def test_dwt_loss_rejects_non_image_outputs_and_composes_in_config():
    with pytest.raises(ValueError, match="image outputs"):
        DWTLoss().loss_term(None, torch.zeros(4, 10), torch.zeros(4, dtype=torch.long))
    from fedsight.api import build_recipe
    from fedsight.config import ConfigError, validate
    from helpers import tiny

    recipe_over = {"recipe.components": [{"name": "dwt_loss", "lambda_hifr": 0.5}, {"name": "fedprox", "mu": 0.001}],
                   "recipe.weighting": {"name": "fedvsr", "decay": "paper", "alpha": 2.0}}
    # on a task whose outputs are not images, the config names both sides before anything runs
    with pytest.raises(ConfigError, match=r"recipe.components\[0\] = 'dwt_loss' needs images .*task 'classification'"):
        validate(tiny(**recipe_over))
    video = tiny(**{"task": "video_sr", "data": {"name": "synthetic_video", "sources": ["astronaut"], "test_sources": ["coffee"]},
                    "model": {"name": "basicvsr", "channels": 4, "blocks": 1}, "partition.name": "iid", **recipe_over})
    recipe = build_recipe(validate(video))
    assert isinstance(recipe.weighting, FedVSRWeighting) and recipe.weighting.p.decay == "paper"
    assert [c.name for c in recipe.components] == ["dwt_loss", "fedprox"]


# ----------------------------------------------------------------------------------- local_adam


def test_local_adam_equals_torch_adam():
    """Three local steps through the SGD loop with ``local_adam`` equal torch.optim.Adam (fresh moments)
    from the same start on the same full batches."""
    lr = 0.05
    comp = build(COMPONENTS, "local_adam", {"beta1": 0.8, "beta2": 0.95})
    sim = toy_sim(components=[comp], lr=lr, steps=3, rounds=2)
    task: ToyTask = sim.task
    W0 = sim.global_model.head.weight.detach().clone()
    b0 = sim.global_model.head.bias.detach().clone()
    locals_ = []
    for x, y in zip(task.xs, task.ys):
        W = W0.clone().requires_grad_(True)
        b = b0.clone().requires_grad_(True)
        opt = torch.optim.Adam([W, b], lr=lr, betas=(0.8, 0.95), eps=1e-8)
        for _ in range(3):
            opt.zero_grad()
            F.cross_entropy(x @ W.T + b, y).backward()
            opt.step()
        locals_.append((W.detach(), b.detach(), len(y)))
    n = sum(m[2] for m in locals_)
    expected_W = sum(m[0] * m[2] / n for m in locals_)  # data-size weighted FedAvg
    sim.run(stop_after=1)
    torch.testing.assert_close(sim.global_model.head.weight.detach(), expected_W, atol=1e-6, rtol=1e-5)
    # SGD alone would have moved differently
    assert not torch.allclose(expected_W, W0)
    with pytest.raises(ValueError, match="momentum"):
        toy_sim(components=[comp], lr=lr, momentum=0.9).run(stop_after=1)
