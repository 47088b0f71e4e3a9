"""Top-down keypoint detection by heatmap regression, with clients at different input resolutions (RAF).

Examples are person instances (``fedsight.data.keypoints.KeypointSet``): an image, a box (centre and size,
padding included) and J joints. The box, widened to the input's aspect ratio (SimpleBaseline ``_box2cs``), is
warped to the network input with an anti-aliased affine warp (``fedsight.functional.keypoints``), so a crop at
128x96 is what a camera of that resolution would deliver, not an aliased sub-sampling of a sharper one.

**Resolution heterogeneity** (RAF, Lim et al.): a *ladder* of input sizes, highest first (the paper's
256x192 / 192x144 / 128x96, 4:3), and every client has a *native rung* for the whole run, assigned by
``resolution``: ``"cycle"`` (client k gets rung k mod R: 3 clients = high, mid, low, as the paper's Table II),
``"blocks"`` (contiguous groups of equal size), ``"one_high"`` (client 0 high, every other client at the
lowest rung: the paper's 1-high + n-low study, Fig. 10), ``"all_high"`` (Fig. 6) or ``"random"`` (uniform,
from the run seed); ``client_rungs`` lists the rungs explicitly. ``partition.json`` records the assignment. A
client trains on crops at its native size, evaluates its local test set there, and RAF's component
(``fedsight.recipe.raf``) builds the rungs below it (:meth:`KeypointTask.rungs_below`).

**Training** (SimpleBaseline/ViTPose top-down pipeline): random scale ``s ~ clip(1 + N(0,1) sf, 1 - sf,
1 + sf)``, rotation ``r ~ clip(N(0,1) rf, -2 rf, 2 rf)`` with probability ``rotation_prob``, horizontal flip
with probability 1/2 (joints mirrored and left/right pairs swapped), all drawn from torch's global generator
(which the engine seeds per (seed, round, client)). Targets: Gaussian heatmaps at 1/``heatmap_stride`` of the
input (``sigma`` heatmap pixels at every rung, as SimpleBaseline and the RAF code), a weight per joint (0 for
unlabelled joints and joints that leave the heatmap). Loss: ``JointsMSELoss(use_target_weight=True)``,
``0.5 * mean((w (p - t))^2)`` over batch, joints and pixels.

**Evaluation** at every size of ``eval_sizes`` (default: the ladder, then 1.25x and 1.5x the top rung, unseen
by training, as the paper's 320x240 and 384x288): the split ``test`` is the first test set at the top rung,
``test_<H>x<W>`` the same images at another size, and ``test_<name>`` / ``test_<name>_<H>x<W>`` further test
sets. Decoding: argmax plus SimpleBaseline's quarter-pixel shift towards the higher neighbour, optionally with
the flip test (mean of the heatmaps of the image and of its mirror, mapped back): ``decoder = "simplebaseline"``,
the default, as SimpleBaseline and ViTPose evaluate. ``decoder = "argmax"`` is what the RAF paper's text
states (its task description: each joint's coordinate is the argmax of its heatmap; no flip test or sub-pixel
step is mentioned): the first maximum in row-major order, no flip test, no quarter-pixel shift, whatever
``flip_test`` and ``refine`` default to (setting either to true with it is a config error). Coordinates go back
to the source image through the inverse crop affine. Metrics (percentages): ``pckh`` (PCKh@``pckh_threshold``: the
normaliser is the dataset's head size, 0.6 x the head box diagonal; joints in the skeleton's ``pckh_exclude``,
MPII's pelvis and thorax, left out of the mean), ``pck`` (PCK@``pck_threshold`` of the longer side of the
person box), ``ap``/``ap50``/``ap75``/``ar`` (COCO OKS through pycocotools with the skeleton's sigmas; the
detections of every client of a split are ranked together) and the heatmap ``loss``. The primary metric is
``primary`` (``pckh`` needs head sizes: COCO files have none, use ``ap`` or ``pck`` there).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from ..data.keypoints import KeypointSet, KeypointSplits
from ..data.partition import ClientSplit
from ..functional.keypoints import (
    crop_affine, decode_heatmaps, fix_aspect, flip_heatmaps, flip_joints, gaussian_heatmaps, transform_points,
    warp_crop,
)
from ..metrics import Mean, MetricSet, MetricState
from ..metrics.keypoints import OKSAP, PCK
from ..models.base import ModelIO
from ..registry import DATASETS, MODELS, TASKS, Params, build
from ..rng import np_rng
from .base import ClientExamples, Task, TaskSpec, component_params

__all__ = ["KeypointParams", "KeypointTask", "assign_rungs", "joints_mse"]

PROVIDES = frozenset({"server_split", "soft_targets", "resolution_ladder", "visuals"})
Size = tuple[int, int]


class KeypointParams(Params):
    ladder: list[list[int]] = Field(
        [[256, 192], [192, 144], [128, 96]], min_length=1,
        description="training input sizes [H, W], highest first (RAF: 256x192, 192x144, 128x96)")
    resolution: Literal["cycle", "blocks", "one_high", "all_high", "random"] = Field(
        "cycle", description="native rung of each client: cycle, blocks, one_high (1 high + n low), all_high, random")
    client_rungs: list[int] | None = Field(None, description="explicit native rung (0 = highest) of every client")
    eval_sizes: list[list[int]] | None = Field(
        None, description="evaluation input sizes [H, W] (default: the ladder, then 1.25x and 1.5x the top rung)")
    heatmap_stride: int = Field(4, ge=1, description="input pixels per heatmap pixel (the model's output stride)")
    sigma: float = Field(2.0, gt=0, description="Gaussian target sigma in heatmap pixels (SimpleBaseline/ViTPose: 2)")
    subpixel_targets: bool = Field(False, description="centre targets at the exact sub-pixel joint (UDP/DARK) "
                                   "instead of SimpleBaseline's rounded pixel")
    augment: bool = Field(True, description="random scale, rotation and flip of training crops")
    scale_factor: float = Field(0.35, ge=0, lt=1, description="random scale spread sf (SimpleBaseline COCO 0.35, MPII 0.25)")
    rotation_factor: float = Field(40.0, ge=0, description="random rotation spread rf in degrees (SimpleBaseline: 40)")
    rotation_prob: float = Field(0.6, ge=0, le=1, description="probability of a random rotation (SimpleBaseline: 0.6)")
    flip_test: bool = Field(True, description="average the heatmaps of the image and of its mirror at evaluation")
    refine: bool = Field(True, description="quarter-pixel refinement of the argmax when decoding")
    decoder: Literal["simplebaseline", "argmax"] = Field(
        "simplebaseline", description="simplebaseline (flip_test, refine as set) or argmax (RAF's plain argmax)")
    primary: Literal["pckh", "pck", "ap"] = Field("pckh", description="primary metric (pckh needs head sizes)")
    pckh_threshold: float = Field(0.5, gt=0, description="PCKh threshold, fraction of the head size")
    pck_threshold: float = Field(0.2, gt=0, description="PCK threshold, fraction of the longer person-box side")
    visual_instances: int = Field(3, ge=0, description="test persons shown in plots/visuals.png, at every rung")

    @model_validator(mode="after")
    def _decoding(self) -> "KeypointParams":
        on = [f for f in ("flip_test", "refine") if f in self.model_fields_set and getattr(self, f)]
        if self.decoder == "argmax" and on:
            raise ValueError(f"decoder = 'argmax' is the plain argmax the RAF paper describes: it has no "
                             f"{' and no '.join(on)}; drop {', '.join(on)} or use decoder = 'simplebaseline'")
        return self

    @property
    def use_flip_test(self) -> bool:
        """Whether evaluation averages the mirrored image's heatmaps in (``flip_test``, never under ``argmax``)."""
        return self.flip_test and self.decoder != "argmax"

    @property
    def use_refine(self) -> bool:
        """Whether decoding adds the quarter-pixel shift (``refine``, never under ``argmax``)."""
        return self.refine and self.decoder != "argmax"

    @model_validator(mode="after")
    def _sizes(self) -> "KeypointParams":
        for what, sizes in (("ladder", self.ladder), ("eval_sizes", self.eval_sizes or [])):
            for size in sizes:
                if len(size) != 2:
                    raise ValueError(f"{what}: every size is [H, W], got {size}")
                h, w = size
                if h < 1 or w < 1 or h % self.heatmap_stride or w % self.heatmap_stride:
                    raise ValueError(f"{what}: size {h}x{w} must be positive multiples of heatmap_stride "
                                     f"{self.heatmap_stride}")
        areas = [h * w for h, w in self.ladder]
        if any(a <= b for a, b in zip(areas, areas[1:])) or any(
                h2 > h1 or w2 > w1 for (h1, w1), (h2, w2) in zip(self.ladder, self.ladder[1:])):
            raise ValueError("ladder: sizes must decrease strictly, highest first (e.g. [[256, 192], [192, 144]])")
        if self.client_rungs is not None and any(r < 0 or r >= len(self.ladder) for r in self.client_rungs):
            raise ValueError(f"client_rungs: every rung must be in 0..{len(self.ladder) - 1} (0 = highest)")
        return self

    def sizes(self) -> list[Size]:
        """The evaluation sizes: ``eval_sizes``, or the ladder then 1.25x and 1.5x the top rung (rounded to the
        heatmap stride)."""
        if self.eval_sizes is not None:
            return [tuple(s) for s in self.eval_sizes]
        h, w = self.ladder[0]
        s = self.heatmap_stride
        extra = [(round(h * f / s) * s, round(w * f / s) * s) for f in (1.25, 1.5)]
        return [tuple(x) for x in self.ladder] + [x for x in extra if x not in self.ladder]


