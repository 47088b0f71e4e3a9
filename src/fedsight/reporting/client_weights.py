"""Client weights: who the server trusted in each round, next to the data each client holds."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..runs import RunDir, read_config
from .partition import _tick_positions, read_partition
from .plots import _save
from .runs_view import StrPath, _Run

CLIENT_WEIGHTS_FILE = "client_weights.png"


def client_weight_matrix(rows: Sequence[dict[str, Any]], num_clients: int | None = None) -> tuple[np.ndarray, np.ndarray, bool]:
    """([clients, rounds] weight relative to uniform, rounds, per_key) from ``client_weights.jsonl`` rows.

    Entry (k, t) is p_k^t * |S_t| (1 = the uniform weight of that round, NaN = client k not aggregated
    in round t). Per-tensor weights (FedVG layer/block granularity) are averaged over the tensors first.
    """
    rounds = sorted({int(r["round"]) for r in rows})
    col = {r: i for i, r in enumerate(rounds)}
    k_max = max((max(r["clients"], default=-1) for r in rows), default=-1) + 1
    n = max(k_max, num_clients or 0)
    out = np.full((n, len(rounds)), np.nan)
    per_key = False
    for r in rows:
        w = r["weights"]
        if isinstance(w, dict):
            per_key = True
            w = np.mean(np.array(list(w.values()), dtype=np.float64), axis=0) if w else []
        w = np.asarray(w, dtype=np.float64)
        m = len(r["clients"])
        for c, v in zip(r["clients"], w):
            out[int(c), col[int(r["round"])]] = v * m
    return out, np.array(rounds, dtype=np.int64), per_key


def plot_client_weights(run_dir: StrPath, label_counts: np.ndarray | Sequence[Sequence[int]] | None = None,
                        class_names: Sequence[str] | None = None) -> Path:
    """Draw ``RUN_DIR/plots/client_weights.png`` from ``RUN_DIR/client_weights.jsonl``; return its path.

    Left: each client's training label distribution (share of each class, clients down, with the
    client's size), from ``label_counts`` [clients, classes] or, by default, ``RUN_DIR/partition.json``.
    Middle: the normalised aggregation weight of each client in each round as a multiple of the
    uniform weight 1/|S_t| (red = trusted more than uniform, blue = less, grey = not aggregated that
    round). Right: each client's mean relative weight over the rounds it was aggregated, with its number
    of participations. Rows line up, so the plot shows who was trusted and what data they hold.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    run_path = Path(run_dir)
    wpath = run_path / "client_weights.jsonl"
    if not wpath.is_file():
        raise FileNotFoundError(f"{wpath}: no client weights logged")
    rows = RunDir(run_path).read_client_weights()
    if not rows:
        raise ValueError(f"{wpath}: no rounds logged")
    part = read_partition(run_path) if label_counts is None else None
    if label_counts is None and part is not None:
        label_counts = part.get("client_label_counts")
        class_names = class_names or part.get("class_names")
    counts = np.asarray(label_counts, dtype=np.float64) if label_counts is not None else None
    w, rounds, per_key = client_weight_matrix(rows, None if counts is None else counts.shape[0])
    n_clients, n_rounds = w.shape
    try:
        name = _Run(run_path, read_config(run_path), []).name  # the run's name; no metrics needed
    except (FileNotFoundError, ValueError):
        name = run_path.resolve().name

    has_labels = counts is not None and counts.ndim == 2 and counts.shape[0] == n_clients
    n_classes = counts.shape[1] if has_labels else 0
    row_h = 0.17 if n_clients > 25 else 0.3
    height = max(4.0, 2.0 + n_clients * row_h)
    label_w = max(2.4, 0.32 * n_classes) if has_labels else 0.0
    weight_w = min(14.0, max(4.5, 0.09 * n_rounds + 2.5))
    ratios = ([label_w, 0.9] if has_labels else []) + [weight_w, 1.6]
    fig = plt.figure(figsize=(sum(ratios) + 1.8, height), layout="constrained")
    gs = fig.add_gridspec(1, len(ratios), width_ratios=ratios)
    axes = [fig.add_subplot(gs[0, i]) for i in range(len(ratios))]
    yt = _tick_positions(n_clients, 50 if n_clients <= 60 else 30)

    i = 0
    if has_labels:
        ax_lab, ax_size = axes[0], axes[1]
        sizes = counts.sum(axis=1)
        share = counts / np.maximum(sizes[:, None], 1)
        ax_lab.imshow(share, aspect="auto", cmap="Greens", vmin=0, vmax=1, interpolation="nearest")
        names = [str(c) for c in (class_names or range(n_classes))]
        ax_lab.set_xticks(np.arange(n_classes), names, rotation=90 if n_classes > 12 or max(map(len, names)) > 3 else 0,
                          fontsize=8)
        ax_lab.set_yticks(yt, [str(k) for k in yt], fontsize=7 if n_clients > 25 else 8)
        ax_lab.set_xlabel("class")
        ax_lab.set_ylabel("client")
        ax_lab.set_title("label share per client", fontsize=10)
        ax_size.barh(np.arange(n_clients), sizes, height=0.8, color="0.5")
        ax_size.set_ylim(n_clients - 0.5, -0.5)
        ax_size.tick_params(axis="y", labelleft=False, left=False)
        ax_size.tick_params(axis="x", labelsize=7)
        ax_size.set_title("size", fontsize=10)
        ax_size.set_xlabel("examples", fontsize=8)
        i = 2
    ax_w, ax_mean = axes[i], axes[i + 1]
    finite = w[np.isfinite(w)]
    vmax = max(2.0, float(np.nanpercentile(finite, 99))) if finite.size else 2.0
    cmap = plt.get_cmap("RdBu_r").with_extremes(bad="0.88")
    im = ax_w.imshow(np.ma.masked_invalid(w), aspect="auto", cmap=cmap, norm=TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=vmax),
                     interpolation="nearest")
    xt = _tick_positions(n_rounds, 12)
    ax_w.set_xticks(xt, [str(rounds[j]) for j in xt], fontsize=8)
    ax_w.set_yticks(yt, [str(k) for k in yt] if not has_labels else [], fontsize=7 if n_clients > 25 else 8)
    if not has_labels:
        ax_w.set_ylabel("client")
    ax_w.set_xlabel("round")
    what = "mean over tensors of " if per_key else ""
    ax_w.set_title(f"{what}weight x clients in round (1 = uniform; grey = not aggregated)", fontsize=10)
    fig.colorbar(im, ax=ax_w, shrink=0.6, pad=0.01, label="weight / uniform")

    mean = np.array([np.nanmean(r) if np.isfinite(r).any() else np.nan for r in w])
    times = np.isfinite(w).sum(axis=1)
    colors = ["#b2182b" if v > 1 else "#2166ac" for v in np.nan_to_num(mean, nan=1.0)]
    ax_mean.barh(np.arange(n_clients), np.nan_to_num(mean), height=0.8, color=colors)
    ax_mean.axvline(1.0, color="0.3", linewidth=0.8, linestyle="--")
    ax_mean.set_ylim(n_clients - 0.5, -0.5)
    ax_mean.tick_params(axis="y", labelleft=False, left=False)
    ax_mean.tick_params(axis="x", labelsize=7)
    ax_mean.set_title("mean (times)", fontsize=10)
    ax_mean.set_xlabel("weight / uniform", fontsize=8)
    top = float(np.nanmax(mean)) if np.isfinite(mean).any() else 1.0
    ax_mean.set_xlim(0, max(1.5, top) * 1.35)
    if n_clients <= 60:
        for k, (v, t) in enumerate(zip(mean, times)):
            if t:
                ax_mean.text(v, k, f" {v:.2f} ({t})", va="center", ha="left", fontsize=6 if n_clients > 25 else 7)
    for ax in axes:
        if ax is not ax_mean:
            ax.set_ylim(n_clients - 0.5, -0.5)
    fig.suptitle(f"{name}: client weights per round", fontsize=12)
    return _save(fig, run_path / "plots" / CLIENT_WEIGHTS_FILE)
