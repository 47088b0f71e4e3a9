"""PPFL-RDSN's DCT-domain activation mechanism (He & Joshi, section 3.2, Algorithm 1) and its noise calibration.

**Transform.** ``dct_matrix(n)`` is the orthonormal DCT-II matrix T (built in float64, then cast):
T[u, x] = a_u cos(pi (2x + 1) u / (2n)), a_0 = sqrt(1/n), a_u = sqrt(2/n); T T^T = I. ``dct2`` applies it over the
last two dimensions of ``[..., h, w]`` as C = T_h X T_w^T (so h != w works; the paper's T H T^T is the square
case, applied per channel), ``idct2`` inverts it with X = T_h^T C T_w. Both are matrix products: exact up to
rounding, differentiable, and on the input's dtype and device. They equal
``scipy.fft.dctn(x, type=2, norm="ortho", axes=(-2, -1))`` and its inverse. The DCT covers the whole map, not
8 x 8 blocks (the paper does not say; a whole-map DCT is what "T H T^T" on the map reads as).

**Partition.** ``high_band_mask(h, w, tau)`` is True on S_H = {(u, v): u + v >= tau} (zero-based indices) and
False on the low band S_L = {u + v < tau} (section 3.2, step 2). With tau = 0 every coefficient is noised;
with tau > h + w - 2 none is.

**Mechanism** (``dct_mechanism``), per sample i of a batch ``[N, ..., h, w]`` (Algorithm 1):

1. clip: Hhat_i = H_i / max(1, ||H_i||_2 / C_max), the norm over *all* of sample i's entries (every channel:
   ``C * h * w`` numbers). The paper leaves open whether ||H||_2 runs over one sample or the batch; the
   per-sample reading is the one under which each example's release carries its own guarantee: replacing
   one example changes only its own clipped activation, by at most 2 C_max (eq. (1)). (Clipping the whole
   batch tensor to C_max also satisfies that bound, by the triangle inequality, but shrinks every example's
   signal by the batch's norm.) It further assumes that the layers up to k process examples independently:
   a BatchNorm in training mode before layer k mixes the batch, and then one example changes every
   example's activation.
2. C = T Hhat T^T per channel; f = vec(C restricted to S_H);
3. f~ = f + N(0, sigma^2 I), independent noise per high-band coefficient (and per sample, channel);
4. eq. (2): H~ = H_L + T^T reshape(f~) T, where **H_L comes from the unclipped H** as the paper writes it
   (``low_from="unclipped"``, the default); ``low_from="clipped"`` takes it from Hhat instead.

The noise is additive, so gradients flow through H_L and the clipped high band (and the clip factor) as
through any differentiable layer.

**What is private.** By the Gaussian mechanism, f~ (one example's noised *high-band* coefficients, one
forward pass) is (epsilon, delta)-DP with respect to that example. H~ as a whole is not: its low band H_L is
released without noise (from the raw H by default), so H~ is the DP release f~ *plus* an un-noised function
of the example. Anything computed from the low band, from layers before k, or from the targets is outside the
guarantee; repeated forward passes of the same example are separate releases (no composition is accounted
here).

**Calibration** (``gaussian_sigma``): ``"classic"`` is the paper's eq. (1) and step 4,
sigma = Delta sqrt(2 ln(1.25/delta)) / epsilon with Delta = 2 C_max (Dwork & Roth, Theorem A.1, which is proven
for epsilon < 1 only; the paper uses epsilon = 2.75, outside that range). ``"analytic"`` is the analytic
Gaussian mechanism of Balle & Wang (2018, Theorem 8): the smallest sigma with
delta(sigma) = Phi(Delta/(2 sigma) - epsilon sigma/Delta) - e^epsilon Phi(-Delta/(2 sigma) - epsilon sigma/Delta) <= delta,
found by root bracketing (``gaussian_delta`` is that function); it is exact for every epsilon > 0.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Literal

import numpy as np
import torch

Calibration = Literal["classic", "analytic"]
LowFrom = Literal["unclipped", "clipped"]

__all__ = [
    "clip_per_sample",
    "dct2",
    "dct_matrix",
    "dct_mechanism",
    "dct_noise",
    "draws_noise",
    "gaussian_delta",
    "gaussian_sigma",
    "high_band_mask",
    "idct2",
    "sensitivity",
]


@lru_cache(maxsize=64)
def _dct_matrix64(n: int) -> torch.Tensor:
    u = np.arange(n, dtype=np.float64)[:, None]
    x = np.arange(n, dtype=np.float64)[None, :]
    t = np.cos(np.pi * (2.0 * x + 1.0) * u / (2.0 * n)) * np.sqrt(2.0 / n)
    t[0, :] = np.sqrt(1.0 / n)
    return torch.from_numpy(t)


def dct_matrix(n: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
    """The orthonormal DCT-II matrix T (``n x n``, T T^T = I): row u is the u-th cosine basis vector.
    Built in float64 and cast to ``dtype``."""
    if n < 1:
        raise ValueError(f"dct_matrix: n must be >= 1, got {n}")
    return _dct_matrix64(int(n)).to(dtype=dtype, device=device)


def _mats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() < 2:
        raise ValueError(f"dct2/idct2 need [..., h, w], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"dct2/idct2 need a floating tensor, got {x.dtype}")
    h, w = x.shape[-2:]
    return dct_matrix(h, x.dtype, x.device), dct_matrix(w, x.dtype, x.device)


def dct2(x: torch.Tensor) -> torch.Tensor:
    """2-D orthonormal DCT-II over the last two dimensions: T_h X T_w^T."""
    th, tw = _mats(x)
    return th @ x @ tw.T


def idct2(c: torch.Tensor) -> torch.Tensor:
    """Inverse of ``dct2`` (2-D orthonormal DCT-III): T_h^T C T_w."""
    th, tw = _mats(c)
    return th.T @ c @ tw


def high_band_mask(h: int, w: int, tau: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean ``[h, w]`` mask of the high band S_H = {(u, v): u + v >= tau} (zero-based DCT indices)."""
    u = torch.arange(h, device=device)[:, None]
    v = torch.arange(w, device=device)[None, :]
    return (u + v) >= int(tau)


