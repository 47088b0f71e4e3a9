"""The distributed backend (``fedsight.distributed``): 2 gloo ranks on the CPU give the one-process run's
metrics and final model, bit for bit with clients trained one at a time (FedAvg, SCAFFOLD, FedBN, Krum, a staged
recipe) and to float tolerance vectorised; a run stopped on 2 ranks resumes on 1; ranks that disagree on the
config start nothing; a failing rank fails the run naming it, resumable. One torchrun session
(``tests/dist_session.py``) runs every case while this process runs the one-process references."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dist_session import CASES, FAILING, register
from fedsight.api import execute
from fedsight.config import validate

#: one worker runs the module (`--dist loadgroup`, the README's test command): the torchrun session runs once
pytestmark = pytest.mark.xdist_group("distributed")

HERE = Path(__file__).resolve().parent
SRC = str(Path(__import__("fedsight").__file__).resolve().parents[1])


def _config(raw: dict[str, Any], out: Path, name: str) -> Any:
    return validate({**raw, "run": {**raw["run"], "output_dir": str(out), "name": name}})


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl without timings (the only entries that may differ)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def _model(run_dir: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The torchrun session's run directories and what rank 0 said, and the one-process references (run while the
    session runs)."""
    out = tmp_path_factory.mktemp("ranks")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, str(HERE), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(HERE / "dist_session.py"), str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    register()
    ref = tmp_path_factory.mktemp("one")
    try:
        for name, (raw, _) in {**CASES, "failing": (FAILING, None)}.items():
            execute(_config(raw, ref, name), ref / name)
        log, _ = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, log[-3000:]
    return {"out": out, "ref": ref, "said": json.loads((out / "session-0.json").read_text()),
            "worker": json.loads((out / "session-1.json").read_text())}


@pytest.mark.parametrize("name", ["fedavg", "fedbn", "krum", "staged", "dp_sgd", "central_dp"])
def test_two_ranks_equal_one_process_bit_for_bit(session: dict[str, Any], name: str) -> None:
    assert session["said"][name] == {"status": "complete"}
    got, ref = session["out"] / name, session["ref"] / name
    assert _rows(got) == _rows(ref)
    assert (got / "model.safetensors").read_bytes() == (ref / "model.safetensors").read_bytes()
    assert (got / "client_weights.jsonl").read_text() == (ref / "client_weights.jsonl").read_text()


def test_a_run_stopped_on_two_ranks_resumes_on_one_with_the_same_numbers(session: dict[str, Any]) -> None:
    """SCAFFOLD: the clients' control variates, written into the run's store by rank 0 from both ranks' saves,
    carry the run on in one process to the uninterrupted one-process run's numbers."""
    assert session["said"]["scaffold"] == {"status": "stopped"}
    run = session["out"] / "scaffold"
    assert json.loads((run / "status.json").read_text())["round"] == 2
    assert sorted(p.name for p in (run / "client_state" / "scaffold").iterdir())  # state of both ranks' clients
    execute(_config(CASES["scaffold"][0], session["out"], "scaffold"), run, resume=True)
    assert _rows(run)[-1] == _rows(session["ref"] / "scaffold")[-1]
    assert (run / "model.safetensors").read_bytes() == (session["ref"] / "scaffold" / "model.safetensors").read_bytes()


def test_vectorised_shares_equal_one_group_to_float_tolerance(session: dict[str, Any]) -> None:
    """Vectorised, each rank trains its share as one group (2 + 2 clients against 4 in one process): equal to
    float rounding, as the vectorised conformance tests hold groupings to."""
    import numpy as np

    got, ref = session["out"] / "vectorised", session["ref"] / "vectorised"
    a, b = _model(got), _model(ref)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k].numpy(), b[k].numpy(), rtol=1e-4, atol=1e-5, err_msg=k)
    last, want = _rows(got)[-1], _rows(ref)[-1]
    assert last.keys() == want.keys()
    for k, v in want.items():
        assert last[k] == pytest.approx(v, rel=1e-4, abs=1e-5), k


