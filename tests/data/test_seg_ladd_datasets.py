"""CrossCity and Mapillary Vistas loaders (LADD, thesis Table 5.9) on tiny fixtures in their released layouts and
LADD's split-file formats: the by_city, cross-silo and per-continent GPS k-means splits, the class maps (against
hand-written tables), unlabelled training images, and bad input named in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fedsight.data import seg_ladd_datasets as ld
from fedsight.registry import DATASETS, build

# independent, hand-written expectations (not the module's constants)
CROSSCITY_TRAIN_ID = {7: 0, 8: 1, 11: 2, 19: 3, 20: 4, 21: 5, 23: 6, 24: 7, 25: 8, 26: 9, 28: 10, 32: 11, 33: 12}
MAPILLARY_TRAIN_ID = {  # v1.2 id: Cityscapes train id, from the class names (curb -> sidewalk, ...)
    2: 1, 3: 4, 6: 3, 7: 1, 9: 1, 11: 1, 13: 0, 14: 0, 15: 1, 17: 2, 19: 11, 20: 12, 21: 12, 22: 12, 24: 0,
    26: 9, 27: 10, 29: 9, 30: 8, 43: 0, 44: 5, 45: 5, 46: 5, 47: 5, 48: 6, 50: 7, 52: 18, 54: 15, 55: 13,
    57: 17, 58: 16, 61: 14,
}  # fmt: skip
H, W = 12, 20


def _expect(ids: np.ndarray, table: dict[int, int]) -> np.ndarray:
    out = np.full(ids.shape, 255, dtype=np.uint8)
    for src, dst in table.items():
        out[ids == src] = dst
    return out


def _save(path: Path, arr: np.ndarray, mode: str | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr, mode).save(path) if mode else Image.fromarray(arr).save(path)


def _leaf(path: Path, users: dict[str, dict[str, list[str]]]) -> Path:
    path.write_text(json.dumps({"users": list(users), "num_samples": [len(u["x"]) for u in users.values()],
                                "user_data": users}))
    return path


# ---------------------------------------------------------------------------------------------- crosscity

TRAIN_PER_CITY = {"Rio": 11, "Rome": 9, "Taipei": 4, "Tokyo": 6}


@pytest.fixture
def crosscity(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """Chen et al.'s layout: {City}/Images/Train/*.jpg (no labels), Images/Test/*.png and Labels/Test/*_eval.png
    (Cityscapes labelIds); returns the root and the test label ids by image path."""
    rng = np.random.default_rng(0)
    root, labels = tmp_path / "crosscity", {}
    for city, n in TRAIN_PER_CITY.items():
        for k in range(n):
            _save(root / city / "Images" / "Train" / f"pano_{k:05d}_0_180.jpg", rng.integers(0, 256, (H, W, 3), np.uint8))
        for k in range(2):
            name = f"{city}/Images/Test/pano_{k:05d}_1_0.png"
            ids = rng.permutation(np.resize(np.r_[np.arange(34), 255], H * W)).reshape(H, W).astype(np.uint8)
            _save(root / name, rng.integers(0, 256, (H, W, 3), np.uint8))
            _save(root / city / "Labels" / "Test" / f"pano_{k:05d}_1_0_eval.png", ids, "L")
            labels[name] = ids
    return root, labels


def test_loaders_are_registered() -> None:
    for name in ("crosscity", "mapillary"):
        assert DATASETS.get(name).task == "segmentation"


def test_crosscity_by_city_clients_hold_one_city_and_every_image_once(crosscity) -> None:
    root, labels = crosscity
    data = build(DATASETS, "crosscity", {"root": str(root), "images_per_client": 3, "spread": 1}, seed=0)
    assert data.class_names[3] == "traffic light" and len(data.class_names) == 13
    assert data.domain_names == ["Rio", "Rome", "Taipei", "Tokyo"]
    pool = data.train
    seen = np.concatenate(data.clients)
    assert sorted(seen.tolist()) == list(range(len(pool))) == list(range(sum(TRAIN_PER_CITY.values())))
    for name, idx in zip(data.client_names, data.clients):
        city = {pool.names[i].split("/")[0] for i in idx}
        assert city == {name.rstrip("0123456789")} and set(pool.domains[idx]) == {data.domain_names.index(city.pop())}
        assert 2 <= len(idx) <= 5, (name, len(idx))  # 3 +- 1, plus at most one left-over image here
    assert all((pool.labels.get_one(i) == 255).all() for i in range(len(pool)))  # unlabelled training images
    assert tuple(pool.labels.get_one(0).shape) == (H, W)
    test = data.tests["test"]
    assert len(test) == 8 and sorted(test.names) == sorted(labels)
    for i, name in enumerate(test.names):
        np.testing.assert_array_equal(test.labels.get_one(i).numpy(), _expect(labels[name], CROSSCITY_TRAIN_ID))
    again = build(DATASETS, "crosscity", {"root": str(root), "images_per_client": 3, "spread": 1}, seed=5)
    other = build(DATASETS, "crosscity", {"root": str(root), "images_per_client": 3, "spread": 1,
                             "split_seed": 1}, seed=0)
    assert [a.tolist() for a in again.clients] == [a.tolist() for a in data.clients]  # split_seed, not the run seed
    assert again.train.names == pool.names and other.train.names != pool.names  # the pool is in client order


@pytest.mark.parametrize("n, mean, spread", [(3200, 27, 10), (10, 3, 1), (5, 27, 10), (7, 2, 0), (0, 3, 1)])
def test_by_city_sizes_cover_the_city_within_the_range(n, mean, spread) -> None:
    sizes = ld.by_city_sizes(n, mean, spread, np.random.default_rng(0))
    assert sum(sizes) == n
    if n >= mean + spread:
        assert min(sizes) >= mean - spread and max(sizes) <= mean + spread + 1  # left-overs: one image each
    if n == 3200:
        assert 100 <= len(sizes) <= 135  # the thesis: 476 clients for 4 x 3,200 images


def test_crosscity_cross_silo_is_one_client_per_city(crosscity) -> None:
    root, _ = crosscity
    data = build(DATASETS, "crosscity", {"root": str(root), "split": "cross_silo", "cities": ["Rome", "Rio"]},
                 seed=0)
    assert data.client_names == ["Rio", "Rome"] and [len(c) for c in data.clients] == [11, 9]
    assert len(data.tests["test"]) == 4


def test_crosscity_reads_ladds_split_files(crosscity, tmp_path) -> None:
    """LADD's by_city_cpc0_ms27_me10/train/{City}.json (users with 'x' only) and test/test_user.json (x, y, city)."""
    root, labels = crosscity
    rio = _leaf(tmp_path / "Rio.json", {"Rio1": {"x": [f"Rio/Images/Train/pano_{k:05d}_0_180.jpg" for k in (3, 0)]},
                                        "Rio2": {"x": ["Rio/Images/Train/pano_00007_0_180.jpg"]}})
    tokyo = _leaf(tmp_path / "Tokyo.json", {"Tokyo1": {"x": ["Tokyo/Images/Train/pano_00002_0_180.jpg"]}})
    test_names = sorted(labels)[:3]
    test = _leaf(tmp_path / "test_user.json", {"test_user": {
        "x": test_names, "y": [n.replace("Images", "Labels").replace(".png", "_eval.png") for n in test_names],
        "city": [n.split("/")[0] for n in test_names]}})
    data = build(DATASETS, "crosscity", {"root": str(root), "split_files": [str(rio), str(tokyo)],
                            "test_file": str(test)}, seed=0)
    assert data.client_names == ["Rio1", "Rio2", "Tokyo1"] and [len(c) for c in data.clients] == [2, 1, 1]
    assert data.train.names == ["Rio/Images/Train/pano_00003_0_180.jpg", "Rio/Images/Train/pano_00000_0_180.jpg",
                                "Rio/Images/Train/pano_00007_0_180.jpg", "Tokyo/Images/Train/pano_00002_0_180.jpg"]
    assert data.tests["test"].names == test_names
    np.testing.assert_array_equal(data.tests["test"].labels.get_one(2).numpy(),
                                  _expect(labels[test_names[2]], CROSSCITY_TRAIN_ID))


