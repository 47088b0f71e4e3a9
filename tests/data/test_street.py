"""The ``street`` dataset (fedsight.data.street): seen / unseen domains of every setting, the seen test split,
independence from the run seed and from the other domains, the .npz cache, parallel rendering and errors.

Checks are properties of the splits or independent references (the scenes rendered one by one with
``render_scene`` under the documented key, domain names from the parameters), never stored outputs."""

from __future__ import annotations

import io
import itertools
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from fedsight.data import street
from fedsight.data.segmentation import SegmentationData, SegmentationSet
from fedsight.data.street_scenes import CLASSES, Appearance, render_scene
from fedsight.plugins import load_builtin
from fedsight.registry import DATASETS, build

load_builtin()

SMALL = {"towns": ["suburb", "rural"], "conditions": ["clear-day", "rain-day"], "cameras": ["car", "bus"],
         "per_domain": 4, "height": 24, "width": 48, "test_fraction": 0.25}
UNSEEN = {"country": lambda t, c, cam: t == "rural", "rainy": lambda t, c, cam: c.startswith("rain"),
          "bus": lambda t, c, cam: cam == "bus", "none": lambda t, c, cam: False}


def load(seed: int = 0, **params) -> SegmentationData:
    return build(DATASETS, "street", {**SMALL, **params}, seed=seed)


@pytest.fixture(autouse=True)
def _fresh_memory_cache():
    street._rendered.cache_clear()
    yield
    street._rendered.cache_clear()


def items(s: SegmentationSet) -> dict[str, tuple[torch.Tensor, torch.Tensor, int]]:
    """name -> (image [3, H, W], label map, domain id) of every scene of a split."""
    return {n: (s.images.get_one(i), s.labels.get_one(i), int(s.domains[i])) for i, n in enumerate(s.names)}


def all_items(data: SegmentationData) -> dict[str, tuple[torch.Tensor, torch.Tensor, int]]:
    out = items(data.train)
    for t in data.tests.values():
        out.update(items(t))
    return out


def assert_same_data(a: SegmentationData, b: SegmentationData) -> None:
    assert a.domain_names == b.domain_names and sorted(a.tests) == sorted(b.tests)
    for x, y in [(a.train, b.train), *((a.tests[k], b.tests[k]) for k in a.tests)]:
        assert x.names == y.names
        np.testing.assert_array_equal(x.domains, y.domains)
        assert torch.equal(x.images.images, y.images.images)
        assert torch.equal(x.labels.labels, y.labels.labels)


# -------------------------------------------------------------------------------------------- settings


