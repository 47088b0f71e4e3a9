"""Issue 48's target on a CPU, as a paired measurement: is the distributed backend on 2 ranks of one thread each no
slower than one process of two threads on the same cores?

Each pair runs both configurations of ``fedsight bench --nproc 2`` (``fedsight.distributed.bench.time_one``: fresh
processes, the bench's CNN workload, vectorised, median seconds of the timed rounds after a warm-up one), the order
alternating from pair to pair (AB, BA, AB, ...) so a change of load falls on both alike. Printed: each pair's
updates/s and the ratio (2 ranks / 1 rank x 2 threads), then the mean of the per-pair log ratios with its 95%
Student-t interval (``fedsight.reporting.paired``), as a ratio, and a verdict: "no slower" only when the interval's
lower end is at least 1, "slower" when its upper end is below 1, else "not told apart". The commit, command and
load averages are printed with it.

    python benchmarks/ranks_vs_threads.py [--pairs 8] [--rounds 5] [--clients 50]
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
from fedsight.reporting.paired import paired_difference

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=8, help="alternating pairs of runs (at least 2)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds of each run, after one warm-up round")
    ap.add_argument("--clients", type=int, default=50, help="clients a round (all train every round)")
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
    configs = {"threads": (1, 2), "ranks": (2, 1)}
    got: dict[str, dict[int, float]] = {"threads": {}, "ranks": {}}
    print(f"{'pair':>4} {'order':>14} {'1 rank x 2 thr':>15} {'2 ranks x 1 thr':>16} {'ratio':>7}")
    with tempfile.TemporaryDirectory(prefix="fedsight-ranks-vs-threads-") as tmp:
        for i in range(args.pairs):
            order = ["threads", "ranks"] if i % 2 == 0 else ["ranks", "threads"]
            for name in order:
                ranks, threads = configs[name]
                got[name][i] = time_one(raw, args.rounds, ranks, threads, Path(tmp))["updates_per_s"]
            print(f"{i:>4} {' then '.join(order):>14} {got['threads'][i]:>15.1f} {got['ranks'][i]:>16.1f} "
                  f"{got['ranks'][i] / got['threads'][i]:>6.2f}x", flush=True)
    logs = {k: {i: math.log(v) for i, v in d.items()} for k, d in got.items()}
    d = paired_difference(logs["ranks"], logs["threads"], higher_is_better=True)
    lo, hi = (math.exp(x) for x in d.ci)
    verdict = "no slower" if lo >= 1 else "slower" if hi < 1 else "not told apart"
    print(f"2 ranks / 1 rank x 2 threads: {math.exp(d.mean):.3f}x (geometric mean of {d.n} pairs), "
          f"95% CI {lo:.3f}x to {hi:.3f}x: {verdict}")
    print(f"load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
