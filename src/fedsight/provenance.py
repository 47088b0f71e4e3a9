"""What a run directory records about the software that produced it (``run.json``, per session): the versions
of FedSight's dependencies as installed, and the git commit of FedSight's source tree and of the working
directory when they are git checkouts (a researcher's experiment repository)."""

from __future__ import annotations

import subprocess
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

#: the distributions whose versions change results or their files (torch's build is in ``device.describe``)
PACKAGES = ("numpy", "scikit-learn", "scikit-image", "scipy", "pillow", "safetensors", "pydantic", "kornia",
            "opacus", "pycocotools", "matplotlib", "flwr")


def package_versions() -> dict[str, str]:
    """Installed version of each of ``PACKAGES`` that is installed."""
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


@lru_cache(maxsize=8)
def git_commit(folder: str) -> dict[str, Any] | None:
    """``{"commit": sha, "dirty": bool}`` of the git work tree holding ``folder``; None when it is not in one
    or git is not installed (or does not answer within 5 s)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", folder, *args], capture_output=True, text=True, timeout=5,
                              check=True).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": dirty}


def provenance() -> dict[str, Any]:
    """Package versions and, when available, the git commits of FedSight's source and of the working directory."""
    out: dict[str, Any] = {"packages": package_versions()}
    git = {k: c for k, c in (("fedsight", git_commit(str(Path(__file__).resolve().parent))),
                             ("cwd", git_commit(str(Path.cwd())))) if c is not None}
    if git:
        out["git"] = git
    return out
