"""A Flower run whose options cannot work with its config fails at start: one line naming the key, before Ray
or any Flower process starts and before anything is written; the corrected run then works in the same run
directory. A run that fails later, before its first round is recorded, leaves nothing behind either."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import tomli_w
from typer.testing import CliRunner

from fedsight.config import ConfigError, validate
from fedsight.flower.cli import flower_app

from flower_direct import run_direct
from helpers import tiny

pytestmark = pytest.mark.flower

GOOD = {"partition.num_clients": 3, "server.clients_per_round": 2, "server.rounds": 2, "eval.local": False,
        "recipe.weighting": "uniform", "engine.threads": 1}
DP = ["--dp-noise", "1.0", "--dp-clip", "0.5", "--dp-delta", "1e-4"]
TWO_SIZES = [{"name": "a", "rounds": 1}, {"name": "b", "rounds": 1, "server": {"clients_per_round": 3}}]

#: (config changes, extra flags, what the one-line error must name)
BAD = {
    "weighting": ({"recipe.weighting": "data_size"}, DP, "recipe.weighting"),
    "extras": ({"recipe.components": ["scaffold"]}, DP, "recipe.components scaffold"),
    "buffers": ({"model.norm": "batch"}, DP, "model.norm"),
    "sizes": ({"stages": TWO_SIZES}, DP, "server.clients_per_round"),
    "min-clients": ({}, ["--min-clients", "3"], "--min-clients = 3"),
    "secagg aggregator": ({"recipe.aggregator": "median", "server.clients_per_round": 3}, ["--secagg"],
                          "recipe.aggregator = 'median'"),
    "secagg clients": ({}, ["--secagg"], "at least 3 clients a round"),
    "secagg shares": ({"server.clients_per_round": 3}, ["--secagg", "--secagg-shares", "4"], "--secagg-shares = 4 exceeds"),
    "secagg with dp": ({"server.clients_per_round": 3}, ["--secagg", *DP], "with central DP"),
    "secagg flag alone": ({}, ["--secagg-clip", "4"], "add --secagg"),
}


def _config(tmp_path: Path, **over) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(tomli_w.dumps(tiny(**{**GOOD, **over})))
    return path


def _one_line_naming(res, what: str) -> None:
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and what in " ".join(res.output.split()), res.output


def test_simulate_refuses_a_bad_config_before_ray_and_the_fixed_one_runs_in_the_same_dir(tmp_path, monkeypatch):
    import flwr.simulation

    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr-home"))
    started = []
    real = flwr.simulation.run_simulation
    monkeypatch.setattr(flwr.simulation, "run_simulation", lambda *a, **k: started.append(1))
    rd = tmp_path / "runs" / "tiny" / "seed0"
    for name, (over, flags, what) in BAD.items():
        cfg = _config(tmp_path, **over)
        res = CliRunner().invoke(flower_app, ["simulate", str(cfg), "--run-dir", str(rd), "--ray-cpus", "1", *flags])
        _one_line_naming(res, what)
        assert not started, f"{name}: Ray started"
        assert not (tmp_path / "runs").exists(), f"{name}: {sorted(map(str, (tmp_path / 'runs').rglob('*')))}"
    monkeypatch.setattr(flwr.simulation, "run_simulation", real)
    cfg = _config(tmp_path)
    res = CliRunner().invoke(flower_app, ["simulate", str(cfg), "--run-dir", str(rd), "--ray-cpus", "1", *DP])
    assert res.exit_code == 0, res.output
    status = json.loads((rd / "status.json").read_text())
    assert (status["state"], status["round"]) == ("complete", GOOD["server.rounds"])
    rows = [json.loads(x) for x in (rd / "metrics.jsonl").read_text().splitlines()]
    assert [r["dp/releases"] for r in rows if "event" not in r] == [1, 2]


@pytest.mark.parametrize("name", sorted(BAD))
def test_local_and_app_refuse_a_bad_config_before_anything_starts_or_is_written(tmp_path, monkeypatch, name):
    from fedsight.flower.local import LocalDeployment

    def no_superlink(self, *a, **k):
        raise AssertionError("a SuperLink was started")

    monkeypatch.setattr(LocalDeployment, "start_superlink", no_superlink)
    over, flags, what = BAD[name]
    cfg = _config(tmp_path, **over)
    rd = ["--run-dir", str(tmp_path / "runs" / "x")]
    res = CliRunner().invoke(flower_app, ["local", str(cfg), *rd, "--workdir", str(tmp_path / "work"), *flags])
    _one_line_naming(res, what)
    res = CliRunner().invoke(flower_app, ["app", str(cfg), str(tmp_path / "app"), *rd, *flags])
    _one_line_naming(res, what)
    assert not [p.name for p in tmp_path.iterdir() if p.name != "run.toml"]


@pytest.mark.parametrize("before", ["absent", "empty", "a run"])
def test_a_run_failing_before_its_first_round_leaves_the_run_dir_as_it_was(tmp_path, before):
    """The ServerApp's own safety net (a fault no check can see coming: here the Grid failing in round 1): no run
    directory (nor the folders created for it), the empty one that was there, or the replaced run as it was;
    the retry then runs there."""
    cfg = validate(tiny(**GOOD))
    rd = tmp_path / "out" / "nested" / "run"
    if before == "empty":
        rd.mkdir(parents=True)
    elif before == "a run":
        run_direct(validate(tiny(**{**GOOD, "server.rounds": 1})), rd, tmp_path / "nodes0")
    snapshot = {p.relative_to(tmp_path): p.read_bytes() if p.is_file() else None for p in tmp_path.rglob("*")}

    def fail(grid, msg):
        if msg.metadata.message_type == "train":
            raise RuntimeError("the SuperLink went away")

    with pytest.raises(RuntimeError, match="went away"):
        run_direct(cfg, rd, tmp_path / "nodes1", kill_hook=fail, options={"overwrite": True})
    after = {p.relative_to(tmp_path): p.read_bytes() if p.is_file() else None for p in tmp_path.rglob("*")
             if not p.is_relative_to(tmp_path / "nodes1")}
    assert after == snapshot
    run_direct(cfg, rd, tmp_path / "nodes2", options={"overwrite": True})
    assert json.loads((rd / "status.json").read_text())["state"] == "complete"


def test_a_component_that_uploads_extra_tensors_is_refused_at_start(tmp_path):
    """Any component declaring that its clients attach extra tensors (``Component.uploads_extras``; not only
    SCAFFOLD) is refused by the start checks, on the server that would run it, before a round: its extras would
    leave un-noised. Every built-in component that writes ``result.extras`` declares it."""
    from fedsight.api import build_server
    from fedsight.flower.dp import check_central_dp
    from fedsight.training.component import Component

    class Sketch(Component):
        name = "sketch"
        uploads_extras = True

        def client_end(self, ctx, result):
            result.extras[self.name] = {"s": result.delta[next(iter(result.delta))].sum().reshape(1)}

    class Metric(Component):  # reports a metric only: no extra tensor
        name = "metric"

        def client_end(self, ctx, result):
            result.metrics["m"] = 1.0

    server = build_server(validate(tiny(**GOOD)))
    server.stages[0].recipe.components.append(Metric())
    assert check_central_dp(server) == GOOD["server.clients_per_round"]
    server.stages[0].recipe.components.append(Sketch())
    with pytest.raises(ConfigError, match="recipe.components sketch"):
        check_central_dp(server)


def test_every_builtin_component_that_writes_extras_declares_it():
    import inspect

    from fedsight import registry as R
    from fedsight.plugins import load_builtin
    from fedsight.training.component import Component

    load_builtin()
    for cls in {c for m in list(sys.modules.values()) if (getattr(m, "__name__", "") or "").startswith("fedsight.recipe")
                for _, c in inspect.getmembers(m, inspect.isclass) if issubclass(c, Component)}:
        text = ""  # the class and its bases, with the trainers they hand out (Fed3R's statistics, LADD's styles)
        for base in cls.__mro__:
            if issubclass(base, Component) and base is not Component:
                own = inspect.getsource(base)
                module = sys.modules[base.__module__]
                text += own + "".join(inspect.getsource(t) for n, t in inspect.getmembers(module, inspect.isclass)
                                      if t.__module__ == module.__name__ and f"{n}(self" in own)
        writes = "result.extras[" in text
        assert cls.uploads_extras == writes, cls.__name__
    assert R.COMPONENTS.get("scaffold")