def clip_per_sample(x: torch.Tensor, c_max: float) -> torch.Tensor:
    """x_i / max(1, ||x_i||_2 / c_max) for every sample i along dimension 0 (the norm over all its other
    entries). Differentiable; a zero sample stays zero."""
    if c_max <= 0:
        raise ValueError(f"c_max must be > 0, got {c_max}")
    norms = torch.linalg.vector_norm(x.reshape(x.shape[0], -1), dim=1)
    factor = c_max / torch.clamp(norms, min=c_max)  # = min(1, c_max / norm)
    return x * factor.reshape((-1,) + (1,) * (x.dim() - 1))


def sensitivity(c_max: float) -> float:
    """The L2 sensitivity of one example's clipped activation (and of its high band), eq. (1): 2 C_max."""
    return 2.0 * float(c_max)


def gaussian_delta(sigma: float, epsilon: float, sens: float) -> float:
    """The exact delta of the Gaussian mechanism with noise std ``sigma`` and L2 sensitivity ``sens`` at
    ``epsilon`` (Balle & Wang 2018, Theorem 8):
    Phi(sens/(2 sigma) - epsilon sigma/sens) - e^epsilon Phi(-sens/(2 sigma) - epsilon sigma/sens)."""
    from scipy.special import log_ndtr, ndtr

    if sigma <= 0 or sens <= 0:
        raise ValueError("sigma and the sensitivity must be > 0")
    a = sens / (2.0 * sigma)
    b = epsilon * sigma / sens
    # the second term in log space: e^epsilon can overflow where Phi(...) underflows
    return float(ndtr(a - b) - math.exp(epsilon + float(log_ndtr(-a - b))))


def _analytic_sigma(epsilon: float, delta: float, sens: float) -> float:
    from scipy.optimize import brentq

    f = lambda log_s: gaussian_delta(math.exp(log_s), epsilon, sens) - delta
    hi = math.log(sens)
    while f(hi) > 0:
        hi += 1.0
    lo = hi - 1.0
    while f(lo) < 0:
        lo -= 1.0
    return math.exp(brentq(f, lo, hi, xtol=1e-14, rtol=1e-14, maxiter=500))


