"""Run directories as reports see them: numeric series per metric, metric directions, groups of runs."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from ..metrics import MetricSpec, direction
from ..runs import read_config, read_metrics, read_run_meta

StrPath = str | os.PathLike[str]

_RESERVED = ("round", "stage", "event")
_EVAL_PREFIXES = ("test", "val", "local")
_PREFIX_RANK = {"test": 0, "val": 1, "local": 2, "train": 4, "time": 5}


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class _Series:
    rounds: np.ndarray  # int, strictly increasing
    values: np.ndarray  # float

    def final(self) -> tuple[float, int]:
        return float(self.values[-1]), int(self.rounds[-1])

    def best(self, higher_is_better: bool | None) -> tuple[float | None, int | None]:
        """Best value (max if higher is better, min if lower) and the first round it was reached, NaNs
        ignored; ``(None, None)`` for a metric with no direction."""
        if higher_is_better is None:
            return None, None
        vals = self.values
        if np.all(np.isnan(vals)):
            return float("nan"), int(self.rounds[-1])
        i = int(np.nanargmax(vals) if higher_is_better else np.nanargmin(vals))
        return float(vals[i]), int(self.rounds[i])


# -- metric directions ------------------------------------------------------------------------------


def _specs_from_table(table: dict[str, Any]) -> tuple[MetricSpec, ...]:
    """``{"key" or "prefix/*": true | false | null}`` as specs; anything but a bool means no direction."""
    return tuple(MetricSpec(str(k), v if isinstance(v, bool) else None) for k, v in table.items())


def _config_directions(config: dict[str, Any]) -> tuple[dict[str, bool | None], str | None]:
    """The direction table and primary metric a run of ``config`` would record in ``run.json``, for runs
    written before that file existed; no directions and no primary when the config does not validate
    under the components registered now."""
    from ..config import validate
    from ..metric_table import metric_directions

    try:
        return metric_directions(validate(config))
    except (ValueError, TypeError, KeyError, LookupError):  # ConfigError is a ValueError
        return {}, None


def run_directions(run_dir: StrPath, config: dict[str, Any] | None = None) -> tuple[tuple[MetricSpec, ...], str | None]:
    """(direction specs, primary metric key) of a run: from ``RUN_DIR/run.json``, else rebuilt from its
    config (see ``_config_directions``)."""
    meta = read_run_meta(run_dir)
    if meta is not None:
        primary = meta.get("primary")
        return _specs_from_table(meta.get("metrics", {})), primary if isinstance(primary, str) else None
    table, primary = _config_directions(read_config(run_dir) if config is None else config)
    return _specs_from_table(table), primary


# -- one run ----------------------------------------------------------------------------------------


@dataclass
class _Run:
    """One run directory, read once: its config, metric lines, metric directions and primary metric."""

    path: Path
    config: dict[str, Any]
    records: list[dict[str, Any]]
    specs: tuple[MetricSpec, ...] = ()
    primary: str | None = None

    @classmethod
    def load(cls, run_dir: StrPath) -> _Run:
        config = read_config(run_dir)
        records = read_metrics(run_dir)
        specs, primary = run_directions(run_dir, config)
        return cls(Path(run_dir), config, records, specs, primary)

    def direction(self, key: str) -> bool | None:
        """True if higher values of ``key`` are better, False if lower, None if it has no direction."""
        return direction(self.specs, key)

    @property
    def name(self) -> str:
        run = self.config.get("run")
        name = run.get("name") if isinstance(run, dict) else None
        return str(name) if name else self.path.name

    @property
    def seed(self) -> int | None:
        seed = self.config.get("seed")
        return seed if isinstance(seed, int) else None

    @cached_property
    def metric_records(self) -> list[dict[str, Any]]:
        return [r for r in self.records if "event" not in r]

    @cached_property
    def series(self) -> dict[str, _Series]:
        """Numeric key -> series over rounds, keys in order of first appearance; last line wins."""
        by_key: dict[str, dict[int, float]] = {}
        for rec in self.metric_records:
            rnd = rec["round"]
            for k, v in rec.items():
                if k in _RESERVED or not _is_number(v):
                    continue
                by_key.setdefault(k, {})[rnd] = float(v)
        out = {}
        for k, d in by_key.items():
            rounds = np.array(sorted(d), dtype=np.int64)
            out[k] = _Series(rounds, np.array([d[r] for r in rounds], dtype=np.float64))
        return out

    @property
    def n_rounds(self) -> int:
        return max((r["round"] for r in self.metric_records), default=0)

    @property
    def stages(self) -> list[tuple[str, int]]:
        """(stage, first round) for each change of stage, in round order."""
        first: dict[int, str] = {}
        for rec in self.metric_records:
            first.setdefault(rec["round"], str(rec.get("stage", "")))
        out: list[tuple[str, int]] = []
        for rnd in sorted(first):
            if not out or out[-1][0] != first[rnd]:
                out.append((first[rnd], rnd))
        return out


def _load_all(run_dirs: Iterable[StrPath]) -> list[_Run]:
    runs = [_Run.load(d) for d in run_dirs]
    if not runs:
        raise ValueError("no run directories given")
    return runs


def _prefix(key: str) -> str:
    """A metric key's split prefix; a task's extra test sets (``test_unseen/miou``) count as ``test``."""
    head = key.split("/", 1)[0] if "/" in key else ""
    return "test" if head.startswith("test_") else head


def _is_eval(key: str) -> bool:
    return _prefix(key) in _EVAL_PREFIXES


def _is_headline(key: str) -> bool:
    """Not a member of a per-class family (``test/iou/road``): what default tables and curves show."""
    return key.count("/") <= 1


def _display_order(keys: Iterable[str]) -> list[str]:
    """Evaluation metrics first (test and extra test sets, val, local, others), then train, then time;
    stable otherwise."""
    keys = list(keys)
    return sorted(keys, key=lambda k: (_PREFIX_RANK.get(_prefix(k), 3), keys.index(k)))


# -- several runs -----------------------------------------------------------------------------------


def _shared_direction(runs: Sequence[_Run], key: str) -> bool | None:
    """The direction of ``key`` that the runs which logged it (all runs if none did) agree on; None when
    they disagree or none gives it one."""
    voters = [r for r in runs if key in r.series] or list(runs)
    found = {r.direction(key) for r in voters}
    return found.pop() if len(found) == 1 else None


def _primary(runs: Sequence[_Run]) -> str | None:
    """The first run's primary metric (runs that disagree defer to the first)."""
    return runs[0].primary if runs else None


