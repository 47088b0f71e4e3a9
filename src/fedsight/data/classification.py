"""Image-classification dataset loaders: scikit-learn digits, ImageFolder trees and MedMNIST ``.npz`` files.

Every loader is registered in :data:`fedsight.registry.DATASETS` as ``factory(params, *, seed) ->
DatasetSplits`` and reads local files only. Images come back float32 ``[N, C, H, W]`` in [0, 1], labels
int64 ``[N]``. Where a loader has to cut a test set out of the training data it does so with its own
``split_seed`` parameter, not the run seed, so every run of an experiment is scored on the same test set.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field

from fedsight.data.base import ArrayDataset, DatasetSplits, LoaderSpec, StoredDataset
from fedsight.data.images import check_image_header, scan_image_folder
from fedsight.errors import DataFileError
from fedsight.registry import DATASETS, Params
from fedsight.safe_read import NpzArrays, exists, read_npz

# --------------------------------------------------------------------------------------------- helpers


def _to_splits(
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    num_classes: int,
    class_names: list[str] | None = None,
) -> DatasetSplits:
    names = list(class_names) if class_names else [str(c) for c in range(num_classes)]

    def ds(x: np.ndarray, y: np.ndarray) -> ArrayDataset:
        return ArrayDataset(
            torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)),
            torch.from_numpy(np.ascontiguousarray(y, dtype=np.int64)),
            num_classes,
            list(names),
        )

    return DatasetSplits(train=ds(x_train, y_train), test=ds(x_test, y_test))


def stratified_split(labels: np.ndarray, test_fraction: float, split_seed: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (train, test) index arrays, stratified by label with scikit-learn's ``train_test_split``.

    Falls back to an unstratified split (with a warning) when some class has a single sample or the test
    or training side would be too small to hold every class. ``what`` names the data in messages.
    """
    from sklearn.model_selection import train_test_split

    labels = np.asarray(labels)
    n = len(labels)
    if n < 2:
        raise ValueError(f"{what}: cannot split {n} sample(s) into a training and a test set")
    n_test = int(np.ceil(test_fraction * n))
    n_train = n - n_test
    if n_test < 1 or n_train < 1:
        raise ValueError(f"{what}: test_fraction={test_fraction} leaves an empty training or test set of {n} samples")
    _, counts = np.unique(labels, return_counts=True)
    stratify: np.ndarray | None = labels
    if counts.min() < 2 or n_test < len(counts) or n_train < len(counts):
        warnings.warn(
            f"{what}: cannot stratify the train/test split by label (a class has fewer than 2 samples or a "
            "side is smaller than the number of classes); splitting at random instead",
            stacklevel=3,
        )
        stratify = None
    idx = np.arange(n)
    train, test = train_test_split(idx, test_size=n_test, random_state=split_seed, shuffle=True, stratify=stratify)
    return np.sort(train).astype(np.int64), np.sort(test).astype(np.int64)


def _resize_uint8(images: np.ndarray, size: int) -> np.ndarray:
    """Bilinear PIL resize of uint8 images ``[N, H, W]`` or ``[N, H, W, 3]`` to ``size`` x ``size``."""
    from PIL import Image

    if images.shape[1] == size and images.shape[2] == size:
        return images
    out = np.empty((len(images), size, size) + images.shape[3:], dtype=np.uint8)
    for i, im in enumerate(images):
        out[i] = np.asarray(Image.fromarray(im).resize((size, size), Image.Resampling.BILINEAR))
    return out


def _nhwc_uint8_to_nchw_float(images: np.ndarray) -> np.ndarray:
    """uint8 ``[N, H, W]`` or ``[N, H, W, C]`` -> float32 ``[N, C, H, W]`` in [0, 1]."""
    if images.ndim == 3:
        images = images[:, None]
    else:
        images = images.transpose(0, 3, 1, 2)
    return images.astype(np.float32) / np.float32(255.0)


# ---------------------------------------------------------------------------------------------- digits


class DigitsParams(Params):
    test_fraction: float = Field(0.2, gt=0, lt=1, description="fraction of the 1,797 images held out as the test set")
    split_seed: int = Field(0, ge=0, description="seed of the stratified train/test split (independent of the run seed)")


