"""Image super-resolution: training on random LR/HR patches, evaluation on whole images.

Data (``fedsight.data.image_sr``): uint8 HR images (mod-cropped to a multiple of the scale) with their LR
images (shipped bicubic files, MATLAB bicubic made on the fly, or uniform decimation); the partitioner
deals out whole images (labels = source/category). Local test sets, when
``partition.local_test_fraction > 0``, are whole images too.

Training (EDSR/RDN/BasicSR ``PairedImageDataset``). Client k's examples are its training images, one
example per image. ``train_batch`` cuts a random ``patch_size`` x ``patch_size`` LR patch of every image
and the matching ``scale`` times larger HR patch and, with ``augment``, applies a random horizontal flip,
vertical flip and transposition (BasicSR's ``augment(hflip, rot)``). With ``lr = "decimate"`` the LR patch
is decimated again from the augmented HR patch, so that every pair keeps the sampling phase of the
degradation (a flipped decimation would keep the pixel ``s - 1 - o`` of each cell instead of ``o``; RDSN's
uniform-down-sampling constraint relies on the phase). The crop and augmentation draw from torch's global
generator, which the engine seeds from the stream ("client", round, client) before each client's local
training, so batches are a deterministic function of (seed, round, client).

Loss: L1 by default (EDSR, RDN and RDSN train with L1; the PPFL-RDSN paper leaves its ``L_task`` unnamed,
digest ``notes/001_ppfl_rdsn.md`` §2.1), or ``l2`` (MSE) or ``charbonnier``, mean over pixels.

Evaluation (BasicSR/EDSR test conventions, ``shared/notes/references.md`` §3): every test image is
super-resolved whole (or in overlapping LR tiles, ``eval_tile``, EDSR's ``chop``), the output is clamped
to [0, 1] and rounded to 8 bits (``quantize``, BasicSR's ``tensor2img``), and PSNR/SSIM are computed with
``crop_border`` pixels removed on each side (default: the scale, the SR-paper convention), on the BT.601
luma Y (MATLAB ``rgb2ycbcr``) and on RGB, side by side; SSIM with an 11x11 Gaussian window, sigma 1.5
(``fedsight.functional.image_metrics``). Reported, as means over images: ``psnr``/``ssim`` on the channel
``metric`` picks (Y by default; ``psnr`` is the primary metric), ``psnr_y``, ``ssim_y``, ``psnr_rgb``,
``ssim_rgb`` and ``loss``. The PPFL-RDSN paper states neither channel nor border (digest §6.10); the
defaults are those of EDSR/RDN/BasicSR tables.

Several named test sets: the data's first test set is the split ``test`` (metrics ``test/*``), the others
``test_<name>`` (metrics ``test_<name>/*``), e.g. ``test``/``test_Set14``/``test_B100``/``test_Urban100``
for ``test_sets = [Set5, Set14, B100, Urban100]``. ``partition.json`` records which set is which.

Visual output: :meth:`ImageSRTask.save_visuals` writes a PNG with the LR input (nearest-neighbour
enlarged), bicubic (MATLAB ``imresize``), output and ground-truth crops, each titled with its PSNR (dB) on the
reported channel, of a few test images (the most detailed crop of each), plus the
raw crops; :func:`interpolation_baseline` scores plain interpolation (MATLAB bicubic by default), the floor
a trained model must beat.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from ..data.image_sr import ImageSet, ImageSRSplits, SRImage
from ..data.partition import ClientSplit
from ..device import model_device
from ..functional.dwt import charbonnier
from ..functional.image_metrics import psnr, ssim
from ..metrics import Mean, MetricSet, MetricState
from ..models.base import ModelIO
from ..registry import DATASETS, MODELS, TASKS, Params, build
from .base import ClientExamples, Task, TaskSpec, component_params
from .sr_visuals import _plot_rows, _write_png, detail_crop

__all__ = ["ImageSRParams", "ImageSRTask", "interpolation_baseline", "random_patch", "tiled_forward"]

PROVIDES = frozenset({"server_split", "image_outputs", "visuals"})
#: SSIM's window: an image must keep at least this many pixels per side after the border crop
_SSIM_WINDOW = 11


class ImageSRParams(Params):
    loss: Literal["l1", "l2", "charbonnier"] = Field("l1", description="pixel loss: l1 (EDSR/RDN/RDSN), l2 (MSE) or charbonnier")
    charbonnier_eps: float = Field(1e-6, gt=0, description="eps of the Charbonnier loss sqrt(d^2 + eps^2) (BasicSR: 1e-6)")
    crop_border: int | None = Field(None, ge=0, description="pixels removed on each side before PSNR/SSIM (default: the scale)")
    metric: Literal["y", "rgb"] = Field("y", description="channel of the reported psnr/ssim: BT.601 luma 'y' or 'rgb'")
    quantize: bool = Field(True, description="clamp and round outputs to 8 bits before the metrics (BasicSR tensor2img)")
    augment: bool = Field(True, description="random horizontal/vertical flips and transposition of training patches")
    eval_tile: int | None = Field(None, ge=8, description="super-resolve test images in LR tiles of this side (bounds memory)")
    eval_tile_overlap: int = Field(8, ge=0, description="LR pixels of context around each tile (>= the model's receptive radius)")
    visual_images: int = Field(3, ge=1, description="test images shown in plots/visuals.png")
    visual_crop: int = Field(96, ge=8, description="HR side of the crops shown in plots/visuals.png")


def sr_metrics(metric: str, quantize: bool, over: str = "images", loss: str = "loss per image") -> MetricSet:
    """psnr/ssim on the channel ``metric`` names, the same on Y and RGB, and the loss: means ``over`` images (or,
    for video, "clips of the per-frame mean"). Outputs clamped to [0, 1] against ground truth in [0, 1] give
    MSE <= 255^2 on the 0..255 scale, so PSNR >= 0 dB (+inf for a perfect image); unquantised (``quantize``
    false) outputs may leave [0, 1], so then PSNR declares no range (finite values only)."""
    psnr_range = (0.0, math.inf) if quantize else None
    return MetricSet(
        [
            Mean("psnr", True, f"PSNR (dB) on {metric}, mean over {over}", psnr_range),
            Mean("ssim", True, f"SSIM on {metric}, mean over {over}", (-1.0, 1.0)),
            Mean("psnr_y", True, "PSNR (dB) on BT.601 luma", psnr_range),
            Mean("ssim_y", True, "SSIM on BT.601 luma", (-1.0, 1.0)),
            Mean("psnr_rgb", True, "PSNR (dB) on RGB", psnr_range),
            Mean("ssim_rgb", True, "SSIM on RGB", (-1.0, 1.0)),
            Mean("loss", False, f"mean {loss}", (0.0, float("inf"))),
        ],
        primary="psnr",
    )


def image_sr_metrics(params: ImageSRParams) -> MetricSet:
    """``sr_metrics`` of an image SR task: means over images of its ``params.loss``."""
    return sr_metrics(params.metric, params.quantize, loss=f"{params.loss} loss per image")


def _to_float(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32).div_(255.0)


def random_patch(lr: torch.Tensor, hr: torch.Tensor, patch: int, scale: int, augment: bool,
                 decimate_offset: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A random LR patch ``[3, P, P]`` of ``lr`` and the HR patch ``[3, sP, sP]`` over the same area, with
    BasicSR's augmentation; draws top, left, then (with ``augment``) three flip bits from torch's global
    generator. With ``decimate_offset`` the LR patch is ``hr_patch[:, o::s, o::s]`` of the augmented HR
    patch (the module docstring says why)."""
    h, w = lr.shape[-2:]
    top = int(torch.randint(0, h - patch + 1, ()))
    left = int(torch.randint(0, w - patch + 1, ()))
    lr = lr[..., top : top + patch, left : left + patch]
    hr = hr[..., scale * top : scale * (top + patch), scale * left : scale * (left + patch)]
    if augment:
        hflip, vflip, transpose = (bool(b) for b in torch.randint(0, 2, (3,)))
        if hflip:
            lr, hr = lr.flip(-1), hr.flip(-1)
        if vflip:
            lr, hr = lr.flip(-2), hr.flip(-2)
        if transpose:
            lr, hr = lr.transpose(-1, -2), hr.transpose(-1, -2)
    if decimate_offset is not None:
        lr = hr[..., decimate_offset::scale, decimate_offset::scale]
    return lr.contiguous(), hr.contiguous()