def test_the_same_execute_call_serves_on_the_other_rank(session: dict[str, Any]) -> None:
    """A script calling ``fedsight.api.execute`` on every rank: rank 1's call serves each run ("served"), one that
    rank 0 refused before it started ("refused") and one that rank 0 stopped with an error ("failed"), and returns
    without writing anything."""
    assert session["worker"] == {**{name: {"status": "served"} for name in CASES}, "disagree": {"status": "refused"},
                                 "secret": {"status": "refused"}, "failing": {"status": "failed"}}


def test_clients_drawing_noise_from_their_own_secrets_are_refused_before_the_run_starts(session: dict[str, Any]) -> None:
    said = session["said"]["secret"]["error"]
    assert said.startswith('ConfigError: privacy.noise = "secret" with 2 ranks: the clients\' secrets (dp_sgd) live '
                           "in rank 0's run directory only"), said
    assert not (session["out"] / "secret").exists()


def test_ranks_that_disagree_on_the_config_start_nothing(session: dict[str, Any]) -> None:
    said = session["said"]["disagree"]["error"]
    assert said.startswith("ConfigError: rank 1's config differs from rank 0's (config digest "), said
    assert not (session["out"] / "disagree").exists()


def test_a_failing_rank_fails_the_run_in_one_line_naming_it_and_the_run_resumes(session: dict[str, Any]) -> None:
    said = session["said"]["failing"]["error"]
    assert said.startswith("RankFailed: rank 1: RuntimeError: client ") and "cannot train (a test failure)" in said
    assert "\n" not in said
    run = session["out"] / "failing"
    status = json.loads((run / "status.json").read_text())
    assert (status["state"], status["round"]) == ("running", 2)  # the rounds before the failure are kept
    execute(_config(FAILING, session["out"], "failing"), run, resume=True)  # one process: nothing fails
    assert _rows(run)[-1] == _rows(session["ref"] / "failing")[-1]
    assert (run / "model.safetensors").read_bytes() == (session["ref"] / "failing" / "model.safetensors").read_bytes()


def test_two_ranks_record_themselves_in_run_json(session: dict[str, Any]) -> None:
    meta = json.loads((session["out"] / "fedavg" / "run.json").read_text())
    assert {k: meta["sessions"][-1][k] for k in ("backend", "ranks", "dist_backend", "messages")} == {
        "backend": "distributed", "ranks": 2, "dist_backend": "gloo", "messages": "shared memory"}  # (one machine)
    assert not list(Path("/dev/shm").glob("fedsight-*")), "a shared-memory segment was left behind"
    one = json.loads((session["ref"] / "fedavg" / "run.json").read_text())["sessions"][-1]
    assert one["backend"] == "in-process" and "ranks" not in one


def test_the_split_balances_estimated_cost_not_client_count() -> None:
    from fedsight.distributed.engine import split_clients

    # one client with as much work as the three others together: it gets a rank to itself
    assert split_clients([3, 5, 8, 9], [1.0, 3.0, 1.0, 1.0], 2) == [[5], [3, 8, 9]]
    # equal costs: round robin, each share in client-id order
    assert split_clients([0, 1, 2, 3, 4], [1.0] * 5, 2) == [[0, 2, 4], [1, 3]]
    # clients that cost nothing (dropped out) still spread over the ranks
    assert split_clients([0, 1, 2], [0.0, 0.0, 0.0], 3) == [[0], [1], [2]]


def test_the_launcher_drops_only_its_own_options() -> None:
    from fedsight.distributed.launch import rank_argv

    argv = ["run", "c.toml", "--nproc", "2", "-s", "seed=1", "--dist-backend=gloo", "--nproc=3", "--stop-after", "2"]
    assert rank_argv(argv) == ["run", "c.toml", "-s", "seed=1", "--stop-after", "2"]


