"""Semantic-segmentation data: label maps, their stores, and the containers a segmentation loader returns.

A segmentation dataset is images (an ``ImageStore`` of ``fedsight.data.pipeline``: uint8 ``[3, H, W]``,
sizes may differ between images) with one label map each (a ``LabelStore``: uint8 ``[H, W]`` of *train ids*
``0 .. C-1`` and ``IGNORE = 255``), and a *domain* per image: the city, town, weather or appearance it
comes from. Domains are the partition key (``heterogeneous`` splits give each client one domain) and the
key of server-held carves.

Label files hold dataset-specific ids (Cityscapes ``labelIds``, GTA5 the same, IDDA its own); a lookup
table of 256 entries maps them to train ids when a map is read (``FileLabelStore(paths, lut)``); ids the
table does not map become 255. Label PNGs are read as stored: single-channel (mode ``L``), palette
(``P``, the indices, never the palette colours) or 16-bit (``I;16``, values above 255 are invalid).

``SegmentationData``: the training pool, named test sets (``"test"``, and e.g. ``"seen"`` / ``"unseen"``
test domains), class and domain names, and optionally a predefined client split (FedDrive's LEAF JSON:
one index array into the pool per client).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

IGNORE = 255


def identity_lut(num_classes: int) -> np.ndarray:
    """A lookup table keeping ids ``0 .. num_classes-1`` and ignoring every other value."""
    lut = np.full(256, IGNORE, dtype=np.uint8)
    lut[:num_classes] = np.arange(num_classes, dtype=np.uint8)
    return lut


def lut_from_map(mapping: dict[int, int]) -> np.ndarray:
    """A lookup table from ``{dataset id: train id}``; unmapped ids become ``IGNORE``."""
    lut = np.full(256, IGNORE, dtype=np.uint8)
    for src, dst in mapping.items():
        if not (0 <= src < 256 and (0 <= dst < 255)):
            raise ValueError(f"label map entry {src} -> {dst} is out of range (ids 0..255, train ids 0..254)")
        lut[src] = dst
    return lut


def load_label(path: str | os.PathLike[str]) -> np.ndarray:
    """A label map file as uint8 ``[H, W]`` of the ids it stores (PNG indices, not palette colours).
    Raises ``ValueError`` naming the file for an unreadable file, a colour image or ids above 255."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            im.load()
            if im.mode in ("L", "P"):
                return np.array(im, dtype=np.uint8)
            if im.mode in ("I", "I;16", "I;16B", "I;16L"):
                arr = np.asarray(im)
                if arr.size and (arr.min() < 0 or arr.max() > 255):
                    raise ValueError(f"label ids outside 0..255 (max {int(arr.max())})")
                return arr.astype(np.uint8)
            raise ValueError(f"a label map must be a single-channel or palette image, got mode {im.mode}")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise ValueError(f"cannot read label map {str(path)!r}: {type(e).__name__}: {e}") from e


