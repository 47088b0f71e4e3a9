"""The reply contract: what a client's training result must be before the server lets anything touch it.

Every backend's replies pass ``check_result`` (``Server.rejection``), in one place, before weighting and
aggregation: a result that breaks the contract becomes a ``rejected_update`` event naming the client and the
reason, and the round goes on with the others. The contract is built from what the server itself knows (the
stage's shared entries, their shapes and dtypes, whether the stage trains, the clients' sizes, what the stage's
components declare they upload), never from the reply.

What it guarantees about an accepted result:

* it is the reply for the client it was asked of (``client_id``);
* ``delta`` has exactly the stage's shared trainable entries (none for a statistics pass), ``buffers`` exactly
  its shared buffers (or none from a statistics pass), each tensor with the global entry's shape and dtype;
* ``extras`` has exactly the groups the stage's components declare for this round (``Component.extras_spec``,
  one group per uploading component, under its name: SCAFFOLD's Delta c_i, Elastic's sensitivities, FedNova's
  factor, Fed3R's / FedNCM's statistics, LADD's style; in a statistics pass only its trainer's group, as the
  other components' ``client_end`` does not run), each group exactly its declared names, each tensor
  dense, with the declared dtype and shape (a size the server cannot know, as the number of classes a Fed3R
  client holds, within its declared bounds and the same wherever the group repeats it), and the group's values
  pass the component's own check (FedNova's factor is the one the server computes from the client's example
  count and the round's local settings; sensitivities and styles non-negative; Fed3R's statistics consistent
  with the example count, sorted in-range classes, a Gram matrix positive semi-definite within lambda/(2K),
  so the server's ridge system stays positive definite whatever K clients send). A component that sets
  ``uploads_extras`` without declaring (a third-party one) gets the old check only: any named finite tensors;
* every tensor (delta, buffers, extras) is finite, and no shared BatchNorm ``running_var`` or
  ``num_batches_tracked`` is negative (``nonneg``);
* ``num_examples`` is a positive integer: equal to the server's own count of the client's training examples
  when the server knows it (in-process runs, Flower nodes holding partitions of the run's dataset), else at
  most ``max_examples``; ``num_steps`` a non-negative integer, ``flops`` finite and non-negative;
* every metric is a finite real number.

What a client can still do within the contract: send any finite update of the right shape (a poisoned model
update; bound it with ``norm_bound`` or a robust aggregator) and, likewise, finite extras of the declared form
chosen to harm (a SCAFFOLD Delta c_i that drags the control variate, statistics that skew Fed3R's classifier:
no robust aggregator covers extras), and, where the server cannot know sizes, claim up to ``max_examples``
examples (weight uniformly to remove that lever; with FedNova it also sets the client's normalising factor).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

import torch

from ..functional.aggregate import all_finite
from ..records import ClientResult
from ..training.component import ExtrasSpec

Spec = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


@dataclass(frozen=True)
class ReplyContract:
    params: Spec  # the shared trainable entries a training client uploads as a delta
    buffers: Spec  # the shared buffers it uploads
    trains: bool  # False: a statistics pass (no delta)
    sizes: Callable[[int], int] | None = None  # the server's own number of training examples of a client
    max_examples: int = 10**9
    #: the extras groups the stage's components declare (component name -> spec); None: any named finite tensors
    extras: Mapping[str, ExtrasSpec] | None = None
    #: shared buffers no honest client makes negative (BatchNorm ``running_var``, ``num_batches_tracked``)
    nonneg: frozenset[str] = frozenset()

    @staticmethod
    def of(state: Mapping[str, torch.Tensor], params: Any, buffers: Any, trains: bool, **kw: Any) -> "ReplyContract":
        spec = lambda keys: {k: (tuple(state[k].shape), state[k].dtype) for k in keys}  # noqa: E731
        return ReplyContract(spec(params), spec(buffers), trains, **kw)


def _result_tensors(res: Any) -> list[Any] | None:
    """The values of a result's delta, buffers and extras groups, in order (None: not a result of that form)."""
    if not isinstance(res, ClientResult) or not isinstance(res.extras, Mapping):
        return None
    groups = [res.delta, res.buffers, *res.extras.values()]
    return [t for g in groups for t in g.values()] if all(isinstance(g, Mapping) for g in groups) else None


