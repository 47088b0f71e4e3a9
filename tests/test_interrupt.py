"""An interrupted run says where it stopped and how to go on: a real ``fedsight`` process (``python -m fedsight``)
stopped by SIGTERM (``kill``, a scheduler's time limit) during ``run`` and by SIGINT (Ctrl-C) during ``resume``
exits 130 with one line naming the round it stopped at, the run directory and the command that resumes it, and
its status file agrees."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import tomli_w
from typer.testing import CliRunner

from fedsight.cli import app

from helpers import tiny

RAW = tiny(**{"server.rounds": 4000, "eval.every": 100, "engine.threads": 1})
RUN = Path("runs/tiny/seed0")


def _start(folder: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("FEDSIGHT_DEBUG", None)
    # ``python -m fedsight`` with Python's own Ctrl-C handler: a process started in the background of a script
    # (``cmd &``, as a CI runner may start the suite) inherits SIGINT ignored, and Python then installs none, so a
    # SIGINT did nothing and the run went on to finish (exit 0)
    start = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
             "runpy.run_module('fedsight', run_name='__main__', alter_sys=True)")
    return subprocess.Popen([sys.executable, "-c", start, *args], cwd=folder, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _rounds(folder: Path) -> int:
    path = folder / RUN / "metrics.jsonl"
    return sum(1 for line in path.read_text().splitlines() if '"round"' in line) if path.is_file() else 0


def _interrupt_after(proc: subprocess.Popen, folder: Path, rounds: int, sig: int) -> tuple[int, str, str]:
    """Send ``sig`` once the run has logged ``rounds`` more rounds than it had; (exit code, stdout, stderr)."""
    start, deadline = _rounds(folder), time.monotonic() + 240
    while _rounds(folder) < start + rounds and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


def _said(out: str, err: str, folder: Path, command: str) -> None:
    status = json.loads((folder / RUN / "status.json").read_text())
    assert status["state"] == "interrupted" and 2 <= status["round"] < 4000
    line = f"interrupted at round {status['round']} of 4000 ({RUN}); resume with: {command}"
    assert line in (out + err).splitlines(), out + err


def test_sigterm_on_run_and_ctrl_c_on_resume_say_the_round_and_how_to_resume(tmp_path, monkeypatch):
    term, intr = tmp_path / "term", tmp_path / "int"
    for folder in (term, intr):
        folder.mkdir()
        (folder / "c.toml").write_text(tomli_w.dumps(RAW))
    procs = [_start(term, "run", "c.toml")]
    try:
        monkeypatch.chdir(intr)  # meanwhile, a run stopped after round 1, to be resumed (and interrupted) below
        assert CliRunner().invoke(app, ["run", "c.toml", "--stop-after", "1"]).exit_code == 0
        procs.append(_start(intr, "resume", str(RUN), "--device", "cpu"))
        code, out, err = _interrupt_after(procs[0], term, 2, signal.SIGTERM)
        assert code == 130
        _said(out, err, term, f"fedsight resume {RUN}")
        code, out, err = _interrupt_after(procs[1], intr, 2, signal.SIGINT)
        assert code == 130
        _said(out, err, intr, f"fedsight resume {RUN} --device=cpu")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def test_an_interrupted_jobs_sweep_stops_its_workers_and_marks_their_runs(tmp_path, monkeypatch):
    """``run --jobs``: Ctrl-C in the parent terminates every worker, whose run is then marked interrupted (the
    handler read the pool's processes after shutting it down, when there are none: an AttributeError, workers left
    training and the parent hanging at exit)."""
    import pytest

    from fedsight.parallel import run_parallel

    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.toml").write_text(tomli_w.dumps(RAW))

    def ctrl_c(msg):  # the worker's first round has reached the parent (its phases come before)
        if msg[0] == "round":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_parallel(Path("c.toml"), [], [], [0], 1, on_message=ctrl_c)
    status = json.loads((tmp_path / RUN / "status.json").read_text())
    assert status["state"] == "interrupted" and 1 <= status["round"] < 4000


def test_an_interrupted_jobs_sweep_starts_no_queued_run(tmp_path, monkeypatch):
    """``run --jobs 2`` of four runs stopped while two train: the pool had already handed a third run to a worker
    (a process pool queues one call ahead), and that worker, its run interrupted, went on to train it unseen while
    the parent waited for it (found by a SIGTERM to a long sweep; the next ``fedsight run`` then met it mid-run)."""
    import multiprocessing as mp

    import pytest

    from fedsight.parallel import run_parallel

    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.toml").write_text(tomli_w.dumps({**RAW, "sweep": {"seeds": [0, 1, 2, 3]}}))
    training: set[int] = set()

    def ctrl_c(msg):  # both workers have finished a round of their first run
        if msg[0] == "round":
            training.add(msg[1])
            if len(training) == 2:
                raise KeyboardInterrupt

    try:
        with pytest.raises(KeyboardInterrupt):
            run_parallel(Path("c.toml"), [], [], range(4), 2, on_message=ctrl_c)
        for seed in (0, 1):
            assert json.loads((tmp_path / f"runs/tiny/seed{seed}/status.json").read_text())["state"] == "interrupted"
        assert not (tmp_path / "runs/tiny/seed2").exists() and not (tmp_path / "runs/tiny/seed3").exists()
        assert not [p for p in mp.active_children() if p.is_alive()]  # every worker has ended
    finally:
        for p in mp.active_children():
            p.kill()


def test_ctrl_c_on_another_command_names_it_and_does_not_promise_a_resume(monkeypatch, capsys):
    """Ctrl-C during `report` (or any command but `run` / `resume`) said "resume with `fedsight resume RUN_DIR`",
    a command that does not apply to it; now it names the command that stopped."""
    import pytest

    import fedsight.cli as cli

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "app", stopped)
    for argv, name in ((["report", "runs", "--out", "r"], "report"), (["flower", "simulate", "x.toml"], "flower simulate"),
                       (["--help"], "")):
        monkeypatch.setattr(sys, "argv", ["fedsight", *argv])
        with pytest.raises(SystemExit) as exit_:
            cli.main()
        err = capsys.readouterr().err
        assert exit_.value.code == 130
        assert f"interrupted: `{' '.join(['fedsight', name]).strip()}` stopped before it finished; run it again to finish" in err, err
        assert "resume" not in err
