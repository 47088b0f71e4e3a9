"""Cost figures and cost to a target (thesis Figs. 3.10-3.13, 4.5-4.6; Tables 4.7-4.10): a metric against the
cumulative communication and the cumulative client computation a run spent, and the rounds, bytes and FLOPs a
run needed to first reach a target value.

Everything comes from the per-round ``cost/total_up_bytes``, ``cost/total_down_bytes`` and ``cost/total_flops``
every engine logs (``fedsight.cost``: bytes on the wire, client FLOPs with backward = 2 forward). Choices:

* **Communication** is up + down bytes, summed over every client of every round (the thesis's "total
  communication", Tables 3.7 and 4.7-4.8). **Computation** is the client FLOPs of every client together
  ("client FLOPs, all clients"), and per client: that total divided by the federation's K clients (config
  ``partition.num_clients``), the thesis's cumulative average cost per client T_t = T t kappa / K (Sec. 3.9.2,
  Tables 4.9-4.10); "—" where the config names no client count.
* The cost *at* round r is the cumulative total logged at the last round <= r (0 before the first round: an
  initial evaluation, round 0, has spent nothing).
* **Reached** is the first evaluated round whose value is >= the target (a higher-is-better metric) or <= it
  (lower is better), the thesis's "rounds to target accuracy" (Fig. 3.10). A NaN value never reaches.
* A group's row gives, over its seeds, the mean and the 95% Student-t interval of the mean (the report's
  ``paired.CONFIDENCE``; none for one seed). Where some seed never reached the target, the row says "not
  reached" and by how many seeds, and gives no number: a mean over the seeds that did reach it would hide the
  others (the thesis's N/A).
* A target is ``VALUE`` (each section's primary metric) or ``METRIC=VALUE``; a metric no run logs, one with no
  direction, or a value that is not a finite number is refused by ``parse_targets``/``check_targets`` in one
  line naming ``--target``.
* The cost figure draws, per metric, one panel against round, one against cumulative communication and one
  against cumulative client computation: each group's mean curve (x and y the means over its seeds at the
  rounds all its seeds evaluated) with a ±std band of the metric, and the target as a dotted line.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError
from .fmt import _fmt, _md_escape, _metric_label
from .paired import CONFIDENCE
from .runs_view import RunGroup, _Run
from .units import human, scale_for

__all__ = ["COST_KEYS", "Target", "TargetRow", "cost_metrics", "has_costs", "parse_targets", "plot_cost_curves",
           "reach", "target_rows"]

#: the cumulative cost series each axis sums
COST_KEYS = {"bytes": ("cost/total_up_bytes", "cost/total_down_bytes"), "flops": ("cost/total_flops",)}
AXIS_LABELS = {"round": "round", "bytes": "cumulative communication, up + down",
               "flops": "cumulative client computation, all clients"}
#: at most this many metrics (rows of panels) in a cost figure
MAX_COST_METRICS = 4


@dataclass(frozen=True)
class Target:
    """A target ``value`` of ``metric`` (None: each section's primary metric); ``text`` as given."""

    metric: str | None
    value: float
    text: str


def parse_targets(texts: Sequence[str] | None) -> tuple[Target, ...]:
    """``--target`` values: ``0.9`` or ``test/acc=0.9``; a ``ConfigError`` naming the bad one."""
    out = []
    for text in texts or ():
        metric, _, value = text.rpartition("=")
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not math.isfinite(number) or (metric == "" and "=" in text):
            raise ConfigError(f"--target {text}: expected VALUE or METRIC=VALUE with a finite number (0.9, "
                              "test/acc=0.9)")
        out.append(Target(metric.strip() or None, number, text))
    return tuple(out)


def check_targets(targets: Sequence[Target], runs: Sequence[_Run]) -> None:
    """A ``ConfigError`` for a target whose metric no run logs or has no direction ("reached" is undefined)."""
    for t in targets:
        if t.metric is None:
            continue
        have = [r for r in runs if t.metric in r.series]
        if not have:
            raise ConfigError(f"--target {t.text}: no run logs {t.metric}")
        if all(r.direction(t.metric) is None for r in have):
            raise ConfigError(f"--target {t.text}: {t.metric} has no direction in the runs' run.json, so "
                              "'reached' is undefined")


def has_costs(run: _Run) -> bool:
    return all(k in run.series for keys in COST_KEYS.values() for k in keys)


def cost_at(run: _Run, axis: str, rnd: int) -> float:
    """The cumulative cost on ``axis`` ("bytes" or "flops") at round ``rnd``: the totals logged at the last
    round <= ``rnd`` (0 before any)."""
    total = 0.0
    for key in COST_KEYS[axis]:
        s = run.series[key]
        i = int(np.searchsorted(s.rounds, rnd, side="right")) - 1
        total += float(s.values[i]) if i >= 0 else 0.0
    return total


def num_clients(run: _Run) -> int | None:
    part = run.config.get("partition")
    k = part.get("num_clients") if isinstance(part, dict) else None
    return k if isinstance(k, int) and not isinstance(k, bool) and k > 0 else None


@dataclass(frozen=True)
class Reach:
    """Where one run first reached a target: the round and the cumulative costs there (None where the run
    logs no costs; per-client FLOPs None without a client count)."""

    round: int
    bytes: float | None
    flops: float | None
    flops_per_client: float | None


def reach(run: _Run, metric: str, value: float, higher: bool) -> Reach | None:
    """The first evaluated round of ``run`` where ``metric`` is at least (``higher``) or at most ``value``,
    with its costs; None when it never is (see the module's docstring)."""
    s = run.series.get(metric)
    if s is None:
        return None
    with np.errstate(invalid="ignore"):
        hit = s.values >= value if higher else s.values <= value
    idx = np.flatnonzero(hit)
    if not len(idx):
        return None
    rnd = int(s.rounds[idx[0]])
    if not has_costs(run):
        return Reach(rnd, None, None, None)
    flops = cost_at(run, "flops", rnd)
    k = num_clients(run)
    return Reach(rnd, cost_at(run, "bytes", rnd), flops, flops / k if k else None)


def mean_ci(values: Sequence[float]) -> tuple[float, tuple[float, float] | None]:
    """Mean and its ``CONFIDENCE`` Student-t interval (n - 1 degrees of freedom; None below 2 values)."""
    from scipy import stats

    arr = np.asarray(values, dtype=np.float64)
    mean = float(arr.mean())
    if len(arr) < 2:
        return mean, None
    half = float(stats.t.ppf((1 + CONFIDENCE) / 2, len(arr) - 1)) * float(arr.std(ddof=1)) / math.sqrt(len(arr))
    return mean, (mean - half, mean + half)


@dataclass(frozen=True)
class TargetRow:
    """One group against one target: ``reaches`` holds each run's ``Reach`` (None: never reached), in the
    group's run order."""

    group: str
    metric: str
    value: float
    higher: bool
    reaches: tuple[Reach | None, ...]

    @property
    def n(self) -> int:
        return len(self.reaches)

    @property
    def reached(self) -> int:
        return sum(r is not None for r in self.reaches)

    def stat(self, field: str) -> tuple[float, tuple[float, float] | None] | None:
        """(mean, CI) of ``field`` ("round", "bytes", "flops", "flops_per_client") over the seeds, None unless
        every seed reached the target and has that number."""
        if not self.reaches or self.reached < self.n:
            return None
        vals = [getattr(r, field) for r in self.reaches]
        return None if any(v is None for v in vals) else mean_ci(vals)

    def cells(self) -> list[str]:
        """(reached, rounds, communication, computation all clients, per client), as the tables show them."""
        if self.reached < self.n:
            missed = self.n - self.reached
            text = "not reached" + (f" by {missed} of {self.n} seeds" if self.n > 1 else "")
            return [f"{self.reached}/{self.n}", text, "—", "—", "—"]
        units = {"round": "", "bytes": "B", "flops": "FLOP", "flops_per_client": "FLOP"}
        out = [f"{self.reached}/{self.n}"]
        for field, unit in units.items():
            got = self.stat(field)
            if got is None:
                out.append("—")
                continue
            mean, ci = got
            one = (lambda v: f"{v:.1f}") if unit == "" else (lambda v, u=unit: human(v, u))
            out.append(one(mean) if ci is None else f"{one(mean)} [{one(ci[0])}, {one(ci[1])}]")
        return out


#: the console's narrower headers (the interval goes on a line of its own there)
SHORT_HEADERS = ("reached", "rounds", "bytes up+down", "client FLOPs", "per client")
HEADERS = ("seeds reached", "rounds", "communication (up + down)", "client FLOPs, all clients", "per client (÷ K)")


def resolve(targets: Sequence[Target], primary: str | None, directions: Mapping[str, bool | None],
            logged: set[str]) -> list[tuple[str, float, bool]]:
    """The (metric, value, higher) a section tabulates: a bare value on its primary metric, a named metric
    where the section's runs log it with a direction."""
    out = []
    for t in targets:
        metric = t.metric or primary
        if metric is None or metric not in logged:
            continue
        higher = directions.get(metric)
        if higher is None:
            continue
        if (metric, t.value, higher) not in out:
            out.append((metric, t.value, higher))
    return out


def target_rows(groups: Sequence[RunGroup], members: Sequence[Sequence[_Run]],
                resolved: Sequence[tuple[str, float, bool]]) -> tuple[TargetRow, ...]:
    """A row per target and group, groups in table order."""
    return tuple(TargetRow(g.label, m, v, hi, tuple(reach(r, m, v, hi) for r in runs))
                 for m, v, hi in resolved for g, runs in zip(groups, members))


def _target_label(row: TargetRow) -> str:
    return f"{_metric_label(row.metric, row.higher)} {'≥' if row.higher else '≤'} {_fmt(row.value)}"


NOTE = (f"Cost to target: the first evaluated round each run reached the target, and the cumulative cost there "
        f"(bytes up + down, client FLOPs of all clients and per client: ÷ K = partition.num_clients); mean over "
        f"the seeds [{CONFIDENCE:.0%} Student-t CI], no interval for one seed. A group with a seed that never "
        "reached it shows 'not reached' and no number.")


def targets_markdown(rows: Sequence[TargetRow]) -> str:
    lines = [NOTE, "", "| target | run | " + " | ".join(HEADERS) + " |", "|---|---|" + "---:|" * len(HEADERS)]
    for r in rows:
        lines.append(f"| {_md_escape(_target_label(r))} | {_md_escape(r.group)} | "
                     + " | ".join(_md_escape(c) for c in r.cells()) + " |")
    return "\n".join(lines) + "\n"


def targets_rich(rows: Sequence[TargetRow]) -> Any:
    """The table on a ``rich`` console (one section per target)."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="Cost to target", caption=escape(NOTE), caption_justify="left")
    table.add_column("target", style="cyan", overflow="fold")
    table.add_column("run", overflow="fold")
    for h in SHORT_HEADERS:
        table.add_column(h, justify="right", overflow="fold")
    for i, r in enumerate(rows):
        first = i == 0 or _target_label(rows[i - 1]) != _target_label(r)
        last = i + 1 == len(rows) or _target_label(rows[i + 1]) != _target_label(r)
        cells = [escape(c.replace(" [", "\n[").replace("not reached by", "not reached\nby")) for c in r.cells()]
        table.add_row(_target_label(r) if first else "", escape(r.group), *cells, end_section=last)
    return table


def targets_html(rows: Sequence[TargetRow]) -> str:
    e = html.escape
    out = [f"<p class=note>{e(NOTE)}</p>", "<table><thead><tr><th>target</th><th>run</th>"
           + "".join(f"<th>{e(h)}</th>" for h in HEADERS) + "</tr></thead>"]
    by_target: dict[str, list[TargetRow]] = {}
    for r in rows:
        by_target.setdefault(_target_label(r), []).append(r)
    for label, rs in by_target.items():
        out.append("<tbody>")
        for i, r in enumerate(rs):
            first = f'<td rowspan="{len(rs)}">{e(label)}</td>' if i == 0 else ""
            cells = "".join(f"<td class=num>{e(c).replace(' [', '<br>[')}</td>" for c in r.cells())  # CI below
            out.append(f"<tr>{first}<td>{e(r.group)}</td>{cells}</tr>")
        out.append("</tbody>")
    return "\n".join(out + ["</table>"])


# -- the figure -------------------------------------------------------------------------------------------------


def cost_metrics(resolved: Sequence[tuple[str, float, bool]], shown: Sequence[str], primary: str | None,
                 chosen: bool, directions: Mapping[str, bool | None]) -> list[str]:
    """The figure's metrics: the targets' metrics, then the asked ``--metric``s with a direction (``chosen``)
    or else the primary metric; at most ``MAX_COST_METRICS``."""
    from ..metric_table import is_budget

    rest = [m for m in shown if directions.get(m) is not None and not is_budget(m)] if chosen else [primary]
    out = list(dict.fromkeys([m for m, _, _ in resolved] + [m for m in rest if m in shown]))
    return out[:MAX_COST_METRICS]


def _mean_cost_curve(runs: Sequence[_Run], metric: str, axis: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x, mean, std) of ``metric`` over the runs that log it and their costs, at the rounds all evaluated; x
    the round or the mean cumulative cost there."""
    have = [r for r in runs if metric in r.series and (axis == "round" or has_costs(r))]
    if not have:
        return np.zeros(0), np.zeros(0), np.zeros(0)
    common = have[0].series[metric].rounds
    for r in have[1:]:
        common = np.intersect1d(common, r.series[metric].rounds)
    ys = np.stack([r.series[metric].values[np.searchsorted(r.series[metric].rounds, common)] for r in have])
    if axis == "round":
        x = common.astype(np.float64)
    else:
        x = np.array([[cost_at(r, axis, int(c)) for c in common] for r in have]).mean(axis=0)
    std = ys.std(axis=0, ddof=1) if len(have) >= 2 else np.zeros(len(common))
    return x, ys.mean(axis=0), std


def plot_cost_curves(groups: Sequence[RunGroup], members: Sequence[Sequence[_Run]], metrics: Sequence[str],
                     targets: Mapping[str, Sequence[float]], directions: Mapping[str, bool | None],
                     path: Path) -> Path:
    """The cost figure (see the module's docstring) at ``path``: a row of three panels per metric."""
    from .fmt import _direction_text
    from .plots import _legend_layout, _markevery, _new_figure, _save, integer_rounds, line_style, std_band

    axes_names = ("round", "bytes", "flops")
    n_seeds = sorted({len(g.run_dirs) for g in groups})
    seeds = f"{n_seeds[0]}" if len(n_seeds) == 1 else f"{n_seeds[0]}–{n_seeds[-1]}"
    fig, axes = _new_figure(3 * len(metrics), f"Metric against cost: mean over {seeds} seed"
                            f"{'s' if n_seeds != [1] else ''} per run group (band: ± std of the metric)")
    handles: dict[str, Any] = {}
    for mi, m in enumerate(metrics):
        for ai, axis in enumerate(axes_names):
            ax = axes[3 * mi + ai]
            curves = [(gi, g, _mean_cost_curve(runs, m, axis)) for gi, (g, runs) in enumerate(zip(groups, members))]
            xs = [v for _, _, (x, _, _) in curves for v in x]
            factor, unit = scale_for(xs, "B" if axis == "bytes" else "FLOP") if axis != "round" else (1.0, "")
            for gi, g, (x, mean, std) in curves:
                if not len(x):
                    continue
                style = line_style(gi)
                (line,) = ax.plot(x / factor, mean, linewidth=1.6, markersize=3, markevery=_markevery(len(x)),
                                  label=g.label, **style)
                if np.any(std > 0):
                    ax.fill_between(x / factor, *std_band(members[gi], m, mean, std), color=style["color"], alpha=0.2,
                                    linewidth=0)
                handles.setdefault(g.label, line)
            for v in targets.get(m, ()):
                ax.axhline(v, color="0.35", linestyle=":", linewidth=1.0)
                ax.text(0.01, v, f" target {_fmt(v)}", transform=ax.get_yaxis_transform(), fontsize=7,
                        color="0.3", va="bottom")
            better = _direction_text(directions.get(m))
            ax.set_title(f"{m} ({better})" if better else m, fontsize=10.5)
            ax.set_xlabel(AXIS_LABELS[axis] + (f" ({unit})" if unit else ""))
            ax.set_ylabel(m.rsplit("/", 1)[-1])
            ax.grid(True, alpha=0.3)
            if axis == "round":
                integer_rounds(ax)
    if handles:
        from .plots import _LEGEND_PT

        labels, ncol = _legend_layout(list(handles), fig.get_figwidth())
        fig.legend(list(handles.values()), labels, loc="outside lower center", ncol=ncol, frameon=False,
                   fontsize=_LEGEND_PT)
    return _save(fig, path)
