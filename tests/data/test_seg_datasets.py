"""Segmentation dataset loaders (Cityscapes, FedDrive split files, IDDA, GTA5) on tiny fixtures in the real layouts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import fedsight.data.pipeline as pipeline_mod
import fedsight.data.segmentation as segmentation_mod
from fedsight.data import seg_datasets as sd  # importing registers the loaders (once per process)
from fedsight.data.pipeline import FileImageStore
from fedsight.registry import DATASETS, build

# Independent, hand-written expectations (deliberately not the module's constants).
CITYSCAPES_TRAIN_ID = {
    7: 0, 8: 1, 11: 2, 12: 3, 13: 4, 17: 5, 19: 6, 20: 7, 21: 8, 22: 9, 23: 10, 24: 11, 25: 12, 26: 13,
    27: 14, 28: 15, 31: 16, 32: 17, 33: 18,
}  # fmt: skip
CROSSCITY_TRAIN_ID = {7: 0, 8: 1, 11: 2, 19: 3, 20: 4, 21: 5, 23: 6, 24: 7, 25: 8, 26: 9, 28: 10, 32: 11, 33: 12}
H, W = 16, 32


def _expect(ids: np.ndarray, table: dict[int, int]) -> np.ndarray:
    out = np.full(ids.shape, 255, dtype=np.uint8)
    for src, dst in table.items():
        out[ids == src] = dst
    return out


def _idda_expect(ids: np.ndarray) -> np.ndarray:
    return np.where((ids >= 1) & (ids <= 23), ids.astype(np.int64) - 1, 255).astype(np.uint8)


def _save(path: Path, arr: np.ndarray, mode: str | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr, mode).save(path) if mode else Image.fromarray(arr).save(path)


def _ids(rng: np.random.Generator, values: np.ndarray, shape: tuple[int, int] = (H, W)) -> np.ndarray:
    """A label map holding every one of ``values`` (shuffled)."""
    return rng.permutation(np.resize(values, shape[0] * shape[1])).reshape(shape).astype(np.uint8)


# ------------------------------------------------------------------------------------------- cityscapes

CITIES = {"train": {"bremen": 2, "aachen": 3}, "val": {"frankfurt": 2}}
CS_IDS = np.r_[np.arange(34), 255]


def _cs_name(split: str, city: str, k: int) -> str:
    return f"{split}/{city}/{city}_{k:06d}_000019_leftImg8bit.png"


def _cs_label(name: str) -> str:
    return name.replace("_leftImg8bit.png", "_gtFine_labelIds.png")


@pytest.fixture
def cityscapes(tmp_path: Path) -> tuple[Path, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """root and {relative image path: (RGB pixels, labelIds)}; every labelId 0..33 and 255 occurs in every map."""
    rng = np.random.default_rng(0)
    root, files = tmp_path / "cityscapes", {}
    for split, cities in CITIES.items():
        for city, n in cities.items():
            for k in range(n):
                name = _cs_name(split, city, k)
                img, ids = rng.integers(0, 256, (H, W, 3), dtype=np.uint8), _ids(rng, CS_IDS)
                _save(root / "leftImg8bit" / name, img)
                _save(root / "gtFine" / _cs_label(name), ids, "L")
                files[name] = (img, ids)
    (root / "leftImg8bit" / "train" / "aachen" / "notes.txt").write_text("not an image")
    return root, files


def test_loaders_are_registered_for_segmentation() -> None:
    for name in ("cityscapes", "idda", "gta5"):
        assert DATASETS.get(name).task == "segmentation"


def test_cityscapes_train_ids_domains_and_names(cityscapes) -> None:
    root, files = cityscapes
    data = build(DATASETS, "cityscapes", {"root": str(root)}, seed=3)
    want_train = [_cs_name("train", c, k) for c, n in (("aachen", 3), ("bremen", 2)) for k in range(n)]
    want_test = [_cs_name("val", "frankfurt", k) for k in range(2)]
    assert data.train.names == want_train and data.tests["test"].names == want_test
    assert set(data.tests) == {"test"} and data.clients is None and data.client_names is None
    assert data.domain_names == ["aachen", "bremen", "frankfurt"]
    assert data.train.domains.tolist() == [0, 0, 0, 1, 1] and data.tests["test"].domains.tolist() == [2, 2]
    assert data.num_classes == 19 and data.class_names[0] == "road" and data.class_names[18] == "bicycle"
    for split in (data.train, data.tests["test"]):
        for i, name in enumerate(split.names):
            img, ids = files[name]
            got = split.labels.get_one(i).numpy()
            assert got.dtype == np.uint8 and got.shape == (H, W)
            np.testing.assert_array_equal(got, _expect(ids, CITYSCAPES_TRAIN_ID))
            np.testing.assert_array_equal(split.images.get_one(i).numpy(), img.transpose(2, 0, 1))
    # the fixture really exercises every id: all 19 train ids and the ignore value occur
    assert set(np.unique(data.train.labels.get_one(0).numpy())) == set(range(19)) | {255}


def test_cityscapes_cities_filter(cityscapes) -> None:
    root, _ = cityscapes
    data = build(DATASETS, "cityscapes", {"root": str(root), "cities": ["bremen"]}, seed=0)
    assert data.train.names == [_cs_name("train", "bremen", k) for k in range(2)]
    assert data.domain_names == ["bremen", "frankfurt"] and data.train.domains.tolist() == [0, 0]
    with pytest.raises(FileNotFoundError, match="paris"):
        build(DATASETS, "cityscapes", {"root": str(root), "cities": ["paris"]}, seed=0)
    with pytest.raises(FileNotFoundError, match="leftImg8bit"):
        build(DATASETS, "cityscapes", {"root": str(root / "nowhere")}, seed=0)


def test_loading_reads_headers_only(cityscapes, monkeypatch) -> None:
    root, _ = cityscapes

    def boom(*args, **kwargs):
        raise AssertionError("decoded at load time")

    monkeypatch.setattr(pipeline_mod, "load_image", boom)
    monkeypatch.setattr(segmentation_mod, "load_label", boom)
    data = build(DATASETS, "cityscapes", {"root": str(root)}, seed=0)
    assert len(data.train) == 5
    with pytest.raises(AssertionError, match="decoded"):
        data.train.labels.get_one(0)


# ------------------------------------------------------------------------------------------ split files


def _leaf(path: Path, users: dict[str, list[str]], num_samples: list[int] | None = None) -> Path:
    data = {
        "users": list(users),
        "num_samples": num_samples if num_samples is not None else [len(v) for v in users.values()],
        "user_data": {u: {"x": xs, "y": [_cs_label(x) for x in xs]} for u, xs in users.items()},
    }
    path.write_text(json.dumps(data))
    return path


SPLIT = {
    "bremen0": [_cs_name("train", "bremen", 1), _cs_name("train", "bremen", 0)],
    "aachen0": [_cs_name("train", "aachen", 2)],
    "aachen1": [_cs_name("train", "aachen", 0), _cs_name("train", "aachen", 1)],
}


def test_feddrive_split_file_fixes_clients_and_pool_order(cityscapes, tmp_path) -> None:
    root, files = cityscapes
    split = _leaf(tmp_path / "train.json", SPLIT)
    test = _leaf(tmp_path / "test.json", {"test_user": [_cs_name("val", "frankfurt", 1)]})
    data = build(DATASETS, "cityscapes", {"root": str(root), "split_file": str(split), "test_file": str(test)}, seed=0)
    assert data.client_names == ["bremen0", "aachen0", "aachen1"]
    assert data.train.names == [x for xs in SPLIT.values() for x in xs]
    assert [c.tolist() for c in data.clients] == [[0, 1], [2], [3, 4]]
    assert data.domain_names == ["aachen", "bremen", "frankfurt"]
    assert data.train.domains.tolist() == [1, 1, 0, 0, 0]
    assert data.tests["test"].names == [_cs_name("val", "frankfurt", 1)] and data.tests["test"].domains.tolist() == [2]
    for i, name in enumerate(data.train.names):
        want = _expect(files[name][1], CITYSCAPES_TRAIN_ID)
        np.testing.assert_array_equal(data.train.labels.get_one(i).numpy(), want)
    # several shards (FedDrive's all_data_k.json) are read file after file; "path#user" picks one user
    shard = _leaf(tmp_path / "shard.json", {"bremen9": [_cs_name("train", "bremen", 0)]})
    data = build(DATASETS, "cityscapes", {"root": str(root), "split_file": [str(shard), f"{split}#aachen0"]}, seed=0)
    assert data.client_names == ["bremen9", "aachen0"] and [c.tolist() for c in data.clients] == [[0], [1]]
    assert data.train.names == [_cs_name("train", "bremen", 0), _cs_name("train", "aachen", 2)]
    with pytest.raises(ValueError, match="nobody"):
        build(DATASETS, "cityscapes", {"root": str(root), "split_file": f"{split}#nobody"}, seed=0)
    with pytest.raises(ValueError, match="cities and split_file"):
        build(DATASETS, "cityscapes", {"root": str(root), "split_file": str(split), "cities": ["aachen"]}, seed=0)


def test_read_leaf_split_returns_users_and_pairs(cityscapes, tmp_path) -> None:
    root, _ = cityscapes
    split = _leaf(tmp_path / "s.json", SPLIT)
    users, pairs = sd.read_leaf_split(split, root / "leftImg8bit", root / "gtFine")
    assert users == list(SPLIT)
    assert pairs == [[(x, _cs_label(x)) for x in xs] for xs in SPLIT.values()]


def test_bad_split_files_name_the_user_and_the_file(cityscapes, tmp_path) -> None:
    root, _ = cityscapes
    bad = _leaf(tmp_path / "counts.json", SPLIT, num_samples=[2, 2, 2])
    with pytest.raises(ValueError, match=r"counts\.json.*'aachen0'.*num_samples 2"):
        build(DATASETS, "cityscapes", {"root": str(root), "split_file": str(bad)}, seed=0)
    missing = _leaf(tmp_path / "missing.json", {**SPLIT, "bremen1": [_cs_name("train", "bremen", 7)]})
    with pytest.raises(FileNotFoundError, match=r"missing\.json.*'bremen1'.*bremen_000007_000019_leftImg8bit"):
        build(DATASETS, "cityscapes", {"root": str(root), "split_file": str(missing)}, seed=0)
    # the label map listed in y is missing (the image exists)
    (root / "gtFine" / _cs_label(_cs_name("train", "aachen", 2))).unlink()
    with pytest.raises(FileNotFoundError, match=r"'aachen0'.*aachen_000002_000019_gtFine_labelIds"):
        sd.read_leaf_split(_leaf(tmp_path / "s.json", SPLIT), root / "leftImg8bit", root / "gtFine")
    uneven = json.loads((tmp_path / "s.json").read_text())
    uneven["user_data"]["aachen1"]["y"].pop()
    (tmp_path / "uneven.json").write_text(json.dumps(uneven))
    with pytest.raises(ValueError, match=r"'aachen1'.*2 images \(x\) and 1 label maps"):
        sd.read_leaf_split(tmp_path / "uneven.json")
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"broken\.json"):
        sd.read_leaf_split(tmp_path / "broken.json")


# ----------------------------------------------------------------------------------- load-time checks


def test_image_without_label_fails_naming_it(cityscapes) -> None:
    root, _ = cityscapes
    label = root / "gtFine" / _cs_label(_cs_name("train", "bremen", 1))
    label.unlink()
    match = r"bremen_000001_000019_gtFine_labelIds\.png.*bremen_000001_000019_leftImg8bit"
    with pytest.raises(FileNotFoundError, match=match):
        build(DATASETS, "cityscapes", {"root": str(root)}, seed=0)


def test_label_of_another_size_fails_naming_both_files(cityscapes) -> None:
    root, _ = cityscapes
    name = _cs_name("val", "frankfurt", 0)
    _save(root / "gtFine" / _cs_label(name), np.zeros((H, W - 2), dtype=np.uint8), "L")
    match = r"frankfurt_000000_000019_leftImg8bit\.png.*32x16.*frankfurt_000000_000019_gtFine_labelIds\.png.*30x16"
    with pytest.raises(ValueError, match=match):
        build(DATASETS, "cityscapes", {"root": str(root)}, seed=0)


def test_many_pairs_are_checked_in_order(tmp_path) -> None:
    rng = np.random.default_rng(5)
    images, labels = [], []
    for k in range(80):  # above the threaded threshold
        images.append(tmp_path / f"i{k}.png")
        labels.append(tmp_path / f"l{k}.png")
        _save(images[-1], rng.integers(0, 256, (4, 6, 3), dtype=np.uint8))
        _save(labels[-1], np.zeros((4, 6) if k not in (50, 70) else (4, 5), dtype=np.uint8), "L")
    with pytest.raises(ValueError, match=r"i50\.png.*l50\.png"):
        sd.check_pairs(images, labels)
    sd.check_pairs(images[:50], labels[:50])


# --------------------------------------------------------------------------------------------- resize


def test_resize_labels_nearest_images_bilinear(cityscapes) -> None:
    root, files = cityscapes
    data = build(DATASETS, "cityscapes", {"root": str(root), "resize": [2 * H, 2 * W]}, seed=0)
    assert data.train.images.shape == (3, 2 * H, 2 * W)
    for i, name in enumerate(data.train.names):
        img, ids = files[name]
        want = _expect(ids, CITYSCAPES_TRAIN_ID)
        np.testing.assert_array_equal(data.train.labels.get_one(i).numpy(), want.repeat(2, 0).repeat(2, 1))
        bilinear = np.asarray(Image.fromarray(img).resize((2 * W, 2 * H), Image.Resampling.BILINEAR))
        np.testing.assert_array_equal(data.train.images.get_one(i).numpy(), bilinear.transpose(2, 0, 1))
    small = build(DATASETS, "cityscapes", {"root": str(root), "resize": [5, 7]}, seed=0)
    assert small.train.images.shape == (3, 5, 7) and tuple(small.train.images.get(np.arange(5)).shape) == (5, 3, 5, 7)
    for i, name in enumerate(small.train.names):
        img, ids = files[name]
        got = small.train.labels.get_one(i).numpy()
        assert got.shape == (5, 7) and set(np.unique(got)) <= set(np.unique(_expect(ids, CITYSCAPES_TRAIN_ID)))
        bilinear = np.asarray(Image.fromarray(img).resize((7, 5), Image.Resampling.BILINEAR))
        np.testing.assert_array_equal(small.train.images.get_one(i).numpy(), bilinear.transpose(2, 0, 1))
    with pytest.raises(ValueError):
        build(DATASETS, "cityscapes", {"root": str(root), "resize": [0, 7]}, seed=0)


def test_file_image_store_accepts_int_pair_or_none(tmp_path) -> None:
    path = tmp_path / "a.png"
    _save(path, np.random.default_rng(0).integers(0, 256, (H, W, 3), dtype=np.uint8))
    assert FileImageStore([path], (5, 9), 3).get_one(0).shape == (3, 5, 9)
    assert FileImageStore([path], (5, 9), 3).shape == (3, 5, 9)
    assert FileImageStore([path], 6, 1).get_one(0).shape == (1, 6, 6)
    assert FileImageStore([path], None, 3).shape == (3, H, W)
    for bad in ((0, 4), (4,), 0):
        with pytest.raises(ValueError):
            FileImageStore([path], bad, 3)


# ----------------------------------------------------------------------------------------------- gta5

GTA_IDS = np.r_[np.arange(41), 255]


@pytest.fixture
def gta5(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """root and {images/NNNNN.png: labelIds}; labels are palette PNGs whose colours are unrelated to the ids."""
    rng = np.random.default_rng(1)
    root, ids_of = tmp_path / "GTA5", {}
    palette = rng.integers(0, 256, 768, dtype=np.uint8).tolist()
    for k in range(1, 11):
        name = f"{k:05d}.png"
        _save(root / "images" / name, rng.integers(0, 256, (H, W, 3), dtype=np.uint8))
        ids = _ids(rng, GTA_IDS)
        label = Image.fromarray(ids, "P")
        label.putpalette(palette)
        (root / "labels").mkdir(exist_ok=True)
        label.save(root / "labels" / name)
        ids_of[f"images/{name}"] = ids
    with Image.open(root / "labels" / "00001.png") as im:  # the fixture is what it claims to be
        assert im.mode == "P" and not np.array_equal(np.asarray(im.convert("L")), ids_of["images/00001.png"])
    return root, ids_of


@pytest.mark.parametrize("classes,table", [(19, CITYSCAPES_TRAIN_ID), (13, CROSSCITY_TRAIN_ID)])
def test_gta5_palette_labels_map_indices(gta5, classes, table) -> None:
    root, ids_of = gta5
    data = build(DATASETS, "gta5", {"root": str(root), "classes": classes, "test_fraction": 0.3}, seed=0)
    assert data.num_classes == classes and data.domain_names == ["gta5"]
    assert len(data.tests["test"]) == 3 and len(data.train) == 7
    assert sorted(data.train.names + data.tests["test"].names) == sorted(ids_of)
    assert data.train.names == sorted(data.train.names)
    for split in (data.train, data.tests["test"]):
        assert split.domains.tolist() == [0] * len(split)
        for i, name in enumerate(split.names):
            np.testing.assert_array_equal(split.labels.get_one(i).numpy(), _expect(ids_of[name], table))
    if classes == 13:
        assert data.class_names[3] == "traffic light" and data.class_names[12] == "bicycle"


def test_gta5_split_is_deterministic_and_split_list_restricts(gta5, tmp_path) -> None:
    root, ids_of = gta5
    p = {"root": str(root), "test_fraction": 0.3, "split_seed": 4}
    a, b = build(DATASETS, "gta5", p, seed=0), build(DATASETS, "gta5", p, seed=99)
    assert a.tests["test"].names == b.tests["test"].names
    others = {tuple(build(DATASETS, "gta5", {**p, "split_seed": s}, seed=0).tests["test"].names) for s in range(5)}
    assert len(others) > 1
    lst = tmp_path / "train.txt"
    lst.write_text("/images/00003.png /labels/00003.png\n\n/images/00007.png /labels/00007.png\n/images/00009.png\n")
    data = build(DATASETS, "gta5", {"root": str(root), "split_list": str(lst), "test_fraction": 0.3}, seed=0)
    listed = ["images/00003.png", "images/00007.png", "images/00009.png"]
    assert sorted(data.train.names + data.tests["test"].names) == listed
    name = data.train.names[0]
    np.testing.assert_array_equal(data.train.labels.get_one(0).numpy(), _expect(ids_of[name], CITYSCAPES_TRAIN_ID))
    (root / "labels" / "00004.png").unlink()
    with pytest.raises(FileNotFoundError, match=r"labels.00004\.png.*images.00004\.png"):
        build(DATASETS, "gta5", {"root": str(root)}, seed=0)


# ----------------------------------------------------------------------------------------------- idda

IDDA_IDS = np.r_[np.arange(0, 31), 255]
SCENARIOS = {"T01_CN_A": 3, "T02_HRN_B": 2, "T07_CS_M": 2}


@pytest.fixture
def idda(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray], dict[str, list[str]]]:
    """IDDAsmall root, {relative RGB path: label ids} and {scenario: its RGB paths}."""
    rng = np.random.default_rng(2)
    root, ids_of, by_scen = tmp_path / "IDDAsmall", {}, {}
    for scen, n in SCENARIOS.items():
        for k in range(n):
            x, y = f"{scen}/RGB/{100 + k}_{scen}.jpg", f"{scen}/Semantic/{100 + k}_{scen}.png"
            _save(root / x, rng.integers(0, 256, (H, W, 3), dtype=np.uint8))
            ids_of[x] = _ids(rng, IDDA_IDS)
            _save(root / y, ids_of[x], "L")
            by_scen.setdefault(scen, []).append(x)
    return root, ids_of, by_scen


def _idda_leaf(path: Path, users: dict[str, list[str]]) -> str:
    path.write_text(json.dumps({
        "users": list(users), "num_samples": [len(v) for v in users.values()],
        "user_data": {u: {"x": xs, "y": [x.replace("/RGB/", "/Semantic/").replace(".jpg", ".png") for x in xs]}
                      for u, xs in users.items()},
    }))  # fmt: skip
    return str(path)


def test_idda_clients_test_splits_and_ids(idda, tmp_path) -> None:
    root, ids_of, by_scen = idda
    a, b, m = by_scen["T01_CN_A"], by_scen["T02_HRN_B"], by_scen["T07_CS_M"]
    train = _idda_leaf(tmp_path / "train.json", {"T02_HRN_B0": b, "T01_CN_A0": a[:2], "T01_CN_A1": a[2:]})
    seen = _idda_leaf(tmp_path / "same.json", {"test_user": [a[0], b[1]]})
    unseen = _idda_leaf(tmp_path / "diff.json", {"test_user": m})
    data = build(DATASETS, "idda", {"root": str(root), "train_split": train,
                                    "test_splits": {"seen": seen, "unseen": unseen}}, seed=0)
    assert list(data.tests) == ["test", "unseen"]
    assert data.client_names == ["T02_HRN_B0", "T01_CN_A0", "T01_CN_A1"]
    assert data.train.names == b + a and [c.tolist() for c in data.clients] == [[0, 1], [2, 3], [4]]
    assert data.domain_names == ["T01_CN_A", "T02_HRN_B", "T07_CS_M"]
    assert data.train.domains.tolist() == [1, 1, 0, 0, 0]
    assert data.tests["test"].domains.tolist() == [0, 1] and data.tests["unseen"].domains.tolist() == [2, 2]
    assert data.num_classes == 23 and data.class_names[0] == "class_0"
    for split in (data.train, data.tests["test"], data.tests["unseen"]):
        for i, name in enumerate(split.names):
            np.testing.assert_array_equal(split.labels.get_one(i).numpy(), _idda_expect(ids_of[name]))
    got = data.train.labels.get_one(0).numpy()
    assert set(np.unique(got)) == set(range(23)) | {255}
    # FedDrive's test files hold both test users: "path#user" selects one
    both = _idda_leaf(tmp_path / "test.json", {"test_user_diff_domain": m, "test_user_same_domain": [a[1]]})
    data = build(DATASETS, "idda", {"root": str(root), "train_split": train, "test_splits": {
        "same": f"{both}#test_user_same_domain", "diff": f"{both}#test_user_diff_domain", "all": both}}, seed=0)
    assert data.tests["test"].names == [a[1]] and data.tests["diff"].names == m
    assert data.tests["all"].names == m + [a[1]]


def test_idda_remap_is_feddrives_16_class_mapping(idda, tmp_path) -> None:
    """`remap = true` maps label ids as FedDrive's src/dataset/idda.py does (``mapping[i] = class_eval[i]``),
    written out here from the release's list rather than from FedSight's table."""
    root, ids_of, by_scen = idda
    class_eval = [255, 2, 4, 255, 11, 5, 0, 0, 1, 8, 13, 3, 7, 6, 255, 255, 15, 14, 12, 9, 10]
    mapping = np.full(256, 255, dtype=np.int64)
    mapping[: len(class_eval)] = class_eval
    a = by_scen["T01_CN_A"]
    train = _idda_leaf(tmp_path / "train.json", {"T01_CN_A0": a})
    data = build(DATASETS, "idda", {"root": str(root), "train_split": train, "test_splits": {"t": train},
                                    "remap": True}, seed=0)
    assert data.num_classes == 16 and data.class_names == [f"class_{i}" for i in range(16)]
    for i, name in enumerate(data.train.names):
        np.testing.assert_array_equal(data.train.labels.get_one(i).numpy(), mapping[ids_of[name]])
    assert set(np.unique(data.train.labels.get_one(0).numpy())) <= set(range(16)) | {255}


def test_idda_errors_name_the_files(idda, tmp_path) -> None:
    root, _, by_scen = idda
    a = by_scen["T01_CN_A"]
    train = _idda_leaf(tmp_path / "train.json", {"T01_CN_A0": a})
    (root / "T01_CN_A" / "Semantic" / "101_T01_CN_A.png").unlink()
    with pytest.raises(FileNotFoundError, match=r"'T01_CN_A0'.*101_T01_CN_A\.png"):
        build(DATASETS, "idda", {"root": str(root), "train_split": train, "test_splits": {"t": train}}, seed=0)
    mixed = tmp_path / "mixed.json"
    mixed.write_text(json.dumps({"users": ["u"], "num_samples": [1], "user_data": {"u": {
        "x": [by_scen["T02_HRN_B"][0]], "y": ["T07_CS_M/Semantic/100_T07_CS_M.png"]}}}))
    with pytest.raises(ValueError, match=r"100_T02_HRN_B\.jpg.*100_T07_CS_M\.png"):
        build(DATASETS, "idda", {"root": str(root), "train_split": str(mixed), "test_splits": {"t": str(mixed)}},
              seed=0)
