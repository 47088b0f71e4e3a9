"""Cross-run comparison: groups of runs on final and best metric values (``compare``), each group against a
baseline paired by seed with a 95% confidence interval (``PairedComparison``), their overlaid curves
(``plot_comparison``) and all of it in a markdown report (``report``)."""

from __future__ import annotations

import math
import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError
from .fmt import _decimals, _fmt_mean_std, _md_escape, _metric_label
from .paired import CONFIDENCE, PairedDifference, paired_difference
from .plots import _plot_groups
from .runs_view import (
    RunGroup,
    StrPath,
    _best_direction,
    _display_order,
    _group,
    _is_eval,
    _is_headline,
    _load_all,
    _primary,
    _Run,
    _shared_direction,
)
from .selection import Selection


def _default_metrics(runs: Sequence[_Run]) -> list[str]:
    """Evaluation metrics (``test/*``, a task's extra ``test_<name>/*``, ``val/*``, ``local/*``; not per-class
    families such as ``test/iou/road``) logged by any run (runs of different tasks log different ones),
    the runs' primary metric first, then the test metrics of a model selected on validation
    (``selected/test/*``), then ``time/round_s`` and central DP's ``dp/epsilon`` if any run has them (a private
    run's comparison shows what its accuracy cost in privacy)."""
    order: dict[str, int] = {}
    for r in runs:
        for k in r.series:
            order.setdefault(k, len(order))
    evals = _display_order(k for k in order if _is_eval(k) and _is_headline(k))
    primary = _primary(runs)
    if primary is not None:
        evals.sort(key=lambda k: k != primary)
    # eval.select = "best": the model selected on validation, scored on test (selected/test/acc)
    selected = [k for k in order if k.startswith("selected/test") and _is_headline(k.split("/", 1)[1])]
    return evals + selected + [k for k in ("time/round_s", "dp/epsilon") if k in order]


