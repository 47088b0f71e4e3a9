"""Numerical core of top-down heatmap keypoint detection (SimpleBaseline / HRNet / ViTPose conventions).

Pure, vectorised torch functions (CPU and CUDA, any float dtype); numpy appears only inside the pycocotools
wrapper :func:`oks_ap`.

Pixel convention (used throughout: crops, heatmaps, flips)
-----------------------------------------------------------
Continuous coordinates ``(x, y)``: the centre of pixel ``(row i, column j)`` is the point ``(j, i)`` and the
pixel covers ``[j - 0.5, j + 0.5) x [i - 0.5, i + 0.5)``; an image of width ``W`` spans ``[-0.5, W - 0.5]``.
This is the convention of ``grid_sample``/``affine_grid``/``interpolate`` with ``align_corners=False``, so:

* :func:`crop_affine` maps the box ``center +- size / 2`` onto the crop's full extent ``[-0.5, w - 0.5]``:
  ``p -> diag(w / size_w, h / size_h) R(-rotation) (p - center) + (w / 2 - 0.5, h / 2 - 0.5)``.
  SimpleBaseline's ``get_affine_transform`` (with ``cv2.warpAffine``) maps ``center -> (w / 2, h / 2)``
  instead: its matrix is ours plus a ``(+0.5, +0.5)`` translation (the half-pixel bias that UDP,
  Huang et al. 2020, points out). :func:`warp_crops` and :func:`transform_points` are exactly consistent.
* Heatmaps of stride ``s`` relative to the crop are pixel-centre aligned when heatmap coordinates are
  ``u = (x + 0.5) / s - 0.5`` (what area/average pooling of the crop does); with that mapping a horizontal
  flip of the crop is exactly a ``.flip(-1)`` of the heatmap (``flip_heatmaps(..., shift=False)``).
  SimpleBaseline uses ``u = x / s`` instead, which is why it shifts flipped heatmaps by one pixel.
* :func:`flip_joints` maps ``x -> width - 1 - x``, the exact counterpart of ``image.flip(-1)``.
"""

from __future__ import annotations

import contextlib
import io
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "COCO_SIGMAS",
    "MPII_SIGMAS",
    "MPII_FLIP_PAIRS",
    "MPII_PCKH_EXCLUDE",
    "fix_aspect",
    "crop_affine",
    "invert_affine",
    "transform_points",
    "warp_crops",
    "warp_crop",
    "gaussian_heatmaps",
    "decode_heatmaps",
    "flip_heatmaps",
    "flip_joints",
    "pck_hits",
    "pckh_summary",
    "oks",
    "oks_ap",
]

#: COCO keypoint OKS sigmas, computed exactly as pycocotools ``Params.setKpParams`` (``np.array([...]) / 10.0``).
COCO_SIGMAS: tuple[float, ...] = tuple(
    v / 10.0 for v in (0.26, 0.25, 0.25, 0.35, 0.35, 0.79, 0.79, 0.72, 0.72, 0.62, 0.62, 1.07, 1.07, 0.87, 0.87,
                       0.89, 0.89)
)

#: mmpose's sigmas for the 16 MPII joints in MPII order (``configs/_base_/datasets/mpii.py``, "Adapted from COCO").
MPII_SIGMAS: tuple[float, ...] = (
    0.089, 0.083, 0.107, 0.107, 0.083, 0.089, 0.026, 0.026, 0.026, 0.026, 0.062, 0.072, 0.179, 0.179, 0.072, 0.062,
)

#: MPII left/right pairs (SimpleBaseline ``lib/dataset/mpii.py``).
MPII_FLIP_PAIRS: tuple[tuple[int, int], ...] = ((0, 5), (1, 4), (2, 3), (10, 15), (11, 14), (12, 13))

#: Joints left out of the MPII PCKh "Mean": pelvis (6) and thorax (7).
MPII_PCKH_EXCLUDE: tuple[int, ...] = (6, 7)


# --------------------------------------------------------------------------------------------------- helpers


