"""t-SNE of last-block features by inference resolution: RAF's Figs. 11-12 (Lim et al., digest
``notes/002_raf.md`` section 4.7) for the runs of ``examples/raf.toml`` / ``examples/raf_ablations.toml``.

For each run (one panel each: e.g. FedAvg, FedAvg + RAF, CL, CL+KD), the final global model (``model.safetensors``,
built as the run built it) sees the first test set's person crops at every evaluation size of the run's task (the
ladder, then the unseen larger sizes). The features are the output tokens of the backbone's **last transformer
block** (a forward hook on ``blocks[-1]``; before the final LayerNorm, as "the last ViT block" of the paper), mean
over the tokens: the paper does not say how a crop's variable number of tokens (8x6 at 64x48, 24x18 at 192x144 with
patch 8) becomes one vector, and a mean is the one pooling that does not depend on the grid size. Features of all
sizes are embedded together by ``sklearn.manifold.TSNE`` (2-D, PCA initialisation, perplexity ``--perplexity``
capped below the number of points, fixed ``--seed``) and drawn coloured by resolution. Each panel's title also gives
the silhouette score of the features (before t-SNE, Euclidean) with the resolution as the cluster label: a number
for what the figure shows by eye (1: the resolutions form separate clusters; about 0: they overlap), since a t-SNE
picture alone can suggest clusters that the features do not have.

    python examples/raf_tsne.py runs/raf/fedavg/seed0 runs/raf/raf_fedavg/seed0 -o tsne.png
    python examples/raf_tsne.py runs/raf_ablations/cl_high/seed0 runs/raf_ablations/cl_kd_high/seed0 -o cl.png
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

Size = tuple[int, int]


def last_block(model: nn.Module) -> nn.Module:
    """The last transformer block of a ViTPose-style model: the last entry of the first ``blocks`` ModuleList
    (``fedsight.models.pose.ViTBackbone`` and the official-layout backbone both keep theirs there)."""
    for module in model.modules():
        blocks = getattr(module, "blocks", None)
        if isinstance(blocks, nn.ModuleList) and len(blocks):
            return blocks[-1]
    raise ValueError(f"{type(model).__name__} has no transformer blocks (a ViTPose model is needed for Figs. 11-12)")


def last_block_features(model: nn.Module, task: Any, sizes: Sequence[Size], limit: int | None = None,
                        batch_size: int = 64) -> dict[Size, np.ndarray]:
    """size -> [N, D] features of the first ``limit`` crops (all when None) of the task's first test set at that
    input size: the last block's output tokens [B, h w, D], mean over the tokens."""
    data = next(iter(task.splits.tests.values()))
    idx = np.arange(len(data) if limit is None else min(limit, len(data)))
    captured: list[torch.Tensor] = []

    def hook(_module, _inputs, output):
        tokens = output[0] if isinstance(output, tuple) else output
        if tokens.ndim != 3:
            raise ValueError(f"the last block returned a {tokens.ndim}-D output, not tokens [B, N, D]")
        captured.append(tokens.mean(1).detach().cpu())

    handle = last_block(model).register_forward_hook(hook)
    was_training = model.training
    model.eval()
    out: dict[Size, np.ndarray] = {}
    try:
        with torch.no_grad():
            for size in sizes:
                captured.clear()
                for x, _ in task.instance_batches(data, idx, tuple(size), batch_size):
                    model(x)
                out[tuple(size)] = torch.cat(captured).numpy()
    finally:
        handle.remove()
        model.train(was_training)
    return out


def embed(features: dict[Size, np.ndarray], perplexity: float = 30.0, seed: int = 0
          ) -> tuple[np.ndarray, np.ndarray, float]:
    """(2-D t-SNE points [N_total, 2], the index of each point's size in ``features``, silhouette of the
    features by size)."""
    from sklearn.manifold import TSNE
    from sklearn.metrics import silhouette_score

    x = np.concatenate(list(features.values())).astype(np.float64)
    labels = np.concatenate([np.full(len(v), k) for k, v in enumerate(features.values())])
    perp = min(perplexity, (len(x) - 1) / 3)  # TSNE needs perplexity < n; a third keeps neighbourhoods local
    points = TSNE(2, perplexity=perp, init="pca", random_state=seed).fit_transform(x)
    sil = float(silhouette_score(x, labels)) if len(features) > 1 else float("nan")
    return points, labels, sil


