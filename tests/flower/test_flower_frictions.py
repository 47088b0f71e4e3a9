"""Issue 45's frictions on the Flower path: the config as one run-config key per value (``flwr run
--run-config 'fedsight.server.rounds=3'`` reaches the run), a Flower run's own default run directory, Flower's and
Ray's per-run notices silenced (and nothing else), progress lines never wrapped, the install line that works."""

from __future__ import annotations

import io
import logging
import warnings
from pathlib import Path

import pytest
import tomli_w

from fedsight.config import validate

from helpers import tiny

pytestmark = pytest.mark.flower


def _app(tmp_path: Path) -> tuple[dict, Path]:
    from fedsight.flower.app import write_app

    raw = tiny(**{"partition.num_clients": 3, "server.clients_per_round": 2})
    return raw, write_app(validate(raw), tmp_path / "app", run_dir=tmp_path / "rd")


def test_run_config_overrides_reach_the_fedsight_config(tmp_path):
    """The app's config goes through Flower's own run-config path (its pyproject read and flattened by flwr, the
    `--run-config` string parsed and fused by flwr): a scalar, a float, a list and a None each reach the config
    the ServerApp and ClientApp validate; without overrides the config is the one written."""
    from flwr.common.config import get_fused_config_from_dir, parse_config_args

    from fedsight.flower.client_app import _settings
    from fedsight.flower.run_config import config_from_run_config, config_json

    raw, app = _app(tmp_path)
    plain = get_fused_config_from_dir(app, {})
    assert plain["fedsight.server.rounds"] == 4 and plain["fedsight.model.channels"] == "json:[8]"
    assert validate(config_from_run_config(plain)).model_dump() == validate(raw).model_dump()
    # one --run-config string: flwr 1.41 merges several of them shallowly (a later one's fedsight.* keys replace an
    # earlier one's), as docs/flower.md says
    over = parse_config_args(['fedsight.server.rounds=3 fedsight.train.lr=0.05 fedsight.model.channels="json:[4, 4]" '
                              'round-timeout=90 fedsight.init.weights="json:null"'])
    rc = get_fused_config_from_dir(app, over)
    cfg = validate(config_from_run_config(rc))
    assert (cfg.server.rounds, cfg.train.lr, list(cfg.model.channels), rc["round-timeout"]) == (3, 0.05, [4, 4], 90.0)
    assert cfg.init.weights is None and cfg.partition.num_clients == 3  # the rest as written

    class Ctx:  # the ClientApp reads the same config out of the same run config
        run_config, node_config, run_id = rc, {"partition-id": 1}, 5

    text, _, partition, _ = _settings(Ctx(), None)
    assert text == config_json(rc) and validate(__import__("json").loads(text)).server.rounds == 3 and partition == 1
    with pytest.raises(ValueError, match="not present"):  # flwr refuses a key the app does not have
        get_fused_config_from_dir(app, parse_config_args(["fedsight.server.round=3"]))


def test_run_config_round_trips_what_toml_cannot_hold():
    """Lists, None, empty tables, keys with dots and strings that begin with the marker survive the flat form;
    an earlier app's one JSON string is still read; a marker without JSON is one error naming the key."""
    from fedsight.flower.run_config import config_from_run_config, flat_run_config

    raw = {"a": {"b": [1, 2], "c": None, "d": {}, "e": "json:x", "f": {"x.y": 1}, "g": 1.5, "h": True, "i": "s"}}
    flat = flat_run_config(raw)
    assert flat["fedsight.a.b"] == "json:[1, 2]" and flat["fedsight.a.g"] == 1.5 and flat["fedsight.a.i"] == "s"
    assert all(isinstance(v, (bool, int, float, str)) for v in flat.values())
    assert config_from_run_config(flat) == raw
    assert config_from_run_config({"fedsight-config": '{"seed": 3}'}) == {"seed": 3}
    with pytest.raises(ValueError, match="fedsight.a.b"):
        config_from_run_config({"fedsight.a.b": "json:[1,"})
    with pytest.raises(KeyError, match="fedsight"):
        config_from_run_config({"run-dir": "x"})


