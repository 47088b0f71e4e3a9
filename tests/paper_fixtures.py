"""Tiny on-disk datasets in the real layouts the paper presets read (``examples/paper/*.toml``), and the overrides
that point a preset at them (``tests/test_paper_presets.py``).

Each writer produces the few files its loader needs, in the published layout and file naming (REDS/Kinetics
frame folders, DIV2K and the EDSR benchmark layout, MPII in the HRNet layout, image folders, Hsu et al.'s GLDv2
and iNaturalist CSV splits, Cityscapes with FedDrive's LEAF split JSON, IDDAsmall with FedDrive's, GTA5 with LADD's
list); the loaders' own tests (tests/video, tests/imagesr,
tests/keypoints, tests/data) check the layouts in detail against hand-written expectations, these only need
to be readable. Pixels are random; sizes are a few dozen pixels so a task builds in well under a second.
``overrides(raw, root)`` returns the dotted-key overrides for one preset: its data paths replaced by the
fixture's, its clients cut to what the fixture holds, its ``[init]`` (published weights, absent in CI) removed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

RNG = np.random.default_rng(0)


def _png(path: Path, h: int, w: int, mode: str = "RGB", values: np.ndarray | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if mode == "L":
        arr = RNG.choice(values if values is not None else np.arange(256), size=(h, w)).astype(np.uint8)
    else:
        arr = RNG.integers(0, 256, (h, w, 3), dtype=np.uint8)
    Image.fromarray(arr, mode).save(path)


# -- video: REDS <root>/<clip>/<frame>.png, Kinetics <root>/<class>/<video>/<frame>.png ------------------------

def write_frames(clip: Path, frames: int = 4, h: int = 32, w: int = 32) -> None:
    for i in range(frames):
        _png(clip / f"{i:08d}.png", h, w)


def write_reds(root: Path) -> Path:
    """REDS train_sharp: REDS4 (000, 011, 015, 020) and four training clips."""
    for clip in ("000", "011", "015", "020", "001", "002", "003", "004"):
        write_frames(root / clip)
    return root


def write_kinetics(root: Path) -> Path:
    for cls in ("archery", "making_pizza"):
        for video in ("v0", "v1"):
            write_frames(root / cls / video)
    return root


# -- image SR: DIV2K_train_HR/NNNN.png; benchmarks <set>/HR/<name>.png + LR_bicubic/X<s>/<name>x<s>.png ----------

def write_div2k(root: Path, scales=(2, 3, 4)) -> Path:
    for k in range(1, 5):
        _png(root / "DIV2K_train_HR" / f"{k:04d}.png", 48, 48)
        for s in scales:
            _png(root / "DIV2K_train_LR_bicubic" / f"X{s}" / f"{k:04d}x{s}.png", 48 // s, 48 // s)
    return root


def write_benchmark(root: Path, scales=(2, 3, 4)) -> Path:
    for name in ("baby", "bird"):
        _png(root / "HR" / f"{name}.png", 36, 36)
        for s in scales:
            _png(root / "LR_bicubic" / f"X{s}" / f"{name}x{s}.png", 36 // s, 36 // s)
    return root


# -- keypoints: MPII in the HRNet/SimpleBaseline layout ---------------------------------------------------------

MPII_JOINTS = ["r_ankle", "r_knee", "r_hip", "l_hip", "l_knee", "l_ankle", "pelvis", "thorax", "upper_neck", "head_top",
               "r_wrist", "r_elbow", "r_shoulder", "l_shoulder", "l_elbow", "l_wrist"]


def write_mpii(root: Path, train: int = 6, valid: int = 3) -> Path:
    from scipy.io import savemat

    for name in ("a.jpg", "b.jpg"):
        _png(root / "images" / name, 120, 160)

    def entry(k: int) -> dict[str, Any]:
        joints = np.round(RNG.uniform(20, 100, (16, 2)), 2).tolist()
        return {"image": "ab"[k % 2] + ".jpg", "center": [80.0, 60.0], "scale": 0.4, "joints": joints,
                "joints_vis": [1] * 16}

    (root / "annot").mkdir(parents=True)
    (root / "annot" / "train.json").write_text(json.dumps([entry(k) for k in range(train)]))
    (root / "annot" / "valid.json").write_text(json.dumps([entry(k) for k in range(valid)]))
    heads = RNG.uniform(0, 100, (2, 2, valid))
    savemat(str(root / "annot" / "gt_valid.mat"), {
        "headboxes_src": heads, "jnt_missing": np.zeros((16, valid)), "pos_gt_src": np.zeros((16, 2, valid)),
        "dataset_joints": np.array(MPII_JOINTS, dtype=object)})
    return root


# -- classification: <dir>/<class>/<image>.png ----------------------------------------------------------------

def write_image_folder(root: Path, classes: int = 4, per_class: int = 6, size: int = 12) -> Path:
    for c in range(classes):
        for k in range(per_class):
            _png(root / f"class{c:02d}" / f"{k}.png", size, size)
    return root


def write_federated_csv(root: Path) -> tuple[Path, Path, Path]:
    """Hsu et al.'s CSV split (federated_train.csv: user_id, image_id, class; test.csv) over GLDv2's nested
    train/a/b/c/<id>.jpg tree: users u0 (6 images), u1 (5) and u2 (1, below a min_images of 2)."""
    rows = [(f"u{k % 2}", f"{'abcdef'[k % 6]}{k}{'fedcba'[k % 6]}{k}", 5 + 4 * (k % 3 == 0)) for k in range(11)]
    rows.append(("u2", "f6a5", 9))
    for _, image_id, _ in rows + [("", "a7f6", 5), ("", "b8e7", 9)]:
        _png(root / "train" / image_id[0] / image_id[1] / image_id[2] / f"{image_id}.jpg", 12, 12)
    train, test = root / "federated_train.csv", root / "test.csv"
    train.write_text("user_id,image_id,class\n" + "".join(f"{u},{i},{c}\n" for u, i, c in rows))
    test.write_text("image_id,class\na7f6,5\nb8e7,9\n")
    return root, train, test


def write_inat_csv(root: Path) -> tuple[Path, Path, Path]:
    """Hsu et al.'s iNaturalist split (federated_train_user_120k.csv: user_id, image_id, class, label; test.csv:
    image_id, class, label, as the release's inspect_splits.py parses them) over a flat folder of <image_id>.jpg
    (the preset's linked copy of iNaturalist 2017's train_val_images): users 17 (4 images) and 230 (3)."""
    rows = [("17", f"{k:032x}", k % 3, 2000 + k % 3) for k in range(4)] + \
           [("230", f"{100 + k:032x}", k % 2, 2000 + k % 2) for k in range(3)]
    tests = [(f"{900 + k:032x}", k % 3, 2000 + k % 3) for k in range(3)]
    for image_id in [r[1] for r in rows] + [t[0] for t in tests]:
        _png(root / "flat" / f"{image_id}.jpg", 12, 12)
    train, test = root / "federated_train_user_120k.csv", root / "test.csv"
    train.write_text("user_id,image_id,class,label\n" + "".join(f"{u},{i},{c},{lab}\n" for u, i, c, lab in rows))
    test.write_text("image_id,class,label\n" + "".join(f"{i},{c},{lab}\n" for i, c, lab in tests))
    return root / "flat", train, test


# -- segmentation: Cityscapes (+ FedDrive's LEAF JSON), GTA5 (+ LADD's list) -------------------------------------

CITYSCAPES_IDS = np.r_[np.arange(34), 255]


def _cs(split: str, city: str, k: int) -> str:
    return f"{split}/{city}/{city}_{k:06d}_000019_leftImg8bit.png"


def write_cityscapes(root: Path, h: int = 32, w: int = 64) -> Path:
    """Two training cities of 3 images and one validation city of 2."""
    for split, cities in (("train", {"aachen": 3, "bremen": 3}), ("val", {"frankfurt": 2})):
        for city, n in cities.items():
            for k in range(n):
                name = _cs(split, city, k)
                _png(root / "leftImg8bit" / name, h, w)
                _png(root / "gtFine" / name.replace("_leftImg8bit.png", "_gtFine_labelIds.png"), h, w, "L",
                     CITYSCAPES_IDS)
    return root


def write_feddrive_split(path: Path) -> Path:
    """FedDrive's LEAF-style split: one client per training city (the heterogeneous distribution)."""
    users = {f"{city}0": [_cs("train", city, k) for k in range(3)] for city in ("aachen", "bremen")}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "users": list(users), "num_samples": [len(v) for v in users.values()],
        "user_data": {u: {"x": xs, "y": [x.replace("_leftImg8bit.png", "_gtFine_labelIds.png") for x in xs]}
                      for u, xs in users.items()}}))
    return path


