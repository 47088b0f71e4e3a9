"""A strict config: no value coerced across TOML types, and every cross-field constraint checked when the config
is read (before any run directory exists), naming the keys involved."""

from __future__ import annotations

import typing

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsight.config import ConfigError, set_path, validate
from fedsight.sweep import expand

from helpers import tiny


def _scalar_fields() -> list[tuple[str, type]]:
    """(dotted key, type) of every plain int, float, bool or str field of the non-component sections, read off
    the schema (so a field added later is covered without editing this test)."""
    from fedsight.config import EvalSection, RunSection, TrainSection, config_model

    server = config_model().model_fields["server"].annotation
    out = []
    for section, cls in [("train", TrainSection), ("eval", EvalSection), ("run", RunSection), ("server", server)]:
        for name, f in cls.model_fields.items():
            ann = f.annotation
            while typing.get_origin(ann) is typing.Annotated:
                ann = typing.get_args(ann)[0]
            if ann in (int, float, bool, str):
                out.append((f"{section}.{name}", ann))
    return out


SCALARS = _scalar_fields()
#: values of another TOML type that a lax validator would coerce: "2" -> 2, true -> 1.0, "yes" -> True, 1 -> "1"
WRONG = {int: ["2", True, 2.5], float: ["0.1", True, False], bool: ["yes", "true", 1, 0], str: [1, True, 2.5]}


def test_the_schema_walk_finds_fields_of_every_kind() -> None:
    kinds = {t for _, t in SCALARS}
    assert kinds == {int, float, bool, str} and len(SCALARS) >= 15


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.sampled_from(SCALARS).flatmap(lambda kt: st.tuples(st.just(kt[0]), st.sampled_from(WRONG[kt[1]]))))
def test_no_value_is_coerced_across_toml_types(case) -> None:
    key, value = case
    raw = tiny()
    set_path(raw, key.split("."), value)
    with pytest.raises(ConfigError) as exc:
        validate(raw, "cfg.toml")
    lines = str(exc.value).splitlines()
    assert len(lines) == 1 and key in lines[0], lines


def test_an_integer_is_taken_for_a_float_and_an_array_for_a_pair() -> None:
    cfg = validate(tiny(**{"train.lr": 1, "train.epochs": None, "train.steps_range": [1, 3]}))
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float) and cfg.train.steps_range == (1, 3)
    with pytest.raises(ConfigError, match=r"train.steps_range\[0\]"):  # the pair's elements are strict too
        validate(tiny(**{"train.epochs": None, "train.steps_range": ["1", 3]}))


def test_stages_are_strict_and_cannot_set_server_rounds() -> None:
    raw = tiny(**{"server.rounds": 3})
    raw["stages"] = [{"name": "a", "rounds": "1"}, {"name": "b", "rounds": 2}]
    with pytest.raises(ConfigError, match=r"stages\[0\].rounds"):
        validate(raw)
    raw["stages"] = [{"name": "a", "rounds": 1, "server": {"rounds": 5}}, {"name": "b", "rounds": 2}]
    with pytest.raises(ConfigError, match="sets server.rounds"):
        validate(raw)


def test_a_repeated_seed_is_refused() -> None:
    raw = tiny()
    raw["sweep"] = {"seeds": [0, 1, 0]}
    with pytest.raises(ConfigError, match="sweep.seeds.*repeats a seed"):
        expand(raw, "cfg")


def test_grid_values_of_any_text_get_safe_distinct_run_directories(tmp_path) -> None:
    raw = tiny(**{"run.output_dir": str(tmp_path)})
    raw["sweep"] = {"grid": {"run.checkpoint_keep": [1, 2], "data.train_dir": ["a/b", "../c d"]}}
    raw["data"] = {"name": "imagefolder", "train_dir": "x"}
    specs = expand(raw, "cfg")
    dirs = [s.run_dir for s in specs]
    assert len(set(dirs)) == 4
    for d in dirs:
        assert d.parent.parent.parent == tmp_path and ".." not in d.parts
    raw["sweep"] = {"grid": {"data.train_dir": ["a/b", "a-b"]}}  # one label for two values
    with pytest.raises(ConfigError, match="one label"):
        expand(raw, "cfg")


def test_freezing_every_parameter_is_refused() -> None:
    with pytest.raises(ConfigError, match="train.*freezes every parameter"):
        validate(tiny(**{"train.freeze": ["head", "backbone"]}))
    validate(tiny(**{"train.freeze": ["backbone", "norm"]}))


@pytest.mark.parametrize("per_round,byzantine,multi,ok", [(3, 0, 1, True), (4, 1, 1, False), (5, 1, 1, True),
                                                          (5, 1, 6, False), (6, 2, 1, False)])
def test_krum_against_the_clients_a_round_samples(per_round, byzantine, multi, ok) -> None:
    """Blanchard et al. 2017, Prop. 1: K > 2f + 2; Multi-Krum's m <= K. A config where every round would be
    skipped is refused before it starts, naming both keys."""
    raw = tiny(**{"server.clients_per_round": per_round, "recipe.aggregator": {"name": "krum", "byzantine": byzantine,
                                                                               "multi": multi}})
    if ok:
        validate(raw)
    else:
        with pytest.raises(ConfigError, match=r"recipe.aggregator: .*server.clients_per_round"):
            validate(raw)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.lists(st.sampled_from([4, 6, 8, 9, 12]), min_size=1, max_size=3), st.integers(1, 7))
def test_group_norm_groups_must_divide_every_width(channels, groups) -> None:
    """The CNN puts a norm layer after each conv of width ``channels[i]``: the config is refused exactly when a
    width is not a multiple of the groups, before any data is read."""
    raw = tiny(**{"model": {"name": "cnn", "channels": channels, "hidden": 8, "norm": "group", "group_norm_groups": groups}})
    if all(c % groups == 0 for c in channels):
        validate(raw)
    else:
        with pytest.raises(ConfigError, match=rf"model.group_norm_groups = {groups}: .* channels"):
            validate(raw)


def test_a_grid_switching_the_component_does_not_hide_a_misspelt_parameter() -> None:
    """Every grid point replaces partition.name, dropping the base partitioner's parameters, typo included."""
    raw = tiny()
    raw["partition"] = {**raw["partition"], "alpah": 0.5}
    raw["sweep"] = {"grid": {"partition.name": ["iid", "shards"]}}
    with pytest.raises(ConfigError, match=r"unknown key 'partition.alpah'"):
        expand(raw, "cfg")
    del raw["partition"]["alpah"]
    assert len(expand(raw, "cfg")) == 2
