"""Training batches for semantic segmentation: joint image/label augmentation and style augmentation.

Every random choice for sample ``j`` of step ``s`` of client ``k`` in round ``r`` comes from the stream
``np_rng(seed, "augment", r, k, s, j)``, in this order: the scale factor, the crop position, the flip, then
(with a style bank) whether to restyle, which bank entry and (CFSI) lambda, then (with colour jitter) the
order of the three colour operations and their three factors. So batches are the same with
any number of prefetching workers, threads or processes (``fedsight.data.prefetch.Prefetcher``).

Geometry (FedDrive's protocol, thesis Sec. 5.2.3): the image is scaled by ``s ~ U(scale)`` (bilinear; the
label map nearest-neighbour), padded to at least the crop size (image with zeros, label with ``IGNORE``),
cropped at a uniformly random position to ``crop`` = (height, width), and flipped horizontally with
probability 1/2. Style (``StyleBank``) then acts on the crop, so every style descriptor has the crop's
frequency grid.

``StyleBank``: the entries other clients shared before training, one per image of the bank's clients
(FedDrive: half of the clients): amplitude windows (``fedsight.functional.style.amplitude_window`` of the
image resized to the crop size) for FDA and CFSI, or LAB (mean, std) pairs. CFSI mixes with
``lambda ~ U(0, 1)`` (FedDG's continuous interpolation), FDA swaps the window (``lambda = 1``, the original FDA).

Which images are restyled (``images``; thesis Sec. 5.1.7 and 5.2.3 against FedDrive's code):

- ``"random"`` (default): each training sample with probability ``prob`` (0.5: as many as the code's half, in
  expectation, but a different half in every draw). The default because every number documented so far was
  run with it;
- ``"even"``: the authors' release (``cityscapes.py`` / ``idda.py`` ``__getitem__``: ``index % 2 == 0``): the
  images at even positions of the client's list, always the same half (a doubled copy shares its original's
  position), ``prob`` unused;
- ``"all"``: the thesis's text (Sec. 5.1.7: "CFSI applies FDA to all the local images"), ``prob`` unused.

Whose entries a client may draw (``exclude``):

- ``"auto"`` (default): FDA and CFSI never draw the client's own entries (``A \\ A^k``, CFSI's definition in
  Sec. 5.1.7), LAB draws from the whole bank L (eq. 5.16's text: "a random pair is sampled from L", as
  FedDrive's ``cityscapes.py::lab`` does);
- ``"own"``: no method draws the client's own entries: FedDrive's ``idda.py::lab`` and ``idda.py::cfsi``
  drop the bank files whose client id starts with the image's (town, weather) prefix, which on its
  heterogeneous IDDA splits (client id = scenario ``T0k_W_V``) are the client's own and its sibling cameras'
  (on the uniform and class-imbalance splits, client ids ``client_N`` never match, so nothing is dropped);
  ``"own"`` drops exactly the client's own entries;
- ``"none"``: every method draws from the whole bank (FedDrive's ``cityscapes.py::cfsi`` and ``::lab``).

With no allowed entry (a bank of only the client, ``exclude`` "own") the image stays as it is.

Colour jitter (``jitter`` > 0; LADD's released configs: 0.5 on the source set): brightness, contrast and saturation
factors ``U(max(0, 1 - jitter), 1 + jitter)`` applied in a random order (torchvision's ``ColorJitter`` as LADD's
``transform.ColorJitter`` copies it, hue off), after the geometry and the style, just before standardisation,
where LADD's transform list puts it (``functional.style.color_jitter``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..functional.style import amplitude_window, color_jitter, fda, lab_stats, lab_transfer, to_uint8
from ..rng import np_rng
from .segmentation import IGNORE


def resize_pair(image: torch.Tensor, label: torch.Tensor, size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 image ``[3, H, W]`` (bilinear) and label map ``[H, W]`` (nearest) at ``size`` = (h, w)."""
    if tuple(image.shape[-2:]) == tuple(size):
        return image, label
    img = F.interpolate(image.unsqueeze(0).to(torch.float32), size=size, mode="bilinear", align_corners=False)
    lab = F.interpolate(label[None, None].to(torch.float32), size=size, mode="nearest")
    return to_uint8(img[0]), lab[0, 0].to(torch.uint8)


