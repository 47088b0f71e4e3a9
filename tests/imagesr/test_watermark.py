"""PPFL-RDSN's parameter watermark (section 3.3, Algorithm 2) and the ``watermark`` component.

Expected values come from binomial bounds, hand-written closed forms over the flattened parameters and an
a-priori Hoeffding bound for PyTorch's uniform Linear initialisation, never from the implementation's own
helpers.
"""

import math

import numpy as np
import pydantic
import pytest
import torch
from helpers import tiny
from scipy import stats
from torch import nn

from fedsight.errors import ConfigError, ModelRefused
from fedsight.functional.watermark import (
    BLOCK,
    add_weight_noise,
    carrier,
    flat_params,
    hoeffding_false_positive,
    model_carrier,
    paper_noise_std,
    prf_uniform,
    prune_magnitude,
    required_carriers,
    select_params,
    wm_loss,
    wm_score,
)
from fedsight.records import ClientResult
from fedsight.recipe import ppfl
from fedsight.training import ClientContext

from helpers import close


KEY = bytes.fromhex("00112233445566778899aabbccddeeff")


def binomial_ok(count, n, p, z=6.0):
    return abs(count - n * p) <= z * math.sqrt(n * p * (1 - p))


# -- the carrier set -----------------------------------------------------------------------------------------


def test_carrier_is_deterministic_keyed_and_of_the_expected_size():
    d, p = 200_000, 0.005
    j, w = carrier(KEY, d, p)
    j2, w2 = carrier(KEY, d, p)
    assert torch.equal(j, j2) and torch.equal(w, w2)
    assert j.dtype == torch.int64 and bool((j[1:] > j[:-1]).all()) and int(j.max()) < d
    assert binomial_ok(j.numel(), d, p)
    assert set(w.unique().tolist()) == {-1.0, 1.0}
    assert binomial_ok(int((w > 0).sum()), j.numel(), 0.5)
    # J is exactly {j : PRF(mk, j) < p}
    np.testing.assert_array_equal(j.numpy(), np.flatnonzero(prf_uniform(KEY, d) < p))
    # another key: an unrelated set (overlap ~ p |J|)
    other, _ = carrier(b"another key", d, p)
    common = len(set(j.tolist()) & set(other.tolist()))
    assert binomial_ok(other.numel(), d, p) and common <= p * j.numel() + 6 * math.sqrt(p * j.numel()) + 1


def test_prf_is_uniform_and_prefix_consistent_across_blocks():
    u = prf_uniform(KEY, 50_000)
    assert stats.kstest(u, "uniform").pvalue > 1e-4
    d = BLOCK + 1000  # two XOF blocks
    j_long, w_long = carrier(KEY, d, 0.001)
    j_short, w_short = carrier(KEY, 5000, 0.001)
    k = int((j_long < 5000).sum())
    assert torch.equal(j_long[:k], j_short) and torch.equal(w_long[:k], w_short)
    assert int((j_long >= BLOCK).sum()) > 0  # the second block contributes carriers


def test_carrier_rejects_bad_arguments():
    with pytest.raises(ValueError):
        carrier(b"", 10, 0.1)
    with pytest.raises(ValueError):
        carrier(KEY, 10, 1.5)


# -- loss and score ------------------------------------------------------------------------------------------


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(32, 16)


def test_selection_order_and_prefixes():
    m = Small()
    assert select_params(m) == ["conv.weight", "conv.bias", "bn.weight", "bn.bias", "fc.weight", "fc.bias"]
    assert select_params(m, ("conv.", "fc.w")) == ["conv.weight", "conv.bias", "fc.weight"]
    c = model_carrier(m, KEY, 0.3)
    assert c.d == sum(p.numel() for p in m.parameters())  # BatchNorm statistics are not coordinates


def test_wm_loss_and_score_match_the_closed_forms_and_the_gradient():
    torch.manual_seed(0)
    m, beta = Small(), 0.07
    c = model_carrier(m, KEY, 0.2)
    theta = flat_params(m, c.names).detach().double()
    j, w = c.indices, c.signs.double()
    expected_loss = ((theta[j] * w - beta) ** 2).mean()
    loss = wm_loss(m, c, beta)
    assert float(loss.detach()) == pytest.approx(float(expected_loss), rel=1e-6)
    assert wm_score(m, c) == pytest.approx(float((theta[j] * w).mean()), rel=1e-9)
    assert wm_score(m.state_dict(), c) == wm_score(m, c)
    loss.backward()
    grad = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for _, p in m.named_parameters()]).double()
    expected = torch.zeros_like(theta)
    expected[j] = (2.0 / j.numel()) * (theta[j] * w - beta) * w
    close(grad, expected, atol=1e-8, rtol=1e-5)
    off = torch.ones_like(theta, dtype=torch.bool)
    off[j] = False
    assert bool((grad[off] == 0).all())


