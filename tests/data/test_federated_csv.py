"""federated_csv: Hsu et al.'s federated CSV splits (Landmarks-User-160k, iNaturalist-User-120k / Geo-*) read from
tiny files in the release's format (header names, any column order, iNaturalist's extra `label` column, GLDv2's
nested image folders), one predefined client per user."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from PIL import Image

import fedsight
from fedsight.config import ConfigError
from fedsight.data import load_dataset

from helpers import tiny

PATTERN = "train/{image_id[0]}/{image_id[1]}/{image_id}.png"  # GLDv2's layout, two levels deep
#: user -> that user's (image_id, class) rows, in the order the CSV lists them (users interleaved on purpose)
ROWS = [("u7", "ab01", "10"), ("u3", "cd02", "2"), ("u7", "ab03", "7"), ("u7", "ef04", "2"), ("u9", "gh05", "7"),
        ("u3", "ij06", "10")]
TEST = [("kl07", "2"), ("mn08", "10"), ("op09", "7")]


def _image(path, value):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((9, 11, 3), value, dtype=np.uint8), "RGB").save(path)


def _csv(path, header, rows):
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return str(path)


@pytest.fixture
def split(tmp_path):
    root = tmp_path / "gldv2"
    for k, (_, image_id, _) in enumerate(ROWS):
        _image(root / PATTERN.format(image_id=image_id), 20 * k)
    for k, (image_id, _) in enumerate(TEST):
        _image(root / PATTERN.format(image_id=image_id), 200 + k)
    train = _csv(tmp_path / "federated_train.csv", ["class", "label", "image_id", "user_id"],
                 [(c, f"species {c}", i, u) for u, i, c in ROWS])
    test = _csv(tmp_path / "test.csv", ["image_id", "class"], TEST)
    return {"root": str(root), "train_csv": train, "test_csv": test, "image_pattern": PATTERN, "image_size": 8}


def test_users_become_predefined_clients_in_first_seen_order_and_classes_sort_numerically(split):
    data = load_dataset("federated_csv", split)
    assert data.client_names == ["u7", "u3", "u9"]
    assert data.client_of.tolist() == [0, 0, 0, 1, 1, 2]  # each user's rows in CSV order, users as first seen
    assert data.train.class_names == ["2", "7", "10"]  # numerically, not "10" < "2"
    assert data.train.labels.tolist() == [2, 1, 0, 0, 2, 1]  # classes 10, 7, 2 (u7), 2, 10 (u3), 7 (u9)
    assert data.test.labels.tolist() == [0, 2, 1]
    # the pool is read in that order: the 4th pool image is u3's first (cd02, the 2nd file written: value 20)
    x = data.train.materialize().x
    assert x.shape == (6, 3, 8, 8) and x[3].mean().item() == pytest.approx(20 / 255, abs=1e-6)


def test_min_images_drops_small_users_as_the_personalisation_splits_do(split):
    data = load_dataset("federated_csv", {**split, "min_images": 2})
    assert data.client_names == ["u7", "u3"] and data.client_of.tolist() == [0, 0, 0, 1, 1]
    with pytest.raises(ValueError, match=r"no user of data.train_csv .* has data.min_images = 4 images \(the largest has 3\)"):
        load_dataset("federated_csv", {**split, "min_images": 4})


def test_a_run_trains_each_user_as_its_client(split, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    raw = tiny(**{"server.rounds": 1, "eval.every": 1, "partition.local_test_fraction": 0.0,
                  "server.clients_per_round": 3})
    raw["data"] = {"name": "federated_csv", **split, "workers": 0}
    raw["partition"] = {"name": "predefined", "num_clients": 3, "local_test_fraction": 0.0}
    result = fedsight.run(raw)
    counts = json.loads((result.run_dir / "partition.json").read_text())["client_label_counts"]
    assert counts == [[1, 1, 1], [1, 0, 1], [0, 1, 0]]  # u7: classes 10, 7, 2; u3: 2, 10; u9: 7
    raw["partition"]["num_clients"] = 4
    with pytest.raises((ConfigError, ValueError), match=r"split has 3 clients but partition.num_clients = 4"):
        fedsight.run(raw, **{"run.name": "other"})


def test_predefined_on_a_dataset_without_its_own_split_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    raw = tiny()
    raw["partition"] = {"name": "predefined", "num_clients": 3}
    with pytest.raises((ConfigError, ValueError), match=r"dataset 'digits' has no client split of its own"):
        fedsight.run(raw)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(("change", "message"), [
    ("no_column", r"data.train_csv '.*federated_train.csv' has no column user_id \(its header: class, label, image_id\)"),
    ("missing_image", r"data.test_csv line 3: image '.*mn08.png' does not exist \(data.root \+ data.image_pattern\)"),
    ("bad_pattern", r"data.image_pattern 'train/\{image_id\}/\{author\}.png' does not fit data.train_csv line 2: KeyError"),
    ("empty_cell", r"data.train_csv '.*' line 3: empty user_id"),
    ("no_file", r"data.test_csv '.*nothing.csv' does not exist"),
])
def test_bad_input_is_one_line_naming_the_file_and_line(split, tmp_path, change, message):
    p = dict(split)
    if change == "no_column":
        _csv(tmp_path / "federated_train.csv", ["class", "label", "image_id"], [(c, "s", i) for _, i, c in ROWS])
    elif change == "missing_image":
        (tmp_path / "gldv2" / PATTERN.format(image_id="mn08")).unlink()
    elif change == "bad_pattern":
        p["image_pattern"] = "train/{image_id}/{author}.png"
    elif change == "empty_cell":
        _csv(tmp_path / "federated_train.csv", ["user_id", "image_id", "class"], [("u1", "ab01", "1"), ("", "cd02", "2")])
    else:
        p["test_csv"] = str(tmp_path / "nothing.csv")
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        load_dataset("federated_csv", p)
