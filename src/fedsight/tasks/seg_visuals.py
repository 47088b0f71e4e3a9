"""Pictures of a segmentation run: test images with ground truth and prediction overlays and a colour legend of
the classes shown (by name), and how the classes are spread over the clients."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from ..data.segmentation import IGNORE
from ..device import model_device

#: Cityscapes colours by class name (the usual palette of segmentation figures)
CITYSCAPES_COLOURS = {
    "road": (128, 64, 128), "sidewalk": (244, 35, 232), "building": (70, 70, 70), "wall": (102, 102, 156),
    "fence": (190, 153, 153), "pole": (153, 153, 153), "traffic light": (250, 170, 30),
    "traffic sign": (220, 220, 0), "vegetation": (107, 142, 35), "terrain": (152, 251, 152), "sky": (70, 130, 180),
    "person": (220, 20, 60), "rider": (255, 0, 0), "car": (0, 0, 142), "truck": (0, 0, 70), "bus": (0, 60, 100),
    "train": (0, 80, 100), "motorcycle": (0, 0, 230), "bicycle": (119, 11, 32),
}  # fmt: skip


def palette(class_names: Sequence[str]) -> np.ndarray:
    """``[256, 3]`` uint8 colours: Cityscapes colours for Cityscapes class names, distinct tab20 colours for
    others, black for ``IGNORE`` and unused ids."""
    from matplotlib import colormaps

    out = np.zeros((256, 3), dtype=np.uint8)
    tab = colormaps["tab20"]
    for i, name in enumerate(class_names):
        rgb = CITYSCAPES_COLOURS.get(name.replace("_", " "))
        out[i] = rgb if rgb is not None else (np.asarray(tab(i % 20)[:3]) * 255).round()
    return out


def overlay(image: np.ndarray, labels: np.ndarray, colours: np.ndarray, alpha: float = 0.6) -> np.ndarray:
    """``image`` uint8 ``[H, W, 3]`` blended with the colours of ``labels`` ``[H, W]``; ignored pixels keep the
    image, darkened."""
    col = colours[labels].astype(np.float32)
    img = image.astype(np.float32)
    out = (1 - alpha) * img + alpha * col
    out[labels == IGNORE] = 0.35 * img[labels == IGNORE]
    return out.round().clip(0, 255).astype(np.uint8)


def image_miou(pred: np.ndarray, target: np.ndarray, num_classes: int) -> float:
    """mIoU of one image over the classes in its target or prediction (ignored pixels left out)."""
    keep = target != IGNORE
    cm = np.bincount(target[keep].astype(np.int64) * num_classes + pred[keep], minlength=num_classes**2)
    cm = cm.reshape(num_classes, num_classes).astype(np.float64)
    tp = np.diag(cm)
    union = cm.sum(0) + cm.sum(1) - tp
    return float((tp[union > 0] / union[union > 0]).mean()) if (union > 0).any() else float("nan")


def _picks(n: int, k: int) -> list[int]:
    return sorted({int(i) for i in np.linspace(0, n - 1, num=min(k, n)).round()}) if n else []


@torch.no_grad()
def save_segmentation_visuals(task: Any, model: nn.Module, path: str | os.PathLike[str],
                              hooks: Callable[[nn.Module, str], Any] | None = None) -> Path:
    """For every global test set, ``visuals.png`` (``"test"``) or ``visuals_<name>.png`` beside ``path``:
    ``task.params.visual_images`` images evenly spaced through the set, each with its ground truth and the
    model's prediction overlaid and the image's mIoU; the model is evaluated as in the run's evaluation
    (``hooks(model, split)``: the stage's evaluation hooks, e.g. SiloBN's test statistics). Also
    ``class_distribution.png``: the clients' class pixel shares. Returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    colours = palette(task.class_names)
    device = model_device(model)
    was_training = model.training
    model.eval()
    try:
        for split in task.test_splits:
            s = task._split(split)
            picks = _picks(len(s), task.params.visual_images)
            if not picks:
                continue
            rows = []
            with hooks(model, split) if hooks is not None else contextlib.nullcontext():
                for i in picks:
                    raw, target = s.images.get_one(i), s.labels.get_one(i)
                    logits = task.predict(model, task.standardize(raw.unsqueeze(0)).to(device))
                    pred = torch.nn.functional.interpolate(logits, size=tuple(target.shape), mode="bilinear",
                                                           align_corners=False).argmax(1)[0].cpu().numpy()
                    img, tgt = raw.permute(1, 2, 0).numpy(), target.numpy()
                    classes = frozenset(np.unique(tgt[tgt != IGNORE]).tolist()) | frozenset(np.unique(pred).tolist())
                    rows.append(SegRow(s.names[i], img, overlay(img, tgt, colours), overlay(img, pred, colours),
                                       image_miou(pred, tgt, task.num_classes), classes, bool((tgt == IGNORE).any())))
            fig = segmentation_figure(rows, task.class_names, colours, f"{split}: {len(s)} images")
            _save_png(fig, path if split == "test" else path.with_name(f"visuals_{split[5:]}.png"))
    finally:
        model.train(was_training)
    desc_pixels = np.stack([task.class_pixels()[c.train].sum(0) for c in task.clients])
    plot_class_distribution(desc_pixels, task.class_names, path.with_name("class_distribution.png"), colours)
    return path


