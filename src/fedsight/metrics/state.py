"""Mergeable metric states (after torchmetrics' state reductions).

An evaluation of a split produces a ``MetricState``: named tensors, each with a declared reduction that
says how two states of the same metric merge:

* ``"sum"``: elementwise sum (counts, sums of losses, a confusion matrix);
* ``"cat"``: concatenation along dim 0 (detections for an AP that ranks all of them at once);
* ``"max"`` / ``"min"``: elementwise extremes.

Merging is associative, so a metric over several clients' test sets is computed from the merged state
(the sum of their confusion matrices), never as a mean of per-client values; the engine merges in client
order, which makes the float sums reproducible. A state crosses a process boundary (Flower records) as
its plain tensors (``tensors()``); the receiver rebuilds it with the task's declared reductions
(``MetricSet.state_from``), which rejects unexpected names.

Sums are kept in float64 (or int64 for counts) so that merging many clients loses nothing.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

REDUCTIONS = ("sum", "cat", "max", "min")


@dataclass(frozen=True)
class MetricSpec:
    """A reported metric: its key (``acc``; ``iou/*`` names a family of keys), whether higher values
    are better (None: informational, no best value), and what it measures."""

    key: str
    higher_is_better: bool | None
    doc: str = ""
    #: the closed range every value lies in (accuracy (0, 1), a loss (0, inf)); None: any finite value. A client's
    #: evaluation reply whose metric falls outside is refused (``engine.contract.check_evaluation``)
    bounds: tuple[float, float] | None = None

    def matches(self, key: str) -> bool:
        """``key`` is this spec's key, or matches it as a pattern (``*`` stands for any characters:
        ``iou/*``, ``test_*/miou``)."""
        return key == self.key or ("*" in self.key and fnmatch.fnmatchcase(key, self.key))


def spec_of(specs: Iterable[MetricSpec], key: str) -> MetricSpec | None:
    """The spec of ``key`` under ``specs``: an exact key wins over a family, a longer family over a shorter
    one; None if no spec matches."""
    best: MetricSpec | None = None
    for s in specs:
        if s.key == key:
            return s
        if s.matches(key) and (best is None or len(s.key) > len(best.key)):
            best = s
    return best


def direction(specs: Iterable[MetricSpec], key: str) -> bool | None:
    """The direction of ``key`` under ``specs`` (``spec_of``); None if no spec matches."""
    s = spec_of(specs, key)
    return None if s is None else s.higher_is_better


def bounds_of(specs: Iterable[MetricSpec], key: str) -> tuple[float, float] | None:
    """The range of ``key`` under ``specs`` (``spec_of``); None if none is declared."""
    s = spec_of(specs, key)
    return None if s is None else s.bounds


class MetricState:
    """Named tensors with their reductions. ``add`` accumulates one batch in place; ``merge`` combines
    states of the same metrics."""

    __slots__ = ("_t", "_reduce", "_pending")

    def __init__(self, reduce: Mapping[str, str], tensors: Mapping[str, torch.Tensor] | None = None):
        bad = {k: r for k, r in reduce.items() if r not in REDUCTIONS}
        if bad:
            raise ValueError(f"unknown reductions {bad}; choose from {REDUCTIONS}")
        self._reduce = dict(reduce)
        self._t: dict[str, torch.Tensor] = dict(tensors or {})
        self._pending: dict[str, list[torch.Tensor]] = {}  # "cat" parts, joined once on read

    @property
    def reductions(self) -> dict[str, str]:
        return dict(self._reduce)

    def add(self, name: str, value: torch.Tensor) -> None:
        """Fold ``value`` into entry ``name`` with the entry's reduction."""
        how = self._reduce[name]
        value = value.detach()
        if how == "cat":
            self._pending.setdefault(name, []).append(value)
            return
        old = self._t.get(name)
        if old is None:
            self._t[name] = value.clone()
        elif how == "sum":
            self._t[name] = old + value.to(old)
        elif how == "max":
            self._t[name] = torch.maximum(old, value.to(old))
        else:
            self._t[name] = torch.minimum(old, value.to(old))

    def get(self, name: str) -> torch.Tensor | None:
        self._flush(name)
        return self._t.get(name)

    def _flush(self, name: str) -> None:
        parts = self._pending.pop(name, None)
        if parts:
            old = self._t.get(name)
            self._t[name] = torch.cat(([old] if old is not None else []) + [p.to(parts[0].device) for p in parts])

    def tensors(self) -> dict[str, torch.Tensor]:
        """The state's tensors (CPU), in a fixed (sorted) order: what a record carries."""
        for name in list(self._pending):
            self._flush(name)
        return {k: self._t[k].detach().cpu() for k in sorted(self._t)}

    def __len__(self) -> int:
        return len(set(self._t) | set(self._pending))

    def merge(self, other: "MetricState") -> "MetricState":
        """A new state: this one folded with ``other`` (same reductions)."""
        if other._reduce != self._reduce:
            raise ValueError("cannot merge metric states of different metrics")
        out = MetricState(self._reduce, self.tensors())
        for k, v in other.tensors().items():
            out.add(k, v)
        out.tensors()  # join "cat" parts
        return out

    @staticmethod
    def merge_all(states: Sequence["MetricState"], reduce: Mapping[str, str]) -> "MetricState":
        """Fold ``states`` in order into one (an empty state for none)."""
        out = MetricState(reduce)
        for s in states:
            out = out.merge(s)
        return out


