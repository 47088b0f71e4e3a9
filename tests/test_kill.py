"""A run killed with SIGKILL at any moment of its writes resumes to the numbers of an uninterrupted run, and
leaves no stray file.

A real ``fedsight run`` process (SCAFFOLD, so every round also writes per-client state; a checkpoint every
round and ``checkpoint_keep = 1``, so every round also prunes) kills itself with SIGKILL at one chosen
file-system moment: ``fuzz_helpers.install_kill_hook`` wraps the writers' operations (safetensors'
``save_file``, ``os.replace``, ``os.unlink``, the metrics/client-weights appends) and sends the signal
before, after or in the middle of the n-th one on a matching file. Moments are chosen by name, not by
timing, so every case is deterministic. Then ``fedsight resume RUN_DIR`` (``fedsight run CONFIG`` when the
kill came before ``config.json`` existed) must finish the run with:

* ``metrics.jsonl`` (rounds; events and wall-clock fields aside), ``client_weights.jsonl``,
  ``model.safetensors``, the last checkpoint, every client-state file, ``status.json``, ``config.*`` and
  ``partition.json`` byte-identical to an uninterrupted run of the same config;
* exactly the uninterrupted run's set of files: no temporary file, no orphan checkpoint half, no stale
  client-state version, nothing missing.

CI mode kills at a handful of moments; ``FEDSIGHT_FUZZ_SLOW=1`` at every moment of ``MOMENTS`` (>= 20).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import fuzz_helpers as H
import pytest
import tomli_w
from helpers import tiny

from fedsight.api import execute
from fedsight.config import validate

RAW = tiny(**{"server.rounds": 3, "recipe.components": ["scaffold"], "run.checkpoint_keep": 1, "eval.every": 1,
            "run.plots": True})  # (the kill moments include the plots)
RUN = Path("runs") / "tiny" / "seed0"  # the run directory, relative to a case's folder

#: name -> "op:glob:n:when" (fuzz_helpers.install_kill_hook). 3 rounds of 3 clients; per round: 3 client-state
#: writes (to a temporary file, then renamed), the metrics and client-weights appends, the checkpoint (tensors to a temporary
#: file, rename, JSON marker by temp + rename), pruning of the older checkpoint (tensors, then marker), the
#: client store's commit (superseded versions deleted), status.json; then model.safetensors, the final
#: status, plots and summary.
MOMENTS: dict[str, str] = {
    "config.toml written to its temporary file": "replace:config.toml:1:before",
    "config.toml renamed, config.json not yet": "replace:config.json:1:before",
    "run.json temporary file": "replace:run.json:1:before",
    "round 1: client state half written": "save:*-r000001.safetensors:1:mid",
    "round 1: client state written, not renamed": "replace:*-r000001.safetensors:2:before",
    "round 1: all client states renamed, no metrics yet": "replace:*-r000001.safetensors:3:after",
    "round 1: metrics line torn (no checkpoint yet)": "append:metrics.jsonl:1:mid",
    "round 1: checkpoint tensors half written": "save:.ckpt.*.tmp:1:mid",
    "round 2: metrics appended, client weights not": "append:metrics.jsonl:2:after",
    "round 2: client-weights line torn": "append:client_weights.jsonl:2:mid",
    "round 2: checkpoint tensors written, not renamed": "save:.ckpt.*.tmp:2:after",
    "round 2: checkpoint tensors renamed, no marker": "replace:round-*.safetensors:2:after",
    "round 2: marker written to its temporary file": "replace:round-*.json:2:before",
    "round 2: marker committed, nothing pruned": "replace:round-*.json:2:after",
    "round 2: pruning, old tensors deleted, old marker left": "unlink:round-*.safetensors:1:after",
    "round 2: pruned, client store not committed": "unlink:round-*.json:1:after",
    "round 2: client store commit half done": "unlink:*-r*.safetensors:1:after",
    "round 2: status.json temporary file": "replace:status.json:2:before",
    "round 3: client state half written": "save:*-r000003.safetensors:2:mid",
    "round 3: metrics line torn": "append:metrics.jsonl:3:mid",
    "round 3: status written, final model not": "replace:status.json:3:after",
    "final model written to its temporary file": "save:.model.safetensors.*.tmp:1:after",
    "final model renamed, status still running": "replace:model.safetensors:1:after",
    "status complete, no plots nor summary": "replace:status.json:4:after",
    "plot temporary file written": "replace:curves.png:1:before",
    "summary temporary file written": "replace:summary.md:1:before",
}
FAST = (
    "round 1: client state written, not renamed",
    "round 2: checkpoint tensors written, not renamed",
    "round 2: pruning, old tensors deleted, old marker left",
    "round 2: status.json temporary file",
)
SELECTED = list(MOMENTS) if H.SLOW else list(FAST)

#: moments whose resume is known to fail, with the reproduction (strict: a fix makes the case pass, and then
#: this entry must go)
KNOWN_BUGS: dict[str, str] = {}
PARAMS = [pytest.param(m, marks=pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[m])) if m in KNOWN_BUGS else m
          for m in SELECTED]

#: files whose content legitimately differs between an interrupted and an uninterrupted run (sessions in
#: run.json, a run_repaired event counted in the summary, plots and metrics lines of wall-clock time):
#: compared by name only (metrics.jsonl line by line, without wall-clock fields and repair events)
BY_NAME = {"run.json", "summary.md", "plots/curves.png", "metrics.jsonl"}

def _child_env() -> dict[str, str]:
    tests = str(Path(__file__).parent)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    env.pop("FEDSIGHT_DEBUG", None)
    return env


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[str, tuple[Path, int, str]]]:
    """(the uninterrupted run, moment -> (case folder, exit status, output) of its killed run).

    The killed runs are real processes running ``fedsight run c.toml`` (``fedsight.cli.main``), forked two
    at a time from one interpreter that imported FedSight once (``fuzz_helpers.zygote_main``); meanwhile this
    process makes the uninterrupted run (in process: the same code path as the CLI)."""
    root = tmp_path_factory.mktemp("kill")
    jobs = []
    for i, name in enumerate(SELECTED):
        case = root / f"m{i:02d}"
        case.mkdir()
        (case / "c.toml").write_text(tomli_w.dumps(RAW))
        jobs.append({"case": str(case), "spec": MOMENTS[name], "args": ["run", "c.toml"], "log": str(root / f"m{i:02d}.log")})
    zygote = subprocess.Popen([sys.executable, "-c", "import fuzz_helpers as h; h.zygote_main()"], env=_child_env(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        zygote.stdin.write(json.dumps(jobs))
        zygote.stdin.close()
        ref = root / "reference"
        out = execute(validate(RAW), ref / RUN)
        assert out.status == "complete"
        out, err = zygote.stdout.read(), zygote.stderr.read()
        assert zygote.wait(timeout=900) == 0, err
    finally:
        if zygote.poll() is None:
            zygote.kill()
    status = json.loads(out.strip().splitlines()[-1])
    killed = {name: (Path(j["case"]), status[j["case"]], Path(j["log"]).read_text(errors="replace"))
              for name, j in zip(SELECTED, jobs)}
    return ref / RUN, killed


def _files(run_dir: Path) -> set[str]:
    return {p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*") if p.is_file()}


@pytest.mark.parametrize("moment", PARAMS)
def test_sigkill_then_resume_gives_the_uninterrupted_run(moment, runs) -> None:
    H.count("test_kill")
    reference, killed = runs
    case, status, log = killed[moment]
    assert status == -signal.SIGKILL, f"the moment {MOMENTS[moment]!r} was never reached (exit {status})\n{log[-2000:]}"
    run_dir = case / RUN
    if (run_dir / "config.json").is_file():
        res = H.cli(["resume", str(RUN)], cwd=case)
    else:  # killed before the run directory was a run: running the command again starts it
        res = H.cli(["run", "c.toml"], cwd=case)
    assert res.code == 0, res.show()

    assert H.metric_rows(run_dir) == H.metric_rows(reference)
    same = sorted(f for f in _files(reference) if f not in BY_NAME)
    differ = [f for f in same if not (run_dir / f).is_file() or (run_dir / f).read_bytes() != (reference / f).read_bytes()]
    assert not differ, f"differs from the uninterrupted run: {differ}"
    assert _events(run_dir) == _events(reference), "events other than run_repaired differ"
    stray = sorted(_files(run_dir) - _files(reference))
    missing = sorted(_files(reference) - _files(run_dir))
    assert not stray and not missing, f"stray files {stray}, missing files {missing}"
    leftovers = [p.relative_to(case).as_posix() for p in case.rglob("*") if p.name.endswith(".tmp") or ".replaced" in p.name]
    assert not leftovers, f"temporary files left: {leftovers}"


def _events(run_dir: Path) -> list[dict]:
    """metrics.jsonl's event lines but ``run_repaired`` (a resume saying it dropped a torn line)."""
    import json

    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if "event" in r and r["event"] != "run_repaired"]


def test_every_slow_moment_is_distinct_and_there_are_at_least_twenty() -> None:
    assert len(set(MOMENTS.values())) == len(MOMENTS) >= 20
