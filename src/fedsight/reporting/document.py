"""``fedsight report``'s output: the runs split into sections (one task, and dataset where metrics differ:
``sections``), each with its own comparison table, paired comparisons and curves, written as ``report.md``,
``report.html`` (``html``) and a curves PNG per section.

``plan_report`` computes everything (and raises on a bad ``--baseline``, ``--select`` or ``--metric``) before
``write_report`` writes a byte, so the command can check every output path first and bad input writes nothing.
One section keeps the layout and names a single-task report always had (``curves.png``, ``##`` headings); several
get a contents list, a ``##`` heading each and ``curves-<section>.png``. A section whose runs log costs also gets
its cost figure (``cost.png``, ``cost-<section>.png``) and, for ``--target``s, the cost to reach each
(``cost_target``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..safe_write import atomic_write_text
from .compare import ComparisonTable, _baselines, _compare_runs, _plot_table, provenance_lines
from .cost_target import (Target, TargetRow, check_targets, cost_metrics, has_costs, parse_targets, plot_cost_curves,
                          resolve, target_rows, targets_markdown, targets_rich)
from .fmt import _md_escape
from .plots import CURVES_FILE
from .runs_view import StrPath, _load_all, _Run
from .sections import split_runs
from .selection import Selection

__all__ = ["HTML_FILE", "MD_FILE", "Report", "Section", "plan_report", "write_report"]

MD_FILE = "report.md"
HTML_FILE = "report.html"
COST_FILE = "cost.png"


@dataclass(frozen=True)
class Section:
    """One task's (and dataset's) runs: its comparison ``table``, the runs of each of its groups (``members``,
    in the table's group order), the file name of its curves and a ``note`` (why its baseline is not the one
    asked for, which asked metrics it does not log), empty when there is nothing to say."""

    title: str
    slug: str
    table: ComparisonTable
    members: tuple[tuple[_Run, ...], ...]
    curves: str
    note: str = ""
    #: each group against each ``--target`` (``cost_target.TargetRow``), and the cost figure's file name and
    #: metrics (None and () where no run of the section logs costs)
    targets: tuple[TargetRow, ...] = ()
    cost_curves: str | None = None
    cost_metrics: tuple[str, ...] = ()

    @property
    def runs(self) -> list[_Run]:
        return [r for group in self.members for r in group]


@dataclass(frozen=True)
class Report:
    """What ``report`` writes: its sections in the order their first run was given, the runs, and the
    titles of the sections left out because they log none of the asked ``--metric``s."""

    sections: tuple[Section, ...]
    runs: tuple[_Run, ...]
    left_out: tuple[str, ...] = ()
    chosen: bool = False  # metrics were asked for (the curves then show them all)

    @property
    def files(self) -> list[str]:
        """The file names written into the report folder."""
        return [MD_FILE, HTML_FILE, *(s.curves for s in self.sections),
                *(s.cost_curves for s in self.sections if s.cost_curves)]

    def print(self, console: Any) -> None:
        """Each section's comparison table and paired comparisons on a ``rich`` console, under a rule with the
        section's title when there are several."""
        from rich.markup import escape

        for s in self.sections:
            if len(self.sections) > 1:
                console.rule(escape(s.title))
            console.print(s.table.to_rich())
            if (paired := s.table.comparison_rich()) is not None:
                console.print(paired)
            if s.targets:
                console.print(targets_rich(s.targets))

    @property
    def table(self) -> ComparisonTable:
        """The comparison table of a report with one section; a ``ValueError`` naming the sections otherwise
        (each has its own: ``sections[i].table``)."""
        if len(self.sections) != 1:
            raise ValueError(f"{len(self.sections)} sections ({', '.join(s.title for s in self.sections)}): "
                             "take each one's table from .sections")
        return self.sections[0].table


def plan_report(run_dirs: Iterable[StrPath], metrics: list[str] | None = None, *, baseline: str | None = None,
                select: str = "final", targets: Sequence[str] | Sequence[Target] | None = None) -> Report:
    """Load the runs, split them into sections (``sections.split_runs``) and compare each: ``metrics`` (the
    section's default evaluation metrics when None; those of them its runs log otherwise, and a section that
    logs none of them is left out), ``baseline`` (a group's label or a sweep variant's name, in the sections
    that have it; the others compare with their first group and say so) and ``select`` as in ``compare``.
    ``targets`` (``--target``: ``0.9`` on each section's primary metric, or ``test/acc=0.9``) add the cost to
    reach each (``cost_target``). Raises ``ConfigError`` for a baseline no section has, a bad protocol or a bad
    target, ``ValueError`` for a metric no run logs."""
    runs = _load_all(run_dirs)
    goals = tuple(t for t in targets or () if isinstance(t, Target)) + parse_targets(
        [t for t in targets or () if not isinstance(t, Target)])
    check_targets(goals, runs)
    if metrics is not None:
        absent = [m for m in metrics if not any(m in r.series for r in runs)]
        if absent:
            raise ValueError(f"metric(s) not logged by any run: {', '.join(absent)}")
    selection = Selection.parse(select)
    parts = split_runs(runs)
    sections, left_out, missed = [], [], []
    for part in parts:
        mine = None if metrics is None else [m for m in metrics if any(m in r.series for r in part.runs)]
        if mine == []:
            left_out.append(part.title)
            continue
        note = ""
        if mine is not None and len(mine) < len(metrics or []):
            note = f"Not logged here: {', '.join(m for m in metrics or [] if m not in mine)}."
        try:
            table, members = _compare_runs(list(part.runs), mine, baseline, selection)
        except ConfigError:
            if baseline is None:
                raise
            table, members = _compare_runs(list(part.runs), mine, None, selection)
            missed.append(table)
            note = (f"The baseline {baseline} is not among these runs: compared with {table.baseline}. {note}").strip()
        curves = CURVES_FILE if len(parts) == 1 else f"curves-{part.slug}.png"
        directions = {r.metric: r.higher_is_better for r in table.rows}
        primary = part.runs[0].primary
        for m in {t.metric or primary for t in goals} - {None, *directions}:  # logged here, not in the table
            dirs = {r.direction(m) for r in part.runs if m in r.series}
            directions[m] = dirs.pop() if len(dirs) == 1 else None
        logged = {k for r in part.runs for k in r.series}
        resolved = resolve(goals, primary, directions, logged)
        rows = target_rows(table.groups, members, resolved)
        cost_file, shown = None, ()
        if any(has_costs(r) for r in part.runs):
            shown = tuple(cost_metrics(resolved, table.metrics, primary, metrics is not None, directions))
            cost_file = (COST_FILE if len(parts) == 1 else f"cost-{part.slug}.png") if shown else None
        sections.append(Section(part.title, part.slug, table, tuple(tuple(m) for m in members), curves, note,
                                rows, cost_file, shown))
    if baseline is not None and len(missed) == len(sections):  # no section has it: name every group
        _baselines([g for t in missed for g in t.groups], baseline)
    return Report(tuple(sections), tuple(runs), tuple(left_out), metrics is not None)


