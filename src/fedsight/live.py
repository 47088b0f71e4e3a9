"""Live progress of runs (``fedsight run``, ``resume``, ``run --jobs``, ``pretrain``): two lines a run on a terminal,
whole lines off one.

On a terminal a run shows

    run 2/4 fedavg seed 0 ━━━━━━━━━━━━━━━━━━━━━━━━       3/10  0:00:41  0:01:20
      round 4: training  |  round 3: 3 clients  acc 0.8123  wma 0.8011  loss 0.5123  train 0.4410

Line 1 has fixed-width columns (bar, done/total, elapsed, remaining), so the bar and both times stay whole at 80
columns whatever the metrics; the run's label takes the rest and is cut with an ellipsis first. Line 2 is the run's
phase (``loading data``, ``building the model``, ``round 0: evaluating the initial model``, ``round k: training``,
``writing the model, plots and summary``; ``api.execute``'s ``on_phase``) and then the last round's clients and
metrics (``api.progress_keys``, the task's primary metric first), cut at the width. A sweep's runs are labelled
``run k/N`` (serial and ``--jobs``). Off a terminal (nohup, SLURM, a pipe) there is no bar: each phase outside the
rounds is a line (``run 1/4 fedavg seed 0: loading data``), and so is every evaluated round, every ``total // 50``-th
round and the last (``run 1/4 fedavg seed 0 round 3/10  3 clients  acc 0.8123 ...``), never wrapped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Column
from rich.text import Text

BAR_WIDTH = 20
#: line 1's columns other than the label: the bar, done/total (11), elapsed (8), remaining (8) and 4 gaps; at 80
#: columns the label has 29
FIXED = BAR_WIDTH + 11 + 8 + 8 + 4


def fit(label: str, width: int) -> str:
    """``label`` in ``width`` characters: cut in the middle with an ellipsis, so that both its start (``run k/N``,
    the variant) and its end (the grid point, the seed), where a sweep's labels differ, stay."""
    if len(label) <= width or width < 5:
        return label
    tail = (width - 1) // 2
    return label[:width - 1 - tail] + "…" + label[-tail:]


class RunProgress(Progress):
    """rich's ``Progress`` with a second, dim line per task (its ``detail`` field) under the bar line; the bar
    line's columns other than the label have fixed widths, so bars and times align across runs and never shrink."""

    def get_renderables(self) -> Any:
        for task in self.tasks:
            yield self.make_tasks_table([task])
            detail = str(task.fields.get("detail", ""))
            if detail:
                yield Text("  " + detail, style="dim", no_wrap=True, overflow="ellipsis")


def make_progress(console: Console) -> RunProgress:
    """The progress display of runs and of pre-training (each task: a label, ``total`` rounds or epochs, a
    ``detail`` field for line 2)."""
    return RunProgress(
        TextColumn("[bold]{task.description}", table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis",
                                                                   min_width=8)),
        BarColumn(bar_width=BAR_WIDTH),
        MofNCompleteColumn(table_column=Column(width=11, justify="right", no_wrap=True)),
        TimeElapsedColumn(table_column=Column(width=8, justify="right", no_wrap=True)),
        TimeRemainingColumn(table_column=Column(width=8, justify="right", no_wrap=True)),
        console=console,
        transient=False,
        expand=True,
    )


def short(row: dict[str, Any], keys: list[tuple[str, str]]) -> str:
    """A round's metrics: ``keys`` from ``api.progress_keys`` (the task's primary metric first)."""
    return "  ".join(f"{label} {row[key]:.4f}" for key, label in keys if key in row)


def clients(row: dict[str, Any]) -> str:
    """A round's aggregated clients; round 0 is the initial model's evaluation."""
    return "initial model" if row.get("round") == 0 else f"{row.get('clients/aggregated', 0)} clients"


def run_label(name: str, seed: int, index: int | None = None, count: int = 1) -> str:
    """A run as the progress shows it: ``run k/N`` in a sweep of N runs, its name (variant, grid point) and seed."""
    return f"{f'run {index + 1}/{count} ' if index is not None and count > 1 else ''}{name} seed {seed}"


class RunView:
    """One run's progress: a task of ``progress`` (a terminal), or, with ``progress`` None, whole lines through
    ``say``. ``phase(text)`` for what the run does now; ``round(r, row)`` after each recorded round."""

    def __init__(self, progress: RunProgress | None, say: Callable[[str], None], label: str, total: int,
                 keys: list[tuple[str, str]], done: int = 0, start: float | None = None, phase: str = ""):
        self.progress, self.say, self.label, self.total, self.keys = progress, say, label, total, keys
        self.start = time.monotonic() if start is None else start
        self._phase, self._last = phase, ""
        self.task = (progress.add_task(escape(fit(label, progress.console.width - FIXED)), total=total, completed=done, detail=phase)
                     if progress is not None else None)

    def _detail(self) -> str:
        return "  |  ".join(part for part in (self._phase, self._last) if part)

    def phase(self, text: str) -> None:
        self._phase = text
        if self.progress is not None:
            self.progress.update(self.task, detail=self._detail())
        elif not text.startswith("round "):  # a round's own line follows it (round 0's: "initial model")
            self.say(f"{self.label}: {text}")

    def finish(self, status: str) -> None:
        """The run ended (``api.Outcome.status``, or a ``--jobs`` worker's): its last frame on a terminal says so
        instead of its last phase; off one the round lines have said it."""
        if self.progress is not None:
            self._phase = {"complete": "complete", "skipped": "already complete"}.get(status, status)
            self.progress.update(self.task, detail=self._detail())

    def round(self, r: int, row: dict[str, Any]) -> None:
        self._last = f"round {r}: {clients(row)}  {short(row, self.keys)}".rstrip()
        self._phase = f"round {r + 1}: training" if r < self.total else ""
        if self.progress is not None:
            self.progress.update(self.task, completed=r, detail=self._detail())
        elif any(key in row for key, _ in self.keys[:1]) or r % max(1, self.total // 50) == 0 or r == self.total:
            self.say(f"{self.label} round {r}/{self.total}  {clients(row)}  {short(row, self.keys)}  "
                     f"{time.monotonic() - self.start:.1f} s")
