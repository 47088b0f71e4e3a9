"""Prefetch worker processes die with their parent (issue 44, item 5).

A real ``fedsight run`` process with ``data.workers = 2`` and ``data.backend = "process"`` (an on-disk
ImageFolder, so the prefetcher is used) is SIGKILLed once both spawned workers exist; every worker must be
gone (or a zombie awaiting its reaper) within a few seconds. Linux only: processes are found through /proc.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tomli_w
from helpers import tiny
from PIL import Image

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of a live process, None once it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    rest = raw[raw.rindex(")") + 2:].split()
    return rest[0], int(rest[1])


def _workers_of(parent: int) -> list[int]:
    """PIDs of the multiprocessing workers (``spawn_main``) whose parent is ``parent``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        st = _stat(int(entry))
        if st is None or st[1] != parent:
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmd:
            found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")  # a zombie has died; only its reaper is missing


def _write_tree(root: Path) -> None:
    rng = np.random.default_rng(0)
    for k, name in enumerate(("a", "b", "c")):
        (root / name).mkdir(parents=True)
        for i in range(12):
            img = np.clip(rng.normal(60 + 60 * k, 40, (10, 10, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(img).save(root / name / f"{i:03d}.png")


def test_sigkill_of_a_run_takes_its_process_workers_with_it(tmp_path) -> None:
    _write_tree(tmp_path / "tree")
    data = {"name": "imagefolder", "train_dir": str(tmp_path / "tree"), "image_size": 8, "test_fraction": 0.25,
            "workers": 2, "backend": "process"}
    raw = tiny(**{"data": data, "model.channels": [4], "partition.num_clients": 4, "server.clients_per_round": 2,
                  "server.rounds": 100000, "train.batch_size": 4, "engine.threads": 1, "eval.every": 100000})
    (tmp_path / "c.toml").write_text(tomli_w.dumps(raw))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("FEDSIGHT_DEBUG", None)
    run = subprocess.Popen([sys.executable, "-c", "from fedsight.cli import main; main()", "run", "c.toml"],
                           cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and run.poll() is None:
            workers = _workers_of(run.pid)
            if len(workers) >= 2:
                break
            time.sleep(0.2)
        assert run.poll() is None, f"the run ended before its workers were seen:\n{run.stderr.read().decode()[-2000:]}"
        assert len(workers) >= 2, f"the run never started its 2 process workers (saw {workers})"
        time.sleep(1.0)  # let the workers finish starting (their initializer runs before the first item)
        os.kill(run.pid, signal.SIGKILL)
        run.wait(timeout=30)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_alive(p) for p in workers):
            time.sleep(0.1)
        left = [p for p in workers if _alive(p)]
        assert not left, f"workers {left} outlived their SIGKILLed parent {run.pid} by 5 s"
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        for pid in workers:  # a failing case must not leave its orphans behind
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
