"""Run directories as reports see them: numeric series per metric, metric directions, groups of runs."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from ..metrics import MetricSpec, direction
from ..runs import read_config, read_metrics, read_run_meta
from ..safe_read import MAX_JSON_BYTES, read_json

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
    return _directions(read_run_meta(run_dir), read_config(run_dir) if config is None else config)


def _directions(meta: dict[str, Any] | None, config: dict[str, Any]) -> tuple[tuple[MetricSpec, ...], str | None]:
    """``run_directions`` from an already read ``run.json`` (None: absent) and config."""
    if meta is not None:
        primary = meta.get("primary")
        return _specs_from_table(meta.get("metrics", {})), primary if isinstance(primary, str) else None
    table, primary = _config_directions(config)
    return _specs_from_table(table), primary


def _backends(meta: dict[str, Any] | None) -> str | None:
    """Where a run's clients trained, from its ``run.json`` sessions ("in-process", "flower"; several
    joined by "+" for a run resumed elsewhere); None when no session records it."""
    sessions = meta.get("sessions", []) if meta is not None else []
    found = [s["backend"] for s in sessions if isinstance(s, dict) and isinstance(s.get("backend"), str)]
    return "+".join(dict.fromkeys(found)) or None


#: a sweep's grid point at the end of a run name: ``fedavg[alpha=0.1]``, ``base[alpha=0.1,mu=0.01]``
#: (the sweep expansion names grid-point runs ``f"{name}[{label}]"``; grid values never hold ``[]=,``)
_GRID_LABEL = re.compile(r"\[([^\[\]=,]+=[^\[\]=,]*(?:,[^\[\]=,]+=[^\[\]=,]*)*)\]$")


def grid_point(run_name: str) -> str | None:
    """The grid-point label of a swept run's name (``"alpha=0.1"`` for ``"fedavg[alpha=0.1]"``); None for a
    name without one."""
    m = _GRID_LABEL.search(run_name)
    return m.group(1) if m else None


# -- one run ----------------------------------------------------------------------------------------


@dataclass
class _Run:
    """One run directory, read once: its config, metric lines, metric directions and primary metric."""

    path: Path
    config: dict[str, Any]
    records: list[dict[str, Any]]
    specs: tuple[MetricSpec, ...] = ()
    primary: str | None = None
    #: where its clients trained, from ``run.json`` (see ``_backends``)
    backend: str | None = None
    #: ``run.json``'s sessions: what produced the run (command, commit, versions, machine), one per start
    sessions: tuple[dict[str, Any], ...] = ()

    @classmethod
    def load(cls, run_dir: StrPath) -> _Run:
        config = read_config(run_dir)
        records = read_metrics(run_dir)
        meta = read_run_meta(run_dir)
        specs, primary = _directions(meta, config)
        sessions = tuple(x for x in (meta or {}).get("sessions", []) if isinstance(x, dict))
        return cls(Path(run_dir), config, records, specs, primary, _backends(meta), sessions)

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


def _best_direction(key: str, higher_is_better: bool | None) -> bool | None:
    """The direction to take ``key``'s best value in: None (no best) for a metric without a direction and for
    a budget metric (bytes, FLOPs, seconds, epsilon: ``fedsight.metric_table.is_budget``), whose "best" would
    be its first round; else ``higher_is_better``."""
    from ..metric_table import is_budget

    return None if higher_is_better is None or is_budget(key) else higher_is_better


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


def _experiment_key(config: dict[str, Any], treatment: dict[str, Any] | None = None) -> str:
    """What identifies an experiment: the config without "seed", "run" and "engine" (where and with how
    many threads a run computed does not change what it computes), and the run's ``treatment`` outside the
    config (Flower's central-DP options: ``_flower_treatment``)."""
    exp = {k: v for k, v in config.items() if k not in ("seed", "run", "engine")}
    if treatment:
        exp["flower"] = treatment
    return json.dumps(_canonical(exp), sort_keys=True, separators=(",", ":"))


def _flower_treatment(run_dir: Path) -> dict[str, Any]:
    """The options of a Flower run that change its results and live in ``flower.json``, not in the config:
    the central-DP settings (a DP run and a plain run of one config are not replicates)."""
    try:
        options = read_json(run_dir / "flower.json", "", MAX_JSON_BYTES).get("options", {})
    except (OSError, ValueError, AttributeError):
        return {}
    if not isinstance(options, dict) or not options.get("dp_noise_multiplier"):
        return {}
    return {k: v for k, v in sorted(options.items()) if k.startswith("dp_")}


@dataclass(frozen=True)
class RunGroup:
    """Replicates of one experiment: runs whose configs are equal apart from top-level "seed", "run" and
    "engine", with distinct seeds.

    Runs of one config that share a seed (the same run on another backend, or run twice) are not
    replicates: they are split into sets of distinct seeds, by backend (``run.json``), then by parent
    directory, then one run each; ``split_note`` then says what tells this group apart ("in-process",
    "flower, runs/ray/A") and ``label`` ends with it in parentheses. ``label`` starts with the
    ``run.name`` of the first run; experiments that share a name add what differs in their configs
    (``fedavg (server.rounds=3)``), or a ``[hash]`` of the config when that is too long (``_distinct_names``);
    ``run_dirs``, ``seeds`` and ``backends`` are in the order the runs were given; ``grid_point`` is the
    sweep grid point of the first run's name (``grid_point``), if any.
    """

    label: str
    run_dirs: tuple[Path, ...]
    seeds: tuple[int | None, ...]
    config: dict[str, Any] = field(compare=False, repr=False)
    backends: tuple[str | None, ...] = ()
    grid_point: str | None = None
    split_note: str = ""
    #: its runs whose last logged round is before the config's ``server.rounds`` (still running, stopped or
    #: interrupted), as "seed 4 at round 15 of 20": their final value is that round's
    unfinished: tuple[str, ...] = ()


def _unfinished(run: _Run) -> str | None:
    """"seed S at round r of R" for a run whose metric lines end before its config's ``server.rounds``."""
    server = run.config.get("server")
    planned = server.get("rounds") if isinstance(server, dict) else None
    rounds = [r["round"] for r in run.records if "event" not in r and isinstance(r.get("round"), int)]
    done = max(rounds, default=0)
    if not isinstance(planned, int) or done >= planned:
        return None
    return f"{'seed ' + str(run.seed) if run.seed is not None else run.path.name} at round {done} of {planned}"


def _repeats_a_seed(runs: Sequence[_Run]) -> bool:
    """Whether two of ``runs`` have the same seed (two runs without a seed count as the same)."""
    seeds = [r.seed for r in runs]
    return len(set(seeds)) != len(seeds)


def _shown_relative(paths: Sequence[Path]) -> dict[Path, str]:
    """Each (absolute) path relative to the parent of their common path: short, never ".", and distinct
    for distinct paths."""
    try:
        base = Path(os.path.commonpath([str(p) for p in paths])).parent
        return {p: p.relative_to(base).as_posix() for p in paths}
    except ValueError:  # paths on different drives
        return {p: p.as_posix() for p in paths}


def _replicate_sets(members: list[_Run]) -> list[tuple[str, list[_Run]]]:
    """Split one experiment's runs into sets without a repeated seed, each with the text that tells it
    apart ("" when the runs needed no split): by backend, then by parent directory, then one run each."""
    if not _repeats_a_seed(members):
        return [("", members)]
    absolute = {id(r): r.path.absolute() for r in members}
    shown = _shown_relative(list({p: None for r in members for p in (absolute[id(r)], absolute[id(r)].parent)}))
    by_backend: dict[str, list[_Run]] = {}
    for r in members:
        by_backend.setdefault(r.backend or "backend not recorded", []).append(r)
    out: list[tuple[str, list[_Run]]] = []
    for backend, runs in by_backend.items():
        if not _repeats_a_seed(runs):
            out.append((backend, runs))
            continue
        by_parent: dict[Path, list[_Run]] = {}
        for r in runs:
            by_parent.setdefault(absolute[id(r)].parent, []).append(r)
        for parent, sub in by_parent.items():
            if not _repeats_a_seed(sub):
                out.append((f"{backend}, {shown[parent]}", sub))
            else:
                out.extend((f"{backend}, {shown[absolute[id(r)]]}", [r]) for r in sub)
    return out


#: the longest "(key=value, ...)" that tells apart experiments sharing a run name; longer: a hash of the config
MAX_DIFFERENCE_CHARS = 48
#: where the differing keys are too many to list, the first of these that tell the experiments apart
_IDENTITY_KEYS = ("task.name", "data.name", "model.name", "partition.name")


def _flat(tree: Any, prefix: str = "") -> dict[str, str]:
    """A config as dotted keys -> compact JSON values (``{"server.rounds": "3"}``); lists are one value."""
    if isinstance(tree, dict) and tree:
        out: dict[str, str] = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: json.dumps(tree, separators=(",", ":")).strip('"')}


