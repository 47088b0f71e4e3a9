"""The thesis's chapter 3 data protocols (``fedsight.data.thesis_protocols``): the RGB-shift domain perturbation
(Sec. 3.9.10, Table 3.9) and the globally class-imbalanced variants A-D (Sec. 3.9.12, Table 3.11).

The expectations are written from the thesis's text, not from the module: a group's channel x delta and the other
two x 1/delta; A keeps 50% of every class, B 25/75, C 20/40/60/80, D 5/15/.../95, half the data in all."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsight.api import build_task
from fedsight.config import validate
from fedsight.data.base import ArrayDataset, DatasetSplits, StoredDataset
from fedsight.data.partition import ClientSplits
from fedsight.data.pipeline import TensorStore
from fedsight.data.thesis_protocols import RGBShift, apply_rgb_shift, global_imbalance_keep

from helpers import tiny

#: the thesis's text: (channel multiplied by delta) -> factors of (R, G, B)
def _thesis_factors(delta: float, channel: int) -> np.ndarray:
    return np.array([delta if c == channel else 1 / delta for c in range(3)])


def _write_rgb_npz(path, n_train=60, n_test=9, size=5, classes=4):
    rng = np.random.default_rng(1)
    tr = rng.integers(0, 256, (n_train, size, size, 3), dtype=np.uint8)
    te = rng.integers(0, 256, (n_test, size, size, 3), dtype=np.uint8)
    np.savez(path, train_images=tr, train_labels=np.arange(n_train) % classes, test_images=te,
             test_labels=np.arange(n_test) % classes)
    return tr.transpose(0, 3, 1, 2) / 255.0, te.transpose(0, 3, 1, 2) / 255.0


def _groups_of(shifted: np.ndarray, raw: np.ndarray, delta: float) -> list[int]:
    """The channel each image was enhanced on, read back from shifted / raw (pixels of raw > 0)."""
    out = []
    for s, r in zip(shifted, raw):
        ratio = np.array([np.median(s[c][r[c] > 0] / r[c][r[c] > 0]) for c in range(3)])
        matches = [c for c in range(3) if np.allclose(ratio, _thesis_factors(delta, c), rtol=1e-5)]
        assert len(matches) == 1, ratio
        out.append(matches[0])
    return out


def test_rgb_shift_is_exactly_the_thesis_factors_per_client_and_thirds_of_the_test_set(tmp_path):
    raw_train, raw_test = _write_rgb_npz(tmp_path / "rgb.npz")
    delta = 1.5
    cfg = validate(tiny(**{"data": {"name": "npz", "path": str(tmp_path / "rgb.npz")},
                           "partition.rgb_shift": {"delta": delta, "clip": False}}))
    task = build_task(cfg)
    mean, std = task.mean.numpy(), task.std.numpy()
    recorded = task.protocols["rgb_shift"]["client_group"]
    for k, split in enumerate(task.clients):
        for part, sl in ((split.train, task._train_slice(k)), (split.test, task._test_slice(k))):
            pixels = task.pool.x[sl].numpy() * std + mean  # the images the model's standardisation started from
            expect = raw_train[part] * _thesis_factors(delta, recorded[k])[None, :, None, None]
            np.testing.assert_allclose(pixels, expect, rtol=1e-5, atol=1e-6)
    assert sorted(np.bincount(recorded, minlength=3).tolist()) == [2, 2, 2]  # 6 clients: three groups of 2
    test = task.test.x.numpy() * std + mean
    assert sorted(np.bincount(_groups_of(test, raw_test, delta), minlength=3).tolist()) == [3, 3, 3]
    assert task.protocols["rgb_shift"]["test_group_sizes"] == [3, 3, 3]


def test_rgb_shift_clip_and_on_disk_images_as_8_bit():
    raw = torch.tensor([[[[0.8]], [[0.5]], [[0.1]]]])  # one 1x1 RGB image
    clients = ClientSplits.pack([np.array([0])], [np.zeros(0, dtype=np.int64)])
    data = ArrayDataset(raw, torch.tensor([0]), 1)
    splits = DatasetSplits(train=data, test=data)
    clipped, info = apply_rgb_shift(splits, clients, RGBShift(delta=2.0), seed=0)
    g = info["client_group"][0]
    expect = np.minimum(np.array([0.8, 0.5, 0.1]) * _thesis_factors(2.0, g), 1.0)
    np.testing.assert_allclose(clipped.train.x.flatten().numpy(), expect, rtol=1e-6)
    u8 = torch.tensor([[[[204]], [[128]], [[25]]]], dtype=torch.uint8)
    stored = StoredDataset(TensorStore(u8), torch.tensor([0]), 1)
    got, info = apply_rgb_shift(DatasetSplits(train=stored, test=stored), clients, RGBShift(delta=2.0), seed=0)
    expect = np.clip(np.floor(np.array([204, 128, 25]) * _thesis_factors(2.0, info["client_group"][0]) + 0.5), 0, 255)
    assert got.train.store.get(np.array([0])).flatten().tolist() == expect.tolist()
    assert got.train.store.subset(np.array([0])).get_one(0).flatten().tolist() == expect.tolist()
    with pytest.raises(ValueError, match=r"^partition.rgb_shift.clip = false: the training data is read from 8-bit"):
        apply_rgb_shift(DatasetSplits(train=stored, test=stored), clients, RGBShift(delta=2.0, clip=False), seed=0)


def test_rgb_shift_refuses_grey_images_and_other_tasks():
    with pytest.raises(ValueError, match="partition.rgb_shift needs RGB images; the data have 1 channel"):
        build_task(validate(tiny(**{"partition.rgb_shift": {"delta": 1.2}})))
    from fedsight.errors import ConfigError

    with pytest.raises(ConfigError, match="delta"):
        validate(tiny(**{"partition.rgb_shift": {"delta": 0}}))


@pytest.mark.parametrize("variant,fractions", [("A", [0.5]), ("B", [0.25, 0.75]), ("C", [0.2, 0.4, 0.6, 0.8]),
                                               ("D", [0.05, 0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.75, 0.85, 0.95])])
def test_global_imbalance_counts_are_the_thesis_cifar100_variants(variant, fractions):
    labels = np.repeat(np.arange(100), 500)  # CIFAR-100's training set: 500 images a class
    kept, info = global_imbalance_keep(labels, 100, variant, seed=3)
    counts = np.bincount(labels[kept], minlength=100)
    assert len(kept) == 25_000  # "exactly half of the total training samples"
    expect = sorted(int(round(f * 500)) for f in fractions for _ in range(100 // len(fractions)))
    assert sorted(counts.tolist()) == expect  # each group: 100 / groups classes, each keeping f x 500
    assert len(np.unique(kept)) == len(kept)
    for c in range(100):  # the group recorded is the one whose fraction the class kept
        assert counts[c] == round(fractions[info["class_group"][c]] * 500)
    other, info2 = global_imbalance_keep(labels, 100, variant, seed=4)
    if len(fractions) > 1:  # the seed changes the grouping (the thesis: seeds change only that)
        assert info2["class_group"] != info["class_group"]
    again, _ = global_imbalance_keep(labels, 100, variant, seed=3)
    assert np.array_equal(again, kept)


def test_global_imbalance_in_a_run_and_its_one_line_refusal(tmp_path):
    _write_rgb_npz(tmp_path / "rgb.npz", n_train=80, classes=4)
    base = {"data": {"name": "npz", "path": str(tmp_path / "rgb.npz")}}
    task = build_task(validate(tiny(**base, **{"partition.global_imbalance": "B"})))
    counts = sorted(np.bincount(np.concatenate([task.client_labels(k) for k in range(task.num_clients)] +
                                               [task.pool_y[task._test_slice(k)].numpy()
                                                for k in range(task.num_clients)]), minlength=4).tolist())
    assert counts == [5, 5, 15, 15]  # 20 images a class: two classes keep 25%, two 75%
    assert task.protocols["global_imbalance"]["kept"] == 40
    with pytest.raises(ValueError, match=r"global_imbalance = 'D' splits the classes into 10 equal groups; the "
                                         r"data's 4 classes are not a multiple of 10"):
        build_task(validate(tiny(**base, **{"partition.global_imbalance": "D"})))
