"""PPFL-RDSN's DCT-domain activation mechanism (section 3.2, Algorithm 1) and the ``dct_dp`` component.

Expected values come from scipy's DCT, closed-form sigma calibrations, a numerical integral of the Gaussian
mechanism's privacy profile and chi-square intervals, never from the implementation's own helpers.
"""

import math

import numpy as np
import pytest
import scipy.fft
import torch
from helpers import tiny
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import integrate, stats
from torch import nn

from fedsight.errors import ConfigError
from fedsight.functional.dct import (
    clip_per_sample,
    dct2,
    dct_matrix,
    dct_mechanism,
    gaussian_delta,
    gaussian_sigma,
    high_band_mask,
    idct2,
)
from fedsight.recipe import ppfl
from fedsight.training import ClientContext

from helpers import close


def low_mask_np(h, w, tau):
    u, v = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    return (u + v) < tau


# -- the transform -------------------------------------------------------------------------------------------


@settings(max_examples=30)
@given(lead=st.lists(st.integers(1, 3), min_size=0, max_size=2), h=st.integers(1, 12), w=st.integers(1, 12),
       seed=st.integers(0, 2**31 - 1))
def test_dct2_matches_scipy_and_idct2_inverts(lead, h, w, seed):
    x = np.random.default_rng(seed).standard_normal((*lead, h, w))
    got = dct2(torch.from_numpy(x))
    np.testing.assert_allclose(got.numpy(), scipy.fft.dctn(x, type=2, norm="ortho", axes=(-2, -1)), atol=1e-12)
    np.testing.assert_allclose(idct2(got).numpy(), x, atol=1e-12)
    np.testing.assert_allclose(idct2(torch.from_numpy(x)).numpy(),
                               scipy.fft.idctn(x, type=2, norm="ortho", axes=(-2, -1)), atol=1e-12)


def test_dct_matrix_is_orthonormal_and_keeps_dtype():
    t = dct_matrix(7, torch.float64)
    close(t @ t.T, torch.eye(7, dtype=torch.float64), atol=1e-13, rtol=0)
    assert dct_matrix(5).dtype == torch.float32
    x = torch.randn(2, 3, 4, 6)
    assert dct2(x).dtype == torch.float32
    close(torch.linalg.vector_norm(dct2(x)), torch.linalg.vector_norm(x))


def test_high_band_mask_is_u_plus_v_at_least_tau():
    m = high_band_mask(4, 6, 3)
    assert m.shape == (4, 6) and m.dtype == torch.bool
    np.testing.assert_array_equal(m.numpy(), ~low_mask_np(4, 6, 3))
    assert int((~m).sum()) == 6  # (0,0) (0,1) (1,0) (0,2) (1,1) (2,0)
    assert bool(high_band_mask(3, 3, 0).all()) and not bool(high_band_mask(3, 3, 5).any())


# -- the mechanism -------------------------------------------------------------------------------------------


def coeffs(x):
    return scipy.fft.dctn(np.asarray(x, dtype=np.float64), type=2, norm="ortho", axes=(-2, -1))


def test_low_band_kept_exactly_without_clipping():
    x = torch.randn(3, 2, 6, 5, dtype=torch.float64)
    out = dct_mechanism(x, c_max=1e6, tau=4, sigma=2.0, generator=torch.Generator().manual_seed(1))
    low = low_mask_np(6, 5, 4)
    diff = coeffs(out) - coeffs(x)
    np.testing.assert_allclose(diff[..., low], 0.0, atol=1e-10)
    assert np.abs(diff[..., ~low]).mean() > 0.5  # the high band carries N(0, 4) noise


def test_eq2_low_band_from_unclipped_high_band_from_clipped():
    x = 10 * torch.randn(4, 3, 5, 7, dtype=torch.float64)
    c_max, tau = 2.0, 3
    low = low_mask_np(5, 7, tau)
    norms = np.linalg.norm(x.numpy().reshape(4, -1), axis=1)
    assert (norms > c_max).all()
    hat = x.numpy() / (norms / c_max)[:, None, None, None]
    out = dct_mechanism(x, c_max, tau, sigma=0.0)
    got = coeffs(out)
    np.testing.assert_allclose(got[..., low], coeffs(x)[..., low], atol=1e-10)  # H_L from the raw H (eq. 2)
    np.testing.assert_allclose(got[..., ~low], coeffs(hat)[..., ~low], atol=1e-10)
    clipped_low = dct_mechanism(x, c_max, tau, sigma=0.0, low_from="clipped")
    np.testing.assert_allclose(clipped_low.numpy(), hat, atol=1e-10)  # no noise, all from Hhat: Hhat itself


