"""Every command in README.md runs, and every command in docs/*.md is checked, as a user would type it.

README: every ``fedsight ...`` line of its fenced shell blocks (```bash, ```sh, ```console or unlabelled) RUNS, in
the README's order, in a temporary folder holding a copy of ``examples/`` (so every output lands in that folder),
through typer's ``CliRunner`` in this process (the ``fedsight`` entry point is ``fedsight.cli:main`` on the same
app; one process saves a torch import per command). Each must exit 0. Training is shortened two ways, both
visible here and nowhere else:

- the copy of ``examples/quickstart.toml`` is shrunk (``QUICKSTART_SHRINK``: 4 rounds of 1 local epoch, seeds 0
  and 1), so the quickstart's commands run exactly as written, at the paths the README names: the report over
  its folder, ``--select last:2``, a run stopped with ``--stop-after`` and then continued, ``evaluate``;
- ``fedsight run`` of any other example gets ``--smoke`` appended (unless it has ``--stop-after``, which
  ``--smoke`` refuses, or ``--smoke`` already), and its output goes to ``runs/smoke/...`` in the folder.

Commands in ``&&`` chains are taken one by one. ``CANNOT_RUN`` lists what is not run here, with the reason (the
installs, and the test suite itself, whose command must equal the one ``.ci/run`` runs); a README command that is
neither run nor listed fails the test. After the run, every path named in the "What to open after a run" table
exists in the quickstart's folder.

Docs (and the README's inline code): every ``fedsight ...`` command of a fenced block, and every inline code
span that starts with ``fedsight``, ``python`` or ``pytest``, is CHECKED without running: the subcommand and
every option exist and their values parse (click's parser, as the command line would); a config file path that
exists in the repository is expanded and validated with the command's ``--set`` and ``--variant`` values (every
key validates, every variant exists); ``python SCRIPT`` names a file of the repository; ``pytest`` names test
files (and ``::`` test names) that exist. A span with a placeholder (``...``, ``|``, ``[OPTION]``, ``<name>``,
``fedsight COMMAND``) is a pattern, not a command, and is not checked; in a sentence, a command may leave out its
arguments or an option's value, and what it gives is checked. No docs command is run: those that need a GPU
(``fedsight bench --device cuda``), a dataset on disk (``data.root``) or Flower deployments across machines
(``fedsight flower app``) are checked like the others (other programs' commands, ``flwr`` or ``tensorboard``, are
not), and the examples behind the docs run under ``--smoke`` in ``tests/test_examples_smoke.py``.
"""

from __future__ import annotations

import re
import shlex
import shutil
import tomllib
from pathlib import Path

import click
import pytest
import tomli_w
import typer.main
from typer.testing import CliRunner

from fedsight.cli import app

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))

#: what the test's copy of the quickstart changes (the README's numbers come from the full config)
QUICKSTART_SHRINK = {"server": {"rounds": 4}, "train": {"epochs": 1}, "sweep": {"seeds": [0, 1]}}

#: README commands not run here, by their first words, and why
CANNOT_RUN = {
    "pip install": "installs packages: the test environment is that install (tests/test_packaging.py builds and "
                   "installs the wheel into fresh virtualenvs)",
    "python -m pytest": "the test suite itself, from inside the suite; checked equal to .ci/run's command instead",
}

_FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
_SHELL = {"", "bash", "sh", "shell", "console"}
_PATTERN = re.compile(r"\.\.\.|\||\[[-A-Z]|<[a-z]|^fedsight [A-Z]")


def fenced_commands(path: Path) -> list[str]:
    """The commands of ``path``'s fenced shell blocks, one per line and ``&&`` link (``$ `` prompts, leading
    ``VAR=value`` settings and trailing ``# comments`` dropped); lines that are output, not commands, are left out."""
    out = []
    for lang, body in _FENCE.findall(path.read_text(encoding="utf-8")):
        if lang not in _SHELL:
            continue
        for line in re.sub(r"\\\n\s*", " ", body).splitlines():  # a line continued with \ is one command
            line = re.sub(r"^(\w+=\S*\s+)+", "", line.strip().removeprefix("$ "))  # environment settings
            if not re.match(r"(fedsight|python|pip|pytest)\b", line):
                continue
            for part in line.split("&&"):
                words = shlex.split(part, comments=True)
                if words:
                    out.append(shlex.join(words))
    return out


