"""Plotting helpers shared by the super-resolution tasks (``video_sr``, ``image_sr``): PNG input/output
of uint8 ``[H, W, 3]`` crops, a crop's Y-PSNR, a grid of LR | output(s) | ground-truth panels, and the
choice of the most detailed crop of an image."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..functional.image_metrics import psnr

__all__ = ["detail_crop"]


def _write_png(path: Path, array: np.ndarray) -> None:
    from PIL import Image

    Image.fromarray(array).save(path)


def _read_png(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as im:
        return np.array(im.convert("RGB"))


def _crop_psnr(a: np.ndarray, ref: np.ndarray) -> float:
    ta = torch.from_numpy(a).permute(2, 0, 1).unsqueeze(0).to(torch.float64) / 255
    tb = torch.from_numpy(ref).permute(2, 0, 1).unsqueeze(0).to(torch.float64) / 255
    return float(psnr(ta, tb, 0, "y")[0])


def _plot_rows(rows: list[tuple[str, list[tuple[str, np.ndarray]]]], path: Path, ref_col: int) -> None:
    """A grid of images (one row per clip); every panel but the reference column (ground truth) and
    the LR column is titled with its Y-PSNR against the reference."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ncols = max(len(r[1]) for r in rows)
    fig = Figure(figsize=(2.2 * ncols, 2.4 * len(rows)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(rows), ncols, squeeze=False)
    for r, (label, panels) in enumerate(rows):
        ref = panels[ref_col][1]
        for c, (title, img) in enumerate(panels):
            ax = axes[r][c]
            ax.imshow(img, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            extra = "" if c in (0, ref_col) else f"\n{_crop_psnr(img, ref):.2f} dB"
            ax.set_title(f"{title}{extra}", fontsize=8)
            if c == 0:
                ax.set_ylabel(label, fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, format="png")


def detail_crop(hr: torch.Tensor, crop: int, scale: int) -> tuple[int, int]:
    """(top, left) of the ``crop`` x ``crop`` window of ``hr`` (``[3, H, W]``, any dtype) with the most
    gradient energy (sum of absolute horizontal and vertical differences of the channel mean), searched
    on a grid of stride about ``crop / 4`` rounded to a multiple of ``scale``, so that the window maps to
    whole LR pixels."""
    g = hr.to(torch.float64).mean(0)
    h, w = g.shape
    energy = (g[1:, :-1] - g[:-1, :-1]).abs() + (g[:-1, 1:] - g[:-1, :-1]).abs()
    best, pos = -1.0, (0, 0)
    stride = max(scale, crop // 4 // scale * scale)
    for top in range(0, h - crop + 1, stride):
        for left in range(0, w - crop + 1, stride):
            e = float(energy[top : top + crop - 1, left : left + crop - 1].sum())
            if e > best:
                best, pos = e, (top, left)
    return pos