@dataclass(frozen=True)
class FiniteSeal:
    """The tensors of a result that were found finite in this process (the in-process runtime's ``keep``, on which
    the client's outcome depends), each with its version counter then. While the result holds exactly these tensor
    objects, none changed in place since (every in-place torch operation counts a version), the server's contract
    check does not read their values again: in an in-process run the second pass over every upload (and on a GPU a
    synchronisation per client) is spared. A result whose tensors were replaced or changed is checked in full; a
    reply that crossed a process boundary never has a seal."""

    tensors: tuple[tuple[torch.Tensor, int], ...]

    @staticmethod
    def of(res: ClientResult) -> "FiniteSeal":
        return FiniteSeal(tuple((t, t._version) for t in _result_tensors(res) or ()))

    def holds(self, res: Any) -> bool:
        now = _result_tensors(res)
        return now is not None and len(now) == len(self.tensors) and all(
            t is s and t._version == v for t, (s, v) in zip(now, self.tensors))


def _is_int(x: Any) -> bool:
    return isinstance(x, Integral) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool) and math.isfinite(float(x))


def _check_tensors(what: str, got: Any, spec: Spec, finite_known: bool = False) -> str | None:
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
    # one check of the whole mapping (a sync on a GPU), then find the culprit
    if not finite_known and not all_finite(got):
        k = next(k for k in spec if not bool(torch.isfinite(got[k]).all()))
        return f"{what} {k!r} has non-finite values"
    return None


def check_result(res: Any, client: int, contract: ReplyContract, *, finite_known: bool = False) -> str | None:
    """Why ``res`` (the reply for ``client``) breaks the contract, or None when it keeps it. ``finite_known``: these
    very tensors were found finite in this process already (``FiniteSeal``): their values are not read again."""
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
    why = _check_tensors("delta", res.delta, params, finite_known)
    if why:
        return why
    buffers = contract.buffers if (contract.trains or res.buffers) else {}
    why = _check_tensors("buffers", res.buffers, buffers, finite_known)
    if why:
        return why
    signed = sorted(k for k in contract.nonneg if k in res.buffers and res.buffers[k].numel())
    # one check of them all (a sync on a GPU), then find the culprit
    if signed and bool(torch.stack([res.buffers[k].min().double() for k in signed]).lt(0).any()):
        k = next(k for k in signed if bool((res.buffers[k] < 0).any()))
        return f"buffers {k!r} has negative values (a BatchNorm variance or counter no honest client sends)"
    return _check_extras(res, contract.extras, finite_known)


def _names(keys: Any) -> str:
    keys = sorted(map(repr, keys))
    return ", ".join(keys[:3]) + (" ..." if len(keys) > 3 else "")


def _shape(shape: tuple, sizes: Mapping[str, tuple[int, int]]) -> str:
    dims = ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "")
    named = [f"{lo} <= {d} <= {hi}" for d in dict.fromkeys(d for d in shape if isinstance(d, str))
             for lo, hi in [sizes.get(d, (0, 0))]]
    return f"({dims})" + (f" with {', '.join(named)}" if named else "")


def _check_group(name: str, group: Mapping[Any, Any], spec: ExtrasSpec, res: ClientResult,
                 finite_known: bool) -> str | None:
    for k, t in group.items():
        if not isinstance(k, str):
            return f"extras {name!r} have a key {k!r} that is not a name"
        if not isinstance(t, torch.Tensor):
            return f"extra {name}/{k} is a {type(t).__name__}, not a tensor"
        if t.layout != torch.strided:
            return f"extra {name}/{k} is a {t.layout} tensor, not a dense one"
    if spec.tensors is None:  # undeclared: any named finite tensors
        for k, t in group.items():
            if not finite_known and (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all()):
                return f"extra {name}/{k} has non-finite values"
        return None
    missing, extra = set(spec.tensors) - set(group), set(group) - set(spec.tensors)
    if missing or extra:
        parts = ([f"missing {_names(missing)}"] if missing else []) + ([f"unexpected {_names(extra)}"] if extra else [])
        return f"extras {name!r}: {'; '.join(parts)}"
    bound: dict[str, int] = {}
    for k, (shape, dtype) in spec.tensors.items():
        t = group[k]
        got = tuple(t.shape)
        ok = len(got) == len(shape)
        for want, size in zip(shape, got) if ok else ():
            if isinstance(want, str):
                lo, hi = spec.sizes.get(want, (0, -1))
                ok = ok and lo <= size <= hi and bound.setdefault(want, size) == size
            else:
                ok = ok and size == want
        if not ok:
            also = ", ".join(f"{d} = {v}" for d, v in bound.items() if d in shape)
            return (f"extra {name}/{k} has shape {got}, expected {_shape(shape, spec.sizes)}"
                    + (f" and {also}" if also else ""))
        if t.dtype != dtype:
            return f"extra {name}/{k} has dtype {t.dtype}, expected {dtype}"
        if not finite_known and (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all()):
            return f"extra {name}/{k} has non-finite values"
    if spec.check is not None:
        try:
            why = spec.check(group, res)
        except Exception as exc:  # a value the check could not handle is the reply's fault, not the server's
            why = f"its values could not be checked ({type(exc).__name__}: {exc})"
        if why:
            return f"extras {name!r}: {why}"
    return None


