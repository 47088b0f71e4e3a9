"""Keypoint data containers: skeletons and the person instances of top-down pose estimation.

Containers. A :class:`Skeleton` names the joints with their left/right pairs, drawing limbs, OKS sigmas
and the joints left out of the PCKh mean. A :class:`KeypointSet` holds person instances (one example per
person box, as SimpleBaseline / HRNet train): the joints ``[N, J, 3]`` (x, y in 0-based source-image
pixels, pixel ``(row i, col j)`` centred at ``(j, i)``; v = 0 unlabelled, 1 labelled but occluded, 2
visible), the region to crop (``center``, ``size``: padding included, aspect not fixed: the task fixes the
aspect to its input size), the OKS ``area``, the person ``bbox`` (xywh), the PCKh ``head_size`` and a
partition ``label``. Images are held once (a file path or a uint8 ``[H, W, 3]`` array) and shared by the
instances that point at them. :class:`KeypointSplits` is the training pool plus named test sets (the
first is the run's main test set).

Loaders building these live in ``fedsight.data.keypoint_files`` (COCO / MPII files) and
``fedsight.data.keypoints`` (the registered data sets); import the names from either module.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from fedsight.data.base import check_named_tests
from fedsight.functional.keypoints import COCO_SIGMAS, MPII_SIGMAS

__all__ = [
    "COCO17",
    "CUSTOM_SIGMA",
    "MPII16",
    "SC_BIAS",
    "KeypointSet",
    "KeypointSplits",
    "Skeleton",
    "custom_skeleton",
    "skeleton_from_names",
]

#: MPII's PCKh normaliser: head size = SC_BIAS x head-box diagonal (HRNet ``evaluate``)
SC_BIAS = 0.6
#: OKS sigma of every joint of a ``custom`` skeleton
CUSTOM_SIGMA = 0.05


@dataclass(frozen=True)
class Skeleton:
    """Joint names, 0-based left/right ``flip_pairs``, 0-based ``limbs`` (for drawing), OKS ``sigmas`` (one per
    joint) and the joints left out of the PCKh mean."""

    name: str
    joint_names: tuple[str, ...]
    flip_pairs: tuple[tuple[int, int], ...]
    limbs: tuple[tuple[int, int], ...]
    sigmas: tuple[float, ...]
    pckh_exclude: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        j = len(self.joint_names)
        problems = []
        if j == 0:
            problems.append("no joints")
        if len(set(self.joint_names)) != j:
            problems.append("repeated joint names")
        if len(self.sigmas) != j:
            problems.append(f"{len(self.sigmas)} sigmas for {j} joints")
        elif any(not (isinstance(s, (int, float)) and math.isfinite(s) and s > 0) for s in self.sigmas):
            problems.append("sigmas must be positive numbers")
        for what, pairs in (("flip_pairs", self.flip_pairs), ("limbs", self.limbs)):
            if any(len(p) != 2 or not all(0 <= int(i) < j for i in p) or p[0] == p[1] for p in pairs):
                problems.append(f"{what} must be pairs of distinct joint indices in 0..{j - 1}")
        if self.flip_pairs:
            flat = [i for p in self.flip_pairs for i in p]
            if len(set(flat)) != len(flat):
                problems.append("a joint is in two flip pairs")
        if any(not 0 <= int(i) < j for i in self.pckh_exclude):
            problems.append(f"pckh_exclude must be joint indices in 0..{j - 1}")
        if problems:
            raise ValueError(f"skeleton {self.name!r}: " + "; ".join(problems))

    @property
    def num_joints(self) -> int:
        return len(self.joint_names)


MPII16 = Skeleton(
    name="mpii16",
    joint_names=("r_ankle", "r_knee", "r_hip", "l_hip", "l_knee", "l_ankle", "pelvis", "thorax", "upper_neck", "head_top",
                 "r_wrist", "r_elbow", "r_shoulder", "l_shoulder", "l_elbow", "l_wrist"),
    flip_pairs=((0, 5), (1, 4), (2, 3), (10, 15), (11, 14), (12, 13)),
    # mmpose's MPII skeleton_info: legs through the pelvis, spine, shoulders from the upper neck, arms
    limbs=((0, 1), (1, 2), (2, 6), (6, 3), (3, 4), (4, 5), (6, 7), (7, 8), (8, 9), (8, 12), (12, 11), (11, 10),
           (8, 13), (13, 14), (14, 15)),
    sigmas=tuple(MPII_SIGMAS),
    pckh_exclude=(6, 7),
)

COCO17 = Skeleton(
    name="coco17",
    joint_names=("nose", "left_eye", "right_eye", "left_ear", "right_ear", "left_shoulder", "right_shoulder", "left_elbow",
                 "right_elbow", "left_wrist", "right_wrist", "left_hip", "right_hip", "left_knee", "right_knee",
                 "left_ankle", "right_ankle"),
    flip_pairs=((1, 2), (3, 4), (5, 6), (7, 8), (9, 10), (11, 12), (13, 14), (15, 16)),
    # the ``skeleton`` of person_keypoints_*.json ([[16, 14], [14, 12], ...], 1-based) made 0-based
    limbs=((15, 13), (13, 11), (16, 14), (14, 12), (11, 12), (5, 11), (6, 12), (5, 6), (5, 7), (6, 8), (7, 9), (8, 10),
           (1, 2), (0, 1), (0, 2), (1, 3), (2, 4), (3, 5), (4, 6)),
    sigmas=tuple(COCO_SIGMAS),
)

#: mmpose's spelling of the MPII joints (same order)
_MPII_LONG = tuple(n.replace("r_", "right_").replace("l_", "left_") if n[:2] in ("r_", "l_") else n for n in MPII16.joint_names)

_SIDES = (("left_", "right_"), ("l_", "r_"))


def custom_skeleton(names: Sequence[str], limbs: Sequence[tuple[int, int]] = ()) -> Skeleton:
    """A ``custom`` skeleton: flip pairs from ``left_X``/``right_X`` and ``l_X``/``r_X`` names
    (case-insensitive), the given 0-based limbs, sigma :data:`CUSTOM_SIGMA` for every joint."""
    low = [n.lower() for n in names]
    index = {n: i for i, n in enumerate(low)}
    pairs = []
    for i, n in enumerate(low):
        for left, right in _SIDES:
            if n.startswith(left):
                j = index.get(right + n[len(left):])
                if j is not None:
                    pairs.append((i, j))
                break
    return Skeleton("custom", tuple(names), tuple(pairs), tuple((int(a), int(b)) for a, b in limbs),
                    tuple([CUSTOM_SIGMA] * len(names)))


def skeleton_from_names(names: Sequence[str], limbs: Sequence[tuple[int, int]] = ()) -> Skeleton:
    """:data:`COCO17` for COCO's 17 names, :data:`MPII16` for MPII's 16 (either spelling), in their order;
    else :func:`custom_skeleton`."""
    names = tuple(names)
    if names == COCO17.joint_names:
        return COCO17
    if names in (MPII16.joint_names, _MPII_LONG):
        return MPII16
    return custom_skeleton(names, limbs)


def _int_array(a, n: int) -> np.ndarray:
    return np.asarray(a, dtype=np.int64).reshape(n) if n else np.zeros(0, dtype=np.int64)


def _stack(rows: list, shape: tuple[int, ...], dtype) -> np.ndarray:
    return np.asarray(rows, dtype=dtype).reshape((len(rows),) + shape) if rows else np.zeros((0,) + shape, dtype=dtype)


@dataclass
class KeypointSet:
    """Person instances for top-down pose estimation: one example per person box.

    ``images`` holds each distinct image once (a path of an image file, or a uint8 ``[H, W, 3]`` array);
    ``image[n]`` indexes it for instance ``n``. Arrays: ``image_id`` [N] int64 (the data set's image id),
    ``joints`` [N, J, 3] float32 (x, y, v), ``center`` / ``size`` [N, 2] float32 (the region to crop,
    padding included, aspect not fixed), ``area`` [N] float32 (OKS area), ``bbox`` [N, 4] float32 (xywh),
    ``head_size`` [N] float32 (PCKh normaliser, NaN where unknown), ``labels`` [N] int64 (partition keys,
    named by ``class_names``)."""

    skeleton: Skeleton
    images: list
    image: np.ndarray
    image_id: np.ndarray
    joints: np.ndarray
    center: np.ndarray
    size: np.ndarray
    area: np.ndarray
    bbox: np.ndarray
    head_size: np.ndarray
    labels: np.ndarray
    class_names: list[str]

    def __post_init__(self) -> None:
        self.image = np.asarray(self.image, dtype=np.int64)
        self.image_id = np.asarray(self.image_id, dtype=np.int64)
        self.labels = np.asarray(self.labels, dtype=np.int64)
        for name in ("joints", "center", "size", "area", "bbox", "head_size"):
            setattr(self, name, np.asarray(getattr(self, name), dtype=np.float32))
        n, J = len(self.image), self.skeleton.num_joints
        want = {"image": (n,), "image_id": (n,), "joints": (n, J, 3), "center": (n, 2), "size": (n, 2), "area": (n,),
                "bbox": (n, 4), "head_size": (n,), "labels": (n,)}
        problems = [f"{k} has shape {tuple(getattr(self, k).shape)}, expected {v}" for k, v in want.items()
                    if tuple(getattr(self, k).shape) != v]
        if not problems:
            if n and (self.image.min() < 0 or self.image.max() >= len(self.images)):
                problems.append(f"image indices must lie in 0..{len(self.images) - 1}")
            if n and (self.labels.min() < 0 or self.labels.max() >= len(self.class_names)):
                problems.append(f"labels must lie in 0..{len(self.class_names) - 1} (one class name each)")
            if n and not np.isin(self.joints[..., 2], (0, 1, 2)).all():
                problems.append("joint visibility v must be 0, 1 or 2")
            if n and not (np.isfinite(self.joints).all() and np.isfinite(self.center).all() and np.isfinite(self.size).all()):
                problems.append("joints, center and size must be finite")
            if n and (self.size <= 0).any():
                problems.append("size must be positive")
        for k, im in enumerate(self.images):
            if isinstance(im, (str, Path)):
                continue
            if not (isinstance(im, np.ndarray) and im.dtype == np.uint8 and im.ndim == 3 and im.shape[2] == 3):
                problems.append(f"images[{k}] must be a path or a uint8 [H, W, 3] array")
                break
        if problems:
            raise ValueError(f"KeypointSet ({self.skeleton.name}, {n} instances): " + "; ".join(problems))

    def __len__(self) -> int:
        return len(self.image)

    @property
    def num_joints(self) -> int:
        return self.skeleton.num_joints

    def subset(self, idx) -> "KeypointSet":
        """The instances at ``idx`` (indices or a boolean mask); the ``images`` list is shared whole."""
        idx = np.asarray(idx)
        if idx.dtype == bool:
            idx = np.flatnonzero(idx)
        idx = idx.astype(np.int64).reshape(-1)
        return replace(self, image=self.image[idx], image_id=self.image_id[idx], joints=self.joints[idx],
                       center=self.center[idx], size=self.size[idx], area=self.area[idx], bbox=self.bbox[idx],
                       head_size=self.head_size[idx], labels=self.labels[idx], class_names=list(self.class_names))

    def read_image(self, i: int) -> np.ndarray:
        """The uint8 ``[H, W, 3]`` image of instance ``i`` (a file is decoded as RGB, grey to 3 channels)."""
        from fedsight.data.images import load_image

        im = self.images[int(self.image[int(i)])]
        if isinstance(im, np.ndarray):
            return im
        return load_image(im, None, 3)


@dataclass
class KeypointSplits:
    """The training pool (partitioned over clients) and the named test sets (the first is the main one)."""

    train: KeypointSet
    tests: dict[str, KeypointSet]

    @property
    def skeleton(self) -> Skeleton:
        return self.train.skeleton

    def check(self, what: str) -> "KeypointSplits":
        check_named_tests(what, self.train, self.tests, "person instances")
        for name, s in self.tests.items():
            if s.skeleton != self.train.skeleton:
                raise ValueError(f"{what}: test set {name!r} has skeleton {s.skeleton.name} "
                                 f"({s.skeleton.num_joints} joints), the training set {self.train.skeleton.name} "
                                 f"({self.train.skeleton.num_joints} joints)")
        return self