def _check(t: torch.Tensor, name: str, shape: tuple[int | None, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
    ok = t.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, t.shape))
    if not ok:
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name}: expected shape {want}, got {list(t.shape)}")


def _float_dtype(*ts: torch.Tensor) -> torch.dtype:
    dt = ts[0].dtype
    for t in ts[1:]:
        dt = torch.promote_types(dt, t.dtype)
    return dt if dt.is_floating_point else torch.get_default_dtype()


def _hw(out_hw: Sequence[int], name: str = "out_hw") -> tuple[int, int]:
    if len(out_hw) != 2 or int(out_hw[0]) < 1 or int(out_hw[1]) < 1:
        raise ValueError(f"{name}: expected two positive ints (h, w), got {tuple(out_hw)}")
    return int(out_hw[0]), int(out_hw[1])


def _to3x3(affine: torch.Tensor) -> torch.Tensor:
    bottom = torch.zeros(*affine.shape[:-2], 1, 3, dtype=affine.dtype, device=affine.device)
    bottom[..., 0, 2] = 1
    return torch.cat([affine, bottom], dim=-2)


def _pair_permutation(num_joints: int, flip_pairs: Sequence[Sequence[int]]) -> list[int]:
    perm = list(range(num_joints))
    seen: set[int] = set()
    for pair in flip_pairs:
        if len(pair) != 2:
            raise ValueError(f"flip_pairs: each pair must have two indices, got {tuple(pair)}")
        a, b = int(pair[0]), int(pair[1])
        if not (0 <= a < num_joints and 0 <= b < num_joints) or a == b or a in seen or b in seen:
            raise ValueError(f"flip_pairs: invalid or repeated pair {(a, b)} for {num_joints} joints")
        seen.update((a, b))
        perm[a], perm[b] = b, a
    return perm


# --------------------------------------------------------------------------------------------- geometry


def fix_aspect(size: torch.Tensor, aspect_wh: float) -> torch.Tensor:
    """Enlarge the smaller side of boxes ``size [N, 2]`` (w, h) so that ``w / h == aspect_wh``.

    SimpleBaseline ``_box2cs`` without its 1.25 padding: ``w > a h -> h = w / a``; ``w < a h -> w = h a``.
    """
    _check(size, "size", (None, 2))
    if not aspect_wh > 0:
        raise ValueError(f"fix_aspect: aspect_wh must be positive, got {aspect_wh}")
    w, h = size[:, 0], size[:, 1]
    return torch.stack([torch.maximum(w, h * aspect_wh), torch.maximum(h, w / aspect_wh)], dim=1)


def crop_affine(
    center: torch.Tensor,
    size: torch.Tensor,
    rotation: torch.Tensor,
    out_hw: tuple[int, int],
    inverse: bool = False,
) -> torch.Tensor:
    """2x3 pixel-coordinate affines ``[N, 2, 3]`` from source images to crops of ``out_hw = (h, w)``.

    ``p -> diag(w / size_w, h / size_h) R(-theta) (p - center) + (w / 2 - 0.5, h / 2 - 0.5)``, with
    ``theta = rotation`` in degrees and ``R`` the rotation matrix in image coordinates (y down): a positive
    rotation turns the crop's content counter-clockwise, as SimpleBaseline ``get_affine_transform`` /
    ``cv2.getRotationMatrix2D``. The box ``center +- size / 2`` (rotated about ``center``) fills the crop's
    full extent ``[-0.5, w - 0.5] x [-0.5, h - 0.5]`` (module docstring: SimpleBaseline's matrix is this one
    plus a (0.5, 0.5) translation). ``size`` should have the aspect ratio ``w / h`` (:func:`fix_aspect`),
    otherwise the two axes scale differently. ``inverse=True`` returns the crop -> source matrix.
    """
    _check(center, "center", (None, 2))
    _check(size, "size", (center.shape[0], 2))
    _check(rotation, "rotation", (center.shape[0],))
    h, w = _hw(out_hw)
    dtype = _float_dtype(center, size, rotation)
    center, size, rotation = center.to(dtype), size.to(dtype), rotation.to(dtype)
    theta = torch.deg2rad(rotation)
    cos, sin = torch.cos(theta), torch.sin(theta)
    sx, sy = w / size[:, 0], h / size[:, 1]
    q0 = torch.tensor([w / 2 - 0.5, h / 2 - 0.5], dtype=dtype, device=center.device)
    if not inverse:
        lin = torch.stack([torch.stack([sx * cos, sx * sin], -1), torch.stack([-sy * sin, sy * cos], -1)], -2)
        shift = q0 - (lin @ center.unsqueeze(-1)).squeeze(-1)
    else:
        lin = torch.stack([torch.stack([cos / sx, -sin / sy], -1), torch.stack([sin / sx, cos / sy], -1)], -2)
        shift = center - lin @ q0
    return torch.cat([lin, shift.unsqueeze(-1)], dim=-1)


