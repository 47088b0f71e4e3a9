"""LADD's target datasets (thesis Sec. 5.3.9, Table 5.9): CrossCity and Mapillary Vistas, in their released on-disk
layouts, with the thesis's client splits. Registered in :data:`fedsight.registry.DATASETS` (``task="segmentation"``).

**CrossCity** (Chen et al. 2017, "No more discrimination: cross city adaptation of road scene segmenters"): four
cities, ``root/{City}/Images/Train/*.jpg`` (3,200 unlabelled street-view crops per city), ``root/{City}/Images/
Test/*.png`` (100 per city) with label maps ``root/{City}/Labels/Test/{stem}_eval.png`` holding Cityscapes
labelIds, mapped to the 13 CrossCity classes (LADD's ``labels2train``; road, sidewalk, building, traffic light,
traffic sign, vegetation, sky, person, rider, car, bus, motorcycle, bicycle). The training images have no labels:
the pool's label maps are all ``IGNORE`` (``UnlabelledStore``), so only source-free adaptation
(``task.labels = "eval_only"``) trains on it. Domain = city. Splits:

* ``by_city`` (the thesis's federated split, 476 clients): every client holds images of one city, a number drawn
  uniformly from ``[images_per_client - spread, images_per_client + spread]`` (27 +- 10: [17, 37], Fig. 5.7),
  city by city from a shuffle (``split_seed``) until the city runs out; the few images left over when the next
  draw exceeds what remains are dealt one each to that city's clients, in order. ``split_files`` instead reads
  LADD's released ``by_city_cpc0_ms27_me10/train/{City}.json`` (LEAF JSON, users ``Rio1`` ... with ``x`` only):
  the clients are exactly their users.
* ``cross_silo`` (the split of DualAdapt [220], Table 5.20): four clients, one per city, all its 3,200 images.
* Test: every city's ``Images/Test`` (400 images), or LADD's ``test/test_user.json`` (``test_file``).

**Mapillary Vistas v1.2** (Neuhold et al. 2017): ``root/training/images/{key}.jpg`` with ``root/training/v1.2/
labels/{key}.png`` (the v1.2 ids 0..65 as palette indices) and ``root/validation/...`` likewise (2,000 images:
the test set). v1.2 ids map to the 19 Cityscapes classes by LADD's ``labels2train`` (curb, bike lane, curb cut,
pedestrian area and sidewalk -> sidewalk; road, service lane, lane marking and pothole -> road; the three rider
kinds -> rider; street light, pole, sign frame and utility pole -> pole; sand and terrain -> terrain; ...). Splits:

* ``split_files``: LADD's released ``clustering/train/{AF,AS,EU,NA,OC,SA}.json`` (users ``AF0`` ...: the GPS
  k-means per continent, 357 clients); domain = continent (the user name's letters).
* ``gps_file``: the split built here, as the thesis describes it: a CSV with columns ``image`` (the key),
  ``latitude``, ``longitude``, ``continent``; images without coordinates are dropped (the thesis drops 31 of
  18,000), and per continent k-means (scikit-learn, ``n_init = 10``, ``split_seed``) on (latitude, longitude)
  with ``k = max(1, round(n / images_per_client))`` clusters makes the clients, continent by continent
  (sorted), clusters by first image. The public release carries no coordinates and the thesis does not say
  where its came from, so the CSV is the user's. Domain = continent.
* neither: no predefined split, the pool is every training image, one domain ``mapillary``.

The thesis resizes Mapillary images to a width of 1024; ``resize`` here is one fixed ``[height, width]`` (or
native sizes, which the task's crop and scale handle in training; evaluation batches group images of one size).
"""

from __future__ import annotations

import csv
import io
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from pydantic import Field

from fedsight.data.seg_datasets import (
    CITYSCAPES_CLASSES,
    CROSSCITY_CLASSES,
    CROSSCITY_LABEL_MAP,
    Size,
    _client_arrays,
    _domain_ids,
    _header,
    _make_set,
    _rel,
    _require_dir,
)
from fedsight.data.segmentation import IGNORE, LabelStore, SegmentationData, SegmentationSet, lut_from_map
from fedsight.registry import DATASETS, Params
from fedsight.rng import np_rng
from fedsight.safe_read import exists, read_json, read_text

