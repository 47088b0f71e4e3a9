"""Image files on disk: finding them in an ImageFolder tree and decoding one (PIL).

The one place that reads image files, shared by the eager loaders (``fedsight.data.classification``) and
the lazy stores (``fedsight.data.pipeline``), so both decode every file to the same pixels.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")


def _is_image_file(path: Path) -> bool:
    return path.is_file() and not path.name.startswith(".") and path.suffix.lower() in IMAGE_EXTENSIONS


def scan_image_folder(root: str | os.PathLike[str]) -> tuple[list[str], list[tuple[Path, int]]]:
    """Class names (sorted sub-folder names) and ``(file, label)`` pairs of an ImageFolder tree.

    Hidden entries (names starting with ``.``) and files without an image extension are skipped.
    """
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"image folder {str(root)!r} does not exist")
    if not root.is_dir():
        raise ValueError(f"image folder {str(root)!r} is not a directory")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise ValueError(f"image folder {str(root)!r} has no class sub-folders (expected <dir>/<class>/<images>)")
    samples: list[tuple[Path, int]] = []
    for label, name in enumerate(classes):
        folder = root / name
        files = sorted((p for p in folder.iterdir() if _is_image_file(p)), key=lambda p: p.name)
        if not files:
            raise ValueError(
                f"class folder {str(folder)!r} contains no image files (extensions: {', '.join(IMAGE_EXTENSIONS)})"
            )
        samples.extend((f, label) for f in files)
    return classes, samples


def image_hw(image_size: int | tuple[int, int] | None) -> tuple[int, int] | None:
    """``(height, width)`` of an ``image_size``: an int (square), a ``(height, width)`` pair, or None (native
    size). Raises ``ValueError`` for sizes below 1 or pairs of another length."""
    if image_size is None:
        return None
    if isinstance(image_size, (tuple, list)):
        if len(image_size) != 2 or any(int(v) < 1 for v in image_size):
            raise ValueError(
                f"image_size must be an int >= 1, a (height, width) pair of ints >= 1 or None, got {image_size}"
            )
        return int(image_size[0]), int(image_size[1])
    if int(image_size) < 1:
        raise ValueError(f"image_size must be >= 1 or None, got {image_size}")
    return int(image_size), int(image_size)


def load_image(path: str | os.PathLike[str], image_size: int | tuple[int, int] | None, channels: int) -> np.ndarray:
    """One image file as uint8 ``[H, W]`` (channels=1) or ``[H, W, 3]``, resized bilinearly to
    ``image_size`` x ``image_size`` (an int), to ``(height, width)`` (a pair), or not at all (``None``: its
    native size).

    Raises ``ValueError`` naming the file when PIL cannot read it.
    """
    from PIL import Image, UnidentifiedImageError

    hw = image_hw(image_size)
    try:
        with Image.open(path) as im:
            im.load()
            if im.mode == "I" or im.mode.startswith("I;16"):
                # 16-bit greyscale (PIL mode I / I;16): map 0..65535 to 0..255; PIL's own conversion clips
                arr = np.asarray(im, dtype=np.float64)
                im = Image.fromarray(np.clip(np.round(arr / 257.0), 0, 255).astype(np.uint8), "L")
            elif im.mode in ("P", "PA", "LA", "La", "RGBa"):
                im = im.convert("RGBA")
            im = im.convert("L" if channels == 1 else "RGB")
            if hw is not None:
                im = im.resize((hw[1], hw[0]), Image.Resampling.BILINEAR)
            return np.asarray(im, dtype=np.uint8).copy()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise ValueError(f"cannot read image file {str(path)!r}: {type(e).__name__}: {e}") from e


def check_image_header(path: str | os.PathLike[str]) -> None:
    """Raise ``ValueError`` naming ``path`` unless PIL recognises it as an image (reads the header only:
    cheap enough for every file of a large tree; a truncated body is found when the image is decoded)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            _ = im.size, im.mode
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise ValueError(f"cannot read image file {str(path)!r}: {type(e).__name__}: {e}") from e
