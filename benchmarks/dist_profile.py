"""Where a distributed round's time goes: per-phase timers on every rank of the `fedsight bench --nproc` workload.

    PYTHONPATH=src python benchmarks/dist_profile.py [--nproc 2] [--rounds 10] [--clients 50]

Runs the bench's distributed timing (``fedsight.distributed.bench``: the small CNN on digits, vectorised, one thread
a rank, ``clients`` a round) under torchrun, with timers wrapped around each phase of a round: the backend's
``train`` on rank 0 (everything from splitting the clients to the replies in hand), each rank's own training
(``InProcessBackend.train``), packing, sending, receiving and unpacking messages (``distributed.wire``), rank 0's
one-pass finite check, and the server's ``collect`` (the contract check) and ``end_round`` (aggregation and the
server optimizer). Prints, per rank, the median milliseconds a call of each phase over the timed rounds (the first
two calls, the warm-up round and the first timed one, left out) and the median seconds a round rank 0 measured.
A receive's time includes the wait for the sender: on rank 0, for the slowest other rank to finish its share; on
another rank, for rank 0's server work between rounds.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TIMES: dict[str, list[float]] = collections.defaultdict(list)


def _wrap(owner: Any, name: str, label: str) -> None:
    inner = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            TIMES[label].append(time.perf_counter() - start)

    setattr(owner, name, timed)


def _rank(raw: dict[str, Any], rounds: int, out: Path) -> None:
    """One rank: the bench's own rounds (``distributed.bench._rounds``) with the phases timed."""
    import fedsight.distributed.bench as bench
    import fedsight.distributed.engine as engine
    import fedsight.distributed.wire as wire
    from fedsight.engine.loop import InProcessBackend
    from fedsight.engine.server import Server

    for name in ("pack", "unpack", "send", "recv", "finite_sections"):
        _wrap(wire, name, f"wire.{name}")
    _wrap(engine.DistributedBackend, "train", "rank 0: DistributedBackend.train")
    _wrap(InProcessBackend, "train", "own share: InProcessBackend.train")
    _wrap(Server, "collect", "server: collect")
    _wrap(Server, "end_round", "server: end_round")
    rank = int(os.environ.get("RANK", "0"))
    try:
        bench._rounds(raw, rounds, out)
    finally:
        (out.parent / f"phases-{rank}.json").write_text(json.dumps(TIMES))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds (after one warm-up round)")
    ap.add_argument("--clients", type=int, default=50)
    args = ap.parse_args()
    from fedsight.bench import cnn_workload

    total = args.rounds + 1
    raw = cnn_workload(args.clients, args.rounds)
    raw = {**raw, "server": {**raw["server"], "rounds": total}, "eval": {"every": total, "local": False},
           "engine": {"device": "cpu", "vectorize": True, "threads": 1}}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="fedsight-dist-profile-") as tmp:
        out = Path(tmp) / "round.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
               __file__, "--rank", json.dumps(raw), str(args.rounds), str(out)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0 or not out.is_file():
            sys.exit(f"error: the profiled run failed: {(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
        print(f"{args.clients} clients a round, {args.nproc} ranks x 1 thread, {args.rounds} timed rounds: "
              f"{json.loads(out.read_text())['seconds'] * 1000:.1f} ms a round (rank 0's median)")
        for rank in range(args.nproc):
            phases = json.loads((Path(tmp) / f"phases-{rank}.json").read_text())
            print(f"rank {rank} (median ms a call, calls):")
            for label, times in sorted(phases.items(), key=lambda kv: -statistics.median(kv[1][2:] or kv[1])):
                print(f"  {label:36s} {statistics.median(times[2:] or times) * 1000:8.2f}  {len(times):4d}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        _rank(json.loads(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
    else:
        main()
