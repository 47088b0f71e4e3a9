"""Plotting helpers shared by the super-resolution tasks (``video_sr``, ``image_sr``): PNG input/output
of uint8 ``[H, W, 3]`` crops, a crop's PSNR (Y or RGB), a grid of LR | bicubic | output(s) | ground-truth panels,
and the choice of the most detailed crop of an image.

Choices for the grid (paper figures): every panel but the LR input and the ground truth is titled with its PSNR
in dB against the ground-truth crop, on the channel the task reports (``metric``: BT.601 luma "y" or "rgb"), and
the figure's title says which; the LR input is enlarged by pixel repetition (nearest) so its pixels show, and
the bicubic column is the interpolation baseline the model must beat (MATLAB ``imresize`` for image SR, the
"Bicubic" row of SR papers; PyTorch bicubic for video SR, as the tasks' ``interpolation_baseline``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..functional.image_metrics import psnr

__all__ = ["detail_crop", "sr_figure"]


def _write_png(path: Path, array: np.ndarray) -> None:
    from PIL import Image

    Image.fromarray(array).save(path)


def _read_png(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as im:
        return np.array(im.convert("RGB"))


#: how titles name the PSNR channel
CHANNEL_NAMES = {"y": "Y", "rgb": "RGB"}


def _crop_psnr(a: np.ndarray, ref: np.ndarray, channel: str = "y") -> float:
    ta = torch.from_numpy(a).permute(2, 0, 1).unsqueeze(0).to(torch.float64) / 255
    tb = torch.from_numpy(ref).permute(2, 0, 1).unsqueeze(0).to(torch.float64) / 255
    return float(psnr(ta, tb, 0, channel)[0])


def sr_figure(rows: list[tuple[str, list[tuple[str, np.ndarray]]]], ref_col: int, channel: str = "y",
              what: str = "") -> Any:
    """A grid of images (one row per clip or image): every panel but the first (the LR input) and the reference
    column (ground truth) is titled with its PSNR (dB) on ``channel`` against the reference; the title names the
    channel. ``what``: the start of the title (what the rows are)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    name = CHANNEL_NAMES[channel]
    ncols = max(len(r[1]) for r in rows)
    fig = Figure(figsize=(2.2 * ncols, 2.4 * len(rows) + 0.4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(rows), ncols, squeeze=False)
    for r, (label, panels) in enumerate(rows):
        ref = panels[ref_col][1]
        for c, (title, img) in enumerate(panels):
            ax = axes[r][c]
            ax.imshow(img, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            extra = "" if c in (0, ref_col) else f"\n{_crop_psnr(img, ref, channel):.2f} dB ({name})"
            ax.set_title(f"{title}{extra}", fontsize=8)
            if c == 0:
                ax.set_ylabel(label, fontsize=8)
    luma = "BT.601 luma Y" if channel == "y" else "RGB"
    fig.suptitle(f"{what}{': ' if what else ''}PSNR of each crop against the ground truth, on {luma}", fontsize=9)
    return fig


def _plot_rows(rows: list[tuple[str, list[tuple[str, np.ndarray]]]], path: Path, ref_col: int, channel: str = "y",
               what: str = "") -> None:
    """``sr_figure`` written to ``path`` as a PNG (atomically)."""
    import io

    from ..safe_write import atomic_write_bytes

    fig = sr_figure(rows, ref_col, channel, what)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, dpi=120, format="png")
    atomic_write_bytes(path, buf.getvalue())


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
