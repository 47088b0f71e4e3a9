"""Curves: figure helpers, one run's metrics against round (``plot_run``), mean curves over seeds and the
overlaid curves of run groups that ``plot_comparison`` and ``report`` draw."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..runs import METRICS_FILE
from .fmt import _direction_text
from .runs_view import RunGroup, StrPath, _display_order, _is_headline, _load_all, _Run, _Series

CURVES_FILE = "curves.png"
_DPI = 120
#: combined with the colour cycle so that every curve of a figure looks different (4 and 7 are coprime)
_LINESTYLES = ("-", "--", ":", "-.")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X")
_PREFIX_TITLES = {
    "test": "Test",
    "val": "Validation",
    "local": "Per-client (local) evaluation",
    "train": "Training",
    "time": "Time per round",
}


def _panel_groups(keys: Sequence[str], series: dict[str, _Series],
                  direction: Callable[[str], bool | None]) -> list[tuple[str, list[str]]]:
    """Split metric keys into subplots: by prefix and by direction (``direction(key)``: True higher is
    better, False lower, None none), losses apart from the rest, and (except for time) values more than
    10x apart in magnitude on separate axes (accuracy vs PSNR). Titles say the direction, if any."""
    buckets: dict[tuple[str, bool, bool | None], list[str]] = {}
    for k in keys:
        prefix = k.split("/", 1)[0] if "/" in k else ""
        is_loss = "loss" in k.rsplit("/", 1)[-1]
        buckets.setdefault((prefix, is_loss, direction(k)), []).append(k)
    panels: list[tuple[str, list[str]]] = []
    for (prefix, is_loss, higher), ks in buckets.items():
        base = _PREFIX_TITLES.get(prefix, f"Test ({prefix[5:]})" if prefix.startswith("test_")
                                  else prefix.capitalize() if prefix else "Other")
        better = _direction_text(higher)
        if prefix == "time":
            panels.append((f"{base} (s, {better})" if better else f"{base} (s)", ks))
            continue
        title = f"{base} loss" if is_loss else (base if prefix in ("local", "") else f"{base} metrics")
        if better:
            title += f" ({better})"
        # cluster by magnitude so small-range metrics are not flattened by large-range ones; magnitudes
        # below 0.1 count as 0.1 so an all-zero or tiny series joins its neighbours
        mags = {k: max(float(np.nanmax(np.abs(v))) if np.any(np.isfinite(v := series[k].values)) else 0.0, 0.1)
                for k in ks}
        clusters: list[list[str]] = []
        for k in sorted(ks, key=lambda k: mags[k]):
            if clusters and mags[k] <= 10 * mags[clusters[-1][0]]:
                clusters[-1].append(k)
            else:
                clusters.append([k])
        order = {k: i for i, k in enumerate(ks)}
        for c in sorted(clusters, key=lambda c: min(order[k] for k in c)):
            c.sort(key=order.__getitem__)
            panels.append((title, c))
    return panels


def _new_figure(n_panels: int, title: str) -> tuple[Any, list[Any]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncols = min(3, n_panels)
    nrows = math.ceil(n_panels / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(max(5.0 * ncols, 6.5), 3.6 * nrows + 0.5), squeeze=False,
                             layout="constrained")
    flat = list(axes.ravel())
    for ax in flat[n_panels:]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=13)
    return fig, flat[:n_panels]


def line_style(i: int, colors: Sequence[str] | None = None) -> dict[str, Any]:
    """``color``, ``linestyle`` and ``marker`` of the ``i``-th curve (0-based) of an axes, distinct for every
    ``i`` and the same for the same ``i``.

    ``colors`` defaults to matplotlib's colour cycle (10 colours). Curve ``i`` takes colour
    ``i % len(colors)``; pass ``k = i // len(colors)`` through the colours changes the line style
    (``-``, ``--``, ``:``, ``-.``: ``k % 4``) and the marker (7 of them: ``k % 7``) together, so the first
    28 passes differ in (line style, marker) and the first ``28 * len(colors)`` curves use plain styles;
    later passes get a dash pattern of their own, ``(0, (2 + k // 28, 1 + k % 4))``.
    """
    if colors is None:
        import matplotlib

        colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    k = i // len(colors)
    n_plain = len(_LINESTYLES) * len(_MARKERS)
    linestyle: Any = (_LINESTYLES[k % len(_LINESTYLES)] if k < n_plain
                      else (0, (2.0 + k // n_plain, 1.0 + k % len(_LINESTYLES))))
    return {"color": colors[i % len(colors)], "linestyle": linestyle, "marker": _MARKERS[k % len(_MARKERS)]}


def _markevery(n_points: int) -> int:
    """Every point carries a marker up to 30 points; longer curves about 20 markers (markers tell curves
    of the same colour apart)."""
    return 1 if n_points <= 30 else math.ceil(n_points / 20)


def _style_axes(ax: Any, title: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=10.5)
    ax.set_xlabel("round")
    ax.set_ylabel(ylabel)
    integer_rounds(ax)
    ax.grid(True, alpha=0.3)


def integer_rounds(ax: Any) -> None:
    """Whole-number ticks on a round axis. ``MaxNLocator(integer=True)`` alone still puts ``1.900 ... 2.100`` on
    an axis whose data span less than one round (one evaluated round), so such an axis is widened to one round
    either side first."""
    from matplotlib.ticker import MaxNLocator

    lo, hi = ax.get_xlim()
    if hi - lo < 1:
        mid = round((lo + hi) / 2)
        ax.set_xlim(mid - 1, mid + 1)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _fold_offset_texts(fig: Any) -> None:
    """Keep matplotlib's offset text (``+2.812e1`` or ``1e-6`` above a y axis, beside an x axis) from
    overprinting panel titles: no axis of ``fig`` gets an additive offset (tick labels show the values
    themselves, ``28.1232``), and an axis whose values need a power-of-ten multiplier keeps the one it
    has now for good and names it in its label (``train/loss (×1e-7)``) instead of the offset text."""
    import matplotlib
    from matplotlib.ticker import ScalarFormatter

    lo, hi = matplotlib.rcParams["axes.formatter.limits"]  # as ScalarFormatter: a multiplier outside (lo, hi)
    for ax in fig.axes:
        if not ax.get_visible():
            continue
        for axis in (ax.xaxis, ax.yaxis):
            fmt = axis.get_major_formatter()
            if not isinstance(fmt, ScalarFormatter):
                continue
            fmt.set_useOffset(False)
            top = float(np.max(np.abs(axis.get_view_interval())))
            oom = math.floor(math.log10(top)) if math.isfinite(top) and top > 0 else 0
            if lo < oom < hi:
                fmt.set_scientific(False)
            else:  # fixed, so that the layout cannot change it after the label names it
                fmt.set_powerlimits((oom, oom))
                axis.set_label_text(f"{axis.get_label_text()} (×1e{oom})".strip())
            axis.get_offset_text().set_visible(False)


def _save(fig: Any, path: Path) -> Path:
    """Write ``fig`` as a PNG at ``path`` (atomically; offset texts folded into axis labels first) and close it."""
    import matplotlib.pyplot as plt

    import io

    from ..safe_write import atomic_write_bytes

    _fold_offset_texts(fig)
    buf = io.BytesIO()
    fig.savefig(buf, dpi=_DPI, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())  # a failed replace (a folder in the way) leaves no temporary file
    return path


def plot_run(run_dir: StrPath, keys: list[str] | None = None) -> Path:
    """Plot the metrics of one run against round into ``RUN_DIR/plots/curves.png``; return its path.

    ``keys`` defaults to every numeric key present except "round", members of per-class families
    (``test/iou/road``) and a model selection's ``selected/*`` (one value, after the last round). Panels
    (``fedsight.reporting.run_panels``): a series equal to another drawn once (``psnr`` = ``psnr_y``), constant bookkeeping (``clients/*``, per-round bytes) named in a note line instead of
    drawn, upload and download told apart, metrics at several input sizes one panel per metric (a line per size)
    plus the primary metric against the input size; the rest share a subplot by prefix (``test/*``, ``local/*``,
    ``train/*``, ``time/*``) and direction (from the run's ``run.json``), with losses on their own axes and metrics
    of very different magnitude (accuracy vs PSNR) split apart. Axes carry units (MB, GFLOP, dB, %), round axes
    whole numbers. Stage changes are marked with dashed lines. Event lines are ignored.
    """
    from .partition import read_partition
    from .run_panels import plan_panels

    run = _Run.load(run_dir)
    series = run.series
    if keys is None:  # (not the selected model's numbers: one value, after the last round; summary.md has them)
        keys = [k for k in series if _is_headline(k) and not k.startswith("selected/")]
    missing = [k for k in keys if k not in series]
    if missing:
        raise ValueError(f"{run.path / METRICS_FILE}: no numeric values for {', '.join(missing)}")
    if not keys:
        raise ValueError(f"{run.path / METRICS_FILE}: no metrics to plot")

    task = run.config.get("task")
    task_name = task.get("name") if isinstance(task, dict) else task if isinstance(task, str) else None
    panels, notes = plan_panels(
        _display_order(keys), series, run.direction,
        lambda ks: _panel_groups(ks, series, run.direction) if ks else [],
        task=task_name, primary=run.primary, partition=read_partition(run.path), style=line_style)
    stages = run.stages
    title = run.name + (f", seed {run.seed}" if run.seed is not None else "")
    if len(stages) > 1:
        title += f"  (stages: {' → '.join(s for s, _ in stages)}, dashed lines)"
    fig, axes = _new_figure(len(panels), title)
    for ax, panel in zip(axes, panels):
        for line in panel.lines:
            ax.plot(line.x, line.y, label=line.label, markersize=3 if panel.x == "round" else 5, linewidth=1.5,
                    markevery=_markevery(len(line.x)), **line.style)
        if panel.x == "size":
            _style_size_axes(ax, panel)
            continue
        if len(stages) > 1:
            for stage, start in stages[1:]:
                ax.axvline(start - 0.5, color="0.5", linestyle="--", linewidth=0.8)
                ax.text(start - 0.5, 0.98, f" {stage}", transform=ax.get_xaxis_transform(), fontsize=7,
                        color="0.35", ha="left", va="top")
        _style_axes(ax, panel.title, panel.ylabel)
        ax.legend(fontsize=8, loc="best")
    if notes:
        import textwrap

        width = int(16 * fig.get_figwidth())  # characters of 9-point text a line, about
        fig.supxlabel("\n".join(textwrap.fill(n, width) for n in notes), fontsize=9, x=0.01, ha="left",
                      color="0.25")
    return _save(fig, run.path / "plots" / CURVES_FILE)


def _style_size_axes(ax: Any, panel: Any) -> None:
    """A panel against input size: categorical sizes (smallest left), the training rungs shaded and labelled."""
    labels = list(panel.xticks)
    for lo, hi, text in panel.spans:
        ax.axvspan(lo, hi, color="0.88", zorder=0)
        i = round((lo + hi) / 2)
        labels[i] = f"{labels[i]}\n{text.replace(': ', chr(10))}"
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_xlim(-0.5, len(labels) - 0.5)
    ax.set_title(panel.title, fontsize=10.5)
    ax.set_xlabel("input size (H x W; shaded: a training rung)")
    ax.set_ylabel(panel.ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best")


# -- several runs -----------------------------------------------------------------------------------


def _mean_curve_runs(runs: Sequence[_Run], metric: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    have = [r.series[metric] for r in runs if metric in r.series]
    if not have:
        return np.zeros(0, np.int64), np.zeros(0), np.zeros(0)
    common = have[0].rounds
    for s in have[1:]:
        common = np.intersect1d(common, s.rounds)
    stacked = np.stack([s.values[np.searchsorted(s.rounds, common)] for s in have])
    std = stacked.std(axis=0, ddof=1) if len(have) >= 2 else np.zeros(len(common))
    return common, stacked.mean(axis=0), std


def std_band(runs: Sequence[_Run], metric: str, mean: np.ndarray, std: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The band drawn around a mean curve: mean ± std, its lower edge clipped at 0 for a metric no run ever logged
    below 0 (seconds, bytes, epsilon, accuracies), so that the figure shows no value the metric cannot take."""
    lo = mean - std
    if all(float(np.min(r.series[metric].values, initial=0.0)) >= 0 for r in runs if metric in r.series):
        lo = np.maximum(lo, 0.0)
    return lo, mean + std


def mean_curve(run_dirs: Iterable[StrPath], metric: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(rounds, mean, std)`` of ``metric`` over the given runs (typically one group's seeds).

    Curves are aligned on the rounds where every run that logged the metric has a value, so a run
    interrupted early shortens the curve rather than skewing its tail. std is the sample std (ddof=1),
    zeros for a single run.
    """
    return _mean_curve_runs(_load_all(run_dirs), metric)


def _plot_groups(groups: Sequence[RunGroup], metrics: Sequence[str], members: Sequence[Sequence[_Run]],
                 directions: Mapping[str, bool | None], path: Path) -> Path:
    """One subplot per metric, one mean ± std line per group (``line_style`` of the group's index, the same
    in every subplot; the band as ``std_band``); titles say each metric's direction."""
    if not metrics:
        raise ValueError("no metrics to plot")
    n_seeds = sorted({len(g.run_dirs) for g in groups})
    seeds_text = (f"{n_seeds[0]} seed{'s' if n_seeds[0] != 1 else ''}" if len(n_seeds) == 1
                  else f"{n_seeds[0]}–{n_seeds[-1]} seeds")
    fig, axes = _new_figure(len(metrics), f"Comparison: mean ± std over {seeds_text} per run group")
    handles: dict[str, Any] = {}
    for ax, m in zip(axes, metrics):
        shown: set[int] = set()
        for gi, (group, runs) in enumerate(zip(groups, members)):
            rounds, mean, std = _mean_curve_runs(runs, m)
            if len(rounds) == 0:
                continue
            shown.update(int(r) for r in rounds)
            style = line_style(gi)
            (line,) = ax.plot(rounds, mean, linewidth=1.6, label=group.label, markersize=3,
                              markevery=_markevery(len(rounds)), **style)
            if len(runs) >= 2:
                ax.fill_between(rounds, *std_band(runs, m, mean, std), color=style["color"], alpha=0.2, linewidth=0)
            handles.setdefault(group.label, line)
        ylabel = "seconds" if m.startswith("time") else m.rsplit("/", 1)[-1]
        better = _direction_text(directions.get(m))
        _style_axes(ax, f"{m} ({better})" if better else m, ylabel)
        if len(shown) == 1:  # one evaluated round: its number, not fractional ticks around it
            ax.set_xticks(sorted(shown))
    labels, ncol = _legend_layout(list(handles), fig.get_figwidth())
    fig.legend(list(handles.values()), labels, loc="outside lower center", ncol=ncol, frameon=False,
               fontsize=_LEGEND_PT)
    return _save(fig, path)


#: legend font size (points) of comparison figures, and the width of one of its characters (inches, an upper
#: estimate for DejaVu Sans) and of an entry's line sample and padding
_LEGEND_PT = 9
_CHAR_IN = 0.6 * _LEGEND_PT / 72
_HANDLE_IN = 0.75


def _legend_layout(labels: Sequence[str], fig_width: float) -> tuple[list[str], int]:
    """Labels and a column count for a legend below the panels that stays inside a figure ``fig_width``
    inches wide: as many columns of the widest label as fit, and labels longer than a whole row wrapped."""
    import textwrap

    fit = max(10, int((fig_width - 0.4 - _HANDLE_IN) / _CHAR_IN))  # characters that fit in one column
    labels = ["\n".join(textwrap.wrap(t, fit)) if len(t) > fit else t for t in labels]
    widest = max((max(len(line) for line in t.split("\n")) for t in labels), default=1)
    ncol = max(1, min(len(labels), int((fig_width - 0.4) / (_HANDLE_IN + widest * _CHAR_IN))))
    return labels, ncol