@DATASETS.register("digits", params=DigitsParams, help="scikit-learn's 8x8 handwritten digits (1,797 images, 10 classes)")
def load_digits_dataset(params: DigitsParams, *, seed: int) -> DatasetSplits:
    """scikit-learn's bundled digits, 1 x 8 x 8 greyscale, split stratified by ``split_seed``."""
    from sklearn.datasets import load_digits

    del seed  # the split uses split_seed so the test set is shared by all runs
    bunch = load_digits()
    x = (bunch.images.astype(np.float32) / np.float32(16.0))[:, None]
    y = bunch.target.astype(np.int64)
    train, test = stratified_split(y, params.test_fraction, params.split_seed, "digits")
    num_classes = int(y.max()) + 1
    return _to_splits(x[train], y[train], x[test], y[test], num_classes)


# ----------------------------------------------------------------------------------------- imagefolder


class StoredImageParams(Params):
    """How image files are read: the fields every loader of image files shares (``imagefolder``,
    ``federated_csv``)."""

    image_size: int = Field(32, ge=1, description="images are resized (bilinear) to image_size x image_size")
    channels: Literal[1, 3] = Field(3, description="1: greyscale (PIL mode L), 3: RGB")
    workers: int = Field(2, ge=0, description="decoding workers that prefetch batches (0: decode in the training thread)")
    backend: Literal["thread", "process"] = Field("thread", description="prefetch workers: threads or spawned processes")
    cache_mb: float = Field(0.0, ge=0, description="keep up to this many MB of decoded images in memory (LRU)")
    augment: Literal["none", "crop_flip"] = Field(
        "none", description="training augmentation: crop_flip = zero-pad by crop_pad, random crop, horizontal flip"
    )
    crop_pad: int = Field(4, ge=0, description="crop_flip: padding on each side (CIFAR: 4)")

    def loader_spec(self) -> LoaderSpec:
        return LoaderSpec(self.workers, self.backend, self.augment, self.crop_pad)


class ImageFolderParams(StoredImageParams):
    train_dir: str = Field(description="folder laid out as <train_dir>/<class name>/<image files>")
    test_dir: str | None = Field(None, description="same layout and classes; if unset, train_dir is split")
    test_fraction: float = Field(0.2, gt=0, lt=1, description="test fraction when test_dir is unset")
    split_seed: int = Field(0, ge=0, description="seed of the stratified split when test_dir is unset")


def file_store(paths: list[Any], p: StoredImageParams) -> Any:
    """A lazy store of image files (nothing decoded here); a file that is no image fails now, not in round 7
    (a truncated one: when decoded)."""
    from fedsight.data.pipeline import FileImageStore

    for path in paths:
        check_image_header(path)
    return FileImageStore(paths, p.image_size, p.channels, cache_bytes=int(p.cache_mb * 2**20))


def _folder_store(root: str, p: ImageFolderParams) -> tuple[list[str], Any, torch.Tensor]:
    """(class names, a lazy store of the tree's files, labels): nothing is decoded here."""
    classes, samples = scan_image_folder(root)
    store = file_store([path for path, _ in samples], p)
    return classes, store, torch.tensor([lab for _, lab in samples], dtype=torch.int64)


@DATASETS.register("imagefolder", params=ImageFolderParams, help="torchvision-style <dir>/<class>/<image> folders")
def load_imagefolder(params: ImageFolderParams, *, seed: int) -> DatasetSplits:
    """ImageFolder tree(s), read lazily: images are decoded (and resized) when a batch needs them, by
    ``workers`` prefetching workers, so memory does not grow with the number of files. Classes are the
    sorted sub-folder names of ``train_dir``."""
    del seed
    loader = params.loader_spec()
    classes, store, y = _folder_store(params.train_dir, params)
    if params.test_dir is None:
        train, test = stratified_split(y.numpy(), params.test_fraction, params.split_seed, f"image folder {params.train_dir!r}")
        whole = StoredDataset(store, y, len(classes), classes, loader)
        return DatasetSplits(train=whole.subset(train), test=whole.subset(test))
    test_classes, test_store, y_te = _folder_store(params.test_dir, params)
    if test_classes != classes:
        only_train = sorted(set(classes) - set(test_classes))
        only_test = sorted(set(test_classes) - set(classes))
        raise ValueError(
            f"test_dir {params.test_dir!r} and train_dir {params.train_dir!r} have different classes; "
            f"only in train_dir: {only_train}, only in test_dir: {only_test}"
        )
    return DatasetSplits(train=StoredDataset(store, y, len(classes), classes, loader),
                         test=StoredDataset(test_store, y_te, len(classes), classes, loader))


# ------------------------------------------------------------------------------------------------- npz


class NpzParams(Params):
    path: str = Field(description="MedMNIST-style .npz with train_images/train_labels/test_images/test_labels")
    include_val_in_train: bool = Field(False, description="append val_images/val_labels to the training pool")
    image_size: int | None = Field(None, ge=1, description="optional bilinear resize to image_size x image_size")