def keypoint_metrics(params: KeypointParams, num_joints: int = 1, exclude: Sequence[int] = (),
                     sigmas: Sequence[float] = ()) -> MetricSet:
    return MetricSet(
        [
            PCK("pckh", num_joints, params.pckh_threshold, exclude,
                f"PCKh@{params.pckh_threshold:g} (%): within {params.pckh_threshold:g} x head size"),
            PCK("pck", num_joints, params.pck_threshold, (),
                f"PCK@{params.pck_threshold:g} (%) of the longer person-box side"),
            OKSAP(sigmas or [0.05] * num_joints),
            Mean("loss", False, "heatmap MSE (JointsMSELoss), mean per instance", (0.0, float("inf"))),
        ],
        primary=params.primary,
    )


def assign_rungs(params: KeypointParams, num_clients: int, seed: int) -> list[int]:
    """The native rung (0 = highest) of every client."""
    r = len(params.ladder)
    if params.client_rungs is not None:
        if len(params.client_rungs) != num_clients:
            raise ValueError(f"task.client_rungs has {len(params.client_rungs)} entries for {num_clients} clients")
        return list(params.client_rungs)
    how = params.resolution
    if how == "cycle":
        return [k % r for k in range(num_clients)]
    if how == "blocks":
        return [min(k * r // num_clients, r - 1) for k in range(num_clients)]
    if how == "one_high":
        return [0] + [r - 1] * (num_clients - 1)
    if how == "all_high":
        return [0] * num_clients
    return [int(v) for v in np_rng(seed, "resolution").integers(0, r, num_clients)]


def joints_mse(pred: torch.Tensor, target: torch.Tensor, weight: torch.Tensor, each: bool = False) -> torch.Tensor:
    """``JointsMSELoss(use_target_weight=True)`` of SimpleBaseline/ViTPose: ``0.5 * mean((w (p - t))^2)`` over
    batch, joints and heatmap pixels (``weight`` [B, J]); ``each``: each example's (B,), over its joints and pixels
    (the batch's value is their mean: every example has as many)."""
    if pred.shape != target.shape:
        raise ValueError(f"heatmaps {tuple(pred.shape)} and targets {tuple(target.shape)} differ in shape")
    w = weight.to(pred.dtype)[..., None, None]
    se = ((pred - target) * w).pow(2)
    return 0.5 * (se.flatten(1).mean(1) if each else se.mean())


class KeypointTask(ClientExamples, Task):
    name = "keypoints"
    provides = PROVIDES
    loss_is_example_mean = True  # a heatmap MSE over the same number of joints and pixels for every crop

    @classmethod
    def spec(cls, params: KeypointParams | None = None) -> TaskSpec:
        params = params if isinstance(params, KeypointParams) else KeypointParams()
        return TaskSpec(keypoint_metrics(params).specs(), params.primary, PROVIDES)

    def __init__(self, splits: KeypointSplits, clients: Sequence[ClientSplit], model_name: str,
                 model_params: Params | None, params: KeypointParams | None = None, *, seed: int = 0,
                 val: KeypointSet | None = None, val_info: dict[str, Any] | None = None):
        self.splits, self.clients = splits, list(clients)
        self.model_name, self.model_params = model_name, model_params
        self.params = p = params or KeypointParams()
        self.skeleton = sk = splits.train.skeleton
        self.metrics = keypoint_metrics(p, sk.num_joints, sk.pckh_exclude, sk.sigmas)
        self.val, self.val_info = val, val_info
        self.ladder: list[Size] = [tuple(s) for s in p.ladder]
        self.rungs = assign_rungs(p, len(self.clients), seed)
        sizes = p.sizes()
        #: evaluation split -> (test set name, input size)
        self.test_views: dict[str, tuple[str, Size]] = {}
        for i, name in enumerate(splits.tests):
            base = "test" if i == 0 else f"test_{name}"
            for j, (h, w) in enumerate(sizes):
                self.test_views[base if j == 0 else f"{base}_{h}x{w}"] = (name, (h, w))
        if p.primary == "pckh":
            for name, ks in splits.tests.items():
                if not bool(np.isfinite(ks.head_size).any()):
                    raise ValueError(f"task.primary = 'pckh' but test set {name!r} has no head sizes (COCO files have "
                                     "none); set task.primary = 'ap' or 'pck'")
        self.pack_rows([c.train for c in self.clients], "training instance")

    # -- sizes ------------------------------------------------------------------------------------

    @property
    def test_splits(self) -> tuple[str, ...]:
        return tuple(self.test_views)

    def native_size(self, client: int) -> Size:
        """The input size of ``client``'s own data (its native rung)."""
        return self.ladder[self.rungs[client]]

    def rungs_below(self, client: int) -> list[Size]:
        """The ladder's sizes strictly below ``client``'s native rung, highest first (RAF's x^(1..N-1))."""
        return self.ladder[self.rungs[client] + 1:]

    def sizes_below(self, size: Size) -> list[Size]:
        """The ladder's sizes strictly below the rung of input size ``size`` (``rungs_below`` of a client whose
        native size it is), highest first."""
        size = tuple(size)
        if size not in self.ladder:
            raise ValueError(f"input size {size} is no rung of the ladder {self.ladder}")
        return self.ladder[self.ladder.index(size) + 1:]

    def data_description(self) -> dict[str, Any]:
        names = list(self.splits.train.class_names)
        counts = np.zeros((self.num_clients, len(names)), dtype=np.int64)
        for k in range(self.num_clients):
            counts[k] = np.bincount(self.splits.train.labels[self.clients[k].train], minlength=len(names))
        tests = {split: {"name": n, "size": list(s), "instances": len(self.splits.tests[n])}
                 for split, (n, s) in self.test_views.items()}
        return {"class_names": names, "client_label_counts": counts.tolist(), "test_sets": tests,
                "skeleton": self.skeleton.name, "ladder": [list(s) for s in self.ladder],
                "client_rungs": self.rungs, "client_sizes": [list(self.native_size(k)) for k in range(self.num_clients)],
                "validation": self.val_info}

    @property
    def model_io(self) -> ModelIO:
        return ModelIO("keypoints", in_channels=3, num_outputs=self.skeleton.num_joints)

    def build_model(self) -> nn.Module:
        return build(MODELS, self.model_name, self.model_params, io=self.model_io)

    # -- crops and targets ------------------------------------------------------------------------

    def heatmap_targets(self, joints: torch.Tensor, weight: torch.Tensor, size: Size
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Heatmaps ``[B, J, H/s, W/s]`` and weights for joints given in input pixels of an ``size`` input."""
        s = self.params.heatmap_stride
        hw = (size[0] // s, size[1] // s)
        return gaussian_heatmaps(joints / s, weight, hw, self.params.sigma, subpixel=self.params.subpixel_targets)

    def _crops(self, data: KeypointSet, idx: Sequence[int], size: Size, train: bool
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Input crops ``[B, 3, H, W]`` in [0, 1], joints ``[B, J, 3]`` in crop pixels (v kept) and the
        crop -> source affine ``[B, 2, 3]``."""
        idx = list(idx)
        n = len(idx)
        p = self.params
        center = torch.as_tensor(data.center[idx], dtype=torch.float64).reshape(n, 2)
        box = fix_aspect(torch.as_tensor(data.size[idx], dtype=torch.float64).reshape(n, 2), size[1] / size[0])
        joints = torch.as_tensor(data.joints[idx], dtype=torch.float64).reshape(n, -1, 3)
        rot = torch.zeros(n, dtype=torch.float64)
        flip = torch.zeros(n, dtype=torch.bool)
        if train and p.augment:
            sf, rf = p.scale_factor, p.rotation_factor
            box = box * (torch.randn(n, dtype=torch.float64) * sf + 1).clamp(1 - sf, 1 + sf)[:, None]
            r = (torch.randn(n, dtype=torch.float64) * rf).clamp(-2 * rf, 2 * rf)
            rot = torch.where(torch.rand(n, dtype=torch.float64) < p.rotation_prob, r, rot)
            flip = torch.rand(n) < 0.5
        fwd = crop_affine(center, box, rot, size)
        inv = crop_affine(center, box, rot, size, inverse=True)
        crops = []
        for b, i in enumerate(idx):
            img = torch.from_numpy(np.array(data.read_image(i))).permute(2, 0, 1).to(torch.float32)
            crops.append(warp_crop(img.div_(255.0), fwd[b].to(torch.float32), size, antialias=True))
        x = torch.stack(crops).clamp_(0, 1)
        xy = transform_points(joints[..., :2], fwd)
        out = torch.cat([xy, joints[..., 2:]], -1)
        if bool(flip.any()):
            x[flip] = x[flip].flip(-1)
            out[flip] = flip_joints(out[flip], float(size[1]), self.skeleton.flip_pairs)
            # the crop -> source map of a flipped crop: mirror first, then the unflipped inverse
            mirror = torch.tensor([[-1.0, 0.0, size[1] - 1.0], [0.0, 1.0, 0.0]], dtype=torch.float64)
            m3 = torch.cat([mirror, torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)])
            inv[flip] = inv[flip] @ m3
        return x, out.to(torch.float32), inv

    def _targets(self, joints: torch.Tensor, size: Size) -> dict[str, torch.Tensor]:
        inside = ((joints[..., 0] >= 0) & (joints[..., 0] <= size[1] - 1) & (joints[..., 1] >= 0)
                  & (joints[..., 1] <= size[0] - 1))
        weight = ((joints[..., 2] > 0) & inside).to(torch.float32)
        heatmaps, weight = self.heatmap_targets(joints[..., :2], weight, size)
        return {"heatmaps": heatmaps, "weight": weight, "joints": joints[..., :2].contiguous()}

    # -- training ---------------------------------------------------------------------------------

    def train_batch(self, client: int, positions: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Crops at the client's native size and ``{"heatmaps", "weight", "joints"}`` (joints in input pixels)."""
        size = self.native_size(client)
        idx = self.client_rows(client)[positions].tolist()
        x, joints, _ = self._crops(self.splits.train, idx, size, train=True)
        return x, self._targets(joints, size)

    def loss(self, outputs: torch.Tensor, targets: dict[str, torch.Tensor]) -> torch.Tensor:
        return joints_mse(outputs, targets["heatmaps"], targets["weight"])

    def example_losses(self, outputs: torch.Tensor, targets: dict[str, torch.Tensor]) -> torch.Tensor:
        return joints_mse(outputs, targets["heatmaps"], targets["weight"], each=True)

    # -- evaluation -------------------------------------------------------------------------------

    def _view(self, split: str | int) -> tuple[KeypointSet, np.ndarray, Size]:
        """(instances, indices into them, input size) of an evaluation split."""
        if isinstance(split, str) and split in self.test_views:
            name, size = self.test_views[split]
            data = self.splits.tests[name]
            return data, np.arange(len(data)), size
        if split == "val":
            if self.val is None:
                raise ValueError('this run has no server-held validation set (split "val"); set [validation] '
                                 'source = "carve" or "dataset"')
            return self.val, np.arange(len(self.val)), self.ladder[0]
        if isinstance(split, str) and not split.lstrip("-").isdigit():
            raise ValueError(f"task keypoints has no evaluation split {split!r} (use {', '.join(self.test_splits)}, "
                             "'val' or a client id)")
        k = int(split)
        return self.splits.train, np.asarray(self.clients[k].test), self.native_size(k)

    def eval_batches(self, split: str | int, batch_size: int = 64, subset: Any = None
                     ) -> Iterator[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        data, idx, size = self._view(split)
        if subset is not None:
            idx = idx[np.asarray(subset, dtype=np.int64)]
        yield from self.instance_batches(data, idx, size, batch_size)

    def instance_batches(self, data: KeypointSet, idx: np.ndarray, size: Size, batch_size: int,
                         capture: Size | None = None, mode: str = "bicubic"
                         ) -> Iterator[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        """Evaluation batches of ``data[idx]`` at input ``size``. With ``capture``, the crops are taken at the
        ``capture`` size and interpolated (``mode``) to ``size``: RAF's inference-time upsampling (Table III)."""
        for s in range(0, len(idx), batch_size):
            part = idx[s:s + batch_size].tolist()
            x, joints, inv = self._crops(data, part, capture or size, train=False)
            if capture is not None and capture != size:
                corners = None if mode in ("nearest", "area") else False
                x = F.interpolate(x, size=size, mode=mode, align_corners=corners).clamp_(0, 1)
                # an input pixel u maps to the capture pixel (u + 1/2) c - 1/2 (c = capture / size per axis, the
                # pixel-centre mapping of interpolate with align_corners=False)
                c = torch.tensor([capture[1] / size[1], capture[0] / size[0]], dtype=torch.float64)
                up = torch.zeros(3, 3, dtype=torch.float64)
                up[0, 0], up[1, 1], up[2, 2] = c[0], c[1], 1.0
                up[:2, 2] = 0.5 * c - 0.5
                inv = inv @ up
                joints = joints.clone()
                joints[..., :2] = (joints[..., :2] + 0.5) / c.to(torch.float32) - 0.5
            targets = self._targets(joints, size)
            box = torch.as_tensor(data.bbox[part], dtype=torch.float32).reshape(len(part), 4)
            targets.update({
                "gt": torch.as_tensor(data.joints[part], dtype=torch.float32).reshape(len(part), -1, 3),
                "inverse": inv.to(torch.float32),
                "head_size": torch.as_tensor(data.head_size[part], dtype=torch.float32).reshape(-1),
                "box": box,
                "area": torch.as_tensor(data.area[part], dtype=torch.float32).reshape(-1),
                "image_id": torch.as_tensor(data.image_id[part], dtype=torch.int64).reshape(-1),
            })
            yield x, targets

    def predict(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        out = model(inputs)
        if self.params.use_flip_test:
            flipped = model(inputs.flip(-1))
            out = 0.5 * (out + flip_heatmaps(flipped, self.skeleton.flip_pairs, shift=True))
        return out

    def decode(self, heatmaps: torch.Tensor, inverse: torch.Tensor, size: Size) -> torch.Tensor:
        """Predicted joints ``[B, J, 3]`` (x, y in source pixels, heatmap maximum) of heatmaps for ``size`` inputs
        whose crop -> source affine is ``inverse``."""
        xy, score = decode_heatmaps(heatmaps.float(), refine=self.params.use_refine)
        sx, sy = size[1] / heatmaps.shape[-1], size[0] / heatmaps.shape[-2]
        xy = xy * torch.tensor([sx, sy], dtype=xy.dtype, device=xy.device)
        src = transform_points(xy.to(torch.float64), inverse.to(device=xy.device, dtype=torch.float64))
        return torch.cat([src.to(torch.float32), score[..., None].float()], -1)

    def update_metrics(self, state: MetricState, outputs: torch.Tensor, targets: dict[str, torch.Tensor]) -> None:
        by_name = {m.name: m for m in self.metrics.metrics}
        n = int(outputs.shape[0])
        per = torch.stack([joints_mse(outputs[i:i + 1], targets["heatmaps"][i:i + 1], targets["weight"][i:i + 1])
                           for i in range(n)])
        by_name["loss"].update(state, per.sum(), n)
        s = self.params.heatmap_stride
        size = (outputs.shape[-2] * s, outputs.shape[-1] * s)
        pred = self.decode(outputs, targets["inverse"], size)
        gt = targets["gt"].to(pred.device)
        visible = gt[..., 2] > 0
        by_name["pckh"].update(state, pred[..., :2], gt[..., :2], visible, targets["head_size"].to(pred.device))
        box = targets["box"].to(pred.device)
        by_name["pck"].update(state, pred[..., :2], gt[..., :2], visible, box[:, 2:].amax(-1))
        by_name["oks"].update(state, pred, gt, targets["area"], box, targets["image_id"])

    def save_visuals(self, model: nn.Module, path: Any, hooks: Any = None) -> Any:
        """``plots/visuals.png``: skeleton overlays (ground truth and prediction) of a few test persons at every
        rung of the ladder (``fedsight.tasks.keypoint_visuals``)."""
        from .keypoint_visuals import save_keypoint_visuals

        return save_keypoint_visuals(self, model, path, hooks)

    def evaluate_at(self, model: nn.Module, size: Size, capture: Size | None = None, mode: str = "bicubic",
                    test_set: str | None = None, batch_size: int = 64) -> dict[str, float]:
        """Metrics of ``model`` on a test set at input ``size``, optionally with crops taken at ``capture`` and
        interpolated to ``size`` (``mode``: bicubic, bilinear, area, nearest)."""
        name = test_set or next(iter(self.splits.tests))
        data = self.splits.tests[name]
        state = self.metrics.new_state()
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        try:
            with torch.no_grad():
                for x, y in self.instance_batches(data, np.arange(len(data)), tuple(size), batch_size,
                                                  capture=tuple(capture) if capture else None, mode=mode):
                    y = {k: v.to(device) for k, v in y.items()}
                    self.update_metrics(state, self.predict(model, x.to(device)), y)
        finally:
            model.train(was_training)
        return self.metrics.compute(state)


@TASKS.register("keypoints", params=KeypointParams, spec=KeypointTask.spec,
                help="top-down keypoint heatmaps at per-client resolutions: PCKh, PCK, OKS AP (pycocotools)")
def build_keypoint_task(params: KeypointParams, *, cfg: Any) -> KeypointTask:
    """The task of a validated config: load ``cfg.data`` (a keypoint dataset), carve the server-held validation
    instances (by label), partition the rest, assign every client its native rung, and check that the model
    takes every ladder and evaluation size."""
    from ..data.partition import partition_from_config
    from ..data.server_split import carve_pool

    splits = build(DATASETS, cfg.data.name, component_params(cfg.data), seed=cfg.seed)
    if not isinstance(splits, KeypointSplits):
        raise ValueError(f"data.name = {cfg.data.name!r} is not a keypoint dataset")
    splits, val, val_info = carve_pool(cfg, splits, KeypointSplits, "a keypoint dataset")
    clients = partition_from_config(splits.train.labels, cfg)
    model_params = MODELS.get(cfg.model.name).params(**component_params(cfg.model))
    task_params = params if isinstance(params, KeypointParams) else KeypointParams(**component_params(params))
    task = KeypointTask(splits, clients, cfg.model.name, model_params, task_params, seed=cfg.seed, val=val,
                        val_info=val_info)
    multiple = int(getattr(task.build_model(), "stride_multiple", 1))
    for h, w in list(task.ladder) + task_params.sizes():
        if h % multiple or w % multiple:
            raise ValueError(f"task: input size {h}x{w} is not a multiple of {multiple}, which model {cfg.model.name!r} "
                             "needs (set task.ladder / task.eval_sizes)")
    return task