def _section_markdown(s: Section, level: str) -> list[str]:
    """A section of ``report.md``: its table, its comparisons with the baseline, its groups and curves, with
    headings at ``level`` (``"##"`` for a one-section report, ``"###"`` under a section's heading)."""
    table = s.table
    lines = [table.to_markdown()]
    if s.note:
        lines += [s.note, ""]
    if table.comparisons:
        lines += [f"{level} Compared with the baseline ({_md_escape(table.baseline or '')})", "",
                  table.comparison_markdown()]
    lines += [f"{level} Groups", "", table.grouping_note(), ""]
    for g, text in zip(table.groups, table.group_lines()):
        dirs = ", ".join(f"`{d}`" for d in g.run_dirs)
        lines.append(f"- **{_md_escape(g.label)}**{_md_escape(text[len(g.label):])} — {dirs}")
    lines += ["", f"{level} Curves", "", f"![comparison curves]({s.curves})", ""]
    if s.targets:
        lines += [f"{level} Cost to target", "", targets_markdown(s.targets)]
    if s.cost_curves:
        lines += [f"{level} Metric against cost", "", f"![metric against cost]({s.cost_curves})", ""]
    return lines


def report_markdown(rep: Report) -> str:
    """``report.md``: one section as the single-task report always was; several under a contents list,
    then the provenance of every run."""
    lines = ["# FedSight comparison", ""]
    if len(rep.sections) == 1 and not rep.left_out:
        lines += _section_markdown(rep.sections[0], "##")
    else:
        lines += [f"{len(rep.runs)} runs in {len(rep.sections)} sections, one per task (and dataset where the "
                  "metrics differ); each compares only its own runs on the metrics they log, and has its own "
                  "baseline (its first group unless --baseline names one of its groups). Also in report.html.", ""]
        lines += [f"- {_md_escape(s.title)}: {len(s.table.groups)} group{'s' if len(s.table.groups) != 1 else ''}, "
                  f"{len(s.runs)} run{'s' if len(s.runs) != 1 else ''}" for s in rep.sections]
        if rep.left_out:
            lines.append(f"- not shown (they log none of the asked metrics): {', '.join(rep.left_out)}")
        lines.append("")
        for s in rep.sections:
            lines += [f"## {_md_escape(s.title)}", ""] + _section_markdown(s, "###")
    return "\n".join(lines + provenance_lines(rep.runs))


def write_report(rep: Report, out_dir: StrPath) -> list[Path]:
    """Write the curves of each section, ``report.md`` and ``report.html`` into ``out_dir`` (each by the atomic
    writer: ``fedsight.safe_write``); return their paths (``rep.files``)."""
    from .html import report_html

    out = Path(out_dir)
    for s in rep.sections:
        _plot_table(s.table, s.members, out / s.curves, chosen=rep.chosen)
        if s.cost_curves:
            goals: dict[str, list[float]] = {}
            for t in s.targets:
                if t.value not in goals.setdefault(t.metric, []):
                    goals[t.metric].append(t.value)
            directions = {r.metric: r.higher_is_better for r in s.table.rows}
            directions.update({t.metric: t.higher for t in s.targets})
            plot_cost_curves(s.table.groups, s.members, s.cost_metrics, goals, directions, out / s.cost_curves)
    atomic_write_text(out / MD_FILE, report_markdown(rep))
    atomic_write_text(out / HTML_FILE, report_html(rep, out))
    return [out / f for f in rep.files]


def report(run_dirs: Iterable[StrPath], out_dir: StrPath, metrics: list[str] | None = None, *,
           baseline: str | None = None, select: str = "final",
           targets: Sequence[str] | Sequence[Target] | None = None) -> Report:
    """Write ``out_dir/report.md``, ``out_dir/report.html`` and the curves of the given runs, a section per
    task; return the ``Report`` (its ``sections``, each with its ``ComparisonTable``). ``metrics``, ``baseline`` and
    ``select`` as in ``compare``, ``targets`` as in ``plan_report``; nothing is written when they are wrong."""
    rep = plan_report(run_dirs, metrics, baseline=baseline, select=select, targets=targets)
    write_report(rep, out_dir)
    return rep
