"""Video super-resolution data: REDS/Vid4-style frame folders and a camera-motion clip generator.

Both loaders are registered in :data:`fedsight.registry.DATASETS` with ``task="video_sr"`` as
``factory(params, *, seed) -> VideoSplits`` and read local files only.

* ``video_frames``: ``<root>/<clip>/<frame>.png`` (REDS ``train_sharp``, Vid4 ``GT``), frames sorted
  numerically (``2.png`` before ``10.png``); or ``<root>/<category>/<clip>/<frame>.png`` with
  ``layout = "categories"`` (Kinetics-style class folders). The REDS4 clips 000, 011, 015 and 020 are the
  conventional REDS test set and part of the official training clips, so they are excluded from the
  training pool by default (digest ambiguity 7: the FedVSR code's VRT/RVRT datasets did not exclude
  them). The test set is ``test_clips`` of ``root`` or every clip of ``test_root`` (e.g. Vid4).
* ``synthetic_video`` (``fedsight.data.video_synth``): clips rendered by moving a virtual camera over
  photographs that ship with installed packages, so demos and tests run offline.

Degradation (the BI setting of REDS/Vid4/FedVSR): HR frames are cropped to a multiple of ``scale``
(top-left kept, BasicSR's ``mod_crop``) and downscaled on the fly by MATLAB-style bicubic with
antialiasing (``fedsight.functional.resize.imresize``, kernel a = -0.5), rounded to 8 bits like the LR
PNGs of REDS. LR frames are computed once per frame and cached.

Clips are the unit that partitioners deal out (``VideoSet.labels`` is one category per clip). A
training example of the video task is a window of ``num_frames`` consecutive frames of a clip.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from pydantic import Field

from fedsight.errors import DataFileError
from fedsight.functional.resize import bicubic_degrade
from fedsight.registry import DATASETS, Params

__all__ = [
    "REDS4",
    "VideoClip",
    "InMemoryClip",
    "FolderClip",
    "VideoSet",
    "VideoSplits",
    "natural_key",
    "list_frames",
    "read_frame",
]

#: the REDS4 test clips (Wang et al. 2019, EDVR), conventionally held out of REDS training
REDS4 = ("000", "011", "015", "020")
FRAME_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp")


# ------------------------------------------------------------------------------------------ clips


class VideoClip:
    """One clip: uint8 HR frames ``[T, 3, H, W]`` (H, W multiples of ``scale``) and their LR frames."""

    name: str
    category: int
    scale: int

    def __len__(self) -> int:
        raise NotImplementedError

    @property
    def hr_size(self) -> tuple[int, int]:
        raise NotImplementedError

    def hr(self, start: int, count: int) -> torch.Tensor:
        """HR frames ``start .. start+count-1`` as uint8 ``[count, 3, H, W]``."""
        raise NotImplementedError

    def lr(self, start: int, count: int) -> torch.Tensor:
        """Their BI-degraded LR frames, uint8 ``[count, 3, H/scale, W/scale]``."""
        raise NotImplementedError

    def _check_range(self, start: int, count: int) -> None:
        if start < 0 or count < 1 or start + count > len(self):
            raise IndexError(f"clip {self.name!r}: frames {start}..{start + count - 1} outside 0..{len(self) - 1}")


def _mod_crop(frames: torch.Tensor, scale: int) -> torch.Tensor:
    h, w = frames.shape[-2:]
    return frames[..., : h - h % scale, : w - w % scale]


class InMemoryClip(VideoClip):
    """A clip held in memory; LR frames are computed once at construction."""

    def __init__(self, name: str, category: int, hr: torch.Tensor, scale: int):
        if hr.dtype != torch.uint8 or hr.ndim != 4 or hr.shape[1] != 3:
            raise ValueError(f"clip {name!r}: HR frames must be uint8 [T, 3, H, W], got {hr.dtype} {tuple(hr.shape)}")
        hr = _mod_crop(hr, scale)
        if min(hr.shape[-2:]) < scale:
            raise ValueError(f"clip {name!r}: frames are smaller than the scale {scale}")
        self.name, self.category, self.scale = name, int(category), int(scale)
        self._hr = hr.contiguous()
        self._lr = bicubic_degrade(self._hr, scale).contiguous()

    def __len__(self) -> int:
        return int(self._hr.shape[0])

    @property
    def hr_size(self) -> tuple[int, int]:
        return int(self._hr.shape[-2]), int(self._hr.shape[-1])

    def hr(self, start: int, count: int) -> torch.Tensor:
        self._check_range(start, count)
        return self._hr[start : start + count]

    def lr(self, start: int, count: int) -> torch.Tensor:
        self._check_range(start, count)
        return self._lr[start : start + count]


def natural_key(path: Path | str) -> list[object]:
    """Sort key ordering numbers numerically: ``frame2`` < ``frame10``, ``00000099`` < ``00000100``."""
    stem = Path(path).stem
    return [int(t) if t.isdigit() else t.lower() for t in re.split(r"(\d+)", stem)]


def list_frames(clip_dir: Path) -> list[Path]:
    frames = [p for p in clip_dir.iterdir() if p.is_file() and p.suffix.lower() in FRAME_EXTENSIONS]
    return sorted(frames, key=natural_key)


def read_frame(path: Path) -> torch.Tensor:
    """An image file as uint8 ``[3, H, W]`` RGB; unreadable files raise ``ValueError`` naming the file."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            arr = np.asarray(im.convert("RGB"), dtype=np.uint8)
    except (OSError, UnidentifiedImageError) as exc:
        raise ValueError(f"{path}: not a readable image ({exc})") from None
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).contiguous()


