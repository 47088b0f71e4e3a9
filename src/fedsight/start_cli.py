"""``fedsight init`` and ``fedsight schema``: where a new config starts (``fedsight.init_config``) and what a TOML
editor checks it against (``fedsight.schema``). Registered by ``fedsight.cli``; errors go through its one-line
``_fail`` (imported when a command runs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from .errors import ConfigError, OutputPathError


def _tasks(incomplete: str) -> list[str]:
    from .init_config import tasks

    return [t for t in tasks() if t.startswith(incomplete)]


def init(
    task: Annotated[str, typer.Argument(help="classification, segmentation, image_sr, video_sr or keypoints.",
                                        autocompletion=_tasks)],
    out: Annotated[Optional[Path], typer.Option(help="Where to write it (default: TASK.toml here); never "
                                                     "replaced.")] = None,
) -> None:
    """Write a commented starting config for TASK that runs as written (small built-in data, a compact model).

    Each key's comment is its description from the config model; each section's other keys follow, commented
    out at their defaults. Try it with `fedsight run FILE --smoke`.
    """
    from . import cli_common as C
    from .init_config import write
    from .safe_write import check_output

    path = out if out is not None else Path(f"{task}.toml")
    try:
        if not (path.exists() or path.is_symlink()):
            check_output(path, "--out" if out is not None else "")  # inside a run directory, a parent that is a file
        write(task, path)
    except (ConfigError, OutputPathError) as exc:
        C.fail(str(exc))
    C.say(f"wrote {path}; try it with: fedsight run {path} --smoke")


def schema(
    out: Annotated[Optional[Path], typer.Option(help="Write the schema here (default: print it).")] = None,
    force: Annotated[bool, typer.Option(help="Replace an existing --out file.")] = False,
) -> None:
    """Export the config's JSON Schema for TOML editors (Taplo, Even Better TOML): every section and every
    registered component's parameters, with their descriptions.

    Use it with `#:schema ./fedsight.schema.json` as a config's first line. Checks across keys stay with
    `fedsight run` (docs/cli.md says what the schema does not cover).
    """
    from . import cli_common as C
    from .safe_write import check_output
    from .schema import config_schema, write

    if out is None:
        C.console.out(json.dumps(config_schema(), indent=1), highlight=False)
        return
    try:
        check_output(out, "--out", force=force)
        write(out)
    except OutputPathError as exc:
        C.fail(str(exc))
    C.say(f"wrote {out}; first line of a config for editors: #:schema ./{out.name}")
