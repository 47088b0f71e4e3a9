"""Semantic segmentation (FedDrive, thesis Sec. 5.2): pixel-wise cross-entropy, mIoU from merged confusion
matrices, domains as the partition key.

Data (``fedsight.data.segmentation.SegmentationData``): a training pool of images with label maps of train
ids (``IGNORE = 255``) and a domain per image (city, town, weather, camera), named test sets ("test", and
extra ones such as "unseen", logged as ``test_<name>/*``), and optionally the dataset's own client split.
The partitioner deals out images by domain (``heterogeneous``-style splits give a client one domain), by
class presence (``class_imbalance``, thesis Alg. 8) or as the dataset lists them (``predefined``).

Training (thesis Sec. 5.2.3, FedDrive's code): every image is scaled by ``s ~ U(scale)``, padded and randomly
cropped to ``crop`` and flipped horizontally with probability 1/2 (``fedsight.data.seg_pipeline``; the draws
come from the stream (seed, "augment", round, client, step, j), so batches are the same with any number of
prefetching ``workers``), then standardised with the ImageNet channel statistics. Optional style
augmentation from a bank of other clients' styles (``style = "fda"``, ``"cfsi"`` or ``"lab"``).

Loss (eq. 5.7): the mean cross-entropy over labelled pixels. ``ohem = f`` keeps, in every image, only the
hardest ``floor(f H W)`` labelled pixels (online hard-negative mining, FedDrive ``perc = 0.25``; FedDrive's
code ranks all H W pixels with ignored ones at loss 0, which differs only when fewer than ``f H W`` pixels
are labelled: here the mean is then over the labelled ones, not diluted by zeros). A model that returns a
tuple in training mode (BiSeNetV2's booster heads) adds ``aux_weight`` times each auxiliary output's loss
(FedDrive: weight 1). Outputs smaller than the labels are upsampled bilinearly first.

Metrics: ``miou`` from the confusion matrix summed over every evaluated image (and, for local test sets and
the by-domain evaluation, over clients: a merged state, never a mean of per-client mIoUs), over the classes
present in the targets or the predictions; ``pixel_acc``; per-class ``iou/<class>``; the mean pixel
cross-entropy ``loss``. ``per_image_miou`` adds ``miou_img``: the thesis's eq. 5.10, the mean over images of
each image's mIoU (eq. 5.9 over the classes present in that image's target or prediction; eq. 5.9 leaves
0/0 classes undefined).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from ..data.partition import ClientSplit
from ..data.segmentation import IGNORE, SegmentationData, SegmentationSet
from ..metrics import ConfusionMatrix, Mean, MetricSet, MetricState
from ..models.base import ModelIO
from ..registry import MODELS, TASKS, Params, build
from .base import Task, TaskSpec

PROVIDES = frozenset({"class_logits", "server_split", "visuals", "domains", "styles"})
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
Pair = tuple[int, int]
Range = tuple[float, float]


class SegmentationParams(Params):
    crop: Pair | None = Field(
        None, description="training crop [height, width] after random scaling (FedDrive: 512 x 1024 Cityscapes, "
        "512 x 928 IDDA); None: the images' own size (they must share one)",
    )
    scale: Range = Field((1.0, 1.0), description="random scale range of training images (FedDrive: [0.5, 1.5] "
                         "Cityscapes, [0.5, 2.0] IDDA)")
    flip: bool = Field(True, description="random horizontal flips of training images")
    ohem: float | None = Field(None, gt=0, le=1, description="online hard-negative mining: only the hardest fraction "
                               "of every image's pixels count (FedDrive: 0.25); None: every labelled pixel")
    aux_weight: float = Field(1.0, ge=0, description="weight of each auxiliary output's loss (BiSeNetV2's booster "
                              "heads; FedDrive: 1)")
    per_image_miou: bool = Field(False, description="also report miou_img, the mean over images of per-image mIoU "
                                 "(thesis eq. 5.10)")
    style: Literal["none", "fda", "cfsi", "lab"] = Field(
        "none", description="style augmentation from other clients' styles: their low-frequency amplitude windows "
        "swapped in (FDA) or interpolated with lambda ~ U(0, 1) (CFSI), or their LAB colour moments")
    style_beta: float = Field(0.1, gt=0, lt=1, description="FDA/CFSI window: 2 floor(beta N / 2) + 1 frequencies "
                              "per side of N (0.1 = FedDrive's half-size floor(0.05 N))")
    style_prob: float = Field(0.5, ge=0, le=1, description="probability that a training image is restyled")
    jitter: float = Field(0.0, ge=0, le=1, description="colour jitter: brightness, contrast and saturation factors "
                          "in [1 - j, 1 + j], random order (LADD: 0.5; 0: off)")
    jitter_on: Literal["source", "clients", "both"] = Field("source", description="whose training images are "
                                                           "jittered (LADD's code: the source set only)")
    style_clients: float = Field(0.5, gt=0, le=1, description="fraction of the clients whose images populate the "
                                 "style bank (FedDrive: half)")
    style_images: Literal["random", "even", "all"] = Field(
        "random", description="which images are restyled: 'random' (each with style_prob), 'even' (FedDrive's code: "
        "the same half, even list positions), 'all' (the thesis's text)")
    style_exclude: Literal["auto", "own", "none"] = Field(
        "auto", description="bank entries a client may not draw: 'auto' (its own for FDA/CFSI, none for LAB), "
        "'own' (FedDrive's IDDA code), 'none' (its Cityscapes code)")
    double: Literal["none", "all", "small"] = Field(
        "none", description="FedDrive's double_dataset: a client's list plus its mirrored copy ('all' clients, as "
        "FedDrive's code; 'small': those under double_below images)")
    double_below: int = Field(16, ge=1, description="double = 'small': clients with fewer training images than "
                              "this are doubled (FedDrive's batch size 16)")
    labels: Literal["train", "eval_only"] = Field(
        "train", description="'eval_only': the clients' images are unlabelled for training (source-free adaptation, "
        "LADD): training batches carry only IGNORE labels and no label map is read for them; evaluation uses the "
        "labels")
    source: dict[str, Any] | None = Field(
        None, description="a labelled source dataset only the server holds, e.g. {name = \"street\", ...} (LADD's "
        "GTA5): its training pool serves source pre-training; its class names must be the clients' data's")
    workers: int = Field(0, ge=0, description="threads or processes decoding and augmenting batches ahead (0: "
                         "in the training loop)")
    backend: Literal["thread", "process"] = Field("thread", description="what the prefetching workers are "
                                                  "('process' pickles the batch loader, style bank included, with "
                                                  "every batch: for datasets on disk without a style bank)")
    eval_pixels: int = Field(1 << 22, ge=1, description="at most this many pixels per evaluation batch (large "
                             "images are evaluated fewer at a time than eval.batch_size)")
    visual_images: int = Field(4, ge=0, description="test images per test set shown in plots/visuals*.png")

    def model_post_init(self, context: Any) -> None:
        if self.scale[0] <= 0 or self.scale[0] > self.scale[1]:
            raise ValueError(f"scale = {list(self.scale)}: need 0 < low <= high")
        if self.crop is not None and min(self.crop) < 1:
            raise ValueError(f"crop = {list(self.crop)}: both sides must be >= 1")


def metric_key(name: str) -> str:
    """A class name as it appears in metric keys (``iou/traffic_light``)."""
    return "_".join(name.split())


class PerImageMIoU(Mean):
    """Thesis eq. 5.10: the mean over images of each image's mIoU (over the classes in its target or
    prediction)."""

    def __init__(self, num_classes: int):
        super().__init__("miou_img", True, "mean over images of per-image mIoU (thesis eq. 5.10)", (0.0, 1.0))
        self.num_classes = num_classes

    def update_images(self, state: MetricState, preds: torch.Tensor, targets: torch.Tensor) -> None:
        b, c = preds.shape[0], self.num_classes
        keep = targets != IGNORE
        image = torch.arange(b, device=preds.device).view(b, *([1] * (preds.ndim - 1))).expand_as(preds)
        flat = (image * c * c + targets.long() * c + preds.long())[keep]
        cm = torch.bincount(flat, minlength=b * c * c).view(b, c, c).to(torch.float64)
        tp = cm.diagonal(dim1=1, dim2=2)
        union = cm.sum(1) + cm.sum(2) - tp
        present = union > 0
        iou = torch.where(present, tp / union.clamp_min(1), torch.zeros_like(tp))
        counted = present.any(1)  # an image with no labelled pixel and no prediction has no mIoU
        per_image = iou.sum(1)[counted] / present.sum(1)[counted]
        self.update(state, per_image.sum(), int(counted.sum()))


def segmentation_metrics(class_names: Sequence[str], per_image: bool) -> MetricSet:
    metrics: list[Any] = [
        ConfusionMatrix("cm", len(class_names), IGNORE, [metric_key(n) for n in class_names]),
        Mean("loss", False, "mean pixel cross-entropy over labelled pixels", (0.0, float("inf"))),
    ]
    if per_image:
        metrics.append(PerImageMIoU(len(class_names)))
    return MetricSet(metrics, primary="miou")


def upsample(logits: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
    """Logits ``[B, C, h, w]`` at ``size`` (bilinear), unchanged when they already are."""
    if tuple(logits.shape[-2:]) == tuple(size):
        return logits
    return F.interpolate(logits, size=tuple(size), mode="bilinear", align_corners=False)


def pixel_loss(logits: torch.Tensor, targets: torch.Tensor, ohem: float | None = None) -> torch.Tensor:
    """Mean cross-entropy over labelled pixels (eq. 5.7), or over the hardest ``floor(ohem H W)`` labelled
    pixels of every image; 0 (with a gradient path) when no pixel is labelled."""
    logits = upsample(logits, targets.shape[-2:])
    ce = F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="none")
    valid = targets != IGNORE
    if ohem is not None:
        b = ce.shape[0]
        ranked = torch.where(valid, ce, torch.full_like(ce, -1.0)).reshape(b, -1)
        k = max(1, int(ohem * ranked.shape[1]))
        top = ranked.topk(k, dim=1).values
        chosen = top >= 0
        n = chosen.sum()
        return torch.where(chosen, top, torch.zeros_like(top)).sum() / n.clamp_min(1)
    n = valid.sum()
    return torch.where(valid, ce, torch.zeros_like(ce)).sum() / n.clamp_min(1)


def main_output(outputs: Any) -> torch.Tensor:
    """The main prediction of a model's output (the first element of a tuple of main and auxiliary outputs)."""
    return outputs[0] if isinstance(outputs, (tuple, list)) else outputs


