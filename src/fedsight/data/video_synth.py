"""``synthetic_video``: video clips rendered by moving a virtual camera over shipped photographs.

The camera pans at a per-clip speed and direction, zooms and rotates slightly over real photographs that
ship with installed packages (``fedsight.data.photos``: scikit-image's colour photos for training,
scikit-learn's and matplotlib's for testing by default), so demos and tests run offline. Each clip's
category is its source photo, so the ``classes`` partitioner with ``classes_per_client = 1`` gives "one
content category per client" and ``iid`` gives "random videos per client". Degradation and clip types are
``fedsight.data.video``'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, model_validator

from fedsight.data.photos import PHOTO_LOADERS, TEST_PHOTOS, TRAIN_PHOTOS, load_photo
from fedsight.data.video import InMemoryClip, VideoClip, VideoSet, VideoSplits, WindowParams
from fedsight.functional.resize import imresize
from fedsight.registry import DATASETS
from fedsight.rng import np_rng

__all__ = ["CameraPath", "SyntheticVideoParams", "load_synthetic_video", "render_clip"]


@dataclass(frozen=True)
class CameraPath:
    """A clip's camera: field of view (fraction of the photo's shorter side), pan speed (HR pixels per
    frame) and direction (radians), total zoom factor and total rotation (degrees) over the clip."""

    fov: float
    speed: float
    direction: float
    zoom: float
    rotation: float


def render_clip(photo: torch.Tensor, frames: int, size: int, path: CameraPath, rng: np.random.Generator) -> torch.Tensor:
    """Render ``frames`` uint8 frames ``[T, 3, size, size]`` of a camera moving over ``photo``.

    Geometry, in the photo's pixel coordinates: the frame samples the photo on a grid of spacing
    ``1 / (s0 z_t)`` with ``s0 = size / (fov * min(H, W))`` (so at zoom 1 the frame spans ``fov`` of the
    shorter side), centred at ``c_t = c_0 + t (speed / s0) (cos d, sin d)`` and rotated by ``theta_t``,
    where ``z_t = zoom^(t/(T-1))`` and ``theta_t = rotation * t/(T-1)``. The start ``c_0`` is drawn from
    ``rng`` among positions that keep the whole path inside the photo (the speed is reduced if the path
    cannot fit). Rendering: the bounding box of the path is cut out, shrunk by ``s0`` with
    antialiased MATLAB bicubic (so the frame samples a band-limited image at about one sample per
    pixel, without aliasing), and sampled with bicubic interpolation (``grid_sample``).
    """
    h0, w0 = photo.shape[-2:]
    s0 = size / (path.fov * min(h0, w0))
    shrink = s0 < 1
    margin = (2.0 / s0 + 3.0) if shrink else 3.0  # resize kernel support plus bicubic sampling support
    t = torch.arange(frames, dtype=torch.float64)
    frac = t / max(frames - 1, 1)
    z = path.zoom**frac
    theta = math.radians(path.rotation) * frac
    radius = (size / 2.0) * math.sqrt(2.0) / (float(z.min()) * s0) + margin
    dx, dy = math.cos(path.direction), math.sin(path.direction)
    room_x, room_y = (w0 - 1) - 2 * radius, (h0 - 1) - 2 * radius
    if room_x < 0 or room_y < 0:
        raise ValueError(f"photo of {h0}x{w0} px is too small for a {size} px frame at fov {path.fov}")
    travel = path.speed / s0 * (frames - 1)
    need = max(abs(dx) * travel / max(room_x, 1e-9), abs(dy) * travel / max(room_y, 1e-9), 1.0)
    travel /= need
    ex, ey = dx * travel, dy * travel
    x_lo, x_hi = radius - min(0.0, ex), (w0 - 1) - radius - max(0.0, ex)
    y_lo, y_hi = radius - min(0.0, ey), (h0 - 1) - radius - max(0.0, ey)
    cx = x_lo + rng.random() * max(x_hi - x_lo, 0.0) + ex * frac
    cy = y_lo + rng.random() * max(y_hi - y_lo, 0.0) + ey * frac
    u = torch.arange(size, dtype=torch.float64) - (size - 1) / 2.0
    vv, uu = torch.meshgrid(u, u, indexing="ij")  # rows (y), columns (x) of the output frame
    cos, sin = torch.cos(theta)[:, None, None], torch.sin(theta)[:, None, None]
    step = 1.0 / (z[:, None, None] * s0)
    px = cx[:, None, None] + (cos * uu - sin * vv) * step
    py = cy[:, None, None] + (sin * uu + cos * vv) * step
    x0 = max(int(math.floor(float(px.min()) - margin)), 0)
    x1 = min(int(math.ceil(float(px.max()) + margin)), w0 - 1)
    y0 = max(int(math.floor(float(py.min()) - margin)), 0)
    y1 = min(int(math.ceil(float(py.max()) + margin)), h0 - 1)
    crop = photo[:, y0 : y1 + 1, x0 : x1 + 1].to(torch.float64)
    if shrink:
        crop = imresize(crop, s0)
        # imresize puts output pixel i at input coordinate (i + 0.5) / s0 - 0.5
        px = (px - x0 + 0.5) * s0 - 0.5
        py = (py - y0 + 0.5) * s0 - 0.5
    else:
        px, py = px - x0, py - y0
    ch, cw = crop.shape[-2:]
    grid = torch.stack([px / (cw - 1) * 2 - 1, py / (ch - 1) * 2 - 1], dim=-1).to(torch.float32)  # align_corners=True
    src = crop.to(torch.float32).unsqueeze(0).expand(frames, -1, -1, -1).contiguous()
    out = F.grid_sample(src, grid, mode="bicubic", padding_mode="border", align_corners=True)
    return out.round().clamp(0, 255).to(torch.uint8)


class SyntheticVideoParams(WindowParams):
    patch_size: int = Field(16, ge=4, description="LR patch size of training windows (HR patch = patch_size * scale)")
    sources: list[str] = Field(list(TRAIN_PHOTOS), min_length=1, description="photos of the training clips (one category each)")
    test_sources: list[str] = Field(list(TEST_PHOTOS), min_length=1, description="held-out photos of the test clips")
    clips_per_source: int = Field(4, ge=1, description="training clips rendered per source photo")
    test_clips_per_source: int = Field(2, ge=1, description="test clips rendered per test photo")
    clip_length: int = Field(10, ge=1, description="frames per clip")
    test_clip_length: int | None = Field(None, ge=1, description="frames per test clip (default clip_length)")
    frame_size: int = Field(96, ge=8, description="HR frame side in pixels (a multiple of scale)")
    fov: tuple[float, float] = Field((0.2, 0.45), description="range of the field of view, as a fraction of the photo's shorter side")
    speed: tuple[float, float] = Field((0.5, 3.0), description="range of the pan speed in HR pixels per frame (per clip)")
    max_zoom: float = Field(0.2, ge=0, lt=1, description="total zoom over a clip is drawn from [1/(1+max_zoom), 1+max_zoom]")
    max_rotation: float = Field(4.0, ge=0, le=45, description="total rotation over a clip in degrees, drawn from [-max, max]")
    data_seed: int | None = Field(0, ge=0, description="seed of the camera paths (None: the run seed)")

    @model_validator(mode="after")
    def _check(self) -> "SyntheticVideoParams":
        if self.frame_size % self.scale:
            raise ValueError(f"frame_size {self.frame_size} is not a multiple of scale {self.scale}")
        for lo_hi, what in ((self.fov, "fov"), (self.speed, "speed")):
            if not 0 <= lo_hi[0] <= lo_hi[1]:
                raise ValueError(f"{what} = {list(lo_hi)} must be an increasing pair of non-negative numbers")
        if not 0 < self.fov[0] <= self.fov[1] <= 1:
            raise ValueError(f"fov = {list(self.fov)} must lie in (0, 1]")
        for name in (*self.sources, *self.test_sources):
            if name not in PHOTO_LOADERS:
                raise ValueError(f"unknown photo {name!r}; choose from: {', '.join(PHOTO_LOADERS)}")
        for lst, what in ((self.sources, "sources"), (self.test_sources, "test_sources")):
            if len(set(lst)) != len(lst):
                raise ValueError(f"{what} lists a photo twice")
        return self


def _draw_path(p: SyntheticVideoParams, rng: np.random.Generator) -> CameraPath:
    fov = rng.uniform(*p.fov)
    speed = rng.uniform(*p.speed)
    direction = rng.uniform(0, 2 * math.pi)
    zoom = math.exp(rng.uniform(-1, 1) * math.log1p(p.max_zoom))
    rotation = rng.uniform(-1, 1) * p.max_rotation
    return CameraPath(fov, speed, direction, zoom, rotation)


def _render_set(p: SyntheticVideoParams, sources: list[str], per_source: int, length: int, split: str, seed: int) -> VideoSet:
    clips: list[VideoClip] = []
    for cat, name in enumerate(sources):
        photo = load_photo(name)
        for k in range(per_source):
            rng = np_rng(seed, "synthetic_video", split, name, k)
            path = _draw_path(p, rng)
            hr = render_clip(photo, length, p.frame_size, path, rng)
            clips.append(InMemoryClip(f"{name}_{k:03d}", cat, hr, p.scale))
    return VideoSet(clips, list(sources))


@DATASETS.register(
    "synthetic_video",
    params=SyntheticVideoParams,
    help="clips made by camera motion (pan, zoom, rotation) over shipped photos; category = source photo",
    task="video_sr",
)
def load_synthetic_video(params: SyntheticVideoParams, *, seed: int = 0) -> VideoSplits:
    data_seed = seed if params.data_seed is None else params.data_seed
    train = _render_set(params, list(params.sources), params.clips_per_source, params.clip_length, "train", data_seed)
    test_len = params.test_clip_length or params.clip_length
    test = _render_set(params, list(params.test_sources), params.test_clips_per_source, test_len, "test", data_seed)
    splits = VideoSplits(train, test, params.scale, params.num_frames, params.patch_size)
    return splits.check("synthetic_video")