def test_flower_runs_default_to_their_own_run_directory(tmp_path, monkeypatch):
    """`flower local` / `simulate` / `app` of a config whose in-process run exists take
    output_dir/run.name/seed<N>-flower-COMMAND, not the in-process run's directory (which they refused)."""
    from fedsight.flower.cli import _check_free, _one_config
    from fedsight.sweep import load

    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.toml").write_text(tomli_w.dumps(tiny()))
    inproc = load(tmp_path / "c.toml", [])[0].run_dir.absolute()
    inproc.mkdir(parents=True)
    (inproc / "config.json").write_text("{}")  # an in-process run is there
    dirs = {cmd: _one_config(tmp_path / "c.toml", None, None, cmd)[1] for cmd in ("local", "simulate", "app")}
    assert dirs["local"] == inproc.parent / "seed0-flower-local"
    assert dirs["simulate"] == inproc.parent / "seed0-flower-simulate" and dirs["app"].name == "seed0-flower-app"
    _check_free(dirs["local"], False)  # free: no "already holds a run"
    assert _one_config(tmp_path / "c.toml", None, tmp_path / "mine", "local")[1] == tmp_path / "mine"


def test_simulation_notices_are_silenced_and_nothing_else():
    """Inside ``quiet_simulation_notices``: Flower's `run_simulation` deprecation banner (logged by flwr's own
    function, as run_simulation logs it) and Ray's accelerator FutureWarning are dropped; another Flower warning
    and another FutureWarning still show; afterwards the banner shows again."""
    from flwr.supercore.logger import warn_deprecated_feature

    from fedsight.flower.simulation import quiet_simulation_notices

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Keep()
    logging.getLogger("flwr").addHandler(handler)
    banner = ("The `run_simulation` function is deprecated and will be removed in a future version of Flower. "
              "Please use `flwr run` in the CLI instead")
    ray_tip = ("Tip: In future versions of Ray, Ray will no longer override accelerator visible devices env var if "
               "num_gpus=0 or num_gpus=None (default).")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with quiet_simulation_notices():
                warn_deprecated_feature(banner)
                warn_deprecated_feature("something else is deprecated")
                warnings.warn(ray_tip, FutureWarning)
                warnings.warn("another future change", FutureWarning)
            warn_deprecated_feature(banner)
    finally:
        logging.getLogger("flwr").removeHandler(handler)
    assert [m for m in seen if "run_simulation" in m] and len([m for m in seen if "run_simulation" in m]) == 1
    assert any("something else is deprecated" in m for m in seen)
    assert [str(w.message) for w in caught] == ["another future change"]


def test_progress_lines_are_never_wrapped(monkeypatch):
    """Off a terminal (a log file: 80 columns), a long progress line (an event with its JSON) stays one line."""
    from fedsight.flower import cli as fc

    buf = io.StringIO()
    monkeypatch.setattr(fc.console, "file", buf)
    row = {"event": "client_rejected", "round": 3, "client": 7, "reason": "non-finite update " * 8, "ids": [1, 2]}
    fc._print_row(row, [("test/accuracy", "acc")], 12.5)
    fc._print_row({"round": 4, "clients/aggregated": 2, "clients/sampled": 3, "test/accuracy": 0.5,
                   "dp/epsilon": 1.25, "time/round_s": 3.0}, [("test/accuracy", "acc")], 140.0)
    lines = buf.getvalue().splitlines()
    assert len(lines) == 2 and len(lines[0]) > 120, lines
    assert '"ids": [1, 2]' in lines[0] and lines[1].endswith("acc 0.5000  eps 1.2500  3.0 s")


def test_install_line_is_the_projects(tmp_path):
    """The generated app's README, docs/flower.md and the missing-Flower error say the install that works (from a
    FedSight clone, with the constraints), never `pip install "fedsight[flower]"` (FedSight is not on PyPI)."""
    from fedsight.flower import INSTALL

    _, app = _app(tmp_path)
    readme = (app / "README.md").read_text()
    docs = (Path(__file__).parents[2] / "docs" / "flower.md").read_text()
    assert INSTALL == 'pip install -c constraints.txt -e ".[flower]"'
    for text in (readme, docs):
        assert INSTALL in text and "fedsight[flower]" not in text
    assert "--run-config" in readme and "fedsight.server.rounds=3" in readme