def invert_affine(affine: torch.Tensor) -> torch.Tensor:
    """Inverse of 2x3 affines ``[..., 2, 3]`` (closed-form 2x2 inverse, no ``linalg`` call)."""
    if affine.dim() < 2 or affine.shape[-2:] != (2, 3):
        raise ValueError(f"affine: expected shape [..., 2, 3], got {list(affine.shape)}")
    a, b, c = affine[..., 0, 0], affine[..., 0, 1], affine[..., 0, 2]
    d, e, f = affine[..., 1, 0], affine[..., 1, 1], affine[..., 1, 2]
    det = a * e - b * d
    ia, ib, id_, ie = e / det, -b / det, -d / det, a / det
    row0 = torch.stack([ia, ib, -(ia * c + ib * f)], -1)
    row1 = torch.stack([id_, ie, -(id_ * c + ie * f)], -1)
    return torch.stack([row0, row1], -2)


def transform_points(points: torch.Tensor, affine: torch.Tensor) -> torch.Tensor:
    """Apply per-instance 2x3 affines ``[N, 2, 3]`` to points ``[N, J, 2]`` (x, y)."""
    _check(points, "points", (None, None, 2))
    _check(affine, "affine", (points.shape[0], 2, 3))
    dtype = _float_dtype(points, affine)
    points, affine = points.to(dtype), affine.to(dtype)
    return points @ affine[:, :, :2].transpose(1, 2) + affine[:, None, :, 2]


def _grid_theta(affine: torch.Tensor, src_hw: tuple[int, int], out_hw: tuple[int, int]) -> torch.Tensor:
    """``affine_grid`` theta (normalised crop -> normalised source, align_corners=False) of source->crop affines."""
    (hs, ws), (ho, wo) = src_hw, out_hw
    dt, dev = affine.dtype, affine.device
    # source pixel -> normalised: x_n = (2 x + 1) / W - 1 ; normalised crop -> crop pixel: u = (w u_n + w - 1) / 2
    to_norm = torch.tensor([[2 / ws, 0, 1 / ws - 1], [0, 2 / hs, 1 / hs - 1], [0, 0, 1]], dtype=dt, device=dev)
    from_norm = torch.tensor([[wo / 2, 0, (wo - 1) / 2], [0, ho / 2, (ho - 1) / 2], [0, 0, 1]], dtype=dt, device=dev)
    return (to_norm @ _to3x3(invert_affine(affine)) @ from_norm)[:, :2]


def _warp(images: torch.Tensor, affine: torch.Tensor, out_hw: tuple[int, int], mode: str, fill: float) -> torch.Tensor:
    n, c = images.shape[:2]
    theta = _grid_theta(affine, (images.shape[-2], images.shape[-1]), out_hw).to(images.dtype)
    grid = F.affine_grid(theta, [n, c, out_hw[0], out_hw[1]], align_corners=False)
    src = images - fill if fill != 0 else images
    out = F.grid_sample(src, grid, mode=mode, padding_mode="zeros", align_corners=False)
    return out + fill if fill != 0 else out