def inline_commands(path: Path) -> list[str]:
    """Inline code spans of ``path``'s prose that are commands (not patterns)."""
    text = _FENCE.sub("", path.read_text(encoding="utf-8"))
    spans = re.findall(r"(?<!`)`([^`\n]+)`(?!`)", text)
    return [s for s in spans if re.match(r"(fedsight|python|pytest) ", s) and not _PATTERN.search(s)]


def parse(argv: list[str]) -> tuple[click.Command, dict]:
    """The command and its parsed parameters, as ``fedsight ARGV`` would see them; nothing runs (click's
    ``make_context`` parses and converts every option and argument; a bad one raises click's UsageError)."""
    cmd: click.Command = typer.main.get_command(app)
    ctx = cmd.make_context("fedsight", list(argv))
    while isinstance(cmd, click.Group):
        rest = [*ctx._protected_args, *ctx.args]
        if not rest:
            raise click.MissingParameter(ctx=ctx, param=click.Argument(["command"]))
        name, cmd, rest = cmd.resolve_command(ctx, rest)
        ctx = cmd.make_context(name, rest, parent=ctx)
    return cmd, ctx.params


def check(command: str, where: str, fragment: bool = False) -> None:
    """Check one documented command without running it (see the module's docstring). ``fragment``: an inline
    span in a sentence, which may name a command without its arguments (`fedsight flower simulate
    --gpus-per-client 0.5`) or an option without its value (`fedsight report --csv`); what it does give is
    checked."""
    words = shlex.split(command)
    if words[0] == "python" and words[1:2] == ["-m"]:
        words = words[2:]
    elif words[0] == "python":
        script = words[1]
        assert (ROOT / script).is_file(), f"{where}: `{command}`: no file {script}"
        return
    if words[0] == "pytest":
        for arg in words[1:]:
            if arg.startswith("tests/"):
                file, _, name = arg.partition("::")
                assert (ROOT / file).exists(), f"{where}: `{command}`: no test file {file}"
                if name:
                    assert re.search(rf"def {re.escape(name.split('[')[0])}\b", (ROOT / file).read_text()), \
                        f"{where}: `{command}`: no test {name} in {file}"
        return
    assert words[0] == "fedsight", f"{where}: `{command}`: not a fedsight, python or pytest command"
    words = ["2" if w == "N" else w for w in words]  # placeholders: a count is a number, a name (CONFIG) a name
    try:
        cmd, params = parse(words[1:])
    except click.exceptions.Exit:  # --help, --version
        return
    except click.exceptions.NoArgsIsHelpError as exc:  # a command group named without its subcommand
        if not fragment:
            pytest.fail(f"{where}: `{command}`: no subcommand ({exc.ctx.command_path} ...)")
        return
    except click.MissingParameter as exc:
        if not (fragment and isinstance(exc.param, click.Argument)):
            pytest.fail(f"{where}: `{command}`: {exc.format_message()}")
        return
    except click.BadOptionUsage as exc:
        if not (fragment and "requires an argument" in exc.message and words[-1] == exc.option_name):
            pytest.fail(f"{where}: `{command}`: {exc.format_message()}")
        return
    except click.UsageError as exc:
        pytest.fail(f"{where}: `{command}`: {exc.format_message()}")
    config = params.get("config")
    if config is not None and (ROOT / config).is_file() and str(config).endswith(".toml"):
        from fedsight.config import ConfigError
        from fedsight.sweep import load

        try:
            specs = load(ROOT / config, params.get("set_") or [], params.get("variant") or [],
                         smoke=bool(params.get("smoke")))
        except ConfigError as exc:
            pytest.fail(f"{where}: `{command}`: {exc}")
        assert specs, f"{where}: `{command}`: no runs"