@pytest.mark.parametrize(("setting", "per_domain", "test_fraction", "extra"), [
    *((s, 5, 0.4, {}) for s in ("country", "rainy", "bus", "none")),
    ("country", 4, 0.25, {}), ("bus", 3, 0.1, {}), ("none", 3, 0.1, {}),  # 0.1 * 3 rounds to 0: still one test scene
    ("rainy", 3, 0.34, {"conditions": ["rain-night", "clear-dusk", "rain-day"], "cameras": ["bus"]}),  # every rain
    ("country", 3, 0.34, {"towns": ["rural", "downtown", "oldtown"], "cameras": ["bus"], "conditions": ["fog-dusk"]}),
])
def test_settings_split_seen_and_unseen_domains(setting, per_domain, test_fraction, extra) -> None:
    p = {**SMALL, "setting": setting, "per_domain": per_domain, "test_fraction": test_fraction, **extra}
    data = load(**p)
    n = per_domain
    n_test = max(1, round(test_fraction * n))
    expected_names = ["/".join(d) for d in itertools.product(p["towns"], p["conditions"], p["cameras"])]
    num_domains = len(expected_names)
    assert sorted(data.domain_names) == sorted(expected_names) and len(set(data.domain_names)) == num_domains
    assert data.class_names == list(CLASSES) and data.num_classes == 13
    unseen = {d for d, name in enumerate(data.domain_names) if UNSEEN[setting](*name.split("/"))}
    seen = set(range(len(data.domain_names))) - unseen
    expect_unseen = {"country": len(expected_names) // len(p["towns"]), "none": 0,
                     "rainy": num_domains * sum(c.startswith("rain") for c in p["conditions"]) // len(p["conditions"]),
                     "bus": num_domains * ("bus" in p["cameras"]) // len(p["cameras"])}[setting]
    assert len(unseen) == expect_unseen and (expect_unseen > 0) == (setting != "none")

    splits = {"train": data.train, **data.tests}
    assert set(data.tests) == ({"test"} if setting == "none" else {"test", "unseen"})
    scenes: dict[str, dict[int, list[int]]] = {}
    for split, s in splits.items():
        assert len(s.names) == len(s) == len(s.domains) == len(s.images) == len(s.labels)
        scenes[split] = {}
        for name, d in zip(s.names, s.domains):
            domain, idx = name.rsplit("/", 1)
            assert domain == data.domain_names[d] and len(idx) == 3, name  # names agree with domain ids
            scenes[split].setdefault(int(d), []).append(int(idx))
    if unseen:
        assert set(scenes["unseen"]) == unseen
        assert all(sorted(v) == list(range(n)) for v in scenes["unseen"].values())
    assert set(scenes["train"]) == seen and set(scenes["test"]) == seen  # no unseen domain in pool or test
    for d in seen:  # the last n_test scenes of every seen domain are its test scenes, the rest the pool
        assert sorted(scenes["test"][d]) == list(range(n - n_test, n))
        assert sorted(scenes["train"][d]) == list(range(n - n_test))
    total = sum(len(s) for s in splits.values())
    assert total == num_domains * n and len({nm for s in splits.values() for nm in s.names}) == total


def test_scenes_are_the_documented_renders() -> None:
    """Every scene is ``render_scene(town, appearance, h, w, data_seed, key=(town, condition, camera, i))``
    under its name: images, labels and names are not mixed up by the split."""
    data = load(data_seed=5, setting="rainy")
    found = all_items(data)
    assert len(found) == 8 * SMALL["per_domain"]
    for name, (img, lab, d) in found.items():
        town, condition, camera, idx = name.split("/")
        weather, time = condition.split("-")
        want_img, want_lab = render_scene(town, Appearance(weather, time, camera), 24, 48, 5,
                                          key=(town, condition, camera, int(idx)))
        assert img.shape == (3, 24, 48) and img.dtype == torch.uint8 and lab.dtype == torch.uint8
        np.testing.assert_array_equal(img.permute(1, 2, 0).numpy(), want_img, err_msg=name)
        np.testing.assert_array_equal(lab.numpy(), want_lab, err_msg=name)


# ---------------------------------------------------------------------------------------------- seeds


def test_data_ignore_the_run_seed_but_follow_the_data_seed() -> None:
    a = load(seed=0)
    street._rendered.cache_clear()
    b = load(seed=7)
    assert_same_data(a, b)
    c = load(seed=0, data_seed=1)
    assert a.train.names == c.train.names
    assert not torch.equal(a.train.images.images, c.train.images.images)
    assert not torch.equal(a.train.labels.labels, c.train.labels.labels)


def test_a_domains_scenes_do_not_depend_on_the_other_domains() -> None:
    full = all_items(load(setting="none"))
    parts = [{"towns": ["rural"]}, {"conditions": ["rain-day"]}, {"towns": ["suburb"], "cameras": ["bus"]}]
    for part in parts:
        alone = all_items(load(setting="none", **part))
        assert 0 < len(alone) < len(full)
        for name, (img, lab, _) in alone.items():
            assert torch.equal(img, full[name][0]) and torch.equal(lab, full[name][1]), (part, name)


# ---------------------------------------------------------------------------------------------- cache


def _no_render(p):
    raise AssertionError("rendered although the cache holds this dataset")


def test_cache_is_written_once_and_read_back(tmp_path, monkeypatch) -> None:
    folder = tmp_path / "cache"
    first = load(setting="none", cache=str(folder))
    files = sorted(folder.iterdir())
    assert len(files) == 1 and files[0].name.startswith("street-") and files[0].suffix == ".npz"
    with np.load(files[0]) as z:
        assert z["images"].shape == (8, 4, 24, 48, 3) and z["labels"].shape == (8, 4, 24, 48)
    street._rendered.cache_clear()
    monkeypatch.setattr(street, "render_domains", _no_render)
    assert_same_data(load(setting="none", cache=str(folder)), first)
    # the key ignores workers and setting (and the test split): these read the same file
    street._rendered.cache_clear()
    other = load(setting="country", workers=2, test_fraction=0.5, cache=str(folder))
    assert sorted(folder.iterdir()) == files
    assert all(torch.equal(v[0], all_items(first)[k][0]) for k, v in all_items(other).items())
    # other scenes are another file
    monkeypatch.undo()
    street._rendered.cache_clear()
    load(setting="none", data_seed=3, cache=str(folder))
    assert len(list(folder.glob("street-*.npz"))) == 2 and len(list(folder.iterdir())) == 2


def test_corrupted_cache_file_is_rendered_anew(tmp_path) -> None:
    ref = load(setting="bus")
    street._rendered.cache_clear()
    load(setting="bus", cache=str(tmp_path))
    (path,) = tmp_path.glob("street-*.npz")
    path.write_bytes(b"this is not an npz archive \x00\x01\x02" * 10)
    street._rendered.cache_clear()
    assert_same_data(load(setting="bus", cache=str(tmp_path)), ref)
    with np.load(path) as z:  # and the file is whole again
        assert z["images"].shape == (8, 4, 24, 48, 3)
    # a readable archive of the wrong content (another shape, a missing array) is rendered anew too
    for arrays in ({"images": np.zeros((2, 4, 24, 48, 3), np.uint8), "labels": np.zeros((2, 4, 24, 48), np.uint8)},
                   {"images": np.zeros((8, 4, 24, 48, 3), np.uint8)}):
        np.savez(path, **arrays)
        street._rendered.cache_clear()
        assert_same_data(load(setting="bus", cache=str(tmp_path)), ref)


def _truncated(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _empty(path: Path) -> None:
    path.write_bytes(b"")


@pytest.mark.parametrize("damage", [_truncated, _empty])
def test_truncated_or_empty_cache_file_is_rendered_anew(tmp_path, damage) -> None:
    first = load(setting="bus", cache=str(tmp_path))
    (path,) = tmp_path.glob("street-*.npz")
    damage(path)
    street._rendered.cache_clear()
    assert_same_data(load(setting="bus", cache=str(tmp_path)), first)


def test_bad_zip_is_what_numpy_raises_for_a_truncated_npz() -> None:
    """numpy's own error for a truncated archive, which the cache must treat as damage."""
    buf = io.BytesIO()
    np.savez(buf, a=np.zeros(100))
    with pytest.raises(zipfile.BadZipFile):
        np.load(io.BytesIO(buf.getvalue()[: len(buf.getvalue()) // 2]))


# -------------------------------------------------------------------------------------------- workers


def test_parallel_rendering_gives_the_same_data() -> None:
    p = {"towns": ["suburb", "downtown"], "conditions": ["clear-dusk"], "cameras": ["car"], "per_domain": 3,
         "setting": "none", "test_fraction": 0.34}
    serial = load(**p)
    parallel = load(**p, workers=2)
    assert_same_data(serial, parallel)
    assert len(serial.train) == 4 and len(serial.tests["test"]) == 2


# --------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(("params", "match"), [
    ({"towns": ["suburb", "atlantis"]}, r"unknown town 'atlantis'"),
    ({"towns": ["rural", "suburb", "rural"]}, r"towns must list at least one entry, each once"),
    ({"conditions": ["rain-day", "rain-day"]}, r"conditions must list"),
    ({"cameras": ["bus", "bus"]}, r"cameras must list"),
    ({"towns": []}, r"towns must list"),
    ({"conditions": ["snow-day"]}, r"conditions"),
    ({"per_domain": 1}, r"per_domain"),
    ({"test_fraction": 1.0}, r"test_fraction"),
    ({"towns": ["rural"], "setting": "country"}, r"setting = 'country' leaves no seen domain"),
    ({"conditions": ["rain-day", "rain-night"], "setting": "rainy"}, r"setting = 'rainy' leaves no seen domain"),
    ({"cameras": ["bus"], "setting": "bus"}, r"setting = 'bus' leaves no seen domain"),
    ({"per_domain": 2, "test_fraction": 0.9}, r"test_fraction = 0.9 leaves no training scene"),
    ({"colour": "red"}, r"colour"),
])
def test_invalid_parameters_name_the_field(params, match) -> None:
    with pytest.raises(ValueError, match=match):  # pydantic's ValidationError is a ValueError
        load(**params)
