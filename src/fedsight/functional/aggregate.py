"""Pure aggregation math on tensors and name -> tensor mappings.

Functions never mutate their inputs and return tensors in the inputs' dtype and device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def normalize_weights(weights: torch.Tensor | Sequence[float]) -> torch.Tensor:
    """Non-negative weights scaled to sum to one (float64). A zero or negative total is an error."""
    w = torch.as_tensor(weights, dtype=torch.float64).flatten()
    if w.numel() == 0:
        raise ValueError("no weights to normalise")
    if not torch.isfinite(w).all() or (w < 0).any():
        raise ValueError(f"client weights must be finite and non-negative, got {w.tolist()}")
    total = w.sum()
    if total <= 0:
        raise ValueError("client weights sum to zero")
    return w / total


def weighted_mean(tensors: Sequence[torch.Tensor], weights: torch.Tensor | Sequence[float]) -> torch.Tensor:
    """sum_k w_k t_k / sum_k w_k in the tensors' dtype (weights normalised in float64 first).

    Integer tensors (e.g. BatchNorm's ``num_batches_tracked``) are averaged in float64 and rounded to
    the nearest integer.
    """
    if len(tensors) == 0:
        raise ValueError("weighted_mean of no tensors")
    w = normalize_weights(weights)
    if len(w) != len(tensors):
        raise ValueError(f"{len(tensors)} tensors but {len(w)} weights")
    ref = tensors[0]
    if ref.is_floating_point():
        stacked = torch.stack(list(tensors))
        return torch.tensordot(w.to(device=stacked.device, dtype=stacked.dtype), stacked, dims=1)
    stacked = torch.stack([t.to(torch.float64) for t in tensors])
    return torch.tensordot(w.to(stacked.device), stacked, dims=1).round().to(ref.dtype)


#: one weight per client, or per state key one weight per client (layer-/block-level weighting)
Weights = torch.Tensor | Mapping[str, torch.Tensor]


def weights_for(weights: Weights | Sequence[float], key: str) -> torch.Tensor | Sequence[float]:
    """The per-client weights that apply to state entry ``key``."""
    if isinstance(weights, Mapping):
        try:
            return weights[key]
        except KeyError:
            raise KeyError(f"per-tensor client weights have no entry for {key!r}") from None
    return weights


def normalize(weights: Weights) -> Weights:
    """``normalize_weights`` applied to a weight vector or to each entry of a per-key mapping."""
    if isinstance(weights, Mapping):
        return {k: normalize_weights(v) for k, v in weights.items()}
    return normalize_weights(weights)


def weighted_mean_state(
    states: Sequence[Mapping[str, torch.Tensor]], weights: Weights | Sequence[float]
) -> dict[str, torch.Tensor]:
    """Key-wise ``weighted_mean`` over mappings that share the same keys (``weights`` may be per key)."""
    if len(states) == 0:
        raise ValueError("weighted_mean_state of no states")
    keys = list(states[0].keys())
    for i, s in enumerate(states[1:], start=1):
        if set(s.keys()) != set(keys):
            raise ValueError(f"state {i} has keys {sorted(s.keys())[:5]}..., expected {sorted(keys)[:5]}...")
    if isinstance(weights, Mapping):
        return {k: weighted_mean([s[k] for s in states], weights_for(weights, k)) for k in keys}
    w = normalize_weights(weights)
    floats = [k for k in keys if states[0][k].is_floating_point()]
    out = {k: weighted_mean([s[k] for s in states], w) for k in keys if k not in set(floats)}
    if floats:  # one fused multiply-add per client over all float entries
        acc = torch._foreach_mul([states[0][k] for k in floats], float(w[0]))
        for s, wi in zip(states[1:], w[1:].tolist()):
            torch._foreach_add_(acc, [s[k] for k in floats], alpha=wi)
        out.update(zip(floats, acc))
    return {k: out[k] for k in keys}


def state_sub(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: a[k] - b[k] for k in a}


def state_add(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], alpha: float = 1.0) -> dict[str, torch.Tensor]:
    return {k: a[k] + alpha * b[k] for k in a}


def all_finite(state: Mapping[str, torch.Tensor]) -> bool:
    """True if no floating-point or complex entry holds NaN or +-Inf (in either part).

    Fast path: a NaN or infinite element makes its tensor's sum NaN or infinite, so finite sums prove
    every element finite. Only a non-finite sum (which may also be an overflow of finite values) pays
    for the exact element-wise check. Sums are in the tensors' own dtype (a float64 sum would copy every
    tensor first), half precision's in float32 (whose range its sums would often overflow).
    """
    floats = [t for t in state.values() if _inexact(t) and t.numel() > 0]
    if not floats:
        return True
    if bool(torch.isfinite(torch.stack([_sum(t) for t in floats])).all()):  # (stack promotes mixed dtypes)
        return True
    return all(bool(torch.isfinite(t).all()) for t in floats)


def finite_rows(stacks: Sequence[torch.Tensor]) -> torch.Tensor:
    """(n,) bool, true where row i of every one of ``stacks`` (n, ...) is proven finite: by a finite sum of the
    row (``all_finite``'s fast path, one reduction a stack instead of one a row). False means only "not proven":
    a row of finite values whose sum overflows is False too, so check such a row alone (``all_finite``)."""
    if not stacks:
        raise ValueError("finite_rows of no tensors")
    floats = [t for t in stacks if _inexact(t) and t.numel() > 0]
    if not floats:
        return torch.ones(len(stacks[0]), dtype=torch.bool, device=stacks[0].device)
    return torch.isfinite(torch.stack([_sum(t.reshape(len(t), -1), 1) for t in floats])).all(0)


def _inexact(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _sum(t: torch.Tensor, *dim: int) -> torch.Tensor:
    """``t.sum(*dim)`` in its own dtype, half precision's in float32."""
    return t.sum(*dim, dtype=torch.float32) if t.element_size() < 4 else t.sum(*dim)