def gaussian_sigma(epsilon: float, delta: float, c_max: float, calibration: Calibration = "classic") -> float:
    """The noise std sigma of one release with sensitivity 2 ``c_max`` at (epsilon, delta).

    ``"classic"``: 2 C_max sqrt(2 ln(1.25/delta)) / epsilon, the paper's formula (its proof covers epsilon < 1
    only); ``"analytic"``: the analytic Gaussian mechanism (Balle & Wang 2018), the smallest sigma whose exact
    delta at epsilon is ``delta``; valid for every epsilon > 0 and never larger than needed."""
    if not epsilon > 0:
        raise ValueError(f"epsilon must be > 0, got {epsilon}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    sens = sensitivity(c_max)
    if sens <= 0:
        raise ValueError(f"c_max must be > 0, got {c_max}")
    if calibration == "classic":
        return sens * math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon
    if calibration == "analytic":
        return _analytic_sigma(float(epsilon), float(delta), sens)
    raise ValueError(f"unknown calibration {calibration!r}; choose 'classic' or 'analytic'")


def draws_noise(shape: tuple[int, ...], tau: int, sigma: float) -> bool:
    """Whether ``dct_mechanism`` draws noise for activations of ``shape``: sigma > 0 and a high band u + v >= tau
    inside the map (the largest u + v is height + width - 2)."""
    return sigma > 0 and int(tau) <= shape[-2] + shape[-1] - 2


def dct_noise(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator | None,
              device: torch.device | str) -> torch.Tensor:
    """The standard normal noise ``dct_mechanism`` draws for activations of ``shape`` and ``dtype``: from
    ``generator`` on its device (else on ``device``), then moved to ``device``."""
    gdev = generator.device if generator is not None else device
    return torch.randn(shape, generator=generator, dtype=dtype, device=gdev).to(device)


def dct_mechanism(
    h: torch.Tensor,
    c_max: float,
    tau: int,
    sigma: float,
    generator: torch.Generator | None = None,
    low_from: LowFrom = "unclipped",
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """Algorithm 1 on a batch of activations ``h`` of shape ``[N, ..., height, width]`` (N samples; e.g.
    ``[N, C, height, width]``): per-sample L2 clip to ``c_max``, per-channel 2-D DCT, N(0, sigma^2) noise on
    the high band u + v >= ``tau`` only, and eq. (2): H~ = H_L + T^T (C_H(Hhat) + noise) T with H_L from the
    unclipped ``h`` (``low_from="unclipped"``, the paper) or from the clipped one (``"clipped"``).

    The noise is drawn from ``generator`` (on its device, then moved to ``h``'s) in ``h``'s dtype
    (``dct_noise``), or given: ``noise``, standard normal of ``h``'s shape, drawn beforehand (vectorised training
    draws each client's so, from its own generator). Only the noised high band of each sample is (epsilon,
    delta)-DP for the sigma of ``gaussian_sigma``; the low band is passed through without noise (see the module
    docstring)."""
    if h.dim() < 3:
        raise ValueError(f"dct_mechanism needs [N, ..., h, w] (a batch of maps), got shape {tuple(h.shape)}")
    if sigma < 0:
        raise ValueError(f"sigma must be >= 0, got {sigma}")
    if low_from not in ("unclipped", "clipped"):
        raise ValueError(f"low_from must be 'unclipped' or 'clipped', got {low_from!r}")
    hh, ww = h.shape[-2:]
    high = high_band_mask(hh, ww, tau, device=h.device)
    hat = clip_per_sample(h, c_max)
    c_hat = dct2(hat)
    c_low = c_hat if low_from == "clipped" else dct2(h)
    coeffs = torch.where(high, c_hat, c_low)
    if draws_noise(tuple(h.shape), tau, sigma):
        if noise is None:
            noise = dct_noise(tuple(h.shape), h.dtype, generator, h.device)
        coeffs = coeffs + noise * (sigma * high.to(h.dtype))
    return idct2(coeffs)
