"""``fedsight bench --nproc N``: client updates/s of the distributed backend on 1..N ranks, on one workload.

``time_ranks`` runs this module once per configuration, each in fresh processes: one rank in-process (at one
thread, then at N threads: what one process gets from the same cores), then k = 2..N ranks of one thread each
under torchrun's launcher (``python -m torch.distributed.run --standalone``). Every rank trains its share of the
round's clients with the vectorised engine (``engine.vectorize = true``); rank 0 times whole rounds (training,
gathering, aggregation: ``Simulation.train_round``), the first one a warm-up, and writes the median to a JSON
file. Scaling efficiency = updates/s on k ranks / (k x updates/s on one rank at one thread).

    python -m fedsight.distributed.bench CONFIG_JSON ROUNDS OUT_JSON     (one rank, or every rank under torchrun)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _rounds(raw: dict[str, Any], rounds: int, out: Path) -> None:
    """This process's part: rank 0 (or the only process) times ``rounds`` rounds after a warm-up one."""
    from ..build import build_simulation
    from ..config import validate
    from .engine import DistributedBackend, serve
    from .run import build_worker
    from .world import current, join

    cfg = validate(raw)
    world = current()
    if world is not None:
        join(world)
        if not world.leader:
            runtime, schedule = build_worker(cfg)
            serve(runtime, schedule, cfg.seed, world)
            return
    sim = build_simulation(cfg)
    if world is not None:
        sim.backend = DistributedBackend(sim.server, sim.runtime, world)
    times = []
    try:
        for r in range(1, rounds + 2):
            start = time.perf_counter()
            sim.train_round(r)
            if r > 1:
                times.append(time.perf_counter() - start)
    finally:
        if world is not None:
            sim.backend.close()
    out.write_text(json.dumps({"seconds": statistics.median(times), "clients": sim.schedule.clients_per_round}))


def bench_config(raw: dict[str, Any], rounds: int, device: str = "cpu") -> dict[str, Any]:
    """The config every configuration of ``time_ranks`` runs: ``rounds`` timed rounds after a warm-up one, no
    evaluation, vectorised on ``device``."""
    total = rounds + 1
    return {**raw, "server": {**raw["server"], "rounds": total}, "eval": {"every": total, "local": False},
            "engine": {"device": device, "vectorize": True}}


def time_one(raw: dict[str, Any], rounds: int, ranks: int, threads: int, tmp: Path,
             env: dict[str, str] | None = None) -> dict[str, Any]:
    """One configuration in fresh processes (``ranks`` ranks of ``threads`` threads; torchrun's launcher for more
    than one rank) on ``bench_config``'s config: its median seconds a round and updates/s. ``env``: variables set
    for those processes on top of this one's (e.g. ``FEDSIGHT_DIST_SHM``)."""
    src = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1",
           **(env or {})}
    cfg = json.dumps({**raw, "engine": {**raw["engine"], "threads": threads}})
    out = Path(tmp) / f"r{ranks}t{threads}.json"
    out.unlink(missing_ok=True)
    launcher = ([sys.executable] if ranks == 1 else
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)])
    proc = subprocess.run([*launcher, "-m", "fedsight.distributed.bench", cfg, str(rounds), str(out)],
                          capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0 or not out.is_file():
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"the {ranks}-rank benchmark run failed: {last}")
    got = json.loads(out.read_text())
    return {"ranks": ranks, "threads": threads, "seconds": got["seconds"], "updates_per_s": got["clients"] / got["seconds"]}


def time_ranks(raw: dict[str, Any], rounds: int, nproc: int, device: str = "cpu") -> list[dict[str, Any]]:
    """One row per configuration (ranks, threads a rank, seconds a round, updates/s, efficiency). ``device``:
    ``engine.device`` of every rank ("cuda": rank k on GPU k mod the GPUs, so ranks share one GPU)."""
    raw = bench_config(raw, rounds, device)
    runs = [(1, 1), (1, nproc)] + [(k, 1) for k in range(2, nproc + 1)]
    with tempfile.TemporaryDirectory(prefix="fedsight-bench-ranks-") as tmp:
        rows = [time_one(raw, rounds, ranks, threads, Path(tmp)) for ranks, threads in runs]
    base = rows[0]["updates_per_s"]
    for r in rows:
        r["efficiency"] = r["updates_per_s"] / (r["ranks"] * base) if r["threads"] == 1 else None
    return rows


if __name__ == "__main__":
    _rounds(json.loads(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
