"""Overrides mean what they say: ``--set`` (and the Python API's keyword overrides) reach every variant, grid
point, seed and stage of a sweep, or the expansion fails with one line naming the key.

The property test builds sweeps (variants x grid x stages x seeds) and overrides, and checks every expanded
run's *validated* config, its stages' configs included, against an oracle written here from the rules in
docs/configuration.md alone (not from ``fedsight.sweep``'s code)."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedsight.config import ConfigError, read_toml, stage_configs
from fedsight.sweep import expand

from helpers import tiny

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.toml"))

#: keys an override may set, with the values it may set them to (all valid for ``tiny()``)
KEYS: dict[str, st.SearchStrategy] = {
    "train.lr": st.sampled_from([0.01, 0.2, 0.3]),
    "train.momentum": st.sampled_from([0.0, 0.5]),
    "train.weight_decay": st.sampled_from([0.0, 1e-3]),
    "train.batch_size": st.integers(4, 40),
    "server.clients_per_round": st.integers(1, 6),
    "server.rounds": st.integers(1, 6),
    "eval.every": st.integers(1, 3),
}
STAGE_KEYS = ("rounds", "train.lr", "train.momentum", "train.weight_decay")


def _stage(name: str) -> st.SearchStrategy:
    own = st.fixed_dictionaries({}, optional={"lr": KEYS["train.lr"], "momentum": KEYS["train.momentum"],
                                              "weight_decay": KEYS["train.weight_decay"]})
    return st.builds(lambda rounds, train: {"name": name, "rounds": rounds, **({"train": train} if train else {})},
                     st.integers(1, 3), own)


@st.composite
def sweeps(draw: Any) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    raw = tiny()
    variants = []
    for i in range(draw(st.integers(0, 3))):
        v: dict[str, Any] = {"name": f"v{i}"}
        if draw(st.booleans()):
            v["train"] = {"lr": draw(KEYS["train.lr"])}
        if draw(st.booleans()):
            names = draw(st.lists(st.sampled_from("abc"), min_size=1, max_size=3, unique=True))
            v["stages"] = [draw(_stage(n)) for n in names]
            v["server"] = {"rounds": sum(s["rounds"] for s in v["stages"])}
        variants.append(v)
    if variants:
        raw["variants"] = variants
    grid = draw(st.sampled_from([{}, {"train.weight_decay": [0.0, 1e-3]}, {"partition.alpha": [0.5, 1.0]}]))
    raw["sweep"] = {"seeds": draw(st.lists(st.integers(0, 9), min_size=1, max_size=3, unique=True)), "grid": grid}
    sets = [(k, draw(KEYS[k])) for k in draw(st.lists(st.sampled_from(sorted(KEYS)), max_size=3, unique=True))]
    for name in draw(st.lists(st.sampled_from("abd"), max_size=2, unique=True)):
        key = draw(st.sampled_from(STAGE_KEYS))
        sets.append((f"stages.{name}.{key}", draw(st.integers(1, 3)) if key == "rounds"
                     else draw(KEYS[f"{key}"] if key in KEYS else KEYS["train.lr"])))
    return raw, sets


def _get(d: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        d = d.get(part, {}) if isinstance(d, dict) else {}
    return d


def _oracle(raw: dict[str, Any], sets: list[tuple[str, Any]]) -> tuple[set[str], list[dict[str, Any]]]:
    """(keys an error may name, or empty) and, when there is none, the expected values of every run:
    ``{"variant", "seed", "values": {key: value}, "stages": [(name, rounds, {key: value})], "rounds"}``."""
    plain = dict((k, v) for k, v in sets if not k.startswith("stages."))
    by_stage: dict[str, dict[str, Any]] = {}
    for k, v in sets:
        if k.startswith("stages."):
            _, name, rest = k.split(".", 2)
            by_stage.setdefault(name, {})[rest] = v
    culprits = {k for k in plain if k in raw["sweep"]["grid"]}
    named = {s["name"] for v in raw.get("variants", []) for s in v.get("stages", [])}
    culprits |= {f"stages.{n}" for n in by_stage if n not in named}
    runs = []
    for v in raw.get("variants", [None]):
        stages = copy.deepcopy((v or {}).get("stages", []))
        for s in stages:
            for rest, val in by_stage.get(s["name"], {}).items():
                cur = s
                *up, last = rest.split(".")
                for part in up:
                    cur = cur.setdefault(part, {})
                cur[last] = val
        total = sum(s["rounds"] for s in stages)
        if "server.rounds" in plain and stages and plain["server.rounds"] != total:
            culprits.add("server.rounds")
        for s in stages:
            for k, val in plain.items():
                if k.startswith("train.") and k.split(".", 1)[1] in s.get("train", {}) and _get(s, k) != val:
                    culprits.add(k)
            for axis in raw["sweep"]["grid"]:  # a stage's own value shadows the grid's
                if axis.startswith("train.") and axis.split(".", 1)[1] in s.get("train", {}):
                    culprits.add(f"sweep.grid {axis}")
        rounds = plain.get("server.rounds", total if stages else raw["server"]["rounds"])
        for _point in range(max(1, *(len(x) for x in raw["sweep"]["grid"].values())) if raw["sweep"]["grid"] else 1):
            for seed in raw["sweep"]["seeds"]:
                runs.append({"variant": v and v["name"], "seed": seed, "values": plain, "rounds": rounds,
                             "stages": [(s["name"], s["rounds"], s.get("train", {})) for s in stages]})
    return culprits, runs


def _attr(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sweeps(), st.booleans())
def test_every_override_reaches_every_run_and_stage_or_the_expansion_names_it(case, typed):
    raw, sets = case
    culprits, runs = _oracle(raw, sets)
    call = (dict(typed=[(k.split("."), v) for k, v in sets]) if typed
            else dict(overrides=[f"{k}={v}" for k, v in sets]))
    if culprits:
        with pytest.raises(ConfigError) as info:
            expand(raw, "c.toml", **call)
        message = str(info.value)
        assert "\n" not in message
        assert any(re.search(rf"(--set |^){re.escape(c)}[:. =]", message) or f"{c}:" in message
                   for c in culprits), (message, culprits)
        return
    specs = expand(raw, "c.toml", **call)
    assert [(s.variant, s.seed) for s in specs] == [(r["variant"], r["seed"]) for r in runs]
    for spec, want in zip(specs, runs):
        cfg = spec.config
        for key, value in want["values"].items():
            assert _attr(cfg, key) == value, (spec.variant, key)
        assert cfg.server.rounds == want["rounds"]
        got = stage_configs(cfg)
        assert [(n, r) for n, r, _ in got] == [(n, r) for n, r, _ in want["stages"]]
        for (name, rounds, own), (_, _, scfg) in zip(want["stages"], got):
            for key, value in want["values"].items():
                if key != "server.rounds":
                    assert _attr(scfg, key) == value, (spec.variant, name, key)
            for key, value in own.items():
                assert getattr(scfg.train, key) == value, (spec.variant, name, key)


def test_the_readme_cases_an_override_reaches_every_variant():
    """The two cases found on main: ``--set`` reached only the first variant of a sweep."""
    specs = expand(read_toml(EXAMPLES[0].parent / "quickstart.toml"), "q.toml", ["server.optimizer.lr=0.5"])
    assert {(s.variant, s.config.server.optimizer.lr) for s in specs} == {("fedavg", 0.5), ("fedadam", 0.5)}
    specs = expand(read_toml(EXAMPLES[0].parent / "fed3r.toml"), "f.toml", ["server.rounds=3", "sweep.seeds=[0]"],
                   only=["fed3r", "fed3r_rf", "fed3r_sync", "fedavg"])
    assert {s.config.server.rounds for s in specs} == {3}


def test_a_staged_run_is_shortened_by_its_stages_and_server_rounds_says_how():
    raw = read_toml(EXAMPLES[0].parent / "personalized.toml")
    with pytest.raises(ConfigError, match=r"^--set server\.rounds: p\.toml \(variant fedavg\+fedsim_psi\) runs in "
                                          r"stages \(fedavg 20 \+ fedsim_psi 10 rounds\).*--set stages\.NAME\.rounds"):
        expand(raw, "p.toml", ["server.rounds=3"])
    (spec,) = expand(raw, "p.toml", ["stages.fedavg.rounds=2", "stages.ditto.rounds=1", "sweep.seeds=[0]"],
                     only=["fedavg+ditto"])
    assert spec.config.server.rounds == 3
    assert [(n, r) for n, r, _ in stage_configs(spec.config)] == [("fedavg", 2), ("ditto", 1)]
    with pytest.raises(ConfigError, match=r"^--set stages\.dito: no run of p\.toml has a stage named 'dito' \(stages: "):
        expand(raw, "p.toml", ["stages.dito.rounds=1"])


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_takes_overrides_everywhere_following_its_own_advice(example):
    """Each shipped example, with overrides of keys its stages also set: the expansion either succeeds with the
    values in every run and stage, or says what to add, and adding exactly that makes it succeed."""
    raw = read_toml(example)
    sets = ["train.batch_size=7", "train.lr=0.0123", "sweep.seeds=[4]"]
    for _ in range(12):
        try:
            specs = expand(raw, example.name, sets)
            break
        except ConfigError as exc:
            advice = re.search(r"set it there too: --set (\S+)$", str(exc))
            assert advice, str(exc)
            sets.append(advice.group(1))
    else:
        pytest.fail(f"{example.name}: the advice never ended: {sets}")
    assert specs and {s.seed for s in specs} == {4}
    for spec in specs:
        for cfg in [spec.config] + [c for _, _, c in stage_configs(spec.config)]:
            assert (cfg.train.batch_size, cfg.train.lr) == (7, 0.0123), spec.run_dir