class SegmentationTask(Task):
    name = "segmentation"
    provides = PROVIDES

    @classmethod
    def spec(cls, params: Any = None) -> TaskSpec:
        params = params if isinstance(params, SegmentationParams) else SegmentationParams()
        return TaskSpec(segmentation_metrics(["c"], params.per_image_miou).specs(), "miou", PROVIDES)

    def __init__(
        self,
        data: SegmentationData,
        clients: Sequence[ClientSplit],
        model_name: str,
        model_params: Params | None,
        params: SegmentationParams | None = None,
        *,
        seed: int = 0,
        val: SegmentationSet | None = None,
        val_info: dict[str, Any] | None = None,
        class_pixels: np.ndarray | None = None,
        source: SegmentationSet | None = None,
    ):
        """``class_pixels``: ``[N, C]`` class pixel counts of the pool's images when already computed (the
        class-imbalance split needs them); computed on demand otherwise. ``source``: the server's labelled
        source images (``params.source``)."""
        from ..data.pipeline import Prefetcher

        self.data, self.pool = data, data.train
        self.clients = list(clients)
        self.model_name, self.model_params = model_name, model_params
        self.params = params or SegmentationParams()
        self.class_names = list(data.class_names)
        self.metrics = segmentation_metrics(self.class_names, self.params.per_image_miou)
        self.val, self.val_info = val, val_info
        self.source = source
        self._class_pixels = class_pixels
        self.device = torch.device("cpu")
        self.mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
        self.std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
        p = self.params
        self.prefetcher = Prefetcher(p.workers, depth=max(2, 2 * p.workers), backend=p.backend, pin_memory=True)
        self.crop = tuple(p.crop) if p.crop is not None else self._common_size(self.pool, "task.crop")
        #: the clients whose images populate the style bank (none without style augmentation)
        self.bank_members = np.zeros(0, dtype=np.int64)
        self.style_bank = self._build_style_bank(seed) if p.style != "none" else None
        #: (amplitude window, half) that evaluation images are restyled with (``restyled``); None: as they are
        self.eval_style: tuple[torch.Tensor, int] | None = None

    # -- sizes and splits -------------------------------------------------------------------------

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def doubled(self, client: int) -> bool:
        """Whether ``client``'s training list is doubled with its mirrored copy (``double``; thesis Sec. 5.2.3:
        "when clients do not have sufficient samples, their dataset is virtually doubled by applying
        horizontal flipping"). FedDrive's code doubles every client of a run that sets ``double_dataset`` (its
        Cityscapes configs, whose clients hold a few dozen images; the IDDA loader has no doubling): ``"all"``.
        ``"small"`` reads the text's "not sufficient" as fewer than ``double_below`` images."""
        p = self.params
        n = len(self.clients[client].train)
        return n > 0 and (p.double == "all" or (p.double == "small" and n < p.double_below))

    def num_train_examples(self, client: int) -> int:
        """The client's training images, twice that when doubled (FedDrive's ``len(dataset)``, which its FedAvg
        weights and its epochs' step counts use)."""
        n = len(self.clients[client].train)
        return 2 * n if self.doubled(client) else n

    def num_test_examples(self, client: int) -> int:
        return len(self.clients[client].test)

    @property
    def test_splits(self) -> tuple[str, ...]:
        return ("test",) + tuple(f"test_{n}" for n in self.data.tests if n != "test")

    @staticmethod
    def _common_size(s: SegmentationSet, field: str) -> Pair:
        sizes = s.image_sizes()
        distinct = np.unique(sizes, axis=0)
        if len(distinct) != 1:
            shown = ", ".join(f"{h}x{w}" for h, w in distinct[:4].tolist())
            raise ValueError(f"{field} must be set: the training images have {len(distinct)} sizes ({shown}, ...)")
        return int(distinct[0][0]), int(distinct[0][1])

    def _split(self, split: str | int) -> SegmentationSet:
        """The images of an evaluation split: "test", "test_<name>", "val" or a client id."""
        if split == "test":
            return self.data.tests["test"]
        if isinstance(split, str) and split.startswith("test_") and split[5:] in self.data.tests:
            return self.data.tests[split[5:]]
        if split == "val":
            if self.val is None:
                raise ValueError('this run has no server-held validation set (split "val"); set [validation] '
                                 'source = "carve"')
            return self.val
        if isinstance(split, str) and not split.lstrip("-").isdigit():
            raise ValueError(f"task segmentation has no evaluation split {split!r} (use {', '.join(self.test_splits)}, "
                             "'val' or a client id)")
        return self.pool.subset(self.clients[int(split)].test)

    def domain_groups(self, split: str) -> list[tuple[int, np.ndarray]]:
        """(domain id, indices into the split of its images) of every domain of an evaluation split, by id."""
        domains = self._split(split).domains
        return [(int(d), np.flatnonzero(domains == d)) for d in np.unique(domains)]

    def client_domain_counts(self) -> np.ndarray:
        """``[clients, domains]`` numbers of training images of each domain on each client."""
        d = len(self.data.domain_names)
        return np.stack([np.bincount(self.pool.domains[c.train], minlength=d) for c in self.clients])

    # -- model ------------------------------------------------------------------------------------

    @property
    def model_io(self) -> ModelIO:
        return ModelIO("segmentation", in_channels=3, num_outputs=self.num_classes)

    def build_model(self) -> nn.Module:
        return build(MODELS, self.model_name, self.model_params, io=self.model_io)

    def to(self, device: torch.device) -> "SegmentationTask":
        """Images stay on the CPU (decoded and augmented there); batches are standardised on ``device``."""
        self.device = torch.device(device)
        self.mean, self.std = self.mean.to(self.device), self.std.to(self.device)
        return self

    def standardize(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 ``[B, 3, H, W]`` -> float32 standardised with the ImageNet statistics, on the task's device."""
        images = images.to(self.device, non_blocking=images.is_pinned())
        return (images.to(torch.float32).div_(255.0) - self.mean) / self.std

    # -- training ---------------------------------------------------------------------------------

    def _batch_loader(self, seed: int, flip: bool | None = None) -> Any:
        from ..data.seg_pipeline import SegBatchLoader

        p = self.params
        labels = self.pool.labels if p.labels == "train" else None  # unlabelled clients: labels never read
        jitter = p.jitter if p.jitter_on in ("clients", "both") else 0.0
        return SegBatchLoader(self.pool.images, labels, self.crop, p.scale, p.flip if flip is None else flip, seed,
                              self.style_bank, jitter)

    def train_batch(self, client: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Augmented crops of the client's training images at ``positions`` (the draws of step 0 of round 0)."""
        return next(self.train_batches(client, [positions]))

    def train_batches(
        self, client: int, batches: Iterable[torch.Tensor], *, seed: int = 0, round: int = 0
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Images ``[B, 3, h, w]`` (standardised, on the task's device) and label maps ``[B, h, w]`` (int64),
        decoded and augmented ahead by the prefetcher; sample j of step s from (seed, "augment", round,
        client, s, j). A batch of a single image (the last of a pass) is trained with its horizontal mirror, as
        FedDrive doubles tiny clients with flips: BatchNorm on a pooled 1 x 1 map needs two values.

        A doubled client's positions run over ``2 n``: position ``i >= n`` is image ``i - n`` mirrored, and its
        random flips are off (FedDrive's Cityscapes transform drops ``RandomHorizontalFlip`` under
        ``double_dataset``); the mirror is applied after the geometric draws, before style."""
        from ..data.seg_pipeline import double_positions

        idx = self.clients[client].train
        doubled = self.doubled(client)
        jobs = []
        for step, pos in enumerate(batches):
            real, mirrored = double_positions(pos.cpu().numpy(), len(idx))
            jobs.append((idx[real], ("augment", round, client, step), client, real, mirrored if doubled else None))
        flip = False if doubled else None
        for x, y in self.prefetcher.map(self._batch_loader(seed, flip), jobs):
            if len(x) == 1:  # a batch of one image: with its mirror (BatchNorm on a pooled 1x1 map needs two)
                x, y = torch.cat([x, x.flip(-1)]), torch.cat([y, y.flip(-1)])
            yield self.standardize(x), y.to(self.device).long()

    def loss(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        outs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        total = pixel_loss(outs[0], targets, self.params.ohem)
        for aux in outs[1:]:
            total = total + self.params.aux_weight * pixel_loss(aux, targets, self.params.ohem)
        return total

    # -- evaluation -------------------------------------------------------------------------------

    def eval_batches(self, split: str | int, batch_size: int = 512, subset: Any = None
                     ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Whole images (of the split, or its ``subset``: indices into it), standardised, with their label maps
        (int64), in batches of images of one size: sizes in order of first appearance, images in split order
        within a size, at most ``batch_size`` images and ``eval_pixels`` pixels a batch."""
        from ..data.seg_pipeline import SegEvalLoader

        s = self._split(split)
        if subset is not None:
            s = s.subset(subset)
        sizes = s.image_sizes()
        jobs = []
        _, first, inverse = np.unique(sizes, axis=0, return_index=True, return_inverse=True)
        for g in np.argsort(first):
            members = np.flatnonzero(inverse.reshape(-1) == g)
            h, w = sizes[members[0]]
            per = max(1, min(batch_size, self.params.eval_pixels // int(h * w)))
            jobs += [members[a : a + per] for a in range(0, len(members), per)]
        style = (self.eval_style[0], self.eval_style[1], self.crop) if self.eval_style is not None else None
        for x, y in self.prefetcher.map(SegEvalLoader(s.images, s.labels, style), jobs):
            yield self.standardize(x), y.to(self.device).long()

    @contextlib.contextmanager
    def restyled(self, window: torch.Tensor, half: int) -> Iterator[None]:
        """Within the block, evaluation images are FDA-restyled with the amplitude ``window`` ``[3, 2 half + 1,
        2 half + 1]`` of a style measured like ``client_style`` (at the crop size; ``seg_pipeline.restyle_to``):
        LADD's test-time restyling to the style of the image's cluster (thesis Sec. 5.3.8)."""
        saved, self.eval_style = self.eval_style, (window.detach().to(torch.float32).cpu(), int(half))
        try:
            yield
        finally:
            self.eval_style = saved

    def predict(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        return main_output(model(inputs))

    def update_metrics(self, state: MetricState, outputs: Any, targets: torch.Tensor) -> None:
        logits = upsample(main_output(outputs), targets.shape[-2:])
        preds = logits.argmax(1)
        by_name = {m.name: m for m in self.metrics.metrics}
        by_name["cm"].update(state, preds, targets)
        valid = int((targets != IGNORE).sum())
        ce = F.cross_entropy(logits.float(), targets, ignore_index=IGNORE, reduction="sum") if valid else 0.0
        by_name["loss"].update(state, ce, valid)
        if "miou_img" in by_name:
            by_name["miou_img"].update_images(state, preds, targets)

    # -- statistics, style bank, cost -------------------------------------------------------------

    def class_pixels(self) -> np.ndarray:
        """``[N, C]`` pixel counts of every class in every pool image (one pass over the label maps)."""
        if self._class_pixels is None:
            from ..data.seg_pipeline import class_pixel_counts

            self._class_pixels = class_pixel_counts(self.pool.labels, self.num_classes, self.prefetcher)
        return self._class_pixels

    def _build_style_bank(self, seed: int) -> Any:
        from ..data.seg_pipeline import bank_clients, build_style_bank

        p = self.params
        members = bank_clients(self.num_clients, p.style_clients, seed)
        idx = np.concatenate([self.clients[k].train for k in members])
        owners = np.concatenate([np.full(len(self.clients[k].train), k) for k in members])
        self.bank_members = members
        return build_style_bank(p.style, self.pool.images.subset(idx), owners, self.crop, p.style_beta, p.style_prob,
                                self.prefetcher, p.style_images, p.style_exclude)

    def source_batch(self, indices: Sequence[int], key: tuple, styles: torch.Tensor | None = None,
                     half: int = 1, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """A training batch of the server's source images at ``indices`` (augmented like the clients'
        batches, from the stream (seed, *key, j)), each restyled by FDA with a random one of ``styles``
        ``[M, 3, 2 half + 1, 2 half + 1]`` (LADD's pre-training with the clients' styles, lambda 1) when given;
        standardised on the task's device, labels int64."""
        from ..data.seg_pipeline import SegBatchLoader, StyleBank

        if self.source is None:
            raise ValueError("task.source is not set: this run has no labelled source dataset on the server")
        bank = None
        if styles is not None:
            bank = StyleBank("fda", styles.to(torch.float32).cpu(), np.full(len(styles), -1), 0.0, 1.0, half)
        p = self.params
        jitter = p.jitter if p.jitter_on in ("source", "both") else 0.0
        loader = SegBatchLoader(self.source.images, self.source.labels, self.crop, p.scale, p.flip, seed, bank, jitter)
        x, y = loader((list(indices), key, -2))
        return self.standardize(x), y.to(self.device).long()

    def _styles(self, images: Any, indices: Sequence[int], half: int) -> torch.Tensor:
        from ..data.seg_pipeline import style_entry

        return torch.stack([style_entry("fda", images.get_one(int(i)), self.crop, 0.0, half) for i in indices])

    def client_style(self, client: int, half: int = 1) -> torch.Tensor:
        """LADD's client style (thesis Sec. 5.3.3): the mean over the client's training images of their
        ``(2 half + 1)^2`` low-frequency amplitude windows (each image resized to the crop size first, so
        every window has the same frequency grid); ``[3, 2 half + 1, 2 half + 1]`` (27 numbers at half 1)."""
        return self._styles(self.pool.images, self.clients[client].train, half).mean(0)

    def image_styles(self, split: str | int, half: int = 1) -> torch.Tensor:
        """The style of every image of an evaluation split (one image's window, as ``client_style`` averages),
        ``[N, 3, 2 half + 1, 2 half + 1]``: what assigns a test image to its nearest style cluster."""
        s = self._split(split)
        return self._styles(s.images, range(len(s)), half)

    def setup_cost(self) -> dict[str, float]:
        """What crosses the network before round 1: every bank client uploads its style entries (one per
        training image: FDA/CFSI amplitude windows of 3 x h x w floats, LAB (mean, std) of 3 channels), every
        client downloads the bank. Nothing else of a client's data ever leaves it."""
        if self.style_bank is None:
            return {}
        return {"up_bytes": float(self.style_bank.nbytes()), "down_bytes": float(self.style_bank.nbytes() * self.num_clients)}

    def data_description(self) -> dict[str, Any]:
        """Per-client image counts per domain (the partition key), per-client class pixel counts, the test
        sets and the server validation set, for ``RUN_DIR/partition.json`` and ``fedsight partition``."""
        pixels = self.class_pixels()
        out: dict[str, Any] = {
            "partition_key": "domain",
            "class_names": list(self.data.domain_names),
            "client_label_counts": self.client_domain_counts().tolist(),
            "pixel_class_names": list(self.class_names),
            "client_class_pixels": [pixels[c.train].sum(0).tolist() for c in self.clients],
            "tests": {n: {"images": len(s), "domains": sorted({self.data.domain_names[d] for d in np.unique(s.domains)})}
                      for n, s in self.data.tests.items()},
            "validation": self.val_info,
        }
        if self.style_bank is not None:
            out["style_bank"] = {"kind": self.style_bank.kind, "clients": [int(k) for k in self.bank_members],
                                 "entries": len(self.style_bank.owners), "bytes": self.style_bank.nbytes()}
        return out

    def example_input(self) -> torch.Tensor:
        for c in range(self.num_clients):
            if self.num_train_examples(c):
                return self.train_batch(c, torch.tensor([0]))[0]
        raise ValueError("task 'segmentation': no client holds a training image")

    def save_visuals(self, model: nn.Module, path: Any, hooks: Any = None) -> Any:
        """``plots/visuals.png`` (and ``visuals_<name>.png`` per extra test set): image, ground truth and
        prediction of a few test images; ``plots/class_distribution.png``: the clients' class pixel shares."""
        from .seg_visuals import save_segmentation_visuals

        return save_segmentation_visuals(self, model, path, hooks)


@TASKS.register("segmentation", params=SegmentationParams, spec=SegmentationTask.spec,
                help="semantic segmentation: pixel cross-entropy (OHEM), mIoU from merged confusion matrices")
def build_segmentation_task(params: SegmentationParams, *, cfg: Any) -> SegmentationTask:
    """The task of a validated config: load ``cfg.data`` (a segmentation dataset), carve the server's
    validation images (stratified by domain), partition the rest by domain."""
    from ..data.partition import partition_from_config
    from ..data.seg_pipeline import class_pixel_counts
    from ..data.server_split import carve_server_splits
    from ..registry import DATASETS, PARTITIONERS
    from .base import component_params

    data = build(DATASETS, cfg.data.name, component_params(cfg.data), seed=cfg.seed)
    if not isinstance(data, SegmentationData):
        raise ValueError(f"data.name = {cfg.data.name!r} is not a segmentation dataset")
    if cfg.validation.source == "dataset":
        raise ValueError('validation.source = "dataset" is not supported by task segmentation; use "carve"')
    server = carve_server_splits(cfg, data.train.domains, len(data.domain_names), list(data.domain_names))
    val = data.train.subset(server.held["val"]) if "val" in server.held else None
    pool = data.train.subset(server.rest)
    needs = PARTITIONERS.get(cfg.partition.name).meta.get("needs", ())
    attributes: dict[str, np.ndarray] = {}
    pixels = None
    if "class_presence" in needs:
        pixels = class_pixel_counts(pool.labels, data.num_classes)
        attributes["class_presence"] = pixels > 0
    if "client_of" in needs:
        if data.clients is None:
            raise ValueError(f"partition.name = 'predefined': dataset {cfg.data.name!r} has no client split of its own")
        client_of = np.full(len(data.train), -1, dtype=np.int64)
        for k, idx in enumerate(data.clients):
            client_of[idx] = k
        attributes["client_of"] = client_of[server.rest]
    source = None
    task_params = params if isinstance(params, SegmentationParams) else SegmentationParams(**component_params(params))
    if task_params.source is not None:
        spec = dict(task_params.source)
        if "name" not in spec:
            raise ValueError("task.source needs a dataset name, e.g. {name = \"street\", ...}")
        src = build(DATASETS, spec.pop("name"), spec, seed=cfg.seed)
        if not isinstance(src, SegmentationData) or list(src.class_names) != list(data.class_names):
            got = list(src.class_names) if isinstance(src, SegmentationData) else "not a segmentation dataset"
            raise ValueError(f"task.source: its classes {got} are not the clients' data's {list(data.class_names)}")
        source = src.train
    data = SegmentationData(pool, data.tests, data.class_names, data.domain_names)
    clients = partition_from_config(pool.domains, cfg, attributes)
    model_params = MODELS.get(cfg.model.name).params(**component_params(cfg.model))
    return SegmentationTask(data, clients, cfg.model.name, model_params, task_params, seed=cfg.seed, val=val,
                            val_info=server.summaries.get("validation"), class_pixels=pixels, source=source)