CROSSCITY_CITIES = ("Rio", "Rome", "Taipei", "Tokyo")
#: Mapillary Vistas v1.2 id -> Cityscapes train id (LADD ``src/dataset/target/mapillary.py``)
MAPILLARY_LABEL_MAP = {
    2: 1, 3: 4, 6: 3, 7: 1, 9: 1, 11: 1, 13: 0, 14: 0, 15: 1, 17: 2, 19: 11, 20: 12, 21: 12, 22: 12, 24: 0, 26: 9,
    27: 10, 29: 9, 30: 8, 43: 0, 44: 5, 45: 5, 46: 5, 47: 5, 48: 6, 50: 7, 52: 18, 54: 15, 55: 13, 57: 17, 58: 16,
    61: 14,
}  # fmt: skip
_RESIZE = "None: native size; [height, width]: images resized bilinearly, label maps nearest, when read"


class UnlabelledStore(LabelStore):
    """Label maps of unlabelled images: all ``IGNORE``, of each image's ``(height, width)``."""

    def __init__(self, sizes: np.ndarray):
        self.sizes = np.asarray(sizes, dtype=np.int64).reshape(-1, 2)

    def __len__(self) -> int:
        return len(self.sizes)

    def get_one(self, i: int) -> torch.Tensor:
        h, w = self.sizes[int(i)]
        return torch.full((int(h), int(w)), IGNORE, dtype=torch.uint8)


def read_ladd_split(path: str | os.PathLike[str], labelled: bool) -> tuple[list[str], list[list[str]], list[list[str]]]:
    """A LADD split file (LEAF JSON ``{"users", "num_samples", "user_data": {user: {"x": [...], "y": [...]}}}``;
    CrossCity's training files have no ``y``): users, their image paths and (``labelled``) label paths, in file
    order. Errors name the file and the user."""
    path = os.fspath(path)
    if not exists(path):
        raise FileNotFoundError(f"split file {path!r} does not exist")
    data = read_json(path, "split file")
    if not (isinstance(data, dict) and isinstance(data.get("users"), list) and isinstance(data.get("user_data"), dict)):
        raise ValueError(f"split file {path!r} is not a LEAF split (expected keys 'users', 'num_samples', 'user_data')")
    users, counts = data["users"], data.get("num_samples")
    if not users or not all(isinstance(u, str) for u in users) or len(set(users)) != len(users):
        raise ValueError(f"split file {path!r}: 'users' must be a non-empty list of distinct names")
    if isinstance(counts, int) and len(users) == 1:  # LADD's Mapillary test file writes one count, not a list
        counts = [counts]
    if counts is not None and (not isinstance(counts, list) or len(counts) != len(users)):
        raise ValueError(f"split file {path!r}: 'num_samples' must list one count per user ({len(users)} users)")
    extra = sorted(set(data["user_data"]) - set(users))
    if extra:
        raise ValueError(f"split file {path!r}: user_data has users that 'users' does not list: {extra[:5]}")
    xs_all, ys_all = [], []
    for i, user in enumerate(users):
        entry = data["user_data"].get(user)
        if not isinstance(entry, dict) or not isinstance(entry.get("x"), list):
            raise ValueError(f"split file {path!r}: user {user!r} has no 'x' list in user_data")
        xs = entry["x"]
        ys = entry.get("y") if labelled else []
        if labelled and not isinstance(ys, list):
            raise ValueError(f"split file {path!r}: user {user!r} has no 'y' list of label maps")
        if not all(isinstance(v, str) for v in xs + ys):
            raise ValueError(f"split file {path!r}: user {user!r}: 'x' and 'y' must be lists of paths")
        if not xs or (labelled and len(ys) != len(xs)) or (counts is not None and counts[i] != len(xs)):
            raise ValueError(f"split file {path!r}: user {user!r} has num_samples "
                             f"{counts[i] if counts is not None else '-'}, {len(xs)} images (x)"
                             + (f" and {len(ys)} label maps (y)" if labelled else ""))
        xs_all.append([_rel(x) for x in xs])
        ys_all.append([_rel(y) for y in ys])
    seen: dict[str, str] = {}
    for user, xs in zip(users, xs_all):
        for x in xs:
            if x in seen:
                raise ValueError(f"split file {path!r}: image {x!r} is listed twice (users {seen[x]!r} and {user!r})")
            seen[x] = user
    return list(users), xs_all, ys_all


def _read_splits(refs: Sequence[str], labelled: bool) -> tuple[list[str], list[list[str]], list[list[str]]]:
    users: list[str] = []
    xs: list[list[str]] = []
    ys: list[list[str]] = []
    owner: dict[str, str] = {}
    for ref in refs:
        u, x, y = read_ladd_split(ref, labelled)
        dup = sorted(set(u) & set(users))
        if dup:
            raise ValueError(f"split file {ref!r} repeats users of an earlier split file: {dup[:5]}")
        for user, files in zip(u, x):
            for f in files:
                if f in owner:
                    raise ValueError(f"split file {ref!r}: image {f!r} of user {user!r} is also user "
                                     f"{owner[f]!r}'s in an earlier split file")
                owner[f] = user
        users, xs, ys = users + u, xs + x, ys + y
    return users, xs, ys


