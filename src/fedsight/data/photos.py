"""Real photographs that ship inside installed packages (scikit-image, scikit-learn, matplotlib): the raw
material of FedSight's built-in generated data (video clips by camera motion, street-scene textures,
figure backgrounds), available offline. Only entries that load without a download are listed."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["PHOTO_LOADERS", "TEST_PHOTOS", "TRAIN_PHOTOS", "load_photo"]


def _skimage(name: str):
    def load() -> np.ndarray:
        import skimage.data as sd

        return getattr(sd, name)()

    return load


def _motorcycle() -> np.ndarray:
    import skimage.data as sd

    return sd.stereo_motorcycle()[0]


def _sklearn(name: str):
    def load() -> np.ndarray:
        from sklearn.datasets import load_sample_image

        return load_sample_image(name)

    return load


def _grace_hopper() -> np.ndarray:
    import matplotlib.cbook as cbook
    from PIL import Image

    with Image.open(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)) as im:
        return np.asarray(im.convert("RGB"))


#: real photographs that ship inside installed packages (no download); grey-scale ones are replicated
#: to three channels
PHOTO_LOADERS = {
    "astronaut": _skimage("astronaut"),
    "chelsea": _skimage("chelsea"),
    "coffee": _skimage("coffee"),
    "rocket": _skimage("rocket"),
    "immunohistochemistry": _skimage("immunohistochemistry"),
    "hubble_deep_field": _skimage("hubble_deep_field"),
    "retina": _skimage("retina"),
    "motorcycle": _motorcycle,
    "colorwheel": _skimage("colorwheel"),
    "camera": _skimage("camera"),
    "brick": _skimage("brick"),
    "grass": _skimage("grass"),
    "gravel": _skimage("gravel"),
    "china": _sklearn("china.jpg"),
    "flower": _sklearn("flower.jpg"),
    "grace_hopper": _grace_hopper,
}
TRAIN_PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "immunohistochemistry", "hubble_deep_field", "retina", "motorcycle")
TEST_PHOTOS = ("china", "flower", "grace_hopper")

_PHOTO_CACHE: dict[str, torch.Tensor] = {}


def load_photo(name: str) -> torch.Tensor:
    """A shipped photograph as float32 ``[3, H, W]`` on the 0..255 scale."""
    if name not in PHOTO_LOADERS:
        raise ValueError(f"unknown photo {name!r}; choose from: {', '.join(PHOTO_LOADERS)}")
    if name not in _PHOTO_CACHE:
        try:
            arr = np.asarray(PHOTO_LOADERS[name]())
        except Exception as exc:  # a photo that needs a download (pooch) on this install
            raise ValueError(f"photo {name!r} cannot be loaded offline on this installation ({type(exc).__name__}: {exc})") from None
        if arr.ndim == 2:
            arr = np.repeat(arr[..., None], 3, axis=2)
        arr = arr[..., :3]
        if arr.dtype != np.uint8:
            arr = (np.clip(arr.astype(np.float64), 0, 1) * 255).round().astype(np.uint8) if arr.max() <= 1 else arr.astype(np.uint8)
        _PHOTO_CACHE[name] = torch.from_numpy(np.array(arr, dtype=np.uint8, copy=True)).permute(2, 0, 1).to(torch.float32).contiguous()
    return _PHOTO_CACHE[name]