def _check_extras(res: ClientResult, declared: Mapping[str, ExtrasSpec] | None, finite_known: bool) -> str | None:
    extras = res.extras
    if not isinstance(extras, Mapping):
        return "extras are not a mapping"
    for name, group in extras.items():
        if not isinstance(name, str):
            return f"extras have a group {name!r} that is not a name"
        if not isinstance(group, Mapping):
            return f"extras {name!r} are not named tensors"
    if declared is None:
        declared = {name: ExtrasSpec(None, required=False) for name in extras}
    unexpected = set(extras) - set(declared)
    if unexpected:
        return (f"extras: unexpected {'group' if len(unexpected) == 1 else 'groups'} {_names(unexpected)} "
                f"(no component of this stage uploads {'it' if len(unexpected) == 1 else 'them'})")
    for name, spec in declared.items():
        if name not in extras:
            if spec.required:
                return f"extras: missing group {name!r} (every client of this stage uploads it)"
            continue
        why = _check_group(name, extras[name], spec, res, finite_known)
        if why:
            return why
    return None


# -- evaluation replies ---------------------------------------------------------------------------------------


def check_evaluation(metrics: Any, tensors: Mapping[str, Any], n: Any, *, known: int | None,
                     max_examples: int) -> str | None:
    """Why a client's local-evaluation reply breaks the contract, or None. ``tensors``: its metric state (the
    task's ``MetricSet``, ``metrics``, names the entries and how they merge), ``n``: the test examples it claims,
    ``known``: the server's own count of that client's test examples (None: the node holds its own data, and ``n``
    is only bounded by ``max_examples``). An accepted reply's state holds only the task's entries, without NaN or
    -inf (+inf only where the metric's range is unbounded above: an honest loss overflows), with no negative count (``Metric.state_problem``), gives the primary metric when ``n > 0`` (nothing when ``n = 0``), and
    every value it gives lies in its metric's declared range (``MetricSpec.bounds``: an accuracy in [0, 1])."""
    if not _is_int(n) or n < 0:
        return f"num-test-examples = {n!r} is not a non-negative integer"
    if known is not None and int(n) != int(known):
        return f"num-test-examples = {n} but the client holds {known} test examples"
    if known is None and n > max_examples:
        return f"num-test-examples = {n} exceeds the bound {max_examples}"
    for k, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.is_complex() or t.layout != torch.strided:
            return f"metric state {k!r} is not a dense real tensor"
        # (+inf is honest: a loss that overflowed; the value's range below decides whether it may be inf)
        if t.is_floating_point() and bool((t.isnan() | (t == -math.inf)).any()):
            return f"metric state {k!r} has NaN or -inf values"
    try:
        state = metrics.state_from(tensors)
        for m in metrics.metrics:
            why = m.state_problem(state)
            if why:
                return why
        values = metrics.compute(state)
    except Exception as exc:  # a state the metrics cannot read is the reply's fault, not the server's
        return f"the metric state cannot be computed ({type(exc).__name__}: {exc})"
    if n == 0 and values:
        return "a client with no test examples sends metric values"
    if n > 0 and metrics.primary not in values:
        return f"the metric state gives no {metrics.primary!r} for {n} test examples"
    from ..metrics.state import bounds_of

    specs = metrics.specs()
    for key, v in values.items():
        lo, hi = bounds_of(specs, key) or (-math.inf, math.inf)
        if math.isnan(v) or (math.isinf(v) and not (v > 0 and hi == math.inf)):
            return f"metric {key} = {v} is not finite"
        slack = 1e-6 * max(1.0, abs(lo) if math.isfinite(lo) else 1.0, abs(hi) if math.isfinite(hi) else 1.0)
        if not lo - slack <= v <= hi + slack:
            return f"metric {key} = {v:g} is outside its range [{lo:g}, {hi:g}]"
    return None


def check_personal(entries: Mapping[str, Any], spec: Spec, nonneg: frozenset[str] = frozenset()) -> str | None:
    """Why a client's stored personal entries sent with an evaluation reply (FedBN/SiloBN's normalisation entries,
    averaged for the global test set) break the contract, or None: a subset of the stage's personal entries, each
    with the global entry's shape and dtype, finite, with no negative BatchNorm variance or counter."""
    if not isinstance(entries, Mapping):
        return "personal entries are not named tensors"
    why = _check_tensors("personal", entries, {k: spec[k] for k in entries if k in spec})  # (names the unknown)
    if why:
        return why
    for k in sorted(nonneg & set(entries)):
        if entries[k].numel() and bool((entries[k] < 0).any()):
            return f"personal {k!r} has negative values (a BatchNorm variance or counter no honest client sends)"
    return None