def test_hoeffding_bound_and_required_carriers():
    assert hoeffding_false_positive(500, 0.05, 0.2) == pytest.approx(math.exp(-500 * 0.05**2 / (2 * 0.2**2)))
    assert hoeffding_false_positive(torch.arange(10), -1.0, 1.0) == 1.0
    n = required_carriers(0.05, 0.2, 1e-6)
    assert hoeffding_false_positive(n, 0.05, 0.2) <= 1e-6 < hoeffding_false_positive(n - 1, 0.05, 0.2)
    # the paper's |J| >= 500 with threshold beta/2 needs beta/B >= 2 sqrt(2 ln(1e6) / 500) = 0.47 (digest: 0.235
    # with the paper's 4x exponent)
    assert required_carriers(0.47 / 2, 1.0, 1e-6) <= 501


def test_marked_model_passes_unmarked_models_stay_below_within_the_hoeffding_bound():
    """Train a tiny regression with lambda * L_wm: S passes beta/2. Then 300 independently initialised Linear
    models (weights U(-b, b), b = 1/sqrt(fan_in): X_j = theta_j w_j are independent, zero-mean and in [-b, b],
    so Hoeffding applies exactly with B = b): the empirical false-positive rate stays below the bound."""
    torch.manual_seed(1)
    fan_in, beta = 64, 0.1
    b = 1 / math.sqrt(fan_in)
    names = ["weight"]
    model = nn.Linear(fan_in, 32)
    c = model_carrier(model, KEY, 0.25, names=names)
    assert c.size >= 450
    x, y = torch.randn(256, fan_in), torch.randn(256, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(100):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y) + c.size * wm_loss(model, c, beta)
        loss.backward()
        opt.step()
    assert wm_score(model, c) > beta / 2
    threshold = b * math.sqrt(2 * math.log(10) / c.size)  # Hoeffding bound 0.1 at B = b
    bound = hoeffding_false_positive(c.size, threshold, b)
    assert bound == pytest.approx(0.1)
    assert threshold < beta / 2
    scores = np.array([wm_score(nn.Linear(fan_in, 32), c) for _ in range(300)])
    assert (scores > beta / 2).sum() == 0
    assert (scores > threshold).mean() <= bound
    assert abs(scores.mean()) < 6 * b / math.sqrt(3 * c.size * 300)  # zero-mean under H0


# -- attacks -------------------------------------------------------------------------------------------------


def test_prune_magnitude_zeroes_the_stated_fraction_of_weights():
    torch.manual_seed(0)
    m = Small()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    out = prune_magnitude(m, 0.7)
    weights = ["conv.weight", "fc.weight"]  # >= 2-D parameters; biases, BatchNorm kept
    n = sum(before[k].numel() for k in weights)
    zeros = sum(int((out[k] == 0).sum()) for k in weights)
    assert zeros == math.floor(0.7 * n)
    kept = torch.cat([out[k].reshape(-1) for k in weights])
    dropped = torch.cat([before[k].reshape(-1)[out[k].reshape(-1) == 0] for k in weights])
    assert float(dropped.abs().max()) <= float(kept[kept != 0].abs().min())  # the smallest magnitudes went
    for k in ("conv.bias", "bn.weight", "fc.bias", "bn.running_var"):
        assert torch.equal(out[k], before[k])
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())  # the input is unchanged
    per = prune_magnitude(m.state_dict(), 0.5, scope="per_tensor", names=weights)
    for k in weights:
        assert int((per[k] == 0).sum()) == math.floor(0.5 * before[k].numel())


def test_weight_noise_std_and_the_papers_two_readings():
    assert paper_noise_std("variance") == pytest.approx(math.sqrt(1e-3))
    assert paper_noise_std("std") == 1e-3
    m = nn.Linear(200, 100)
    out = add_weight_noise(m, 0.03, torch.Generator().manual_seed(0))
    diff = (out["weight"] - m.weight.detach()).reshape(-1).double()
    k = diff.numel()
    stat = float((diff**2).sum() / 0.03**2)
    assert stats.chi2.ppf(1e-6, k) < stat < stats.chi2.ppf(1 - 1e-6, k)
    assert not torch.equal(out["bias"], m.bias.detach())


# -- the component -------------------------------------------------------------------------------------------


def ctx_for(model, rnd):
    return ClientContext(client_id=0, round=rnd, model=model, global_params={}, num_examples=8, seed=0,
                         global_state={k: v.detach().clone() for k, v in model.state_dict().items()})


def marked(model, params, seed=0):
    """``model`` with its carriers set to theta_j = w_j beta (a perfectly marked global model)."""
    comp = ppfl.Watermark(params)
    c = comp.carrier_of(model, seed)
    with torch.no_grad():
        named = dict(model.named_parameters())
        for k, pos, w in c.parts:
            named[k].view(-1)[pos] = w * params.beta
    return model


