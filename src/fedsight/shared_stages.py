"""``[sweep] share_stages = true``: the runs of a sweep that begin with the same stages train them once.

An ablation of a staged recipe often varies only its last stage (LADD's Table 5.13: every row pre-trains on the
source the same way, then adapts differently); each run would train the shared stages again, for the same
numbers. With ``share_stages`` the first run of the sweep (in ``fedsight run``'s order) that has a prefix of
stages trains it and stops at its last round R (``stop_after``); every later run with the same seed and the same
prefix starts from a copy of that run directory, as if it had been stopped at round R itself, and resumes from
there (``api.execute``): resume is bit-identical (docs/guarantees.md), so each run ends with the numbers it would
have had on its own (``tests/test_shared_stages.py`` compares them bit for bit). The copy's ``metrics.jsonl``
says where its first R rounds came from (a ``stages_shared`` event naming the run directory), its ``run.json``
keeps that run's sessions before its own.

Two runs share their first j stages when these are equal (``prefix_keys``): the seed; the resolved config without
``run`` (names and paths), ``stages``, ``recipe`` and ``train``, which covers everything read for the whole run
(task, data, partition, model, the schedule's ``server`` and ``eval`` settings, ``server.rounds``, engine,
privacy, initial weights); and each of the first j stages' effective configs (the base deep-merged with the
stage's table, ``config.stage_configs``), which covers the recipe and local training each of those stages runs.
A difference in a later stage, or in the top-level recipe where every shared stage sets its own, does not count.

Not shared: a run directory that exists already (it resumes or is skipped as always); a prefix whose first run
has gone past its last round (its checkpoint at R is gone: the later runs train the stages themselves); runs that
keep secrets (client keys from the OS's CSPRNG, the server's central-DP secret), which a copy would share between
runs meant to be independent. ``--overwrite`` and ``--stop-after`` turn sharing off for the command, and so does
the distributed backend.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .build import resolved, toml_safe
from .config import stage_configs
from .runs import RunDir, read_status

#: top-level sections that each stage's effective config carries (compared stage by stage instead)
_PER_STAGE = ("run", "stages", "recipe", "train")
#: what a copy leaves out: half-written files, and what the run draws again at its end (a run's lock is a sibling
#: file, ``run_lock``, never inside it)
_NOT_COPIED = ("*.tmp", "plots", "tensorboard", "mlflow", "mlflow.json", "summary.md")


def prefix_keys(cfg: Any) -> list[str]:
    """What the first j stages of ``cfg``'s run depend on, as canonical JSON, for j = 1 .. all but the last stage
    (see the module docstring)."""
    top = {k: v for k, v in resolved(cfg).items() if k not in _PER_STAGE}
    per_stage = [{"name": name, "rounds": rounds,
                  "config": {k: v for k, v in resolved(scfg).items() if k not in ("run", "stages")}}
                 for name, rounds, scfg in stage_configs(cfg)[:-1]]
    return [json.dumps({"top": top, "stages": per_stage[:j]}, sort_keys=True, default=str)
            for j in range(1, len(per_stage) + 1)]


@dataclass(frozen=True)
class Share:
    """Run ``follower`` (an index into the sweep's runs) starts from run ``donor`` stopped at ``round``, the end
    of their ``stages`` shared stages."""

    follower: int
    donor: int
    round: int
    stages: int


def plan(configs: Sequence[Any]) -> list[Share]:
    """For each run with an earlier run sharing a prefix of its stages (never all of them), the longest such
    prefix and the first run that has it; in the runs' order."""
    first: dict[str, int] = {}
    out = []
    for i, cfg in enumerate(configs):
        stages = stage_configs(cfg)
        ends = [sum(r for _, r, _ in stages[:j]) for j in range(1, len(stages))]
        keys = prefix_keys(cfg)
        for j in range(len(keys), 0, -1):
            if keys[j - 1] in first:
                out.append(Share(i, first[keys[j - 1]], ends[j - 1], j))
                break
        for key in keys:
            first.setdefault(key, i)
    return out


def _keeps_secrets(run_dir: Path) -> bool:
    return any(p.is_dir() and any(p.iterdir()) for p in (run_dir / "client_state" / "secret", run_dir / "private"))


def _copy(donor: Path, follower: Path, cfg: Any, r: int) -> None:
    """``donor`` (stopped at round ``r``) as ``follower``'s run directory, with ``cfg``'s config and an event
    saying where its first rounds came from; written next to it and renamed into place, so that a kill leaves no
    half-copied run."""
    import tomli_w

    tmp = follower.with_name(f".{follower.name}.sharing")
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(donor, tmp, ignore=shutil.ignore_patterns(*_NOT_COPIED))
    res = resolved(cfg)
    (tmp / "config.toml").write_text(tomli_w.dumps(toml_safe(res)))
    (tmp / "config.json").write_text(json.dumps(res, indent=2, sort_keys=True) + "\n")
    stage = json.loads((tmp / "metrics.jsonl").read_text().splitlines()[-1]).get("stage")
    with open(tmp / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"event": "stages_shared", "round": r, "stage": stage, "from": os.path.abspath(donor)}) + "\n")
    follower.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, follower)


def prepare(configs: Sequence[Any], run_dirs: Sequence[Path], execute: Callable[..., Any],
            say: Callable[[str], None]) -> list[int]:
    """Bring each shared prefix's first run to the prefix's last round and copy it to the later runs whose
    directories do not exist yet (``plan``); ``execute(i, stop_after)`` runs run i (to resume later). Returns the
    runs that start from a copy. Donors are brought forward in the runs' order, each through its prefixes from
    the shortest, so that a run that is both a copy and a donor is copied first."""
    shares = [s for s in plan(configs) if not os.path.lexists(run_dirs[s.follower])]
    copied = []
    for donor in sorted({s.donor for s in shares}):
        for r in sorted({s.round for s in shares if s.donor == donor}):
            followers = [s.follower for s in shares if s.donor == donor and s.round == r]
            run = RunDir(run_dirs[donor])
            if (read_status(run.path).get("round", 0) if run.exists() else 0) < r:
                execute(donor, r)
            if read_status(run.path).get("round", 0) != r or not run.checkpoints():
                say(f"share_stages: {run_dirs[donor]} is past round {r} already; "
                    f"{len(followers)} run(s) train their first {r} rounds themselves")
                continue
            if _keeps_secrets(run_dirs[donor]):
                say(f"share_stages: {run_dirs[donor]} keeps secrets (keys, DP noise) that a copy would share; "
                    f"{len(followers)} run(s) train their first {r} rounds themselves")
                continue
            for f in followers:
                _copy(run_dirs[donor], run_dirs[f], configs[f], r)
                copied.append(f)
    return copied


def share(specs: Sequence[Any], execute: Callable[..., Any], say: Callable[[str], None], *, overwrite: bool = False,
          stop_after: int | None = None) -> list[int]:
    """``prepare`` for a sweep's runs (``sweep.RunSpec``) when ``[sweep] share_stages`` is on and nothing turns it
    off (``--overwrite``, ``--stop-after``, the distributed backend: said in one line); the runs that start from
    a copy."""
    if not any(s.share_stages for s in specs):
        return []
    from .distributed.world import current

    why = ("--overwrite" if overwrite else "--stop-after" if stop_after is not None else
           "the distributed backend" if current() is not None else None)
    if why:
        say(f"share_stages: off with {why}; every run trains all its stages")
        return []
    copied = prepare([s.config for s in specs], [s.run_dir for s in specs], execute, say)
    if copied:
        say(f"share_stages: {len(copied)} run(s) start from a copy of an earlier run's shared stages")
    return copied