class Metric:
    """One metric's part of a task's state: the entries it owns (prefixed with its name, so metrics never
    collide), how batches update them and what it computes. Subclasses: ``Mean``, ``ConfusionMatrix``."""

    name: str

    def reductions(self) -> dict[str, str]:
        raise NotImplementedError

    def specs(self) -> tuple[MetricSpec, ...]:
        raise NotImplementedError

    def compute(self, state: MetricState) -> dict[str, float]:
        """The metric's values; {} when the state holds nothing of it (an empty split)."""
        raise NotImplementedError

    def key(self, entry: str) -> str:
        return f"{self.name}.{entry}"

    def state_problem(self, state: MetricState) -> str | None:
        """Why ``state`` (received from a client) is not one this metric's updates can produce, or None. Here: an
        integer entry (a count, a confusion matrix) with a negative value."""
        for k in self.reductions():
            t = state.get(k)
            if t is not None and not t.is_floating_point() and t.dtype != torch.bool and t.numel() and bool((t < 0).any()):
                return f"metric state {k!r} has negative counts"
        return None


class Mean(Metric):
    """The mean of a per-example (or per-unit) quantity: state ``sum`` (float64) and ``count`` (float64),
    value ``sum / count``. ``update(state, total, count)`` adds a batch's total and its number of units."""

    def __init__(self, name: str, higher_is_better: bool | None, doc: str = "",
                 bounds: tuple[float, float] | None = None):
        self.name, self.higher_is_better, self.doc, self.bounds = name, higher_is_better, doc, bounds

    def reductions(self) -> dict[str, str]:
        return {self.key("sum"): "sum", self.key("count"): "sum"}

    def specs(self) -> tuple[MetricSpec, ...]:
        return (MetricSpec(self.name, self.higher_is_better, self.doc, self.bounds),)

    def state_problem(self, state: MetricState) -> str | None:
        n = state.get(self.key("count"))
        if n is not None and bool(((n < 0) | ~torch.isfinite(n)).any()):
            return f"metric state {self.key('count')!r} is negative or not finite"
        return None

    def update(self, state: MetricState, total: float | torch.Tensor, count: float | int) -> None:
        state.add(self.key("sum"), torch.as_tensor(float(total), dtype=torch.float64))
        state.add(self.key("count"), torch.as_tensor(float(count), dtype=torch.float64))

    def compute(self, state: MetricState) -> dict[str, float]:
        n = state.get(self.key("count"))
        if n is None or float(n) == 0:
            return {}
        return {self.name: float(state.get(self.key("sum"))) / float(n)}


class ConfusionMatrix(Metric):
    """A C x C confusion matrix (rows: target class, columns: predicted), int64, summed over batches and
    clients. Reports ``miou`` (mean over classes present in targets or predictions of
    IoU_c = TP_c / (TP_c + FP_c + FN_c)), ``pixel_acc`` (trace / total) and, with ``class_names``, the
    per-class IoU as ``iou/<name>`` of every class present in targets or predictions (a class absent from
    both has no IoU and no entry). Targets equal to ``ignore_index`` are left out."""

    def __init__(self, name: str, num_classes: int, ignore_index: int | None = None,
                 class_names: Sequence[str] | None = None):
        self.name, self.num_classes, self.ignore_index = name, int(num_classes), ignore_index
        self.class_names = list(class_names) if class_names is not None else None

    def reductions(self) -> dict[str, str]:
        return {self.key("matrix"): "sum"}

    def specs(self) -> tuple[MetricSpec, ...]:
        out = [
            MetricSpec("miou", True, "mean intersection over union over classes", (0.0, 1.0)),
            MetricSpec("pixel_acc", True, "fraction of correctly labelled targets", (0.0, 1.0)),
        ]
        if self.class_names is not None:
            out.append(MetricSpec("iou/*", True, "per-class intersection over union", (0.0, 1.0)))
        return tuple(out)

    def update(self, state: MetricState, preds: torch.Tensor, targets: torch.Tensor) -> None:
        p, t = preds.reshape(-1).long(), targets.reshape(-1).long()
        if self.ignore_index is not None:
            keep = t != self.ignore_index
            p, t = p[keep], t[keep]
        c = self.num_classes
        cm = torch.bincount(t * c + p, minlength=c * c).reshape(c, c)
        state.add(self.key("matrix"), cm.to(torch.int64))

    def compute(self, state: MetricState) -> dict[str, float]:
        cm = state.get(self.key("matrix"))
        if cm is None or int(cm.sum()) == 0:
            return {}
        cm = cm.to(torch.float64)
        tp = cm.diag()
        union = cm.sum(0) + cm.sum(1) - tp
        iou = torch.where(union > 0, tp / union.clamp_min(1), torch.full_like(tp, float("nan")))
        present = union > 0
        out = {"miou": float(iou[present].mean()), "pixel_acc": float(tp.sum() / cm.sum())}
        if self.class_names is not None:
            out.update({f"iou/{n}": float(v) for n, v, p in zip(self.class_names, iou.tolist(), present.tolist()) if p})
        return out


