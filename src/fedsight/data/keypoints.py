"""Human keypoint data for top-down pose estimation: skeletons, person-instance containers and loaders.

Containers: :class:`Skeleton` (with :data:`MPII16` and :data:`COCO17`), :class:`KeypointSet` (person
instances) and :class:`KeypointSplits` (training pool plus named test sets) are defined, and described, in
``fedsight.data.keypoint_sets`` and re-exported here; COCO / MPII file parsing (:func:`load_coco_split`,
:func:`load_mpii_split`) is in ``fedsight.data.keypoint_files``.

Loaders (``fedsight.registry.DATASETS``, ``task="keypoints"``, ``factory(params, *, seed) ->
KeypointSplits``; local files only; a bad input raises a one-line error naming the file and field):

* ``coco_keypoints``: COCO keypoint JSON files (``person_keypoints_*.json``) and image folders, read as
  SimpleBaseline does (what is kept, the skeleton from the category's joint names, head sizes: see
  ``fedsight.data.keypoint_files``).
* ``mpii``: the HRNet / SimpleBaseline layout (``annot/{split}.json``, ``annot/gt_valid.mat``,
  ``images/``), see :func:`load_mpii`.
* ``builtin_pose``: generated articulated figures (``fedsight.data.figures``) in memory, see
  :func:`load_builtin_pose`.
"""

from __future__ import annotations

import re
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import numpy as np
from pydantic import Field, model_validator

from fedsight.data.figures import DEFAULT_BACKGROUNDS
from fedsight.data.keypoint_files import load_coco_split, load_mpii_split
from fedsight.data.keypoint_sets import (
    COCO17,
    MPII16,
    SC_BIAS,
    KeypointSet,
    KeypointSplits,
    Skeleton,
    _int_array,
    _stack,
    custom_skeleton,
    skeleton_from_names,
)
from fedsight.data.keypoint_sets import CUSTOM_SIGMA as CUSTOM_SIGMA
from fedsight.registry import DATASETS, Params

__all__ = [
    "COCO17",
    "MPII16",
    "KeypointSet",
    "KeypointSplits",
    "Skeleton",
    "custom_skeleton",
    "load_builtin_pose",
    "load_coco_keypoints",
    "load_mpii",
    "skeleton_from_names",
]


# ------------------------------------------------------------------------------------------------- COCO


class COCOKeypointParams(Params):
    root: str = Field(..., description="COCO folder holding the annotation files and the image folders")
    train_json: str = Field("annotations/person_keypoints_train2017.json", description="training annotations (relative to root)")
    test_json: str = Field("annotations/person_keypoints_val2017.json", description="test annotations (relative to root); the test set is named after it")
    train_images: str = Field("train2017", description="folder of the training images (relative to root)")
    test_images: str = Field("val2017", description="folder of the test images (relative to root)")
    padding: float = Field(1.25, gt=0, description="crop size = person box (w, h) x padding (SimpleBaseline 1.25)")
    min_keypoints: int = Field(1, ge=0, description="skip annotations with fewer labelled joints (v > 0)")
    max_instances: int | None = Field(None, ge=1, description="keep at most this many instances per split, in file order (smoke runs)")


def _resolve(root: Path, rel: str) -> Path:
    p = Path(rel)
    return p if p.is_absolute() else root / p


def _split_name(json_path: str) -> str:
    stem = Path(json_path).stem
    stem = stem[len("person_keypoints_"):] if stem.startswith("person_keypoints_") and len(stem) > 17 else stem
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", stem) or "test"


@DATASETS.register("coco_keypoints", params=COCOKeypointParams, task="keypoints",
                   help="COCO keypoint JSON + image folders (COCO 2017 person keypoints, or any skeleton)")
def load_coco_keypoints(params: COCOKeypointParams, *, seed: int = 0) -> KeypointSplits:
    root = Path(params.root)
    what = f"coco_keypoints {root}"
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: data.root folder not found (coco_keypoints)")
    kw = dict(padding=params.padding, min_keypoints=params.min_keypoints, max_instances=params.max_instances)
    train = load_coco_split(_resolve(root, params.train_json), _resolve(root, params.train_images), **kw)
    test = load_coco_split(_resolve(root, params.test_json), _resolve(root, params.test_images), **kw)
    return KeypointSplits(train, {_split_name(params.test_json): test}).check(what)