def _unlabelled_set(root: Path, paths: Sequence[str], domains: Sequence[str], ids: dict[str, int],
                    resize: Sequence[int] | None) -> SegmentationSet:
    """Images without label maps (CrossCity's training images): headers checked, labels all ``IGNORE``."""
    from fedsight.data.pipeline import FileImageStore

    files = [root / p for p in paths]
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"image file {str(f)!r} does not exist")
    size = None if resize is None else (int(resize[0]), int(resize[1]))
    sizes = np.array([size if size is not None else _header(f, False)[::-1] for f in files],
                     dtype=np.int64).reshape(len(files), 2)
    return SegmentationSet(FileImageStore(files, size, 3), UnlabelledStore(sizes),
                           np.array([ids[d] for d in domains], dtype=np.int64), list(paths), sizes)


# ------------------------------------------------------------------------------------------------ crosscity


class CrossCityParams(Params):
    root: str = Field(description="CrossCity root, holding {City}/Images/{Train,Test}/ and {City}/Labels/Test/")
    split: Literal["by_city", "cross_silo"] = Field("by_city", description="by_city: clients of one city, "
                                                    "images_per_client +- spread each (the thesis's 476); "
                                                    "cross_silo: one client per city")
    split_files: list[str] | None = Field(None, description="LADD's by_city_cpc0_ms27_me10/train/{City}.json "
                                          "(paths relative to root): the clients are their users")
    test_file: str | None = Field(None, description="LADD's test_user.json instead of every {City}/Images/Test")
    cities: list[str] = Field(list(CROSSCITY_CITIES), min_length=1, description="the cities used")
    images_per_client: int = Field(27, ge=1, description="mean images of a by_city client (the thesis: 27)")
    spread: int = Field(10, ge=0, description="a by_city client holds images_per_client +- spread (uniform)")
    split_seed: int = Field(0, ge=0, description="seed of the by_city split (independent of the run seed)")
    resize: Size | None = Field(None, description=_RESIZE)


def _crosscity_city(path: str, what: str) -> str:
    city = Path(path).parts[0] if Path(path).parts else ""
    if city not in CROSSCITY_CITIES:
        raise ValueError(f"{what}: {path!r} does not lie in a city folder ({', '.join(CROSSCITY_CITIES)})")
    return city


def _scan(folder: Path, suffixes: tuple[str, ...], what: str) -> list[str]:
    _require_dir(folder, what)
    files = sorted(p.name for p in folder.iterdir() if p.suffix.lower() in suffixes and not p.name.startswith("."))
    if not files:
        raise ValueError(f"{what} folder {str(folder)!r} has no {'/'.join(suffixes)} images")
    return files


def by_city_sizes(n: int, mean: int, spread: int, rng: np.random.Generator) -> list[int]:
    """Client sizes of one city of ``n`` images: draws from U{mean - spread .. mean + spread} (at least 1) while
    a draw fits in what remains; the rest is dealt one image each to the clients in order."""
    low, high = max(1, mean - spread), mean + spread
    sizes: list[int] = []
    left = n
    while left > 0:
        k = int(rng.integers(low, high + 1))
        if k > left:
            break
        sizes.append(k)
        left -= k
    if not sizes:
        return [n] if n else []
    for i in range(left):
        sizes[i % len(sizes)] += 1
    return sizes


@DATASETS.register("crosscity", params=CrossCityParams, task="segmentation",
                   help="CrossCity (Rio, Rome, Taipei, Tokyo; 13 classes, unlabelled training images) with LADD's "
                   "by_city or the cross-silo split")