def warp_crops(
    images: torch.Tensor,
    affine: torch.Tensor,
    out_hw: tuple[int, int],
    mode: str = "bilinear",
    fill: float = 0.0,
    antialias: bool = False,
) -> torch.Tensor:
    """Warp ``images [N, C, H, W]`` into crops ``[N, C, h, w]`` with source->crop affines ``[N, 2, 3]``.

    Sampling is ``grid_sample(align_corners=False)`` at the source point of each crop pixel centre,
    ``invert_affine(affine) @ (u, v, 1)``, so crop pixel ``(u, v)`` shows exactly the source point that
    :func:`transform_points` sends to ``(u, v)``. Outside the source the value is ``fill`` (constant padding:
    border pixels blend with ``fill``). ``mode``: ``"bilinear"``, ``"nearest"`` or ``"bicubic"``.

    ``antialias=True``: when the crop shrinks the source by ``f = 1 / sqrt(|det A|)`` > 1 (A the affine's
    linear part), each instance is warped at ``k = ceil(f)`` times the output size (crop pixel ``u`` ->
    supersampled ``k (u + 0.5) - 0.5``) and then reduced with ``F.interpolate(mode="area")`` (k x k box
    average), a box prefilter of about the source pixel footprint. Instances are grouped by ``k``
    (reading ``k`` synchronises with the device).
    """
    _check(images, "images", (None, None, None, None))
    _check(affine, "affine", (images.shape[0], 2, 3))
    if not images.dtype.is_floating_point:
        raise ValueError(f"images: expected a float tensor, got {images.dtype}")
    if mode not in ("bilinear", "nearest", "bicubic"):
        raise ValueError(f"mode: expected 'bilinear', 'nearest' or 'bicubic', got {mode!r}")
    out_hw = _hw(out_hw)
    affine = affine.to(device=images.device, dtype=torch.promote_types(affine.dtype, torch.float32))
    if not antialias or images.shape[0] == 0:
        return _warp(images, affine, out_hw, mode, fill)
    det = (affine[:, 0, 0] * affine[:, 1, 1] - affine[:, 0, 1] * affine[:, 1, 0]).abs()
    ks = torch.ceil(det.rsqrt() - 1e-6).clamp(min=1).to(torch.int64)
    out = images.new_empty(images.shape[0], images.shape[1], *out_hw)
    for k in torch.unique(ks).tolist():
        idx = (ks == k).nonzero().squeeze(1)
        sub = affine[idx]
        if k == 1:
            out[idx] = _warp(images[idx], sub, out_hw, mode, fill)
            continue
        up = torch.tensor([[k, 0, (k - 1) / 2], [0, k, (k - 1) / 2]], dtype=sub.dtype, device=sub.device)
        sub_k = up @ _to3x3(sub)
        big = _warp(images[idx], sub_k, (out_hw[0] * k, out_hw[1] * k), mode, fill)
        out[idx] = F.interpolate(big, size=out_hw, mode="area")
    return out


def warp_crop(
    image: torch.Tensor,
    affine: torch.Tensor,
    out_hw: tuple[int, int],
    mode: str = "bilinear",
    fill: float = 0.0,
    antialias: bool = False,
) -> torch.Tensor:
    """:func:`warp_crops` for one image ``[C, H, W]`` and one affine ``[2, 3]`` -> ``[C, h, w]``.

    For instances from differently sized images, call it once per instance (or batch equal-size images).
    """
    _check(image, "image", (None, None, None))
    _check(affine, "affine", (2, 3))
    return warp_crops(image[None], affine[None], out_hw, mode=mode, fill=fill, antialias=antialias)[0]


# --------------------------------------------------------------------------------------------- heatmaps