def _npz_images(data: NpzArrays, key: str, path: str) -> np.ndarray:
    if key not in data.files:
        raise ValueError(f"{path!r} has no key {key!r} (keys: {', '.join(sorted(data.files))})")
    images = data[key]
    if images.dtype != np.uint8:
        raise ValueError(f"{path!r}: {key!r} must be uint8 images, got dtype {images.dtype}")
    if images.ndim == 4 and images.shape[-1] == 1:
        images = images[..., 0]
    if not (images.ndim == 3 or (images.ndim == 4 and images.shape[-1] == 3)):
        raise ValueError(
            f"{path!r}: {key!r} must be [N, H, W] (grey) or [N, H, W, 3] (RGB) images, got shape {images.shape} "
            "(3-D volumes are not supported)"
        )
    return images


def _npz_labels(data: NpzArrays, key: str, path: str, n: int) -> np.ndarray:
    if key not in data.files:
        raise ValueError(f"{path!r} has no key {key!r} (keys: {', '.join(sorted(data.files))})")
    labels = data[key]
    if labels.ndim == 2 and labels.shape[1] == 1:
        labels = labels[:, 0]
    elif labels.ndim == 2:
        raise ValueError(
            f"{path!r}: {key!r} has shape {labels.shape}: multi-label data ({labels.shape[1]} label columns) "
            "is not supported; expected [N] or [N, 1] class indices"
        )
    if labels.ndim != 1:
        raise ValueError(f"{path!r}: {key!r} must be [N] or [N, 1] class indices, got shape {labels.shape}")
    if len(labels) != n:
        raise ValueError(f"{path!r}: {key!r} has {len(labels)} labels for {n} images")
    if labels.dtype.kind not in "iub":
        if labels.dtype.kind == "f" and np.all(np.isfinite(labels)) and np.all(labels == np.round(labels)):
            labels = labels.astype(np.int64)
        else:
            raise ValueError(f"{path!r}: {key!r} must hold integer class indices, got dtype {labels.dtype}")
    labels = labels.astype(np.int64)
    if n and labels.min() < 0:
        raise ValueError(f"{path!r}: {key!r} holds negative class indices")
    return labels


@DATASETS.register("npz", params=NpzParams, help="MedMNIST-style .npz (train/val/test images and labels)")
def load_npz(params: NpzParams, *, seed: int) -> DatasetSplits:
    """A MedMNIST-layout ``.npz``: uint8 images ``[N, H, W]`` / ``[N, H, W, 3]``, labels ``[N]`` / ``[N, 1]``."""
    del seed
    path = params.path
    if not exists(path):
        raise FileNotFoundError(f"npz file {path!r} does not exist")
    parts = ["train", "val", "test"] if params.include_val_in_train else ["train", "test"]
    # read now, bounded: a regular file, a damaged archive or array named with the file (fedsight.safe_read)
    data = read_npz(path, "npz file", [f"{part}_{what}" for part in parts for what in ("images", "labels")])
    images: dict[str, np.ndarray] = {}
    labels: dict[str, np.ndarray] = {}
    for part in parts:
        images[part] = _npz_images(data, f"{part}_images", path)
        labels[part] = _npz_labels(data, f"{part}_labels", path, len(images[part]))
    shapes = {part: im.shape[1:] for part, im in images.items()}
    if len(set(shapes.values())) != 1 and params.image_size is None:
        raise ValueError(f"{path!r}: image shapes differ between splits: {shapes}; set image_size to resize them")
    if len({s[2:] for s in shapes.values()}) != 1:
        raise ValueError(f"{path!r}: some splits are greyscale and others RGB: {shapes}")
    if params.image_size is not None:
        images = {part: _resize_uint8(im, params.image_size) for part, im in images.items()}
    train_parts = [p for p in parts if p != "test"]
    x_tr = np.concatenate([images[p] for p in train_parts])
    y_tr = np.concatenate([labels[p] for p in train_parts])
    x_te, y_te = images["test"], labels["test"]
    if len(y_tr) == 0:
        raise ValueError(f"{path!r}: the training split is empty")
    if len(y_te) == 0:  # the global test set: every evaluation would divide by zero images
        raise DataFileError(f"npz file {path} (data.path): test_images holds 0 images; the test set needs at least one")
    num_classes = int(max(y_tr.max(), y_te.max() if len(y_te) else 0)) + 1
    return _to_splits(_nhwc_uint8_to_nchw_float(x_tr), y_tr, _nhwc_uint8_to_nchw_float(x_te), y_te, num_classes)