def _difference_texts(keys: Sequence[str]) -> list[str] | None:
    """For experiments (``_experiment_key``s) that share a run name: each one's values of the config keys
    where they differ, ``"server.rounds=3, train.lr=0.1"`` (a key one of them lacks: ``key=unset``); when
    that list is too long, the first identity keys (task, data, model, partition) that tell them apart; None
    when neither fits in ``MAX_DIFFERENCE_CHARS`` or tells them apart."""
    flats = [_flat(json.loads(k)) for k in keys]
    every = list(dict.fromkeys(k for f in flats for k in f))
    differ = [k for k in every if len({f.get(k) for f in flats}) > 1]
    candidates = [differ]
    for n in range(1, len(_IDENTITY_KEYS) + 1):
        candidates.append([k for k in _IDENTITY_KEYS[:n] if k in differ])
    for chosen in candidates:
        texts = [", ".join(f"{k}={f.get(k, 'unset')}" for k in chosen) for f in flats]
        if chosen and len(set(texts)) == len(texts) and max(map(len, texts)) <= MAX_DIFFERENCE_CHARS:
            return texts
    return None


def _distinct_names(names: Sequence[str], keys: Sequence[str]) -> list[str]:
    """Each experiment's label: its run name, and where several experiments share one, what differs in
    their configs in parentheses (``fedavg (server.rounds=3)``, ``_difference_texts``), else the first 6 hex
    digits of the sha1 of its config in brackets (``fedavg [b74bf6]``)."""
    out = list(names)
    for name in dict.fromkeys(names):
        idx = [i for i, n in enumerate(names) if n == name]
        if len(idx) < 2:
            continue
        texts = _difference_texts([keys[i] for i in idx])
        for j, i in enumerate(idx):
            out[i] = (f"{name} ({texts[j]})" if texts is not None
                      else f"{name} [{hashlib.sha1(keys[i].encode()).hexdigest()[:6]}]")
    return out


