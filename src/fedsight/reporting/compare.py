"""Cross-run comparison: groups of runs on final and best metric values (``compare``), their overlaid
curves (``plot_comparison``) and both in a markdown report (``report``)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .fmt import _decimals, _fmt_mean_std, _md_escape, _metric_label
from .plots import CURVES_FILE, _plot_groups
from .runs_view import (
    RunGroup,
    StrPath,
    _display_order,
    _group,
    _is_eval,
    _is_headline,
    _load_all,
    _primary,
    _Run,
    _shared_direction,
)


def _default_metrics(runs: Sequence[_Run]) -> list[str]:
    """Evaluation metrics (``test/*``, a task's extra ``test_<name>/*``, ``val/*``, ``local/*``; not per-class
    families such as ``test/iou/road``) logged by any run (runs of different tasks log different ones),
    the runs' primary metric first, then ``time/round_s`` if any run has it."""
    order: dict[str, int] = {}
    for r in runs:
        for k in r.series:
            order.setdefault(k, len(order))
    evals = _display_order(k for k in order if _is_eval(k) and _is_headline(k))
    primary = _primary(runs)
    if primary is not None:
        evals.sort(key=lambda k: k != primary)
    return evals + (["time/round_s"] if "time/round_s" in order else [])


def _mean_std(values: Sequence[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    arr = np.asarray(values, dtype=np.float64)
    return float(arr.mean()), (float(arr.std(ddof=1)) if len(arr) >= 2 else None)


@dataclass(frozen=True)
class ComparisonRow:
    """One (group, metric) cell pair of a comparison: mean and sample std (None below 2 runs) of each
    run's final and best value. ``higher_is_better`` is the metric's direction that the compared runs'
    ``run.json`` agree on (None: no direction, or they disagree; then there is no best). ``n_runs``
    counts the runs that logged the metric (0, and no values, for a group that never logged it);
    ``rounds`` holds each run's last round (all runs of the group); ``grid_point`` is the group's sweep
    grid point (``RunGroup.grid_point``), the set of rows whose best final is bold."""

    group: str
    metric: str
    higher_is_better: bool | None
    n_runs: int
    rounds: tuple[int, ...]
    seeds: tuple[int | None, ...]
    final_mean: float | None
    final_std: float | None
    best_mean: float | None
    best_std: float | None
    grid_point: str | None = None


@dataclass(frozen=True)
class ComparisonTable:
    """Final and best values per group and metric, as mean ± std over the runs of each group."""

    groups: tuple[RunGroup, ...]
    metrics: tuple[str, ...]
    rows: tuple[ComparisonRow, ...]

    def _leaders(self) -> set[tuple[str, str]]:
        """(group, metric) of the group with the best mean final per metric with a direction, among the
        rows of one sweep grid point (rows without one form one set): >= 2 candidates, no ties."""
        out = set()
        for m in self.metrics:
            by_point: dict[str | None, list[ComparisonRow]] = {}
            for r in self.rows:
                if (r.metric == m and r.higher_is_better is not None and r.final_mean is not None
                        and not math.isnan(r.final_mean)):
                    by_point.setdefault(r.grid_point, []).append(r)
            for cands in by_point.values():
                if len(cands) >= 2:
                    sign = 1.0 if cands[0].higher_is_better else -1.0
                    top = max(sign * r.final_mean for r in cands)  # type: ignore[operator]
                    winners = [r for r in cands if sign * r.final_mean == top]  # type: ignore[operator]
                    if len(winners) == 1:  # no bold on ties
                        out.add((winners[0].group, m))
        return out

    def _seeds_line(self) -> str:
        ns = sorted({len(g.run_dirs) for g in self.groups})
        n = str(ns[0]) if len(ns) == 1 else "N"
        unit = "seed" if n == "1" else "seeds"
        text = f"Values are mean ± std over {n} {unit}"
        if len(ns) > 1:
            text += " (N per group in column n)"
        bold = ("Bold: best final per metric among the runs of one grid point ([...] in the run name)"
                if any(g.grid_point is not None for g in self.groups) else "Bold: best final per metric")
        return (text + "; std is the sample std (ddof=1), omitted for a single run. Final = each run's "
                "last logged round; best = max (↑) or min (↓) over rounds, none for a metric without "
                f"a direction; — = not logged by the group. {bold}.")

    def group_lines(self) -> list[str]:
        """One line per group: its label, seeds and backends (``run.json``), and the rule that formed
        it (replicates are runs of one config with distinct seeds; a config's runs that share a seed
        are rows of their own, told apart by backend or directory)."""
        lines = []
        for g in self.groups:
            seeds = ", ".join("?" if s is None else str(s) for s in g.seeds)
            backends = ", ".join(dict.fromkeys(b or "not recorded" for b in g.backends))
            unit = "seed" if len(g.seeds) == 1 else "seeds"
            lines.append(f"{g.label}: {len(g.run_dirs)} run{'s' if len(g.run_dirs) != 1 else ''}, {unit} {seeds}"
                         f"{f'; backend {backends}' if backends else ''}")
        return lines

    def grouping_note(self) -> str:
        """One sentence on how runs were grouped, naming the rows that hold same-seed runs of one config."""
        split = [g.label for g in self.groups if g.split_note]
        text = ("Groups: runs whose configs are equal apart from seed, run name/directory and engine, with "
                "distinct seeds, are replicates of one row")
        if split:
            text += ("; runs of one config with the same seed are not replicates, so these are rows of "
                     f"their own: {', '.join(split)}")
        return text + "."

    def _cells(self, r: ComparisonRow) -> tuple[str, str]:
        """Formatted (final, best), with decimals shared by all rows of the metric."""
        same = [x for x in self.rows if x.metric == r.metric]
        d = _decimals([x.final_mean for x in same] + [x.best_mean for x in same])
        return _fmt_mean_std(r.final_mean, r.final_std, d), _fmt_mean_std(r.best_mean, r.best_std, d)

    @staticmethod
    def _rounds_text(rounds: tuple[int, ...]) -> str:
        lo, hi = min(rounds), max(rounds)
        return str(lo) if lo == hi else f"{lo}–{hi}"

    def to_markdown(self) -> str:
        """A markdown table (one row per metric and group) preceded by a "mean ± std over N seeds" line."""
        lead = self._leaders()
        lines = [self._seeds_line(), "",
                 "| metric | run | n | rounds | final | best |",
                 "|---|---|---:|---:|---:|---:|"]
        for r in self.rows:
            final, best = self._cells(r)
            if (r.group, r.metric) in lead:
                final = f"**{final}**"
            lines.append(f"| {_md_escape(_metric_label(r.metric, r.higher_is_better))} | {_md_escape(r.group)} | "
                         f"{r.n_runs} | {self._rounds_text(r.rounds)} | {final} | {best} |")
        return "\n".join(lines) + "\n"

    def to_rich(self) -> Any:
        """The same table as a ``rich.table.Table`` (one section per metric)."""
        from rich.markup import escape
        from rich.table import Table

        lead = self._leaders()
        caption = "\n".join([self._seeds_line(), self.grouping_note(), *(f"  {ln}" for ln in self.group_lines())])
        table = Table(title="FedSight run comparison", caption=escape(caption), caption_justify="left")
        table.add_column("metric", style="cyan", overflow="fold")
        table.add_column("run", overflow="fold")
        table.add_column("n", justify="right")
        table.add_column("rounds", justify="right")
        table.add_column("final", justify="right", no_wrap=True)
        table.add_column("best", justify="right", no_wrap=True)
        for i, r in enumerate(self.rows):
            first_of_metric = i == 0 or self.rows[i - 1].metric != r.metric
            last_of_metric = i + 1 == len(self.rows) or self.rows[i + 1].metric != r.metric
            final, best = self._cells(r)
            if (r.group, r.metric) in lead:
                final = f"[bold]{final}[/bold]"
            label = _metric_label(r.metric, r.higher_is_better) if first_of_metric else ""
            table.add_row(label, escape(r.group), str(r.n_runs), self._rounds_text(r.rounds), final, best,
                          end_section=last_of_metric)
        return table


def _compare_runs(runs: Sequence[_Run], metrics: list[str] | None) -> tuple[ComparisonTable, list[list[_Run]]]:
    grouped = _group(runs)
    if metrics is None:
        metrics = _default_metrics(runs)
    else:
        absent = [m for m in metrics if not any(m in r.series for r in runs)]
        if absent:
            raise ValueError(f"metric(s) not logged by any run: {', '.join(absent)}")
    rows = []
    for m in metrics:
        higher = _shared_direction(runs, m)  # one direction per metric across all groups
        for group, members in grouped:
            have = [r for r in members if m in r.series]
            fm, fs = _mean_std([r.series[m].final()[0] for r in have])
            bm, bs = (None, None) if higher is None else _mean_std([r.series[m].best(higher)[0] for r in have])
            rows.append(ComparisonRow(group.label, m, higher, len(have), tuple(r.n_rounds for r in members),
                                      group.seeds, fm, fs, bm, bs, group.grid_point))
    table = ComparisonTable(tuple(g for g, _ in grouped), tuple(metrics), tuple(rows))
    return table, [members for _, members in grouped]


def compare(run_dirs: Iterable[StrPath], metrics: list[str] | None = None) -> ComparisonTable:
    """Compare groups of runs (see ``group_runs``) on final and best metric values.

    ``metrics`` defaults to the evaluation metrics (``test/*``, ``val/*``, ``local/*``) logged by any run
    (a group that never logged one shows "—" for it), the runs' primary metric first (the first run's, if
    they differ), then ``time/round_s``; pass other keys (``train/loss``, ``dp/epsilon``) explicitly. For
    each group and metric the table holds the mean and sample std (ddof=1; none for a single run) over the
    group's runs of:

    - final: each run's value at its own last round where the metric was logged, so a run that was
      interrupted early or evaluates every k rounds still contributes its last evaluation;
    - best: each run's max (higher-is-better) or min (lower-is-better) over its logged rounds.

    Directions come from each run's ``run.json``; a metric with no direction there, or one the runs
    disagree on, has no best and is never bold. The best final per metric is bold among the groups of
    one sweep grid point (``name[alpha=0.1]``), the groups without a grid point forming one set.
    """
    return _compare_runs(_load_all(run_dirs), metrics)[0]


#: more default metrics than this: the curves show the primary metric at each split (the table keeps them all)
MAX_DEFAULT_PANELS = 9


def _curve_metrics(metrics: Sequence[str], runs: Sequence[_Run], chosen: bool) -> list[str]:
    """The panels of ``curves.png``: the metrics asked for (``chosen``), else the default ones, or, when those
    are many (keypoints at five input sizes log 4 metrics each), the primary metric's name at every split
    (``test/pckh``, ``test_64x48/pckh``, ...) and ``time/round_s``."""
    primary = _primary(runs)
    if chosen or len(metrics) <= MAX_DEFAULT_PANELS or primary is None:
        return list(metrics)
    name = primary.rsplit("/", 1)[-1]
    return [m for m in metrics if m.rsplit("/", 1)[-1] == name or m == "time/round_s"]


def _plot_table(table: ComparisonTable, members: Sequence[Sequence[_Run]], path: Path, chosen: bool = False) -> Path:
    directions = {r.metric: r.higher_is_better for r in table.rows}
    panels = _curve_metrics(table.metrics, [r for group in members for r in group], chosen)
    return _plot_groups(table.groups, panels, members, directions, path)


def plot_comparison(run_dirs: Iterable[StrPath], path: StrPath, metrics: list[str] | None = None) -> Path:
    """Overlay the groups' curves, one subplot per metric, and save a PNG at ``path``; return it.

    Each group is one line: the mean over its runs at the rounds all its runs logged, with a shaded
    ±std band (sample std) when it has two or more runs. ``metrics`` defaults as in ``compare`` (more than
    ``MAX_DEFAULT_PANELS`` of them: the primary metric at each split, ``_curve_metrics``).
    """
    table, members = _compare_runs(_load_all(run_dirs), metrics)
    return _plot_table(table, members, Path(path), chosen=metrics is not None)


def report(run_dirs: Iterable[StrPath], out_dir: StrPath, metrics: list[str] | None = None) -> ComparisonTable:
    """Write ``out_dir/report.md`` (comparison table, what was grouped and why, curves link) and
    ``out_dir/curves.png`` for the given runs; return the table. ``metrics`` defaults as in ``compare``."""
    out = Path(out_dir)
    table, members = _compare_runs(_load_all(run_dirs), metrics)
    _plot_table(table, members, out / CURVES_FILE, chosen=metrics is not None)
    lines = ["# FedSight comparison", "", table.to_markdown(), "## Groups", "", table.grouping_note(), ""]
    for g, text in zip(table.groups, table.group_lines()):
        dirs = ", ".join(f"`{d}`" for d in g.run_dirs)
        lines.append(f"- **{_md_escape(g.label)}**{_md_escape(text[len(g.label):])} — {dirs}")
    lines += ["", "## Curves", "", f"![comparison curves]({CURVES_FILE})", ""]
    (out / "report.md").write_text("\n".join(lines), encoding="utf-8")
    return table