def test_every_readme_command_runs_as_written(tmp_path, monkeypatch):
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    quick = tmp_path / "examples" / "quickstart.toml"
    raw = tomllib.loads(quick.read_text())
    for section, keys in QUICKSTART_SHRINK.items():
        raw[section].update(keys)
    quick.write_text(tomli_w.dumps(raw))
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    commands = fenced_commands(README)
    ran = []
    for command in commands:
        if any(command.startswith(prefix) for prefix in CANNOT_RUN):
            continue
        words = shlex.split(command)
        assert words[0] == "fedsight", f"README: `{command}` is neither run here nor in CANNOT_RUN"
        if (words[1] == "run" and words[2] != "examples/quickstart.toml"
                and not {"--smoke", "--stop-after"} & set(words)):
            words.append("--smoke")
        result = runner.invoke(app, words[1:])
        assert result.exit_code == 0, f"README: `{shlex.join(words)}` exited {result.exit_code}:\n{result.output}"
        ran.append(words)
    assert ["fedsight", "run", "examples/quickstart.toml"] in ran  # the set-up command's job
    assert any("--stop-after" in w for w in ran)
    for name in opened_after_a_run():
        assert (tmp_path / "runs" / "quickstart" / name).exists(), f"README's table names {name}: not written"


def opened_after_a_run() -> list[str]:
    """The paths the README's "What to open after a run" table names, relative to the quickstart's folder (a bare
    file name after another path in the same row lies beside it)."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## What to open after a run"):]
    section = section[:section.index("\n## ", 1)]
    names = []
    for row in re.findall(r"^\| (`[^|]*`) \|", section, re.M):
        paths = re.findall(r"`([^`]+)`", row)
        first = Path(paths[0])
        names += [paths[0]] + [str(first.parent / p) if "/" not in p.rstrip("/") else p for p in paths[1:]]
    return names


def test_the_readme_table_of_files_is_read_whole():
    names = opened_after_a_run()
    assert {"report.md", "curves.png", "fedavg/seed0/metrics.jsonl", "fedavg/seed0/client_weights.jsonl",
            "fedavg/seed0/checkpoints", "fedavg/seed0/config.toml", "fedavg/seed0/model.safetensors"} <= set(names), names


def test_the_readme_test_command_is_the_one_ci_runs():
    """.ci/run runs the README's test command (with python3 and a quiet pip): they must not drift apart."""
    readme = [c for c in fenced_commands(README) if c.startswith(("pip install", "python -m pytest"))]
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    ci_commands = [shlex.join(shlex.split(p)) for p in ci.split("&&")]
    ci_commands = [c.replace("python3 -m pip install -q", "pip install").replace("python3 -m pytest", "python -m pytest")
                   for c in ci_commands]
    suite = [c for c in readme if c.startswith("python -m pytest")]
    assert suite and all(c == ci_commands[-1] for c in suite)
    assert ci_commands[:-1] == ["pip install torch==2.13.0", "pip install -c constraints.txt -e '.[test]'"]
    assert set(ci_commands[:-1]) <= set(readme)


PAGES = [README, *DOCS]
CASES = [(p, c, False) for p in DOCS for c in dict.fromkeys(fenced_commands(p))] + \
    [(p, c, True) for p in PAGES for c in dict.fromkeys(inline_commands(p))]


@pytest.mark.parametrize("page, command, fragment", CASES, ids=[f"{p.name}:{c[:60]}" for p, c, _ in CASES])
def test_every_documented_command_parses_and_its_config_validates(page, command, fragment):
    check(command, page.name, fragment)


def test_the_checker_refuses_what_a_user_would_meet():
    for bad in ("fedsight runn examples/quickstart.toml", "fedsight run examples/quickstart.toml --smok",
                "fedsight run examples/quickstart.toml --variant fedyogi",
                "fedsight run examples/quickstart.toml --set server.roundz=3",
                "fedsight report runs/x --select", "python benchmarks/nothing.py",
                "pytest tests/test_cli.py::test_not_there"):
        with pytest.raises(pytest.fail.Exception):
            try:
                check(bad, "here")
            except AssertionError as exc:
                pytest.fail(str(exc))
    check("fedsight run examples/quickstart.toml --variant fedadam --set server.rounds=3", "here")
