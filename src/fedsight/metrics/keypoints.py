"""Keypoint metrics as mergeable states: PCK (per-joint hit counts, summed over batches and clients) and COCO
OKS AP (the detections themselves, concatenated, ranked together by pycocotools at ``compute``).

Both states carry everything they need, ground truth included, so a server merges clients' states and computes
the metric without holding any client's annotations (the ``cat`` entries cross a Flower record as plain
tensors). Detections of all clients therefore merge before AP is computed, as COCO evaluates one detection
file: AP is never a mean of per-client APs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..functional.keypoints import oks_ap, pck_hits
from .state import Metric, MetricSpec, MetricState

__all__ = ["PCK", "OKSAP"]


class PCK(Metric):
    """Percentage of correct keypoints: a labelled joint is correct when its prediction lies within
    ``threshold x norm`` of the ground truth. State: per-joint ``hits`` and ``count`` (int64 sums). Value: the
    sum of hits over the joints not in ``exclude`` divided by their count (MPII's mean PCKh weights joints by
    their labelled counts, which is this ratio; pelvis and thorax are excluded there)."""

    def __init__(self, name: str, num_joints: int, threshold: float, exclude: Sequence[int] = (), doc: str = ""):
        self.name, self.num_joints, self.threshold = name, int(num_joints), float(threshold)
        self.exclude = tuple(int(j) for j in exclude)
        self.doc = doc

    def reductions(self) -> dict[str, str]:
        return {self.key("hits"): "sum", self.key("count"): "sum"}

    def specs(self) -> tuple[MetricSpec, ...]:
        return (MetricSpec(self.name, True, self.doc, (0.0, 100.0)),)

    def update(self, state: MetricState, pred: torch.Tensor, gt: torch.Tensor, visible: torch.Tensor,
               norm: torch.Tensor) -> None:
        """``pred``/``gt`` [N, J, 2] source-image pixels, ``visible`` [N, J] bool, ``norm`` [N] (instances with
        a non-positive or nan norm are left out)."""
        ok = torch.isfinite(norm) & (norm > 0)
        if not bool(ok.any()):
            return
        hits, count = pck_hits(pred[ok], gt[ok], visible[ok], norm[ok], self.threshold)
        state.add(self.key("hits"), hits.to(torch.int64).cpu())
        state.add(self.key("count"), count.to(torch.int64).cpu())

    def compute(self, state: MetricState) -> dict[str, float]:
        hits, count = state.get(self.key("hits")), state.get(self.key("count"))
        if hits is None or count is None:
            return {}
        keep = torch.ones(self.num_joints, dtype=torch.bool)
        keep[list(self.exclude)] = False
        total = int(count[keep].sum())
        return {} if total == 0 else {self.name: 100.0 * int(hits[keep].sum()) / total}


class OKSAP(Metric):
    """COCO keypoint AP/AR over object keypoint similarity, computed by pycocotools from the concatenated
    detections of every evaluated batch (and client). State (``cat``): ``pred`` [N, J, 3] (x, y, per-joint
    score), ``gt`` [N, J, 3] (x, y, v), ``area`` [N], ``box`` [N, 4] xywh and ``image`` [N] (image ids; the
    matching is per image). Values: ``ap`` (AP@[.5:.95]), ``ap50``, ``ap75`` and ``ar`` as percentages."""

    KEYS = ("ap", "ap50", "ap75", "ar")

    def __init__(self, sigmas: Sequence[float]):
        self.name = "oks"
        self.sigmas = [float(s) for s in sigmas]

    def reductions(self) -> dict[str, str]:
        return {self.key(k): "cat" for k in ("pred", "gt", "area", "box", "image")}

    def specs(self) -> tuple[MetricSpec, ...]:
        # (pycocotools' -1, "no ground truth", cannot occur: ``compute`` gives nothing without a visible joint)
        pct = (0.0, 100.0)
        return (MetricSpec("ap", True, "COCO OKS AP@[.5:.95] (%), detections of all clients ranked together", pct),
                MetricSpec("ap50", True, "COCO OKS AP at OKS 0.5 (%)", pct),
                MetricSpec("ap75", True, "COCO OKS AP at OKS 0.75 (%)", pct),
                MetricSpec("ar", True, "COCO OKS AR@[.5:.95] (%)", pct))

    def update(self, state: MetricState, pred: torch.Tensor, gt: torch.Tensor, area: torch.Tensor,
               box: torch.Tensor, image: torch.Tensor) -> None:
        state.add(self.key("pred"), pred.detach().to(torch.float64).cpu())
        state.add(self.key("gt"), gt.detach().to(torch.float64).cpu())
        state.add(self.key("area"), area.detach().to(torch.float64).cpu())
        state.add(self.key("box"), box.detach().to(torch.float64).cpu())
        state.add(self.key("image"), image.detach().to(torch.int64).cpu())

    def compute(self, state: MetricState) -> dict[str, float]:
        pred = state.get(self.key("pred"))
        if pred is None or len(pred) == 0:
            return {}
        gt = state.get(self.key("gt"))
        if not bool((gt[..., 2] > 0).any()):
            return {}
        stats = oks_ap(pred, gt, state.get(self.key("area")), state.get(self.key("image")), self.sigmas,
                       bbox=state.get(self.key("box")))
        return {k: 100.0 * stats[k] for k in self.KEYS}
