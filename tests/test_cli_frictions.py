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
    monkeypatch.setattr("fedsight.cli.console", Console(width=200))
    res = runner.invoke(app, ["list", word])
    assert res.exit_code == 0, res.output
    titles = [line.strip() for line in res.output.splitlines() if line.strip() and line.strip()[0].isalpha()]
    assert titles == [heading]  # that registry's table, and it alone


def test_list_of_an_unknown_kind_is_one_line_naming_the_kinds():
    res = runner.invoke(app, ["list", "widgets"])
    assert res.exit_code == 2
    assert "unknown kind 'widgets'" in res.output and "server_optimizer" in res.output


def test_list_shows_every_choice_of_a_choice_parameter(monkeypatch):
    monkeypatch.setattr("fedsight.cli.console", Console(width=1000))  # one line per entry
    res = runner.invoke(app, ["list", "tasks"])
    line = next(x for x in res.output.splitlines() if x.strip("│ ").startswith("segmentation"))
    assert "style='none' [none|fda|cfsi|lab]" in line
    line = next(x for x in res.output.splitlines() if x.strip("│ ").startswith("image_sr"))
    assert "[l1|l2|charbonnier]" in line