def write_gta5(root: Path, h: int = 32, w: int = 64, n: int = 6) -> Path:
    lines = []
    for k in range(1, n + 1):
        _png(root / "images" / f"{k:05d}.png", h, w)
        _png(root / "labels" / f"{k:05d}.png", h, w, "L", CITYSCAPES_IDS)
        lines.append(f"/images/{k:05d}.png /labels/{k:05d}.png")
    (root / "train.txt").write_text("\n".join(lines) + "\n")
    return root


IDDA_IDS = np.arange(0, 24)  # raw ids 0..23 (FedDrive's remap keeps 16 of them)


def write_idda(root: Path, h: int = 32, w: int = 64) -> tuple[Path, Path, Path]:
    """IDDAsmall's layout ``<T0k>_<W>_<V>/RGB/<n>_<scenario>.jpg`` and ``.../Semantic/<n>_<scenario>.png``, and
    FedDrive's heterogeneous split JSONs: one client per seen scenario (T01_CN_A, T01_CS_B; 3 images each), the
    test file's ``test_user_same_domain`` (one more image of each) and ``test_user_diff_domain`` (the rural town
    T07, 2 images). Returns (IDDAsmall root, train JSON, test JSON)."""
    def scenario(name: str, first: int, n: int) -> list[tuple[str, str]]:
        pairs = []
        for k in range(first, first + n):
            x, y = f"{name}/RGB/{k}_{name}.jpg", f"{name}/Semantic/{k}_{name}.png"
            (root / x).parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(RNG.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / x, quality=95)
            _png(root / y, h, w, "L", IDDA_IDS)
            pairs.append((x, y))
        return pairs

    def leaf(users: dict[str, list[tuple[str, str]]], path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"users": list(users), "num_samples": [len(v) for v in users.values()],
                                    "user_data": {u: {"x": [x for x, _ in v], "y": [y for _, y in v]}
                                                  for u, v in users.items()}}))
        return path

    train = {name: scenario(name, 100, 3) for name in ("T01_CN_A", "T01_CS_B")}
    same = scenario("T01_CN_A", 200, 1) + scenario("T01_CS_B", 200, 1)
    splits = root.parent / "splits"
    return (root, leaf(train, splits / "train" / "idda_by_city_country_train_clients.json"),
            leaf({"test_user_diff_domain": scenario("T07_CN_A", 300, 2), "test_user_same_domain": same},
                 splits / "test" / "idda_by_city_country_test_clients.json"))