def _mean_std(values: Sequence[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    arr = np.asarray(values, dtype=np.float64)
    return float(arr.mean()), (float(arr.std(ddof=1)) if len(arr) >= 2 else None)


@dataclass(frozen=True)
class ComparisonRow:
    """One (group, metric) row of a comparison: mean and sample std (None below 2 runs) of each run's
    final, best and selected value (the table's ``Selection``: final, best or the mean of the last N
    evaluations). ``higher_is_better`` is the metric's direction that the compared runs' ``run.json`` agree
    on (None: no direction, or they disagree; then there is no best, nor for a budget metric: bytes, FLOPs,
    seconds, epsilon). ``n_runs`` counts the runs that logged the metric (0, and no values, for a group that
    never logged it); ``rounds`` holds each run's last round (all runs of the group); ``grid_point`` is the
    group's sweep grid point (``RunGroup.grid_point``), the set of rows whose best selected value is bold."""

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
    selected_mean: float | None = None
    selected_std: float | None = None


@dataclass(frozen=True)
class PairedComparison:
    """One group against its ``baseline`` group on one metric with a direction: the per-seed paired
    difference (group minus baseline) of the values ``selection`` (in words) picked, its mean, 95% CI and
    verdict (``PairedDifference``)."""

    group: str
    baseline: str
    metric: str
    higher_is_better: bool
    selection: str
    stats: PairedDifference


@dataclass(frozen=True)
class ComparisonTable:
    """Final and best values per group and metric, as mean ± std over the runs of each group, and every group
    against the baseline, paired by seed (``comparisons``), on the values ``selection`` picks."""

    groups: tuple[RunGroup, ...]
    metrics: tuple[str, ...]
    rows: tuple[ComparisonRow, ...]
    selection: Selection = Selection()
    #: the name the baselines were chosen by (a group's label, or a variant's name at each grid point)
    baseline: str | None = None
    comparisons: tuple[PairedComparison, ...] = ()
    #: each group's privacy noise (``run.json``'s ``privacy_noise``: "simulated: ..." or "secret: ...", with the
    #: parts that draw it), None for a group whose runs draw no protecting noise
    noise: tuple[tuple[str, str | None], ...] = ()

    def _leaders(self) -> set[tuple[str, str]]:
        """(group, metric) of the group with the best mean selected value per metric with a direction, among
        the rows of one sweep grid point (rows without one form one set): >= 2 candidates, no ties."""
        out = set()
        for m in self.metrics:
            by_point: dict[str | None, list[ComparisonRow]] = {}
            for r in self.rows:
                if (r.metric == m and r.higher_is_better is not None and r.selected_mean is not None
                        and not math.isnan(r.selected_mean)):
                    by_point.setdefault(r.grid_point, []).append(r)
            for cands in by_point.values():
                if len(cands) >= 2:
                    sign = 1.0 if cands[0].higher_is_better else -1.0
                    top = max(sign * r.selected_mean for r in cands)  # type: ignore[operator]
                    winners = [r for r in cands if sign * r.selected_mean == top]  # type: ignore[operator]
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
        sel = self.selection
        what = {"best": "top best (final where there is no best)"}.get(sel.kind, f"best {sel.column}")
        bold = (f"Bold: {what} per metric among the runs of one grid point ([...] in the run name)"
                if any(g.grid_point is not None for g in self.groups) else f"Bold: {what} per metric")
        last = (f"; last {sel.n} = mean of each run's last {sel.n} evaluations" if sel.kind == "last" else "")
        return (text + "; std is the sample std (ddof=1), omitted for a single run. Final = each run's "
                "last logged round; best = max (↑) or min (↓) over rounds, selected on the split it is "
                "measured on (the test set for test/* and local/*), none for a metric without a direction or "
                f"a budget metric (bytes, FLOPs, seconds, epsilon){last}; — = not logged by the group. {bold}.")

    def group_lines(self) -> list[str]:
        """One line per group: its label, seeds and backends (``run.json``), and the rule that formed
        it (replicates are runs of one config with distinct seeds; a config's runs that share a seed
        are rows of their own, told apart by backend or directory); then its runs that have not reached their
        last round (``RunGroup.unfinished``)."""
        lines = []
        for g in self.groups:
            seeds = ", ".join("?" if s is None else str(s) for s in g.seeds)
            backends = ", ".join(dict.fromkeys(b or "not recorded" for b in g.backends))
            unit = "seed" if len(g.seeds) == 1 else "seeds"
            unfinished = (f"; not finished: {', '.join(g.unfinished)} (final = that round's value)"
                          if g.unfinished else "")
            lines.append(f"{g.label}: {len(g.run_dirs)} run{'s' if len(g.run_dirs) != 1 else ''}, {unit} {seeds}"
                         f"{f'; backend {backends}' if backends else ''}{unfinished}")
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

    def _decimals(self, metric: str) -> int:
        """Decimals shared by every number of ``metric`` (its rows' means and its paired differences)."""
        same = [x for x in self.rows if x.metric == metric]
        return _decimals([x.final_mean for x in same] + [x.best_mean for x in same] + [x.selected_mean for x in same])

    def _headers(self) -> list[str]:
        """The value columns: final, best, and "last N" under ``--select last:N``."""
        return ["final", "best"] + ([self.selection.column] if self.selection.kind == "last" else [])

    def _cells(self, r: ComparisonRow, lead: set[tuple[str, str]], bold: tuple[str, str]) -> list[str]:
        """Formatted value cells (``_headers``), decimals shared by all rows of the metric; the selected value
        of a leader wrapped in ``bold`` (its best, or its final where the metric has no best)."""
        d = self._decimals(r.metric)
        cells = [_fmt_mean_std(r.final_mean, r.final_std, d), _fmt_mean_std(r.best_mean, r.best_std, d)]
        if self.selection.kind == "last":
            cells.append(_fmt_mean_std(r.selected_mean, r.selected_std, d))
        if (r.group, r.metric) in lead:
            i = {"final": 0, "best": 1 if r.best_mean is not None else 0}.get(self.selection.kind, 2)
            cells[i] = f"{bold[0]}{cells[i]}{bold[1]}"
        return cells

    @staticmethod
    def _rounds_text(rounds: tuple[int, ...]) -> str:
        lo, hi = min(rounds), max(rounds)
        return str(lo) if lo == hi else f"{lo}–{hi}"

    def to_markdown(self) -> str:
        """A markdown table (one row per metric and group) preceded by a "mean ± std over N seeds" line."""
        lead = self._leaders()
        heads = self._headers()
        lines = [self._seeds_line(), "",
                 f"| metric | run | n | rounds | {' | '.join(heads)} |",
                 "|---|---|---:|---:|" + "---:|" * len(heads)]
        for r in self.rows:
            cells = self._cells(r, lead, ("**", "**"))
            lines.append(f"| {_md_escape(_metric_label(r.metric, r.higher_is_better))} | {_md_escape(r.group)} | "
                         f"{r.n_runs} | {self._rounds_text(r.rounds)} | {' | '.join(cells)} |")
        return "\n".join(lines) + "\n"

    def to_rich(self) -> Any:
        """The same table as a ``rich.table.Table`` (one section per metric)."""
        from rich.markup import escape
        from rich.table import Table

        lead = self._leaders()
        caption = "\n".join([self._seeds_line(), self.grouping_note(), *(f"  {ln}" for ln in self.group_lines())])
        table = Table(title="FedSight run comparison", caption=escape(caption), caption_justify="left")
        table.add_column("metric / run", overflow="fold")  # (the metric heads its rows: the run names get its width)
        table.add_column("n", justify="right")
        table.add_column("rounds", justify="right")
        heads = self._headers()
        for head in heads:
            table.add_column(head, justify="right", no_wrap=True)
        for i, r in enumerate(self.rows):
            if i == 0 or self.rows[i - 1].metric != r.metric:
                table.add_row(_metric_heading(r.metric, r.higher_is_better), "", "", *[""] * len(heads))
            last_of_metric = i + 1 == len(self.rows) or self.rows[i + 1].metric != r.metric
            table.add_row(escape(r.group), str(r.n_runs), self._rounds_text(r.rounds),
                          *self._cells(r, lead, ("[bold]", "[/bold]")), end_section=last_of_metric)
        return table

    # -- paired comparisons with the baseline ---------------------------------------------------------

    def comparison_note(self, selection_column: bool = True) -> str:
        """What the comparison table holds, in one paragraph; without ``selection_column`` it also says which
        values each metric's rows compare (what that column would say)."""
        pct = f"{CONFIDENCE:.0%}"
        values = f"Values compared (--select {self.selection}): "
        if selection_column:
            values += "column selection."
        else:
            by_label: dict[str, list[str]] = {}
            for c in self.comparisons:
                metrics = by_label.setdefault(c.selection, [])
                if c.metric not in metrics:
                    metrics.append(c.metric)
            values += "; ".join(f"{label} ({', '.join(ms)})" for label, ms in by_label.items()) + "."
        text = (f"Each row: the run minus the baseline, paired by seed (only the seeds both have; n pairs). {values} "
                f"Δ = mean of the per-seed differences; {pct} CI = Student t interval of that mean (n − 1 degrees "
                "of freedom). Verdict: better / worse when the interval excludes 0 (in the metric's direction), "
                "within noise when it holds 0; no interval below 2 pairs. Wilcoxon p = two-sided Wilcoxon signed-rank "
                "test of the same differences (scipy, exact; zero differences dropped); n pairs cannot give a p "
                "below 2^(1 − n) (0.25 with 3 seeds, 0.125 with 4, 0.0625 with 5: fewer than 6 never reach 0.05), "
                "marked (min) where it is that floor.")
        noise = self.noise_note()
        return f"{text} {noise}" if noise else text

    def noise_note(self) -> str:
        """Where the compared runs' DP noise came from (``[privacy] noise``, ``run.json``), in one sentence: the
        mode shared by every group, or each group's where they differ; empty when no run draws protecting noise."""
        if not any(v for _, v in self.noise):
            return ""
        values = list(dict.fromkeys(v for _, v in self.noise))
        if len(values) == 1:
            return f"Privacy noise (run.json), every run: {values[0]}."
        each = "; ".join(f"{label}: {v or 'none drawn'}" for label, v in self.noise)
        return (f"Privacy noise differs between the compared runs (run.json): {each}. Runs with secret noise do not "
                "reproduce from their seed, and their differences include their own noise draws.")

    def _comparison_cells(self, c: PairedComparison) -> tuple[str, str, str]:
        """(Δ, 95% CI, verdict) of one comparison, with the decimals of its metric's table rows."""
        d, st = self._decimals(c.metric), c.stats
        delta = "—" if st.mean is None else f"{st.mean:+.{d}f}"
        if st.ci is not None:
            ci = f"[{st.ci[0]:+.{d}f}, {st.ci[1]:+.{d}f}]"
        else:
            ci = {0: "n/a (no common seed)", 1: "n/a (1 seed)"}.get(st.n, "n/a")
        return delta, ci, st.verdict

    @staticmethod
    def _wilcoxon_cell(c: PairedComparison) -> str:
        """The comparison's Wilcoxon p (3 significant digits), "(min)" at the floor its pairs allow; "—" for none."""
        p, floor = c.stats.wilcoxon, c.stats.min_wilcoxon_p
        if p is None:
            return "—"
        return f"{p:.3g}" + (" (min)" if floor is not None and math.isclose(p, floor) else "")

    def comparison_markdown(self) -> str:
        """The paired comparisons as a markdown table (empty when there are none)."""
        if not self.comparisons:
            return ""
        pct = f"{CONFIDENCE:.0%}"
        lines = [self.comparison_note(), "",
                 f"| metric | run | baseline | selection | n | Δ | {pct} CI | verdict | Wilcoxon p |",
                 "|---|---|---|---|---:|---:|---|---|---:|"]
        for c in self.comparisons:
            delta, ci, verdict = self._comparison_cells(c)
            lines.append(f"| {_md_escape(_metric_label(c.metric, c.higher_is_better))} | {_md_escape(c.group)} | "
                         f"{_md_escape(c.baseline)} | {c.selection} | {c.stats.n} | {delta} | {ci} | {verdict} | "
                         f"{self._wilcoxon_cell(c)} |")
        return "\n".join(lines) + "\n"

    def comparison_rich(self) -> Any:
        """The paired comparisons as a ``rich.table.Table`` (one section per metric); None when there are none.
        Which values are compared is said in the caption; the baseline is a column only where rows differ in
        it, else in the title."""
        if not self.comparisons:
            return None
        from rich.markup import escape
        from rich.table import Table

        rows = self.comparisons
        bases = list(dict.fromkeys(c.baseline for c in rows))
        title = f"Compared with the baseline {bases[0]}" if len(bases) == 1 else "Compared with the baselines"
        table = Table(title=escape(title), caption=escape(self.comparison_note(selection_column=False)),
                      caption_justify="left")
        table.add_column("metric / run", overflow="fold")  # (the metric heads its rows: the run names get its width)
        if len(bases) > 1:
            table.add_column("baseline", overflow="fold")
        table.add_column("n", justify="right")
        table.add_column("Δ", justify="right", no_wrap=True)
        table.add_column(f"{CONFIDENCE:.0%} CI", justify="right", no_wrap=True)
        table.add_column("verdict\nWilcoxon p", no_wrap=True)  # (one column: the table fits 80 columns)
        for i, c in enumerate(rows):
            if i == 0 or rows[i - 1].metric != c.metric:
                table.add_row(_metric_heading(c.metric, c.higher_is_better), *[""] * (len(table.columns) - 1))
            last = i + 1 == len(rows) or rows[i + 1].metric != c.metric
            cells = [escape(c.group)] + ([escape(c.baseline)] if len(bases) > 1 else [])
            delta, ci, verdict = self._comparison_cells(c)
            p = self._wilcoxon_cell(c)
            table.add_row(*cells, str(c.stats.n), delta, ci, verdict + (f"\np={p}" if p != "—" else ""), end_section=last)
        return table


def _metric_heading(metric: str, higher: bool | None) -> str:
    """A metric's label as the row heading its runs in a terminal table (rich markup)."""
    from rich.markup import escape

    return f"[bold cyan]{escape(_metric_label(metric, higher))}[/bold cyan]"


def _noise_of(runs: Sequence[_Run]) -> str | None:
    """The ``privacy_noise`` the sessions of ``runs`` record (``fedsight.secret.privacy_note``), distinct values
    joined by " | "; None when no session records one (nothing draws protecting noise, or a run predates it)."""
    values = dict.fromkeys(s["privacy_noise"] for r in runs for s in r.sessions
                           if isinstance(s.get("privacy_noise"), str))
    return " | ".join(values) or None


def _variant_name(g: RunGroup) -> str:
    """A group's label without its grid point: the sweep variant it belongs to (``fedavg`` of
    ``fedavg[alpha=0.1]``)."""
    return g.label.replace(f"[{g.grid_point}]", "", 1) if g.grid_point is not None else g.label


def _baselines(groups: Sequence[RunGroup], name: str | None) -> tuple[str, dict[str | None, RunGroup] | RunGroup]:
    """(the name, the baseline): the group labelled ``name``, else the groups of the variant ``name`` keyed by
    grid point (each group is compared with its grid point's); ``name`` None: the first group's variant (or
    label). A ``ConfigError`` naming ``--baseline`` and the groups when ``name`` names none."""
    if name is None:
        name = _variant_name(groups[0])
    for g in groups:
        if g.label == name:
            return name, g
    by_point: dict[str | None, RunGroup] = {}
    for g in groups:
        if g.grid_point is not None and _variant_name(g) == name:
            by_point.setdefault(g.grid_point, g)
    if not by_point:
        variants = list(dict.fromkeys(_variant_name(g) for g in groups if g.grid_point is not None))
        also = f" (or a variant, compared at each grid point: {', '.join(variants)})" if variants else ""
        raise ConfigError(f"--baseline {name}: no such group; the groups are {', '.join(g.label for g in groups)}"
                          + also)
    return name, by_point


def _by_seed(runs: Sequence[_Run], metric: str, higher: bool, selection: Selection) -> dict[int, float]:
    """Seed -> selected value of ``metric``, for the runs that have a seed and logged it."""
    return {r.seed: selection.value(r.series[metric], metric, higher) for r in runs
            if r.seed is not None and metric in r.series}


def _paired(grouped: Sequence[tuple[RunGroup, list[_Run]]], metrics: Sequence[str], directions: dict[str, bool | None],
            selection: Selection, baseline: dict[str | None, RunGroup] | RunGroup) -> list[PairedComparison]:
    """Every group but its baseline against the baseline, on every metric with a direction."""
    members = {id(g): runs for g, runs in grouped}
    out = []
    for m in metrics:
        higher = directions[m]
        if higher is None:
            continue
        for g, runs in grouped:
            base = baseline if isinstance(baseline, RunGroup) else baseline.get(g.grid_point)
            if base is None or base is g:
                continue
            theirs = members[id(base)]
            if not any(m in r.series for r in runs) or not any(m in r.series for r in theirs):
                continue  # a metric of another task: nothing to compare
            stats = paired_difference(_by_seed(runs, m, higher, selection), _by_seed(theirs, m, higher, selection),
                                      higher)
            out.append(PairedComparison(g.label, base.label, m, higher, selection.label(m, higher), stats))
    return out


def _compare_runs(runs: Sequence[_Run], metrics: list[str] | None, baseline: str | None = None,
                  select: str | Selection = "final") -> tuple[ComparisonTable, list[list[_Run]]]:
    selection = select if isinstance(select, Selection) else Selection.parse(select)
    grouped = _group(runs)
    if metrics is None:
        metrics = _default_metrics(runs)
    else:
        absent = [m for m in metrics if not any(m in r.series for r in runs)]
        if absent:
            raise ValueError(f"metric(s) not logged by any run: {', '.join(absent)}")
    selection.check(runs, metrics)
    name, base = _baselines([g for g, _ in grouped], baseline)
    rows, directions = [], {}
    for m in metrics:
        higher = directions[m] = _shared_direction(runs, m)  # one direction per metric across all groups
        best = _best_direction(m, higher)
        for group, members in grouped:
            have = [r for r in members if m in r.series]
            fm, fs = _mean_std([r.series[m].final()[0] for r in have])
            bm, bs = (None, None) if best is None else _mean_std([r.series[m].best(best)[0] for r in have])
            sm, ss = _mean_std([selection.value(r.series[m], m, higher) for r in have])
            rows.append(ComparisonRow(group.label, m, higher, len(have), tuple(r.n_rounds for r in members),
                                      group.seeds, fm, fs, bm, bs, group.grid_point, sm, ss))
    comparisons = _paired(grouped, metrics, directions, selection, base)
    table = ComparisonTable(tuple(g for g, _ in grouped), tuple(metrics), tuple(rows), selection, name,
                            tuple(comparisons), tuple((g.label, _noise_of(members)) for g, members in grouped))
    return table, [members for _, members in grouped]


def compare(run_dirs: Iterable[StrPath], metrics: list[str] | None = None, *, baseline: str | None = None,
            select: str = "final") -> ComparisonTable:
    """Compare groups of runs (see ``group_runs``) on final and best metric values, and each group with a
    baseline group, paired by seed.

    ``metrics`` defaults to the evaluation metrics (``test/*``, ``val/*``, ``local/*``) logged by any run
    (a group that never logged one shows "—" for it), the runs' primary metric first (the first run's, if
    they differ), then ``time/round_s`` and ``dp/epsilon``; pass other keys (``train/loss``) explicitly. For
    each group and metric the table holds the mean and sample std (ddof=1; none for a single run) over the
    group's runs of:

    - final: each run's value at its own last round where the metric was logged, so a run that was
      interrupted early or evaluates every k rounds still contributes its last evaluation;
    - best: each run's max (higher-is-better) or min (lower-is-better) over its logged rounds; none for a
      budget metric (bytes, FLOPs, seconds, epsilon: ``fedsight.metric_table.is_budget``);
    - with ``select="last:N"``, the mean of each run's last N evaluations.

    Directions come from each run's ``run.json``; a metric with no direction there, or one the runs
    disagree on, has no best, is never bold and is not compared with the baseline. The best selected value
    per metric is bold among the groups of one sweep grid point (``name[alpha=0.1]``), the groups without a
    grid point forming one set.

    ``select`` (``fedsight.reporting.selection``): "final" (default), "best" (the best round, selected on
    the split the metric is measured on) or "last:N". ``baseline``: a group's label, or a sweep variant's name
    (each grid point's groups are then compared with that variant's group at the same grid point); default
    the first group's variant. ``comparisons`` holds, for every other group and every metric with a direction,
    the per-seed differences of the selected values, their mean, 95% Student-t CI and verdict
    (``fedsight.reporting.paired``). A baseline naming no group, an unknown protocol, or ``last:N`` with a run
    that has fewer than N evaluations of a compared metric raise ``fedsight.ConfigError`` naming the option.
    """
    return _compare_runs(_load_all(run_dirs), metrics, baseline, select)[0]


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


def _command(command: Any) -> str | None:
    """A session's command line; ``python -m fedsight``, recorded as ``__main__.py`` before the command was recorded
    as ``fedsight`` (``build.command_line``), reads ``fedsight``."""
    if not isinstance(command, list) or not command:
        return None
    return shlex.join(["fedsight" if command[0] == "__main__.py" else command[0], *command[1:]])


#: what a report's provenance lists of each run's sessions (``run.json``), in this order
PROVENANCE = (
    ("FedSight commit", lambda s: _commit(s.get("git", {}).get("fedsight"))),
    ("command", lambda s: _command(s.get("command"))),
    ("torch / Python", lambda s: f"torch {s.get('torch')}, Python {s.get('python')}" if s.get("torch") else None),
    ("device, threads", lambda s: f"{s.get('device')}, {s.get('threads')} thread{'s' if s.get('threads') != 1 else ''}"
     if s.get("device") else None),
    ("CPU", lambda s: _cpu(s.get("machine"))),
    ("privacy noise", lambda s: s.get("privacy_noise") if isinstance(s.get("privacy_noise"), str) else None),
)


def _commit(git: Any) -> str | None:
    if not isinstance(git, dict) or not isinstance(git.get("commit"), str):
        return None
    return git["commit"][:12] + (" (with uncommitted changes)" if git.get("dirty") else "")


def _cpu(machine: Any) -> str | None:
    if not isinstance(machine, dict) or not machine.get("cpu"):
        return None
    build = ", ".join(f"{k} {machine[k]}" for k in ("cpu_capability", "blas") if machine.get(k))
    return f"{machine['cpu']}" + (f" ({build})" if build else "")


def provenance_values(runs: Iterable[_Run]) -> list[tuple[str, list[tuple[str, int]]]]:
    """Each ``PROVENANCE`` item that any session of ``runs`` records (a resumed run has several sessions):
    (label, its distinct values with how many runs each produced, most runs first)."""
    runs = list(runs)
    out = []
    for label, get in PROVENANCE:
        seen: dict[str, set[Path]] = {}
        for run in runs:
            for session in run.sessions:
                value = get(session)
                if value:
                    seen.setdefault(value, set()).add(run.path)
        if seen:
            out.append((label, [(v, len(paths)) for v, paths in sorted(seen.items(), key=lambda kv: -len(kv[1]))]))
    return out


def provenance_lines(runs: Iterable[_Run]) -> list[str]:
    """``report.md``'s provenance: ``provenance_values`` as a list, so a table says which code, command and
    machine its numbers came from."""
    runs = list(runs)
    lines = ["## Provenance", "", f"From the `run.json` of the {len(runs)} runs (every session of each):", ""]
    for label, values in provenance_values(runs):
        if len(values) == 1:
            lines.append(f"- {label}: `{values[0][0]}`")
        else:
            lines.append(f"- {label}:")
            lines += [f"  - `{value}` ({n} run{'s' if n != 1 else ''})" for value, n in values]
    return lines + [""]


def provenance(run_dirs: Iterable[StrPath]) -> str:
    """The provenance section (``provenance_lines``) of these run directories, as Markdown: what the table
    scripts (``examples/*_table.py``) print under their tables."""
    return "\n".join(provenance_lines(_load_all(run_dirs)))