def load_crosscity(params: CrossCityParams, *, seed: int) -> SegmentationData:
    """CrossCity in Chen et al.'s layout (module docstring); domain = city."""
    del seed
    root = Path(params.root)
    _require_dir(root, "CrossCity")
    unknown = [c for c in params.cities if c not in CROSSCITY_CITIES]
    if unknown:
        raise ValueError(f"crosscity: unknown city {unknown[0]!r} (cities: {', '.join(CROSSCITY_CITIES)})")
    cities = sorted(set(params.cities))
    if params.split_files is not None:
        if params.split != "by_city":
            raise ValueError("crosscity: split_files are LADD's by_city files; set split = 'by_city' with them")
        names, user_xs, _ = _read_splits(params.split_files, labelled=False)
    else:
        per_city = {c: [f"{c}/Images/Train/{f}" for f in _scan(root / c / "Images" / "Train", (".jpg", ".png"),
                                                                 f"CrossCity {c} training image")] for c in cities}
        names, user_xs = [], []
        for c in cities:
            files = per_city[c]
            if params.split == "cross_silo":
                names.append(c)
                user_xs.append(files)
                continue
            rng = np_rng(params.split_seed, "crosscity-by-city", c)
            order = [files[int(i)] for i in rng.permutation(len(files))]
            start = 0
            for j, k in enumerate(by_city_sizes(len(order), params.images_per_client, params.spread, rng), 1):
                names.append(f"{c}{j}")
                user_xs.append(sorted(order[start : start + k]))
                start += k
    train = [x for xs in user_xs for x in xs]
    train_dom = [_crosscity_city(x, "crosscity split") for x in train]
    if params.split_files is not None:
        outside = sorted({d for d in train_dom} - set(cities))
        if outside:
            raise ValueError(f"crosscity: the split files list images of {outside[0]!r}, not among cities")
    if params.test_file is not None:
        _, txs, tys = read_ladd_split(params.test_file, labelled=True)
        test = [(x, y) for xs, ys in zip(txs, tys) for x, y in zip(xs, ys)]
    else:
        test = []
        for c in cities:
            for f in _scan(root / c / "Images" / "Test", (".png", ".jpg"), f"CrossCity {c} test image"):
                test.append((f"{c}/Images/Test/{f}", f"{c}/Labels/Test/{Path(f).stem}_eval.png"))
    test_dom = [_crosscity_city(x, "crosscity test") for x, _ in test]
    dom_names, ids = _domain_ids(train_dom, [test_dom])
    lut = lut_from_map(CROSSCITY_LABEL_MAP)
    return SegmentationData(
        train=_unlabelled_set(root, train, train_dom, ids, params.resize),
        tests={"test": _make_set(root, root, test, test_dom, ids, lut, params.resize)},
        class_names=list(CROSSCITY_CLASSES), domain_names=dom_names,
        clients=_client_arrays([[(x, "") for x in xs] for xs in user_xs]),
        client_names=names,
    )


# ------------------------------------------------------------------------------------------------ mapillary


class MapillaryParams(Params):
    root: str = Field(description="Mapillary Vistas root, holding {training,validation}/images/*.jpg and "
                      "{training,validation}/v1.2/labels/*.png")
    split_files: list[str] | None = Field(None, description="LADD's clustering/train/{AF,...,SA}.json (paths "
                                          "relative to root): the clients are their users, domain = continent")
    gps_file: str | None = Field(None, description="CSV image,latitude,longitude,continent: the clients by k-means "
                                 "on the coordinates per continent (the thesis's split)")
    images_per_client: int = Field(50, ge=1, description="gps_file: k = round(images of a continent / this)")
    split_seed: int = Field(0, ge=0, description="seed of the k-means (independent of the run seed)")
    test_file: str | None = Field(None, description="LADD's test_user.json instead of every validation image")
    resize: Size | None = Field(None, description=_RESIZE)


def _mapillary_pair(split: str, key: str) -> tuple[str, str]:
    return f"{split}/images/{key}.jpg", f"{split}/v1.2/labels/{key}.png"


def read_gps(path: str, keys: set[str]) -> dict[str, tuple[float, float, str]]:
    """``image -> (latitude, longitude, continent)`` of a GPS CSV; rows without coordinates are skipped. Errors
    (missing columns, an image not in the training set, a repeated image, a coordinate out of range) name the file
    and the row."""
    if not exists(path):
        raise FileNotFoundError(f"GPS file {path!r} does not exist")
    reader = csv.DictReader(io.StringIO(read_text(path, "GPS file")))
    need = {"image", "latitude", "longitude", "continent"}
    if reader.fieldnames is None or not need <= set(reader.fieldnames):
        raise ValueError(f"GPS file {path!r} must have the columns {', '.join(sorted(need))}, got {reader.fieldnames}")
    out: dict[str, tuple[float, float, str]] = {}
    for n, row in enumerate(reader, 2):
        key = (row["image"] or "").strip()
        key = re.sub(r"\.jpg$", "", Path(key).name)
        if key not in keys:
            raise ValueError(f"GPS file {path!r} line {n}: image {key!r} is not in training/images")
        if key in out:
            raise ValueError(f"GPS file {path!r} line {n}: image {key!r} is listed twice")
        lat, lon, cont = (row["latitude"] or "").strip(), (row["longitude"] or "").strip(), (row["continent"] or "").strip()
        if not lat or not lon:
            continue  # no coordinates: dropped, as the thesis drops them
        try:
            la, lo = float(lat), float(lon)
        except ValueError:
            raise ValueError(f"GPS file {path!r} line {n}: latitude/longitude {lat!r}, {lon!r} are not numbers") from None
        if not (-90 <= la <= 90 and -180 <= lo <= 180) or not cont:
            raise ValueError(f"GPS file {path!r} line {n}: need latitude in [-90, 90], longitude in [-180, 180] "
                             f"and a continent, got {lat}, {lon}, {cont!r}")
        out[key] = (la, lo, cont)
    if not out:
        raise ValueError(f"GPS file {path!r} gives coordinates for no image")
    return out