# -- the overrides that point a preset at the fixture ----------------------------------------------------------

def overrides(raw: dict[str, Any], root: Path) -> dict[str, Any]:
    """Dotted-key overrides (the Python API's keyword arguments) that point the preset ``raw`` at a tiny
    fixture of its own layout written under ``root``, with as many clients as the fixture holds."""
    data, out = raw["data"], {}
    name = data["name"]
    clients = 2
    if name == "video_frames":
        if data.get("layout") == "categories":
            out["data.root"] = str(write_kinetics(root / "kinetics"))
            out["data.test_root"] = str(write_reds(root / "reds4"))
        else:
            out["data.root"] = str(write_reds(root / "REDS" / "train_sharp"))
        out.update({"data.num_frames": 3, "data.patch_size": 4})
    elif name == "div2k":
        out["data.root"] = str(write_div2k(root / "DIV2K"))
        out["data.test_sets"] = [str(write_benchmark(root / "benchmark" / "Set5"))]
        out["data.patch_size"] = 16  # rdsn_etc's U-Net pools 4 times at the authors' size: 16 LR pixels a side
    elif name == "mpii":
        out["data.root"] = str(write_mpii(root / "mpii"))
        clients = 3  # one per rung of the ladder
    elif name == "imagefolder":
        if data.get("test_dir"):
            out["data.train_dir"] = str(write_image_folder(root / "train"))
            out["data.test_dir"] = str(write_image_folder(root / "test", per_class=2))
        else:
            out["data.train_dir"] = str(write_image_folder(root / "all", per_class=16))
        out["data.image_size"] = 12
        out["data.test_fraction"] = 0.25 if not data.get("test_dir") else None
        if raw["partition"]["name"] == "classes":
            clients = 4  # one class each, as the preset
        out["partition.min_size"] = 1 if raw["partition"]["name"] == "dirichlet" else None
    elif name == "federated_csv" and "inaturalist" in data["train_csv"]:
        data_root, train, test = write_inat_csv(root / "inat")
        out.update({"data.root": str(data_root), "data.train_csv": str(train), "data.test_csv": str(test),
                    "data.min_images": 1, "data.image_size": 12, "data.workers": 0})
    elif name == "federated_csv":
        data_root, train, test = write_federated_csv(root / "gldv2")
        out.update({"data.root": str(data_root), "data.train_csv": str(train), "data.test_csv": str(test),
                    "data.min_images": 2, "data.image_size": 12, "data.workers": 0})
    elif name == "cityscapes":
        out["data.root"] = str(write_cityscapes(root / "cityscapes"))
        out["data.split_file"] = str(write_feddrive_split(root / "feddrive" / "all_data_0.json"))
        out["data.resize"] = [32, 64]     # the fixture's own size (the preset reads 512 x 1024)
        out["task.crop"] = [16, 32]
        out["task.workers"] = 0
        if isinstance(raw["task"].get("source"), dict):
            out["task.source"] = {**raw["task"]["source"], "root": str(write_gta5(root / "gta5")),
                                  "split_list": str(root / "gta5" / "train.txt")}
    elif name == "idda":
        idda_root, train, test = write_idda(root / "idda" / "IDDAsmall")
        out["data.root"] = str(idda_root)
        out["data.train_split"] = str(train)
        out["data.test_splits"] = {"seen": f"{test}#test_user_same_domain", "unseen": f"{test}#test_user_diff_domain"}
        out["data.resize"] = [32, 64]
        out["task.crop"] = [16, 32]
        out["task.workers"] = 0
    else:
        raise AssertionError(f"no fixture for data {name!r}: add one to tests/paper_fixtures.py")
    out = {k: v for k, v in out.items() if v is not None}
    out["partition.num_clients"] = clients
    out["server.clients_per_round"] = clients
    return out