def augment_pair(
    image: torch.Tensor, label: torch.Tensor, crop: tuple[int, int], scale: tuple[float, float], flip: bool,
    rng: np.random.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random scale, pad, crop and horizontal flip of an image ``[3, H, W]`` and its label map, jointly."""
    h, w = image.shape[-2:]
    s = float(rng.uniform(scale[0], scale[1]))
    image, label = resize_pair(image, label, (max(1, round(h * s)), max(1, round(w * s))))
    ch, cw = crop
    h, w = image.shape[-2:]
    if h < ch or w < cw:
        ph, pw = max(0, ch - h), max(0, cw - w)
        image = F.pad(image, (0, pw, 0, ph), value=0)
        label = F.pad(label, (0, pw, 0, ph), value=IGNORE)
        h, w = image.shape[-2:]
    top, left = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
    image, label = image[:, top : top + ch, left : left + cw], label[top : top + ch, left : left + cw]
    if flip and rng.random() < 0.5:
        image, label = image.flip(-1), label.flip(-1)
    return image.contiguous(), label.contiguous()


@dataclass
class StyleBank:
    """Style entries shared before training (see the module docstring): ``entries`` [M, ...] float32,
    the client each came from (``owners`` [M]), the method ("fda", "cfsi" or "lab") and its parameters."""

    kind: str
    entries: torch.Tensor
    owners: np.ndarray
    beta: float = 0.1
    prob: float = 0.5
    #: a fixed (2 half + 1)^2 amplitude window instead of ``beta``'s (LADD's client styles)
    half: int | None = None
    #: which samples are restyled: "random" (with ``prob``), "even" (FedDrive's code), "all" (thesis text)
    images: str = "random"
    #: whose entries are off limits: "auto", "own" or "none" (module docstring)
    exclude: str = "auto"

    def __post_init__(self) -> None:
        _check_kind(self.kind)
        if self.images not in STYLE_IMAGES:
            raise ValueError(f"style images must be one of {', '.join(STYLE_IMAGES)}, got {self.images!r}")
        if self.exclude not in STYLE_EXCLUDE:
            raise ValueError(f"style exclude must be one of {', '.join(STYLE_EXCLUDE)}, got {self.exclude!r}")

    def nbytes(self) -> int:
        return int(self.entries.numel() * self.entries.element_size())

    def client_bytes(self, client: int) -> int:
        """What ``client`` shared (its own entries)."""
        return int((self.owners == client).sum()) * int(self.entries[0].numel() * self.entries.element_size())

    def restyles(self, position: int | None, rng: np.random.Generator) -> bool:
        """Whether the sample at ``position`` of its client's list is restyled: ``"random"`` draws from ``rng``
        (probability ``prob``), ``"even"`` and ``"all"`` draw nothing."""
        if self.images == "all":
            return True
        if self.images == "even":
            if position is None:
                raise ValueError('style images = "even" needs the sample\'s position in its client\'s list')
            return position % 2 == 0
        return bool(rng.random() < self.prob)

    def allowed(self, client: int) -> np.ndarray:
        """Indices of the entries ``client`` may draw (``exclude``, module docstring)."""
        own_out = self.exclude == "own" or (self.exclude == "auto" and self.kind in AMPLITUDE_KINDS)
        return np.flatnonzero(self.owners != client) if own_out else np.arange(len(self.owners))

    def apply(self, image: torch.Tensor, client: int, rng: np.random.Generator, position: int | None = None
              ) -> torch.Tensor:
        """``image`` uint8 ``[3, h, w]`` (at ``position`` of the client's list) restyled or not as ``images``
        says (draws: restyle? (``"random"`` only), entry, and for CFSI lambda)."""
        if not self.restyles(position, rng):
            return image
        amplitude = self.kind in AMPLITUDE_KINDS
        allowed = self.allowed(client)
        if len(allowed) == 0:
            return image
        entry = self.entries[int(allowed[int(rng.integers(0, len(allowed)))])]
        if amplitude:
            lam = float(rng.uniform(0.0, 1.0)) if self.kind == "cfsi" else 1.0
            return to_uint8(fda(image.to(torch.float32), entry, self.beta, lam, self.half))
        return to_uint8(lab_transfer(image, entry.to(torch.float64)))


#: style kinds whose entries are low-frequency amplitude windows
AMPLITUDE_KINDS = ("fda", "cfsi")
#: which training samples a style bank restyles, and whose entries a client may not draw (module docstring)
STYLE_IMAGES = ("random", "even", "all")
STYLE_EXCLUDE = ("auto", "own", "none")


def _check_kind(kind: str) -> None:
    if kind not in (*AMPLITUDE_KINDS, "lab"):
        raise ValueError(f"style kind must be 'fda', 'cfsi' or 'lab', got {kind!r}")


def style_entry(kind: str, image: torch.Tensor, crop: tuple[int, int], beta: float, half: int | None = None
                ) -> torch.Tensor:
    """A client's style entry for one image (resized to the crop size first, so every amplitude window has the
    crop's frequency grid; ``half``: a fixed ``(2 half + 1)^2`` window instead of ``beta``'s)."""
    _check_kind(kind)
    img = F.interpolate(image.unsqueeze(0).to(torch.float32), size=crop, mode="bilinear", align_corners=False)[0]
    if kind in AMPLITUDE_KINDS:
        return amplitude_window(img, beta, half).to(torch.float32)
    return lab_stats(img.clamp(0, 255)).to(torch.float32)


JITTER_OPS = ("brightness", "contrast", "saturation")


def jitter_colors(image: torch.Tensor, strength: float, rng: np.random.Generator) -> torch.Tensor:
    """uint8 ``image`` with random brightness, contrast and saturation (module docstring); draws: the order (a
    permutation of the three), then the three factors in ``JITTER_OPS`` order."""
    order = [JITTER_OPS[int(i)] for i in rng.permutation(len(JITTER_OPS))]
    low, high = max(0.0, 1.0 - strength), 1.0 + strength
    factors = {name: float(rng.uniform(low, high)) for name in JITTER_OPS}
    return color_jitter(image, factors, order)


class SegBatchLoader:
    """Picklable ``(indices, key, client[, positions, mirrored]) -> (images uint8 [B, 3, h, w], labels uint8
    [B, h, w])`` over an image store and a label store, augmented (geometry, then the doubled copy's mirror, then
    style) from per-sample streams. ``positions``: each sample's place in its client's list (the style bank's
    ``"even"`` rule); ``mirrored``: samples that are the horizontally flipped copy of a doubled client's image
    (``double_positions``). Without a label store (``labels=None``: unlabelled clients) no label is read and
    every label pixel is ``IGNORE``."""

    def __init__(self, images: Any, labels: Any, crop: tuple[int, int], scale: tuple[float, float], flip: bool,
                 seed: int, style: StyleBank | None = None, jitter: float = 0.0):
        self.images, self.labels, self.crop, self.scale, self.flip = images, labels, tuple(crop), tuple(scale), flip
        self.seed, self.style, self.jitter = int(seed), style, float(jitter)

    def __call__(self, job: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        indices, key, client = job[:3]
        positions, mirrored = (job[3], job[4]) if len(job) > 3 else (None, None)
        xs, ys = [], []
        for j, i in enumerate(indices):
            rng = np_rng(self.seed, *key, j)
            image = self.images.get_one(int(i))
            label = (self.labels.get_one(int(i)) if self.labels is not None
                     else torch.full(image.shape[-2:], IGNORE, dtype=torch.uint8))
            img, lab = augment_pair(image, label, self.crop, self.scale, self.flip, rng)
            if mirrored is not None and mirrored[j]:
                img, lab = img.flip(-1), lab.flip(-1)
            if self.style is not None:
                img = self.style.apply(img, client, rng, None if positions is None else int(positions[j]))
            if self.jitter > 0:
                img = jitter_colors(img, self.jitter, rng)
            xs.append(img)
            ys.append(lab)
        return torch.stack(xs), torch.stack(ys)


def restyle_to(image: torch.Tensor, window: torch.Tensor, half: int, style_size: tuple[int, int]) -> torch.Tensor:
    """uint8 ``image`` ``[3, H, W]`` FDA-restyled (lambda 1) with the ``(2 half + 1)^2`` amplitude ``window`` of
    a style measured on images resized to ``style_size`` (``style_entry``: LADD's client styles and cluster
    centroids). An unnormalised DFT's low-frequency amplitudes grow with the number of pixels (the DC term is
    the pixel sum), so the window is scaled by ``H W / (h w)`` before the swap: the restyled image, resized to
    ``style_size``, has about the style's window, without resampling the image itself (exactly for the DC term
    under area resizing; up to the resize filter's response for the others)."""
    h, w = style_size
    scale = image.shape[-2] * image.shape[-1] / float(h * w)
    return to_uint8(fda(image.to(torch.float32), window.to(torch.float32) * scale, 0.0, 1.0, half))


