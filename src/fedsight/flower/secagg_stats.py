"""Sums of statistics under SecAgg+ (Fed3R, FedNCM): each client adds its statistics for all C classes as two limbs
per entry on the grid Flower's SecAgg+ quantises to, so its stochastic rounding rounds nothing and the unmasked sum
is exact to ``m * bound / Q**2`` per entry (``encode_statistic``, ``decode_sum``, ``sum_error``). The protocol
itself is ``fedsight.flower.secagg``'s."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

MODULUS = 1 << 32  # Flower's modulus_range (its maximum)


def statistics_component(stage: Any) -> Any:
    """The component whose statistics a statistics stage's clients upload, if they can be securely summed (it
    declares ``secure_fields``: Fed3R, FedNCM), else None (LADD's client styles, which the server clusters one by
    one)."""
    comp = getattr(stage.recipe.trainer, "component", None)
    return comp if callable(getattr(comp, "secure_fields", None)) else None


#: Flower's stochastic rounding casts the levels to int32, so a round's levels stay at or below 2**30
STATS_LEVELS_MAX = 1 << 30


def stats_levels(m: int) -> int:
    """The quantisation levels ``Q`` of a statistics round of ``m`` clients: the largest power of two at most
    ``2**30`` whose sum over ``m`` clients stays below the modulus (``m * Q < 2**32``)."""
    q = STATS_LEVELS_MAX
    while q > 2 and m * q >= MODULUS:
        q //= 2
    return q


def encode_statistic(x: np.ndarray, bound: float, levels: int) -> tuple[np.ndarray, int]:
    """One client's statistic ``x`` (float64) as two limbs on the grid Flower quantises to, and how many of its
    entries were clipped (``|x| > bound``). ``bound`` and ``levels`` (``Q``) are powers of two, so ``u = x / bound``
    is exact; ``u`` (clipped to [-1, 1]) is rounded to the nearest of Flower's levels ``hi = n_h / (Q / 2)``, and the
    residual ``u - hi`` (at most ``1 / Q``, computed exactly) is scaled by ``Q`` and rounded the same way: ``lo =
    n_l / (Q / 2)``. Both lie on Flower's grid (clipping range 1: level ``n + Q / 2``), so its stochastic rounding
    has nothing to round and the protocol sums the integers ``n`` exactly; ``u = hi + lo / Q`` within ``1 / Q**2``,
    i.e. ``x`` within ``bound / Q**2``. Returns ``[hi, lo]`` stacked (shape ``(2, *x.shape)``)."""
    u = np.asarray(x, dtype=np.float64) / bound
    clipped = int((np.abs(u) > 1.0).sum())
    u = np.clip(u, -1.0, 1.0)
    half = levels / 2
    n_hi = np.rint(u * half)
    n_lo = np.rint((u - n_hi / half) * levels * half)
    return np.stack([n_hi / half, n_lo / half]), clipped


def decode_sum(mean: np.ndarray, m: int, bound: float, levels: int) -> np.ndarray:
    """The sum of ``m`` clients' statistics from the unmasked mean of their ``encode_statistic`` limbs: the limbs'
    integer sums ``N_h``, ``N_l`` are recovered exactly (``rint(mean * m * Q / 2)``: the mean's float error is far
    below half a level), and the sum is ``bound (N_h Q + N_l) / (Q**2 / 2)``, the float64 nearest that exact value.
    It differs from the clients' true sum by at most ``m * bound / Q**2`` per entry (``sum_error``) when nothing was
    clipped."""
    half = levels / 2
    n = np.rint(np.asarray(mean, dtype=np.float64) * m * half).astype(np.int64)
    return (n[0] * levels + n[1]).astype(np.float64) * (bound / (half * levels))


def sum_error(m: int, bound: float, levels: int) -> float:
    """The largest error per entry of ``decode_sum`` over ``m`` clients: each client's ``lo`` limb is rounded to
    half a level, ``bound / Q**2`` (one step of the two-limb grid, ``2 bound / Q**2``, halved)."""
    return m * bound / float(levels) ** 2


@dataclass(frozen=True)
class Statistics:
    """A statistics round under SecAgg+: ``component`` (Fed3R, FedNCM) names its fields, each ``(name, shape,
    bound)`` in the fixed all-classes form (``secure_fields``), summed as two limbs each (``encode_statistic``)
    on a grid of ``levels`` (``stats_levels``)."""

    component: Any
    classes: int
    fields: list[tuple[str, tuple[int, ...], float]]
    levels: int

    def config(self) -> dict[str, Any]:
        """What a node needs to encode its statistics (instruction config)."""
        return {"secagg-stats": self.component.name, "secagg-classes": self.classes, "secagg-levels": self.levels,
                "secagg-stat-names": [n for n, _, _ in self.fields],
                "secagg-stat-bounds": [float(b) for _, _, b in self.fields]}

    def group_sum(self, arrays: list[np.ndarray], m: int, total: int,
                  num_clients: int) -> tuple[str | None, dict[str, torch.Tensor]]:
        """(why the unmasked sum cannot be the statistics of these ``m`` clients, who claim ``total`` examples, or
        None; the group's statistics, which the component checks as a sum, ``ClosedFormClassifier.secure_sum``,
        within ``sum_error``)."""
        sums = {n: torch.from_numpy(decode_sum(a, m, b, self.levels)) for (n, _, b), a in zip(self.fields, arrays)}
        errors = {n: sum_error(m, b, self.levels) for n, _, b in self.fields}
        return self.component.secure_sum(sums, total, m, num_clients, errors)