def test_crosscity_bad_input_names_the_file(crosscity, tmp_path) -> None:
    root, _ = crosscity
    missing = _leaf(tmp_path / "m.json", {"Rio1": {"x": ["Rio/Images/Train/pano_09999_0_180.jpg"]}})
    with pytest.raises(FileNotFoundError, match="pano_09999"):
        build(DATASETS, "crosscity", {"root": str(root), "split_files": [str(missing)]}, seed=0)
    twice = _leaf(tmp_path / "t.json", {"Rio1": {"x": ["Rio/Images/Train/pano_00001_0_180.jpg"]},
                                        "Rio2": {"x": ["Rio/Images/Train/pano_00001_0_180.jpg"]}})
    with pytest.raises(ValueError, match="t.json.*listed twice"):
        build(DATASETS, "crosscity", {"root": str(root), "split_files": [str(twice)]}, seed=0)
    again = _leaf(tmp_path / "again.json", {"Rio9": {"x": ["Rio/Images/Train/pano_00001_0_180.jpg"]}})
    with pytest.raises(ValueError, match="again.json.*also user 'Rio1'"):
        build(DATASETS, "crosscity", {"root": str(root),
                         "split_files": [str(_leaf(tmp_path / "one.json", {"Rio1": {"x": [
                             "Rio/Images/Train/pano_00001_0_180.jpg"]}})), str(again)]}, seed=0)
    with pytest.raises(ValueError, match="unknown city 'Paris'"):
        build(DATASETS, "crosscity", {"root": str(root), "cities": ["Paris"]}, seed=0)
    (root / "Rome" / "Labels" / "Test" / "pano_00001_1_0_eval.png").unlink()
    with pytest.raises(FileNotFoundError, match="pano_00001_1_0_eval.png"):
        build(DATASETS, "crosscity", {"root": str(root)}, seed=0)