def gps_clients(gps: dict[str, tuple[float, float, str]], images_per_client: int, seed: int
                ) -> tuple[list[str], list[list[str]], list[str]]:
    """Client names (``{continent}{j}``), their image keys and their continents: k-means per continent."""
    from sklearn.cluster import KMeans

    names: list[str] = []
    members: list[list[str]] = []
    conts: list[str] = []
    for cont in sorted({c for _, _, c in gps.values()}):
        keys = sorted(k for k, v in gps.items() if v[2] == cont)
        xy = np.array([gps[k][:2] for k in keys], dtype=np.float64)
        k = min(len(keys), max(1, round(len(keys) / images_per_client)))
        labels = KMeans(n_clusters=k, n_init=10, random_state=seed).fit_predict(xy) if k > 1 else np.zeros(len(keys), int)
        order = []  # clusters by their first image (sorted keys), so names do not depend on k-means' numbering
        for lab in labels:
            if lab not in order:
                order.append(lab)
        for j, lab in enumerate(order):
            names.append(f"{cont}{j}")
            members.append([key for key, l_ in zip(keys, labels) if l_ == lab])
            conts.append(cont)
    return names, members, conts


@DATASETS.register("mapillary", params=MapillaryParams, task="segmentation",
                   help="Mapillary Vistas v1.2 mapped to the 19 Cityscapes classes, with LADD's per-continent GPS "
                   "k-means split")
def load_mapillary(params: MapillaryParams, *, seed: int) -> SegmentationData:
    """Mapillary Vistas v1.2 (module docstring); domain = continent with a split, else ``mapillary``."""
    del seed
    root = Path(params.root)
    _require_dir(root, "Mapillary")
    if params.split_files is not None and params.gps_file is not None:
        raise ValueError("mapillary: set split_files or gps_file, not both (each fixes the clients)")
    clients = names = None
    if params.split_files is not None:
        names, xs, ys = _read_splits(params.split_files, labelled=True)
        train = [(x, y) for ux, uy in zip(xs, ys) for x, y in zip(ux, uy)]
        train_dom = [re.sub(r"\d+$", "", u) for u, ux in zip(names, xs) for _ in ux]
        clients = _client_arrays([list(zip(ux, uy)) for ux, uy in zip(xs, ys)])
    else:
        keys = [Path(f).stem for f in _scan(root / "training" / "images", (".jpg",), "Mapillary training image")]
        if params.gps_file is not None:
            names, members, conts = gps_clients(read_gps(params.gps_file, set(keys)), params.images_per_client,
                                                params.split_seed)
            train = [_mapillary_pair("training", k) for m in members for k in m]
            train_dom = [c for m, c in zip(members, conts) for _ in m]
            clients = _client_arrays([[_mapillary_pair("training", k) for k in m] for m in members])
        else:
            train = [_mapillary_pair("training", k) for k in keys]
            train_dom = ["mapillary"] * len(train)
    if params.test_file is not None:
        _, txs, tys = read_ladd_split(params.test_file, labelled=True)
        test = [(x, y) for ux, uy in zip(txs, tys) for x, y in zip(ux, uy)]
    else:
        test = [_mapillary_pair("validation", Path(f).stem)
                for f in _scan(root / "validation" / "images", (".jpg",), "Mapillary validation image")]
    test_dom = ["mapillary-val"] * len(test)
    dom_names, ids = _domain_ids(train_dom, [test_dom])
    lut = lut_from_map(MAPILLARY_LABEL_MAP)
    return SegmentationData(
        train=_make_set(root, root, train, train_dom, ids, lut, params.resize),
        tests={"test": _make_set(root, root, test, test_dom, ids, lut, params.resize)},
        class_names=list(CITYSCAPES_CLASSES), domain_names=dom_names, clients=clients, client_names=names,
    )
