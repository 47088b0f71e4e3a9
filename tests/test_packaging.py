"""Packaging: the library's requirements are ranges (it installs next to an existing CUDA torch), CI's
exact versions satisfy them, and the wheel installs into Python 3.12 and 3.13 where those exist here."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def pins() -> dict[str, Version]:
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            out[name.lower().replace("_", "-")] = Version(version)
    return out


def test_runtime_requirements_are_ranges_that_ci_pins_satisfy():
    constraints = pins()
    for text in PROJECT["dependencies"]:
        req = Requirement(text)
        assert not any(s.operator == "==" for s in req.specifier), f"{text}: an exact pin in the library's requirements"
        name = req.name.lower().replace("_", "-")
        assert name in constraints, f"{name} has no exact version in constraints.txt"
        assert req.specifier.contains(constraints[name]), f"constraints.txt pins {name} {constraints[name]} outside {text}"
    torch = next(Requirement(t) for t in PROJECT["dependencies"] if Requirement(t).name == "torch")
    for version in ("2.11.0", "2.13.0", "2.13.0+cu128"):  # recent CUDA builds and this machine's CPU build
        assert torch.specifier.contains(Version(version)), version
    assert Requirement("python" + PROJECT["requires-python"]).specifier.contains("3.13")


#: another interpreter must not see this one's PYTHONPATH / PYTHONHOME (Ray, for one, adds to them)
CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON") and k != "VIRTUAL_ENV"}


def interpreter(minor: str) -> str | None:
    """A working ``python3.<minor>`` here: on PATH, or one that pyenv manages."""
    candidates = [shutil.which(f"python3.{minor}")]
    if shutil.which("pyenv"):
        root = subprocess.run(["pyenv", "root"], capture_output=True, text=True).stdout.strip()
        candidates += sorted(glob.glob(os.path.join(root, "versions", f"3.{minor}.*", "bin", f"python3.{minor}")))
    for c in candidates:
        if c and subprocess.run([c, "--version"], capture_output=True, env=CLEAN_ENV).returncode == 0:
            return c
    return None


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The project's wheel, built once: setuptools builds in the source tree's build/, and two builds at once
    (the two interpreters' tests on two workers) removed each other's files."""
    dist = tmp_path_factory.mktemp("dist")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
                            str(ROOT)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    return next(dist.glob("fedsight-*.whl"))


@pytest.mark.xdist_group("wheel")  # one worker builds the wheel, once (`--dist loadgroup`, the README's test command)
@pytest.mark.parametrize("minor", ["12", pytest.param("13", marks=pytest.mark.slow)])  # 3.13: FEDSIGHT_SLOW=1
def test_the_wheel_installs_into_a_fresh_virtualenv(tmp_path, minor, wheel):
    python = interpreter(minor)
    if python is None:
        pytest.skip(f"no Python 3.{minor} on this machine")
    subprocess.run([python, "-m", "venv", str(tmp_path / "venv")], check=True, env=CLEAN_ENV)
    venv_python = str(tmp_path / "venv" / "bin" / "python")
    # no index: the dependencies are not installed (torch alone is gigabytes); pip checks requires-python
    installed = subprocess.run([venv_python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                               capture_output=True, text=True, env=CLEAN_ENV)
    assert installed.returncode == 0, installed.stderr
    meta = subprocess.run([venv_python, "-c", "import importlib.metadata as m; d = m.distribution('fedsight'); "
                           "print(d.version); print(d.metadata['Requires-Python']); print(*d.requires, sep='\\n')"],
                          capture_output=True, text=True, check=True, env=CLEAN_ENV).stdout.splitlines()
    assert meta[0] == PROJECT["version"] and meta[1] == ">=3.11"
    assert any(r.startswith("torch") and "==" not in r for r in meta[2:])
