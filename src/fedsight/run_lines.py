"""What ``fedsight run`` and ``fedsight resume`` say besides their progress: the command that continues a stopped or
interrupted run, the line an interrupted run ends with, the ``--device`` override, and the end of a resumed run
(the same table and paths ``fedsight run`` ends with, not ``summary.md``'s Markdown source).

Kept out of ``fedsight.cli`` so the command functions stay a page each."""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .errors import ConfigError


def device_override(device: str) -> str:
    """``run --device DEVICE`` as the ``--set`` it stands for (``engine.device=DEVICE``), the value checked as
    ``engine.device`` is: a bad one is a ConfigError naming ``--device`` (not a ``--set`` the user never wrote).
    The same semantics as ``resume --device``: it replaces the config's ``engine.device`` for every run of the
    sweep, and a run directory made on another device resumes on this one (``[engine]`` is not part of a run's
    identity)."""
    from pydantic import ValidationError

    from .config import EngineSection

    try:
        EngineSection(device=device)
    except ValidationError as exc:
        msg = exc.errors()[0]["msg"].removeprefix("Value error, ")
        raise ConfigError(f"--device {device!r}: {msg}") from None
    return f"engine.device={json.dumps(device.strip())}"


def again_command(config: Path, sets: Sequence[str], variants: Sequence[str], device: str | None) -> str:
    """The ``fedsight run`` command line that continues this one (re-running a config resumes its unfinished
    runs and skips finished ones), shell-quoted."""
    return shlex.join(["fedsight", "run", str(config), *(f"--set={s}" for s in sets),
                       *(f"--variant={v}" for v in variants), *([f"--device={device}"] if device else [])])


def resume_command(run_dir: Path, device: str | None) -> str:
    return shlex.join(["fedsight", "resume", str(run_dir), *([f"--device={device}"] if device else [])])


def _status(run_dir: Path) -> dict[str, Any]:
    try:
        status = json.loads((Path(run_dir) / "status.json").read_text())
    except (OSError, ValueError):
        return {}
    return status if isinstance(status, dict) else {}


def interrupted_lines(run_dirs: Sequence[Path], again: str | None, device: str | None = None) -> list[str]:
    """What an interrupted ``fedsight run`` (``again``: the command that continues it) or ``fedsight resume``
    (``again`` None) prints last: for each of ``run_dirs`` whose ``status.json`` says interrupted, the round it
    stopped at (its last checkpointed round) and how to resume it; for a sweep, also the command that
    continues the whole sweep. Interrupted before any run started: how to start again."""
    stopped = [(d, s) for d in run_dirs if (s := _status(d)).get("state") == "interrupted"]
    if not stopped:
        return [f"interrupted before the first round; start again with: {again}" if again
                else "interrupted before the first round"]
    lines = [f"interrupted at round {s.get('round', 0)} of {s.get('rounds', '?')} ({d}); resume with: "
             f"{resume_command(d, device)}" for d, s in stopped]
    if again is not None and len(run_dirs) > 1:
        lines.append(f"or continue the whole sweep (finished runs are skipped) with: {again}")
    return lines


def finished(run_dir: Path) -> tuple[Any, list[str]]:
    """A completed run as ``fedsight run`` ends one: its comparison table (``fedsight.reporting.compare``: the
    final and best value of each evaluation metric, in the terminal's width) and the lines naming its files
    (the summary, the curves when the run drew them). Nothing is written: a resumed member of a sweep must not
    replace the sweep's report with a report of one run."""
    from .reporting.compare import compare

    run_dir = Path(run_dir)
    table = compare([run_dir])
    curves = run_dir / "plots" / "curves.png"
    files = f"summary: {run_dir / 'summary.md'}" + (f"  curves: {curves}" if curves.is_file() else "")
    return table, [f"run: {run_dir}", files]


def complete_variants(ctx: Any, incomplete: str) -> list[str]:
    """Shell completion of ``--variant``: the ``[[variants]]`` names of the config already on the command line
    (none when it is not there yet or does not read: completion never prints an error)."""
    from .safe_read import read_toml

    # while --variant waits for its value, click's resilient parse leaves the config among the unparsed args
    found = [p for p in [ctx.params.get("config"), *getattr(ctx, "args", [])] if p is not None and Path(p).is_file()]
    try:
        raw = read_toml(found[0]) if found else {}
    except Exception:  # noqa: BLE001 - a half-typed path, a file being edited: nothing to offer
        return []
    variants = raw.get("variants") if isinstance(raw.get("variants"), list) else []
    names = [v.get("name") for v in variants if isinstance(v, dict) and isinstance(v.get("name"), str)]
    return [n for n in names if n.startswith(incomplete)]
