"""Semantic-segmentation dataset loaders: Cityscapes, IDDA (FedDrive's "IDDAsmall") and GTA5.

Every loader is registered in :data:`fedsight.registry.DATASETS` (``task="segmentation"``) as ``factory(params,
*, seed) -> SegmentationData`` and reads local files in their published layouts. Nothing is decoded at load
time: images and label maps are read when a batch needs them (``FileImageStore`` / ``FileLabelStore``), and
only file headers are read here, to check that every image has its label map and that both have one size.

FedDrive's split files (LEAF JSON: ``{"users", "num_samples", "user_data": {user: {"x": [...], "y": [...]}}}``)
give a predefined client split (``SegmentationData.clients``: one index array into the pool per user, in user
order) or a test set. Wherever a loader takes a split file, ``"path#user"`` selects one user of that file
(FedDrive's IDDA test files hold ``test_user_same_domain`` and ``test_user_diff_domain`` side by side), and a
list of files (FedDrive's Cityscapes train split is ``all_data_0.json`` .. ``all_data_23.json``) is read as
their users, file after file.

Domain ids index ``domain_names``: the sorted domains of the training pool first (ids ``0 .. k-1``), then the
sorted domains that only a test set has (e.g. Cityscapes' validation cities, IDDA's unseen scenarios).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import Field

from fedsight.data.segmentation import FileLabelStore, SegmentationData, SegmentationSet, lut_from_map
from fedsight.registry import DATASETS, Params
from fedsight.safe_read import exists, read_json, read_text_lines

# ------------------------------------------------------------------------------------------- class maps

CITYSCAPES_CLASSES = [
    "road", "sidewalk", "building", "wall", "fence", "pole", "traffic light", "traffic sign", "vegetation",
    "terrain", "sky", "person", "rider", "car", "truck", "bus", "train", "motorcycle", "bicycle",
]  # fmt: skip
#: Cityscapes labelId -> trainId (every other labelId is ignored); GTA5 labels carry the same labelIds
CITYSCAPES_LABEL_MAP = {
    7: 0, 8: 1, 11: 2, 12: 3, 13: 4, 17: 5, 19: 6, 20: 7, 21: 8, 22: 9, 23: 10, 24: 11, 25: 12, 26: 13, 27: 14,
    28: 15, 31: 16, 32: 17, 33: 18,
}  # fmt: skip
CITYSCAPES_VAL_CITIES = ("frankfurt", "lindau", "munster")
#: the 13 classes shared by GTA5/SYNTHIA and Cityscapes in CrossCity-style benchmarks (LADD)
CROSSCITY_CLASSES = [
    "road", "sidewalk", "building", "traffic light", "traffic sign", "vegetation", "sky", "person", "rider",
    "car", "bus", "motorcycle", "bicycle",
]  # fmt: skip
CROSSCITY_LABEL_MAP = {7: 0, 8: 1, 11: 2, 19: 3, 20: 4, 21: 5, 23: 6, 24: 7, 25: 8, 26: 9, 28: 10, 32: 11, 33: 12}
#: IDDA (FedDrive): ids 1..23 -> train ids 0..22, everything else ignored; the class names are not published
#: with the split files, so classes are named by train id
IDDA_NUM_CLASSES = 23
IDDA_CLASSES = [f"class_{i}" for i in range(IDDA_NUM_CLASSES)]
IDDA_LABEL_MAP = {i + 1: i for i in range(IDDA_NUM_CLASSES)}
#: FedDrive's 16-class ``remap`` (``src/dataset/idda.py``'s ``class_eval``, on in every FedDrive IDDA config):
#: label id i -> class_eval[i] for ids 0..20 (ids 6 and 7 share class 0; ids 0, 3, 14, 15 and 21.. are ignored)
IDDA_REMAP_CLASS_EVAL = (255, 2, 4, 255, 11, 5, 0, 0, 1, 8, 13, 3, 7, 6, 255, 255, 15, 14, 12, 9, 10)
IDDA_REMAP = {i: c for i, c in enumerate(IDDA_REMAP_CLASS_EVAL) if c != 255}
IDDA_REMAP_NUM_CLASSES = 16
IDDA_TOWNS = tuple(f"T0{k}" for k in range(1, 8))
IDDA_WEATHERS = ("CN", "CS", "HRN")
IDDA_VEHICLES = ("A", "B", "J", "M", "V")

Size = tuple[Annotated[int, Field(ge=1)], Annotated[int, Field(ge=1)]]
_RESIZE = "None: native size; [height, width]: images resized bilinearly, label maps nearest, when read"

# ------------------------------------------------------------------------------------------ split files


def _rel(p: str) -> str:
    """A path of a split file or list as a relative POSIX path (a leading ``/`` is the dataset root)."""
    return p.replace("\\", "/").lstrip("/")


def read_leaf_split(
    path: str | os.PathLike[str], x_root: str | os.PathLike[str] | None = None,
    y_root: str | os.PathLike[str] | None = None,
) -> tuple[list[str], list[list[tuple[str, str]]]]:
    """A LEAF-style split file: its users and each user's ``(x, y)`` relative paths, in file order.

    Checks the structure, ``num_samples[i] == len(x) == len(y)`` for every user, and, when ``x_root`` /
    ``y_root`` are given, that every listed file exists under them. Errors (``FileNotFoundError`` for a
    missing file, ``ValueError`` otherwise) name the split file, the user and the offending file.
    """
    path = os.fspath(path)
    if not exists(path):
        raise FileNotFoundError(f"split file {path!r} does not exist")
    data = read_json(path, "split file")  # bounded: regular file, size, UTF-8, nesting, digits (fedsight.safe_read)
    if not (isinstance(data, dict) and isinstance(data.get("users"), list) and isinstance(data.get("user_data"), dict)):
        raise ValueError(f"split file {path!r} is not a LEAF split (expected keys 'users', 'num_samples', 'user_data')")
    users, user_data, counts = data["users"], data["user_data"], data.get("num_samples")
    if not users or not all(isinstance(u, str) for u in users) or len(set(users)) != len(users):
        raise ValueError(f"split file {path!r}: 'users' must be a non-empty list of distinct names")
    if counts is not None and (not isinstance(counts, list) or len(counts) != len(users)):
        raise ValueError(f"split file {path!r}: 'num_samples' must list one count per user ({len(users)} users)")
    extra = sorted(set(user_data) - set(users))
    if extra:
        raise ValueError(f"split file {path!r}: user_data has users that 'users' does not list: {extra[:5]}")
    pairs: list[list[tuple[str, str]]] = []
    for i, user in enumerate(users):
        entry = user_data.get(user)
        if not isinstance(entry, dict) or not isinstance(entry.get("x"), list) or not isinstance(entry.get("y"), list):
            raise ValueError(f"split file {path!r}: user {user!r} has no 'x' and 'y' lists in user_data")
        xs, ys = entry["x"], entry["y"]
        if not all(isinstance(v, str) for v in xs + ys):
            raise ValueError(f"split file {path!r}: user {user!r}: 'x' and 'y' must be lists of paths")
        if len(xs) != len(ys) or (counts is not None and counts[i] != len(xs)):
            raise ValueError(
                f"split file {path!r}: user {user!r} has num_samples {counts[i] if counts is not None else '-'} "
                f"but {len(xs)} images (x) and {len(ys)} label maps (y)"
            )
        if not xs:
            raise ValueError(f"split file {path!r}: user {user!r} has no images")
        pairs.append([(_rel(x), _rel(y)) for x, y in zip(xs, ys)])
    _check_listed(path, users, pairs, x_root, y_root)
    return list(users), pairs


def _check_listed(
    path: str, users: Sequence[str], pairs: Sequence[Sequence[tuple[str, str]]],
    x_root: str | os.PathLike[str] | None, y_root: str | os.PathLike[str] | None,
) -> None:
    """Every file the users of a split file list exists under ``x_root`` / ``y_root`` (None: not checked)."""
    for user, user_pairs in zip(users, pairs):
        for root, k, what in ((x_root, 0, "image"), (y_root, 1, "label map")):
            if root is None:
                continue
            for pair in user_pairs:
                if not (Path(root) / pair[k]).is_file():
                    raise FileNotFoundError(
                        f"split file {path!r}: user {user!r} lists {what} {pair[k]!r}, but "
                        f"{str(Path(root) / pair[k])!r} does not exist"
                    )


def _read_split_ref(
    ref: str, x_root: Path, y_root: Path
) -> tuple[list[str], list[list[tuple[str, str]]]]:
    """``read_leaf_split`` of ``"path"`` (every user) or ``"path#user"`` (that user only)."""
    path, user = ref, None
    if not exists(ref) and "#" in ref:
        path, user = ref.rsplit("#", 1)
    if user is None:
        return read_leaf_split(path, x_root, y_root)
    users, pairs = read_leaf_split(path)
    if user not in users:
        raise ValueError(f"split file {path!r} has no user {user!r} (users: {', '.join(users[:10])})")
    chosen = [pairs[users.index(user)]]
    _check_listed(path, [user], chosen, x_root, y_root)
    return [user], chosen


def _read_split_refs(
    refs: str | Sequence[str], x_root: Path, y_root: Path
) -> tuple[list[str], list[list[tuple[str, str]]]]:
    """The users of one or more split files, file after file (user names must not repeat)."""
    users: list[str] = []
    pairs: list[list[tuple[str, str]]] = []
    for ref in [refs] if isinstance(refs, str) else refs:
        u, p = _read_split_ref(ref, x_root, y_root)
        dup = sorted(set(u) & set(users))
        if dup:
            raise ValueError(f"split file {ref!r} repeats users of an earlier split file: {dup[:5]}")
        users += u
        pairs += p
    return users, pairs


# -------------------------------------------------------------------------------------------- checks


def _header(path: Path, label: bool) -> tuple[int, int]:
    """``(width, height)`` of an image file from its header; a label map must be single-channel or palette."""
    from PIL import Image, UnidentifiedImageError

    what = "label map" if label else "image file"
    try:
        with Image.open(path) as im:
            size, mode = im.size, im.mode
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise ValueError(f"cannot read {what} {str(path)!r}: {type(e).__name__}: {e}") from e
    if label and mode not in ("L", "P", "I", "I;16", "I;16B", "I;16L"):
        raise ValueError(f"label map {str(path)!r} must be a single-channel or palette image, got mode {mode}")
    return size


def _check_pair(pair: tuple[Path, Path]) -> tuple[int, int]:
    """``(height, width)`` of a checked pair."""
    image, label = pair
    if not image.is_file():
        raise FileNotFoundError(f"image file {str(image)!r} does not exist")
    if not label.is_file():
        raise FileNotFoundError(f"label map {str(label)!r} of image {str(image)!r} does not exist")
    si, sl = _header(image, False), _header(label, True)
    if si != sl:
        raise ValueError(
            f"image {str(image)!r} is {si[0]}x{si[1]} but its label map {str(label)!r} is {sl[0]}x{sl[1]} "
            "(width x height)"
        )
    return si[1], si[0]


def check_pairs(images: Sequence[Path], labels: Sequence[Path]) -> np.ndarray:
    """Every image and its label map exist, are readable images (headers only) and have the same size; their
    ``[N, 2]`` (height, width). The first problem (in list order) is raised, naming the files."""
    pairs = list(zip(images, labels))
    if len(pairs) < 64:
        sizes = [_check_pair(pair) for pair in pairs]
    else:
        with ThreadPoolExecutor(max_workers=16) as pool:  # headers of a large tree: I/O bound
            sizes = [fut.result() for fut in [pool.submit(_check_pair, pair) for pair in pairs]]
    return np.array(sizes, dtype=np.int64).reshape(len(pairs), 2)


def _make_set(
    root_x: Path, root_y: Path, pairs: Sequence[tuple[str, str]], domains: Sequence[str],
    domain_ids: dict[str, int], lut: np.ndarray, resize: tuple[int, int] | None,
) -> SegmentationSet:
    """A lazy ``SegmentationSet`` of ``(image, label)`` paths relative to ``root_x`` / ``root_y``, checked with
    :func:`check_pairs`; names are the image paths as given."""
    from fedsight.data.pipeline import FileImageStore

    images = [root_x / x for x, _ in pairs]
    labels = [root_y / y for _, y in pairs]
    sizes = check_pairs(images, labels)
    size = None if resize is None else (int(resize[0]), int(resize[1]))
    if size is not None:
        sizes[:] = size
    return SegmentationSet(
        FileImageStore(images, size, 3), FileLabelStore(labels, lut, size),
        np.array([domain_ids[d] for d in domains], dtype=np.int64), [x for x, _ in pairs], sizes,
    )


def _domain_ids(train: Sequence[str], tests: Sequence[Sequence[str]]) -> tuple[list[str], dict[str, int]]:
    """Domain names (the training pool's sorted, then test-only ones sorted) and their ids."""
    names = sorted(set(train))
    names += sorted({d for t in tests for d in t} - set(names))
    return names, {d: i for i, d in enumerate(names)}


def _client_arrays(pairs: list[list[tuple[str, str]]]) -> list[np.ndarray]:
    bounds = np.cumsum([0] + [len(p) for p in pairs]).tolist()
    return [np.arange(a, b, dtype=np.int64) for a, b in itertools.pairwise(bounds)]


def _require_dir(path: Path, what: str) -> None:
    if not path.is_dir():
        raise FileNotFoundError(f"{what} folder {str(path)!r} does not exist")


# ---------------------------------------------------------------------------------------------- cityscapes


class CityscapesParams(Params):
    root: str = Field(description="Cityscapes root, holding leftImg8bit/{split}/{city}/ and gtFine/{split}/{city}/")
    train_split: str = Field("train", description="split folder of the training pool (when split_file is unset)")
    test_split: str = Field("val", description="split folder of the test set (when test_file is unset)")
    cities: list[str] | None = Field(
        None, description="keep only these cities of train_split in the training pool (not with split_file)"
    )
    split_file: str | list[str] | None = Field(
        None,
        description="FedDrive split JSON (or a list of them, e.g. all_data_0..23.json; 'path#user' = one user): "
        "the training pool is exactly its users' images in user order, one predefined client per user",
    )
    test_file: str | None = Field(None, description="FedDrive test JSON ('path#user' = one user) instead of test_split")
    resize: Size | None = Field(None, description=_RESIZE)


def _scan_cityscapes(root: Path, split: str, cities: Sequence[str] | None) -> list[tuple[str, str]]:
    """``(image, label)`` paths relative to ``leftImg8bit/`` and ``gtFine/`` of one split, by city then file."""
    folder = root / "leftImg8bit" / split
    _require_dir(folder, f"Cityscapes {split!r} image")
    _require_dir(root / "gtFine" / split, f"Cityscapes {split!r} label")
    present = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    if cities is not None:
        missing = [c for c in cities if c not in present]
        if missing:
            raise FileNotFoundError(f"Cityscapes city folder {str(folder / missing[0])!r} does not exist")
        present = sorted(set(cities))
    pairs = []
    for city in present:
        for f in sorted((folder / city).glob("*_leftImg8bit.png")):
            stem = f.name[: -len("_leftImg8bit.png")]
            pairs.append((f"{split}/{city}/{f.name}", f"{split}/{city}/{stem}_gtFine_labelIds.png"))
    if not pairs:
        raise ValueError(f"Cityscapes folder {str(folder)!r} has no *_leftImg8bit.png images")
    return pairs


def _city(x: str) -> str:
    return Path(x).parent.name


@DATASETS.register("cityscapes", params=CityscapesParams, task="segmentation",
                   help="Cityscapes fine annotations (19 classes), optionally with FedDrive's client split")
def load_cityscapes(params: CityscapesParams, *, seed: int) -> SegmentationData:
    """Cityscapes ``leftImg8bit`` / ``gtFine_labelIds`` (labelIds mapped to the 19 train ids); domain = city."""
    del seed
    root = Path(params.root)
    x_root, y_root = root / "leftImg8bit", root / "gtFine"
    _require_dir(x_root, "Cityscapes leftImg8bit")
    _require_dir(y_root, "Cityscapes gtFine")
    clients = client_names = None
    if params.split_file is not None:
        if params.cities is not None:
            raise ValueError("cityscapes: cities and split_file cannot both be set (the split file fixes the pool)")
        client_names, user_pairs = _read_split_refs(params.split_file, x_root, y_root)
        train = [p for ps in user_pairs for p in ps]
        clients = _client_arrays(user_pairs)
    else:
        train = _scan_cityscapes(root, params.train_split, params.cities)
    if params.test_file is not None:
        test = [p for ps in _read_split_ref(params.test_file, x_root, y_root)[1] for p in ps]
    else:
        test = _scan_cityscapes(root, params.test_split, None)
    train_dom, test_dom = [_city(x) for x, _ in train], [_city(x) for x, _ in test]
    names, ids = _domain_ids(train_dom, [test_dom])
    lut = lut_from_map(CITYSCAPES_LABEL_MAP)
    return SegmentationData(
        train=_make_set(x_root, y_root, train, train_dom, ids, lut, params.resize),
        tests={"test": _make_set(x_root, y_root, test, test_dom, ids, lut, params.resize)},
        class_names=list(CITYSCAPES_CLASSES), domain_names=names, clients=clients, client_names=client_names,
    )


# ------------------------------------------------------------------------------------------------- idda


class IDDAParams(Params):
    root: str = Field(description="the IDDAsmall folder, holding {T0k}_{W}_{V}/RGB/*.jpg and .../Semantic/*.png")
    train_split: str | list[str] = Field(
        description="FedDrive train JSON (paths relative to root; 'path#user' = one user): the training pool, "
        "one predefined client per user"
    )
    test_splits: dict[str, str] = Field(
        description="test set name -> FedDrive test JSON ('path#user' = one user, e.g. "
        "'test.json#test_user_same_domain'); the first is the run's 'test' set (metrics test/*), the others "
        "are logged as test_<name>/*"
    )
    resize: Size | None = Field(None, description=_RESIZE)
    remap: bool = Field(False, description="FedDrive's 16-class mapping (its configs' 'remap', used by every "
                        "FedDrive IDDA table); false: ids 1..23 -> 23 classes")


def _scenario(x: str, y: str, what: str) -> str:
    px, py = Path(x).parts, Path(y).parts
    sx = px[0] if len(px) > 1 else None
    if sx is None or len(py) < 2 or py[0] != sx:
        raise ValueError(
            f"{what}: image {x!r} and label map {y!r} must lie in one scenario folder {{T0k}}_{{W}}_{{V}}/"
        )
    return sx


@DATASETS.register("idda", params=IDDAParams, task="segmentation",
                   help="IDDA (FedDrive's IDDAsmall, 23 classes or FedDrive's 16 with remap) with FedDrive's "
                   "client and test splits")
def load_idda(params: IDDAParams, *, seed: int) -> SegmentationData:
    """IDDA scenarios ``{T0k}_{W}_{V}`` (town, weather, vehicle): label ids 1..23 -> 0..22, or with ``remap``
    FedDrive's 16 classes (``IDDA_REMAP``; the FedDrive release's ``remap`` flag, which every FedDrive IDDA config
    sets, so only ``remap = true`` numbers compare with the thesis's Tables 5.3-5.5); domain = scenario. The
    class names are not published: ``class_0`` ... ."""
    del seed
    root = Path(params.root)
    _require_dir(root, "IDDA")
    if not params.test_splits:
        raise ValueError("idda: test_splits must name at least one test split file")
    client_names, user_pairs = _read_split_refs(params.train_split, root, root)
    train = [p for ps in user_pairs for p in ps]
    tests = {name: [p for ps in _read_split_ref(ref, root, root)[1] for p in ps]
             for name, ref in params.test_splits.items()}
    train_dom = [_scenario(x, y, f"idda split {params.train_split!r}") for x, y in train]
    test_dom = {n: [_scenario(x, y, f"idda split {params.test_splits[n]!r}") for x, y in t] for n, t in tests.items()}
    names, ids = _domain_ids(train_dom, list(test_dom.values()))
    lut = lut_from_map(IDDA_REMAP if params.remap else IDDA_LABEL_MAP)
    classes = [f"class_{i}" for i in range(IDDA_REMAP_NUM_CLASSES)] if params.remap else list(IDDA_CLASSES)
    sets = {n: _make_set(root, root, t, test_dom[n], ids, lut, params.resize) for n, t in tests.items()}
    first = next(iter(params.test_splits))
    return SegmentationData(
        train=_make_set(root, root, train, train_dom, ids, lut, params.resize),
        tests={"test": sets[first], **{n: s for n, s in sets.items() if n != first}}, class_names=classes,
        domain_names=names,
        clients=_client_arrays(user_pairs), client_names=client_names,
    )


# ------------------------------------------------------------------------------------------------- gta5


class GTA5Params(Params):
    root: str = Field(description="GTA5 root, holding images/NNNNN.png and labels/NNNNN.png (Cityscapes labelIds)")
    classes: Literal[19, 13] = Field(19, description="19: the Cityscapes classes; 13: the CrossCity classes (LADD)")
    split_list: str | None = Field(
        None, description="LADD-style list, one '/images/NNNNN.png /labels/NNNNN.png' per line: the images used"
    )
    test_fraction: float = Field(0.1, gt=0, lt=1, description="fraction held out as the test set (GTA5 has none)")
    split_seed: int = Field(0, ge=0, description="seed of the train/test split (independent of the run seed)")
    resize: Size | None = Field(None, description=_RESIZE)


def read_image_list(path: str | os.PathLike[str]) -> list[tuple[str, str]]:
    """``(image, label)`` relative paths of a list with lines ``/images/X.png /labels/X.png`` (a line with
    only the image means ``labels/<same name>``; blank lines and ``#`` comments are skipped)."""
    path = os.fspath(path)
    if not exists(path):
        raise FileNotFoundError(f"split list {path!r} does not exist")
    pairs = []
    # bounded: a regular file, its size, strict UTF-8 naming the line (fedsight.safe_read)
    for n, line in enumerate(read_text_lines(path, "split list"), 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) > 2:
            raise ValueError(f"split list {path!r} line {n}: expected 'image [label]', got {line.strip()!r}")
        x = _rel(fields[0])
        pairs.append((x, _rel(fields[1]) if len(fields) == 2 else f"labels/{Path(x).name}"))
    if not pairs:
        raise ValueError(f"split list {path!r} lists no images")
    return pairs


@DATASETS.register("gta5", params=GTA5Params, task="segmentation",
                   help="GTA5 (synthetic, Cityscapes labelIds; 19 or 13 classes), a held-out test fraction")
def load_gta5(params: GTA5Params, *, seed: int) -> SegmentationData:
    """GTA5 ``images/`` and ``labels/`` (palette PNGs: their indices are the labelIds); one domain ``gta5``.
    The test set is a deterministic ``test_fraction`` of the images (``split_seed``), sorted, as is the pool."""
    from sklearn.model_selection import train_test_split

    del seed
    root = Path(params.root)
    _require_dir(root / "images", "GTA5 images")
    if params.split_list is not None:
        pairs = read_image_list(params.split_list)
    else:
        _require_dir(root / "labels", "GTA5 labels")
        files = sorted(p.name for p in (root / "images").glob("*.png") if not p.name.startswith("."))
        if not files:
            raise ValueError(f"GTA5 folder {str(root / 'images')!r} has no .png images")
        pairs = [(f"images/{f}", f"labels/{f}") for f in files]
    n = len(pairs)
    n_test = int(np.ceil(params.test_fraction * n))
    if n_test < 1 or n - n_test < 1:
        raise ValueError(
            f"gta5: test_fraction={params.test_fraction} leaves an empty training or test set of {n} images"
        )
    tr, te = train_test_split(np.arange(n), test_size=n_test, random_state=params.split_seed, shuffle=True)
    classes, mapping = (
        (CITYSCAPES_CLASSES, CITYSCAPES_LABEL_MAP) if params.classes == 19 else (CROSSCITY_CLASSES, CROSSCITY_LABEL_MAP)
    )
    lut, ids = lut_from_map(mapping), {"gta5": 0}

    def part(idx: np.ndarray) -> SegmentationSet:
        sel = [pairs[int(i)] for i in np.sort(idx)]
        return _make_set(root, root, sel, ["gta5"] * len(sel), ids, lut, params.resize)

    return SegmentationData(train=part(tr), tests={"test": part(te)}, class_names=list(classes), domain_names=["gta5"])
