"""What every ``fedsight`` command shares for talking to the terminal: the output and error consoles, one-line
errors, plain text that is never read as markup, the output-path guard, the progress display and finding run
directories. The commands' modules (``cli``, ``evaluate_cli``, ``pretrain_cli``, ``start_cli``,
``calibrate_cli``) import it, so none of them imports another; tests replace ``console`` here."""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

console = Console()
err_console = Console(stderr=True)

#: set to show the traceback behind an error's one-line summary
DEBUG_ENV = "FEDSIGHT_DEBUG"


def fail(msg: str, code: int = 2) -> None:
    """``msg`` as one line on stderr (never read as markup: paths may hold ``[..]``), then exit ``code``. Called
    while an exception is being handled and with ``FEDSIGHT_DEBUG`` set, the exception's traceback comes first
    (the one error boundary, ``cli.main``, does the same for the errors no command catches)."""
    if os.environ.get(DEBUG_ENV) and sys.exc_info()[0] is not None:
        traceback.print_exc()
    err_console.print(f"[bold red]error:[/] {escape(msg)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def say(text: str) -> None:
    """A line of plain text (paths, names, values from the user): never read as rich markup (``runs/exp[bold]``
    stays as written), never highlighted, never wrapped into two lines."""
    console.print(escape(text), highlight=False, soft_wrap=True)


def guard(check: Any, *args: Any, **kwargs: Any) -> Path:
    """``check(*args, **kwargs)`` of ``fedsight.safe_write`` (the one output-path guard); a path it refuses is one
    line naming it and why, exit 2, before anything is written."""
    from .errors import OutputPathError

    try:
        return check(*args, **kwargs)
    except OutputPathError as exc:
        fail(str(exc))
        raise  # unreachable: fail exits


def progress():
    """The progress display (``fedsight.live``): two lines a run, readable at 80 columns."""
    from .live import make_progress

    return make_progress(console)


def find_runs(paths: list[Path]) -> list[Path]:
    """The run directories ``paths`` name or hold (searched for ``config.json``); none is one line, exit 1."""
    found: list[Path] = []
    for p in paths:
        if (p / "config.json").is_file():
            found.append(p)
        elif p.is_dir():
            found.extend(sorted(c.parent for c in p.rglob("config.json")))
        else:
            fail(f"{p}: not a run directory or a folder of runs", 1)
    if not found:
        fail(f"no run directories under {', '.join(map(str, paths))}", 1)
    return found
