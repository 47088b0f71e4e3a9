"""Articulated figures: synthetic people in MPII's 16-joint layout, drawn over shipped photographs.

A documented generator (no download) behind the ``builtin_pose`` data set of ``fedsight.data.keypoints``
and behind ``python -m fedsight.data.figures`` (a COCO-format copy on disk, see :func:`write_coco`).

What is generated
-----------------
Each image is a crop of a real photograph (``fedsight.data.photos``, by default the people-free ones of
:data:`DEFAULT_BACKGROUNDS`, shrunk once to a longer side of at most 640 pixels: a random crop of 35-100 %
of the largest window of the image's aspect, resampled by PIL's bilinear filter, randomly mirrored, gain
0.8-1.2) with
``persons_per_image`` figures in front of it. A figure is a small 3-D skeleton (MPII joints, below) posed
by joint angles, seen from a random view and projected orthographically; its body parts are drawn as
filled shapes, farthest first (painter's algorithm on the depth of each part), so limbs cover each other
as they would. The body parts' shapes, the clothes and their textures are described in
``fedsight.data.figure_draw``; body proportions (:data:`SEGMENTS`), joint-angle limits
(:data:`ANGLE_LIMITS`), pose archetypes and views in ``fedsight.data.figure_pose``.

Joints (MPII order, ``fedsight.data.keypoints.MPII16``): 0 r_ankle, 1 r_knee, 2 r_hip, 3 l_hip, 4 l_knee,
5 l_ankle, 6 pelvis (midpoint of the hips), 7 thorax (midpoint of the shoulders), 8 upper_neck, 9 head_top,
10 r_wrist, 11 r_elbow, 12 r_shoulder, 13 l_shoulder, 14 l_elbow, 15 l_wrist. Coordinates are 0-based
pixels with pixel ``(row i, col j)`` centred at ``(x, y) = (j, i)`` (``fedsight.functional.keypoints``).

Placement: a figure (its drawn silhouette's box) fills a fraction ``height_range`` (0.6-0.95) of the
image's height or of its width share, whichever binds; the box may stick out of the image by
``truncation`` (10 %) of its size on each side. With several persons the width is dealt into slots (their
boxes may overlap) and they are stacked in random depth order.

Visibility ``v`` (COCO's): a joint outside the image (``x`` not in ``[0, W - 1]`` or ``y`` not in
``[0, H - 1]``) has ``v = 0`` and coordinates ``(0, 0)``; otherwise ``v = 2`` when the pixel at the joint
(rounded) shows one of the joint's own body parts (e.g. the thigh or shin for a knee; the torso or a thigh
for the pelvis), and ``v = 1`` (labelled but occluded) when something else is drawn there: an occluder,
another person, or another part of the same figure (an arm across the hip). Occluders: with probability
``occlusion`` per person, a rectangle or an ellipse of 15-45 % of its height, cut from a photograph, is
put in front of everything, centred near one of its joints (random joint, jitter of half the occluder).
The occluder's random numbers are drawn whether or not it is used, so the same seed with another
``occlusion`` gives the same figures and backgrounds.

Per person the generator also gives its ``bbox`` (xywh: the silhouette's box, occluded parts included,
clipped to the image ``[0, W] x [0, H]``), ``area`` (the number of pixels of the image that show the
person: COCO's segmentation area is the visible area too), ``head_box`` ``[x1, y1, x2, y2]`` (the head
ellipse's axis-aligned box, MPII style, not clipped), ``height`` (``H`` in pixels) and ``joints_3d``
(``[16, 3]``: x, y in pixels, z the depth towards the camera, in pixels).

Everything is a function of the ``numpy.random.Generator`` passed in (the first ``k`` images of a
stream do not depend on how many follow).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedsight.data.figure_draw import (
    OWN_PARTS,
    _background,
    _Canvas,
    _extent,
    _person_parts,
    _photo,
    _sample_style,
    _scaled,
)
from fedsight.data.figure_pose import (
    ANGLE_LIMITS,
    SEGMENT_VARIATION,
    SEGMENTS,
    WIDTH_VARIATION,
    _sample_body,
    _sample_pose,
    _sample_view,
    _skeleton,
)

__all__ = [
    "ANGLE_LIMITS",
    "DEFAULT_BACKGROUNDS",
    "SEGMENTS",
    "SEGMENT_VARIATION",
    "WIDTH_VARIATION",
    "render_figures",
    "write_coco",
]

#: photographs used as backgrounds by default: every shipped photograph without a person in it
#: (astronaut, camera and grace_hopper show unannotated people) and with a real scene (not colorwheel)
DEFAULT_BACKGROUNDS = ("chelsea", "coffee", "rocket", "immunohistochemistry", "hubble_deep_field", "retina", "motorcycle",
                       "china", "flower", "brick", "grass", "gravel")

#: part-map id of the first occluder (occluder of person k: _OCCLUDER_ID + k; figures' parts: person * 16 + part)
_OCCLUDER_ID = 100


# ---------------------------------------------------------------------------------------- images


def _sample_occluder(rng: np.random.Generator, n_photos: int) -> dict:
    return {
        "use": rng.random(), "ellipse": bool(rng.random() < 0.5), "w": rng.uniform(0.15, 0.45), "h": rng.uniform(0.15, 0.45),
        "joint": int(rng.integers(16)), "jitter": rng.uniform(-0.5, 0.5, 2), "photo": int(rng.integers(n_photos)),
        "offset": rng.random(2), "gain": rng.uniform(0.6, 1.2),
    }


def _render_image(rng: np.random.Generator, hw: tuple[int, int], names: list[str], photos: list[np.ndarray], persons: int, occlusion: float,
                  height_range: tuple[float, float], truncation: float, free_view: float):
    H, W = hw
    bg = int(rng.integers(len(photos)))
    canvas = _Canvas(_background(names[bg], hw, rng))
    figures = []
    for k in range(persons):
        pose, body, view, style = _sample_pose(rng), _sample_body(rng), _sample_view(rng, free_view), _sample_style(rng)
        occ = _sample_occluder(rng, len(photos))
        cam, geo = _skeleton(pose, body, view)
        parts = _person_parts(cam, geo, body, style)
        box = _extent(parts)
        bw, bh = box[2] - box[0], box[3] - box[1]
        slot = W / persons * (1.3 if persons > 1 else 1.0)
        s = rng.uniform(*height_range) * min(H / bh, slot / bw)
        bw_px, bh_px = bw * s, bh * s
        lo_x = (k * W / persons if persons > 1 else 0) - truncation * bw_px
        hi_x = ((k + 1) * W / persons if persons > 1 else W) + truncation * bw_px - bw_px
        x1 = rng.uniform(min(lo_x, hi_x), max(lo_x, hi_x))
        y1 = rng.uniform(min(-truncation * bh_px, H - bh_px + truncation * bh_px), max(-truncation * bh_px, H - bh_px + truncation * bh_px))
        off = np.array([x1, y1]) - box[:2] * s
        figures.append((cam, parts, s, off, occ))
    order = rng.permutation(persons)
    for k in order:  # back to front: persons, then each person's parts by depth
        _, parts, s, off, _ = figures[k]
        for _depth, part, kind, g, colour, tex in sorted(_scaled(parts, s, off), key=lambda t: t[0]):
            pid = int(k) * 16 + part
            if kind == "cap":
                canvas.capsule(g[0], g[1], g[2], g[3], colour, tex, pid)
            elif kind == "poly":
                canvas.polygon(g, colour, tex, pid)
            else:
                canvas.head(*g, style=colour, pid=pid)
    for k in range(persons):  # occluders in front of everything
        cam, parts, s, off, occ = figures[k]
        if occ["use"] >= occlusion:
            continue
        w, h = occ["w"] * s, occ["h"] * s
        jx, jy = cam[occ["joint"], 0] * s + off[0], -cam[occ["joint"], 1] * s + off[1]
        x0, y0 = jx + occ["jitter"][0] * w - w / 2, jy + occ["jitter"][1] * h - h / 2
        photo = photos[occ["photo"]]
        ph, pw = photo.shape[:2]
        oy, ox = int(occ["offset"][0] * max(ph - h - 2, 1)), int(occ["offset"][1] * max(pw - w - 2, 1))
        ix0, iy0 = int(math.floor(x0)), int(math.floor(y0))

        def patch(ys, xs, photo=photo, oy=oy, ox=ox, ix0=ix0, iy0=iy0, ph=ph, pw=pw, gain=occ["gain"]):
            return photo[np.minimum(np.maximum(ys - iy0 + oy, 0), ph - 1), np.minimum(np.maximum(xs - ix0 + ox, 0), pw - 1)] * gain

        canvas.occluder(x0, y0, w, h, occ["ellipse"], patch, _OCCLUDER_ID + k)
    img = canvas.img
    np.rint(img, out=img)
    image = np.minimum(np.maximum(img, 0, out=img), 255, out=img).astype(np.uint8)
    counts = np.bincount(canvas.ids[canvas.ids >= 0].astype(np.int64) // 16, minlength=persons + 8)
    people = []
    for k in range(persons):
        cam, parts, s, off, _ = figures[k]
        xy = np.stack([cam[:, 0] * s + off[0], -cam[:, 1] * s + off[1]], 1)
        inside = (xy[:, 0] >= 0) & (xy[:, 0] <= W - 1) & (xy[:, 1] >= 0) & (xy[:, 1] <= H - 1)
        joints = np.zeros((16, 3), dtype=np.float32)
        for j in range(16):
            if not inside[j]:
                continue
            pid = int(canvas.ids[int(round(xy[j, 1])), int(round(xy[j, 0]))])
            own = pid >= 0 and pid // 16 == k and pid < _OCCLUDER_ID and (pid % 16) in OWN_PARTS[j]
            joints[j] = (xy[j, 0], xy[j, 1], 2.0 if own else 1.0)
        box = _extent(_scaled(parts, s, off))
        x1, y1 = max(box[0], 0.0), max(box[1], 0.0)
        x2, y2 = min(box[2], float(W)), min(box[3], float(H))
        head = next(g for _, part, kind, g, *_ in _scaled(parts, s, off) if kind == "head")
        c, axis, A, B = head[:4]
        e = np.array([math.hypot(A * axis[0], B * axis[1]), math.hypot(A * axis[1], B * axis[0])])
        people.append({
            "joints": joints,
            "bbox": np.array([x1, y1, max(x2 - x1, 0.0), max(y2 - y1, 0.0)], dtype=np.float32),
            "area": float(max(counts[k], 1)),
            "head_box": np.array([c[0] - e[0], c[1] - e[1], c[0] + e[0], c[1] + e[1]], dtype=np.float32),
            "height": float(s),
            "joints_3d": np.stack([xy[:, 0], xy[:, 1], cam[:, 2] * s], 1).astype(np.float32),
        })
    return image, people, bg


def render_figures(
    n_images: int,
    image_hw: tuple[int, int],
    rng: np.random.Generator,
    persons_per_image: int = 1,
    occlusion: float = 0.3,
    backgrounds: Sequence[str] | None = None,
    *,
    height_range: tuple[float, float] = (0.6, 0.95),
    truncation: float = 0.1,
    free_view: float = 0.25,
) -> tuple[list[np.ndarray], list[dict], list[int], list[str]]:
    """Render ``n_images`` images of ``image_hw = (H, W)`` with ``persons_per_image`` figures each.

    Returns ``(images, persons, background_index, background_names)``: uint8 ``[H, W, 3]`` images; per person
    (image by image, in annotation order) a dict with ``image`` (index), ``joints`` float32 ``[16, 3]``
    (x, y, v: see the module docstring), ``bbox`` xywh, ``area``, ``head_box`` x1y1x2y2, ``height`` (pixels)
    and ``joints_3d``; the background photograph's index (into ``background_names``) of each image.
    """
    names = list(DEFAULT_BACKGROUNDS if backgrounds is None else backgrounds)
    H, W = (int(v) for v in image_hw)
    if n_images < 0:
        raise ValueError(f"n_images = {n_images} must be >= 0")
    if min(H, W) < 16:
        raise ValueError(f"image_hw = {tuple(image_hw)}: both sides must be >= 16 pixels")
    if not 1 <= persons_per_image <= 3:
        raise ValueError(f"persons_per_image = {persons_per_image} must lie in 1..3")
    if not 0 <= occlusion <= 1:
        raise ValueError(f"occlusion = {occlusion} must lie in [0, 1]")
    if not 0 < height_range[0] <= height_range[1] <= 1.5:
        raise ValueError(f"height_range = {tuple(height_range)} must satisfy 0 < low <= high <= 1.5")
    if not 0 <= truncation <= 0.5:
        raise ValueError(f"truncation = {truncation} must lie in [0, 0.5]")
    if not 0 <= free_view <= 1:
        raise ValueError(f"free_view = {free_view} must lie in [0, 1]")
    if not names:
        raise ValueError("backgrounds: at least one photograph is needed")
    photos = [_photo(n) for n in names]
    images, persons, bgs = [], [], []
    for i in range(n_images):
        img, people, bg = _render_image(rng, (H, W), names, photos, persons_per_image, occlusion, tuple(height_range), truncation, free_view)
        images.append(img)
        bgs.append(bg)
        for p in people:
            persons.append({"image": i, **p})
    return images, persons, bgs, names


# ---------------------------------------------------------------------------------------- COCO files


def write_coco(
    out_dir: str | Path,
    n_images: int,
    image_hw: tuple[int, int],
    seed: int,
    split_name: str = "train",
    *,
    persons_per_image: int = 1,
    occlusion: float = 0.3,
    backgrounds: Sequence[str] | None = None,
    force: bool = False,
    **options,
) -> Path:
    """Write ``n_images`` generated images to ``out_dir/images/<split>/%06d.png`` (named by image id, 1-based)
    and their annotations to ``out_dir/annotations/person_keypoints_<split>.json`` in COCO keypoint format
    (one ``person`` category whose ``keypoints`` are the 16 MPII joint names and ``skeleton`` the 1-based
    MPII limbs; each annotation also carries the non-standard ``head_box`` ``[x1, y1, x2, y2]``). Returns the
    annotation file's path. Refuses to overwrite an existing annotation file or a non-empty image folder
    unless ``force``. ``options``: :func:`render_figures`' keyword options."""
    from PIL import Image

    from fedsight.data.keypoint_sets import MPII16

    out = Path(out_dir)
    if not split_name or "/" in split_name or split_name.startswith("."):
        raise ValueError(f"split name {split_name!r} must be a plain folder name")
    img_dir = out / "images" / split_name
    ann = out / "annotations" / f"person_keypoints_{split_name}.json"
    if not force:
        if ann.exists():
            raise FileExistsError(f"{ann}: annotation file exists; pass force=True (--force) to overwrite")
        if img_dir.is_dir() and any(img_dir.iterdir()):
            raise FileExistsError(f"{img_dir}: image folder is not empty; pass force=True (--force) to overwrite")
    rng = np.random.default_rng(seed)
    images, persons, bgs, names = render_figures(n_images, image_hw, rng, persons_per_image, occlusion, backgrounds, **options)
    img_dir.mkdir(parents=True, exist_ok=True)
    ann.parent.mkdir(parents=True, exist_ok=True)
    if force:
        for old in img_dir.glob("[0-9][0-9][0-9][0-9][0-9][0-9].png"):
            old.unlink()
    H, W = (int(v) for v in image_hw)
    coco_images = []
    for i, img in enumerate(images):
        name = f"{i + 1:06d}.png"
        Image.fromarray(img).save(img_dir / name)
        coco_images.append({"id": i + 1, "file_name": name, "width": W, "height": H, "background": names[bgs[i]]})
    annotations = []
    for a, p in enumerate(persons):
        j = p["joints"]
        annotations.append({
            "id": a + 1, "image_id": p["image"] + 1, "category_id": 1,
            "bbox": [float(v) for v in p["bbox"]], "area": float(p["area"]), "iscrowd": 0,
            "num_keypoints": int((j[:, 2] > 0).sum()),
            "keypoints": [float(v) for v in j.reshape(-1)],
            "head_box": [float(v) for v in p["head_box"]],
        })
    category = {
        "id": 1, "name": "person", "supercategory": "person", "keypoints": list(MPII16.joint_names),
        "skeleton": [[a + 1, b + 1] for a, b in MPII16.limbs],
    }
    doc = {
        "info": {"description": f"fedsight.data.figures: {n_images} generated images, seed {seed}, split {split_name}"},
        "images": coco_images, "annotations": annotations, "categories": [category],
    }
    tmp = ann.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(ann)
    return ann


