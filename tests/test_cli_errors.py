"""The CLI's one error boundary: bad input gives one line on stderr, a non-zero exit and no traceback
(``FEDSIGHT_DEBUG=1`` shows it). Through ``fedsight.cli.main``, the console script's function, in this process
(``fuzz_helpers.cli``: its exit status, stdout and stderr; an exception past it is exit -1), and through real
processes for ``FEDSIGHT_DEBUG``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import tomli_w

from fuzz_helpers import cli
from helpers import tiny


def fedsight(*args: str) -> subprocess.CompletedProcess:
    res = cli(list(args))
    return subprocess.CompletedProcess(["fedsight", *args], res.code, res.out, res.err)


def _lines(text: str) -> list[str]:
    return [x for x in text.splitlines() if x.strip()]


def test_a_config_that_is_not_utf8_is_one_line_naming_the_file(tmp_path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_bytes(b"# caf\xe9\nseed = 0\n")
    out = fedsight("run", str(cfg))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "not UTF-8" in out.stderr and str(cfg.name) in out.stderr


def test_an_output_dir_that_is_a_file_is_one_line_and_the_file_survives(tmp_path) -> None:
    blocker = tmp_path / "runs"
    blocker.write_text("not a folder")
    raw = tiny(**{"server.rounds": 1, "run.output_dir": str(blocker)})
    cfg = tmp_path / "c.toml"
    cfg.write_text(tomli_w.dumps(raw))
    out = fedsight("run", str(cfg))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr  # the output guard, at config time
    assert len(_lines(out.stderr)) == 1 and str(blocker) in out.stderr, out.stderr
    assert "run.output_dir" in out.stderr and "a file, not a folder" in out.stderr, out.stderr
    assert blocker.read_text() == "not a folder"


def test_parts_that_do_not_fit_together_found_while_building_are_a_configuration_error(tmp_path) -> None:
    """Refused when the run is built (not by the schema): still one line and exit 2, and nothing written."""
    raw = tiny(**{"server.rounds": 1, "engine.vectorize": True, "recipe.components": ["ditto"],
                  "run.output_dir": str(tmp_path / "runs")})
    cfg = tmp_path / "c.toml"
    cfg.write_text(tomli_w.dumps(raw))
    out = fedsight("run", str(cfg))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert _lines(out.stderr)[0].startswith("error: engine.vectorize = true: stage 'federated' cannot train"), out.stderr
    assert not any((tmp_path / "runs").rglob("*.safetensors"))


@pytest.mark.parametrize("text", ["seed = [1, 2]\n", "[[[x\n", "a = " + "[" * 5000 + "]" * 5000 + "\n"])
def test_malformed_configs_are_one_line(tmp_path, text) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(text)
    out = fedsight("run", str(cfg))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr


def test_a_mistyped_command_is_one_line_with_one_suggestion() -> None:
    """typer and click each append "Did you mean ...?": the line says it once."""
    out = fedsight("evaluat")
    lines = _lines(out.stderr)
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "No such command 'evaluat'" in lines[0] and lines[0].count("Did you mean") == 1, lines[0]


def test_fedsight_debug_shows_the_traceback_that_the_one_line_error_hides(tmp_path):
    """``FEDSIGHT_DEBUG=1`` (docs/configuration.md): the same bad input, with the traceback behind the line."""
    import os
    import subprocess
    import sys

    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nlr = -1\n")
    env = {k: v for k, v in os.environ.items() if k != "FEDSIGHT_DEBUG"}
    plain = subprocess.run([sys.executable, "-m", "fedsight.cli", "run", str(bad)], capture_output=True, text=True,
                           env=env, cwd=tmp_path, check=False)
    debug = subprocess.run([sys.executable, "-m", "fedsight.cli", "run", str(bad)], capture_output=True, text=True,
                           env={**env, "FEDSIGHT_DEBUG": "1"}, cwd=tmp_path, check=False)
    assert plain.returncode == 2 and "Traceback" not in plain.stderr and "train.lr" in plain.stderr, plain.stderr
    assert debug.returncode != 0 and "Traceback (most recent call last)" in debug.stderr, debug.stderr
    assert not (tmp_path / "runs").exists()