def _cli(*args: str) -> tuple[int, str, str]:
    """``fedsight ARGS`` in this process (bad options fail before any rank starts)."""
    import contextlib
    import io

    from fedsight.cli import main

    out, err = io.StringIO(), io.StringIO()
    argv = sys.argv
    sys.argv = ["fedsight", *args]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exc:
            main()
    finally:
        sys.argv = argv
    return int(exc.value.code or 0), out.getvalue(), err.getvalue()


@pytest.mark.parametrize("args, says", [
    (["--nproc", "4"], "error: 4 ranks for 3 clients a round: every rank needs a client to train; use at most 3"),
    (["--nproc", "2", "--dist-backend", "nccl"], "error: --dist-backend nccl: not available here"),
    (["--nproc", "2", "--dist-backend", "mpi"], "error: --dist-backend 'mpi': expected one of gloo, nccl"),
    (["--nproc", "2", "--jobs", "2"], "error: --jobs 2 with 2 ranks: a sweep's runs take turns on the ranks"),
    (["--dist-backend", "gloo"], "error: --dist-backend without --nproc N (N > 1) or torchrun"),
    (["--nproc", "0"], "error: Invalid value for '--nproc': 0 is not in the range x>=1."),
    (["--nproc", "2", "--device", "cuda"], "error: engine.device = 'cuda' but CUDA is not available here"),
])
def test_bad_launch_options_are_one_line_before_any_rank_starts(tmp_path: Path, args: list[str], says: str) -> None:
    import tomli_w

    from helpers import tiny

    cfg = tmp_path / "c.toml"
    cfg.write_text(tomli_w.dumps(tiny(**{"run.output_dir": str(tmp_path / "runs")})))
    if "nccl" in args or "cuda" in args:
        import torch.distributed as dist

        if __import__("torch").cuda.is_available() and (dist.is_nccl_available() or "cuda" in args):
            pytest.skip("CUDA (and NCCL) is available here")
    code, out, err = _cli("run", str(cfg), *args)
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith(says), err
    assert not (tmp_path / "runs").exists()


def test_a_device_this_machine_lacks_is_one_line_before_any_job_starts(tmp_path: Path) -> None:
    """`--jobs 2` on a sweep of two runs with `--device cuda` where CUDA is not: one line from the parent, not one
    per job, and nothing written."""
    import tomli_w

    from helpers import tiny

    if __import__("torch").cuda.is_available():
        pytest.skip("CUDA is available here")
    raw = {**tiny(**{"run.output_dir": str(tmp_path / "runs")}), "sweep": {"seeds": [0, 1]}}
    cfg = tmp_path / "c.toml"
    cfg.write_text(tomli_w.dumps(raw))
    code, out, err = _cli("run", str(cfg), "--jobs", "2", "--device", "cuda")
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and lines == ["error: engine.device = 'cuda' but CUDA is not available here (torch "
                                   f"{__import__('torch').__version__}, a build without CUDA); use \"auto\" or "
                                   "\"cpu\""], err
    assert not (tmp_path / "runs").exists()


