"""The reply contract: what a client's training result must be before the server lets anything touch it.

Every backend's replies pass ``check_result`` (``Server.rejection``), in one place, before weighting and
aggregation: a result that breaks the contract becomes a ``rejected_update`` event naming the client and the
reason, and the round goes on with the others. The contract is built from what the server itself knows (the
stage's shared entries, their shapes and dtypes, whether the stage trains, the clients' sizes), never from
the reply.

What it guarantees about an accepted result:

* it is the reply for the client it was asked of (``client_id``);
* ``delta`` has exactly the stage's shared trainable entries (none for a statistics pass), ``buffers`` exactly
  its shared buffers (or none from a statistics pass), each tensor with the global entry's shape and dtype;
* every tensor (delta, buffers, floating extras) is finite;
* ``num_examples`` is a positive integer: equal to the server's own count of the client's training examples
  when the server knows it (in-process runs, Flower nodes holding partitions of the run's dataset), else at
  most ``max_examples``; ``num_steps`` a non-negative integer, ``flops`` finite and non-negative;
* every metric is a finite real number.

What a client can still do within the contract: send any finite update of the right shape (a poisoned model
update; bound it with ``norm_bound`` or a robust aggregator), and, where the server cannot know sizes, claim
up to ``max_examples`` examples (weight uniformly to remove that lever).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

import torch

from ..records import ClientResult

Spec = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


@dataclass(frozen=True)
class ReplyContract:
    params: Spec  # the shared trainable entries a training client uploads as a delta
    buffers: Spec  # the shared buffers it uploads
    trains: bool  # False: a statistics pass (no delta)
    sizes: Callable[[int], int] | None = None  # the server's own number of training examples of a client
    max_examples: int = 10**9

    @staticmethod
    def of(state: Mapping[str, torch.Tensor], params: Any, buffers: Any, trains: bool, **kw: Any) -> "ReplyContract":
        spec = lambda keys: {k: (tuple(state[k].shape), state[k].dtype) for k in keys}  # noqa: E731
        return ReplyContract(spec(params), spec(buffers), trains, **kw)


def _is_int(x: Any) -> bool:
    return isinstance(x, Integral) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool) and math.isfinite(float(x))


def _check_tensors(what: str, got: Any, spec: Spec) -> str | None:
    if not isinstance(got, Mapping):
        return f"{what} is a {type(got).__name__}, not named tensors"
    missing, extra = sorted(set(spec) - set(got)), sorted(set(got) - set(spec))
    if missing or extra:
        parts = ([f"missing {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"] if missing else []) + \
                ([f"unexpected {', '.join(map(str, extra[:3]))}{' ...' if len(extra) > 3 else ''}"] if extra else [])
        return f"{what}: {'; '.join(parts)}"
    for k, (shape, dtype) in spec.items():
        t = got[k]
        if not isinstance(t, torch.Tensor):
            return f"{what} {k!r} is a {type(t).__name__}, not a tensor"
        if tuple(t.shape) != shape:
            return f"{what} {k!r} has shape {tuple(t.shape)}, expected {shape}"
        if t.dtype != dtype:
            return f"{what} {k!r} has dtype {t.dtype}, expected {dtype}"
        if not bool(torch.isfinite(t).all()):
            return f"{what} {k!r} has non-finite values"
    return None


def check_result(res: Any, client: int, contract: ReplyContract) -> str | None:
    """Why ``res`` (the reply for ``client``) breaks the contract, or None when it keeps it."""
    if not isinstance(res, ClientResult):
        return f"not a client result ({type(res).__name__})"
    if not _is_int(res.client_id) or int(res.client_id) != client:
        return f"reply names client {res.client_id!r}, it was asked of client {client}"
    n = res.num_examples
    if not _is_int(n) or n <= 0:
        return f"num_examples = {n!r} is not a positive integer"
    if contract.sizes is not None:
        own = int(contract.sizes(client))
        if int(n) != own:
            return f"num_examples = {n} but the client holds {own} training examples"
    elif n > contract.max_examples:
        return f"num_examples = {n} exceeds the bound {contract.max_examples}"
    if not _is_int(res.num_steps) or res.num_steps < 0:
        return f"num_steps = {res.num_steps!r} is not a non-negative integer"
    if not _is_real(res.flops) or res.flops < 0:
        return f"flops = {res.flops!r} is not a finite non-negative number"
    if not isinstance(res.metrics, Mapping):
        return "metrics are not a mapping"
    for k, v in res.metrics.items():
        if not isinstance(k, str) or not _is_real(v):
            return f"metric {k!r} = {v!r} is not a finite number"
    params = contract.params if contract.trains else {}
    why = _check_tensors("delta", res.delta, params)
    if why:
        return why
    buffers = contract.buffers if (contract.trains or res.buffers) else {}
    why = _check_tensors("buffers", res.buffers, buffers)
    if why:
        return why
    if not isinstance(res.extras, Mapping):
        return "extras are not a mapping"
    for name, tensors in res.extras.items():
        if not isinstance(tensors, Mapping):
            return f"extras {name!r} are not named tensors"
        for k, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                return f"extra {name}/{k} is a {type(t).__name__}, not a tensor"
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                return f"extra {name}/{k} has non-finite values"
    return None