# ---------------------------------------------------------------------------------------------- mapillary

KEYS = {"EU": ["eu_a1", "eu_a2", "eu_a3", "eu_b1", "eu_b2"], "AF": ["af_1", "af_2"]}
#: two GPS blobs in Europe (Turin, Oslo), one in Africa
GPS = {"eu_a1": (45.07, 7.68), "eu_a2": (45.06, 7.69), "eu_a3": (45.08, 7.66), "eu_b1": (59.91, 10.75),
       "eu_b2": (59.92, 10.74), "af_1": (-1.29, 36.82), "af_2": (-1.28, 36.81)}
MAP_IDS = np.r_[np.arange(66), 255]


@pytest.fixture
def mapillary(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """training/images/{key}.jpg + training/v1.2/labels/{key}.png (ids as palette indices), validation likewise;
    plus one training image without GPS (``nogps``)."""
    rng = np.random.default_rng(1)
    root, labels = tmp_path / "mapillary", {}
    palette = rng.integers(0, 256, 768).tolist()
    keys = [("training", k) for ks in KEYS.values() for k in ks] + [("training", "nogps"), ("validation", "v1"),
                                                                   ("validation", "v2")]
    for split, key in keys:
        _save(root / split / "images" / f"{key}.jpg", rng.integers(0, 256, (H, W, 3), np.uint8))
        ids = rng.permutation(np.resize(MAP_IDS, H * W)).reshape(H, W).astype(np.uint8)
        im = Image.fromarray(ids, "P")
        im.putpalette(palette)
        (root / split / "v1.2" / "labels").mkdir(parents=True, exist_ok=True)
        im.save(root / split / "v1.2" / "labels" / f"{key}.png")
        labels[f"{split}/{key}"] = ids
    return root, labels


def _gps_csv(path: Path, rows: list[str]) -> Path:
    path.write_text("image,latitude,longitude,continent\n" + "\n".join(rows) + "\n")
    return path


def test_mapillary_gps_split_is_k_means_per_continent(mapillary, tmp_path) -> None:
    root, labels = mapillary
    rows = [f"{k}.jpg,{GPS[k][0]},{GPS[k][1]},{c}" for c, ks in KEYS.items() for k in ks] + ["nogps,,,EU"]
    data = build(DATASETS, "mapillary", {"root": str(root), "gps_file": str(_gps_csv(tmp_path / "g.csv", rows)),
                            "images_per_client": 3}, seed=0)
    groups = [sorted(data.train.names[i].split("/")[-1][:-4] for i in c) for c in data.clients]
    assert data.client_names == ["AF0", "EU0", "EU1"]  # continents sorted; EU: round(5 / 3) = 2 clusters
    assert groups == [["af_1", "af_2"], ["eu_a1", "eu_a2", "eu_a3"], ["eu_b1", "eu_b2"]]  # the two cities
    assert "training/images/nogps.jpg" not in data.train.names  # no coordinates: dropped
    assert [data.domain_names[d] for d in data.train.domains[data.clients[2]]] == ["EU", "EU"]
    assert len(data.class_names) == 19 and data.class_names[12] == "rider"
    for i, name in enumerate(data.train.names):
        key = "training/" + name.split("/")[-1][:-4]
        np.testing.assert_array_equal(data.train.labels.get_one(i).numpy(), _expect(labels[key], MAPILLARY_TRAIN_ID))
    assert sorted(data.tests["test"].names) == ["validation/images/v1.jpg", "validation/images/v2.jpg"]


def test_mapillary_reads_ladds_split_files(mapillary, tmp_path) -> None:
    root, labels = mapillary
    pair = lambda k: (f"training/images/{k}.jpg", f"training/v1.2/labels/{k}.png")  # noqa: E731
    af = _leaf(tmp_path / "AF.json", {"AF0": {"x": [pair("af_2")[0], pair("af_1")[0]],
                                              "y": [pair("af_2")[1], pair("af_1")[1]]}})
    eu = _leaf(tmp_path / "EU.json", {"EU0": {"x": [pair("eu_b1")[0]], "y": [pair("eu_b1")[1]]},
                                      "EU1": {"x": [pair("eu_a1")[0]], "y": [pair("eu_a1")[1]]}})
    test = tmp_path / "test_user.json"  # LADD's Mapillary test file writes num_samples as one number
    test.write_text(json.dumps({"users": ["test_user"], "num_samples": 1, "user_data": {"test_user": {
        "x": ["validation/images/v2.jpg"], "y": ["validation/v1.2/labels/v2.png"]}}}))
    data = build(DATASETS, "mapillary", {"root": str(root), "split_files": [str(af), str(eu)],
                            "test_file": str(test)}, seed=0)
    assert data.client_names == ["AF0", "EU0", "EU1"] and [len(c) for c in data.clients] == [2, 1, 1]
    assert [data.domain_names[d] for d in data.train.domains] == ["AF", "AF", "EU", "EU"]
    np.testing.assert_array_equal(data.tests["test"].labels.get_one(0).numpy(),
                                  _expect(labels["validation/v2"], MAPILLARY_TRAIN_ID))


def test_mapillary_bad_input_names_the_file_and_line(mapillary, tmp_path) -> None:
    root, _ = mapillary
    cases = [
        (["ghost.jpg,1,2,EU"], "line 2: image 'ghost' is not in training/images"),
        (["af_1,1,2,AF", "af_1,1,2,AF"], "line 3: image 'af_1' is listed twice"),
        (["af_1,100,2,AF"], "line 2: need latitude in"),
        (["af_1,north,2,AF"], "line 2: latitude/longitude 'north'"),
    ]
    for rows, message in cases:
        with pytest.raises(ValueError, match=message):
            build(DATASETS, "mapillary", {"root": str(root),
                             "gps_file": str(_gps_csv(tmp_path / "bad.csv", rows))}, seed=0)
    (tmp_path / "cols.csv").write_text("image,lat,lon\naf_1,1,2\n")
    with pytest.raises(ValueError, match="cols.csv.*must have the columns"):
        build(DATASETS, "mapillary", {"root": str(root), "gps_file": str(tmp_path / "cols.csv")}, seed=0)
    with pytest.raises(ValueError, match="split_files or gps_file, not both"):
        build(DATASETS, "mapillary", {"root": str(root), "gps_file": "a.csv", "split_files": ["b.json"]},
              seed=0)
    plain = build(DATASETS, "mapillary", {"root": str(root)}, seed=0)
    assert plain.clients is None and len(plain.train) == 8 and set(plain.train.domains) == {0}


def test_a_ladd_styles_stage_on_crosscity_scores_its_clusters_against_the_cities(crosscity, tmp_path) -> None:
    """The loader as a run uses it: the predefined by_city clients, unlabelled training images (eval_only), the
    styles stage's clusters scored against each client's city (Table 5.19's form) in clusters.json."""
    from fedsight.api import execute
    from fedsight.config import validate

    root, _ = crosscity
    n_clients = len(build(DATASETS, "crosscity", {"root": str(root), "images_per_client": 3, "spread": 1},
                          seed=0).clients)
    raw = {
        "seed": 0, "run": {"name": "cc"},
        "task": {"name": "segmentation", "crop": [12, 20], "labels": "eval_only"},
        "data": {"name": "crosscity", "root": str(root), "images_per_client": 3, "spread": 1},
        "partition": {"name": "predefined", "num_clients": n_clients, "local_test_fraction": 0.0},
        "model": {"name": "bisenetv2", "width": 0.25, "head_channels": 16, "aux_channels": 8},
        "train": {"epochs": 1, "batch_size": 2, "lr": 0.01}, "server": {"rounds": 1, "clients_per_round": 2},
        "eval": {"batch_size": 4, "local": False}, "engine": {"threads": 1},
        "stages": [{"name": "styles", "rounds": 1, "recipe": {"components": [
            {"name": "client_styles", "ks": [2, 3, 4]}]}}],
    }
    out = execute(validate(raw), tmp_path / "run")
    info = json.loads((out.run_dir / "clusters.json").read_text())
    assert {c["domain"] for c in info["clients"]} == set(TRAIN_PER_CITY)
    table = np.asarray(info["table"]["clients"])
    assert info["table"]["domains"] == sorted(TRAIN_PER_CITY) and table.sum() == n_clients
    assert 0 < info["accuracy"]["matching"] <= info["accuracy"]["majority"] <= 1