# ------------------------------------------------------------------------------------------------- MPII


class MPIIParams(Params):
    root: str = Field(..., description="MPII folder in the HRNet layout: annot/{split}.json, annot/gt_valid.mat, images/")
    train_split: str = Field("train", description="training annotations: annot/<train_split>.json")
    test_split: str = Field("valid", description="test annotations: annot/<test_split>.json (the 'valid' split takes its head boxes from annot/gt_valid.mat)")
    max_instances: int | None = Field(None, ge=1, description="keep at most this many instances per split, in file order (smoke runs)")


@DATASETS.register("mpii", params=MPIIParams, task="keypoints",
                   help="MPII Human Pose in the HRNet/SimpleBaseline layout (annot/*.json, annot/gt_valid.mat, images/)")
def load_mpii(params: MPIIParams, *, seed: int = 0) -> KeypointSplits:
    """MPII Human Pose as HRNet / SimpleBaseline read it.

    ``root/annot/<split>.json`` lists ``{image, center [x, y], scale s, joints [[x, y] x 16], joints_vis
    [16]}`` with MATLAB 1-based coordinates. As HRNet's ``lib/dataset/mpii.py``: when ``center[0] != -1``
    the centre moves down by ``15 s`` and ``s *= 1.25``; then 1 is subtracted from the centre and the
    joints. ``size = (200 s, 200 s)``; ``v = 2`` where ``joints_vis > 0``, else 0 (and x = y = 0).
    ``bbox``: the square of side ``200 s`` (the file's scale, before the 1.25) centred on the adjusted
    centre. ``area``: the box of the labelled joints (at least 1; MPII has no OKS area). ``image_id``: the
    running index of the image name within the split. ``head_size``: for the ``valid`` split, ``0.6 x``
    the diagonal of ``headboxes_src`` of ``root/annot/gt_valid.mat`` (``[2, 2, N]``, the valid instances in
    file order; HRNet's ``SC_BIAS``), NaN for other splits. Images: ``root/images/<image>``.
    """
    root = Path(params.root)
    what = f"mpii {root}"
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: data.root folder not found (mpii)")
    train = load_mpii_split(root, params.train_split, params.max_instances)
    test = load_mpii_split(root, params.test_split, params.max_instances)
    name = re.sub(r"[^A-Za-z0-9_.+-]", "_", params.test_split) or "test"
    return KeypointSplits(train, {name: test}).check(what)


# ------------------------------------------------------------------------------------------ built-in figures


class BuiltinPoseParams(Params):
    num_train: int = Field(600, ge=1, description="training images (persons_per_image instances each)",
                           json_schema_extra={"smoke": 96})
    num_test: int = Field(150, ge=1, description="test images", json_schema_extra={"smoke": 24})
    image_size: tuple[int, int] = Field((256, 192), description="[H, W] of the generated images (a portrait canvas, like top-down crops)")
    persons_per_image: int = Field(1, ge=1, le=3, description="figures per image, 1..3")
    occlusion: float = Field(0.3, ge=0, le=1, description="probability that a person gets an occluder in front of one of its joints")
    data_seed: int = Field(0, ge=0, description="seed of the generated data (the run seed plays no part)")
    backgrounds: tuple[str, ...] = Field(DEFAULT_BACKGROUNDS, description="photographs cut into backgrounds (label = photo index); people-free shipped photos by default")
    height_range: tuple[float, float] = Field((0.6, 0.95), description="figure box height (or width share) as a fraction of the image's")
    truncation: float = Field(0.1, ge=0, le=0.5, description="how far a figure's box may leave the image, as a fraction of its size")
    free_view: float = Field(0.25, ge=0, le=1, description="probability of a view from any direction (profiles, backs); else faces the camera +-60 deg")
    padding: float = Field(1.25, gt=0, description="crop size = person box (w, h) x padding")

    @model_validator(mode="after")
    def _check(self) -> "BuiltinPoseParams":
        from fedsight.data.photos import PHOTO_LOADERS

        if not self.backgrounds:
            raise ValueError("backgrounds must name at least one photograph")
        for name in self.backgrounds:
            if name not in PHOTO_LOADERS:
                raise ValueError(f"unknown background photo {name!r}; choose from: {', '.join(PHOTO_LOADERS)}")
        if len(set(self.backgrounds)) != len(self.backgrounds):
            raise ValueError("backgrounds lists a photograph twice")
        if min(self.image_size) < 32:
            raise ValueError(f"image_size = {list(self.image_size)}: both sides must be >= 32")
        lo, hi = self.height_range
        if not 0 < lo <= hi <= 1.5:
            raise ValueError(f"height_range = {list(self.height_range)} must satisfy 0 < low <= high <= 1.5")
        return self


