"""Every config error is one line naming its key (and the allowed values where there is a set)."""

from pathlib import Path

import pytest

from fedsight.config import ConfigError, parse_override, validate
from fedsight.sweep import expand

from helpers import tiny


def err(raw):
    with pytest.raises(ConfigError) as exc:
        validate(raw, "cfg.toml")
    return str(exc.value)


def test_valid_tiny_config_and_defaults():
    cfg = validate(tiny())
    assert cfg.recipe.weighting.name == "data_size" and cfg.server.optimizer.name == "sgd"
    assert cfg.server.optimizer.lr == 1.0 and cfg.train.epochs == 1


@pytest.mark.parametrize(
    "over, must_contain",
    [
        ({"bogus": 1}, ["unknown key 'bogus'", "allowed:", "train"]),
        ({"train.epoch": 2}, ["unknown key 'train.epoch'", "epochs"]),
        ({"server.rounds": "ten"}, ["server.rounds", "'ten'", "integer"]),
        ({"train.lr": -1}, ["train.lr", "greater than 0"]),
        ({"model.name": "nope"}, ["model", "'nope'", "cnn", "resnet18"]),
        ({"model.widht": 3}, ["unknown key 'model.widht'", "hidden", "channels"]),
        ({"model.norm": "layer"}, ["model.norm", "'batch'", "'group'"]),
        ({"partition.alpha": 0}, ["partition.alpha", "greater than 0"]),
        ({"partition.num_clients": 0}, ["partition.num_clients"]),
        ({"server.optimizer": {"name": "fedadam", "beta3": 0.1}}, ["server.optimizer.beta3", "beta2"]),
        ({"server.optimizer.name": "adamw"}, ["server.optimizer", "fedadam", "fedyogi", "sgd"]),
        ({"server.clients_per_round": 50}, ["server.clients_per_round", "partition.num_clients"]),
        ({"train.steps": 5}, ["train.epochs", "train.steps"]),
        ({"recipe.weighting": "by_loss"}, ["recipe.weighting", "data_size", "uniform"]),
        ({"eval.every": 0}, ["eval.every"]),
        ({"data.test_fraction": 1.5}, ["data.test_fraction"]),
    ],
)
def test_each_error_names_its_key(over, must_contain):
    msg = err(tiny(**over))
    assert msg.startswith("cfg.toml: ")
    for part in must_contain:
        assert part in msg, (part, msg)


def test_missing_required_section():
    raw = tiny()
    del raw["server"]
    assert "missing required key 'server'" in err(raw)


def test_overrides_parse_toml_values_and_switch_components():
    assert parse_override("server.rounds=7") == (["server", "rounds"], 7)
    assert parse_override("model.channels=[4, 8]") == (["model", "channels"], [4, 8])
    assert parse_override("run.name=abc") == (["run", "name"], "abc")
    specs = expand(tiny(), "cfg", ["server.optimizer.name=fedyogi", "server.optimizer.tau=0.01"])
    opt = specs[0].config.server.optimizer
    assert opt.name == "fedyogi" and opt.tau == 0.01
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("server.rounds")


def test_sweep_and_variants_expand_with_run_dirs():
    raw = tiny()
    raw["sweep"] = {"seeds": [0, 1]}
    raw["variants"] = [{"name": "a"}, {"name": "b", "server": {"optimizer": {"name": "fedadam", "lr": 0.02}}}]
    specs = expand(raw, "cfg")
    assert [(s.variant, s.seed) for s in specs] == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    assert specs[3].config.server.optimizer.name == "fedadam" and specs[3].config.server.optimizer.lr == 0.02
    assert specs[0].config.server.optimizer.name == "sgd"
    assert str(specs[3].run_dir).endswith("tiny/b/seed1") and specs[3].config.run.name == "b"


def test_variant_errors_name_the_variant():
    raw = tiny()
    raw["variants"] = [{"name": "ok"}, {"name": "bad", "train": {"lr": 0}}]
    with pytest.raises(ConfigError, match=r"variant bad.*train\.lr"):
        expand(raw, "cfg")
    raw["variants"] = [{"server": {}}]
    with pytest.raises(ConfigError, match=r"variants\[0\]\.name"):
        expand(raw, "cfg")


def test_sweep_grid_runs_every_combination():
    raw = tiny()
    raw["sweep"] = {"seeds": [0, 1], "grid": {"partition.alpha": [1.0, 0.1], "train.lr": [0.1, 0.2]}}
    raw["variants"] = [{"name": "a"}, {"name": "b"}]
    specs = expand(raw, "cfg")
    assert len(specs) == 2 * 2 * 2 * 2
    got = {(s.variant, s.config.partition.alpha, s.config.train.lr, s.seed) for s in specs}
    assert len(got) == 16
    one = next(s for s in specs if s.variant == "b" and s.config.partition.alpha == 0.1 and s.config.train.lr == 0.2)
    assert one.config.run.name == "b[alpha=0.1,lr=0.2]"
    assert one.run_dir.parts[-4:] == ("tiny", "b", "alpha=0.1,lr=0.2", f"seed{one.seed}")
    raw["sweep"] = {"grid": {"partition.alpha": [0.0]}}
    with pytest.raises(ConfigError, match="alpha=0.0.*partition.alpha"):
        expand(raw, "cfg")


@pytest.mark.parametrize("where", ["run", "variant"])
@pytest.mark.parametrize("name", [".", ".."])
def test_run_and_variant_names_cannot_leave_output_dir(tmp_path, where, name):
    """``run.name = ".."`` (or a variant named "..") would put the run directory outside output_dir, where an
    --overwrite could replace another run: refused with a message naming the key."""
    from fedsight.sweep import expand

    raw = tiny()
    if where == "run":
        raw["run"] = {**raw.get("run", {}), "name": name}
    else:
        raw["variants"] = [{"name": name}]
    with pytest.raises(ConfigError, match="leave output_dir"):
        expand(raw, "config")


@pytest.mark.parametrize("key,value", [("train.lr", float("inf")), ("partition.alpha", float("nan")),
                                       ("server.optimizer", {"name": "fedadam", "lr": float("-inf")}),
                                       ("recipe.components", [{"name": "norm_bound", "bound": float("inf")}])])
def test_no_float_field_accepts_inf_or_nan(key, value):
    from fedsight.config import set_path

    raw = tiny()
    set_path(raw, key.split("."), value)
    with pytest.raises(ConfigError, match="finite number"):
        validate(raw)


@pytest.mark.parametrize("path", sorted((Path(__file__).parent.parent / "examples").glob("*.toml")), ids=lambda p: p.name)
def test_every_example_config_expands_and_validates(path):
    """Every run of every README example (variants x seeds) is a valid config, so a README command cannot fail
    on its config."""
    from fedsight.sweep import load

    specs = load(path)
    assert specs and len({s.run_dir for s in specs}) == len(specs)


def test_setting_the_run_name_keeps_the_other_run_keys():
    """``--set run.name=X`` used to be taken for a component switch and dropped output_dir and checkpoint_keep."""
    raw = tiny()
    raw["run"] = {"name": "a", "output_dir": "elsewhere", "checkpoint_keep": 5}
    (spec,) = expand(raw, "config", ["run.name=b"])
    assert (spec.config.run.name, spec.config.run.output_dir, spec.config.run.checkpoint_keep) == ("b", "elsewhere", 5)


def test_component_parameters_without_a_name_say_so():
    with pytest.raises(ConfigError, match=r"server.optimizer has parameters but no name"):
        expand(tiny(), "config", ["server.optimizer.lr=0.5"])