class FolderClip(VideoClip):
    """Frames read from image files on demand (an LRU cache keeps the last ``cache_frames`` HR/LR
    pairs), so REDS-sized data need not fit in memory."""

    def __init__(self, name: str, category: int, paths: Sequence[Path], scale: int, cache_frames: int = 256):
        if not paths:
            raise ValueError(f"clip {name!r}: no frames")
        self.name, self.category, self.scale = name, int(category), int(scale)
        self.paths = list(paths)
        self.cache_frames = int(cache_frames)
        self._cache: OrderedDict[int, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        first = self._frame(0)[0]
        self._size = (int(first.shape[-2]), int(first.shape[-1]))

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def hr_size(self) -> tuple[int, int]:
        return self._size

    def _frame(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        hit = self._cache.get(i)
        if hit is not None:
            self._cache.move_to_end(i)
            return hit
        hr = _mod_crop(read_frame(self.paths[i]), self.scale)
        if hasattr(self, "_size") and tuple(hr.shape[-2:]) != self._size:
            raise ValueError(
                f"{self.paths[i]}: frame size {tuple(hr.shape[-2:])} differs from the clip's {self._size} (after mod-crop)"
            )
        if min(hr.shape[-2:]) < self.scale:
            raise ValueError(f"{self.paths[i]}: frame is smaller than the scale {self.scale}")
        pair = (hr, bicubic_degrade(hr, self.scale))
        if self.cache_frames > 0:
            self._cache[i] = pair
            while len(self._cache) > self.cache_frames:
                self._cache.popitem(last=False)
        return pair

    def hr(self, start: int, count: int) -> torch.Tensor:
        self._check_range(start, count)
        return torch.stack([self._frame(i)[0] for i in range(start, start + count)])

    def lr(self, start: int, count: int) -> torch.Tensor:
        self._check_range(start, count)
        return torch.stack([self._frame(i)[1] for i in range(start, start + count)])

    def to_memory(self) -> InMemoryClip:
        return InMemoryClip(self.name, self.category, self.hr(0, len(self)), self.scale)


# ------------------------------------------------------------------------------------ containers


@dataclass
class VideoSet:
    """Clips plus category names; ``labels`` (one category index per clip) is what partitioners split."""

    clips: list[VideoClip]
    class_names: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.class_names:
            n = max((c.category for c in self.clips), default=-1) + 1
            self.class_names = [str(i) for i in range(n)]

    def __len__(self) -> int:
        return len(self.clips)

    @property
    def labels(self) -> np.ndarray:
        return np.array([c.category for c in self.clips], dtype=np.int64)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)


@dataclass
class VideoSplits:
    """What a video loader returns: a training pool of clips (partitioned over clients), a global test
    set of whole clips, and the training-window settings the task uses."""

    train: VideoSet
    test: VideoSet
    scale: int
    #: frames per training window
    num_frames: int
    #: LR patch size of training windows (HR patch = patch_size * scale)
    patch_size: int

    @property
    def num_classes(self) -> int:
        return self.train.num_classes

    def check(self, what: str) -> "VideoSplits":
        if len(self.train) == 0:
            raise ValueError(f"{what}: the training pool has no clips")
        if len(self.test) == 0:
            raise ValueError(f"{what}: the test set has no clips")
        for c in self.train.clips:
            if len(c) < self.num_frames:
                raise ValueError(f"{what}: clip {c.name!r} has {len(c)} frames, fewer than num_frames={self.num_frames}")
            h, w = c.hr_size
            if min(h, w) < self.patch_size * self.scale:
                raise ValueError(
                    f"{what}: clip {c.name!r} frames are {h}x{w}, smaller than the HR patch "
                    f"{self.patch_size * self.scale} (patch_size={self.patch_size} x scale={self.scale})"
                )
        return self


class WindowParams(Params):
    scale: int = Field(4, ge=1, le=8, description="super-resolution factor s of the BI degradation")
    num_frames: int = Field(5, ge=1, description="frames N per training window")
    patch_size: int = Field(32, ge=4, description="LR patch size of training windows (HR patch = patch_size * scale)")


# ------------------------------------------------------------------------------- frame folders


class VideoFramesParams(WindowParams):
    root: str = Field(..., description="folder of clips: <root>/<clip>/<frame>.png (REDS train_sharp, Vid4 GT)")
    layout: Literal["clips", "categories"] = Field(
        "clips", description="'clips': <root>/<clip>/...; 'categories': <root>/<category>/<clip>/... (category labels)"
    )
    test_root: str | None = Field(None, description="folder whose clips form the test set (e.g. Vid4); default: test_clips of root")
    test_clips: list[str] = Field(list(REDS4), description="clips of root used as the test set when test_root is unset (REDS4)")
    exclude_test_clips: bool = Field(True, description="never train on test_clips (REDS4 overlaps the official training clips)")
    train_clips: list[str] | None = Field(None, description="restrict the training pool to these clips")
    max_frames: int | None = Field(None, ge=1, description="use only the first max_frames frames of every clip")
    in_memory: bool = Field(False, description="read every frame up front (small sets) instead of on demand")
    cache_frames: int = Field(256, ge=0, description="frames per clip kept in the LRU cache when reading on demand")


def _discover(root: Path, layout: str, what: str) -> list[tuple[str, str, list[Path]]]:
    """(clip name, category name, frame paths) of every clip folder under ``root``."""
    if not root.is_dir():
        raise FileNotFoundError(f"{what}: folder not found: {root}")
    found: list[tuple[str, str, list[Path]]] = []
    empty: list[Path] = []  # clip folders without frames (hidden ones, .ipynb_checkpoints, are no clips)
    if layout == "clips":
        for d in sorted((p for p in root.iterdir() if p.is_dir()), key=natural_key):
            frames = list_frames(d)
            if frames:
                found.append((d.name, d.name, frames))
            elif not d.name.startswith("."):
                empty.append(d)
    else:
        for cat in sorted((p for p in root.iterdir() if p.is_dir()), key=natural_key):
            for d in sorted((p for p in cat.iterdir() if p.is_dir()), key=natural_key):
                frames = list_frames(d)
                if frames:
                    found.append((f"{cat.name}/{d.name}", cat.name, frames))
                elif not (d.name.startswith(".") or cat.name.startswith(".")):
                    empty.append(d)
    if found and empty:  # a clip folder without frames would silently be no clip at all
        more = f" (and {len(empty) - 1} more)" if len(empty) > 1 else ""
        raise DataFileError(f"{what}: the clip folder {empty[0]}{more} holds no {'/'.join(FRAME_EXTENSIONS)} frames; "
                         "add its frames or move it out of the data folder")
    if not found:
        hint = "<root>/<clip>/<frame>.png" if layout == "clips" else "<root>/<category>/<clip>/<frame>.png"
        raise FileNotFoundError(f"{what}: no clip folders with {'/'.join(FRAME_EXTENSIONS)} frames in {root} (expected {hint})")
    return found


def _make_set(entries: list[tuple[str, str, list[Path]]], p: VideoFramesParams) -> VideoSet:
    names = sorted({cat for _, cat, _ in entries}, key=natural_key)
    index = {n: i for i, n in enumerate(names)}
    clips: list[VideoClip] = []
    for name, cat, frames in entries:
        if p.max_frames is not None:
            frames = frames[: p.max_frames]
        clip: VideoClip = FolderClip(name, index[cat], frames, p.scale, p.cache_frames)
        if p.in_memory:
            clip = clip.to_memory()  # type: ignore[attr-defined]
        clips.append(clip)
    return VideoSet(clips, names)


@DATASETS.register(
    "video_frames",
    params=VideoFramesParams,
    help="REDS/Vid4-style frame folders <root>/<clip>/<frame>.png; REDS4 held out; bicubic LR on the fly",
    task="video_sr",
)
def load_video_frames(params: VideoFramesParams, *, seed: int = 0) -> VideoSplits:
    what = f"video_frames {params.root}"
    entries = _discover(Path(params.root), params.layout, what)
    by_name = {e[0]: e for e in entries}
    excluded = set(params.test_clips) if params.exclude_test_clips else set()
    if params.test_root is not None:
        test_entries = _discover(Path(params.test_root), "clips", f"video_frames test_root {params.test_root}")
    else:
        missing = [c for c in params.test_clips if c not in by_name]
        if missing or not params.test_clips:
            raise ValueError(
                f"{what}: test clips {missing or '[]'} not found (clips present: {', '.join(list(by_name)[:12])}"
                f"{', ...' if len(by_name) > 12 else ''}); set data.test_clips or data.test_root"
            )
        test_entries = [by_name[c] for c in params.test_clips]
    if params.train_clips is not None:
        missing = [c for c in params.train_clips if c not in by_name]
        if missing:
            raise ValueError(f"{what}: train_clips {missing} not found")
        train_entries = [by_name[c] for c in params.train_clips if c not in excluded]
    else:
        train_entries = [e for e in entries if e[0] not in excluded]
    splits = VideoSplits(
        train=_make_set(train_entries, params),
        test=_make_set(test_entries, params),
        scale=params.scale,
        num_frames=params.num_frames,
        patch_size=params.patch_size,
    )
    return splits.check(what)
