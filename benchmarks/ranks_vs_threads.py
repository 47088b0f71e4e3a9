"""Issue 48's target on a CPU, as a paired measurement: is the distributed backend on 2 ranks of one thread each no
slower than one process of two threads on the same cores?

Each pair runs both configurations of ``fedsight bench --nproc 2`` (``fedsight.distributed.bench.time_one``: fresh
processes, the bench's CNN workload, vectorised, median seconds of the timed rounds after a warm-up one), the order
alternating from pair to pair (AB, BA, AB, ...) so a change of load falls on both alike. Printed: each pair's
updates/s and the ratio (2 ranks / 1 rank x 2 threads), then the mean of the per-pair log ratios with its 95%
Student-t interval (``fedsight.reporting.paired``), as a ratio, and a verdict: "no slower" only when the interval's
lower end is at least 1, "slower" when its upper end is below 1, else "not told apart". The commit, command and
load averages are printed with it.

``--against-tcp`` compares the two exchanges of 2 ranks of one thread instead: the payload through shared memory
(``FEDSIGHT_DIST_SHM=1``, the default between ranks of one machine; ``fedsight/distributed/shm.py``) against gloo's
TCP (``FEDSIGHT_DIST_SHM=0``), the ratio shared memory / TCP, "faster" only when the interval's lower end is at
least 1.

    python benchmarks/ranks_vs_threads.py [--pairs 8] [--rounds 5] [--clients 50] [--against-tcp]
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from fedsight.bench import cnn_workload
from fedsight.distributed.bench import bench_config, time_one
from fedsight.distributed.shm import ENV as SHM_ENV
from fedsight.reporting.paired import paired_difference

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=8, help="alternating pairs of runs (at least 2)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds of each run, after one warm-up round")
    ap.add_argument("--clients", type=int, default=50, help="clients a round (all train every round)")
    ap.add_argument("--against-tcp", action="store_true",
                    help="2 ranks with shared memory against 2 ranks over gloo's TCP, instead of ranks against threads")
    args = ap.parse_args()
    if args.pairs < 2 or args.rounds < 2 or args.clients < 2:
        ap.error("--pairs, --rounds and --clients must be at least 2")
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip() or "unknown"
    if subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                      text=True, check=False).stdout.strip():
        commit += " (with uncommitted changes)"
    print(f"commit {commit}; python benchmarks/ranks_vs_threads.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"cpu count {os.cpu_count()}; load average at start {os.getloadavg()[0]:.2f}")
    raw = bench_config(cnn_workload(args.clients, args.rounds + 1), args.rounds, "cpu")
    # name -> (ranks, threads a rank, environment); the ratio is the first over the second
    if args.against_tcp:
        configs = {"shm": (2, 1, {SHM_ENV: "1"}), "tcp": (2, 1, {SHM_ENV: "0"})}
        heads, what, better = ("2 ranks, shm", "2 ranks, TCP"), "shared memory / TCP (2 ranks x 1 thread)", "faster"
    else:
        configs = {"ranks": (2, 1, {}), "threads": (1, 2, {})}
        heads, what, better = ("2 ranks x 1 thr", "1 rank x 2 thr"), "2 ranks / 1 rank x 2 threads", "no slower"
    a, b = configs
    got: dict[str, dict[int, float]] = {a: {}, b: {}}
    print(f"{'pair':>4} {'order':>14} {heads[0]:>16} {heads[1]:>16} {'ratio':>7}")
    with tempfile.TemporaryDirectory(prefix="fedsight-ranks-vs-threads-") as tmp:
        for i in range(args.pairs):
            order = [b, a] if i % 2 == 0 else [a, b]
            for name in order:
                ranks, threads, env = configs[name]
                got[name][i] = time_one(raw, args.rounds, ranks, threads, Path(tmp), env)["updates_per_s"]
            print(f"{i:>4} {' then '.join(order):>14} {got[a][i]:>16.1f} {got[b][i]:>16.1f} "
                  f"{got[a][i] / got[b][i]:>6.2f}x", flush=True)
    logs = {k: {i: math.log(v) for i, v in d.items()} for k, d in got.items()}
    d = paired_difference(logs[a], logs[b], higher_is_better=True)
    lo, hi = (math.exp(x) for x in d.ci)
    verdict = better if lo >= 1 else "slower" if hi < 1 else "not told apart"
    print(f"{what}: {math.exp(d.mean):.3f}x (geometric mean of {d.n} pairs), "
          f"95% CI {lo:.3f}x to {hi:.3f}x: {verdict}")
    print(f"load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
