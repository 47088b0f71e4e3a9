"""Classification loaders: digits, ImageFolder and MedMNIST-style .npz, checked against independent reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from fedsight.data import ArrayDataset, DatasetSplits, load_dataset
from fedsight.data.base import StoredDataset
from fedsight.registry import DATASETS


def eager(splits: DatasetSplits) -> DatasetSplits:
    """An ImageFolder's lazy splits decoded into memory (what its batches hold)."""
    assert isinstance(splits.train, StoredDataset) and isinstance(splits.test, StoredDataset)
    return DatasetSplits(train=splits.train.materialize(), test=splits.test.materialize())


def check_types(splits: DatasetSplits) -> None:
    assert isinstance(splits, DatasetSplits)
    for ds in (splits.train, splits.test):
        assert isinstance(ds, ArrayDataset)
        assert ds.x.dtype == torch.float32 and ds.y.dtype == torch.int64
        assert ds.x.ndim == 4
        assert float(ds.x.min()) >= 0.0 and float(ds.x.max()) <= 1.0
        assert ds.num_classes == splits.train.num_classes


def rows_as_multiset(a: np.ndarray) -> np.ndarray:
    a = a.reshape(len(a), -1)
    return a[np.lexsort(a.T[::-1])]


def test_registered() -> None:
    assert {"digits", "imagefolder", "npz"} <= set(DATASETS.names())


# --------------------------------------------------------------------------------------------- digits


def test_digits_matches_sklearn() -> None:
    from sklearn.datasets import load_digits

    ref = load_digits()
    splits = load_dataset("digits", None, seed=0)
    check_types(splits)
    assert len(splits.train) + len(splits.test) == 1797 == len(ref.target)
    assert splits.num_classes == 10 and splits.in_channels == 1 and splits.image_size == 8
    assert float(splits.train.x.max()) == 1.0  # 16 / 16
    # the union of both splits is exactly sklearn's images (0..16 scaled by 1/16) with their labels
    x = torch.cat([splits.train.x, splits.test.x]).numpy().reshape(1797, 64) * 16
    y = torch.cat([splits.train.y, splits.test.y]).numpy()
    ours = np.column_stack([x, y])
    theirs = np.column_stack([ref.data, ref.target])
    assert np.allclose(rows_as_multiset(ours), rows_as_multiset(theirs))
    assert len(splits.test) == pytest.approx(0.2 * 1797, abs=1)
    # stratified: each class's test share is close to the test fraction
    for c in range(10):
        n_c = int((ref.target == c).sum())
        assert abs(int((splits.test.y == c).sum()) - 0.2 * n_c) <= 1


def test_digits_test_set_fixed_by_split_seed_not_run_seed() -> None:
    a = load_dataset("digits", {"test_fraction": 0.3}, seed=0)
    b = load_dataset("digits", {"test_fraction": 0.3}, seed=123)
    c = load_dataset("digits", {"test_fraction": 0.3, "split_seed": 1}, seed=0)
    assert torch.equal(a.test.x, b.test.x) and torch.equal(a.test.y, b.test.y)
    assert not torch.equal(a.test.x, c.test.x)
    assert len(a.test) == pytest.approx(0.3 * 1797, abs=1)


@pytest.mark.parametrize("bad", [{"test_fraction": 0.0}, {"test_fraction": 1.0}, {"nope": 1}])
def test_digits_params_validated(bad) -> None:
    with pytest.raises(ValueError):
        load_dataset("digits", bad, seed=0)


# ---------------------------------------------------------------------------------------- imagefolder


def write_folder(root, classes=("zebra", "ant", "bee"), per_class=4, seed=0):
    """Per class: a greyscale 10x7 PNG, an RGB JPEG with an upper-case .JPG suffix and RGB PNGs of other sizes,
    plus a text file and a hidden file that must be ignored. Returns {path: class name}."""
    rng = np.random.default_rng(seed)
    written = {}
    for name in classes:
        d = root / name
        d.mkdir(parents=True)
        for i in range(per_class):
            if i == 0:
                im = Image.fromarray(rng.integers(0, 256, size=(7, 10), dtype=np.uint8), "L")
                path = d / f"img{i}.png"
            elif i == 1:
                im = Image.fromarray(rng.integers(0, 256, size=(20, 24, 3), dtype=np.uint8), "RGB")
                path = d / f"img{i}.JPG"
            else:
                im = Image.fromarray(rng.integers(0, 256, size=(16 + i, 12, 3), dtype=np.uint8), "RGB")
                path = d / f"img{i}.png"
            im.save(path)
            written[path] = name
        (d / "notes.txt").write_text("not an image")
        (d / ".hidden.png").write_bytes(b"not an image either")
    (root / "README.md").write_text("top-level files are ignored")
    return written


def reference_image(path, size, channels) -> np.ndarray:
    with Image.open(path) as im:
        im = im.convert("L" if channels == 1 else "RGB").resize((size, size), Image.Resampling.BILINEAR)
        arr = np.asarray(im, dtype=np.float32) / 255.0
    return arr[None] if channels == 1 else arr.transpose(2, 0, 1)


