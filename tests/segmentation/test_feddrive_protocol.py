"""FedDrive's protocol pieces where the thesis's text and the authors' code differ (thesis Sec. 5.1.7, 5.2.3):
which images a style bank restyles (``style_images``), whose entries a client may draw (``style_exclude``) and
the doubling of clients' lists with mirrored copies (``double``)."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch

from fedsight.api import build_task
from fedsight.config import set_path, validate
from fedsight.data.seg_pipeline import StyleBank, double_positions
from fedsight.functional.style import lab_stats
from fedsight.plugins import load_builtin

load_builtin()

BASE: dict[str, Any] = {
    "seed": 0, "run": {"name": "s", "checkpoint_keep": 0, "plots": False},
    "task": {"name": "segmentation", "crop": [32, 48], "scale": [1.0, 1.0]},
    "data": {"name": "street", "towns": ["suburb", "rural"], "conditions": ["clear-day", "rain-day"], "cameras": ["car"],
             "per_domain": 5, "height": 32, "width": 48},
    "partition": {"name": "classes", "classes_per_client": 1, "num_clients": 2, "local_test_fraction": 0.0},
    "model": {"name": "bisenetv2", "width": 0.25, "head_channels": 16, "aux_channels": 8},
    "train": {"epochs": 1, "batch_size": 2, "lr": 0.05},
    "server": {"rounds": 1, "clients_per_round": 2}, "eval": {"batch_size": 4},
}


def task_with(**over: Any):
    raw = copy.deepcopy(BASE)
    for k, v in over.items():
        set_path(raw, k.split("."), v)
    return build_task(validate(raw))


# -- which images are restyled -----------------------------------------------------------------------------------

#: LAB targets far apart in L (mean, std of L, a, b): which one an output used shows in its own L mean
TARGETS = torch.tensor([[[20.0, 0.0, 0.0], [5.0, 4.0, 4.0]], [[45.0, 0.0, 0.0], [5.0, 4.0, 4.0]],
                        [[70.0, 0.0, 0.0], [5.0, 4.0, 4.0]], [[90.0, 0.0, 0.0], [5.0, 4.0, 4.0]]])
OWNERS = np.array([0, 1, 2, 3])


def _image(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(60, 200, (3, 12, 16), generator=g, dtype=torch.uint8)


def _entry_used(image: torch.Tensor, out: torch.Tensor) -> int | None:
    """The LAB target an output was moved to (None: the image came back as it was)."""
    if torch.equal(out, image):
        return None
    return int(np.argmin([abs(float(lab_stats(out)[0, 0]) - float(t[0, 0])) for t in TARGETS]))


@pytest.mark.parametrize("images,prob,want", [("all", 0.0, [True] * 6), ("even", 0.0, [True, False] * 3),
                                              ("even", 1.0, [True, False] * 3)])
def test_all_restyles_every_image_and_even_the_same_half(images: str, prob: float, want: list[bool]) -> None:
    """``"all"`` (thesis Sec. 5.1.7: "CFSI applies FDA to all the local images") restyles every sample, ``"even"``
    (FedDrive's ``index % 2 == 0``) those at even positions, in every draw; ``prob`` plays no part in either."""
    bank = StyleBank("lab", TARGETS, OWNERS, prob=prob, images=images)
    for seed in range(3):
        got = [_entry_used(_image(p), bank.apply(_image(p), 9, np.random.default_rng(seed), position=p)) is not None
               for p in range(6)]
        assert got == want


def test_random_restyles_with_the_probability_and_even_needs_a_position() -> None:
    bank = StyleBank("lab", TARGETS, OWNERS, prob=0.3)
    hits = [bank.restyles(None, np.random.default_rng(s)) for s in range(2000)]
    assert abs(np.mean(hits) - 0.3) < 0.04
    with pytest.raises(ValueError, match="position"):
        StyleBank("lab", TARGETS, OWNERS, images="even").restyles(None, np.random.default_rng(0))
    with pytest.raises(ValueError, match="style images must be one of random, even, all"):
        StyleBank("lab", TARGETS, OWNERS, images="half")


# -- whose entries a client draws ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind,exclude,own_drawn", [("lab", "auto", True), ("lab", "own", False),
                                                     ("lab", "none", True), ("cfsi", "auto", False),
                                                     ("cfsi", "own", False), ("cfsi", "none", True)])
