"""One writer per run directory: a second process on a run directory in use fails at once, naming the PID."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomli_w

from fedsight.api import execute
from fedsight.crosseval import evaluate_run
from fedsight.config import validate
from fedsight.runs import RunInUse, RunLock
from fuzz_helpers import cli
from helpers import tiny

CLI = [sys.executable, "-c", "from fedsight.cli import main; main()"]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}


def _rounds(run_dir: Path) -> list[int]:
    return [json.loads(line)["round"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if "event" not in json.loads(line)]


def test_a_second_fedsight_run_of_the_same_config_fails_at_once_naming_the_first(tmp_path):
    raw = tiny(**{"server.rounds": 100000, "eval.every": 1000, "engine.threads": 1, "run.checkpoint_keep": 1})
    cfg = tmp_path / "exp.toml"
    cfg.write_text(tomli_w.dumps(raw))
    run_dir = tmp_path / "runs" / "tiny" / "seed0"
    first = subprocess.Popen([*CLI, "run", str(cfg)], cwd=tmp_path, env=_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not (run_dir / "status.json").is_file():  # the first is training
            assert first.poll() is None, first.stderr.read()
            assert time.time() < deadline, "the first run never recorded a round"
            time.sleep(0.2)
        # the second: the console script's function in this process (another process than the first; a fresh
        # interpreter would only add its start-up)
        second = cli(["run", str(cfg)], cwd=tmp_path, env={"COLUMNS": "200"})
        assert second.code == 1, second.show()
        err = " ".join(second.err.split())
        assert f"is in use by another FedSight process (PID {first.pid})" in err, err
        assert "Traceback" not in second.err
        assert first.poll() is None  # untouched by the second
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(60)
    rounds = _rounds(run_dir)
    assert rounds == list(range(1, len(rounds) + 1)) and rounds  # one writer: no interleaved rows
    assert not (tmp_path / "runs" / "tiny" / ".seed0.lock").exists()  # released on exit


def _hold(lock_path: Path) -> subprocess.Popen:
    """Another process holding the run directory's lock until its stdin closes."""
    code = ("import sys; from fedsight.runs import RunLock\n"
            f"with RunLock({str(lock_path)!r}):\n    print('held', flush=True); sys.stdin.read()")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env=_env())
    assert p.stdout.readline().strip() == "held"
    return p


def test_resume_and_evaluate_refuse_a_run_directory_another_process_holds(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = validate(tiny(**{"server.rounds": 2}))
    run_dir = tmp_path / "runs" / "tiny" / "seed0"
    execute(cfg, run_dir, stop_after=1)
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    holder = _hold(run_dir)
    try:
        with pytest.raises(RunInUse, match=f"PID {holder.pid}"):
            execute(cfg, run_dir, resume=True)
        with pytest.raises(RunInUse, match=f"PID {holder.pid}"):
            evaluate_run(run_dir)
    finally:
        holder.stdin.close()
        holder.wait(30)
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before  # nothing written
    assert execute(cfg, run_dir).status == "complete"  # released with its holder


def test_a_lock_taken_for_a_new_run_that_fails_to_start_leaves_no_folder(tmp_path):
    target = tmp_path / "out" / "exp" / "seed0"
    with pytest.raises(RuntimeError):
        with RunLock(target):
            assert (tmp_path / "out" / "exp" / ".seed0.lock").read_text().strip() == str(os.getpid())
            raise RuntimeError("the data failed to load")
    assert not (tmp_path / "out").exists()
    with RunLock(target):  # a folder the run wrote into is kept
        target.mkdir()
    assert target.is_dir() and not (target.parent / ".seed0.lock").exists()


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    holder = _hold(tmp_path / "run")
    holder.kill()
    holder.wait(30)
    assert (tmp_path / ".run.lock").exists()  # the file stays, the lock went with the process
    with RunLock(tmp_path / "run"):
        pass


def test_a_flower_run_of_a_directory_in_use_is_refused_before_anything_starts(tmp_path):
    pytest.importorskip("flwr")
    from fedsight.flower.options import preflight

    holder = _hold(tmp_path / "run")
    try:
        with pytest.raises(RunInUse, match=f"PID {holder.pid}"):
            preflight(validate(tiny()), {}, tmp_path / "run")
    finally:
        holder.stdin.close()
        holder.wait(30)
    preflight(validate(tiny()), {}, tmp_path / "run")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # checked, nothing written


def test_runs_started_side_by_side_share_parent_folders(tmp_path, monkeypatch):
    """Two runs of a sweep (``--jobs 2``) lock seed0 and seed1 under one new folder at the same moment: the
    folder another process creates between our check and our mkdir, or removes (empty, its start failed) between
    our mkdir and our open, is taken as it comes (this failed with "File exists" naming the sweep's folder)."""
    sweep = tmp_path / "out" / "exp"
    mkdir = Path.mkdir

    def raced(self, *args, **kwargs):  # the other run makes the folder first
        if self == sweep and not self.exists():
            mkdir(self)
        return mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", raced)
    with RunLock(sweep / "seed0"):
        assert (sweep / ".seed0.lock").is_file()
    assert sweep.is_dir()  # made by the other run: not ours to remove
    monkeypatch.undo()

    real_open, removed = os.open, []

    def open_after_removal(path, *args, **kwargs):  # the other run's start failed: it removed its empty folder
        if not removed:
            removed.append(sweep)
            sweep.rmdir()
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_after_removal)
    with RunLock(sweep / "seed1"):
        assert (sweep / ".seed1.lock").is_file()
    assert removed and not sweep.exists()  # made again by us, and removed again, empty


def test_runs_in_threads_of_one_process_take_turns_and_match_a_run_alone(tmp_path):
    """Two `execute` calls at once in threads of one process (the Flower loopback test did this, and its
    in-process model once came out different): torch's global generator seeds the model initialisation and
    the dropout masks, so without turns each run re-seeds it under the other. Both must equal a run alone."""
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from safetensors.torch import load_file

    raw = tiny(**{"server.rounds": 2, "server.clients_per_round": 3, "model.dropout": 0.5, "engine.threads": 1})
    execute(validate(raw), tmp_path / "alone")
    alone = load_file(str(tmp_path / "alone" / "model.safetensors"))
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda name: execute(validate(raw), tmp_path / name), ["a", "b"]))
    for name in ("a", "b"):
        model = load_file(str(tmp_path / name / "model.safetensors"))
        assert all(torch.equal(alone[k], model[k]) for k in alone), name