class LabelStore(ABC):
    """Label maps by index: ``get_one(i)`` uint8 ``[H, W]`` of train ids (``IGNORE`` = 255)."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def get_one(self, i: int) -> torch.Tensor: ...

    def subset(self, indices: Sequence[int] | np.ndarray) -> "LabelStore":
        return SubsetLabelStore(self, np.asarray(indices, dtype=np.int64))


class TensorLabelStore(LabelStore):
    """Label maps held in memory: uint8 ``[N, H, W]`` (already train ids)."""

    def __init__(self, labels: torch.Tensor):
        if labels.ndim != 3 or labels.dtype != torch.uint8:
            raise ValueError(f"labels must be uint8 [N, H, W], got {labels.dtype} {tuple(labels.shape)}")
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def get_one(self, i: int) -> torch.Tensor:
        return self.labels[int(i)]


class FileLabelStore(LabelStore):
    """Label map files read on demand through a 256-entry lookup table ``lut`` (dataset id -> train id);
    ``size`` = ``(height, width)`` resizes every map to that size (nearest neighbour), None keeps it."""

    def __init__(
        self, paths: Sequence[str | os.PathLike[str]], lut: np.ndarray, size: tuple[int, int] | None = None
    ):
        self.paths = [os.fspath(p) for p in paths]
        lut = np.asarray(lut, dtype=np.uint8)
        if lut.shape != (256,):
            raise ValueError(f"a label lookup table has 256 entries, got shape {lut.shape}")
        self.lut = lut
        if size is not None:
            if len(size) != 2 or int(size[0]) < 1 or int(size[1]) < 1:
                raise ValueError(f"size must be None or (height, width) with both >= 1, got {size}")
            size = (int(size[0]), int(size[1]))
        self.size = size

    def __len__(self) -> int:
        return len(self.paths)

    def path(self, i: int) -> Path:
        return Path(self.paths[int(i)])

    def get_one(self, i: int) -> torch.Tensor:
        ids = load_label(self.paths[int(i)])
        if self.size is not None and ids.shape != self.size:
            from PIL import Image

            ids = np.asarray(Image.fromarray(ids, "L").resize(self.size[::-1], Image.Resampling.NEAREST))
        return torch.from_numpy(self.lut[ids])


class SubsetLabelStore(LabelStore):
    def __init__(self, base: LabelStore, indices: np.ndarray):
        if isinstance(base, SubsetLabelStore):  # views of views compose to one index map
            indices, base = base.indices[indices], base.base
        n = len(base)
        if indices.size and (indices.min() < 0 or indices.max() >= n):
            raise IndexError(f"label index out of range for a store of {n} maps")
        self.base, self.indices = base, indices

    def __len__(self) -> int:
        return len(self.indices)

    def get_one(self, i: int) -> torch.Tensor:
        return self.base.get_one(int(self.indices[int(i)]))


@dataclass
class SegmentationSet:
    """One split: images, their label maps, a domain id per image and an id per image (its file's
    relative path for real datasets: what FedDrive's split files name)."""

    images: Any  # fedsight.data.pipeline.ImageStore
    labels: LabelStore
    domains: np.ndarray
    names: list[str] = field(default_factory=list)
    #: ``[N, 2]`` (height, width) of every image as read (after a loader's resize), when the loader knows them
    sizes: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.domains = np.asarray(self.domains, dtype=np.int64)
        n = len(self.images)
        if len(self.labels) != n or len(self.domains) != n:
            raise ValueError(f"{n} images but {len(self.labels)} label maps and {len(self.domains)} domain ids")
        if not self.names:
            self.names = [str(i) for i in range(n)]
        elif len(self.names) != n:
            raise ValueError(f"{n} images but {len(self.names)} names")
        if self.sizes is not None:
            self.sizes = np.asarray(self.sizes, dtype=np.int64).reshape(n, 2)

    def __len__(self) -> int:
        return len(self.domains)

    def image_sizes(self) -> np.ndarray:
        """``[N, 2]`` (height, width) of every image: the loader's, one shape for a store of one size, else
        read once from the images themselves."""
        if self.sizes is None:
            shape = self.images.shape
            if shape is not None:
                self.sizes = np.tile(np.asarray(shape[1:], dtype=np.int64), (len(self), 1))
            else:
                self.sizes = np.array([self.images.get_one(i).shape[1:] for i in range(len(self))],
                                      dtype=np.int64).reshape(len(self), 2)
        return self.sizes

    def subset(self, idx: Sequence[int] | np.ndarray) -> "SegmentationSet":
        idx = np.asarray(idx, dtype=np.int64)
        return SegmentationSet(self.images.subset(idx), self.labels.subset(idx), self.domains[idx],
                               [self.names[int(i)] for i in idx], None if self.sizes is None else self.sizes[idx])


@dataclass
class SegmentationData:
    """What a segmentation loader returns."""

    train: SegmentationSet
    #: test sets by name: "test" always; others (e.g. "seen", "unseen") are extra evaluation splits
    tests: dict[str, SegmentationSet]
    class_names: list[str]
    domain_names: list[str]
    #: a predefined partition of ``train`` (FedDrive's split files): one index array per client, or None
    clients: list[np.ndarray] | None = None
    #: names of the predefined clients (``clients``), e.g. "erfurt0"
    client_names: list[str] | None = None

    def __post_init__(self) -> None:
        if "test" not in self.tests:
            raise ValueError(f"a segmentation dataset needs a 'test' set, got {sorted(self.tests)}")

    @property
    def num_classes(self) -> int:
        return len(self.class_names)