class PerClassAccuracy(Metric):
    """Per-class accuracy (the recall of each class): ``<prefix>/<class>`` = correctly predicted examples of
    class c / examples of class c, for every class present in the targets, from two int64 count vectors summed
    over batches and clients (so per-class values merge exactly). ``class_names`` name the keys (class index
    when None)."""

    def __init__(self, name: str, num_classes: int, prefix: str, class_names: Sequence[str] | None = None):
        self.name, self.num_classes, self.prefix = name, int(num_classes), prefix
        self.class_names = list(class_names) if class_names is not None else [str(c) for c in range(num_classes)]

    def reductions(self) -> dict[str, str]:
        return {self.key("correct"): "sum", self.key("count"): "sum"}

    def specs(self) -> tuple[MetricSpec, ...]:
        return (MetricSpec(f"{self.prefix}/*", True, "per-class accuracy (recall of each class)", (0.0, 1.0)),)

    def update(self, state: MetricState, preds: torch.Tensor, targets: torch.Tensor) -> None:
        t = targets.reshape(-1).long()
        hit = preds.reshape(-1).long() == t
        c = self.num_classes
        state.add(self.key("correct"), torch.bincount(t[hit], minlength=c).to(torch.int64).cpu())
        state.add(self.key("count"), torch.bincount(t, minlength=c).to(torch.int64).cpu())

    def compute(self, state: MetricState) -> dict[str, float]:
        correct, count = state.get(self.key("correct")), state.get(self.key("count"))
        if count is None or int(count.sum()) == 0:
            return {}
        return {f"{self.prefix}/{n}": int(k) / int(m) for n, k, m in zip(self.class_names, correct.tolist(),
                                                                          count.tolist()) if m > 0}


class MetricSet:
    """A task's metrics: one state for all of them, the reported specs and the primary metric (whose
    per-client values give WMA and the worst-10% mean)."""

    def __init__(self, metrics: Sequence[Metric], primary: str):
        self.metrics = list(metrics)
        names = [m.name for m in self.metrics]
        if len(set(names)) != len(names):
            raise ValueError(f"metric names must be distinct, got {names}")
        self.primary = primary
        self._reduce: dict[str, str] = {}
        for m in self.metrics:
            self._reduce.update(m.reductions())
        if not any(s.matches(primary) for s in self.specs()):
            raise ValueError(f"primary metric {primary!r} is not among {[s.key for s in self.specs()]}")

    @property
    def reductions(self) -> dict[str, str]:
        return dict(self._reduce)

    def specs(self) -> tuple[MetricSpec, ...]:
        return tuple(s for m in self.metrics for s in m.specs())

    def new_state(self) -> MetricState:
        return MetricState(self._reduce)

    def state_from(self, tensors: Mapping[str, torch.Tensor]) -> MetricState:
        """A state rebuilt from ``tensors()`` (a record); names must be exactly this set's entries or a
        subset of them (an empty split has none)."""
        unknown = sorted(set(tensors) - set(self._reduce))
        if unknown:
            raise ValueError(f"unexpected metric state entries {unknown}; expected {sorted(self._reduce)}")
        return MetricState(self._reduce, dict(tensors))

    def merge(self, states: Sequence[MetricState]) -> MetricState:
        return MetricState.merge_all(states, self._reduce)

    def compute(self, state: MetricState) -> dict[str, float]:
        out: dict[str, float] = {}
        for m in self.metrics:
            out.update(m.compute(state))
        return out

    def higher_is_better(self, key: str) -> bool | None:
        return direction(self.specs(), key)