def test_high_band_noise_has_the_stated_variance():
    sigma, n, tau = 0.7, 400, 5
    x = torch.randn(1, 2, 6, 8, dtype=torch.float64).expand(n, -1, -1, -1).contiguous()
    out = dct_mechanism(x, c_max=1e6, tau=tau, sigma=sigma, generator=torch.Generator().manual_seed(3))
    diff = coeffs(out) - coeffs(x)
    low = low_mask_np(6, 8, tau)
    np.testing.assert_allclose(diff[..., low], 0.0, atol=1e-10)
    z = diff[..., ~low].ravel()
    k = z.size  # known zero mean: sum z^2 / sigma^2 ~ chi2(k)
    stat = float((z**2).sum() / sigma**2)
    assert stats.chi2.ppf(1e-6, k) < stat < stats.chi2.ppf(1 - 1e-6, k), (stat, k)
    assert abs(z.mean()) < 6 * sigma / math.sqrt(k)
    # independent across coefficients: the correlation of neighbouring high-band coefficients is ~ 0
    zz = diff[..., ~low]
    r = np.corrcoef(zz[..., 0].ravel(), zz[..., 1].ravel())[0, 1]
    assert abs(r) < 6 / math.sqrt(zz[..., 0].size)


def test_clip_bounds_every_sample_norm():
    x = torch.randn(6, 3, 4, 4, dtype=torch.float64) * torch.tensor([0.01, 0.1, 1, 10, 100, 0.0],
                                                                     dtype=torch.float64)[:, None, None, None]
    c = clip_per_sample(x, 2.5)
    norms = torch.linalg.vector_norm(c.reshape(6, -1), dim=1)
    raw = torch.linalg.vector_norm(x.reshape(6, -1), dim=1)
    assert bool((norms <= 2.5 + 1e-12).all())
    close(norms, torch.minimum(raw, torch.tensor(2.5, dtype=torch.float64)))
    # tau = 0, no noise, low band from the clipped H: the mechanism releases exactly the clipped activation
    out = dct_mechanism(x, 2.5, tau=0, sigma=0.0)
    assert bool((torch.linalg.vector_norm(out.reshape(6, -1), dim=1) <= 2.5 + 1e-10).all())


def test_gradient_flows_and_does_not_depend_on_the_noise():
    x = torch.randn(3, 2, 5, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 2, 5, 5, dtype=torch.float64)
    grads = []
    for sigma in (0.0, 3.0):
        (g,) = torch.autograd.grad((dct_mechanism(x, 1.5, 3, sigma, torch.Generator().manual_seed(0)) * w).sum(), x)
        grads.append(g)
    assert bool(torch.isfinite(grads[0]).all()) and grads[0].abs().sum() > 0
    close(grads[0], grads[1])
    zero = torch.zeros(2, 1, 4, 4, requires_grad=True)
    dct_mechanism(zero, 1.0, 2, 1.0, torch.Generator().manual_seed(0)).sum().backward()
    assert bool(torch.isfinite(zero.grad).all())


# -- calibration ---------------------------------------------------------------------------------------------


def test_classic_sigma_at_the_papers_epsilon():
    # digest 2.2: sqrt(2 ln(1.25e5)) = 4.845, sigma = 9.69 C_max / epsilon = 3.52 C_max at epsilon = 2.75
    s = gaussian_sigma(2.75, 1e-5, 1.0)
    assert s == pytest.approx(2 * math.sqrt(2 * math.log(1.25 / 1e-5)) / 2.75, rel=1e-12)
    assert s == pytest.approx(3.52, abs=0.005)
    assert gaussian_sigma(3.0, 1e-5, 2.0) == pytest.approx(2 * 3.23, abs=0.01)


def delta_by_integration(sigma, eps, sens):
    """delta(eps) = integral of max(0, p(x) - e^eps q(x)) for p = N(0, sigma^2), q = N(sens, sigma^2)."""
    p, q = stats.norm(0, sigma), stats.norm(sens, sigma)
    # p > e^eps q exactly left of x* = sens/2 - eps sigma^2/sens
    x_star = sens / 2 - eps * sigma**2 / sens
    val, _ = integrate.quad(lambda x: p.pdf(x) - math.exp(eps) * q.pdf(x), -np.inf, x_star, epsabs=1e-14, epsrel=1e-10)
    return val


@pytest.mark.parametrize("eps", [0.3, 1.0, 2.75, 10.0])
def test_analytic_sigma_meets_delta_exactly(eps):
    c_max, delta = 0.8, 1e-5
    s = gaussian_sigma(eps, delta, c_max, "analytic")
    assert gaussian_delta(s, eps, 2 * c_max) == pytest.approx(delta, rel=1e-8)
    assert delta_by_integration(s, eps, 2 * c_max) == pytest.approx(delta, rel=1e-4)
    assert delta_by_integration(0.9 * s, eps, 2 * c_max) > delta  # the smallest such sigma
    if eps < 1:  # the classic formula is valid there and conservative
        assert s < gaussian_sigma(eps, delta, c_max)


