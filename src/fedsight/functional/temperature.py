"""The softmax temperature by minimum training cross-entropy (thesis Sec. 3.9.1, Fig. 3.3; Sec. 4.3.1, Fig. 4.4).

After Fed3R sets the classifier, the thesis fine-tunes with the tempered softmax of eq. 3.2,
``softmax(f(x) / tau)``, and picks tau "to align the entropy of the predictions' distribution" (Sec. 3.7): the
candidate with "the lowest average CE loss on the training set" (caption of Fig. 3.3), evaluated with the
Fed3R-initialised model before any fine-tuning. The thesis shows a grid of candidates (not listed in the text;
its answer is 0.1 on both datasets) and no finer search.

Federated form: the CE of eq. 3.1 is a sum over examples, so each client sends, for the G candidates, the sum of
its training examples' cross-entropies and its number of examples (G + 1 numbers, no data); the server adds
them and divides (``mean_ce``), which equals the CE over the pooled training set. A refinement between grid
points (``golden_section``) costs one more such pass per evaluated candidate.

Choices made:

* ``DEFAULT_GRID``: 1-2-5 steps from 0.01 to 10 (the thesis's value, 0.1, is on it; 1 is the untempered
  softmax).
* Ties go to the smaller temperature (``select``): the first minimum in the grid's ascending order.
* The refinement is a golden-section search over log tau inside the bracket of the grid minimum's two
  neighbours. It finds the global minimum: the mean CE is convex in beta = 1 / tau (log-sum-exp of beta z minus
  the linear beta z_y), so it is unimodal in beta and in log tau (a monotone change of variable), and the grid
  minimum's neighbours bracket it. A minimum at the grid's end is not bracketed: no refinement is done there
  and the caller is told to widen the grid.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

#: the default candidate temperatures (ascending)
DEFAULT_GRID: tuple[float, ...] = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)

#: 1 / golden ratio
_INV_PHI = (math.sqrt(5.0) - 1.0) / 2.0


@torch.no_grad()
def ce_sums(logits: torch.Tensor, targets: torch.Tensor, taus: Sequence[float]) -> torch.Tensor:
    """For each ``tau``: the sum over examples of CE(softmax(logits / tau), y) (eq. 3.1 with eq. 3.2), in
    float64, as a tensor [len(taus)]: one client's message (with its example count)."""
    z = logits.detach().to(torch.float64)
    y = targets.detach().long().to(z.device)
    return torch.stack([F.cross_entropy(z / float(t), y, reduction="sum") for t in taus]).cpu()


def mean_ce(client_sums: Sequence[torch.Tensor], client_counts: Sequence[int]) -> torch.Tensor:
    """The server's part: the clients' CE sums added and divided by their examples, the mean CE over the
    pooled training set for each candidate."""
    n = sum(int(c) for c in client_counts)
    if n <= 0:
        raise ValueError("no training examples: the clients' counts sum to 0")
    return torch.stack([s.to(torch.float64) for s in client_sums]).sum(0) / n


def select(taus: Sequence[float], ce: torch.Tensor) -> int:
    """The index of the lowest mean CE (the first one on a tie: ``taus`` ascending, the smaller tau)."""
    if len(taus) != len(ce) or not len(taus):
        raise ValueError(f"{len(taus)} temperatures and {len(ce)} losses")
    if not bool(torch.isfinite(ce).all()):
        bad = [float(t) for t, v in zip(taus, ce.tolist()) if not math.isfinite(v)]
        raise ValueError(f"the training cross-entropy is not finite at tau = {bad}")
    return int(torch.argmin(ce))


def check_grid(taus: Sequence[float]) -> list[float]:
    """``taus`` as floats: at least two, all positive and finite, strictly ascending (else a ValueError)."""
    out = [float(t) for t in taus]
    if len(out) < 2:
        raise ValueError(f"a temperature grid needs at least 2 values, got {out}")
    if not all(math.isfinite(t) and t > 0 for t in out):
        raise ValueError(f"temperatures must be positive and finite, got {out}")
    if any(b <= a for a, b in zip(out, out[1:])):
        raise ValueError(f"temperatures must be strictly ascending, got {out}")
    return out


def golden_section(f: Callable[[float], float], lo: float, hi: float, iters: int) -> tuple[float, float, int]:
    """Minimise a unimodal ``f`` over tau in [lo, hi] by golden-section search on log tau: ``iters`` shrinking
    steps (the bracket shrinks by 0.618 each), one new evaluation of ``f`` per step after the first two.
    Returns (tau, f(tau), evaluations) for the best point evaluated."""
    a, b = math.log(lo), math.log(hi)
    c, d = b - _INV_PHI * (b - a), a + _INV_PHI * (b - a)
    fc, fd = f(math.exp(c)), f(math.exp(d))
    evals = 2
    for _ in range(iters):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - _INV_PHI * (b - a)
            fc = f(math.exp(c))
        else:
            a, c, fc = c, d, fd
            d = a + _INV_PHI * (b - a)
            fd = f(math.exp(d))
        evals += 1
    return (math.exp(c), fc, evals) if fc <= fd else (math.exp(d), fd, evals)


__all__ = ["DEFAULT_GRID", "ce_sums", "check_grid", "golden_section", "mean_ce", "select"]
