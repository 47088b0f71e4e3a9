"""Image super-resolution data: DIV2K, SR benchmark folders (Set5/Set14/B100/Urban100) and built-in photos.

Every loader is registered in :data:`fedsight.registry.DATASETS` with ``task="image_sr"`` as
``factory(params, *, seed) -> ImageSRSplits`` and reads local files only.

Images. An :class:`SRImage` gives its HR image as uint8 ``[3, H, W]``, cropped to a multiple of ``scale``
with the top-left corner kept (BasicSR's ``mod_crop``; EDSR crops the HR test image to ``scale`` times
its LR size, the same pixels), and its LR image uint8 ``[3, H/s, W/s]``, by ``lr``:

* ``"disk"``: the LR file shipped with the data set (DIV2K ``X{s}`` folders, benchmark ``LR_bicubic`` /
  ``LRbicx{s}``, all MATLAB bicubic). Its size must be exactly the mod-cropped HR size over ``s``;
* ``"bicubic"``: MATLAB bicubic downscaling with antialiasing, rounded to 8 bits
  (``fedsight.functional.resize.bicubic_degrade``: the BI degradation of EDSR/RDN/BasicSR, which
  reproduces the shipped LR files up to MATLAB's rounding);
* ``"decimate"``: uniform sub-sampling ``hr[:, o::s, o::s]`` (offset ``o = decimate_offset``, default 0:
  pixel ``(s i, s j)`` is kept), the "uniform down-sampling" channel of EtLC that RDSN reconstructs
  (PPFL-RDSN digest ``notes/001_ppfl_rdsn.md`` §1.2; the paper leaves open whether its DIV2K LR images are
  the bicubic files or a decimation, so both are offered).

Decoded images and their LR are cached: all in memory with ``in_memory = true`` (or always, for the
built-in photos), else in an LRU cache of ``cache_images`` HR/LR pairs shared by a loader's images.

Containers. An :class:`ImageSet` is a list of images with one label (source or category) per image:
the partitioner deals out whole images. :class:`ImageSRSplits` holds the training pool, the named test
sets (the task reports the first as ``test`` and the others as ``test_<name>``), the scale and the LR
training patch size.

Loaders:

* ``div2k``: ``<root>/DIV2K_train_HR/0001.png ...`` (label: one class ``DIV2K``), LR from
  ``DIV2K_train_LR_bicubic/X{s}/0001x{s}.png`` with ``lr = "disk"``; test sets are benchmark folders
  (``test_sets``) and, with ``valid_as_test``, ``DIV2K_valid_HR`` (+ ``DIV2K_valid_LR_bicubic/X{s}``) as
  ``DIV2K_valid``;
* ``sr_benchmark``: training and test sets from benchmark-layout folders (below), one label per
  training folder;
* ``builtin_sr``: offline, from ``fedsight.data.photos`` (see :func:`load_builtin_sr`).

Benchmark folders (the test set's name is the folder's name), detected by their sub-folders:
EDSR ``HR/<name>.png`` + ``LR_bicubic/X{s}/<name>x{s}.png``; BasicSR ``GTmod12/<name>.png`` +
``LRbicx{s}/<name>.png``; otherwise the folder's own images are HR images (``lr`` must then be generated).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from pydantic import Field, model_validator

from fedsight.data.base import check_named_tests
from fedsight.data.images import IMAGE_EXTENSIONS
from fedsight.data.photos import PHOTO_LOADERS, TEST_PHOTOS, TRAIN_PHOTOS, load_photo
from fedsight.data.video import natural_key, read_frame
from fedsight.functional.resize import bicubic_degrade, imresize
from fedsight.registry import DATASETS, Params

__all__ = [
    "TEXTURE_PHOTOS",
    "ImageCache",
    "ImageSet",
    "ImageSRSplits",
    "SRImage",
    "degrade",
    "load_sr_folder",
    "mod_crop",
]

LRMode = Literal["disk", "bicubic", "decimate"]
#: grey photographs of scikit-image used as the built-in "textures" test set
TEXTURE_PHOTOS = ("brick", "grass", "gravel", "camera")


def mod_crop(img: torch.Tensor, scale: int) -> torch.Tensor:
    """``img[..., :H - H % s, :W - W % s]`` (BasicSR ``mod_crop``: the top-left part is kept)."""
    h, w = img.shape[-2:]
    return img[..., : h - h % scale, : w - w % scale]


def degrade(hr: torch.Tensor, scale: int, mode: str, offset: int = 0) -> torch.Tensor:
    """The LR image of a mod-cropped uint8 HR image ``[..., H, W]``: MATLAB bicubic (``"bicubic"``) or
    uniform decimation ``hr[..., o::s, o::s]`` (``"decimate"``), uint8 ``[..., H/s, W/s]``."""
    if mode == "bicubic":
        return bicubic_degrade(hr, scale)
    if mode == "decimate":
        if not 0 <= offset < scale:
            raise ValueError(f"decimate_offset = {offset} must lie in 0..{scale - 1}")
        return hr[..., offset::scale, offset::scale].contiguous()
    raise ValueError(f"cannot generate LR images with lr = {mode!r}; use 'bicubic' or 'decimate'")


def image_size(path: Path) -> tuple[int, int]:
    """(height, width) of an image file from its header; a missing or unreadable file raises naming it."""
    from PIL import Image, UnidentifiedImageError

    if not path.is_file():
        raise FileNotFoundError(f"{path}: image file not found")
    try:
        with Image.open(path) as im:
            w, h = im.size
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable image ({exc})") from None
    return int(h), int(w)


class ImageCache:
    """An LRU cache of decoded (HR, LR) pairs shared by the images of one loader."""

    def __init__(self, capacity: int):
        self.capacity = int(capacity)
        self._items: OrderedDict[object, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()

    def get(self, key: object, make: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        hit = self._items.get(key)
        if hit is not None:
            self._items.move_to_end(key)
            return hit
        pair = make()
        if self.capacity > 0:
            self._items[key] = pair
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)
        return pair


class SRImage:
    """One HR image (held in memory, or a file decoded on demand) and its LR image (see the module
    docstring). Sizes are known at construction (file headers), so loaders validate without decoding."""

    def __init__(
        self,
        name: str,
        label: int,
        scale: int,
        *,
        hr: torch.Tensor | None = None,
        hr_path: Path | None = None,
        lr: str = "bicubic",
        lr_path: Path | None = None,
        decimate_offset: int = 0,
        cache: ImageCache | None = None,
    ):
        self.name, self.label, self.scale = name, int(label), int(scale)
        self.lr_mode, self.offset, self.cache = lr, int(decimate_offset), cache
        self.hr_path, self.lr_path = hr_path, lr_path
        self._pair: tuple[torch.Tensor, torch.Tensor] | None = None
        self._hr: torch.Tensor | None = None
        if hr is not None:
            if hr.dtype != torch.uint8 or hr.ndim != 3 or hr.shape[0] != 3:
                raise ValueError(f"image {name!r}: HR must be uint8 [3, H, W], got {hr.dtype} {tuple(hr.shape)}")
            self._hr = mod_crop(hr, scale).contiguous()
            h, w = self._hr.shape[-2:]
        elif hr_path is not None:
            h, w = image_size(hr_path)
            h, w = h - h % scale, w - w % scale
        else:
            raise ValueError(f"image {name!r}: neither HR pixels nor an HR file")
        if min(h, w) < scale:
            raise ValueError(f"{self.source}: image is smaller than the scale {scale}")
        self._size = (int(h), int(w))
        if lr == "disk":
            if lr_path is None:
                raise ValueError(f'{self.source}: lr = "disk" but the image has no LR file (generate LR with "bicubic" or "decimate")')
            if not lr_path.is_file():
                raise FileNotFoundError(f'{lr_path}: LR image not found (lr = "disk", HR image {self.source})')
            self._check_lr(image_size(lr_path))
        elif lr not in ("bicubic", "decimate"):
            raise ValueError(f"unknown lr = {lr!r}; use 'disk', 'bicubic' or 'decimate'")
        elif lr == "decimate" and not 0 <= self.offset < scale:
            raise ValueError(f"decimate_offset = {self.offset} must lie in 0..{scale - 1}")

    @property
    def source(self) -> str:
        """The HR file, or the image's name for images held in memory (what error messages name)."""
        return str(self.hr_path) if self.hr_path is not None else self.name

    @property
    def hr_size(self) -> tuple[int, int]:
        return self._size

    @property
    def lr_size(self) -> tuple[int, int]:
        return self._size[0] // self.scale, self._size[1] // self.scale

    def _check_lr(self, size: tuple[int, int]) -> None:
        if tuple(size) != self.lr_size:
            (h, w), (lh, lw) = self._size, self.lr_size
            raise ValueError(
                f"{self.lr_path}: LR image is {size[1]}x{size[0]} (WxH) but {self.source} is {w}x{h} after mod-crop, "
                f"so the LR image at scale {self.scale} must be {lw}x{lh}"
            )

    def _decode(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._hr is not None:
            hr = self._hr
        else:
            hr = mod_crop(read_frame(self.hr_path), self.scale).contiguous()  # type: ignore[arg-type]
            if tuple(hr.shape[-2:]) != self._size:
                raise ValueError(f"{self.source}: decoded size {tuple(hr.shape[-2:])} differs from its header's {self._size}")
        if self.lr_mode == "disk":
            lr = read_frame(self.lr_path)  # type: ignore[arg-type]
            self._check_lr(tuple(lr.shape[-2:]))
        else:
            lr = degrade(hr, self.scale, self.lr_mode, self.offset)
        return hr, lr

    def pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(HR, LR) uint8 tensors (held, cached, or decoded now)."""
        if self._pair is not None:
            return self._pair
        if self._hr is not None or self.cache is None:  # in-memory HR: compute the LR once and keep it
            pair = self._decode()
            if self._hr is not None:
                self._pair = pair
            return pair
        return self.cache.get(self, self._decode)

    def hr(self) -> torch.Tensor:
        return self.pair()[0]

    def lr(self) -> torch.Tensor:
        return self.pair()[1]

    def load(self) -> "SRImage":
        """Decode now and keep both images in memory (``in_memory``)."""
        self._pair = self._decode()
        return self


@dataclass
class ImageSet:
    """Images plus the names of their labels; ``labels`` (one per image) is what partitioners split."""

    images: list[SRImage]
    class_names: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.class_names:
            n = max((im.label for im in self.images), default=-1) + 1
            self.class_names = [str(i) for i in range(n)]

    def __len__(self) -> int:
        return len(self.images)

    @property
    def labels(self) -> np.ndarray:
        return np.array([im.label for im in self.images], dtype=np.int64)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def subset(self, indices: Sequence[int] | np.ndarray) -> "ImageSet":
        return ImageSet([self.images[int(i)] for i in indices], list(self.class_names))


@dataclass
class ImageSRSplits:
    """What an image SR loader returns: the training pool (partitioned over clients), the named global
    test sets (the first is the task's ``test``), the scale and the LR training patch size (HR patch
    ``patch_size * scale``)."""

    train: ImageSet
    tests: dict[str, ImageSet]
    scale: int
    patch_size: int

    @property
    def num_classes(self) -> int:
        return self.train.num_classes

    def check(self, what: str) -> "ImageSRSplits":
        check_named_tests(what, self.train, self.tests, "images")
        need = self.patch_size * self.scale
        for im in self.train.images:
            h, w = im.hr_size
            if min(h, w) < need:
                raise ValueError(
                    f"{what}: {im.source} is {w}x{h} (WxH), smaller than the HR patch {need} "
                    f"(patch_size={self.patch_size} x scale={self.scale})"
                )
        return self


class SRDataParams(Params):
    scale: int = Field(4, ge=1, le=8, description="super-resolution factor s")
    patch_size: int = Field(48, ge=4, description="LR side of training patches (HR patch = patch_size * scale; EDSR 48, PPFL-RDSN 64)")
    lr: LRMode = Field("disk", description="LR images: 'disk' (shipped files), 'bicubic' (MATLAB bicubic) or 'decimate' (hr[o::s, o::s])")
    decimate_offset: int = Field(0, ge=0, description="offset o of lr = 'decimate' (keep pixel (s i + o, s j + o)), 0..scale-1")
    in_memory: bool = Field(False, description="decode every image (and make its LR) up front and keep it")
    cache_images: int = Field(32, ge=0, description="decoded HR/LR pairs kept in the LRU cache when not in_memory")

    @model_validator(mode="after")
    def _offset(self) -> "SRDataParams":
        if self.decimate_offset >= self.scale:
            raise ValueError(f"decimate_offset = {self.decimate_offset} must lie in 0..{self.scale - 1} (scale {self.scale})")
        return self


def list_images(folder: Path) -> list[Path]:
    """Image files (not hidden) of ``folder``, in natural order (``2.png`` before ``10.png``)."""
    files = [p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in IMAGE_EXTENSIONS]
    return sorted(files, key=natural_key)


def _pairs(hr_dir: Path, lr_dir: Path | None, lr_name: Callable[[Path], str] | None, p: SRDataParams, label: int,
           cache: ImageCache, what: str, keep: Callable[[list[Path]], list[Path]] | None = None) -> list[SRImage]:
    """The images of ``hr_dir`` (optionally filtered by ``keep``) with their LR files in ``lr_dir``."""
    if not hr_dir.is_dir():
        raise FileNotFoundError(f"{what}: folder not found: {hr_dir}")
    files = list_images(hr_dir)
    if not files:
        raise FileNotFoundError(f"{what}: no images ({'/'.join(IMAGE_EXTENSIONS)}) in {hr_dir}")
    if keep is not None:
        files = keep(files)
    if p.lr == "disk":
        if lr_dir is None or lr_name is None:
            raise FileNotFoundError(
                f'{what}: lr = "disk" but {hr_dir.parent if hr_dir.name in ("HR", "GTmod12") else hr_dir} has no LR folder '
                f"(expected HR/ + LR_bicubic/X{p.scale}/ or GTmod12/ + LRbicx{p.scale}/); or set lr = 'bicubic'"
            )
        if not lr_dir.is_dir():
            raise FileNotFoundError(f'{what}: LR folder not found: {lr_dir} (lr = "disk", scale {p.scale})')
    images = []
    for f in files:
        lr_path = lr_dir / lr_name(f) if (p.lr == "disk" and lr_dir is not None and lr_name is not None) else None
        images.append(SRImage(f.stem, label, p.scale, hr_path=f, lr=p.lr, lr_path=lr_path,
                              decimate_offset=p.decimate_offset, cache=cache))
    if p.in_memory:
        for im in images:
            im.load()
    return images


def load_sr_folder(path: str | Path, p: SRDataParams, cache: ImageCache, label: int = 0, what: str = "") -> list[SRImage]:
    """The images of a benchmark folder in the EDSR layout (``HR/`` + ``LR_bicubic/X{s}/<name>x{s}.png``),
    the BasicSR layout (``GTmod12/`` + ``LRbicx{s}/<name>.png``) or a plain folder of HR images."""
    root = Path(path)
    what = what or f"SR folder {root}"
    if not root.is_dir():
        raise FileNotFoundError(f"{what}: folder not found: {root}")
    s = p.scale
    if (root / "HR").is_dir():
        return _pairs(root / "HR", root / "LR_bicubic" / f"X{s}", lambda f: f"{f.stem}x{s}{f.suffix}", p, label, cache, what)
    if (root / "GTmod12").is_dir():
        return _pairs(root / "GTmod12", root / f"LRbicx{s}", lambda f: f.name, p, label, cache, what)
    return _pairs(root, None, None, p, label, cache, what)


def _test_sets(paths: Sequence[str], p: SRDataParams, cache: ImageCache, what: str) -> dict[str, ImageSet]:
    tests: dict[str, ImageSet] = {}
    for path in paths:
        name = Path(path).name
        if name in tests:
            raise ValueError(f"{what}: two test sets are named {name!r} (test sets are named by their folders)")
        tests[name] = ImageSet(load_sr_folder(path, p, cache, 0, f"{what} test set {path}"), [name])
    return tests


# ------------------------------------------------------------------------------------------------ DIV2K


class DIV2KParams(SRDataParams):
    root: str = Field(..., description="folder holding DIV2K_train_HR/ (and DIV2K_train_LR_bicubic/X{s}/, DIV2K_valid_HR/ ...)")
    train_images: int | list[str] | None = Field(None, description="use the first n training images, or these ids ('0001', ...)")
    test_sets: list[str] = Field([], description="benchmark folders used as test sets (Set5, Set14, B100, Urban100), named by folder")
    valid_as_test: bool = Field(False, description="also test on DIV2K_valid_HR (+ DIV2K_valid_LR_bicubic/X{s}), named DIV2K_valid")
    valid_images: int | list[str] | None = Field(None, description="with valid_as_test: the first n validation images, or these ids")


def _select(ids: int | list[str] | None, field_name: str, what: str) -> Callable[[list[Path]], list[Path]]:
    def keep(files: list[Path]) -> list[Path]:
        if ids is None:
            return files
        if isinstance(ids, int):
            if ids < 1:
                raise ValueError(f"{what}: {field_name} = {ids} must be >= 1")
            return files[:ids]
        by_id = {f.stem: f for f in files}
        missing = [i for i in ids if i not in by_id]
        if missing:
            raise ValueError(f"{what}: {field_name} lists ids not found: {', '.join(missing[:5])}")
        return [by_id[i] for i in ids]

    return keep


@DATASETS.register("div2k", params=DIV2KParams, task="image_sr",
                   help="DIV2K train HR/LR (800 images) + benchmark test folders (Set5, Set14, B100, Urban100)")
def load_div2k(params: DIV2KParams, *, seed: int = 0) -> ImageSRSplits:
    root, s = Path(params.root), params.scale
    what = f"div2k {root}"
    if not root.is_dir():
        raise FileNotFoundError(f"{what}: data.root folder not found")
    if not params.test_sets and not params.valid_as_test:
        raise ValueError(f"{what}: no test set; set data.test_sets = [<benchmark folder>, ...] or data.valid_as_test = true")
    cache = ImageCache(0 if params.in_memory else params.cache_images)

    def lr_name(f: Path) -> str:
        return f"{f.stem}x{s}{f.suffix}"

    train = _pairs(root / "DIV2K_train_HR", root / "DIV2K_train_LR_bicubic" / f"X{s}", lr_name, params, 0, cache, what,
                   _select(params.train_images, "train_images", what))
    tests = _test_sets(params.test_sets, params, cache, what)  # the benchmark folders first, DIV2K_valid last
    if params.valid_as_test:
        if "DIV2K_valid" in tests:
            raise ValueError(f"{what}: a test_sets folder is named 'DIV2K_valid', like the validation test set")
        valid = _pairs(root / "DIV2K_valid_HR", root / "DIV2K_valid_LR_bicubic" / f"X{s}", lr_name, params, 0, cache, what,
                       _select(params.valid_images, "valid_images", what))
        tests["DIV2K_valid"] = ImageSet(valid, ["DIV2K_valid"])
    return ImageSRSplits(ImageSet(train, ["DIV2K"]), tests, s, params.patch_size).check(what)


# ---------------------------------------------------------------------------------------- benchmark folders


class SRBenchmarkParams(SRDataParams):
    train_sets: list[str] = Field(..., min_length=1, description="training folders (benchmark layout or plain HR images); label = folder")
    test_sets: list[str] = Field(..., min_length=1, description="test folders (Set5, Set14, B100, Urban100), named by folder")


@DATASETS.register("sr_benchmark", params=SRBenchmarkParams, task="image_sr",
                   help="SR folders in the EDSR (HR/, LR_bicubic/X{s}/) or BasicSR (GTmod12/, LRbicx{s}/) layout")
def load_sr_benchmark(params: SRBenchmarkParams, *, seed: int = 0) -> ImageSRSplits:
    what = "sr_benchmark"
    cache = ImageCache(0 if params.in_memory else params.cache_images)
    names = [Path(t).name for t in params.train_sets]
    if len(set(names)) != len(names):
        raise ValueError(f"{what}: two train_sets folders have the same name ({', '.join(names)})")
    train = [im for i, t in enumerate(params.train_sets) for im in load_sr_folder(t, params, cache, i, f"{what} train set {t}")]
    tests = _test_sets(params.test_sets, params, cache, what)
    return ImageSRSplits(ImageSet(train, names), tests, params.scale, params.patch_size).check(what)


# ---------------------------------------------------------------------------------------- built-in photos


class BuiltinSRParams(SRDataParams):
    scale: int = Field(4, ge=1, le=8, description="super-resolution factor s")
    patch_size: int = Field(16, ge=4, description="LR side of training patches (HR patch = patch_size * scale)")
    lr: LRMode = Field("bicubic", description="LR images: 'bicubic' (MATLAB bicubic) or 'decimate' (hr[o::s, o::s])")
    in_memory: bool = Field(True, description="built-in images are always held in memory")
    sources: list[str] = Field(list(TRAIN_PHOTOS), min_length=1, description="photos cut into training tiles (label = photo)")
    tile: int = Field(128, ge=8, description="HR side of the non-overlapping training tiles (a multiple of scale)")
    train_max_side: int | None = Field(512, ge=8, description="shrink training photos whose longer side exceeds this first (None: keep)")
    test_sets: dict[str, list[str]] = Field(
        {"photos": list(TEST_PHOTOS), "textures": list(TEXTURE_PHOTOS)},
        description="named test sets of whole photos never used for training (the first is the task's test)",
    )
    test_max_side: int | None = Field(256, ge=16, description="shrink test photos whose longer side exceeds this (None: keep)")

    @model_validator(mode="after")
    def _check(self) -> "BuiltinSRParams":
        if self.lr == "disk":
            raise ValueError("builtin_sr makes its LR images: use lr = 'bicubic' or 'decimate' (lr = 'disk' needs div2k or sr_benchmark)")
        if self.tile % self.scale:
            raise ValueError(f"tile = {self.tile} is not a multiple of scale {self.scale}")
        if self.tile < self.patch_size * self.scale:
            raise ValueError(f"tile = {self.tile} is smaller than the HR patch {self.patch_size * self.scale} (patch_size x scale)")
        if not self.test_sets or any(not v for v in self.test_sets.values()):
            raise ValueError("test_sets must name at least one test set, each with at least one photo")
        used = {}
        for name in self.sources:
            if name in used:
                raise ValueError(f"sources lists photo {name!r} twice")
            used[name] = "sources"
        for tname, photos in self.test_sets.items():
            for name in photos:
                if name in used:
                    raise ValueError(f"photo {name!r} is in both {used[name]} and test_sets.{tname} (train and test photos must differ)")
                used[name] = f"test_sets.{tname}"
        for name in used:
            if name not in PHOTO_LOADERS:
                raise ValueError(f"unknown photo {name!r}; choose from: {', '.join(PHOTO_LOADERS)}")
        return self


@lru_cache(maxsize=32)
def _photo(name: str, max_side: int | None) -> torch.Tensor:
    """A shipped photo as uint8 ``[3, H, W]``, shrunk by MATLAB bicubic (antialiased, rounded) so that its
    longer side is at most ``max_side``."""
    photo = load_photo(name)
    h, w = photo.shape[-2:]
    if max_side is not None and max(h, w) > max_side:
        photo = imresize(photo, max_side / max(h, w))  # float32: exact enough for 8-bit output
    return photo.round().clamp(0, 255).to(torch.uint8).contiguous()


@DATASETS.register("builtin_sr", params=BuiltinSRParams, task="image_sr",
                   help="offline SR data: tiles of shipped photos for training, other whole photos as test sets")
def load_builtin_sr(params: BuiltinSRParams, *, seed: int = 0) -> ImageSRSplits:
    """Built-in SR data from photographs that ship with scikit-image, scikit-learn and matplotlib.

    A fixed whole-image split with no randomness:

    * training pool: each photo of ``sources`` (default the 8 colour photos of ``photos.TRAIN_PHOTOS``:
      astronaut, chelsea, coffee, rocket, immunohistochemistry, hubble_deep_field, retina, motorcycle) is
      shrunk so that its longer side is at most ``train_max_side`` (512; MATLAB bicubic), then cut into
      non-overlapping ``tile`` x ``tile`` HR tiles from the top-left (partial tiles dropped). A tile is one
      training image labelled by its photo (90 tiles by default, 6 to 16 per photo), so a partitioner
      deals whole tiles: ``iid`` mixes photos, ``classes`` with ``classes_per_client = 1`` gives one photo
      per client;
    * test sets (``test_sets``, in order; the first is the task's ``test``): whole photos never used for
      training, shrunk to a longer side of at most ``test_max_side`` (256) to keep CPU evaluation cheap:
      ``photos`` = china, flower, grace_hopper (``photos.TEST_PHOTOS``, colour) and ``textures`` = brick,
      grass, gravel, camera (scikit-image's grey photos, replicated to three channels).

    The LR images are made by ``lr`` (``bicubic`` or ``decimate``) from the mod-cropped HR images.
    """
    s = params.scale
    train: list[SRImage] = []
    for label, name in enumerate(params.sources):
        photo = _photo(name, params.train_max_side)
        t = params.tile
        rows, cols = photo.shape[-2] // t, photo.shape[-1] // t
        if rows * cols == 0:
            raise ValueError(f"builtin_sr: photo {name!r} ({photo.shape[-1]}x{photo.shape[-2]}) is smaller than a tile of {t}")
        for r in range(rows):
            for c in range(cols):
                tile = photo[:, r * t : (r + 1) * t, c * t : (c + 1) * t].contiguous()
                train.append(SRImage(f"{name}_r{r}c{c}", label, s, hr=tile, lr=params.lr, decimate_offset=params.decimate_offset))
    tests = {}
    for tname, photos in params.test_sets.items():
        images = [SRImage(name, i, s, hr=_photo(name, params.test_max_side), lr=params.lr, decimate_offset=params.decimate_offset)
                  for i, name in enumerate(photos)]
        tests[tname] = ImageSet(images, list(photos))
    return ImageSRSplits(ImageSet(train, list(params.sources)), tests, s, params.patch_size).check("builtin_sr")