def _group(runs: Sequence[_Run]) -> list[tuple[RunGroup, list[_Run]]]:
    """Groups of replicates (see ``RunGroup``) in order of first appearance, each with its runs."""
    by_key: dict[str, list[_Run]] = {}
    for r in runs:
        by_key.setdefault(_experiment_key(r.config, _flower_treatment(r.path)), []).append(r)
    names = [members[0].name for members in by_key.values()]
    bases = _distinct_names(names, list(by_key))
    out = []
    for (key, members), base in zip(by_key.items(), bases):
        config = {k: v for k, v in members[0].config.items() if k not in ("seed", "run")}
        for note, sub in _replicate_sets(members):
            group = RunGroup(f"{base} ({note})" if note else base, tuple(r.path for r in sub),
                             tuple(r.seed for r in sub), config, tuple(r.backend for r in sub),
                             grid_point(sub[0].name), note, tuple(u for r in sub if (u := _unfinished(r))))
            out.append((group, sub))
    labels = [g.label for g, _ in out]
    if len(set(labels)) < len(labels):  # a run named like another's label with its suffix: number them
        seen: dict[str, int] = {}
        for i, (g, sub) in enumerate(out):
            seen[g.label] = seen.get(g.label, 0) + 1
            if labels.count(g.label) > 1:
                out[i] = (dataclasses.replace(g, label=f"{g.label} #{seen[g.label]}"), sub)
    return out


def group_runs(run_dirs: Iterable[StrPath]) -> list[RunGroup]:
    """Group run directories into replicates (config minus top-level "seed", "run" and "engine", seeds
    distinct; see ``RunGroup``), in order of first appearance."""
    return [g for g, _ in _group(_load_all(run_dirs))]