def _figure_set(images: list, persons: list[dict], bgs: list[int], names: list[str], padding: float) -> KeypointSet:
    n = len(persons)
    box = _stack([p["bbox"] for p in persons], (4,), np.float32)
    hb = _stack([p["head_box"] for p in persons], (4,), np.float32)
    for im in images:
        im.setflags(write=False)
    img = _int_array([p["image"] for p in persons], n)
    return KeypointSet(
        skeleton=MPII16, images=images, image=img, image_id=img + 1,
        joints=_stack([p["joints"] for p in persons], (16, 3), np.float32),
        center=box[:, :2] + box[:, 2:] / 2, size=box[:, 2:] * padding,
        area=np.asarray([p["area"] for p in persons], dtype=np.float32), bbox=box,
        head_size=SC_BIAS * np.hypot(hb[:, 2] - hb[:, 0], hb[:, 3] - hb[:, 1]),
        labels=np.asarray([bgs[p["image"]] for p in persons], dtype=np.int64), class_names=list(names),
    )


@lru_cache(maxsize=2)
def _builtin_pose(key: str) -> KeypointSplits:
    from fedsight.data.figures import render_figures

    p = BuiltinPoseParams.model_validate_json(key)
    opts = dict(height_range=tuple(p.height_range), truncation=p.truncation, free_view=p.free_view)
    sets = []
    for stream, n in ((0, p.num_train), (1, p.num_test)):
        rng = np.random.default_rng([p.data_seed, stream])
        images, persons, bgs, names = render_figures(n, tuple(p.image_size), rng, p.persons_per_image, p.occlusion,
                                                     p.backgrounds, **opts)
        sets.append(_figure_set(images, persons, bgs, names, p.padding))
    return KeypointSplits(sets[0], {"figures": sets[1]}).check("builtin_pose")


@DATASETS.register("builtin_pose", params=BuiltinPoseParams, task="keypoints",
                   help="offline pose data: generated articulated figures (MPII joints) over shipped photographs")
def load_builtin_pose(params: BuiltinPoseParams, *, seed: int = 0) -> KeypointSplits:
    """Generated figures (``fedsight.data.figures``; MPII's 16 joints, head boxes for PCKh, COCO-style v)
    held in memory. Training images come from the stream ``default_rng([data_seed, 0])``, the test set
    ``figures`` from ``default_rng([data_seed, 1])``: the data depend on ``data_seed`` only, never on the
    run seed. Each person is one instance: ``bbox`` its silhouette's box, ``center`` / ``size`` the box's
    centre and ``(w, h) x padding``, ``area`` its visible pixels, ``head_size`` 0.6 x its head box's
    diagonal; its ``label`` is the background photograph's index (so ``classes`` partitioners give
    clients different scenes). Generated once per parameter set and process (an in-memory cache); the
    image arrays are read-only."""
    cached = _builtin_pose(params.model_dump_json())
    # fresh containers around the cached (read-only) arrays, so a caller's edits cannot reach the cache
    return KeypointSplits(replace(cached.train), {k: replace(v) for k, v in cached.tests.items()})