class SegEvalLoader:
    """Picklable ``indices -> (images uint8 [B, 3, H, W], labels uint8 [B, H, W])`` of whole images (the
    indices' images must share one size); with ``style`` = (window, half, style_size) every image is restyled
    by ``restyle_to`` (LADD's test-time FDA to the style of the image's cluster, thesis Sec. 5.3.8)."""

    def __init__(self, images: Any, labels: Any, style: tuple[torch.Tensor, int, tuple[int, int]] | None = None):
        self.images, self.labels, self.style = images, labels, style

    def __call__(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        xs = [self.images.get_one(int(i)) for i in indices]
        if self.style is not None:
            xs = [restyle_to(x, *self.style) for x in xs]
        ys = [self.labels.get_one(int(i)) for i in indices]
        return torch.stack(xs), torch.stack(ys)


def class_pixel_counts(labels: Any, num_classes: int, prefetcher: Any = None, chunk: int = 16) -> np.ndarray:
    """``[N, C]`` int64 pixel counts of every class in every label map (``IGNORE`` not counted): what
    class-imbalance splits and the per-client class plots use. One pass over the label maps."""
    n = len(labels)
    chunks = [list(range(s, min(s + chunk, n))) for s in range(0, n, chunk)]

    def count(idx: list[int]) -> np.ndarray:
        out = np.zeros((len(idx), num_classes), dtype=np.int64)
        for r, i in enumerate(idx):
            lab = labels.get_one(i).reshape(-1).to(torch.int64)
            lab = lab[lab != IGNORE]
            if lab.numel() and int(lab.max()) >= num_classes:
                raise ValueError(f"label map {i} holds class id {int(lab.max())} >= {num_classes} classes")
            out[r] = torch.bincount(lab, minlength=num_classes).numpy()
        return out

    parts = list(prefetcher.map(count, chunks)) if prefetcher is not None else [count(c) for c in chunks]
    return np.concatenate(parts) if parts else np.zeros((0, num_classes), dtype=np.int64)


def build_style_bank(kind: str, images: Any, owners: np.ndarray, crop: tuple[int, int], beta: float, prob: float,
                     prefetcher: Any = None, which: str = "random", exclude: str = "auto") -> StyleBank:
    """The bank of ``kind`` ("fda", "cfsi" or "lab") over ``images`` (a store of the bank clients' images) whose
    clients are ``owners``; ``which`` and ``exclude``: ``StyleBank.images`` and ``.exclude``."""
    n = len(images)
    one = lambda i: style_entry(kind, images.get_one(i), crop, beta)  # noqa: E731
    entries = list(prefetcher.map(one, range(n))) if prefetcher is not None else [one(i) for i in range(n)]
    if not entries:
        raise ValueError("the style bank is empty: no client shares images")
    return StyleBank(kind, torch.stack(entries), np.asarray(owners, dtype=np.int64), beta, prob, images=which,
                     exclude=exclude)


def double_positions(positions: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """FedDrive's ``double_dataset`` (``cityscapes.py``: ``__len__`` is ``2 n``; item ``i >= n`` is item
    ``i - n`` flipped horizontally): positions ``0..2n-1`` of a doubled client's virtual list -> (positions in its
    real list, whether the sample is the mirrored copy)."""
    positions = np.asarray(positions, dtype=np.int64)
    return positions % n, positions >= n


def bank_clients(num_clients: int, fraction: float, seed: int) -> np.ndarray:
    """The sorted clients whose images populate the bank: ``ceil(fraction K)`` of them, drawn from the
    stream (seed, "style-bank") (FedDrive: half of the clients)."""
    k = max(1, math.ceil(round(fraction * num_clients, 9)))  # 0.28 x 25 is 7.000000000000001 in floating point
    return np.sort(np_rng(seed, "style-bank").permutation(num_clients)[:k])
