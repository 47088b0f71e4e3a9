"""Validation bounds from what the machine and the math allow (issue 44, item 3): every value below passed
validation and then crashed or was silently ignored; each is now refused in one line naming the key(s)."""

from __future__ import annotations

import math
import os

import pytest

from fedsight.config import ConfigError, validate

from helpers import tiny


def refused(**over) -> str:
    with pytest.raises(ConfigError) as exc:
        validate(tiny(**over))
    msg = str(exc.value)
    assert "\n" not in msg, msg
    return msg


# -- engine.threads: up to the machine's CPUs ---------------------------------------------------------


def test_threads_beyond_the_machines_cpus_are_refused_naming_the_count() -> None:
    cpus = os.cpu_count() or 1
    for n in (cpus + 1, 1_000_000):
        msg = refused(**{"engine.threads": n})
        assert "engine.threads" in msg and str(n) in msg and f"{cpus} CPU" in msg, msg
    assert validate(tiny(**{"engine.threads": cpus})).engine.threads == cpus
    assert validate(tiny(**{"engine.threads": "auto"})).engine.threads == "auto"


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
