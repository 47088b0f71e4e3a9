"""Keypoint data: containers, the COCO / MPII loaders on tiny fixtures, and the figure generator."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from PIL import Image

from fedsight.data import figures
from fedsight.data.keypoints import (
    COCO17,
    MPII16,
    KeypointSet,
    KeypointSplits,
    _builtin_pose,
    load_coco_split,
)
from fedsight.registry import DATASETS, build

COCO_NAMES = ["nose", "left_eye", "right_eye", "left_ear", "right_ear", "left_shoulder", "right_shoulder", "left_elbow",
              "right_elbow", "left_wrist", "right_wrist", "left_hip", "right_hip", "left_knee", "right_knee", "left_ankle",
              "right_ankle"]
# MPII joint order as documented (references.md): 0 r_ankle ... 15 l_wrist
MPII_NAMES = ["r_ankle", "r_knee", "r_hip", "l_hip", "l_knee", "l_ankle", "pelvis", "thorax", "upper_neck", "head_top",
              "r_wrist", "r_elbow", "r_shoulder", "l_shoulder", "l_elbow", "l_wrist"]


def one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    return msg


def _kp(J: int, labelled: dict[int, tuple[float, float, int]]) -> list[float]:
    out = [0.0] * (3 * J)
    for j, (x, y, v) in labelled.items():
        out[3 * j: 3 * j + 3] = [x, y, v]
    return out


def _write_image(path, h, w, seed):
    arr = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path)
    return arr


def _coco_doc(names, annotations, skeleton=None):
    return {
        "images": [{"id": 7, "file_name": "a.png", "width": 100, "height": 80},
                   {"id": 9, "file_name": "b.png", "width": 60, "height": 50}],
        "annotations": annotations,
        "categories": [{"id": 1, "name": "person", "supercategory": "person", "keypoints": names,
                        "skeleton": skeleton if skeleton is not None else [[1, 2]]}],
    }


@pytest.fixture
def coco_root(tmp_path):
    a = _write_image(tmp_path / "val" / "a.png", 80, 100, 0)
    b = _write_image(tmp_path / "val" / "b.png", 50, 60, 1)
    anns = [
        {"id": 1, "image_id": 7, "category_id": 1, "bbox": [10, 20, 30, 40], "area": 500.0, "iscrowd": 0,
         "num_keypoints": 3, "keypoints": _kp(17, {0: (20, 25, 2), 5: (15.5, 35.25, 1), 16: (30, 58, 2)})},
        {"id": 2, "image_id": 7, "category_id": 1, "bbox": [0, 0, 50, 50], "area": 900.0, "iscrowd": 1,
         "num_keypoints": 2, "keypoints": _kp(17, {0: (5, 5, 2), 1: (6, 6, 2)})},
        {"id": 3, "image_id": 9, "category_id": 1, "bbox": [5, 5, 20, 20], "area": 100.0, "iscrowd": 0,
         "num_keypoints": 0, "keypoints": [0] * 51},
        # sticks out of the 60 x 50 image: clipped to [50, 30, 10, 20]; no area -> the clipped box's
        {"id": 4, "image_id": 9, "category_id": 1, "bbox": [50, 30, 20, 30], "iscrowd": 0,
         "num_keypoints": 1, "keypoints": _kp(17, {9: (55, 40, 2)})},
    ]
    (tmp_path / "ann").mkdir()
    (tmp_path / "ann" / "val.json").write_text(json.dumps(_coco_doc(COCO_NAMES, anns)))
    return tmp_path, a, b


# ------------------------------------------------------------------------------------------------ COCO


def test_coco_loader_keeps_the_right_instances(coco_root):
    root, a, b = coco_root
    s = load_coco_split(root / "ann" / "val.json", root / "val")
    assert len(s) == 2  # the crowd annotation and the one without keypoints are skipped
    assert s.image_id.tolist() == [7, 9]
    assert s.skeleton is COCO17
    j = s.joints[0]
    assert j[0].tolist() == [20, 25, 2] and j[5].tolist() == [15.5, 35.25, 1] and j[16].tolist() == [30, 58, 2]
    assert (j[[1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], 2] == 0).all()
    assert s.joints[1, 9].tolist() == [55, 40, 2]
    # centre = box centre, size = 1.25 x box (SimpleBaseline _box2cs without the aspect fix)
    np.testing.assert_allclose(s.center, [[10 + 15, 20 + 20], [55, 40]])
    np.testing.assert_allclose(s.size, [[1.25 * 30, 1.25 * 40], [1.25 * 10, 1.25 * 20]])
    np.testing.assert_allclose(s.bbox, [[10, 20, 30, 40], [50, 30, 10, 20]])
    np.testing.assert_allclose(s.area, [500, 10 * 20])
    assert np.isnan(s.head_size).all()
    np.testing.assert_array_equal(s.read_image(0), a)
    np.testing.assert_array_equal(s.read_image(1), b)
    assert s.labels.tolist() == [0, 0]


def test_coco_loader_options(coco_root):
    root, _, _ = coco_root
    assert len(load_coco_split(root / "ann" / "val.json", root / "val", min_keypoints=2)) == 1  # 1 labelled joint < 2
    assert len(load_coco_split(root / "ann" / "val.json", root / "val", max_instances=1)) == 1
    s = load_coco_split(root / "ann" / "val.json", root / "val", padding=1.0)
    np.testing.assert_allclose(s.size[0], [30, 40])


def test_coco_registered_loader(coco_root):
    root, _, _ = coco_root
    params = {"root": str(root), "train_json": "ann/val.json", "test_json": "ann/val.json", "train_images": "val",
              "test_images": "val"}
    assert DATASETS.get("coco_keypoints").task == "keypoints"
    splits = build(DATASETS, "coco_keypoints", params, seed=0)
    assert isinstance(splits, KeypointSplits)
    assert list(splits.tests) == ["val"] and len(splits.train) == 2


def test_coco_sigmas_match_pycocotools():
    from pycocotools.cocoeval import Params

    np.testing.assert_allclose(COCO17.sigmas, Params(iouType="keypoints").kpt_oks_sigmas)
    # the 1-based COCO skeleton of person_keypoints_*.json, made 0-based
    coco_skeleton = [[16, 14], [14, 12], [17, 15], [15, 13], [12, 13], [6, 12], [7, 13], [6, 7], [6, 8], [7, 9], [8, 10],
                     [9, 11], [2, 3], [1, 2], [1, 3], [2, 4], [3, 5], [4, 6], [5, 7]]
    assert [tuple(p) for p in COCO17.limbs] == [(a - 1, b - 1) for a, b in coco_skeleton]


def _load_names(tmp_path, names, skeleton=None):
    _write_image(tmp_path / "img" / "a.png", 80, 100, 0)
    J = len(names)
    ann = [{"id": 1, "image_id": 7, "category_id": 1, "bbox": [10, 10, 40, 40], "area": 100.0, "iscrowd": 0,
            "keypoints": _kp(J, {0: (20, 20, 2)})}]
    path = tmp_path / "k.json"
    path.write_text(json.dumps(_coco_doc(names, ann, skeleton)))
    return load_coco_split(path, tmp_path / "img")


def test_skeleton_detection(tmp_path):
    assert _load_names(tmp_path, COCO_NAMES).skeleton is COCO17
    mpii = _load_names(tmp_path, MPII_NAMES).skeleton
    assert mpii is MPII16
    assert set(mpii.flip_pairs) == {(0, 5), (1, 4), (2, 3), (10, 15), (11, 14), (12, 13)}
    assert mpii.pckh_exclude == (6, 7)
    long_names = [n.replace("r_", "right_").replace("l_", "left_") if n[:2] in ("r_", "l_") else n for n in MPII_NAMES]
    assert _load_names(tmp_path, long_names).skeleton is MPII16
    custom = _load_names(tmp_path, ["head", "left_hand", "right_hand", "L_foot", "r_foot", "tail"], [[1, 2], [1, 3], [5, 6]]).skeleton
    assert custom.name == "custom" and custom.num_joints == 6
    assert {tuple(sorted(p)) for p in custom.flip_pairs} == {(1, 2), (3, 4)}
    assert custom.limbs == ((0, 1), (0, 2), (4, 5))
    assert custom.sigmas == (0.05,) * 6
    # COCO's names in another order are not COCO17 (sigmas are per position)
    assert _load_names(tmp_path, COCO_NAMES[::-1]).skeleton.name == "custom"


# ------------------------------------------------------------------------------------------------- MPII


def _mpii_entry(image, center, scale, joints, vis):
    return {"image": image, "center": center, "scale": scale, "joints": joints, "joints_vis": vis}


@pytest.fixture
def mpii_root(tmp_path):
    rng = np.random.default_rng(0)
    for name in ("x.jpg", "y.jpg"):
        _write_image(tmp_path / "images" / name, 120, 160, 3)

    def joints():
        return np.round(rng.uniform(1, 100, (16, 2)), 2).tolist()

    vis = [1] * 16
    vis[3] = 0
    train = [_mpii_entry("x.jpg", [80.0, 60.0], 0.5, joints(), vis), _mpii_entry("y.jpg", [-1, -1], 0.4, joints(), [1] * 16)]
    valid = [_mpii_entry("x.jpg", [50.0, 40.0], 0.3, joints(), [1] * 16), _mpii_entry("y.jpg", [70.5, 65.0], 0.6, joints(), vis),
             _mpii_entry("x.jpg", [90.0, 30.0], 0.25, joints(), [1] * 16)]
    (tmp_path / "annot").mkdir()
    (tmp_path / "annot" / "train.json").write_text(json.dumps(train))
    (tmp_path / "annot" / "valid.json").write_text(json.dumps(valid))
    headboxes = rng.uniform(0, 100, (2, 2, 3))
    _write_mat(tmp_path, headboxes, 3)
    return tmp_path, train, valid, headboxes


def _write_mat(root, headboxes, n):
    from scipy.io import savemat

    savemat(str(root / "annot" / "gt_valid.mat"), {
        "headboxes_src": headboxes, "jnt_missing": np.zeros((16, n)), "pos_gt_src": np.zeros((16, 2, n)),
        "dataset_joints": np.array(MPII_NAMES, dtype=object),
    })


def test_mpii_loader(mpii_root):
    root, train, _, headboxes = mpii_root
    splits = build(DATASETS, "mpii", {"root": str(root)}, seed=0)
    tr, va = splits.train, splits.tests["valid"]
    assert tr.skeleton is MPII16 and len(tr) == 2 and len(va) == 3
    # 1-based -> 0-based joints; v = 2 where joints_vis > 0, else 0 with x = y = 0
    e = train[0]
    expect = np.array(e["joints"]) - 1
    expect[3] = 0
    np.testing.assert_allclose(tr.joints[0, :, :2], expect, rtol=0, atol=1e-4)
    assert tr.joints[0, :, 2].tolist() == [2 if v else 0 for v in e["joints_vis"]]
    # HRNet: c[1] += 15 s, s *= 1.25 (when c[0] != -1), then the centre also becomes 0-based
    np.testing.assert_allclose(tr.center[0], [80 - 1, 60 + 15 * 0.5 - 1], atol=1e-5)
    np.testing.assert_allclose(tr.size[0], [200 * 0.5 * 1.25] * 2, atol=1e-4)
    np.testing.assert_allclose(tr.center[1], [-2, -2])  # centre -1: no adjustment
    np.testing.assert_allclose(tr.size[1], [80, 80], atol=1e-4)
    # head sizes: 0.6 x the head box diagonal, valid split only
    diag = np.sqrt(((headboxes[1] - headboxes[0]) ** 2).sum(0))
    np.testing.assert_allclose(va.head_size, 0.6 * diag, rtol=1e-5)
    assert np.isnan(tr.head_size).all()
    # instances of one image share it
    assert va.image.tolist() == [0, 1, 0] and va.image_id.tolist() == [0, 1, 0]
    assert va.read_image(2).shape == (120, 160, 3)
    capped = build(DATASETS, "mpii", {"root": str(root), "max_instances": 2}, seed=0).tests["valid"]
    np.testing.assert_allclose(capped.head_size, 0.6 * diag[:2], rtol=1e-5)


# ----------------------------------------------------------------------------------------------- errors


def test_errors_are_one_line_and_name_the_file(coco_root, mpii_root, tmp_path):
    root, _, _ = coco_root
    missing = root / "ann" / "nope.json"
    with pytest.raises(FileNotFoundError) as e:
        load_coco_split(missing, root / "val")
    assert str(missing) in one_line(e)

    doc = json.loads((root / "ann" / "val.json").read_text())
    doc["annotations"][0]["id"] = 17
    doc["annotations"][0]["keypoints"] = doc["annotations"][0]["keypoints"][:48]
    bad = root / "ann" / "person_keypoints_val2017.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(ValueError) as e:
        load_coco_split(bad, root / "val")
    assert one_line(e) == f"annotation 17 in {bad}: keypoints has 48 values, expected 3 x 17"

    (root / "val" / "b.png").unlink()
    with pytest.raises(FileNotFoundError) as e:
        load_coco_split(root / "ann" / "val.json", root / "val")
    assert str(root / "val" / "b.png") in one_line(e)

    mroot, _, _, headboxes = mpii_root
    _write_mat(mroot, headboxes[..., :2], 2)  # the valid split has 3 instances
    with pytest.raises(ValueError) as e:
        build(DATASETS, "mpii", {"root": str(mroot)}, seed=0)
    msg = one_line(e)
    assert "gt_valid.mat" in msg and "valid.json" in msg and "2" in msg and "3" in msg

    entries = json.loads((mroot / "annot" / "train.json").read_text())
    entries[1]["joints"] = entries[1]["joints"][:15]
    (mroot / "annot" / "train.json").write_text(json.dumps(entries))
    with pytest.raises(ValueError) as e:
        build(DATASETS, "mpii", {"root": str(mroot)}, seed=0)
    assert "entry 1" in one_line(e) and "train.json" in str(e.value) and "joints" in str(e.value)

    with pytest.raises(FileNotFoundError) as e:
        build(DATASETS, "mpii", {"root": str(tmp_path / "absent")}, seed=0)
    assert "absent" in one_line(e)


def test_keypoint_set_validates_shapes():
    n = 2
    ok = dict(skeleton=MPII16, images=[np.zeros((4, 4, 3), np.uint8)], image=np.zeros(n), image_id=np.zeros(n),
              joints=np.zeros((n, 16, 3)), center=np.ones((n, 2)), size=np.ones((n, 2)), area=np.ones(n),
              bbox=np.ones((n, 4)), head_size=np.ones(n), labels=np.zeros(n), class_names=["a"])
    s = KeypointSet(**ok)
    assert len(s) == 2 and len(s.subset([1])) == 1 and len(s.subset(np.array([True, False]))) == 1
    with pytest.raises(ValueError) as e:
        KeypointSet(**{**ok, "joints": np.zeros((n, 17, 3))})
    assert "joints" in one_line(e)
    with pytest.raises(ValueError) as e:
        KeypointSet(**{**ok, "image": np.array([0, 1])})
    assert "image indices" in one_line(e)


# -------------------------------------------------------------------------------------------- generator


HW = (96, 72)


def test_write_coco_round_trip(tmp_path):
    for split, seed in (("train", 3), ("val", 4)):
        figures.write_coco(tmp_path, 5, HW, seed, split, persons_per_image=2, occlusion=0.6)
    params = {"root": str(tmp_path), "train_json": "annotations/person_keypoints_train.json",
              "test_json": "annotations/person_keypoints_val.json", "train_images": "images/train", "test_images": "images/val"}
    splits = build(DATASETS, "coco_keypoints", params, seed=0)
    s = splits.train
    assert s.skeleton is MPII16 and list(splits.tests) == ["val"]
    images, persons, _, _ = figures.render_figures(5, HW, np.random.default_rng(3), 2, 0.6)
    assert len(s) == len(persons) == 10
    np.testing.assert_allclose(s.joints, np.stack([p["joints"] for p in persons]), atol=1e-4)
    hb = np.stack([p["head_box"] for p in persons])
    np.testing.assert_allclose(s.head_size, 0.6 * np.hypot(hb[:, 2] - hb[:, 0], hb[:, 3] - hb[:, 1]), rtol=1e-5)
    np.testing.assert_allclose(s.area, [p["area"] for p in persons])
    for i in (0, 3, 9):
        np.testing.assert_array_equal(s.read_image(i), images[persons[i]["image"]])


def test_limb_lengths_are_anatomical():
    _, persons, _, _ = figures.render_figures(40, (128, 96), np.random.default_rng(7), 1, 0.0)
    for p in persons:
        H, j3, j = p["height"], p["joints_3d"].astype(np.float64), p["joints"]
        assert 20 < H < 200
        for name, (pairs, nominal) in figures.SEGMENTS.items():
            var = figures.WIDTH_VARIATION if name in ("shoulder_width", "hip_width") else figures.SEGMENT_VARIATION
            for a, b in pairs:
                length3 = np.linalg.norm(j3[a] - j3[b]) / H
                assert nominal * (1 - var) - 1e-4 <= length3 <= nominal * (1 + var) + 1e-4, (name, length3)
                length2 = np.linalg.norm(j3[a, :2] - j3[b, :2]) / H
                assert length2 <= length3 + 1e-5  # a projection never lengthens
        lab = j[:, 2] > 0
        np.testing.assert_allclose(j[lab, :2], p["joints_3d"][lab, :2], atol=1e-4)
    # independent anthropometric sanity (Winter: thigh 0.245 H, shin 0.246 H, upper arm 0.186 H, forearm 0.146 H)
    for (a, b), (lo, hi) in (((2, 1), (0.2, 0.3)), ((1, 0), (0.2, 0.3)), ((12, 11), (0.15, 0.22)), ((11, 10), (0.12, 0.18))):
        ratios = [np.linalg.norm(p["joints_3d"][a] - p["joints_3d"][b]) / p["height"] for p in persons]
        assert lo < min(ratios) and max(ratios) < hi


def test_occluded_joints_are_really_covered():
    rng_args = dict(n_images=25, image_hw=(128, 96), persons_per_image=2)
    im0, p0, bg0, _ = figures.render_figures(rng=np.random.default_rng(11), occlusion=0.0, **rng_args)
    im1, p1, bg1, _ = figures.render_figures(rng=np.random.default_rng(11), occlusion=1.0, **rng_args)
    assert bg0 == bg1
    newly = 0
    for a, b in zip(p0, p1, strict=True):
        np.testing.assert_array_equal(a["joints_3d"], b["joints_3d"])  # same figures; only occluders added
        va, vb = a["joints"][:, 2], b["joints"][:, 2]
        assert ((va == 0) == (vb == 0)).all() and (vb <= va).all()
        for j in range(16):
            if vb[j] == 0:
                continue
            x, y = (int(round(float(c))) for c in b["joints"][j, :2])
            same = (im0[a["image"]][y, x] == im1[b["image"]][y, x]).all()
            if vb[j] == 2:
                assert same  # visible joints show their own limb: nothing was drawn over them
            elif va[j] == 2:
                assert not same  # hidden by an occluder: the pixel at the joint changed
                newly += 1
    assert newly > 5


def test_joints_outside_the_image_are_unlabelled():
    H, W = 96, 72
    _, persons, _, _ = figures.render_figures(30, (H, W), np.random.default_rng(5), 1, 0.0, height_range=(0.9, 1.3), truncation=0.5)
    outside = 0
    for p in persons:
        xy = p["joints_3d"][:, :2]
        out = (xy[:, 0] < 0) | (xy[:, 0] > W - 1) | (xy[:, 1] < 0) | (xy[:, 1] > H - 1)
        assert ((p["joints"][:, 2] == 0) == out).all()
        assert (p["joints"][out, :2] == 0).all()
        outside += int(out.sum())
    assert outside > 10


def test_generator_is_deterministic():
    a = figures.render_figures(4, HW, np.random.default_rng(1), 2, 0.5)
    b = figures.render_figures(4, HW, np.random.default_rng(1), 2, 0.5)
    c = figures.render_figures(4, HW, np.random.default_rng(2), 2, 0.5)
    for x, y in zip(a[0], b[0], strict=True):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(np.stack([p["joints"] for p in a[1]]), np.stack([p["joints"] for p in b[1]]))
    assert not np.array_equal(np.stack(a[0]), np.stack(c[0]))
    assert not np.array_equal(np.stack([p["joints"] for p in a[1]]), np.stack([p["joints"] for p in c[1]]))
    # the first images do not depend on how many follow
    d = figures.render_figures(2, HW, np.random.default_rng(1), 2, 0.5)
    np.testing.assert_array_equal(d[0][1], a[0][1])


def test_builtin_pose_dataset():
    params = {"num_train": 6, "num_test": 3, "image_size": [96, 72], "persons_per_image": 2, "data_seed": 4}
    assert DATASETS.get("builtin_pose").task == "keypoints"
    _builtin_pose.cache_clear()
    s0 = build(DATASETS, "builtin_pose", params, seed=0)
    _builtin_pose.cache_clear()
    s5 = build(DATASETS, "builtin_pose", params, seed=5)  # generated afresh with another run seed
    assert isinstance(s0, KeypointSplits) and s0 is not s5
    assert len(s0.train) == 12 and len(s0.tests["figures"]) == 6 and len(s0.train.images) == 6
    assert s0.train.skeleton is MPII16
    for a, b in ((s0.train, s5.train), (s0.tests["figures"], s5.tests["figures"])):
        np.testing.assert_array_equal(a.joints, b.joints)
        np.testing.assert_array_equal(np.stack(a.images), np.stack(b.images))
    s = s0.train
    assert s.read_image(0).shape == (96, 72, 3)
    assert s.labels.max() < len(s.class_names) and s.class_names == list(figures.DEFAULT_BACKGROUNDS)
    np.testing.assert_allclose(s.center, s.bbox[:, :2] + s.bbox[:, 2:] / 2, atol=1e-4)
    np.testing.assert_allclose(s.size, 1.25 * s.bbox[:, 2:], atol=1e-4)
    assert np.isfinite(s.head_size).all() and (s.head_size > 0).all()
    other = build(DATASETS, "builtin_pose", {**params, "data_seed": 5}, seed=0)
    assert not np.array_equal(other.train.joints, s.joints)
    again = build(DATASETS, "builtin_pose", params, seed=1)  # cached: the same arrays in new containers
    assert again.train.images[0] is s5.train.images[0] and again.train is not s5.train


def test_write_coco_refuses_to_overwrite(tmp_path, capsys):
    ann = figures.write_coco(tmp_path, 2, HW, 0, "val")
    first = json.loads(ann.read_text())
    assert len(first["images"]) == 2 and first["categories"][0]["keypoints"] == MPII_NAMES
    assert all(len(a["keypoints"]) == 48 and len(a["head_box"]) == 4 for a in first["annotations"])
    with pytest.raises(FileExistsError) as e:
        figures.write_coco(tmp_path, 3, HW, 1, "val")
    assert str(ann) in one_line(e)
    assert json.loads(ann.read_text()) == first  # untouched
    assert figures.main([str(tmp_path), "--images", "3", "--size", "96x72", "--split", "val"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--force" in err
    assert figures.main([str(tmp_path), "--images", "3", "--size", "96x72", "--split", "val", "--force"]) == 0
    assert len(json.loads(ann.read_text())["images"]) == 3
    assert sorted(p.name for p in (tmp_path / "images" / "val").iterdir()) == ["000001.png", "000002.png", "000003.png"]
    # an image folder with files but no annotation file is refused too
    (tmp_path / "images" / "other").mkdir()
    (tmp_path / "images" / "other" / "x.txt").write_text("x")
    with pytest.raises(FileExistsError):
        figures.write_coco(tmp_path, 1, HW, 0, "other")
    assert math.isfinite(first["annotations"][0]["area"])
