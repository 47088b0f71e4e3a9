"""Validation bounds from what the machine and the math allow (issue 44, item 3): every value below passed
validation and then crashed or was silently ignored; each is now refused in one line naming the key(s)."""

from __future__ import annotations

import math
import os

import pytest
import torch

from fedsight.config import ConfigError, validate

from helpers import tiny


def refused(**over) -> str:
    with pytest.raises(ConfigError) as exc:
        validate(tiny(**over))
    msg = str(exc.value)
    assert "\n" not in msg, msg
    return msg


# -- engine.threads: a fixed cap at validation, the machine's CPUs at run time ----------------------------


def test_threads_past_the_fixed_cap_are_refused_naming_it(monkeypatch) -> None:
    """The cap does not depend on the machine: a config valid here is valid on any machine (a run's
    config.json is validated again on resume)."""
    for n in (1025, 1_000_000):
        msg = refused(**{"engine.threads": n})
        assert "engine.threads" in msg and str(n) in msg and "1024" in msg, msg
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert validate(tiny(**{"engine.threads": 1024})).engine.threads == 1024
    assert validate(tiny(**{"engine.threads": "auto"})).engine.threads == "auto"


def test_a_run_made_with_more_threads_than_this_machines_cpus_resumes_with_one_per_cpu(tmp_path, monkeypatch) -> None:
    """A run made on a larger machine (here: 2 CPUs, engine.threads = 2) resumes on a smaller one (1 CPU) with one
    thread per CPU and a warning; run.json records each session's thread count and the count asked for. (Before:
    the resume was refused, "more threads than this machine's 1 CPUs".)"""
    import json
    import warnings

    import torch

    from fedsight.api import execute, load_run_config

    raw = tiny(**{"server.rounds": 2, "engine.threads": 2, "eval.every": 2, "eval.local": False, "train.epochs": None,
                  "train.steps": 1, "server.clients_per_round": 2})
    run = tmp_path / "run"
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(os, "cpu_count", lambda: 2)
        assert execute(validate(raw), run, stop_after=1).status == "stopped"
        monkeypatch.setattr(os, "cpu_count", lambda: 1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = execute(load_run_config(run), run, resume=True)
    finally:
        torch.set_num_threads(before)
    assert out.status == "complete"
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert any("engine.threads = 2" in m and "1 CPUs" in m for m in said), said
    sessions = json.loads((run / "run.json").read_text())["sessions"]
    assert [s["threads"] for s in sessions] == [2, 1]
    assert "threads_requested" not in sessions[0] and sessions[1]["threads_requested"] == 2


# -- server.speed_sigma: speeds exp(sigma * z) stay finite and nonzero --------------------------------


@pytest.mark.parametrize("sigma", [1e300, 1e3, 21.0])
def test_a_speed_spread_that_overflows_the_speeds_is_refused(sigma) -> None:
    msg = refused(**{"server.speed_sigma": sigma, "server.deadline": 10.0})
    assert "server.speed_sigma" in msg and "20" in msg and "finite" in msg, msg


def test_the_largest_speed_spread_gives_finite_speeds_for_any_draw() -> None:
    from fedsight.engine.loop import client_speed

    cfg = validate(tiny(**{"server.speed_sigma": 20.0, "server.deadline": 10.0}))
    speeds = [client_speed(s, c, cfg.server.speed_sigma) for s in range(20) for c in range(50)]
    assert all(math.isfinite(v) and v > 0 and math.isfinite(1 / v) for v in speeds)
    assert math.isfinite(math.exp(20.0 * 35)) and math.exp(-20.0 * 35) > 0  # |z| < 35: any standard normal draw


# -- seeds: within the generators' (and TOML's) 64-bit signed range ----------------------------------


@pytest.mark.parametrize("seed", [2**63, 2**64, 10**30])
def test_a_seed_past_int64_is_refused(seed) -> None:
    msg = refused(seed=seed)
    assert msg.startswith("config: seed") and str(2**63 - 1) in msg, msg


def test_the_largest_int64_seed_is_accepted() -> None:
    assert validate(tiny(seed=2**63 - 1)).seed == 2**63 - 1


def test_a_validation_seed_past_int64_is_refused() -> None:
    msg = refused(**{"validation.source": "carve", "validation.seed": 2**64})
    assert "validation.seed" in msg, msg


# -- keys that do nothing with source = "none" -------------------------------------------------------


@pytest.mark.parametrize("key,value", [("fraction", 0.5), ("stratified", False), ("seed", 3)])
def test_validation_settings_without_a_validation_source_are_refused(key, value) -> None:
    msg = refused(**{f"validation.{key}": value})
    assert f"validation.{key}" in msg and "validation.source" in msg, msg


@pytest.mark.parametrize("key,value", [("epochs", 3), ("fraction", 0.5), ("classes", [0, 1]), ("lr", 0.5)])
def test_pretrain_settings_without_a_pretrain_source_are_refused(key, value) -> None:
    msg = refused(**{f"pretrain.{key}": value})
    assert f"pretrain.{key}" in msg and "pretrain.source" in msg, msg


def test_a_full_dump_of_a_config_validates_again() -> None:
    """config.json holds every key at its value (defaults included): resuming validates it again."""
    cfg = validate(tiny())
    assert validate(cfg.model_dump(mode="json")).model_dump() == cfg.model_dump()
    on = validate(tiny(**{"validation.source": "carve", "validation.fraction": 0.2, "pretrain.source": "samples",
                          "pretrain.epochs": 2}))
    assert validate(on.model_dump(mode="json")).validation.fraction == 0.2


# -- stages: one name each ----------------------------------------------------------------------------


def test_two_stages_with_one_name_are_refused() -> None:
    raw = tiny(**{"server.rounds": 4})
    raw["stages"] = [{"name": "warm", "rounds": 2}, {"name": "warm", "rounds": 2, "train": {"lr": 0.01}}]
    with pytest.raises(ConfigError) as exc:
        validate(raw)
    msg = str(exc.value)
    assert "\n" not in msg and "stages" in msg and "'warm'" in msg and "stages[0]" in msg and "stages[1]" in msg, msg


# -- silent acceptances: each refused naming both keys (issue 44, item 3) ------------------------------------


def test_a_validation_dataset_of_another_task_is_refused_naming_it() -> None:
    """Issue 44: a video dataset as a classification run's ``validation.dataset`` passed validation and the run
    ended in ``AttributeError: 'VideoSet' object has no attribute 'shape'``."""
    raw = tiny(**{"validation.source": "dataset", "validation.dataset": {"name": "synthetic_video"}})
    with pytest.raises(ConfigError, match=r"validation\.dataset\.name = 'synthetic_video' is a video_sr dataset, but "
                                          r"task is 'classification'; datasets for classification: digits"):
        validate(raw)
    validate(tiny(**{"validation.source": "dataset", "validation.dataset": {"name": "digits"}}))


def test_an_attack_on_more_clients_than_the_federation_has_is_refused() -> None:
    """Before: accepted; attack.num_clients = 10 of 6 clients chose malicious ids no client has."""
    msg = refused(**{"recipe.components": [{"name": "attack", "fraction": 0.5, "num_clients": 10}]})
    assert "num_clients = 10" in msg and "partition.num_clients = 6" in msg and "recipe.components[0]" in msg, msg
    validate(tiny(**{"recipe.components": [{"name": "attack", "fraction": 0.5, "num_clients": 6}]}))


@pytest.mark.parametrize("groups,width", [(5, 1.0), (3, 1.0), (4, 0.3)])
def test_resnet8_groups_that_do_not_divide_its_widths_are_refused(groups, width) -> None:
    """Before: accepted, and resnet8's widths silently became multiples of the groups (16/32/64 -> 15/30/65)."""
    msg = refused(**{"model": {"name": "resnet8", "norm": "group", "group_norm_groups": groups, "width": width}})
    assert f"model.group_norm_groups = {groups}" in msg and "model.width" in msg and "widths" in msg, msg


def test_resnet8_groups_that_divide_its_widths_keep_them() -> None:
    from fedsight.models import build_model

    model = build_model("resnet8", {"norm": "group", "group_norm_groups": 8}, in_channels=3, num_outputs=10,
                        image_size=32)
    assert [m.num_channels for m in model.modules() if isinstance(m, torch.nn.GroupNorm)][:1] == [16]
    assert model.feature_dim == 64


def test_an_unknown_key_in_a_table_without_a_name_is_named() -> None:
    """Before: "model has parameters but no name", naming neither the key nor what the table expects."""
    raw = tiny()
    raw["model"] = {"widht": 3}
    msg = refused_raw(raw)
    assert "'model.widht'" in msg and "model.name" in msg and "cnn" in msg and "has parameters but no" not in msg, msg
    raw["model"] = {"channels": [8]}  # a key some model accepts: the table lacks only its name
    assert "model has parameters but no name" in refused_raw(raw)


def refused_raw(raw) -> str:
    with pytest.raises(ConfigError) as exc:
        validate(raw)
    msg = str(exc.value)
    assert "\n" not in msg, msg
    return msg


def _npz(path, n_train: int, n_test: int) -> str:
    import numpy as np

    rng = np.random.default_rng(0)
    np.savez(path, train_images=rng.integers(0, 256, (n_train, 8, 8), dtype=np.uint8),
             train_labels=np.arange(n_train) % 2, test_images=rng.integers(0, 256, (n_test, 8, 8), dtype=np.uint8),
             test_labels=np.arange(n_test) % 2)
    return str(path)


def test_an_npz_with_no_test_images_is_refused_naming_the_file(tmp_path) -> None:
    """Before: accepted; every evaluation of the global model ran on an empty test set."""
    from fedsight.errors import DataFileError
    from fedsight.registry import DATASETS, build

    path = _npz(tmp_path / "d.npz", 12, 0)
    with pytest.raises(DataFileError) as exc:
        build(DATASETS, "npz", {"path": path}, seed=0)
    assert path in str(exc.value) and "test_images" in str(exc.value) and "0 images" in str(exc.value)
    assert len(build(DATASETS, "npz", {"path": _npz(tmp_path / "ok.npz", 12, 1)}, seed=0).test) == 1


def test_a_video_clip_folder_without_frames_is_refused_naming_it(tmp_path) -> None:
    """Before: the folder was skipped silently (one clip fewer than the data folder shows)."""
    import numpy as np
    from PIL import Image

    from fedsight.errors import DataFileError
    from fedsight.registry import DATASETS, build

    root = tmp_path / "clips"
    for clip in ("a", "b"):
        (root / clip).mkdir(parents=True)
        for i in range(2):
            Image.fromarray(np.full((16, 16, 3), 40 * i, dtype=np.uint8)).save(root / clip / f"{i}.png")
    (root / ".cache").mkdir()  # a hidden folder is no clip: never refused
    params = {"root": str(root), "scale": 2, "num_frames": 2, "patch_size": 4, "test_clips": ["a"]}
    assert [c.name for c in build(DATASETS, "video_frames", params, seed=0).train.clips] == ["b"]
    (root / "c").mkdir()
    (root / "c" / "notes.txt").write_text("no frames here")
    with pytest.raises(DataFileError) as exc:
        build(DATASETS, "video_frames", params, seed=0)
    assert str(root / "c") in str(exc.value) and "no " in str(exc.value), exc.value


def test_more_clients_than_samples_names_both_keys_and_the_data_file(tmp_path) -> None:
    """Before: "iid: num_clients=8 exceeds the number of samples (7)", naming neither the key nor the file."""
    import tomli_w

    import fuzz_helpers as H

    path = _npz(tmp_path / "seven.npz", 7, 2)
    raw = tiny(**{"data": {"name": "npz", "path": path}, "partition": {"name": "iid", "num_clients": 8},
                  "server.clients_per_round": 2})
    (tmp_path / "c.toml").write_text(tomli_w.dumps(raw))
    res = H.cli(["run", "c.toml"], cwd=tmp_path)
    first = (H.lines_of(res.err) or [""])[0]
    assert not H.error_problems(res, codes=(2,)), res.show()
    assert "partition.num_clients = 8" in first and path in first and "7 samples" in first, first
    assert not (tmp_path / "runs").exists()