def test_classic_sigma_fails_delta_beyond_its_proven_range():
    s = gaussian_sigma(10.0, 1e-5, 1.0)  # epsilon >= 1: Dwork & Roth's proof does not apply
    assert delta_by_integration(s, 10.0, 2.0) > 1e-5


def test_calibration_rejects_bad_arguments():
    with pytest.raises(ValueError):
        gaussian_sigma(0.0, 1e-5, 1.0)
    with pytest.raises(ValueError):
        gaussian_sigma(1.0, 1.0, 1.0)
    with pytest.raises(ValueError):
        gaussian_sigma(1.0, 1e-5, 1.0, "moments")


# -- the component -------------------------------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.act = nn.ReLU()
        self.head = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        return self.head(self.act(self.conv(x)).flatten(1))


def ctx_for(model, client=0, rnd=1, seed=0):
    return ClientContext(client_id=client, round=rnd, model=model, global_params={}, num_examples=8, seed=seed)


def hooks(model):
    return sum(len(m._forward_hooks) for m in model.modules())


def test_component_noises_training_passes_only_and_removes_its_hook():
    torch.manual_seed(0)
    net, x = Net(), torch.randn(8, 1, 6, 6)
    net.eval()
    with torch.no_grad():
        base = net(x)
    comp = ppfl.DctDP(ppfl.DctDPParams(layer="conv", c_max=1.0, tau=2, epsilon=2.75))
    ctx = ctx_for(net)
    comp.client_start(ctx)
    assert hooks(net) == 1
    with torch.no_grad():
        close(net(x), base)  # eval mode: no noise
        net.train()
        noisy = net(x)
        assert (noisy - base).abs().max() > 1e-3
    from fedsight.records import ClientResult

    res = ClientResult(0, 8, {})
    comp.client_end(ctx, res)
    assert hooks(net) == 0
    with torch.no_grad():
        close(net(x), base)  # removed: training mode is clean again
    assert res.metrics["privacy/dct_epsilon"] == 2.75 and res.metrics["privacy/dct_delta"] == 1e-5
    assert res.metrics["privacy/dct_sigma"] == pytest.approx(3.5235, abs=1e-3)
    assert res.metrics["privacy/dct_passes"] == 1.0  # one noised forward pass of the 8 examples


def test_component_noise_stream_is_per_round_and_client():
    torch.manual_seed(0)
    net, x = Net(), torch.randn(4, 1, 6, 6)
    comp = ppfl.DctDP(ppfl.DctDPParams(layer="conv"))

    def noisy(client, rnd):
        comp.client_start(ctx_for(net, client, rnd))
        net.train()
        with torch.no_grad():
            return net(x)

    a, b, c, d = noisy(0, 1), noisy(0, 1), noisy(1, 1), noisy(0, 2)
    close(a, b)
    assert not torch.allclose(a, c) and not torch.allclose(a, d)
    # a stale registration (a client refused after client_start) is replaced, never stacked
    assert hooks(net) == 1


def test_component_refuses_an_unknown_layer_naming_valid_ones():
    comp = ppfl.DctDP(ppfl.DctDPParams(layer="backbone.7"))
    with pytest.raises(ConfigError) as exc:
        comp.client_start(ctx_for(Net()))
    msg = str(exc.value)
    assert "\n" not in msg and "'backbone.7'" in msg and "conv" in msg and "head" in msg
    with pytest.raises(ConfigError, match="needs a floating"):  # a Linear output is not a map
        c2 = ppfl.DctDP(ppfl.DctDPParams(layer="head"))
        net = Net()
        c2.client_start(ctx_for(net))
        net.train()
        net(torch.randn(2, 1, 6, 6))


def test_component_in_a_run_reports_single_release_privacy_and_leaves_no_hook():
    ppfl  # registers the components
    from fedsight.api import build_simulation
    from fedsight.config import validate

    raw = tiny(**{"server.rounds": 1, "eval.every": 1})
    raw["recipe"] = {"components": [{"name": "dct_dp", "c_max": 50.0, "epsilon": 4.0, "calibration": "analytic"}]}
    sim = build_simulation(validate(raw))
    rows = []
    sim.run(on_round=lambda r, row, ev: rows.append(row))
    row = rows[-1]
    assert row["privacy/dct_epsilon"] == 4.0 and row["privacy/dct_delta"] == 1e-5
    assert row["privacy/dct_sigma"] == pytest.approx(gaussian_sigma(4.0, 1e-5, 50.0, "analytic"))
    assert row["privacy/dct_passes"] == 1.0  # one epoch: every example passed the layer once
    assert math.isfinite(row["test/acc"])
    assert hooks(sim.global_model) == 0 and hooks(sim.runtime.work_model) == 0
