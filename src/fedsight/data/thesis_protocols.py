"""Two data protocols of the thesis's chapter 3 experiments, applied to any classification dataset:

**RGB-shift domain imbalance** (thesis Sec. 3.9.10, Table 3.9; ``partition.rgb_shift``). "The clients are divided
into three equal-sized groups, each associated with a specific RGB channel. In the first group, the red channel of
the images is multiplied by a domain imbalance intensity factor delta, while the green and blue channels are
multiplied by the factor 1/delta. [...] The red, green, and blue channels of the test set are also enhanced in the
same manner over three equally sized groups." So the shift is multiplicative (not an additive offset), constant
per client, one of three, and applied to the pixels themselves (before the task's standardisation, whose
statistics are then those of the shifted pool). Choices the thesis leaves open, made here:

* *which* clients form each group: a random permutation of the clients (stream (seed, "rgb_shift", "clients")),
  cut into three contiguous thirds (sizes within one of each other); the test images likewise (stream (seed,
  "rgb_shift", "test")). A client's local test images belong to its group (they are its domain).
* *clipping*: ``clip = true`` (the default) clamps the shifted pixels to [0, 1], what an 8-bit image of the
  shifted scene holds (a channel multiplied by 2 saturates); ``clip = false`` keeps the products (a channel may
  reach delta), the literal "multiplied", for in-memory datasets only. On-disk images (``imagefolder``,
  ``federated_csv``) are 8-bit and shifted as 8-bit: floor(clamp(255 x pixel x factor, 0, 255) + 0.5), so they always clip.
* the server-held validation and pre-training splits (``[validation]``, ``[pretrain]``) are the server's, not a
  client's: left unshifted.

**Globally class-imbalanced variants A-D** (thesis Sec. 3.9.12, Table 3.11; ``partition.global_imbalance``). "The
classes are randomly divided into" 1, 2, 4 or 10 groups, group g keeping a fraction f_g of "the available data for
each class": A keeps 50% of every class, B 25% / 75%, C 20 / 40 / 60 / 80%, D 5, 15, ..., 95%. Every variant keeps
half of the data (CIFAR-100: 25,000 of 50,000; the thesis: "exactly half"). The groups are a random permutation of
the classes cut into equal contiguous parts (stream (seed, "global_imbalance", "groups"): the thesis's seeds change
only the grouping); a class keeps round-half-up(f_g x n_c) of its n_c images, drawn at random (stream (seed,
"global_imbalance", "keep", c)); with 100 classes of 500 images every count is exact. The test set is untouched.
The number of classes must be a multiple of the number of groups (the thesis's equal groups).
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from .base import ArrayDataset, DatasetSplits, StoredDataset
from .pipeline import ImageStore, _as_index, _one
from ..errors import ConfigError
from ..rng import np_rng

#: thesis Sec. 3.9.12: the fraction of each class's data that each class group keeps
GLOBAL_IMBALANCE_VARIANTS: dict[str, tuple[float, ...]] = {
    "A": (0.5,),
    "B": (0.25, 0.75),
    "C": (0.2, 0.4, 0.6, 0.8),
    "D": tuple(round(0.05 + 0.1 * g, 2) for g in range(10)),
}


class RGBShift(BaseModel):
    """``partition.rgb_shift``: the thesis's Table 3.9 domain perturbation."""

    model_config = ConfigDict(extra="forbid")
    delta: float = Field(gt=0, description="intensity: a group's channel x delta, the other two x 1/delta "
                                           "(thesis: 1.2, 1.5, 2.0)")
    clip: bool = Field(True, description="clamp shifted pixels to [0, 1] (false: in-memory data only)")


# ----------------------------------------------------------------------------------------------- RGB shift


def rgb_factors(delta: float, channel: int, channels: int = 3) -> torch.Tensor:
    """The per-channel factors of group ``channel``: delta on that channel, 1/delta on the others (float64 [C])."""
    f = torch.full((channels,), 1.0 / delta, dtype=torch.float64)
    f[channel] = delta
    return f


def three_groups(n: int, rng: np.random.Generator) -> np.ndarray:
    """Group 0, 1 or 2 of each of ``n`` items: a random permutation cut into contiguous thirds."""
    group = np.empty(n, dtype=np.int64)
    group[rng.permutation(n)] = np.arange(n) * 3 // max(n, 1)
    return group


