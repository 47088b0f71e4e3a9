"""Starting points (issue 45, item 7): ``fedsight init TASK`` writes a commented config that runs as written,
``fedsight schema`` exports a JSON Schema every example config validates against, and shell completion works
(commands, ``init``'s tasks, ``--variant`` names read from the config on the command line)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedsight.cli import app

runner = CliRunner()
EXAMPLES = sorted((Path(__file__).parents[1] / "examples").glob("*.toml"))
TASKS = ["classification", "image_sr", "keypoints", "segmentation", "video_sr"]


def _comments(text: str) -> str:
    """The file's comment text, wrapped lines joined (as the descriptions read before wrapping)."""
    return " ".join(line.strip()[1:].strip() for line in text.splitlines() if line.strip().startswith("#"))


def test_init_knows_every_registered_task():
    from fedsight import registry as R
    from fedsight.init_config import tasks
    from fedsight.plugins import load_builtin

    load_builtin()
    own = [e.name for e in R.TASKS.entries() if getattr(e.factory, "__module__", "").startswith("fedsight.")]
    assert tasks() == TASKS == own  # a new task needs its starting point (other tests register toy tasks)


@pytest.mark.parametrize("task", TASKS)
def test_init_writes_a_valid_config_whose_comments_are_the_models_descriptions(task, tmp_path, monkeypatch):
    from fedsight import sweep as S
    from fedsight.init_config import _section_model

    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, ["init", task])
    assert res.exit_code == 0, res.output
    assert res.output.strip() == f"wrote {task}.toml; try it with: fedsight run {task}.toml --smoke"
    text = (tmp_path / f"{task}.toml").read_text()
    raw = tomllib.loads(text)
    assert raw["task"]["name"] == task
    specs = S.expand(raw, f"{task}.toml", smoke=True)  # every key and check of `fedsight run --smoke`
    assert len(specs) == 1 and specs[0].config.task.name == task
    said = _comments(text)
    for section in ("run", "task", "data", "partition", "model", "train", "server", "eval"):
        model = _section_model(section, raw[section])
        for key, field in model.model_fields.items():  # every described key: set, or listed at its default
            if field.description and key != "name" and (key in raw[section] or not field.is_required()) \
                    and field.get_default(call_default_factory=True) is not None:
                assert " ".join(field.description.replace("``", "").split()) in said, (section, key)
        assert all(len(line) <= 100 for line in text.splitlines() if line.startswith("#") and " = " not in line)


def test_a_starting_config_runs_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert runner.invoke(app, ["init", "classification", "--out", "c.toml"]).exit_code == 0
    res = runner.invoke(app, ["run", "c.toml", "--smoke"])
    assert res.exit_code == 0, res.output
    status = json.loads((tmp_path / "runs/smoke/classification/seed0/status.json").read_text())
    assert status["state"] == "complete"


