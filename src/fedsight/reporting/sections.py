"""A report's sections: the runs of one task (and dataset, where the datasets log different metrics), each
compared in a table of its own with only its own metrics.

A folder of mixed tasks (classification, segmentation, SR, keypoints) compared in one table gives every group a
row for every task's metrics, most of them empty; grouping by task first keeps each table to the metrics its
runs log. Within a task, datasets share a section when their runs log the same headline evaluation metrics
(the same keys, so the same columns), and get one each otherwise (an SR run on a benchmark with four test sets
logs ``test_set5/psnr`` ... where another logs ``test/psnr``). The runs of one dataset stay together even where
they log different metrics (a run stopped before its first evaluation, ``eval.local`` on in some): a group
without a metric shows "—" for it there. Sections keep the order in which their first run was given.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .runs_view import _is_eval, _is_headline, _Run

__all__ = ["Part", "split_runs", "task_of", "dataset_of"]


def task_of(run: _Run) -> str:
    """The run's ``task.name`` (a config written without one is a classification run: the default task)."""
    task = run.config.get("task")
    name = task.get("name") if isinstance(task, dict) else task
    return str(name) if name else "classification"


def dataset_of(run: _Run) -> str:
    """The run's ``data.name`` ("unknown data" when its config names none)."""
    data = run.config.get("data")
    name = data.get("name") if isinstance(data, dict) else data
    return str(name) if name else "unknown data"


def _headline_evals(runs: Sequence[_Run]) -> frozenset[str]:
    return frozenset(k for r in runs for k in r.series if _is_eval(k) and _is_headline(k))


@dataclass(frozen=True)
class Part:
    """One section's runs: ``title`` says the task and datasets ("classification on digits"), ``slug`` is
    its file-name form (``classification-digits``), unique among the sections of one report."""

    title: str
    slug: str
    runs: tuple[_Run, ...]


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "runs"


def _ordered(runs: Sequence[_Run], key: Any) -> dict[Any, list[_Run]]:
    out: dict[Any, list[_Run]] = {}
    for r in runs:
        out.setdefault(key(r), []).append(r)
    return out


def split_runs(runs: Sequence[_Run]) -> list[Part]:
    """The runs by task, then by dataset where a task's datasets log different headline evaluation metrics
    (see the module's docstring); one part when the runs are all of one kind."""
    parts: list[tuple[str, list[_Run]]] = []
    for task, members in _ordered(runs, task_of).items():
        by_data = _ordered(members, dataset_of)
        if len({_headline_evals(rs) for rs in by_data.values()}) <= 1:
            parts.append((f"{task} on {', '.join(by_data)}", members))
            continue
        parts += [(f"{task} on {data}", rs) for data, rs in by_data.items()]
    out, seen = [], set()
    for title, members in parts:
        slug = base = _slug(title)
        n = 2
        while slug in seen:
            slug, n = f"{base}-{n}", n + 1
        seen.add(slug)
        out.append(Part(title, slug, tuple(members)))
    return out