def tiled_forward(model: nn.Module, lr: torch.Tensor, scale: int, tile: int | None, overlap: int) -> torch.Tensor:
    """``model(lr)`` for an LR batch ``[B, C, h, w]``, computed tile by tile when ``tile`` is set: each
    ``tile`` x ``tile`` LR tile is run with ``overlap`` LR pixels of context on every side (clipped at the
    image border) and only its centre is kept, so the result equals the whole-image output whenever the
    model's receptive radius is at most ``overlap`` LR pixels."""
    h, w = lr.shape[-2:]
    if tile is None or (h <= tile and w <= tile):
        return model(lr)
    out: torch.Tensor | None = None
    for y0 in range(0, h, tile):
        for x0 in range(0, w, tile):
            y1, x1 = min(y0 + tile, h), min(x0 + tile, w)
            a0, b0 = max(y0 - overlap, 0), max(x0 - overlap, 0)
            a1, b1 = min(y1 + overlap, h), min(x1 + overlap, w)
            part = model(lr[..., a0:a1, b0:b1])
            if out is None:
                out = part.new_zeros(*part.shape[:-2], h * scale, w * scale)
            s = scale
            out[..., y0 * s : y1 * s, x0 * s : x1 * s] = part[..., (y0 - a0) * s : (y1 - a0) * s, (x0 - b0) * s : (x1 - b0) * s]
    assert out is not None
    return out


