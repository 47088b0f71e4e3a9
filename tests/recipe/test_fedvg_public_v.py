"""FedVG's public validation set (seed digest notes/003_fedvg.md §5.3, App. A.5): another dataset's classes mapped
onto the training classes (``validation.class_map``, ``unmapped``) and the authors' two-step sampler
(``duplicates_per_class``), read from image folders in the layout ``examples/paper/cifar_folders.py`` writes."""

from collections import Counter

import numpy as np
import pytest
from PIL import Image

from fedsight.api import build_task
from fedsight.config import ConfigError, validate

from helpers import tiny

TRAIN = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
#: CIFAR-100's fine classes that FedVG's code maps onto CIFAR-10 (digest App. A.5), and one it leaves out
C100_MAP = {"bus": "automobile", "motorcycle": "automobile", "leopard": "cat", "lion": "cat", "tiger": "cat",
            "wolf": "dog", "fox": "dog"}


def folder(root, classes, per_class, start=0):
    """<root>/<class>/<k>.png, every image unique: its pixel (0, 0) red and green encode its number."""
    k = start
    for name in classes:
        (root / name).mkdir(parents=True)
        for _ in range(per_class):
            im = np.full((8, 8, 3), 128, np.uint8)
            im[0, 0, 0], im[0, 0, 1] = k // 256, k % 256
            Image.fromarray(im).save(root / name / f"{k}.png")
            k += 1
    return k


def cfg(tmp_path, **validation):
    return validate(tiny(**{
        "data": {"name": "imagefolder", "train_dir": str(tmp_path / "train"), "test_dir": str(tmp_path / "test"),
                 "image_size": 8, "channels": 3, "workers": 0},
        "partition": {"name": "iid", "num_clients": 4, "local_test_fraction": 0.0},
        "validation": {"source": "dataset", "dataset": {"name": "imagefolder", "train_dir": str(tmp_path / "c100"),
                                                        "test_dir": str(tmp_path / "c100_test"), "image_size": 8,
                                                        "channels": 3, "workers": 0},
                       **validation}}))


@pytest.fixture
def folders(tmp_path):
    n = folder(tmp_path / "train", TRAIN, 4)
    n = folder(tmp_path / "test", TRAIN, 1, start=n)
    n = folder(tmp_path / "c100", sorted([*C100_MAP, "apple"]), 6, start=n)
    folder(tmp_path / "c100_test", sorted([*C100_MAP, "apple"]), 1, start=n)
    return tmp_path


def codes(x):
    """Each image's pixel (0, 0) red and green as the task serves them (standardised): equal for the same image,
    different for any two images folder() wrote."""
    return [tuple(v) for v in x[:, :2, 0, 0].tolist()]


def test_class_map_places_the_public_classes_and_drops_the_rest(folders):
    task = build_task(cfg(folders, class_map=C100_MAP, unmapped="drop"))
    counts = Counter(TRAIN[c] for c in task.val_y.tolist())
    assert counts == {"automobile": 12, "cat": 18, "dog": 12}  # 2, 3 and 2 fine classes of 6 images; apple left out
    assert len(set(codes(task.val_x))) == 42  # no image twice without duplicates_per_class
    assert len(task.pool_y) == 40  # the clients keep the whole training pool


def test_duplicates_per_class_reproduce_the_authors_counts(folders):
    """Digest App. A.5: the code draws n images of each class, then the whole pool: 7 x 500 + 3 x 50 = 3,650 at
    n = 50; here 7 x 6 + 3 x 2 = 48, and exactly 2 images of each mapped class appear twice."""
    task = build_task(cfg(folders, class_map=C100_MAP, unmapped="drop", duplicates_per_class=2))
    y, ids = task.val_y.tolist(), codes(task.val_x)
    assert len(y) == 48
    assert Counter(TRAIN[c] for c in y) == {"automobile": 14, "cat": 20, "dog": 14}
    twice = Counter(i for i, n in Counter(ids).items() if n == 2)
    assert len(twice) == 6 and set(Counter(ids).values()) == {1, 2}
    label_of = dict(zip(ids, y))
    assert Counter(TRAIN[label_of[i]] for i in twice) == {"automobile": 2, "cat": 2, "dog": 2}
    again = build_task(cfg(folders, class_map=C100_MAP, unmapped="drop", duplicates_per_class=2))
    assert codes(again.val_x) == ids  # a deterministic function of the seed
    other = build_task(cfg(folders, class_map=C100_MAP, unmapped="drop", duplicates_per_class=2, seed=5))
    assert sorted(set(codes(other.val_x))) == sorted(set(ids)) and codes(other.val_x) != ids


def test_unplaced_classes_and_bad_maps_are_one_line_errors(folders):
    with pytest.raises(ValueError, match=r"classes \['apple'\] are not among.*validation.class_map.*unmapped"):
        build_task(cfg(folders, class_map=C100_MAP))
    with pytest.raises(ValueError, match=r"validation.class_map: 'bus' maps to 'car', which is not a training"):
        build_task(cfg(folders, class_map={**C100_MAP, "bus": "car"}, unmapped="drop"))
    with pytest.raises(ValueError, match=r"validation.class_map: \['whale'\] are not classes of"):
        build_task(cfg(folders, class_map={**C100_MAP, "whale": "ship"}, unmapped="drop"))
    with pytest.raises(ValueError, match="duplicates_per_class = 7: .* has 6 images of 'dog'"):
        build_task(cfg(folders, class_map={"wolf": "dog"}, unmapped="drop", duplicates_per_class=7))
    with pytest.raises(ValueError, match="none of its classes"):
        build_task(cfg(folders, class_map=None, unmapped="drop"))


def test_public_v_keys_need_a_dataset_source():
    with pytest.raises(ConfigError, match='validation.class_map applies to source = "dataset" only'):
        validate(tiny(**{"validation.source": "carve", "validation.class_map": {"bus": "automobile"}}))
    with pytest.raises(ConfigError, match="validation.duplicates_per_class"):
        validate(tiny(**{"validation.duplicates_per_class": 50}))
