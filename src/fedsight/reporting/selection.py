"""Selection protocols: which of a run's evaluations stands for the run in a comparison.

- ``final``: the run's last evaluation of the metric;
- ``best``: its best evaluation (max for higher-is-better, min for lower-is-better). Selecting the round on
  the split that is reported is optimistic: a test metric's best round is "selected on the test set", and says
  so; a validation metric's (``val/*``) is selected on the validation set. Budget metrics (bytes, FLOPs,
  seconds, epsilon: ``fedsight.metric_table.is_budget``) and metrics without a direction have no best and keep
  their final value;
- ``last:N``: the mean of the run's last N evaluations (the FedDrive protocol), which needs N evaluations of
  every compared metric in every run.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from .runs_view import _best_direction, _Run, _Series

_LAST = re.compile(r"last:([1-9][0-9]*)")


@dataclass(frozen=True)
class Selection:
    """A selection protocol (see the module docstring): ``kind`` "final", "best" or "last" (with ``n``)."""

    kind: str = "final"
    n: int = 1

    @classmethod
    def parse(cls, text: str) -> Selection:
        """``final``, ``best`` or ``last:N`` (N >= 1); anything else is a ``ConfigError`` naming ``--select``."""
        if text in ("final", "best"):
            return cls(text)
        m = _LAST.fullmatch(text)
        if m is None:
            raise ConfigError(f"--select {text}: unknown selection protocol; choose final, best or last:N "
                              "(N >= 1: the mean of each run's last N evaluations)")
        return cls("last", int(m.group(1)))

    def __str__(self) -> str:
        return f"last:{self.n}" if self.kind == "last" else self.kind

    @property
    def column(self) -> str:
        """The comparison table's column that holds this protocol's values."""
        return f"last {self.n}" if self.kind == "last" else self.kind

    def uses_best(self, key: str, higher_is_better: bool | None) -> bool:
        """Whether this protocol takes ``key``'s best round (``best``, for a metric that has one)."""
        return self.kind == "best" and _best_direction(key, higher_is_better) is not None

    def value(self, series: _Series, key: str, higher_is_better: bool | None) -> float:
        """The run's value of ``key`` under this protocol (``series``: its evaluations)."""
        if self.uses_best(key, higher_is_better):
            return series.best(higher_is_better)[0]  # type: ignore[return-value]
        if self.kind == "last":
            return float(np.mean(series.values[-self.n:]))
        return series.final()[0]

    def label(self, key: str, higher_is_better: bool | None) -> str:
        """What the value of ``key`` is, in words: "final", "best round, selected on the test set", ..."""
        if self.kind == "last":
            return f"mean of last {self.n} evaluations"
        if self.kind == "best":
            if not self.uses_best(key, higher_is_better):
                return "final (no best for this metric)"
            split = "validation" if key.split("/", 1)[0] == "val" else "test"
            return f"best round, selected on the {split} set"
        return "final"

    def check(self, runs: Sequence[_Run], metrics: Sequence[str]) -> None:
        """A ``ConfigError`` naming ``--select``, the run and its count when ``last:N`` meets a run with fewer
        than N evaluations of one of ``metrics`` (among those it logged)."""
        if self.kind != "last":
            return
        for r in runs:
            for m in metrics:
                if m in r.series and len(r.series[m].values) < self.n:
                    have = len(r.series[m].values)
                    raise ConfigError(f"--select last:{self.n}: run {r.path} has {have} evaluation"
                                      f"{'s' if have != 1 else ''} of {m}, fewer than {self.n}")