class ImageSRTask(ClientExamples, Task):
    name = "image_sr"
    provides = PROVIDES
    loss_is_example_mean = True  # L1 / L2 / Charbonnier means over same-sized patches

    @classmethod
    def spec(cls, params: ImageSRParams | None = None) -> TaskSpec:
        params = params if isinstance(params, ImageSRParams) else ImageSRParams()
        return TaskSpec(image_sr_metrics(params).specs(), "psnr", PROVIDES)

    def __init__(
        self,
        splits: ImageSRSplits,
        clients: Sequence[ClientSplit],
        model_name: str,
        model_params: Params | None,
        params: ImageSRParams | None = None,
        val: ImageSet | None = None,
        val_info: dict[str, Any] | None = None,
    ):
        """``val``: the server-held validation images, served as the evaluation split ``"val"``."""
        self.splits = splits
        self.clients = list(clients)
        self.model_name = model_name
        self.model_params = model_params
        self.params = params or ImageSRParams()
        self.metrics = image_sr_metrics(self.params)
        self.val = val
        self.val_info = val_info
        self.scale, self.patch = splits.scale, splits.patch_size
        self.crop_border = self.params.crop_border if self.params.crop_border is not None else self.scale
        names = list(splits.tests)
        #: evaluation split -> test set name (the first set is "test")
        self.test_names = {("test" if i == 0 else f"test_{n}"): n for i, n in enumerate(names)}
        need = 2 * self.crop_border + _SSIM_WINDOW
        for n in names:
            for im in splits.tests[n].images:
                if min(im.hr_size) < need:
                    raise ValueError(
                        f"test set {n!r}: {im.source} is {im.hr_size[1]}x{im.hr_size[0]} (WxH), too small for SSIM "
                        f"after removing crop_border={self.crop_border} pixels per side (needs {need})"
                    )
        self.pack_rows([c.train for c in self.clients], "training image")
        first = self.splits.train.images[0]
        self._decimate = first.offset if first.lr_mode == "decimate" else None

    # -- sizes ------------------------------------------------------------------------------------

    @property
    def test_splits(self) -> tuple[str, ...]:
        return tuple(self.test_names)

    def client_labels(self, client: int) -> np.ndarray:
        """Label (source or category) of every training image of ``client``."""
        return self.splits.train.labels[self.clients[client].train]

    def data_description(self) -> dict[str, Any]:
        """Per-client training image counts per label, which data set each test split is, and the
        server validation set, for ``RUN_DIR/partition.json``."""
        names = list(self.splits.train.class_names)
        counts = np.zeros((self.num_clients, len(names)), dtype=np.int64)
        for k in range(self.num_clients):
            counts[k] = np.bincount(self.client_labels(k), minlength=len(names))
        tests = {split: {"name": n, "images": len(self.splits.tests[n])} for split, n in self.test_names.items()}
        return {"class_names": names, "client_label_counts": counts.tolist(), "test_sets": tests,
                "scale": self.scale, "validation": self.val_info}

    @property
    def model_io(self) -> ModelIO:
        return ModelIO("image_sr", in_channels=3, num_outputs=3, scale=self.scale)

    def build_model(self) -> nn.Module:
        return build(MODELS, self.model_name, self.model_params, io=self.model_io)

    # -- training ---------------------------------------------------------------------------------

    def train_batch(self, client: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """LR patches ``[B, 3, P, P]`` and HR patches ``[B, 3, sP, sP]`` in [0, 1]."""
        pool = self.splits.train.images
        pairs = []
        for i in self.client_rows(client)[positions].tolist():
            hr, lr = pool[int(i)].pair()
            pairs.append(random_patch(lr, hr, self.patch, self.scale, self.params.augment, self._decimate))
        return _to_float(torch.stack([a for a, _ in pairs])), _to_float(torch.stack([b for _, b in pairs]))

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if outputs.shape != targets.shape:
            raise ValueError(f"the model's output {tuple(outputs.shape)} is not the HR target's shape {tuple(targets.shape)}")
        kind = self.params.loss
        if kind == "l1":
            return F.l1_loss(outputs, targets)
        if kind == "l2":
            return F.mse_loss(outputs, targets)
        return charbonnier(outputs - targets, self.params.charbonnier_eps)

    # -- evaluation -------------------------------------------------------------------------------

    def eval_images(self, split: str | int) -> list[SRImage]:
        """The images of an evaluation split: ``"test"``, ``"test_<name>"``, ``"val"`` or a client id."""
        if isinstance(split, str) and split in self.test_names:
            return list(self.splits.tests[self.test_names[split]].images)
        if split == "val":
            if self.val is None:
                raise ValueError('this run has no server-held validation set (split "val"); set [validation] '
                                 'source = "carve" or "dataset"')
            return list(self.val.images)
        if isinstance(split, str) and not split.lstrip("-").isdigit():
            raise ValueError(f"task image_sr has no evaluation split {split!r} (use {', '.join(self.test_splits)}, "
                             "'val' or a client id)")
        pool = self.splits.train.images
        return [pool[int(i)] for i in self.clients[int(split)].test]

    def eval_batches(self, split: str | int, batch_size: int = 512, subset: Any = None
                     ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One whole image per batch (of the split, or its ``subset``: indices into it): LR ``[1, 3, h, w]``
        and HR ``[1, 3, H, W]`` in [0, 1] (images differ in size, so they are not stacked)."""
        images = self.eval_images(split)
        for im in images if subset is None else [images[int(i)] for i in subset]:
            hr, lr = im.pair()
            yield _to_float(lr).unsqueeze(0), _to_float(hr).unsqueeze(0)

    def predict(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        return tiled_forward(model, inputs, self.scale, self.params.eval_tile, self.params.eval_tile_overlap)

    def image_metrics(self, out: torch.Tensor, hr: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-image PSNR/SSIM on Y and RGB of images ``[N, 3, H, W]`` (module conventions)."""
        if self.params.quantize:
            out = (out.clamp(0, 1) * 255.0).round() / 255.0
        cb = self.crop_border
        return {
            "psnr_y": psnr(out, hr, cb, "y"),
            "ssim_y": ssim(out, hr, cb, "y"),
            "psnr_rgb": psnr(out, hr, cb, "rgb"),
            "ssim_rgb": ssim(out, hr, cb, "rgb"),
        }

    def update_metrics(self, state: MetricState, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        """A batch of images (``eval_batches`` yields one per batch): each image's loss and metrics, each
        image counted once (means over images, mergeable across clients)."""
        by_name = {m.name: m for m in self.metrics.metrics}
        n = int(targets.shape[0])
        losses = torch.stack([self.loss(outputs[i : i + 1], targets[i : i + 1]) for i in range(n)])
        by_name["loss"].update(state, losses.sum(), n)
        values = self.image_metrics(outputs, targets)
        for k, v in values.items():
            by_name[k].update(state, v.sum(), n)
        m = self.params.metric
        by_name["psnr"].update(state, values[f"psnr_{m}"].sum(), n)
        by_name["ssim"].update(state, values[f"ssim_{m}"].sum(), n)

    # -- visual output ----------------------------------------------------------------------------

    def _visual_picks(self) -> list[tuple[str, int]]:
        """(test split, image index) of the shown images: the first image of every test set, then the
        second of every set, ... up to ``visual_images``."""
        sizes = {split: len(self.splits.tests[n]) for split, n in self.test_names.items()}
        picks: list[tuple[str, int]] = []
        for i in range(max(sizes.values())):
            for split, size in sizes.items():
                if i < size and len(picks) < self.params.visual_images:
                    picks.append((split, i))
        return picks

    @torch.no_grad()
    def save_visuals(self, model: nn.Module, path: str | Path, hooks: Any = None) -> Path:
        """Write ``path`` (a PNG: per row the LR input, bicubic (MATLAB ``imresize``), output and ground-truth
        crops of one test image, the most detailed ``visual_crop`` window, each titled with its PSNR in dB on the
        reported channel, ``metric``) and, beside it, ``visuals/`` with the raw crops and ``visuals.json``.
        ``hooks(model, split)``: the run's evaluation hooks."""
        from ..functional.resize import imresize

        path = Path(path)
        raw = path.parent / "visuals"
        raw.mkdir(parents=True, exist_ok=True)
        was_training = model.training
        model.eval()
        rows, meta = [], []
        s = self.scale
        try:
            for j, (split, i) in enumerate(self._visual_picks()):
                im = self.eval_images(split)[i]
                hr_u8, lr_u8 = im.pair()
                crop = min(self.params.visual_crop, *im.hr_size) // s * s
                top, left = detail_crop(hr_u8, crop, s)
                with hooks(model, split) if hooks is not None else contextlib.nullcontext():
                    out = self.predict(model, _to_float(lr_u8).unsqueeze(0).to(model_device(model)))[0].clamp(0, 1).cpu()
                lr_full = _to_float(lr_u8)
                bicubic = imresize(lr_full.unsqueeze(0).to(torch.float64), float(s))[0].to(torch.float32).clamp(0, 1)
                lr = lr_full[:, top // s : (top + crop) // s, left // s : (left + crop) // s]
                imgs = {
                    "lr": lr.repeat_interleave(s, -2).repeat_interleave(s, -1),
                    "bicubic": bicubic[:, top : top + crop, left : left + crop],
                    "output": out[:, top : top + crop, left : left + crop],
                    "gt": _to_float(hr_u8)[:, top : top + crop, left : left + crop],
                }
                arrays = {k: (v * 255).round().to(torch.uint8).permute(1, 2, 0).numpy() for k, v in imgs.items()}
                for k, a in arrays.items():
                    _write_png(raw / f"image{j}_{k}.png", a)
                name = self.test_names[split]
                meta.append({"split": split, "set": name, "image": im.name, "top": top, "left": left, "size": crop, "scale": s})
                rows.append((f"{name}/{im.name}", [(f"LR input (x{s} nearest)", arrays["lr"]),
                                                   ("bicubic", arrays["bicubic"]), ("ours", arrays["output"]),
                                                   ("ground truth", arrays["gt"])]))
        finally:
            model.train(was_training)
        (path.parent / "visuals.json").write_text(json.dumps(meta, indent=1) + "\n")
        _plot_rows(rows, path, ref_col=3, channel=self.params.metric, what=f"x{s} crops of {len(rows)} test images")
        return path


class _Interpolate(nn.Module):
    def __init__(self, scale: int, mode: str):
        super().__init__()
        self.scale, self.mode = scale, mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "matlab":
            from ..functional.resize import imresize

            return imresize(x, float(self.scale))
        corners = False if self.mode in ("bilinear", "bicubic") else None
        return F.interpolate(x, scale_factor=self.scale, mode=self.mode, align_corners=corners)


def interpolation_baseline(task: ImageSRTask, mode: str = "matlab") -> dict[str, float]:
    """Metrics of plain interpolation of the LR test images on every test split (keys ``<split>/<metric>``,
    as the run logs them): ``"matlab"`` (MATLAB ``imresize`` bicubic, the "Bicubic" row of SR papers),
    or PyTorch's ``"bicubic"``, ``"bilinear"`` or ``"nearest"``."""
    if mode not in ("matlab", "bicubic", "bilinear", "nearest"):
        raise ValueError(f"unknown interpolation {mode!r}; use 'matlab', 'bicubic', 'bilinear' or 'nearest'")
    model = _Interpolate(task.scale, mode)
    out: dict[str, float] = {}
    for split in task.test_splits:
        out.update({f"{split}/{k}": v for k, v in task.evaluate(model, split, 1).items()})
    return out


@TASKS.register("image_sr", params=ImageSRParams, spec=ImageSRTask.spec,
                help="image super-resolution: L1 loss, PSNR/SSIM (Y and RGB, border crop) on whole test images")
def build_image_sr_task(params: ImageSRParams, *, cfg: Any) -> ImageSRTask:
    """The task of a validated config: load ``cfg.data`` (an image SR dataset), carve the server-held
    validation images (by label), partition the rest of the images."""
    from ..data.partition import partition_from_config
    from ..data.server_split import carve_pool

    splits = build(DATASETS, cfg.data.name, component_params(cfg.data), seed=cfg.seed)
    if not isinstance(splits, ImageSRSplits):
        raise ValueError(f"data.name = {cfg.data.name!r} is not an image SR dataset")

    def same_scale(other: ImageSRSplits) -> None:
        if other.scale != splits.scale:
            raise ValueError(f"validation.dataset = {cfg.validation.dataset['name']!r} has scale {other.scale}, "
                             f"the data scale {splits.scale}")

    splits, val, val_info = carve_pool(cfg, splits, ImageSRSplits, "an image SR dataset", check=same_scale)
    clients = partition_from_config(splits.train.labels, cfg)
    model_params = MODELS.get(cfg.model.name).params(**component_params(cfg.model))
    task_params = params if isinstance(params, ImageSRParams) else ImageSRParams(**component_params(params))
    return ImageSRTask(splits, clients, cfg.model.name, model_params, task_params, val=val, val_info=val_info)