def test_exclude_decides_whether_the_clients_own_entries_are_drawn(kind: str, exclude: str, own_drawn: bool) -> None:
    entries = TARGETS if kind == "lab" else torch.rand(4, 3, 3, 3)
    bank = StyleBank(kind, entries, OWNERS, prob=1.0, exclude=exclude)
    assert (1 in bank.allowed(1)) is own_drawn
    assert set(bank.allowed(1)) | {1} == {0, 1, 2, 3}


def test_lab_with_exclude_own_never_moves_an_image_to_its_clients_style() -> None:
    """FedDrive's ``idda.py::lab`` filters the client's own bank files; ``"auto"`` (``cityscapes.py::lab``) does
    not: over many draws it lands on the client's own target too."""
    used = {ex: {_entry_used(_image(s), StyleBank("lab", TARGETS, OWNERS, prob=1.0, exclude=ex).apply(
        _image(s), 2, np.random.default_rng(s))) for s in range(40)} for ex in ("own", "auto")}
    assert used["own"] == {0, 1, 3}
    assert used["auto"] == {0, 1, 2, 3}


# -- doubling ------------------------------------------------------------------------------------------------

def test_double_positions_map_the_second_half_to_mirrored_copies() -> None:
    real, mirrored = double_positions(np.array([0, 4, 5, 9, 2]), 5)
    assert real.tolist() == [0, 4, 0, 4, 2] and mirrored.tolist() == [False, False, True, True, False]


def test_a_doubled_client_trains_on_its_images_and_their_mirrors() -> None:
    """``double = "all"`` (FedDrive's ``double_dataset``): ``2 n`` examples, position ``n + i`` is image ``i``
    mirrored (label too), and no random flips (the copies are the flips)."""
    plain, doubled = task_with(), task_with(**{"task.double": "all"})
    n = plain.num_train_examples(0)
    assert doubled.num_train_examples(0) == 2 * n and doubled.num_train_examples(1) == 2 * plain.num_train_examples(1)
    pos = torch.arange(2 * n)
    (x, y), = doubled.train_batches(0, [pos])
    assert torch.equal(x[n:], x[:n].flip(-1)) and torch.equal(y[n:], y[:n].flip(-1))
    assert not torch.equal(x[n:], x[:n])
    # no random flip: the first copy is the image as stored (standardised)
    idx = doubled.clients[0].train
    stored = torch.stack([doubled.pool.images.get_one(int(i)) for i in idx])
    assert torch.equal(x[:n], doubled.standardize(stored))


def test_small_doubles_only_clients_under_the_threshold() -> None:
    plain = task_with()
    sizes = [plain.num_train_examples(k) for k in range(2)]
    small = task_with(**{"task.double": "small", "task.double_below": max(sizes)})
    assert [small.num_train_examples(k) for k in range(2)] == [2 * s if s < max(sizes) else s for s in sizes]
    none = task_with(**{"task.double": "small", "task.double_below": 1})
    assert [none.num_train_examples(k) for k in range(2)] == sizes


def test_even_restyles_a_mirrored_copy_as_its_original() -> None:
    """FedDrive takes ``index %= true_len`` before its ``index % 2 == 0`` test: a copy is restyled exactly when
    its original is."""
    t = task_with(**{"task.double": "all", "task.style": "lab", "task.style_images": "even",
                     "task.style_clients": 1.0, "task.style_exclude": "own"})
    plain = task_with(**{"task.double": "all"})
    n = t.num_train_examples(0) // 2
    pos = torch.arange(2 * n)
    (x, _), = t.train_batches(0, [pos])
    (p, _), = plain.train_batches(0, [pos])
    changed = [not torch.equal(x[i], p[i]) for i in range(2 * n)]
    assert changed == [i % n % 2 == 0 for i in range(2 * n)]


# -- the paper presets follow the code -----------------------------------------------------------------------

@pytest.mark.parametrize("preset,factor", [("feddrive_cityscapes", 2), ("feddrive_idda", 1)])
def test_feddrive_presets_train_on_every_image_of_every_client(preset: str, factor: int, tmp_path) -> None:
    """FedDrive keeps no local test split and doubles its Cityscapes clients (``double_dataset``), not IDDA's."""
    import sys
    from pathlib import Path

    from fedsight.config import read_toml
    from fedsight.sweep import expand

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "tests"))
    from paper_fixtures import overrides

    raw = read_toml(root / "examples" / "paper" / f"{preset}.toml")
    first = raw["variants"][0]["name"]
    spec = expand(raw, f"{preset}.toml", only=[first],
                  typed=[(k.split("."), v) for k, v in overrides(raw, tmp_path).items()])[0]
    task = build_task(spec.config)
    assert sum(task.num_train_examples(k) for k in range(task.num_clients)) == factor * len(task.pool)
