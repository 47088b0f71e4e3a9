"""Flower's Ray-backed simulation engine as a FedSight engine option: `fedsight flower simulate` gives
the in-process simulator's run bit for bit (SCAFFOLD, client state on the virtual nodes, local
evaluation on the nodes)."""

from __future__ import annotations

import json
import logging

import pytest
import tomli_w
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from fedsight.api import execute
from fedsight.config import validate
from fedsight.flower.cli import flower_app

from helpers import tiny

pytestmark = pytest.mark.flower


def test_ray_simulation_equals_in_process(tmp_path, monkeypatch, recwarn):
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr-home"))  # Flower writes nothing to ~/.flwr
    raw = tiny(**{"partition.num_clients": 3, "server.clients_per_round": 2, "server.rounds": 2, "eval.every": 1,
                  "recipe.components": ["scaffold"], "recipe.weighting": "uniform", "engine.threads": 1})
    cfg_file = tmp_path / "run.toml"
    cfg_file.write_text(tomli_w.dumps(raw))
    execute(validate(raw), tmp_path / "inproc")
    logged: list[str] = []  # what Flower logs (its own handler's stream is not pytest's capture)

    class Keep(logging.Handler):
        def emit(self, record):
            logged.append(record.getMessage())

    monkeypatch.setattr(logging.getLogger("flwr"), "handlers", [*logging.getLogger("flwr").handlers, Keep()])
    result = CliRunner().invoke(flower_app, ["simulate", str(cfg_file), "--run-dir", str(tmp_path / "ray"),
                                             "--cpus-per-client", "1", "--ray-cpus", "1"])
    assert result.exit_code == 0, result.output
    # issue 45: neither run_simulation's deprecation banner nor Ray's FutureWarning; Flower's other lines still show
    assert not [m for m in logged if "DEPRECATED FEATURE" in m] and any("client identity not authenticated" in m
                                                                        for m in logged), logged
    assert not [w for w in recwarn if "Ray will no longer override" in str(w.message)]
    a, b = load_file(str(tmp_path / "inproc" / "model.safetensors")), load_file(str(tmp_path / "ray" / "model.safetensors"))
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)

    def rows(p):
        return [{k: v for k, v in json.loads(x).items() if not k.startswith(("time/", "flower/"))}
                for x in (p / "metrics.jsonl").read_text().splitlines()]

    ra, rb = rows(tmp_path / "inproc"), rows(tmp_path / "ray")
    assert ra == rb and all("local/wma" in r for r in rb)
    assert not (tmp_path / "ray" / "client_state").exists()
