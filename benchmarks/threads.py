"""Round time with one torch thread (FedSight's default, ``engine.threads = "auto"``) against two, on an
idle machine and with the other core busy.

Each measurement runs in a fresh process (torch's thread pool is per process): a few warm-up rounds,
then the median seconds of training + aggregation per round (``time/train_s + time/aggregate_s``).
"Busy" starts a second process that keeps one core at 100% (a pure-Python loop) for the duration.
Workloads: the quickstart (digits, small CNN, 10 clients x 2 epochs a round) and a wider model (ResNet-8
on digits) where intra-op parallelism has more to split.

    python benchmarks/threads.py [--rounds 12]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

WORKLOADS = {
    "quickstart cnn": {"model": {"name": "cnn", "channels": [32, 64], "hidden": 128}},
    "resnet8": {"model": {"name": "resnet8", "norm": "group"}},
}

CHILD = r"""
import json, sys, time
import torch
from fedsight.api import build_simulation
from fedsight.config import validate
spec = json.loads(sys.argv[1])
raw = {"seed": 0, "data": {"name": "digits"}, "partition": {"name": "dirichlet", "alpha": 0.3, "num_clients": 20},
       "train": {"epochs": 2, "batch_size": 32, "lr": 0.05}, "eval": {"every": 1000, "local": False},
       "server": {"rounds": spec["rounds"], "clients_per_round": 10}, "engine": {"threads": spec["threads"]},
       **spec["workload"]}
sim = build_simulation(validate(raw))
times = []
sim.run(on_round=lambda r, row, ev: times.append(row["time/train_s"] + row["time/aggregate_s"]))
print(json.dumps({"threads": torch.get_num_threads(), "times": times}))
"""


def spin() -> subprocess.Popen:
    """A process that keeps one core busy until killed."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def measure(workload: dict, threads: int | str, rounds: int, busy: bool) -> tuple[float, int]:
    hog = spin() if busy else None
    try:
        time.sleep(0.5 if busy else 0.0)
        out = subprocess.run([sys.executable, "-c", CHILD, json.dumps({"workload": workload, "threads": threads,
                                                                       "rounds": rounds})],
                             capture_output=True, text=True, check=True)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    res = json.loads(out.stdout.strip().splitlines()[-1])
    return statistics.median(res["times"][3:]), res["threads"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=12, help="rounds per measurement (the first 3 are warm-up)")
    args = ap.parse_args()
    print(f"{os.cpu_count()} CPUs; torch default threads here: ", end="", flush=True)
    import torch

    print(torch.get_num_threads())
    print(f"{'workload':16} {'machine':8} {'auto (1 thread)':>16} {'2 threads':>12} {'2 threads / auto':>17}")
    for name, workload in WORKLOADS.items():
        for busy in (False, True):
            t1, n1 = measure(workload, "auto", args.rounds, busy)
            t2, n2 = measure(workload, 2, args.rounds, busy)
            assert (n1, n2) == (1, 2), (n1, n2)
            print(f"{name:16} {'busy' if busy else 'idle':8} {t1:14.3f} s {t2:10.3f} s {t2 / t1:16.2f}x")


if __name__ == "__main__":
    main()
