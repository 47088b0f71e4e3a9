"""PPFL-RDSN's parameter watermark (He & Joshi, section 3.3, Algorithm 2): a PRF-keyed sparse carrier set, the
regulariser that embeds the mark, the correlation score that detects it, its Hoeffding bound, and the weight
attacks of the paper's Table III.

**Carrier set.** PRF(mk, j) is SHAKE-256 (an extendable-output function; keyed by prefixing, which is a PRF for
a sponge: no length extension) read 8 bytes per coordinate, little-endian, as u_j = (x >> 11) 2^-53, uniform on
[0, 1): J = {j : u_j < p} (section 3.3). Coordinates come in blocks of 2^20 with one XOF call per block
(input: a domain string, the key's length and the key, the block index), so memory stays bounded for large d
and there is no Python loop over coordinates. The sign w_j is one bit of a second, domain-separated stream
(the paper's PRF(mk, ("w", j))): w_j = +1 if the bit is set, else -1.

**Reading of the signs** (digest section 2.3, ambiguity): the paper writes w in {+-beta}^|J| in one place and
the target theta_j w_j -> beta in the loss; taken together that pulls theta_j to +-1, far outside the scale of
conv weights. We take w_j in {+-1} and the target theta_j w_j -> beta, i.e. theta_j -> w_j beta.

**Coordinates.** theta is the concatenation, in ``named_parameters()`` order, of the flattened selected
parameters: by default every floating-point ``nn.Parameter`` (whether or not a stage freezes it, so the set
does not change between stages; buffers such as BatchNorm statistics are never included), or those whose
qualified name starts with one of ``prefixes``. ``model_carrier`` resolves the names and returns a ``Carrier``
that holds them, so the same coordinates can be read from a model or from a state dict.

**Loss and score.** L_wm = (1/|J|) sum_{j in J} (theta_j w_j - beta)^2 (``wm_loss``, gathers only J, so its
gradient (2/|J|)(theta_j w_j - beta) w_j is zero outside J) and S = (1/|J|) sum_{j in J} theta_j w_j
(``wm_score``); the mark is accepted when S > threshold (Algorithm 2: threshold beta/2).

**False positives.** Under H0 (no mark) the paper assumes the X_j = theta_j w_j are independent, zero-mean and
bounded, |X_j| <= B. Hoeffding's inequality for variables in [-B, B] (range 2B) gives
Pr[S > t] <= exp(-|J| t^2 / (2 B^2)) (``hoeffding_false_positive``). The paper writes exp(-2|J|t^2/B^2), which
is 4x too large in the exponent. The assumption is an assumption: independence of a random sign from an
unmarked model holds when the key is secret and unrelated to the model, but B is not known a priori; taking B
as the max |theta_j| over J of the model under test (``score_bound``) is a heuristic plug-in, not a proof.

**Attacks** (Table III). Fine-tuning needs data and is done by the caller. ``prune_magnitude`` zeroes the
``fraction`` of weights with the smallest magnitude ("70 % L1 pruning": unstructured L1-magnitude pruning,
global over the weight tensors by default or per tensor). ``add_weight_noise`` adds N(0, std^2) to every
selected entry; the paper's "N(0, 10^-3)" does not say whether 10^-3 is the variance (std 0.0316, the usual
N(mu, sigma^2) notation) or the std: ``paper_noise_std(reading)`` gives either.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import nn

__all__ = [
    "Carrier",
    "add_weight_noise",
    "carrier",
    "flat_params",
    "hoeffding_false_positive",
    "model_carrier",
    "paper_noise_std",
    "prf_signs",
    "prf_uniform",
    "prune_magnitude",
    "required_carriers",
    "score_bound",
    "select_params",
    "wm_loss",
    "wm_score",
]

ModelOrState = nn.Module | Mapping[str, torch.Tensor]
BLOCK = 1 << 20
_DOMAIN_J = b"fedsight/ppfl-watermark/v1/carrier"
_DOMAIN_W = b"fedsight/ppfl-watermark/v1/sign"


def _xof(domain: bytes, key: bytes, block: int, nbytes: int) -> bytes:
    msg = len(domain).to_bytes(2, "little") + domain + len(key).to_bytes(4, "little") + key + block.to_bytes(8, "little")
    return hashlib.shake_256(msg).digest(nbytes)


def _block_uniform(key: bytes, b: int, n: int) -> np.ndarray:
    x = np.frombuffer(_xof(_DOMAIN_J, key, b, 8 * n), dtype="<u8")
    return (x >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _block_signs(key: bytes, b: int, n: int) -> np.ndarray:
    bits = np.unpackbits(np.frombuffer(_xof(_DOMAIN_W, key, b, (n + 7) // 8), dtype=np.uint8), bitorder="little")
    return np.where(bits[:n] == 1, 1.0, -1.0)


def prf_uniform(key: bytes, d: int) -> np.ndarray:
    """PRF(mk, j) for j < d as float64 uniforms on [0, 1) (what ``carrier`` thresholds)."""
    return np.concatenate([_block_uniform(key, b, min(BLOCK, d - b * BLOCK)) for b in range((d + BLOCK - 1) // BLOCK)]
                          or [np.zeros(0)])


def prf_signs(key: bytes, d: int) -> np.ndarray:
    """PRF(mk, ("w", j)) for j < d as signs +-1 (float64)."""
    return np.concatenate([_block_signs(key, b, min(BLOCK, d - b * BLOCK)) for b in range((d + BLOCK - 1) // BLOCK)]
                          or [np.zeros(0)])


def carrier(key: bytes, d: int, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The carrier set J = {j < d : PRF(key, j) < p} (sorted int64 indices) and its signs w_j in {+-1}
    (float32), from two domain-separated SHAKE-256 streams. Deterministic in (key, d, p); a prefix of the
    coordinates gets the same carriers whatever d is."""
    if not isinstance(key, (bytes, bytearray)) or not key:
        raise ValueError("watermark key must be non-empty bytes")
    if not 0 < p < 1:
        raise ValueError(f"carrier probability p must be in (0, 1), got {p}")
    key = bytes(key)
    idx, sign = [], []
    for b in range((d + BLOCK - 1) // BLOCK):
        n = min(BLOCK, d - b * BLOCK)
        local = np.flatnonzero(_block_uniform(key, b, n) < p)
        idx.append(local + b * BLOCK)
        sign.append(_block_signs(key, b, n)[local])
    j = np.concatenate(idx) if idx else np.zeros(0, dtype=np.int64)
    w = np.concatenate(sign) if sign else np.zeros(0)
    return torch.from_numpy(j.astype(np.int64)), torch.from_numpy(w.astype(np.float32))


def select_params(model: nn.Module, prefixes: Sequence[str] | None = None) -> list[str]:
    """The watermarked parameters' names, in ``named_parameters()`` order: every floating-point parameter, or
    those whose qualified name starts with one of ``prefixes`` (a prefix ``"backbone"`` matches
    ``backbone.0.weight``; use ``"backbone."`` to exclude ``backbone2``)."""
    names = [k for k, p in model.named_parameters() if p.is_floating_point()]
    if prefixes:
        names = [k for k in names if any(k.startswith(pre) for pre in prefixes)]
    return names


@dataclass(frozen=True)
class Carrier:
    """A resolved carrier set: the parameter names and sizes the coordinates run over, J and the signs, and
    per parameter the local positions of its carriers with their signs (what ``wm_loss`` gathers)."""

    names: tuple[str, ...]
    numels: tuple[int, ...]
    p: float
    indices: torch.Tensor
    signs: torch.Tensor
    parts: tuple[tuple[str, torch.Tensor, torch.Tensor], ...]

    @property
    def d(self) -> int:
        return int(sum(self.numels))

    @property
    def size(self) -> int:
        return int(self.indices.numel())


def model_carrier(model_or_state: ModelOrState, key: bytes, p: float, prefixes: Sequence[str] | None = None,
                  names: Sequence[str] | None = None) -> Carrier:
    """The ``Carrier`` of ``model_or_state`` (parameters chosen by ``select_params``, or exactly ``names``;
    for a state dict ``names`` default to every floating tensor, buffers included, so pass them)."""
    if names is None:
        if isinstance(model_or_state, nn.Module):
            names = select_params(model_or_state, prefixes)
        else:
            names = [k for k, v in model_or_state.items() if v.is_floating_point()
                     and (not prefixes or any(k.startswith(pre) for pre in prefixes))]
    tensors = _tensors(model_or_state)
    missing = [k for k in names if k not in tensors]
    if missing:
        raise KeyError(f"watermark parameters not in the model: {', '.join(missing[:3])}")
    numels = tuple(int(tensors[k].numel()) for k in names)
    if not numels:
        raise ValueError("watermark: no parameters selected")
    j, w = carrier(key, sum(numels), p)
    parts, off = [], 0
    for k, n in zip(names, numels):
        lo, hi = np.searchsorted(j.numpy(), [off, off + n])
        if hi > lo:
            parts.append((k, j[lo:hi] - off, w[lo:hi].clone()))
        off += n
    return Carrier(tuple(names), numels, float(p), j, w, tuple(parts))


def _tensors(model_or_state: ModelOrState) -> dict[str, torch.Tensor]:
    if isinstance(model_or_state, nn.Module):
        out = dict(model_or_state.named_parameters())
        for k, v in model_or_state.state_dict(keep_vars=True).items():
            out.setdefault(k, v)
        return out
    return dict(model_or_state)


def flat_params(model_or_state: ModelOrState, names: Sequence[str]) -> torch.Tensor:
    """theta: the named tensors flattened and concatenated in the order of ``names`` (differentiable for a
    model's parameters)."""
    t = _tensors(model_or_state)
    return torch.cat([t[k].reshape(-1) for k in names])


def wm_loss(model: ModelOrState, c: Carrier, beta: float) -> torch.Tensor:
    """L_wm = (1/|J|) sum_{j in J} (theta_j w_j - beta)^2, gathering only the carriers (differentiable)."""
    t = _tensors(model)
    terms = [((t[k].reshape(-1)[pos] * sign.to(t[k].device, t[k].dtype) - beta) ** 2).sum() for k, pos, sign in c.parts]
    if not terms:
        raise ValueError("watermark: the carrier set is empty")
    return torch.stack(terms).sum() / c.size


@torch.no_grad()
def wm_score(model_or_state: ModelOrState, c: Carrier) -> float:
    """S = (1/|J|) sum_{j in J} theta_j w_j (computed in float64)."""
    t = _tensors(model_or_state)
    if c.size == 0:
        raise ValueError("watermark: the carrier set is empty")
    total = sum(float((t[k].detach().reshape(-1)[pos.to(t[k].device)].double() * sign.double().to(t[k].device)).sum())
                for k, pos, sign in c.parts)
    return total / c.size


@torch.no_grad()
def score_bound(model_or_state: ModelOrState, c: Carrier) -> float:
    """max_{j in J} |theta_j|: a plug-in for the bound B of the Hoeffding test (a heuristic, not a priori)."""
    t = _tensors(model_or_state)
    return max((float(t[k].detach().reshape(-1)[pos.to(t[k].device)].abs().max()) for k, pos, _ in c.parts), default=0.0)


def hoeffding_false_positive(J: int | torch.Tensor | Carrier, threshold: float, bound: float) -> float:
    """Hoeffding's bound on Pr_H0[S > threshold] for |J| independent zero-mean X_j in [-bound, bound]:
    exp(-|J| threshold^2 / (2 bound^2)) (1 when threshold <= 0). ``J``: its size, the index tensor or a Carrier."""
    n = J.size if isinstance(J, Carrier) else (int(J.numel()) if isinstance(J, torch.Tensor) else int(J))
    if threshold <= 0:
        return 1.0
    if bound <= 0:
        return 0.0
    return math.exp(-n * threshold**2 / (2.0 * bound**2))


def required_carriers(threshold: float, bound: float, false_positive: float) -> int:
    """The smallest |J| for which ``hoeffding_false_positive`` is <= ``false_positive``:
    ceil(2 bound^2 ln(1/false_positive) / threshold^2)."""
    if threshold <= 0 or bound <= 0 or not 0 < false_positive < 1:
        raise ValueError("required_carriers needs threshold > 0, bound > 0 and 0 < false_positive < 1")
    return math.ceil(2.0 * bound**2 * math.log(1.0 / false_positive) / threshold**2)


# ------------------------------------------------------------------------------------------------ attacks


def _state_copy(model_or_state: ModelOrState, names: Sequence[str] | None,
                default: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """A detached copy of the whole state, and the names an attack touches (``names`` or the default set)."""
    if isinstance(model_or_state, nn.Module):
        state = {k: v.detach().clone() for k, v in model_or_state.state_dict().items()}
        params = dict(model_or_state.named_parameters())
        cand = [k for k, p in params.items() if p.is_floating_point()]
    else:
        state = {k: v.detach().clone() for k, v in model_or_state.items()}
        cand = [k for k, v in state.items() if v.is_floating_point()
                and not k.endswith(("running_mean", "running_var", "num_batches_tracked"))]
    if names is None:
        names = [k for k in cand if state[k].dim() >= 2] if default == "weights" else cand
    return state, list(names)


@torch.no_grad()
def prune_magnitude(model_or_state: ModelOrState, fraction: float = 0.7, scope: Literal["global", "per_tensor"] = "global",
                    names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """A copy of the state with the ``fraction`` smallest-magnitude weights set to zero (unstructured L1
    pruning): ``floor(fraction * n)`` entries over all selected tensors together (``scope="global"``) or in
    each tensor (``"per_tensor"``). Default tensors: the weights, i.e. floating parameters with >= 2
    dimensions (conv and linear kernels; biases and norm parameters are kept), as torch's pruning
    utilities are usually applied. Ties are broken by position, so exactly that many entries are zeroed.
    Load the result with ``model.load_state_dict(out)``; the input is not changed."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    state, names = _state_copy(model_or_state, names, "weights")
    if not names or fraction == 0:
        return state
    if scope == "per_tensor":
        groups = [[k] for k in names]
    elif scope == "global":
        groups = [names]
    else:
        raise ValueError(f"scope must be 'global' or 'per_tensor', got {scope!r}")
    for group in groups:
        flat = torch.cat([state[k].reshape(-1).abs().double() for k in group])
        k_prune = math.floor(fraction * flat.numel())
        if k_prune == 0:
            continue
        drop = torch.zeros(flat.numel(), dtype=torch.bool)
        drop[torch.argsort(flat, stable=True)[:k_prune]] = True
        off = 0
        for k in group:
            n = state[k].numel()
            state[k].reshape(-1)[drop[off:off + n].to(state[k].device)] = 0
            off += n
    return state


def paper_noise_std(reading: Literal["variance", "std"] = "variance", value: float = 1e-3) -> float:
    """The std of the paper's "Gaussian weight noise N(0, 10^-3)": sqrt(value) if 10^-3 is the variance (the
    N(mu, sigma^2) convention), value itself if it is the std."""
    if reading == "variance":
        return math.sqrt(value)
    if reading == "std":
        return float(value)
    raise ValueError(f"reading must be 'variance' or 'std', got {reading!r}")


@torch.no_grad()
def add_weight_noise(model_or_state: ModelOrState, std: float, generator: torch.Generator | None = None,
                     names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """A copy of the state with N(0, std^2) noise added to every selected entry (default: every floating
    parameter; for a state dict every floating tensor except BatchNorm statistics). Noise is drawn on the CPU
    from ``generator`` in the order of ``names``. The input is not changed."""
    if std < 0:
        raise ValueError(f"std must be >= 0, got {std}")
    state, names = _state_copy(model_or_state, names, "all")
    for k in names:
        t = state[k]
        noise = torch.randn(t.shape, generator=generator, dtype=torch.float64)
        state[k] = (t.double() + std * noise.to(t.device)).to(t.dtype)
    return state