def _parse_hw(text: str) -> tuple[int, int]:
    try:
        h, w = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--size {text!r}: expected HxW, e.g. 256x192") from None
    return h, w


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m fedsight.data.figures",
        description="Write generated articulated figures (MPII's 16 joints) as a COCO keypoint data set: "
                    "OUT/images/<split>/%06d.png and OUT/annotations/person_keypoints_<split>.json, loadable with "
                    "the coco_keypoints data set (train_json / train_images pointing there).",
    )
    ap.add_argument("out", type=Path, help="output folder")
    ap.add_argument("--images", type=int, default=100, help="number of images (default 100)")
    ap.add_argument("--size", type=_parse_hw, default=(256, 192), help="image size HxW (default 256x192)")
    ap.add_argument("--seed", type=int, default=0, help="random seed of the data (default 0)")
    ap.add_argument("--split", default="train", help="split name: folder and file suffix (default train)")
    ap.add_argument("--persons", type=int, default=1, help="figures per image, 1..3 (default 1)")
    ap.add_argument("--occlusion", type=float, default=0.3, help="probability of an occluder per person (default 0.3)")
    ap.add_argument("--force", action="store_true", help="overwrite an existing split")
    args = ap.parse_args(argv)
    try:
        path = write_coco(args.out, args.images, args.size, args.seed, args.split, persons_per_image=args.persons,
                          occlusion=args.occlusion, force=args.force)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
