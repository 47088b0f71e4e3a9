"""Issue 45's command-line frictions, each as the user met it: ``list`` by the words its headings print, a choice
parameter's choices, an error that names the ``--set`` it came from, ``resume``'s summary rendered, ``--device`` on
``run`` (an interrupted run's line is in test_interrupt.py: it needs a real process)."""

from __future__ import annotations

import json

import pytest
import tomli_w
from rich.console import Console
from typer.testing import CliRunner

from fedsight.cli import app

from helpers import tiny

runner = CliRunner()


@pytest.mark.parametrize("word, heading", [("models", "models"), ("components", "recipe components"),
                                           ("optimizers", "server optimizers"), ("server-optimizers", "server optimizers"),
                                           ("server_optimizer", "server optimizers"), ("sharing", "parameter sharings"),
                                           ("Datasets", "datasets"), ("task", "tasks")])
def test_list_takes_the_words_of_its_own_headings(word, heading, monkeypatch):
    monkeypatch.setattr("fedsight.cli_common.console", Console(width=200))
    res = runner.invoke(app, ["list", word])
    assert res.exit_code == 0, res.output
    titles = [line.strip() for line in res.output.splitlines() if line.strip() and line.strip()[0].isalpha()]
    assert titles == [heading]  # that registry's table, and it alone


def test_list_of_an_unknown_kind_is_one_line_naming_the_kinds():
    res = runner.invoke(app, ["list", "widgets"])
    assert res.exit_code == 2
    assert "unknown kind 'widgets'" in res.output and "server_optimizer" in res.output


def test_list_shows_every_choice_of_a_choice_parameter(monkeypatch):
    monkeypatch.setattr("fedsight.cli_common.console", Console(width=1000))  # one line per entry
    res = runner.invoke(app, ["list", "tasks"])
    line = next(x for x in res.output.splitlines() if x.strip("│ ").startswith("segmentation"))
    assert "style='none' [none|fda|cfsi|lab]" in line
    line = next(x for x in res.output.splitlines() if x.strip("│ ").startswith("image_sr"))
    assert "[l1|l2|charbonnier]" in line


def _cfg(tmp_path, **over):
    path = tmp_path / "c.toml"
    path.write_text(tomli_w.dumps(tiny(**over)))
    return path


def test_an_error_in_a_value_set_on_the_command_line_names_that_set_and_the_key(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = _cfg(tmp_path)
    res = runner.invoke(app, ["run", str(cfg), "--set", "server.clients_per_round=50"])
    assert res.exit_code == 2
    line, = res.output.strip().splitlines()
    assert line.startswith(f"error: --set server.clients_per_round=50 on {cfg}: ")
    assert "server.clients_per_round = 50 exceeds partition.num_clients = 6" in line and "(top level)" not in line
    assert not (tmp_path / "runs").exists()
    res = runner.invoke(app, ["run", str(cfg), "--set", "partition.num_clients=2"])  # the other key of the message
    assert res.exit_code == 2 and res.output.startswith(f"error: --set partition.num_clients=2 on {cfg}: "), res.output


def test_an_error_in_the_file_itself_still_blames_the_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = _cfg(tmp_path, **{"server.clients_per_round": 50})
    res = runner.invoke(app, ["run", str(cfg), "--set", "train.lr=0.05"])
    assert res.exit_code == 2
    assert res.output.strip() == f"error: {cfg}: server.clients_per_round = 50 exceeds partition.num_clients = 6"


@pytest.mark.parametrize("body, who", [
    ("server.optimizer.lr = -1: Input should be greater than 0", "--set server.optimizer=fedadam"),
    ("unknown key 'bogus' (allowed: data, engine)", "--set bogus=1"),
    ("model: Input tag 'nope' found using 'name'", "--set model.name=nope"),
    ("train: set either epochs or steps", None),  # the table's own check, not about the override's value
    ("server.rounds = 3: too few", None),
    # the fuzz suite's case: the table exists only because an override wrote a key into it
    ("missing required key 'privacy.central_dp.noise_multiplier'", '--set privacy.central_dp.clipping_norm="x"'),
    ("missing required key 'privacy.noise_multiplier'", None),
])
def test_which_override_a_message_blames(body, who):
    from fedsight.config_messages import blamed

    overrides = [("server.optimizer", "--set server.optimizer=fedadam"), ("bogus", "--set bogus=1"),
                 ("model.name", "--set model.name=nope"), ("train.lr", "--set train.lr=0.5"),
                 ("server.roundsx", "--set server.roundsx=3"),
                 ("privacy.central_dp.clipping_norm", '--set privacy.central_dp.clipping_norm="x"')]
    assert blamed(body, overrides) == who


def test_resume_ends_as_run_does_with_the_table_and_the_files_not_raw_markdown(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = _cfg(tmp_path, **{"server.rounds": 2})
    assert runner.invoke(app, ["run", str(cfg), "--stop-after", "1"]).exit_code == 0
    res = runner.invoke(app, ["resume", "runs/tiny/seed0"])
    assert res.exit_code == 0, res.output
    assert "##" not in res.output and "![" not in res.output and "**" not in res.output  # no Markdown source
    assert "test/acc" in res.output  # the comparison table `fedsight run` ends with
    assert res.output.splitlines()[-2:] == ["run: runs/tiny/seed0", "summary: runs/tiny/seed0/summary.md"]
    again = runner.invoke(app, ["resume", "runs/tiny/seed0"])  # already complete: the same ending
    assert again.exit_code == 0 and again.output.splitlines()[-1].startswith("summary: runs/tiny/seed0/summary.md")


def test_run_takes_device_as_resume_does(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = _cfg(tmp_path, **{"server.rounds": 2})
    res = runner.invoke(app, ["run", str(cfg), "--device", "gpu"])
    assert res.exit_code == 2 and res.output.strip() == \
        "error: --device 'gpu': expected \"auto\", \"cpu\", \"cuda\" or \"cuda:N\"" and not (tmp_path / "runs").exists()
    res = runner.invoke(app, ["run", str(cfg), "--device", "cpu", "--stop-after", "1"])
    assert res.exit_code == 0, res.output
    assert res.output.strip().endswith(f"continue with: fedsight run {cfg} --device=cpu")
    run_json = json.loads((tmp_path / "runs/tiny/seed0/run.json").read_text())
    assert json.dumps(run_json).count('"cpu"') >= 1
    assert json.loads((tmp_path / "runs/tiny/seed0/config.json").read_text())["engine"]["device"] == "cpu"