def test_component_refuses_a_substituted_model_and_accepts_the_marked_one():
    params = ppfl.WatermarkParams(key=KEY.hex(), p=0.1, min_carriers=100, beta=0.1)
    torch.manual_seed(0)
    good = marked(nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 10)), params)
    comp = ppfl.Watermark(params)
    ctx = ctx_for(good, 2)
    comp.client_start(ctx)
    res = ClientResult(0, 8, {})
    comp.client_end(ctx, res)
    assert res.metrics["wm/score"] == pytest.approx(0.1) and res.metrics["wm/carriers"] >= 100
    substitute = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 10))
    with pytest.raises(ModelRefused) as exc:
        comp.client_start(ctx_for(substitute, 2))
    assert "watermark check failed: S = " in str(exc.value) and exc.value.info["threshold"] == 0.05
    assert exc.value.info["score"] < 0.05
    comp.client_start(ctx_for(substitute, 1))  # round 1: the unmarked initial model is not verified
    assert ppfl.verify(good, params).passed and not ppfl.verify(substitute, params).passed
    v = ppfl.verify(good.state_dict(), params, template=good)
    assert v.passed and v.score == pytest.approx(0.1) and v.carriers == res.metrics["wm/carriers"]


def test_component_refuses_too_few_carriers_and_a_bad_key():
    comp = ppfl.Watermark(ppfl.WatermarkParams(key="ab", p=0.005))
    with pytest.raises(ConfigError, match=r"only \d+ carrier coordinates .* min_carriers = 500"):
        comp.client_start(ctx_for(nn.Linear(10, 10), 1))
    with pytest.raises(pydantic.ValidationError):
        ppfl.WatermarkParams(key="not hex")


def test_component_in_a_run_marks_the_global_model_and_refuses_a_substitution():
    ppfl  # registers the components
    from fedsight.api import build_simulation
    from fedsight.config import validate

    raw = tiny(**{"server.rounds": 3, "eval.every": 10, "train.epochs": 3, "model.channels": [16],
                  "model.hidden": 64})
    raw["recipe"] = {"components": [{"name": "watermark", "key": KEY.hex(), "p": 0.1, "beta": 0.05}]}
    sim = build_simulation(validate(raw))
    rows, events = [], []
    sim.run(stop_after=2, on_round=lambda r, row, ev: (rows.append(row), events.extend(ev)))
    assert rows[1]["wm/score"] > 0.025 and rows[1]["wm/local_score"] > 0.025  # the aggregate carries the mark
    assert not [e for e in events if e["event"] == "model_refused"]
    with torch.no_grad():  # a malicious server substitutes a fresh model
        for p in sim.global_model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    sim.run(on_round=lambda r, row, ev: (rows.append(row), events.extend(ev)))
    refused = [e for e in events if e["event"] == "model_refused"]
    assert len(refused) == 3 and all(e["round"] == 3 and e["score"] < e["threshold"] for e in refused)


def test_a_model_fine_tuned_from_the_marked_one_still_verifies_so_the_check_detects_substitution_not_tampering():
    """The paper's threat model lists "parameter tampering" (section 3.1) beside substitution; the check cannot tell
    a model *derived* from the marked one: 100 Adam steps (lr 2e-3) of a different objective (task loss only, no L_wm) on an
    RDSN change most weights by far more than the mark's margin, yet S stays above the threshold; a substituted
    (freshly initialised) RDSN is refused. docs/image_sr.md states this."""
    from fedsight.models import build_model
    from fedsight.models.base import ModelIO

    make = lambda: build_model("rdsn", {"features": 8, "blocks": 1, "layers": 2, "growth": 4},
                               io=ModelIO("image_sr", in_channels=3, num_outputs=3, scale=2))
    params = ppfl.WatermarkParams(key=KEY.hex(), p=0.05, min_carriers=200, beta=0.05)
    torch.manual_seed(0)
    model = marked(make(), params)
    assert ppfl.verify(model, params).passed
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    g = torch.Generator().manual_seed(1)
    hr = torch.rand(64, 3, 24, 24, generator=g)
    lr = hr[..., ::2, ::2]
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    losses = []
    for step in range(100):
        i = torch.randint(0, 64, (8,), generator=g)
        loss = (model(lr[i]) - hr[i]).abs().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-20:]) < sum(losses[:20])  # it did learn something else
    moved = torch.cat([(p.detach() - before[k]).abs().reshape(-1) for k, p in model.named_parameters()])
    assert float(moved.median()) > params.accept_above  # half the weights moved by more than the mark's margin
    v = ppfl.verify(model, params)
    assert v.passed and v.score > params.accept_above  # tampered, still accepted
    torch.manual_seed(1)
    assert not ppfl.verify(make(), params).passed  # a substitute is refused


def test_watermark_stats_prints_the_exact_clopper_pearson_interval(monkeypatch):
    """benchmarks/watermark_stats.py's rates: at k = 0 and k = n the exact 95% interval has the closed forms
    [0, 1 - 0.025^(1/n)] and [0.025^(1/n), 1]."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import watermark_stats

    assert watermark_stats.rate(0, 200) == f"0 / 200 = 0.0000 (95% CI 0.0000 to {1 - 0.025 ** (1 / 200):.4f})"
    assert watermark_stats.rate(5, 5) == f"5 / 5 = 1.0000 (95% CI {0.025 ** (1 / 5):.4f} to 1.0000)"