def test_fedsight_run_nproc_launches_the_ranks_and_rank_0_says_why_a_run_cannot_start(tmp_path: Path) -> None:
    """`fedsight run CONFIG --nproc 2` through the real launcher: a sweep's first run trains on 2 ranks; its second
    samples a fraction of one client a round, which only rank 0 can find out (the data decides): one line from
    rank 0, its exit code from the launcher, and nothing written for that run or the third (the worker stops
    serving there too, rather than wait for the third run's handshake and report rank 0 lost)."""
    import tomli_w

    from helpers import tiny

    raw = tiny(**{"run.output_dir": str(tmp_path / "runs"), "server.rounds": 2, "engine.threads": 1})
    del raw["server"]["clients_per_round"]
    raw["variants"] = [{"name": "two", "server": {"clients_per_round": 2}}, {"name": "few", "server": {"fraction": 0.1}},
                       {"name": "after", "server": {"clients_per_round": 2}}]
    cfg = tmp_path / "c.toml"
    cfg.write_text(tomli_w.dumps(raw))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]), "COLUMNS": "200",
           "FEDSIGHT_DIST_SHM": "0"}  # gloo's TCP transfer, as between machines (the session above: shared memory)
    proc = subprocess.run([sys.executable, "-m", "fedsight", "run", str(cfg), "--nproc", "2"], capture_output=True,
                          text=True, env=env, timeout=600)
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 2, proc.stderr
    assert lines == ["error: 2 ranks for 1 client a round: every rank needs a client to train; use at most 1 "
                     "(--nproc, or torchrun's --nproc-per-node x nodes)"], proc.stderr
    runs = sorted(p.parent.parent.name for p in (tmp_path / "runs").rglob("run.json"))
    assert runs == ["two"], runs
    (done,) = (tmp_path / "runs").rglob("status.json")
    assert json.loads(done.read_text())["state"] == "complete"
    session = json.loads((done.parent / "run.json").read_text())["sessions"][-1]
    assert session["ranks"] == 2 and session["launched_by"] == ["fedsight", "run", str(cfg), "--nproc", "2"]
    assert session["messages"] == "gloo"
    from fedsight.api import execute
    from fedsight.sweep import load

    (spec,) = load(cfg, only=["two"])
    execute(spec.config, tmp_path / "one")  # the same run in one process: the same numbers over TCP
    assert _rows(done.parent) == _rows(tmp_path / "one")


def test_the_launcher_blames_the_rank_that_stopped_first_not_those_it_stopped() -> None:
    import signal

    from fedsight.distributed.launch import blame

    class Failure:
        def __init__(self, exitcode: int, timestamp: int = 100):
            self.exitcode, self.timestamp = exitcode, timestamp

        def signal_name(self) -> str:
            return signal.Signals(-self.exitcode).name if self.exitcode < 0 else "<N/A>"

    # rank 1 was killed; rank 0 then said "lost contact" (exit 1) or was stopped by the agent (SIGTERM)
    line = "error: rank 1 stopped (signal SIGKILL); the run directory is resumable: run the same command again"
    assert blame({0: Failure(1), 1: Failure(-9)}) == (1, line)
    assert blame({0: Failure(-15), 1: Failure(-9)}) == (1, line)
    # rank 0 failed with its own line (a worker's error it reported, bad input): its code, no second line
    assert blame({0: Failure(2)}) == (2, None)
    assert blame({0: Failure(1), 1: Failure(-15)}) == (1, None)
    assert blame({1: Failure(1, 99), 0: Failure(1)}) == (1, None)


@pytest.mark.slow
def test_bench_nproc_times_one_and_two_ranks_and_records_them(tmp_path: Path) -> None:
    """`fedsight bench --nproc 2` (slow: four launches): one row per (ranks, threads), efficiency against one rank."""
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]), "COLUMNS": "120"}
    proc = subprocess.run([sys.executable, "-m", "fedsight.cli", "bench", "-w", "cnn", "--clients", "4", "--rounds", "2",
                           "--no-flower", "--no-memory", "--nproc", "2", "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert "4 clients a round on 1..2 ranks, vectorised, device auto" in proc.stdout
    rows = json.loads(out.read_text())["ranks"]["cnn"]
    assert [(r["ranks"], r["threads"]) for r in rows] == [(1, 1), (1, 2), (2, 1)]
    assert rows[0]["efficiency"] == 1.0 and rows[1]["efficiency"] is None
    for r in rows:
        assert r["seconds"] > 0 and abs(r["updates_per_s"] - 4 / r["seconds"]) < 1e-9
    assert rows[2]["efficiency"] == pytest.approx(rows[2]["updates_per_s"] / (2 * rows[0]["updates_per_s"]))
