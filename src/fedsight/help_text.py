"""Help text of the command line: Typer joins the lines of a command's first help paragraph only and keeps the
others' line breaks, which ``--help`` then wraps again into ragged lines; ``reflow_help`` joins them for every
command (the docstrings stay as written)."""

from __future__ import annotations

import inspect

import typer


def reflowed(doc: str) -> str:
    """``doc`` with each paragraph's lines joined, as Typer does for the first paragraph only (it keeps the
    others' line breaks and wraps them again, so ``--help`` at 80 columns read raggedly). A paragraph with an
    indented line, a list item or click's ``\\b`` marker keeps its lines."""
    def keeps(para: str) -> bool:
        return any(line[:1].isspace() or line.lstrip().startswith(("- ", "* ", "\b")) for line in para.splitlines())

    return "\n\n".join(p if keeps(p) else " ".join(p.split()) for p in inspect.cleandoc(doc).split("\n\n"))


def reflow_help(group: typer.Typer) -> None:
    """Every command's help text of ``group`` and its sub-groups through ``reflowed`` (docstrings stay as
    written)."""
    for info in group.registered_commands:
        if info.help is None and info.callback is not None and info.callback.__doc__:
            info.help = reflowed(info.callback.__doc__)
    for sub in group.registered_groups:
        if sub.typer_instance is not None:
            reflow_help(sub.typer_instance)