class SegRow(NamedTuple):
    """One shown test image: its name, the image, the ground-truth and prediction overlays (``overlay``), the
    image's mIoU, the class ids in its ground truth or prediction, whether its ground truth has ignored pixels."""

    name: str
    image: np.ndarray
    gt: np.ndarray
    pred: np.ndarray
    miou: float
    classes: frozenset[int]
    ignored: bool


def segmentation_figure(rows: Sequence[SegRow], class_names: Sequence[str], colours: np.ndarray, title: str) -> Any:
    """Per row the image, ground-truth and prediction panels, and below them a colour legend of the classes that
    appear in any shown ground truth or prediction (their names, in class order), plus "ignored (not labelled)"
    for the darkened pixels where a ground truth has them."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    h, w = rows[0][1].shape[:2]
    fig = Figure(figsize=(3 * 2.4 * w / max(h, w) + 0.4, len(rows) * 2.4 * h / max(h, w) + 1.6),
                 layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(rows), 3, squeeze=False)
    for r, (name, img, gt, pred, miou, _, _) in enumerate(rows):
        for c, (text, panel) in enumerate((("image", img), ("ground truth", gt), (f"prediction, mIoU {miou:.2f}", pred))):
            ax = axes[r][c]
            ax.imshow(panel, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_title(text, fontsize=8)
            if c == 0:
                short = name if len(name) <= 48 else "..." + name[-45:]  # one line a path part: fits the row
                ax.set_ylabel(short.replace("/", "/\n") if len(short) > 20 else short, fontsize=7)
    present = sorted(set().union(*(r.classes for r in rows)))
    handles = [Patch(facecolor=colours[i] / 255, edgecolor="0.3", linewidth=0.4, label=str(class_names[i]))
               for i in present]
    if any(r.ignored for r in rows):
        handles.append(Patch(facecolor="0.15", edgecolor="0.3", linewidth=0.4, label="ignored (not labelled)"))
    ncol = max(1, min(len(handles), int(fig.get_figwidth() * 72 / 95)))  # about 95 points an entry
    fig.legend(handles=handles, loc="outside lower center", ncol=ncol, fontsize=7, frameon=False,
               handlelength=1.2, columnspacing=0.8)
    fig.suptitle(title, fontsize=9)
    return fig


def _save_png(fig: Any, path: Path) -> None:
    import io

    from ..safe_write import atomic_write_bytes

    buf = io.BytesIO()
    fig.savefig(buf, dpi=110, format="png")
    atomic_write_bytes(path, buf.getvalue())


def plot_class_distribution(pixels: np.ndarray, class_names: Sequence[str], path: str | os.PathLike[str],
                            colours: np.ndarray | None = None, title: str = "") -> None:
    """Two panels from ``pixels`` ``[clients, classes]`` (labelled pixel counts): every client's class shares as
    a stacked bar, and per class the spread of its share over clients as a box plot (thesis Fig. 5.4)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    pixels = np.asarray(pixels, dtype=np.float64)
    if pixels.ndim != 2 or pixels.shape[1] != len(class_names) or 0 in pixels.shape:
        raise ValueError(f"pixels must be [clients, {len(class_names)}] counts, got shape {pixels.shape}")
    colours = palette(class_names) if colours is None else colours
    share = 100 * pixels / np.maximum(pixels.sum(1, keepdims=True), 1)
    k, c = share.shape
    fig = Figure(figsize=(max(7.0, 0.12 * k + 3), 7.5), layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1)
    left = np.zeros(k)
    for j in range(c):
        top.bar(np.arange(k), share[:, j], bottom=left, width=0.9, color=colours[j] / 255, label=class_names[j])
        left += share[:, j]
    top.set_xlim(-0.6, k - 0.4)
    top.xaxis.set_major_locator(MaxNLocator(integer=True))
    top.set_ylim(0, 100)
    top.set_xlabel("client")
    top.set_ylabel("% of labelled pixels")
    top.legend(fontsize=7, ncol=min(c, 7), loc="upper center", bbox_to_anchor=(0.5, -0.18), frameon=False)
    parts = bottom.boxplot([share[:, j] for j in range(c)], patch_artist=True, widths=0.6)
    for j, box in enumerate(parts["boxes"]):
        box.set_facecolor(colours[j] / 255)
    bottom.set_xticks(np.arange(1, c + 1), class_names, rotation=60, ha="right", fontsize=8)
    bottom.set_ylabel("% of a client's pixels")
    fig.suptitle(title or f"class pixel shares of {k} clients", fontsize=10)
    import io

    from ..safe_write import atomic_write_bytes

    buf = io.BytesIO()
    fig.savefig(buf, dpi=110, format="png")
    atomic_write_bytes(path, buf.getvalue())  # temp + rename, onto a regular file only (fedsight.safe_write)
