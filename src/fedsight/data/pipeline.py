"""Lazy on-disk image stores, streaming channel statistics and deterministic per-sample augmentation.

An :class:`ImageStore` hands out uint8 ``[B, C, H, W]`` batches by index; :class:`FileImageStore` decodes files
on demand (pixels bit-identical to the eager ImageFolder loader) with an optional LRU cache bounded in bytes, so
memory does not grow with the number of files beyond a compact path table. ``store.subset(idx)`` is a lazy view;
views of views compose to one index map. Sample ``j`` of a batch loaded with ``key`` is augmented with draws
from ``sample_generator(seed, *key, j)`` only (a named :mod:`fedsight.rng` stream, never global RNG state or the
worker's identity), so batches are identical with 0, 1 or more workers, threads or processes::

    loader = BatchLoader(store, augment=RandomCropFlip(4), seed=seed)   # load_batch for (indices, key) jobs
    jobs = [(idx, ("augment", rnd, client, step)) for step, idx in enumerate(batches)]
    for x in prefetcher.map(loader, jobs):
        ...
"""

from __future__ import annotations

import itertools
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedsight.data.images import image_hw, load_image, scan_image_folder
from fedsight.data.prefetch import CacheInfo, Prefetcher, _identity, pin_tensors, shared_cache
from fedsight.rng import np_rng

__all__ = [
    "Augment", "BatchLoader", "CacheInfo", "FileImageStore", "ImageStore", "Prefetcher", "RandomCropFlip",
    "SubsetStore", "TensorStore", "channel_stats", "image_folder_store", "load_batch", "pin_tensors",
    "sample_generator",
]  # fmt: skip

Indices = Sequence[int] | np.ndarray | torch.Tensor
_STORE_IDS = itertools.count()


def _as_index(indices: Indices, n: int) -> np.ndarray:
    """int64 1-D index array with negatives wrapped; IndexError when out of range."""
    if isinstance(indices, torch.Tensor):
        indices = indices.detach().cpu().numpy()
    idx = np.asarray(indices)
    if idx.size == 0:
        return np.zeros(0, dtype=np.int64)
    if idx.ndim != 1 or idx.dtype.kind not in "iu":
        raise TypeError(f"indices must be a 1-D sequence of ints, got shape {idx.shape} dtype {idx.dtype}")
    idx = idx.astype(np.int64)
    bad = (idx < -n) | (idx >= n)
    if bad.any():
        raise IndexError(f"index {int(idx[bad][0])} is out of range for a store of {n} images")
    return np.where(idx < 0, idx + n, idx)


def _one(i: int, n: int) -> int:
    return int(_as_index([i], n)[0])


def _hwc_to_chw(a: np.ndarray) -> np.ndarray:
    return a[None] if a.ndim == 2 else a.transpose(2, 0, 1)


# ------------------------------------------------------------------------------------------------ stores


class ImageStore(ABC):
    """Indexable uint8 images. ``get`` returns ``[B, C, H, W]`` (same-size images); ``get_one`` ``[C, H, W]``."""

    @abstractmethod
    def __len__(self) -> int: ...

    @property
    @abstractmethod
    def shape(self) -> tuple[int, int, int] | None:
        """``(C, H, W)`` of every image, or None when the images may differ in size."""

    @abstractmethod
    def get(self, indices: Indices) -> torch.Tensor: ...

    @abstractmethod
    def get_one(self, i: int) -> torch.Tensor: ...

    def subset(self, indices: Indices) -> ImageStore:
        """Lazy view of the images at ``indices`` (no pixels are read or copied)."""
        return SubsetStore(self, _as_index(indices, len(self)))

    def _take(self, index: np.ndarray) -> ImageStore | None:
        """A compact copy holding only ``index`` (used to pickle views small), or None if not supported."""
        return None


class TensorStore(ImageStore):
    """In-memory uint8 ``[N, C, H, W]`` images; ``get`` is an index gather."""

    def __init__(self, images: torch.Tensor) -> None:
        if not isinstance(images, torch.Tensor) or images.dtype != torch.uint8 or images.ndim != 4:
            raise TypeError("TensorStore needs a uint8 tensor [N, C, H, W]")
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.images.shape[1:])  # type: ignore[return-value]

    def get(self, indices: Indices) -> torch.Tensor:
        return self.images[torch.from_numpy(_as_index(indices, len(self)))]

    def get_one(self, i: int) -> torch.Tensor:
        return self.images[_one(i, len(self))].clone()

    def _take(self, index: np.ndarray) -> TensorStore:
        return TensorStore(self.images[torch.tensor(index)])