def _canonical(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _canonical(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_canonical(x) for x in v]
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


def _experiment_key(config: dict[str, Any]) -> str:
    """What identifies an experiment: the config without "seed", "run" and "engine" (where and with how
    many threads a run computed does not change what it computes)."""
    exp = {k: v for k, v in config.items() if k not in ("seed", "run", "engine")}
    return json.dumps(_canonical(exp), sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class RunGroup:
    """Runs of one experiment: configs equal apart from top-level "seed", "run" and "engine".

    ``label`` is the ``run.name`` of the first run (plus ``[hash]`` of the config when two groups share
    a name); ``run_dirs`` and ``seeds`` are in the order the runs were given.
    """

    label: str
    run_dirs: tuple[Path, ...]
    seeds: tuple[int | None, ...]
    config: dict[str, Any] = field(compare=False, repr=False)


def _group(runs: Sequence[_Run]) -> list[tuple[RunGroup, list[_Run]]]:
    by_key: dict[str, list[_Run]] = {}
    for r in runs:
        by_key.setdefault(_experiment_key(r.config), []).append(r)
    names = [members[0].name for members in by_key.values()]
    out = []
    for (key, members), name in zip(by_key.items(), names):
        label = name
        if names.count(name) > 1:
            label = f"{name} [{hashlib.sha1(key.encode()).hexdigest()[:6]}]"
        config = {k: v for k, v in members[0].config.items() if k not in ("seed", "run")}
        group = RunGroup(label, tuple(r.path for r in members), tuple(r.seed for r in members), config)
        out.append((group, members))
    return out


def group_runs(run_dirs: Iterable[StrPath]) -> list[RunGroup]:
    """Group run directories by config minus top-level "seed", "run" and "engine", in order of first appearance."""
    return [g for g, _ in _group(_load_all(run_dirs))]
