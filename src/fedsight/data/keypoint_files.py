"""Keypoint annotation files: COCO keypoint JSON and MPII (HRNet / SimpleBaseline layout), each split
parsed into a ``KeypointSet`` (``fedsight.data.keypoint_sets``); the registered data sets that use these
parsers are in ``fedsight.data.keypoints``. A bad input raises a one-line error naming the file and field.

COCO (:func:`load_coco_split`): ``person_keypoints_*.json`` files and image folders, read as
SimpleBaseline's ``_load_coco_keypoint_annotation_kernal`` does: crowd annotations, annotations with
fewer than ``min_keypoints`` labelled joints and boxes narrower or lower than 1 pixel once clipped to
the image ``[0, W] x [0, H]`` are skipped; ``center`` is the clipped box's centre and ``size`` the box's
``(w, h)`` times ``padding`` (``_box2cs`` without its aspect fix). ``area`` is the annotation's ``area``
(the clipped box's area where it is missing or not positive). The skeleton comes from the category's
``keypoints`` names: COCO's 17 names in COCO order give ``COCO17``, MPII's 16 names (``r_ankle``
style or mmpose's ``right_ankle`` style) in MPII order give ``MPII16``, other names a ``custom``
skeleton whose flip pairs pair ``left_X``/``right_X`` and ``l_X``/``r_X`` (case-insensitive), whose limbs
are the category's 1-based ``skeleton`` made 0-based and whose sigmas are 0.05 for every joint. The
optional, non-standard annotation field ``head_box`` ``[x1, y1, x2, y2]`` (the generated figures carry
it) gives ``head_size = 0.6 * ||(x2 - x1, y2 - y1)||``; without it ``head_size`` is NaN.

MPII (:func:`load_mpii_split`): ``root/annot/<split>.json``, ``root/annot/gt_valid.mat`` (head boxes of
the ``valid`` split) and ``root/images/``, read as HRNet's ``lib/dataset/mpii.py`` does (the details:
``fedsight.data.keypoints.load_mpii``).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from fedsight.data.keypoint_sets import (
    MPII16,
    SC_BIAS,
    KeypointSet,
    Skeleton,
    _int_array,
    _stack,
    skeleton_from_names,
)
from fedsight.safe_read import exists, read_json

__all__ = ["load_coco_split", "load_mpii_split"]


# ----------------------------------------------------------------------------------------------- helpers


def _read_json(path: Path, what: str):
    if not exists(path):
        raise FileNotFoundError(f"{path}: annotation file not found ({what})")
    # bounded: a regular file, its size, strict UTF-8, nesting and digit limits (fedsight.safe_read)
    return read_json(path, f"{what} annotation file")


#: the range of an image id (stored as int64)
_INT64 = (-(2**63), 2**63 - 1)


def _numbers(v, n: int | None) -> bool:
    return (isinstance(v, (list, tuple)) and (n is None or len(v) == n)
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v))


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# ------------------------------------------------------------------------------------------------- COCO


def _coco_skeleton(doc: dict, path: Path) -> tuple[dict, Skeleton]:
    cats = doc["categories"]
    if not isinstance(cats, list) or not all(isinstance(c, dict) for c in cats):
        raise ValueError(f"{path}: categories must be a list of objects")
    with_kp = [c for c in cats if "keypoints" in c]
    if not with_kp:
        raise ValueError(f"{path}: no category has 'keypoints' (joint names); is this a keypoint annotation file?")
    cat = next((c for c in with_kp if c.get("name") == "person"), with_kp[0])
    names = cat["keypoints"]
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise ValueError(f"category {cat.get('id')!r} in {path}: keypoints must be a non-empty list of joint names")
    if len(set(names)) != len(names):
        raise ValueError(f"category {cat.get('id')!r} in {path}: keypoints repeats a joint name")
    J = len(names)
    limbs = cat.get("skeleton", [])
    if not isinstance(limbs, list) or not all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(i, int) and not isinstance(i, bool) and 1 <= i <= J for i in p)
        and p[0] != p[1] for p in limbs
    ):
        raise ValueError(f"category {cat.get('id')!r} in {path}: skeleton must be a list of [a, b] pairs of distinct 1-based joint indices in 1..{J}")
    return cat, skeleton_from_names(names, [(a - 1, b - 1) for a, b in limbs])


def load_coco_split(json_path: Path, image_dir: Path, padding: float = 1.25, min_keypoints: int = 1,
                    max_instances: int | None = None) -> KeypointSet:
    """One COCO keypoint annotation file and its image folder as a :class:`KeypointSet` (see the module
    docstring for what is kept)."""
    doc = _read_json(json_path, "COCO keypoints")
    if not isinstance(doc, dict):
        raise ValueError(f"{json_path}: expected a JSON object with images, annotations and categories")
    for key in ("images", "annotations", "categories"):
        if key not in doc:
            raise ValueError(f"{json_path}: missing field '{key}'")
    if not isinstance(doc["images"], list) or not isinstance(doc["annotations"], list):
        raise ValueError(f"{json_path}: images and annotations must be lists")
    cat, skel = _coco_skeleton(doc, json_path)
    J = skel.num_joints
    images: dict[int, tuple[str, int, int]] = {}
    for k, im in enumerate(doc["images"]):
        if not isinstance(im, dict):
            raise ValueError(f"image entry {k} in {json_path}: not an object")
        for key in ("id", "file_name", "width", "height"):
            if key not in im:
                raise ValueError(f"image {im.get('id', f'entry {k}')} in {json_path}: missing field '{key}'")
        if not (isinstance(im["id"], int) and not isinstance(im["id"], bool) and _INT64[0] <= im["id"] <= _INT64[1]
                and isinstance(im["file_name"], str)
                and _is_number(im["width"]) and _is_number(im["height"]) and im["width"] > 0 and im["height"] > 0):
            raise ValueError(f"image {im['id']} in {json_path}: id must be an int (64-bit), file_name a string, width and "
                             "height positive numbers")
        if im["id"] in images:
            raise ValueError(f"image {im['id']} in {json_path}: id repeated")
        images[im["id"]] = (im["file_name"], int(im["width"]), int(im["height"]))

    order: dict[int, int] = {}
    rows: dict[str, list] = {k: [] for k in ("image", "image_id", "joints", "center", "size", "area", "bbox", "head")}
    for k, a in enumerate(doc["annotations"]):
        if max_instances is not None and len(rows["image"]) >= max_instances:
            break
        if not isinstance(a, dict):
            raise ValueError(f"annotation entry {k} in {json_path}: not an object")
        aid = a.get("id", f"entry {k}")
        if a.get("category_id") != cat.get("id") or a.get("iscrowd", 0):
            continue
        kp = a.get("keypoints")
        if kp is None:
            raise ValueError(f"annotation {aid} in {json_path}: missing field 'keypoints'")
        if not _numbers(kp, None):
            raise ValueError(f"annotation {aid} in {json_path}: keypoints must be a list of finite numbers")
        if len(kp) != 3 * J:
            raise ValueError(f"annotation {aid} in {json_path}: keypoints has {len(kp)} values, expected 3 x {J}")
        joints = np.asarray(kp, dtype=np.float64).reshape(J, 3)
        if not np.isin(joints[:, 2], (0, 1, 2)).all():
            raise ValueError(f"annotation {aid} in {json_path}: keypoints visibility values must be 0, 1 or 2")
        if int((joints[:, 2] > 0).sum()) < min_keypoints:
            continue
        iid = a.get("image_id")
        if iid not in images:
            raise ValueError(f"annotation {aid} in {json_path}: image_id {iid!r} is not in images")
        box = a.get("bbox")
        if not _numbers(box, 4):
            raise ValueError(f"annotation {aid} in {json_path}: bbox must be 4 finite numbers [x, y, w, h]")
        _, W, H = images[iid]
        x, y, w, h = (float(v) for v in box)
        x1, y1, x2, y2 = max(x, 0.0), max(y, 0.0), min(x + max(w, 0.0), float(W)), min(y + max(h, 0.0), float(H))
        if x2 - x1 < 1 or y2 - y1 < 1:
            continue
        area = a.get("area")
        if not _is_number(area) or area <= 0:
            area = (x2 - x1) * (y2 - y1)
        head = a.get("head_box")
        if head is None:
            hs = float("nan")
        elif _numbers(head, 4):
            hs = SC_BIAS * math.hypot(head[2] - head[0], head[3] - head[1])
        else:
            raise ValueError(f"annotation {aid} in {json_path}: head_box must be 4 finite numbers [x1, y1, x2, y2]")
        rows["image"].append(order.setdefault(iid, len(order)))
        rows["image_id"].append(iid)
        rows["joints"].append(joints)
        rows["center"].append(((x1 + x2) / 2, (y1 + y2) / 2))
        rows["size"].append(((x2 - x1) * padding, (y2 - y1) * padding))
        rows["area"].append(area)
        rows["bbox"].append((x1, y1, x2 - x1, y2 - y1))
        rows["head"].append(hs)
    paths = []
    for iid in order:
        p = image_dir / images[iid][0]
        if not p.is_file():
            raise FileNotFoundError(f"{p}: image file not found (image {iid} of {json_path})")
        paths.append(str(p))
    n = len(rows["image"])
    return KeypointSet(
        skeleton=skel, images=paths, image=_int_array(rows["image"], n), image_id=_int_array(rows["image_id"], n),
        joints=_stack(rows["joints"], (J, 3), np.float32), center=_stack(rows["center"], (2,), np.float32),
        size=_stack(rows["size"], (2,), np.float32), area=np.asarray(rows["area"], dtype=np.float32),
        bbox=_stack(rows["bbox"], (4,), np.float32), head_size=np.asarray(rows["head"], dtype=np.float32),
        labels=np.zeros(n, dtype=np.int64), class_names=[str(cat.get("name", "person"))],
    )


# ------------------------------------------------------------------------------------------------- MPII


def _mpii_head_sizes(mat_path: Path, n: int, json_path: Path) -> np.ndarray:
    if not mat_path.is_file():
        raise FileNotFoundError(f"{mat_path}: MPII ground truth not found (head boxes of {json_path.name}, needed for PCKh)")
    from scipy.io import loadmat

    try:
        mat = loadmat(str(mat_path))
    except Exception as exc:  # scipy raises several types for broken files
        raise ValueError(f"{mat_path}: not a readable MATLAB file ({type(exc).__name__}: {exc})") from None
    if "headboxes_src" not in mat:
        raise ValueError(f"{mat_path}: missing field 'headboxes_src'")
    hb = np.asarray(mat["headboxes_src"], dtype=np.float64)
    if hb.ndim != 3 or hb.shape[:2] != (2, 2):
        raise ValueError(f"{mat_path}: headboxes_src has shape {hb.shape}, expected (2, 2, N)")
    for key, shape in (("headboxes_src", hb.shape), ("jnt_missing", None), ("pos_gt_src", None)):
        if key != "headboxes_src" and key in mat:
            shape = np.asarray(mat[key]).shape
        if shape is not None and shape[-1] != n:
            raise ValueError(f"{mat_path}: {key} has {shape[-1]} instances but {json_path} has {n} "
                             f"(gt_valid.mat must list the instances of {json_path.name} in file order)")
    return (SC_BIAS * np.linalg.norm(hb[1] - hb[0], axis=0)).astype(np.float32)


def load_mpii_split(root: Path, split: str, max_instances: int | None = None) -> KeypointSet:
    """``root/annot/<split>.json`` (HRNet / SimpleBaseline format) as a :class:`KeypointSet`: see
    :func:`fedsight.data.keypoints.load_mpii`."""
    path = root / "annot" / f"{split}.json"
    entries = _read_json(path, f"MPII split {split!r}")
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a list of {{image, center, scale, joints, joints_vis}} objects")
    J = MPII16.num_joints
    rows: dict[str, list] = {k: [] for k in ("image", "image_id", "joints", "center", "size", "area", "bbox")}
    order: dict[str, int] = {}
    for k, e in enumerate(entries):
        where = f"entry {k} in {path}"
        if not isinstance(e, dict):
            raise ValueError(f"{where}: not an object")
        for key in ("image", "center", "scale", "joints", "joints_vis"):
            if key not in e:
                raise ValueError(f"{where}: missing field '{key}'")
        if not isinstance(e["image"], str) or not e["image"]:
            raise ValueError(f"{where}: image must be a file name")
        if not _numbers(e["center"], 2):
            raise ValueError(f"{where}: center must be 2 finite numbers [x, y]")
        if not _is_number(e["scale"]) or e["scale"] <= 0:
            raise ValueError(f"{where}: scale must be a positive number")
        jts = e["joints"]
        if not (isinstance(jts, list) and len(jts) == J and all(_numbers(p, 2) for p in jts)):
            n_j = len(jts) if isinstance(jts, list) else "no"
            raise ValueError(f"{where}: joints has {n_j} entries, expected {J} [x, y] pairs of finite numbers")
        vis = e["joints_vis"]
        if not _numbers(vis, J):
            n_v = len(vis) if isinstance(vis, list) else "no"
            raise ValueError(f"{where}: joints_vis has {n_v} values, expected {J} numbers")
        # HRNet lib/dataset/mpii.py: move the centre down and enlarge the box, then MATLAB 1-based -> 0-based
        c = np.array(e["center"], dtype=np.float64)
        s0 = s = float(e["scale"])
        if c[0] != -1:
            c[1] = c[1] + 15 * s
            s = s * 1.25
        c = c - 1
        v = np.where(np.asarray(vis, dtype=np.float64) > 0, 2.0, 0.0)
        xy = np.asarray(jts, dtype=np.float64) - 1
        xy[v == 0] = 0
        lab = xy[v > 0]
        area = float(np.ptp(lab[:, 0]) * np.ptp(lab[:, 1])) if len(lab) else 0.0
        side = 200 * s0
        rows["image"].append(order.setdefault(e["image"], len(order)))
        rows["image_id"].append(order[e["image"]])
        rows["joints"].append(np.concatenate([xy, v[:, None]], 1))
        rows["center"].append(c)
        rows["size"].append((200 * s, 200 * s))
        rows["area"].append(max(area, 1.0))
        rows["bbox"].append((c[0] - side / 2, c[1] - side / 2, side, side))
    n = len(rows["image"])
    head = _mpii_head_sizes(root / "annot" / "gt_valid.mat", n, path) if split == "valid" else np.full(n, np.nan, np.float32)
    paths = []
    for name in order:
        p = root / "images" / name
        if not p.is_file():
            raise FileNotFoundError(f"{p}: image file not found (named in {path})")
        paths.append(str(p))
    ks = KeypointSet(
        skeleton=MPII16, images=paths, image=_int_array(rows["image"], n), image_id=_int_array(rows["image_id"], n),
        joints=_stack(rows["joints"], (J, 3), np.float32), center=_stack(rows["center"], (2,), np.float32),
        size=_stack(rows["size"], (2,), np.float32), area=np.asarray(rows["area"], dtype=np.float32),
        bbox=_stack(rows["bbox"], (4,), np.float32), head_size=head, labels=np.zeros(n, dtype=np.int64),
        class_names=["person"],
    )
    return ks if max_instances is None or n <= max_instances else ks.subset(np.arange(max_instances))
