"""Pictures of a keypoint run: skeleton overlays of test persons, ground truth against prediction, at every rung of
the resolution ladder (``plots/visuals.png``).

Choices: each panel shows the input crop exactly as the model saw it at that rung (a 64x48 crop is blocky when
enlarged to the panel's size: that is the resolution the client trains at), with the ground-truth skeleton in green
(solid limbs, round joints) and the predicted one in red (dashed limbs, x joints), both in crop pixels; joints that
are not labelled are not drawn, and a predicted limb is drawn only where its ground-truth limb is. The title gives
the person's PCKh at that size (the share of its labelled joints within ``pckh_threshold`` x head size, in the
source image, the joints the skeleton leaves out of PCKh excluded), or PCK of the person box where the data has no
head sizes (COCO). Persons: ``visual_instances`` evenly spaced through the first test set.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..device import model_device
from ..functional.keypoints import decode_heatmaps

GT_COLOUR = "#1db954"
PRED_COLOUR = "#e8262b"


def _picks(n: int, k: int) -> list[int]:
    return sorted({int(i) for i in np.linspace(0, n - 1, num=min(k, n)).round()}) if n and k else []


def person_score(pred: np.ndarray, gt: np.ndarray, norm: float, threshold: float, exclude: Sequence[int] = ()
                 ) -> float:
    """Percent of the labelled joints (``gt[:, 2] > 0``, not in ``exclude``) whose predicted position (``pred``
    [J, >=2], source pixels) lies within ``threshold * norm`` of the truth; NaN when none is labelled or ``norm``
    is not a positive number."""
    keep = gt[:, 2] > 0
    keep[list(exclude)] = False
    if not keep.any() or not np.isfinite(norm) or norm <= 0:
        return float("nan")
    d = np.linalg.norm(pred[keep, :2] - gt[keep, :2], axis=1)
    return float(100.0 * np.mean(d <= threshold * norm))


def draw_skeleton(ax: Any, joints: np.ndarray, visible: np.ndarray, limbs: Sequence[tuple[int, int]], colour: str,
                  linestyle: str, marker: str) -> None:
    """Limbs between visible joints and a marker at each visible joint of ``joints`` [J, 2] (x, y), each with a
    thin white outline so that it shows on any background."""
    from matplotlib import patheffects

    halo = [patheffects.withStroke(linewidth=3.2, foreground="white", alpha=0.8)]
    for a, b in limbs:
        if visible[a] and visible[b]:
            ax.plot([joints[a, 0], joints[b, 0]], [joints[a, 1], joints[b, 1]], color=colour, linestyle=linestyle,
                    linewidth=1.6, solid_capstyle="round", path_effects=halo)
    ax.scatter(joints[visible, 0], joints[visible, 1], s=16, c=colour, marker=marker, linewidths=1.4, zorder=3,
               path_effects=halo)


def save_keypoint_visuals(task: Any, model: nn.Module, path: str | Path,
                          hooks: Callable[[nn.Module, str], Any] | None = None) -> Path | None:
    """``path`` (``plots/visuals.png``): ``keypoint_figure`` as a PNG (written atomically). Returns ``path``, or
    None when nothing is shown (``visual_instances = 0`` or an empty test set)."""
    from ..safe_write import atomic_write_bytes

    fig = keypoint_figure(task, model, hooks)
    if fig is None:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, dpi=110, format="png")
    atomic_write_bytes(path, buf.getvalue())
    return path


@torch.no_grad()
def keypoint_figure(task: Any, model: nn.Module, hooks: Callable[[nn.Module, str], Any] | None = None) -> Any:
    """The figure: per shown person (rows) the crop at every rung of the ladder (columns, highest first) with the
    ground-truth and predicted skeletons (module docstring); None when no person is shown. ``hooks(model,
    split)``: the run's evaluation hooks for the split of that size."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    p = task.params
    name = next(iter(task.splits.tests))
    data = task.splits.tests[name]
    picks = _picks(len(data), p.visual_instances)
    if not picks:
        return None
    split_of = {size: split for split, (n, size) in task.test_views.items() if n == name}
    sk = task.skeleton
    use_head = bool(np.isfinite(data.head_size[picks]).all())
    device = model_device(model)
    cells: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, float]] = {}
    was_training = model.training
    model.eval()
    try:
        for c, size in enumerate(task.ladder):
            split = split_of.get(size, "test")
            with hooks(model, split) if hooks is not None else contextlib.nullcontext():
                x, y = next(task.instance_batches(data, np.asarray(picks), size, len(picks)))
                heat = task.predict(model, x.to(device))
            src = task.decode(heat, y["inverse"], size).cpu().numpy()  # source pixels, for the score
            xy, _ = decode_heatmaps(heat.float(), refine=p.use_refine)
            crop_pred = (xy.cpu() * torch.tensor([size[1] / heat.shape[-1], size[0] / heat.shape[-2]])).numpy()
            gt_src = y["gt"].numpy()
            for r in range(len(picks)):
                if use_head:
                    score = person_score(src[r], gt_src[r], float(y["head_size"][r]), p.pckh_threshold, sk.pckh_exclude)
                else:
                    score = person_score(src[r], gt_src[r], float(y["box"][r, 2:].max()), p.pck_threshold)
                img = (x[r].permute(1, 2, 0).clamp(0, 1).numpy() * 255).round().astype(np.uint8)
                cells[(r, c)] = (img, y["joints"][r].numpy(), gt_src[r, :, 2] > 0, crop_pred[r], score)
    finally:
        model.train(was_training)

    metric = (f"PCKh@{p.pckh_threshold:g}" if use_head else f"PCK@{p.pck_threshold:g}")
    h0, w0 = task.ladder[0]
    ncols, nrows = len(task.ladder), len(picks)
    fig = Figure(figsize=(ncols * 2.3 * w0 / h0 + 0.5, nrows * 2.3 + 1.0), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for (r, c), (img, gt, vis, pred, score) in cells.items():
        ax = axes[r][c]
        h, w = img.shape[:2]
        ax.imshow(img, interpolation="nearest", extent=(-0.5, w - 0.5, h - 0.5, -0.5))
        draw_skeleton(ax, gt, vis, sk.limbs, GT_COLOUR, "-", "o")
        draw_skeleton(ax, pred, vis, sk.limbs, PRED_COLOUR, "--", "x")
        ax.set_xlim(-0.5, w - 0.5)
        ax.set_ylim(h - 0.5, -0.5)
        ax.set_xticks([])
        ax.set_yticks([])
        score_text = "n/a" if not np.isfinite(score) else f"{score:.0f}%"
        ax.set_title(f"{h}x{w} (rung {c}), {metric} {score_text}", fontsize=8)
        if c == 0:
            ax.set_ylabel(f"{name} #{picks[r]}", fontsize=8)
    handles = [Line2D([], [], color=GT_COLOUR, linestyle="-", marker="o", label="ground truth"),
               Line2D([], [], color=PRED_COLOUR, linestyle="--", marker="x", label="prediction")]
    fig.legend(handles=handles, loc="outside lower center", ncol=2, frameon=False, fontsize=8)
    fig.suptitle(f"{name}: {nrows} of {len(data)} persons at each training input size ({sk.name} skeleton)",
                 fontsize=9)
    return fig