def gaussian_heatmaps(
    joints: torch.Tensor,
    weight: torch.Tensor,
    hw: tuple[int, int],
    sigma: float,
    subpixel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian target heatmaps ``[N, J, h, w]`` and target weights ``[N, J]`` (SimpleBaseline ``generate_target``).

    ``joints [N, J, 2]`` are (x, y) in heatmap pixels (pixel ``(i, j)`` at ``(j, i)``); dividing image
    coordinates by the stride, as SimpleBaseline does, is the caller's choice (see the module docstring).
    Value ``exp(-((x - mu_x)^2 + (y - mu_y)^2) / (2 sigma^2))`` at pixel centres, with
    ``mu = floor(joint + 0.5)`` (``subpixel=False``, SimpleBaseline's ``int(x + 0.5)``: peak exactly 1 on
    the rounded pixel) or ``mu = joint`` (``subpixel=True``, the exact centre as UDP / DARK). As in
    SimpleBaseline (and mmpose's UDP codec) the Gaussian is drawn only inside the window of pixels
    ``[floor(r - 3 sigma), floor(r + 3 sigma + 1))`` around the rounded centre ``r`` (13 x 13 for sigma 2) and
    is zero elsewhere. The returned weight is ``weight`` with 0 for joints whose window misses the heatmap
    (``ul >= size or br <= 0``); heatmaps of joints with returned weight <= 0 are all zero.

    Deviations from SimpleBaseline, both at degenerate places: it truncates with ``int`` (wrong for
    coordinates below -0.5 and, with non-integer ``3 sigma``, for windows crossing the left/top edge) where
    we use ``floor``; it tests ``br < 0`` (keeping the weight of a window ending exactly at the border, whose
    heatmap is empty) where we test ``br <= 0`` (weight > 0 iff the heatmap is non-empty; flip-symmetric).
    SimpleBaseline draws only when weight > 0.5 (its weights are 0/1); here, when weight > 0.
    """
    _check(joints, "joints", (None, None, 2))
    _check(weight, "weight", (joints.shape[0], joints.shape[1]))
    h, w = _hw(hw, "hw")
    if not sigma > 0:
        raise ValueError(f"gaussian_heatmaps: sigma must be positive, got {sigma}")
    dtype = _float_dtype(joints)
    joints = joints.to(dtype)
    radius = 3.0 * sigma
    mu = torch.floor(joints + 0.5)
    ul = torch.floor(mu - radius)
    br = torch.floor(mu + radius + 1)
    outside = (ul[..., 0] >= w) | (ul[..., 1] >= h) | (br[..., 0] <= 0) | (br[..., 1] <= 0)
    weight_out = torch.where(outside, torch.zeros((), dtype=dtype, device=joints.device), weight.to(dtype))
    centre = joints if subpixel else mu
    xs = torch.arange(w, dtype=dtype, device=joints.device)
    ys = torch.arange(h, dtype=dtype, device=joints.device)
    inv = -1.0 / (2.0 * sigma * sigma)
    gx = torch.exp((xs - centre[..., 0:1]) ** 2 * inv) * ((xs >= ul[..., 0:1]) & (xs < br[..., 0:1]))
    gy = torch.exp((ys - centre[..., 1:2]) ** 2 * inv) * ((ys >= ul[..., 1:2]) & (ys < br[..., 1:2]))
    gx = gx * (weight_out > 0).unsqueeze(-1)
    return gy.unsqueeze(-1) * gx.unsqueeze(-2), weight_out


def decode_heatmaps(heatmaps: torch.Tensor, refine: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Argmax decoding: coordinates ``[N, J, 2]`` (x, y, heatmap pixels) and maxima ``[N, J]``.

    SimpleBaseline ``lib/core/inference.py``: ``get_max_preds`` (first maximum in row-major order; joints with
    ``maxval <= 0`` get coordinates (0, 0)) then, with ``refine``, ``get_final_preds``' quarter-pixel shift
    ``coords += 0.25 * sign(hm[y, x+1] - hm[y, x-1], hm[y+1, x] - hm[y-1, x])`` applied only when
    ``1 < x < w - 1 and 1 < y < h - 1`` (its strict bounds: x = 1 or y = 1 is not refined). Mapping back to
    the image is :func:`transform_points` with the inverse crop affine (after rescaling by the stride).
    """
    _check(heatmaps, "heatmaps", (None, None, None, None))
    n, j, h, w = heatmaps.shape
    if h * w == 0:
        raise ValueError(f"heatmaps: expected non-empty maps, got {list(heatmaps.shape)}")
    dtype = _float_dtype(heatmaps)
    flat = heatmaps.reshape(n, j, h * w)
    maxvals, idx = flat.max(dim=-1)
    coords = torch.stack([idx % w, torch.div(idx, w, rounding_mode="floor")], dim=-1).to(dtype)
    coords = coords * (maxvals > 0).unsqueeze(-1)
    if refine:
        px, py = coords[..., 0], coords[..., 1]
        ok = (px > 1) & (px < w - 1) & (py > 1) & (py < h - 1)
        centre = (py * w + px).to(torch.int64)
        offsets = torch.tensor([1, -1, w, -w], device=heatmaps.device)
        nb = (centre.unsqueeze(-1) + offsets).clamp(0, h * w - 1)
        vals = torch.gather(flat, -1, nb).to(dtype)
        diff = torch.stack([vals[..., 0] - vals[..., 1], vals[..., 2] - vals[..., 3]], dim=-1)
        coords = coords + 0.25 * torch.sign(diff) * ok.unsqueeze(-1)
    return coords, maxvals


def flip_heatmaps(heatmaps: torch.Tensor, flip_pairs: Sequence[tuple[int, int]], shift: bool = True) -> torch.Tensor:
    """Map heatmaps predicted on a horizontally flipped crop back to the unflipped frame.

    Flip the width axis and swap the paired channels (SimpleBaseline ``flip_back``); ``shift=True`` then moves
    the maps one pixel right, column 0 kept (``out[..., 1:] = out[..., :-1]``, SimpleBaseline's
    ``TEST.SHIFT_HEATMAP``). The shift is right for SimpleBaseline's heatmap coordinates ``u = x / s``
    (stride ``s``), where the flip of a crop moves heatmap points by ``1 - 1 / s`` px more than the array
    flip (0.75 px at s = 4). With pixel-centre aligned heatmaps, ``u = (x + 0.5) / s - 0.5`` (this module's
    convention, UDP), the array flip is exact: use ``shift=False``.
    """
    _check(heatmaps, "heatmaps", (None, None, None, None))
    perm = _pair_permutation(heatmaps.shape[1], flip_pairs)
    out = heatmaps.flip(-1)[:, perm]
    if shift and heatmaps.shape[-1] > 1:
        out = torch.cat([out[..., :1], out[..., :-1]], dim=-1)
    return out


def flip_joints(joints: torch.Tensor, width: float, flip_pairs: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Joints ``[N, J, 2 or 3]`` of a horizontally flipped image of width ``width``: ``x -> width - 1 - x``.

    Pixel centres at integers, so this is the exact counterpart of ``image.flip(-1)``; pairs are swapped
    (with their extra columns, e.g. visibility). SimpleBaseline ``fliplr_joints`` additionally zeroes
    invisible joints; we leave them as they are.
    """
    if joints.dim() != 3 or joints.shape[-1] not in (2, 3):
        raise ValueError(f"joints: expected shape [N, J, 2 or 3], got {list(joints.shape)}")
    perm = _pair_permutation(joints.shape[1], flip_pairs)
    out = joints[:, perm].clone()
    out[..., 0] = (width - 1) - out[..., 0]
    return out


# ---------------------------------------------------------------------------------------------- metrics


def pck_hits(
    pred: torch.Tensor,
    gt: torch.Tensor,
    visible: torch.Tensor,
    norm: torch.Tensor,
    threshold: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-joint PCK sums over instances: ``(hits [J], counts [J])``, int64, mergeable by addition.

    A joint counts when ``visible`` and ``norm > 0``; it is a hit when ``||pred - gt|| / norm <= threshold``
    (SimpleBaseline ``lib/dataset/mpii.py`` ``evaluate``: ``scaled_uv_err <= threshold``, ``<=`` and the
    division as there). For MPII PCKh, ``norm`` is ``0.6 * ||headbox diagonal||`` (SC_BIAS 0.6), computed by
    the data loader, and ``threshold`` is 0.5.
    """
    _check(pred, "pred", (None, None, 2))
    _check(gt, "gt", tuple(pred.shape))
    _check(visible, "visible", tuple(pred.shape[:2]))
    _check(norm, "norm", (pred.shape[0],))
    dtype = _float_dtype(pred, gt, norm)
    err = torch.linalg.vector_norm(pred.to(dtype) - gt.to(dtype), dim=-1)
    norm = norm.to(dtype)
    counted = visible.to(torch.bool) & (norm > 0).unsqueeze(-1)
    safe = torch.where(norm > 0, norm, torch.ones_like(norm)).unsqueeze(-1)
    hit = counted & (err / safe <= threshold)
    return hit.sum(0, dtype=torch.int64), counted.sum(0, dtype=torch.int64)


def pckh_summary(hits: torch.Tensor, counts: torch.Tensor, exclude: Sequence[int]) -> float:
    """MPII "Mean" PCKh as a fraction: ``sum(hits) / sum(counts)`` over the joints not in ``exclude``.

    SimpleBaseline computes ``sum_j PCKh_j * jnt_ratio_j`` with ``PCKh_j = 100 hits_j / counts_j`` and
    ``jnt_ratio_j = counts_j / sum(counts)`` (excluded joints masked), which is ``100 sum(hits) / sum(counts)``
    whenever every kept joint has ``counts_j > 0`` (otherwise SimpleBaseline gives nan). Multiply by 100 for
    its percentage. MPII excludes pelvis and thorax, ``MPII_PCKH_EXCLUDE = (6, 7)``. nan if nothing counted.
    """
    _check(hits, "hits", (None,))
    _check(counts, "counts", tuple(hits.shape))
    keep = torch.ones(hits.shape[0], dtype=torch.bool, device=hits.device)
    for j in exclude:
        if not 0 <= int(j) < hits.shape[0]:
            raise ValueError(f"exclude: joint index {j} out of range for {hits.shape[0]} joints")
        keep[int(j)] = False
    total = int(counts[keep].sum())
    return float(hits[keep].sum()) / total if total > 0 else math.nan


def oks(pred: torch.Tensor, gt: torch.Tensor, area: torch.Tensor, sigmas: Sequence[float]) -> torch.Tensor:
    """Object keypoint similarity ``[N]`` of matched pairs (pycocotools ``COCOeval.computeOks``).

    ``pred [N, J, 2]`` (x, y), ``gt [N, J, 3]`` (x, y, v), ``area [N]``: with ``vars = (2 sigma)^2``,
    ``e = d^2 / vars / (area + eps) / 2`` (``eps = np.spacing(1)``), OKS is the mean of ``exp(-e)`` over the
    labelled (``v > 0``) gt joints; nan where there is none (pycocotools then falls back to a box distance;
    such ground truths are ignored by the COCO evaluation anyway).
    """
    _check(pred, "pred", (None, None, 2))
    _check(gt, "gt", (pred.shape[0], pred.shape[1], 3))
    _check(area, "area", (pred.shape[0],))
    if len(sigmas) != pred.shape[1]:
        raise ValueError(f"sigmas: expected {pred.shape[1]} values, got {len(sigmas)}")
    dtype = _float_dtype(pred, gt, area)
    pred, gt, area = pred.to(dtype), gt.to(dtype), area.to(dtype)
    var = (torch.as_tensor(sigmas, dtype=dtype, device=pred.device) * 2) ** 2
    d2 = (pred[..., 0] - gt[..., 0]) ** 2 + (pred[..., 1] - gt[..., 1]) ** 2
    e = d2 / var / (area.unsqueeze(-1) + torch.finfo(torch.float64).eps) / 2
    labelled = gt[..., 2] > 0
    num = torch.where(labelled, torch.exp(-e), torch.zeros((), dtype=dtype, device=pred.device)).sum(-1)
    return num / labelled.sum(-1).to(dtype)  # 0 / 0 -> nan for no labelled joint


def oks_ap(
    pred: torch.Tensor,
    gt: torch.Tensor,
    area: torch.Tensor,
    image_id: torch.Tensor,
    sigmas: Sequence[float],
    score: torch.Tensor | None = None,
    bbox: torch.Tensor | None = None,
) -> dict[str, float]:
    """COCO keypoint AP/AR through pycocotools, silently (stdout suppressed).

    Ground truth: one annotation per instance (``keypoints`` from ``gt [N, J, 3]`` (x, y, v),
    ``num_keypoints`` = #(v > 0), ``area``, ``bbox`` = given xywh or the extent of the labelled keypoints,
    ``iscrowd`` 0, ``category_id`` 1, ``id`` i + 1); images = the unique ``image_id``. Detections: one per
    instance, ``keypoints`` from ``pred [N, J, 3]`` (x, y, per-joint score in the visibility slot), ``score``
    = ``score`` or the mean per-joint score (SimpleBaseline rescores with the box score times the mean of
    the per-joint scores above 0.2: pass that as ``score`` to reproduce it). ``COCOeval(..., "keypoints")``
    with ``kpt_oks_sigmas = sigmas`` (any J). Instances whose gt has no labelled joint are ignored by COCO.
    Returns ``ap`` (OKS .50:.95), ``ap50``, ``ap75``, ``ap_m``, ``ap_l``, ``ar``; undefined entries
    (pycocotools' -1) are nan.
    """
    import numpy as np
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    _check(pred, "pred", (None, None, 3))
    n, j = pred.shape[:2]
    _check(gt, "gt", (n, j, 3))
    _check(area, "area", (n,))
    _check(image_id, "image_id", (n,))
    if score is not None:
        _check(score, "score", (n,))
    if bbox is not None:
        _check(bbox, "bbox", (n, 4))
    if len(sigmas) != j:
        raise ValueError(f"sigmas: expected {j} values, got {len(sigmas)}")
    keys = ("ap", "ap50", "ap75", "ap_m", "ap_l", "ar")
    if n == 0:
        return {k: math.nan for k in keys}

    pred_l = pred.detach().cpu().tolist()
    gt_l = gt.detach().cpu().tolist()
    area_l = area.detach().cpu().tolist()
    ids = [int(i) for i in image_id.detach().cpu().tolist()]
    if score is None:
        score_l = pred[..., 2].detach().mean(-1).cpu().tolist()
    else:
        score_l = score.detach().cpu().tolist()
    bbox_l = bbox.detach().cpu().tolist() if bbox is not None else None

    anns = []
    for i in range(n):
        labelled = [(x, y) for x, y, v in gt_l[i] if v > 0]
        if bbox_l is not None:
            box = [float(b) for b in bbox_l[i]]
        elif labelled:
            xs, ys = [p[0] for p in labelled], [p[1] for p in labelled]
            box = [min(xs), min(ys), max(xs) - min(xs), max(ys) - min(ys)]
        else:
            box = [0.0, 0.0, 0.0, 0.0]
        anns.append({
            "id": i + 1, "image_id": ids[i], "category_id": 1, "iscrowd": 0, "area": float(area_l[i]),
            "bbox": box, "num_keypoints": len(labelled), "keypoints": [float(c) for kp in gt_l[i] for c in kp],
        })
    dets = [
        {"image_id": ids[i], "category_id": 1, "keypoints": [float(c) for kp in pred_l[i] for c in kp],
         "score": float(score_l[i])}
        for i in range(n)
    ]
    dataset = {
        "info": {}, "licenses": [], "images": [{"id": i} for i in sorted(set(ids))], "annotations": anns,
        "categories": [{"id": 1, "name": "person", "keypoints": [f"k{k}" for k in range(j)], "skeleton": []}],
    }
    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt = COCO()
        coco_gt.dataset = dataset
        coco_gt.createIndex()
        coco_dt = coco_gt.loadRes(dets)
        ev = COCOeval(coco_gt, coco_dt, "keypoints")
        ev.params.kpt_oks_sigmas = np.array([float(s) for s in sigmas])
        ev.params.useSegm = None
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    stats = [float(s) for s in ev.stats[:6]]
    return {k: (math.nan if s == -1 else s) for k, s in zip(keys, stats)}