class SubsetStore(ImageStore):
    """The images ``base[indices]`` of another store. Subsets of a subset map straight to the base."""

    def __init__(self, base: ImageStore, indices: Indices) -> None:
        if isinstance(base, SubsetStore):
            indices, base = base.indices[_as_index(indices, len(base))], base.base
        self.base = base
        self.indices = _as_index(indices, len(base))
        self.indices.flags.writeable = False

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def shape(self) -> tuple[int, int, int] | None:
        return self.base.shape

    def get(self, indices: Indices) -> torch.Tensor:
        return self.base.get(self.indices[_as_index(indices, len(self))])

    def get_one(self, i: int) -> torch.Tensor:
        return self.base.get_one(int(self.indices[_one(i, len(self))]))

    def subset(self, indices: Indices) -> ImageStore:
        return SubsetStore(self.base, self.indices[_as_index(indices, len(self))])

    def _take(self, index: np.ndarray) -> ImageStore | None:
        return self.base._take(self.indices[index])

    def __reduce__(self) -> tuple[Any, ...]:
        # pickle (e.g. for a worker process) only this view's images/paths, not the whole base store
        compact = self.base._take(self.indices)
        if compact is not None:
            return _identity, (compact,)
        return SubsetStore, (self.base, self.indices)


class FileImageStore(ImageStore):
    """Image files decoded on demand with :func:`load_image` (``image_size=None``: native size, no resize; an
    int: square; a ``(height, width)`` pair: that size).

    Paths are kept as one byte string plus an offset array (about the path length per file). ``cache_bytes > 0``
    keeps decoded images in a thread-safe LRU cache bounded by that many bytes (an image larger than the bound
    is never cached); views of the store share it. In worker processes each worker has its own cache.
    """

    def __init__(
        self,
        paths: Sequence[str | os.PathLike[str]],
        image_size: int | tuple[int, int] | None,
        channels: int,
        cache_bytes: int = 0,
    ) -> None:
        if channels not in (1, 3):
            raise ValueError(f"channels must be 1 or 3, got {channels}")
        image_hw(image_size)  # ValueError for a size below 1
        if cache_bytes < 0:
            raise ValueError(f"cache_bytes must be >= 0, got {cache_bytes}")
        encoded = [os.fsencode(p) for p in paths]
        offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(b) for b in encoded], out=offsets[1:])
        uid = f"{os.getpid()}-{next(_STORE_IDS)}"
        self._setup(b"".join(encoded), offsets, image_size, channels, int(cache_bytes), uid)

    def _setup(
        self, blob: bytes, offsets: np.ndarray, size: int | tuple[int, int] | None, channels: int, cache: int, uid: str
    ) -> None:
        self._blob, self._offsets = blob, offsets
        #: None, an int (square) or a (height, width) tuple, as given
        self.image_size = image_hw(size) if isinstance(size, (tuple, list)) else None if size is None else int(size)
        self.channels, self.cache_bytes, self._uid = int(channels), cache, uid
        self._cache = shared_cache(uid, cache) if cache > 0 else None
        self._shape: tuple[int, int, int] | None | bool = False  # False: not computed yet

    def __getstate__(self) -> dict[str, Any]:
        return {"args": (self._blob, self._offsets, self.image_size, self.channels, self.cache_bytes, self._uid)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._setup(*state["args"])

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def _raw_path(self, i: int) -> bytes:
        return self._blob[self._offsets[i] : self._offsets[i + 1]]

    def path(self, i: int) -> Path:
        """The file of image ``i``."""
        return Path(os.fsdecode(self._raw_path(_one(i, len(self)))))

    @property
    def shape(self) -> tuple[int, int, int] | None:
        hw = image_hw(self.image_size)
        if hw is not None:
            return self.channels, *hw
        if self._shape is False:  # native sizes: read every file's header once (no decoding)
            from PIL import Image

            sizes = set()
            for i in range(len(self)):
                p = os.fsdecode(self._raw_path(i))
                try:
                    with Image.open(p) as im:
                        sizes.add(im.size)
                except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
                    raise ValueError(f"cannot read image file {p!r}: {type(e).__name__}: {e}") from e
                if len(sizes) > 1:
                    break
            self._shape = (self.channels, *next(iter(sizes))[::-1]) if len(sizes) == 1 else None
        return self._shape  # type: ignore[return-value]

    def _decode(self, i: int) -> np.ndarray:
        """Image ``i`` as uint8 ``[H, W]`` / ``[H, W, 3]`` (cached arrays are read-only)."""
        raw = self._raw_path(i)
        if self._cache is not None:
            hit = self._cache.get(raw)
            if hit is not None:
                return hit
        arr = load_image(os.fsdecode(raw), self.image_size, self.channels)
        if self._cache is not None:
            self._cache.put(raw, arr)
        return arr

    def get(self, indices: Indices) -> torch.Tensor:
        idx = _as_index(indices, len(self))
        if len(idx) == 0:
            shape = self.shape
            if shape is None:
                raise ValueError("an empty batch of a store with mixed image sizes has no shape")
            return torch.empty((0, *shape), dtype=torch.uint8)
        first = _hwc_to_chw(self._decode(int(idx[0])))
        out = np.empty((len(idx), *first.shape), dtype=np.uint8)
        out[0] = first
        for k in range(1, len(idx)):
            a = _hwc_to_chw(self._decode(int(idx[k])))
            if a.shape != first.shape:
                raise ValueError(
                    f"images differ in size ({self.path(int(idx[0]))}: {first.shape}, {self.path(int(idx[k]))}: "
                    f"{a.shape}); use get_one or set image_size"
                )
            out[k] = a
        return torch.from_numpy(out)

    def get_one(self, i: int) -> torch.Tensor:
        a = self._decode(_one(i, len(self)))
        return torch.from_numpy(np.ascontiguousarray(_hwc_to_chw(a)) if a.flags.writeable else _hwc_to_chw(a).copy())

    def _take(self, index: np.ndarray) -> FileImageStore:
        parts = [self._raw_path(int(i)) for i in index]
        offsets = np.zeros(len(parts) + 1, dtype=np.int64)
        np.cumsum([len(b) for b in parts], out=offsets[1:])
        new = object.__new__(FileImageStore)
        new._setup(b"".join(parts), offsets, self.image_size, self.channels, self.cache_bytes, self._uid)
        return new

    @property
    def cached_bytes(self) -> int:
        """Bytes of decoded images held in the cache now (0 without a cache)."""
        return 0 if self._cache is None else self._cache.info().nbytes

    def cache_info(self) -> CacheInfo:
        return CacheInfo(0, 0, 0, 0, 0) if self._cache is None else self._cache.info()


def image_folder_store(
    root: str | os.PathLike[str], image_size: int | None = 32, channels: int = 3, cache_bytes: int = 0
) -> tuple[FileImageStore, torch.Tensor, list[str]]:
    """A lazy ImageFolder tree: ``(store, labels int64 [N], class names)``, files in ``scan_image_folder`` order."""
    classes, samples = scan_image_folder(root)
    labels = torch.tensor([lab for _, lab in samples], dtype=torch.int64)
    return FileImageStore([p for p, _ in samples], image_size, channels, cache_bytes), labels, classes


# ------------------------------------------------------------------------------------------- statistics


def channel_stats(
    store: ImageStore, batch_size: int = 256, prefetcher: Prefetcher | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and unbiased (ddof=1) std of the pixels scaled to [0, 1], in one streaming pass.

    Keeps a 256-bin histogram per channel (exact int64 counts), so memory is O(batch) and the sums are exact;
    mean and std are then computed in float64 and returned as float32 ``[C]``. Stores of mixed image sizes
    are read one image at a time. ``prefetcher`` optionally decodes batches ahead.
    """
    n = len(store)
    if n == 0:
        raise ValueError("channel_stats of an empty store")
    same_size = store.shape is not None
    chunks = [np.arange(s, min(s + batch_size, n)) for s in range(0, n, batch_size)] if same_size else range(n)
    read = store.get if same_size else store.get_one
    hist: np.ndarray | None = None
    for x in (prefetcher.map(read, chunks) if prefetcher is not None else map(read, chunks)):
        x = x if same_size else x[None]
        if hist is None:
            hist = np.zeros((x.shape[1], 256), dtype=np.int64)
        for c in range(x.shape[1]):
            hist[c] += torch.bincount(x[:, c].reshape(-1), minlength=256).numpy()
    assert hist is not None
    v = np.arange(256, dtype=np.int64)
    means, stds = [], []
    for h in hist:
        count, s1, s2 = int(h.sum()), int(h @ v), int(h @ (v * v))  # exact (Python ints below)
        means.append(s1 / (255.0 * count))
        stds.append(((count * s2 - s1 * s1) / (count * (count - 1))) ** 0.5 / 255.0 if count > 1 else float("nan"))
    return torch.tensor(means, dtype=torch.float32), torch.tensor(stds, dtype=torch.float32)


# ------------------------------------------------------------------------------------------ augmentation


def sample_generator(seed: int, *key: object) -> np.random.Generator:
    """The random stream of one sample, e.g. ``sample_generator(seed, "augment", round, client, step, j)``."""
    return np_rng(seed, *key)


class Augment(ABC):
    """A random transform of one uint8 ``[C, H, W]`` image drawing only from the generator it is given."""

    @abstractmethod
    def __call__(self, image: torch.Tensor, rng: np.random.Generator) -> torch.Tensor: ...


class RandomCropFlip(Augment):
    """Zero-pad by ``pad`` on each side, crop a random window of the original size, flip horizontally with p=0.5.

    Draws, in this order: ``rng.integers(0, 2 * pad + 1, size=2)`` (row and column offset into the padded
    image), then, if ``flip``, ``rng.random() < 0.5`` (flip). The output pixel ``[c, y, x]`` (before the flip)
    is ``image[c, y + dy - pad, x + dx - pad]``, or 0 outside the image.
    """

    def __init__(self, pad: int = 4, flip: bool = True) -> None:
        if pad < 0:
            raise ValueError(f"pad must be >= 0, got {pad}")
        self.pad, self.flip = int(pad), bool(flip)

    def __repr__(self) -> str:
        return f"RandomCropFlip(pad={self.pad}, flip={self.flip})"

    def __call__(self, image: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
        _, h, w = image.shape
        dy, dx = (int(v) - self.pad for v in rng.integers(0, 2 * self.pad + 1, size=2))
        flip = self.flip and bool(rng.random() < 0.5)
        if dy == 0 and dx == 0:
            out = image.clone()
        else:
            out = torch.zeros_like(image)
            ys, xs = slice(max(0, -dy), min(h, h - dy)), slice(max(0, -dx), min(w, w - dx))
            if ys.start < ys.stop and xs.start < xs.stop:
                out[:, ys, xs] = image[:, ys.start + dy : ys.stop + dy, xs.start + dx : xs.stop + dx]
        return out.flip(-1) if flip else out


def load_batch(
    store: ImageStore,
    indices: Indices,
    augment: Augment | None = None,
    key: Sequence[object] | None = None,
    seed: int = 0,
) -> torch.Tensor:
    """uint8 ``[B, C, H, W]`` images ``store[indices]``; sample ``j`` is augmented with ``sample_generator(seed,
    *key, j)``.

    Module-level so that a process-backed :class:`Prefetcher` can pickle it, e.g.
    ``prefetcher.starmap(functools.partial(load_batch, store), [(indices, augment, key, seed), ...])``, or use
    :class:`BatchLoader` with ``prefetcher.map(loader, [(indices, key), ...])``.
    """
    batch = store.get(indices)
    if augment is None:
        return batch
    if key is None:
        raise ValueError("load_batch with augment needs a key, e.g. ('augment', round, client, step)")
    key = tuple(key)
    if len(batch) == 0:
        return batch
    return torch.stack([augment(img, sample_generator(seed, *key, j)) for j, img in enumerate(batch)])


class BatchLoader:
    """Picklable ``job -> load_batch(store, indices, augment, key, seed)`` for ``Prefetcher.map`` over
    ``(indices, key)`` jobs."""

    def __init__(self, store: ImageStore, augment: Augment | None = None, seed: int = 0) -> None:
        self.store, self.augment, self.seed = store, augment, int(seed)

    def __call__(self, job: tuple[Indices, Sequence[object] | None]) -> torch.Tensor:
        indices, key = job
        return load_batch(self.store, indices, self.augment, key, self.seed)