@pytest.mark.parametrize("channels", [3, 1])
def test_imagefolder_with_test_dir(tmp_path, channels) -> None:
    train = write_folder(tmp_path / "train", seed=1)
    test = write_folder(tmp_path / "test", per_class=2, seed=2)
    splits = eager(load_dataset(
        "imagefolder",
        {"train_dir": str(tmp_path / "train"), "test_dir": str(tmp_path / "test"), "image_size": 9, "channels": channels},
        seed=0,
    ))
    check_types(splits)
    classes = sorted(["zebra", "ant", "bee"])
    assert splits.train.class_names == classes and splits.test.class_names == classes
    assert splits.num_classes == 3 and splits.in_channels == channels and splits.image_size == 9
    assert tuple(splits.train.x.shape) == (12, channels, 9, 9)
    assert tuple(splits.test.x.shape) == (6, channels, 9, 9)
    assert np.bincount(splits.train.labels, minlength=3).tolist() == [4, 4, 4]
    # every file appears once, with its class's label, and pixels equal an independent PIL read
    for files, ds in ((train, splits.train), (test, splits.test)):
        xs = ds.x.numpy()
        for path, name in files.items():
            ref = reference_image(path, 9, channels)
            hits = [i for i in range(len(xs)) if np.allclose(xs[i], ref, atol=1e-6)]
            assert len(hits) == 1, path
            assert ds.class_names[int(ds.y[hits[0]])] == name


def test_imagefolder_split_when_no_test_dir(tmp_path) -> None:
    write_folder(tmp_path, per_class=10)
    params = {"train_dir": str(tmp_path), "test_fraction": 0.2, "image_size": 6}
    splits = eager(load_dataset("imagefolder", params, seed=0))
    check_types(splits)
    assert len(splits.train) + len(splits.test) == 30
    assert len(splits.test) == 6
    assert np.bincount(splits.test.labels, minlength=3).tolist() == [2, 2, 2]  # stratified
    again = eager(load_dataset("imagefolder", params, seed=99))
    assert torch.equal(splits.test.x, again.test.x)
    # train and test are disjoint: no test image appears in train
    tr = splits.train.x.reshape(len(splits.train), -1)
    for row in splits.test.x.reshape(len(splits.test), -1):
        assert not any(torch.equal(row, r) for r in tr)


def test_imagefolder_corrupt_file_names_it(tmp_path) -> None:
    write_folder(tmp_path)
    bad = tmp_path / "bee" / "x.png"
    bad.write_bytes(b"\x00garbage bytes, not a PNG" * 10)
    with pytest.raises(ValueError, match="x.png") as err:
        load_dataset("imagefolder", {"train_dir": str(tmp_path)}, seed=0)
    assert str(bad) in str(err.value)


