"""Dataset containers shared by loaders, partitioners and tasks: images in memory (``ArrayDataset``) or
read from disk on demand (``StoredDataset``), with integer labels."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sized
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch


class _Labelled:
    """What both dataset kinds share: integer labels ``y`` [N] and class names (default "0", "1", ...)."""

    y: torch.Tensor
    num_classes: int
    class_names: list[str]

    def _check_labels(self, n: int) -> None:
        if self.y.ndim != 1 or len(self.y) != n:
            raise ValueError(f"labels must be [N] with N={n}, got shape {tuple(self.y.shape)}")
        if not self.class_names:
            self.class_names = [str(c) for c in range(self.num_classes)]

    def __len__(self) -> int:
        return len(self.y)

    @property
    def labels(self) -> np.ndarray:
        return self.y.numpy()


@dataclass
class ArrayDataset(_Labelled):
    """Images and integer labels held as tensors.

    ``x`` is float32 ``[N, C, H, W]`` scaled to [0, 1] (before any normalisation), ``y`` int64 ``[N]``.
    """

    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    class_names: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.x.ndim != 4:
            raise ValueError(f"images must be [N, C, H, W], got shape {tuple(self.x.shape)}")
        self._check_labels(len(self.x))

    @property
    def shape(self) -> tuple[int, int, int]:
        """(C, H, W) of every image."""
        return tuple(self.x.shape[1:])  # type: ignore[return-value]

    def subset(self, idx: np.ndarray | torch.Tensor) -> "ArrayDataset":
        idx_t = torch.as_tensor(np.asarray(idx), dtype=torch.long)
        return ArrayDataset(self.x[idx_t], self.y[idx_t], self.num_classes, self.class_names)

    def materialize(self) -> "ArrayDataset":
        return self


@dataclass(frozen=True)
class LoaderSpec:
    """How a task reads a ``StoredDataset``: prefetching workers (threads or processes, 0 = decode in the
    training thread) and the training augmentation (``"crop_flip"``: zero-pad by ``crop_pad``, random crop,
    horizontal flip; per-sample randomness from the stream (seed, "augment", round, client, step, j))."""

    workers: int = 2
    backend: Literal["thread", "process"] = "thread"
    augment: Literal["none", "crop_flip"] = "none"
    crop_pad: int = 4


@dataclass
class StoredDataset(_Labelled):
    """Images decoded on demand from an image store (``fedsight.data.pipeline.ImageStore``: uint8
    ``[C, H, W]``, all the same size) and integer labels held in memory. ``subset`` is a lazy view."""

    store: Any
    y: torch.Tensor
    num_classes: int
    class_names: list[str] = field(default_factory=list)
    loader: LoaderSpec = field(default_factory=LoaderSpec)

    def __post_init__(self) -> None:
        self._check_labels(len(self.store))
        if self.store.shape is None:
            raise ValueError("a StoredDataset needs images of one size (set the loader's image_size)")

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.store.shape)

    def subset(self, idx: np.ndarray | torch.Tensor) -> "StoredDataset":
        idx = np.asarray(idx, dtype=np.int64)
        return StoredDataset(self.store.subset(idx), self.y[torch.as_tensor(idx)], self.num_classes,
                             self.class_names, self.loader)

    def materialize(self, batch_size: int = 256) -> ArrayDataset:
        """Every image decoded into memory as float32 in [0, 1] (small sets: a node's own data, V)."""
        n = len(self)
        parts = [self.store.get(np.arange(s, min(s + batch_size, n))) for s in range(0, n, batch_size)]
        x = torch.cat(parts).to(torch.float32).div_(255.0) if parts else torch.zeros(0, *self.shape)
        return ArrayDataset(x, self.y.clone(), self.num_classes, self.class_names)


@dataclass
class DatasetSplits:
    """What a dataset loader returns: a training pool (partitioned over clients) and a global test set; a
    dataset published with its own client split also gives ``client_of`` (each training sample's client,
    0..K-1: ``partition.name = "predefined"``) and the clients' names."""

    train: ArrayDataset | StoredDataset
    test: ArrayDataset | StoredDataset
    client_of: np.ndarray | None = None
    client_names: list[str] | None = None

    @property
    def in_channels(self) -> int:
        return int(self.train.shape[0])

    @property
    def image_size(self) -> int:
        return int(self.train.shape[-1])

    @property
    def num_classes(self) -> int:
        return self.train.num_classes


def check_named_tests(what: str, train: Sized, tests: Mapping[str, Sized], unit: str) -> None:
    """A loader's named test sets: a non-empty training set, at least one test set, names usable as split
    suffixes (``test_<name>``), no empty test set; one-line ``ValueError`` otherwise."""
    if len(train) == 0:
        raise ValueError(f"{what}: the training set has no {unit}")
    if not tests:
        raise ValueError(f"{what}: no test set")
    for name, s in tests.items():
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+-]*", name):
            raise ValueError(f"{what}: test set name {name!r} must be letters, digits, '_', '.', '+' or '-'")
        if len(s) == 0:
            raise ValueError(f"{what}: test set {name!r} has no {unit}")