class ShiftedStore(ImageStore):
    """The 8-bit images of ``base``, image i's channels multiplied by ``factors[i]`` and stored back as 8-bit
    (rounded half up, clamped to 0..255): the images a client of a shifted domain would hold on disk."""

    def __init__(self, base: ImageStore, factors: torch.Tensor) -> None:
        self.base, self.factors = base, factors.to(torch.float32)

    def __len__(self) -> int:
        return len(self.base)

    @property
    def shape(self) -> tuple[int, int, int] | None:
        return self.base.shape

    def _apply(self, images: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        out = images.to(torch.float32) * f.view(*f.shape, 1, 1)
        return out.add_(0.5).floor_().clamp_(0, 255).to(torch.uint8)  # rounded half up

    def get(self, indices: Any) -> torch.Tensor:
        idx = _as_index(indices, len(self))
        return self._apply(self.base.get(idx), self.factors[torch.from_numpy(idx)])

    def get_one(self, i: int) -> torch.Tensor:
        return self._apply(self.base.get_one(i), self.factors[_one(i, len(self))])

    def _take(self, index: np.ndarray) -> ImageStore | None:
        compact = self.base._take(index)
        return None if compact is None else ShiftedStore(compact, self.factors[torch.from_numpy(index)])


def _shift(data: ArrayDataset | StoredDataset, factors: torch.Tensor, clip: bool, where: str):
    if isinstance(data, StoredDataset):
        if not clip:
            raise ConfigError(f"partition.rgb_shift.clip = false: {where} is read from 8-bit image files, which hold "
                             "clipped pixels only; set clip = true")
        return StoredDataset(ShiftedStore(data.store, factors), data.y, data.num_classes, data.class_names,
                             data.loader)
    x = data.x.to(torch.float64) * factors.view(len(factors), -1, 1, 1)
    if clip:
        x = x.clamp_(0.0, 1.0)
    return ArrayDataset(x.to(data.x.dtype), data.y, data.num_classes, data.class_names)


def apply_rgb_shift(splits: DatasetSplits, clients: Any, shift: RGBShift, seed: int
                    ) -> tuple[DatasetSplits, dict[str, Any]]:
    """``splits`` with every client's images (training and local test) shifted by its group's factors and the test
    set's images by theirs; and what ``partition.json`` records (each client's group, the test groups' sizes)."""
    channels = splits.in_channels
    if channels != 3:
        raise ConfigError(f"partition.rgb_shift needs RGB images; the data have {channels} channel(s) "
                         "(set data.channels = 3)")
    table = torch.stack([rgb_factors(shift.delta, c) for c in range(3)])  # [group, channel]
    client_group = three_groups(len(clients), np_rng(seed, "rgb_shift", "clients"))
    per_image = np.full(len(splits.train), -1, dtype=np.int64)
    for k, c in enumerate(clients):
        per_image[c.train] = client_group[k]
        per_image[c.test] = client_group[k]
    held = per_image < 0  # images no client holds (none after partitioning; kept as they are)
    factors = table[np.where(held, 0, per_image)]
    factors[torch.from_numpy(held)] = 1.0
    test_group = three_groups(len(splits.test), np_rng(seed, "rgb_shift", "test"))
    train = _shift(splits.train, factors, shift.clip, "the training data")
    test = _shift(splits.test, table[test_group], shift.clip, "the test data")
    info = {"delta": shift.delta, "clip": shift.clip, "channel_of_group": ["red", "green", "blue"],
            "client_group": client_group.tolist(),
            "test_group_sizes": np.bincount(test_group, minlength=3).tolist()}
    return DatasetSplits(train=train, test=test, client_of=splits.client_of, client_names=splits.client_names), info


# ------------------------------------------------------------------------------------ global class imbalance


def global_imbalance_keep(labels: np.ndarray, num_classes: int, variant: str, seed: int
                          ) -> tuple[np.ndarray, dict[str, Any]]:
    """Sorted indices of the training images variant ``variant`` keeps, and the grouping (for ``partition.json``)."""
    fractions = GLOBAL_IMBALANCE_VARIANTS[variant]
    groups = len(fractions)
    if num_classes % groups:
        raise ConfigError(f"partition.global_imbalance = {variant!r} splits the classes into {groups} equal groups; "
                         f"the data's {num_classes} classes are not a multiple of {groups}")
    order = np_rng(seed, "global_imbalance", "groups").permutation(num_classes)
    group_of = np.empty(num_classes, dtype=np.int64)
    group_of[order] = np.arange(num_classes) * groups // num_classes
    keep = []
    for c in range(num_classes):
        idx = np.flatnonzero(labels == c)
        take = int(np.floor(fractions[group_of[c]] * len(idx) + 0.5))
        keep.append(np_rng(seed, "global_imbalance", "keep", c).choice(idx, size=take, replace=False))
    kept = np.sort(np.concatenate(keep)).astype(np.int64) if keep else np.zeros(0, dtype=np.int64)
    info = {"variant": variant, "fractions": list(fractions), "class_group": group_of.tolist(),
            "kept": int(len(kept)), "of": int(len(labels))}
    return kept, info


def apply_global_imbalance(splits: DatasetSplits, variant: Literal["A", "B", "C", "D"], seed: int
                           ) -> tuple[DatasetSplits, dict[str, Any]]:
    """``splits`` with the training pool cut to variant ``variant`` (a predefined client split follows it)."""
    kept, info = global_imbalance_keep(splits.train.labels, splits.num_classes, variant, seed)
    client_of = None if splits.client_of is None else np.asarray(splits.client_of)[kept]
    return DatasetSplits(train=splits.train.subset(kept), test=splits.test, client_of=client_of,
                         client_names=splits.client_names), info