def test_init_never_replaces_a_file_and_names_unknown_tasks(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.toml").write_text("seed = 7\n")
    res = runner.invoke(app, ["init", "segmentation", "--out", "mine.toml"])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1
    assert "mine.toml: exists" in res.output and (tmp_path / "mine.toml").read_text() == "seed = 7\n"
    res = runner.invoke(app, ["init", "detection"])
    assert res.exit_code == 2 and "no such task; choose one of: " + ", ".join(TASKS) in res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.toml"]


def test_schema_is_written_once_and_is_a_json_schema_of_every_section(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, ["schema", "--out", "fedsight.schema.json"])
    assert res.exit_code == 0, res.output
    schema = json.loads((tmp_path / "fedsight.schema.json").read_text())
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert {"seed", "run", "task", "data", "partition", "model", "train", "server", "recipe", "eval", "engine",
            "privacy", "stages", "validation", "pretrain", "sweep", "variants"} <= set(schema["properties"])
    again = runner.invoke(app, ["schema", "--out", "fedsight.schema.json"])
    assert again.exit_code == 2 and "exists; pass --force" in again.output
    assert runner.invoke(app, ["schema", "--out", "fedsight.schema.json", "--force"]).exit_code == 0
    printed = runner.invoke(app, ["schema"])
    assert json.loads(printed.output) == schema


def test_every_example_and_starting_config_validates_against_the_schema_and_mistakes_do_not(tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    from fedsight.init_config import render
    from fedsight.schema import config_schema

    schema = config_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    check = jsonschema.Draft202012Validator(schema)
    configs = {p.name: tomllib.loads(p.read_text()) for p in EXAMPLES}
    configs.update({f"init {t}": tomllib.loads(render(t)) for t in TASKS})
    assert len(EXAMPLES) >= 10
    for name, raw in configs.items():
        assert not list(check.iter_errors(raw)), (name, [e.message for e in check.iter_errors(raw)][:3])
    base = configs["quickstart.toml"]
    for bad in ({**base, "bogus": 1}, {**base, "server": {**base["server"], "rounds": "30"}},
                {**base, "server": {**base["server"], "optimizer": "fedadamm"}},  # bare name: not a component
                {**base, "server": {**base["server"], "optimizer": {"name": "fedadam", "lrr": 0.1}}},
                {**base, "model": {"name": "cnn", "channels": "wide"}},
                {**base, "variants": [{"name": "x", "sever": {}}]}):
        assert list(check.iter_errors(bad)), bad


@pytest.mark.parametrize("words, cword, expected", [
    ("fedsight ru", 1, ["run"]),
    ("fedsight init seg", 2, ["segmentation"]),
    ("fedsight run {quickstart} --variant fed", 4, ["fedavg", "fedadam"]),
    ("fedsight run {quickstart} --variant fedad", 4, ["fedadam"]),
    ("fedsight run nothere.toml --variant ", 4, []),
])
def test_shell_completion_of_commands_tasks_and_variants(words, cword, expected):
    quickstart = next(p for p in EXAMPLES if p.name == "quickstart.toml")
    env = {"_FEDSIGHT_COMPLETE": "complete_bash", "COMP_WORDS": words.format(quickstart=quickstart),
           "COMP_CWORD": str(cword)}
    res = runner.invoke(app, [], env=env, prog_name="fedsight")
    assert res.output.split() == expected


def test_show_completion_prints_the_script_for_the_shell(monkeypatch):
    # typer takes the shell named here only with its detection off; with it on (shellingham installed) it reads the
    # shell from the parent processes, and a suite started without a shell above it (setsid, an IDE) got exit 1
    monkeypatch.setenv("_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION", "1")
    res = runner.invoke(app, ["--show-completion", "bash"], prog_name="fedsight")
    assert res.exit_code == 0 and "_FEDSIGHT_COMPLETE=complete_bash" in res.output
    assert "complete -o default -F _fedsight_completion fedsight" in res.output


def test_every_command_line_of_docs_cli_md_is_one_the_cli_accepts():
    """docs/cli.md's examples parse: each command and option exists and takes the values shown (lines that would
    act as they parse, --help and the completion installers, are left out)."""
    import shlex

    import click
    import typer.main

    text = (Path(__file__).parents[1] / "docs" / "cli.md").read_text()
    lines = [line.split("  #")[0].strip() for block in text.split("```sh")[1:] for line in block.split("```")[0]
             .splitlines() if line.strip().startswith("fedsight ")]
    assert len(lines) >= 20
    group = typer.main.get_command(app)
    for line in lines:
        args = shlex.split(line)[1:]
        if any(a in ("--help", "--install-completion", "--show-completion") for a in args):
            continue
        cmd, name = group, "fedsight"
        while isinstance(cmd, click.Group):
            name, args = args[0], args[1:]
            cmd = cmd.commands[name]
        try:
            cmd.make_context(name, list(args))
        except click.UsageError as exc:
            raise AssertionError(f"docs/cli.md: {line}: {exc.format_message()}") from None
