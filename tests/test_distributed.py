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
    return {"out": out, "ref": ref, "said": json.loads((out / "session.json").read_text())}


@pytest.mark.parametrize("name", ["fedavg", "fedbn", "krum", "staged"])
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
