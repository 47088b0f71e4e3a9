"""``fedsight list``: the registries as tables (tasks, datasets, models, partitioners, recipe parts), each entry
with its parameters and what it declares (task family, metrics, what it provides and needs)."""

from __future__ import annotations

from typing import Any

from rich.markup import escape
from rich.table import Table


def registry_tables(kind: str | None = None) -> list[Table]:
    """One table per registry (only ``kind``'s when given: "model", "dataset", "server_optimizer", ...); an
    unknown ``kind`` is a ValueError listing the kinds."""
    from . import registry as R
    from .plugins import load_builtin

    load_builtin()
    regs = (R.TASKS, R.DATASETS, R.MODELS, R.PARTITIONERS, R.WEIGHTINGS, R.AGGREGATORS, R.SERVER_OPTIMIZERS,
            R.SHARING, R.COMPONENTS)
    if kind is not None:
        chosen = [r for r in regs if r.answers_to(kind)]
        if not chosen:
            raise ValueError(f"unknown kind {kind!r}; choose one of: {', '.join(r.kind.replace(' ', '_') for r in regs)} "
                             "(singular or plural)")
        regs = tuple(chosen)
    tables = []
    for reg in regs:
        table = Table(title=f"{reg.kind}s", title_justify="left", show_lines=False, expand=False)
        table.add_column("name", style="cyan", no_wrap=True)
        table.add_column("description", ratio=3)
        table.add_column("parameters (default)", ratio=2, overflow="fold")
        for e in reg.entries():
            params = ", ".join(_param(k, f) for k, f in e.params.model_fields.items())
            table.add_row(e.name, escape(e.help + _declarations(reg, e)), escape(params) or "-")
        tables.append(table)
    return tables


def _param(key: str, field: Any) -> str:
    """One parameter as ``fedsight list`` shows it: ``key=default``, and for a choice (a ``Literal``) every value
    it allows after the default (``style='none' [none|fda|cfsi|lab]``): the default alone hid the others."""
    from .registry import literal_choices

    shown = f"{key}={'required' if field.is_required() else repr(field.default)}"
    choices = literal_choices(field.annotation)
    return shown + (f" [{'|'.join(str(c) for c in choices)}]" if len(choices) > 1 else "")


def _declarations(reg: Any, e: Any) -> str:
    """What ``fedsight list`` adds to an entry's description: its task family, its metrics (tasks), what
    it provides (tasks; models with default parameters) and what it needs (recipe parts)."""
    from . import registry as R
    from .capabilities import resolve

    family = f" [{e.task_family}]" if reg in (R.DATASETS, R.MODELS) else ""
    out = []
    if reg is R.TASKS and "spec" in e.meta:
        spec = e.meta["spec"](e.params())
        arrows = {True: " ↑", False: " ↓", None: ""}
        metrics = ", ".join(f"{m.key}{arrows[m.higher_is_better]}" for m in spec.metrics)
        out.append(f"metrics: {metrics}; primary {spec.primary}; provides: {', '.join(sorted(spec.provides))}")
    try:
        default = e.params()
    except Exception:  # required parameters: no default instance to resolve a function of params with
        default = None
    if reg is R.MODELS and e.provides is not None and default is not None:
        out.append(f"provides: {', '.join(sorted(resolve(e.provides, default)))}")
    if e.requires is not None and default is not None:
        needs = resolve(e.requires, default)
        if needs:
            out.append(f"needs: {', '.join(sorted(needs))}")
    return family + ("; " + "; ".join(out) if out else "")
