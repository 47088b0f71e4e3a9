"""How a run's data was dealt out: ``RUN_DIR/partition.json`` and the clients x classes heat map."""

from __future__ import annotations

import io
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import RunFileError
from ..safe_write import atomic_write_bytes

from ..data.partition_stats import partition_summary
from .runs_view import StrPath

PARTITION_FILE = "partition.json"


def read_partition(run_dir: StrPath) -> dict[str, Any] | None:
    """``RUN_DIR/partition.json`` (per-client label counts, class names, the server validation set), or
    None when the run did not write one."""
    p = Path(run_dir) / PARTITION_FILE
    from ..runs import read_text
    from ..safe_read import exists, loads_json

    if not exists(p):
        return None
    try:
        out = loads_json(read_text(p), str(p), RunFileError)
    except json.JSONDecodeError as exc:
        raise RunFileError(f"{p}: invalid JSON ({exc})") from None
    if not isinstance(out, dict):
        raise RunFileError(f"{p}: expected a JSON object")
    return out


def describe_split(split: dict[str, Any]) -> str:
    """A server-held split of ``partition.json`` (``data.server_split.split_summary``) as one readable line:
    its size, where it came from, its extras (imbalance, fraction) and its per-class counts."""
    source = {"carve": "carved from the training pool", "dataset": "from another dataset"}.get(
        str(split.get("source")), str(split.get("source")))
    extras = ", ".join(f"{k} {v}" for k, v in split.items()
                       if k not in ("source", "size", "class_counts", "class_names") and v is not None)
    counts = split.get("class_counts") or []
    names = split.get("class_names") or [str(i) for i in range(len(counts))]
    hist = ", ".join(f"{n}: {c}" for n, c in zip(names, counts))
    return (f"{split.get('size')} examples, {source}" + (f" ({extras})" if extras else "")
            + (f"; per class {hist}" if hist else ""))


def _wrap_title(text: str, fig_width_in: float, fontsize: float) -> str:
    """``text``'s lines wrapped at spaces to the figure's width (a character of DejaVu Sans at ``fontsize`` is
    about 0.55 of it wide on average), so a long title is never cut at the figure's edges."""
    import textwrap

    chars = max(20, int(fig_width_in * 72 / (0.55 * fontsize)))
    return "\n".join(textwrap.fill(line, chars, break_long_words=True) for line in text.split("\n"))


def _tick_positions(n: int, max_ticks: int) -> np.ndarray:
    """At most about ``max_ticks`` evenly spaced positions in ``0..n-1``, starting at 0."""
    step = max(1, int(math.ceil(n / max_ticks)))
    return np.arange(0, n, step)


def plot_partition_heatmap(
    counts: np.ndarray,
    path: str | os.PathLike[str],
    class_names: Sequence[str] | None = None,
    title: str = "",
    key: str = "class",
) -> None:
    """Save ``partition_heatmap_png`` at ``path`` (temp + rename, onto a regular file only:
    ``fedsight.safe_write``)."""
    atomic_write_bytes(path, partition_heatmap_png(counts, class_names, title, key))


def partition_heatmap_png(
    counts: np.ndarray,
    class_names: Sequence[str] | None = None,
    title: str = "",
    key: str = "class",
) -> bytes:
    """A PNG (dpi 120) heat map of ``counts`` (clients down, partition keys across: classes, or
    ``key = "domain"``) with a colour bar and a side bar of client totals. Cells are annotated with counts when
    the matrix is smaller than 30 x 30."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    counts = np.asarray(counts)
    if counts.ndim != 2 or 0 in counts.shape:
        raise ValueError(f"counts must be a non-empty [clients, classes] matrix, got shape {counts.shape}")
    n_clients, n_classes = counts.shape
    names = [str(c) for c in (class_names if class_names is not None else range(n_classes))]
    if len(names) != n_classes:
        raise ValueError(f"{len(names)} class names for {n_classes} classes")
    annotate = n_clients < 30 and n_classes < 30

    cell_w = 0.45 if annotate else 0.25
    cell_h = 0.32 if annotate else 0.12
    width = 3.5 + min(n_classes, 60) * cell_w
    height = 1.8 + min(n_clients, 120) * cell_h
    fig_width = max(width, 6.0)
    fig = Figure(figsize=(fig_width, max(height, 3.5)), layout="constrained")
    FigureCanvasAgg(fig)
    gs = fig.add_gridspec(1, 3, width_ratios=[max(n_classes, 4), 2.5, 0.35])
    ax = fig.add_subplot(gs[0, 0])
    ax_tot = fig.add_subplot(gs[0, 1], sharey=ax)
    cax = fig.add_subplot(gs[0, 2])

    im = ax.imshow(counts, aspect="auto", cmap="viridis", interpolation="nearest", vmin=0)
    fig.colorbar(im, cax=cax, label="samples")
    xt = _tick_positions(n_classes, 40)
    ax.set_xticks(xt, [names[i] for i in xt], rotation=90 if max(len(s) for s in names) > 3 or n_classes > 20 else 0)
    yt = _tick_positions(n_clients, 40)
    ax.set_yticks(yt, [str(i) for i in yt])
    ax.set_xlabel(key)
    ax.set_ylabel("client")
    if annotate:
        vmax = counts.max() if counts.max() > 0 else 1
        fs = 8 if max(n_clients, n_classes) <= 15 else 6
        for i in range(n_clients):
            for j in range(n_classes):
                v = counts[i, j]
                ax.text(j, i, str(v), ha="center", va="center", fontsize=fs, color="black" if v > 0.6 * vmax else "white")

    totals = counts.sum(axis=1)
    ax_tot.barh(np.arange(n_clients), totals, height=0.8, color="0.45")
    ax_tot.set_xlabel("client total")
    ax_tot.tick_params(axis="y", labelleft=False)
    ax_tot.set_xlim(0, max(1, totals.max()) * (1.35 if n_clients <= 40 else 1.05))
    if n_clients <= 40:
        for i, t in enumerate(totals):
            ax_tot.text(t, i, f" {t}", va="center", ha="left", fontsize=7)
    ax.set_ylim(n_clients - 0.5, -0.5)
    s = partition_summary(counts)
    fig.suptitle(_wrap_title(
        (f"{title}\n" if title else "")
        + f"{n_clients} clients, {int(s['total'])} samples; client size {s['min_size']}-{s['max_size']} "
        f"(median {s['median_size']:g}); {s['mean_classes_per_client']:.1f} "
        f"{'classes' if key == 'class' else key + 's'}/client, mean Jaccard {s['mean_jaccard']:.2f}", fig_width, 10),
        fontsize=10)
    buf = io.BytesIO()
    fig.savefig(buf, dpi=120, format="png")
    return buf.getvalue()