def plot(panels: list[tuple[str, np.ndarray, np.ndarray, float]], sizes: Sequence[Size], ladder: Sequence[Size],
         path: Path) -> Path:
    """One scatter panel per run (title, points, labels, silhouette), colour by resolution; sizes outside the
    training ladder are marked unseen in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = plt.get_cmap("viridis")(np.linspace(0, 0.9, len(sizes)))
    fig, axes = plt.subplots(1, len(panels), figsize=(max(4.2 * len(panels), 6.0), 4.9), squeeze=False)
    for ax, (title, points, labels, sil) in zip(axes[0], panels):
        for k, size in enumerate(sizes):
            sel = labels == k
            name = f"{size[0]}x{size[1]}" + ("" if tuple(size) in {tuple(s) for s in ladder} else " (unseen)")
            ax.scatter(points[sel, 0], points[sel, 1], s=9, color=colours[k], label=name, alpha=0.8)
        ax.set_title(f"{title}\nsilhouette by resolution {sil:.2f}", fontsize=10)
        ax.set_xticks([])
        ax.set_yticks([])
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, title="input H x W", fontsize=8, title_fontsize=8, loc="lower center",
               ncol=len(sizes), frameon=False)
    fig.suptitle("t-SNE of last-block features, coloured by inference resolution", fontsize=11)
    fig.tight_layout(rect=(0, 0.1, 1, 1))  # room for the legend below the panels
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_features(run: Path, limit: int | None) -> tuple[str, dict[Size, np.ndarray], list[Size]]:
    """(panel title, features by size, the run's training ladder) of a finished run."""
    from ppfl_table import load_model

    from fedsight.api import build_task, load_run_config

    cfg = load_run_config(run)
    task = build_task(cfg)
    model = load_model(run, cfg, task)
    sizes = sorted(task.params.sizes(), key=lambda s: s[0] * s[1])  # lowest first: the colour map runs with size
    return f"{run.parent.name}, seed {cfg.seed}", last_block_features(model, task, sizes, limit), list(task.ladder)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", type=Path, nargs="+", help="finished keypoint runs (one panel each)")
    ap.add_argument("-o", "--output", type=Path, default=Path("tsne.png"), help="the PNG to write")
    ap.add_argument("--limit", type=int, default=None, help="test crops per size (default: all)")
    ap.add_argument("--perplexity", type=float, default=30.0, help="t-SNE perplexity (capped below n/3)")
    ap.add_argument("--seed", type=int, default=0, help="t-SNE random state")
    args = ap.parse_args(argv)
    for run in args.runs:
        if not (run / "model.safetensors").is_file():
            print(f"error: {run} is not a finished run (no model.safetensors)", file=sys.stderr)
            return 2
    if args.limit is not None and args.limit < 2:
        print(f"error: --limit must be at least 2, got {args.limit}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    panels, sizes, ladder = [], None, None
    for run in args.runs:
        try:
            title, feats, run_ladder = run_features(run, args.limit)
        except ValueError as e:
            print(f"error: {run}: {e}", file=sys.stderr)
            return 2
        if sizes is not None and list(feats) != sizes:
            print(f"error: {run} evaluates at {list(feats)}, not at the first run's {sizes}", file=sys.stderr)
            return 2
        sizes, ladder = list(feats), run_ladder
        points, labels, sil = embed(feats, args.perplexity, args.seed)
        panels.append((title, points, labels, sil))
        print(f"{run}: silhouette by resolution {sil:.3f} ({sum(len(v) for v in feats.values())} crops)")
    print(plot(panels, sizes, ladder, args.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