def test_imagefolder_truncated_file_names_it(tmp_path) -> None:
    """A truncated file passes the header check and fails when decoded, naming the file; a truncated
    training image fails when the task is built (its statistics pass decodes the whole pool), before any
    run directory exists."""
    from fedsight.api import build_task
    from fedsight.config import validate

    from helpers import tiny

    write_folder(tmp_path / "tree", per_class=6)
    good = tmp_path / "tree" / "ant" / "img2.png"
    data = good.read_bytes()
    good.write_bytes(data[: len(data) // 2])
    splits = load_dataset("imagefolder", {"train_dir": str(tmp_path / "tree"), "test_fraction": 0.2}, seed=0)
    with pytest.raises(ValueError) as err:
        eager(splits)
    assert str(good) in str(err.value)
    cfg = validate(tiny(**{"data": {"name": "imagefolder", "train_dir": str(tmp_path / "tree"), "image_size": 8},
                           "partition": {"name": "iid", "num_clients": 2}, "server.clients_per_round": 2,
                           "run.output_dir": str(tmp_path / "runs")}))
    with pytest.raises(ValueError, match="img2.png"):
        build_task(cfg)
    assert not (tmp_path / "runs").exists()


def test_imagefolder_missing_and_empty_dirs(tmp_path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError) as err:
        load_dataset("imagefolder", {"train_dir": str(missing)}, seed=0)
    assert str(missing) in str(err.value)

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "file.png").write_bytes(b"")  # a file, not a class folder
    with pytest.raises(ValueError) as err:
        load_dataset("imagefolder", {"train_dir": str(empty)}, seed=0)
    assert str(empty) in str(err.value)

    root = tmp_path / "root"
    write_folder(root)
    (root / "void").mkdir()
    (root / "void" / "a.txt").write_text("no images here")
    with pytest.raises(ValueError) as err:
        load_dataset("imagefolder", {"train_dir": str(root)}, seed=0)
    assert str(root / "void") in str(err.value)


def test_imagefolder_test_dir_with_other_classes(tmp_path) -> None:
    write_folder(tmp_path / "train")
    write_folder(tmp_path / "test", classes=("ant", "bee", "wasp"))
    with pytest.raises(ValueError) as err:
        load_dataset("imagefolder", {"train_dir": str(tmp_path / "train"), "test_dir": str(tmp_path / "test")}, seed=0)
    msg = str(err.value)
    assert str(tmp_path / "test") in msg and "wasp" in msg and "zebra" in msg


def test_imagefolder_channels_validated(tmp_path) -> None:
    with pytest.raises(ValueError):
        load_dataset("imagefolder", {"train_dir": str(tmp_path), "channels": 2}, seed=0)


# ------------------------------------------------------------------------------------------------ npz


def write_npz(path, rgb=False, with_val=True, seed=0, label_shape="column", **extra):
    rng = np.random.default_rng(seed)
    shape = (28, 28, 3) if rgb else (28, 28)
    arrays = {}
    sizes = {"train": 30, "val": 8, "test": 12} if with_val else {"train": 30, "test": 12}
    for part, n in sizes.items():
        arrays[f"{part}_images"] = rng.integers(0, 256, size=(n, *shape), dtype=np.uint8)
        labels = rng.integers(0, 5, size=n).astype(np.uint8)
        arrays[f"{part}_labels"] = labels[:, None] if label_shape == "column" else labels
    arrays["test_labels"][0] = 6  # the largest label only occurs in the test split
    arrays.update(extra)
    np.savez(path, **arrays)
    return arrays


@pytest.mark.parametrize("rgb", [False, True])
@pytest.mark.parametrize("label_shape", ["column", "flat"])
def test_npz_medmnist_layout(tmp_path, rgb, label_shape) -> None:
    path = tmp_path / "pathmnist.npz"
    arrays = write_npz(path, rgb=rgb, label_shape=label_shape)
    splits = load_dataset("npz", {"path": str(path)}, seed=0)
    check_types(splits)
    c = 3 if rgb else 1
    assert tuple(splits.train.x.shape) == (30, c, 28, 28)
    assert tuple(splits.test.x.shape) == (12, c, 28, 28)
    assert splits.num_classes == 7 == splits.test.num_classes
    for part, ds in (("train", splits.train), ("test", splits.test)):
        ref = arrays[f"{part}_images"].astype(np.float32) / 255.0
        ref = ref[:, None] if not rgb else ref.transpose(0, 3, 1, 2)
        assert np.array_equal(ds.x.numpy(), ref)
        assert np.array_equal(ds.labels, arrays[f"{part}_labels"].reshape(-1).astype(np.int64))


def test_npz_include_val_and_resize(tmp_path) -> None:
    path = tmp_path / "m.npz"
    arrays = write_npz(path, rgb=True)
    splits = load_dataset("npz", {"path": str(path), "include_val_in_train": True, "image_size": 32}, seed=0)
    assert tuple(splits.train.x.shape) == (38, 3, 32, 32)
    expected_labels = np.concatenate([arrays["train_labels"], arrays["val_labels"]]).reshape(-1)
    assert np.array_equal(splits.train.labels, expected_labels)
    im = arrays["val_images"][3]
    ref = np.asarray(Image.fromarray(im).resize((32, 32), Image.Resampling.BILINEAR), dtype=np.float32) / 255.0
    assert np.allclose(splits.train.x[30 + 3].numpy(), ref.transpose(2, 0, 1), atol=1e-6)


def test_npz_missing_key_names_key_and_file(tmp_path) -> None:
    path = tmp_path / "broken.npz"
    np.savez(path, train_images=np.zeros((3, 4, 4), np.uint8), train_labels=np.zeros((3, 1), np.uint8),
             test_images=np.zeros((2, 4, 4), np.uint8))
    with pytest.raises(ValueError, match="test_labels") as err:
        load_dataset("npz", {"path": str(path)}, seed=0)
    assert str(path) in str(err.value)
    with pytest.raises(ValueError, match="val_images"):
        load_dataset("npz", {"path": str(path), "include_val_in_train": True}, seed=0)


def test_npz_rejects_multilabel_and_bad_files(tmp_path) -> None:
    path = tmp_path / "chest.npz"
    write_npz(path, with_val=False, train_labels=np.zeros((30, 14), np.uint8))
    with pytest.raises(ValueError, match="multi-label"):
        load_dataset("npz", {"path": str(path)}, seed=0)

    missing = tmp_path / "absent.npz"
    with pytest.raises(FileNotFoundError, match="absent.npz"):
        load_dataset("npz", {"path": str(missing)}, seed=0)

    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"definitely not a zip archive")
    with pytest.raises(ValueError, match="garbage.npz"):
        load_dataset("npz", {"path": str(garbage)}, seed=0)

    mismatch = tmp_path / "mismatch.npz"
    write_npz(mismatch, with_val=False, train_labels=np.zeros((29, 1), np.uint8))
    with pytest.raises(ValueError, match="train_labels"):
        load_dataset("npz", {"path": str(mismatch)}, seed=0)
