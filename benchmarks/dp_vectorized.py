"""One DP-SGD round trained sequentially (Opacus's per-sample hooks, one client at a time) against the same round
trained vectorised (``fedsight.training.private_step``: per-example gradients under vmap, all the clients together).

The workload is `fedsight bench`'s CNN (``fedsight.bench.cnn_workload``: the quickstart's small CNN on digits,
Dirichlet(0.3) label skew, batch 16, one epoch, every client every round) with ``dp_sgd`` (z = 1, C = 1, Poisson
batches). Two simulations are built, ``engine.vectorize = false`` and ``true``; after a warm-up round each, their
rounds alternate (so load on the machine falls on both alike) and the medians, their ratio and the spread of the
per-pair ratios are printed, with the commit and the command. Evaluation is off. The two runs compute the same
model (``tests/test_dp_vectorized.py``); the first line printed checks it on this round's global models.

    python benchmarks/dp_vectorized.py [--clients 20] [--rounds 5] [--threads 1] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from fedsight.api import build_simulation
from fedsight.bench import cnn_workload
from fedsight.config import validate

ROOT = Path(__file__).resolve().parents[1]


def simulation(vectorize: bool, clients: int, rounds: int, threads: int, device: str, out: Path):
    raw = cnn_workload(clients, rounds + 1)
    raw["recipe"] = {"components": [{"name": "dp_sgd", "noise_multiplier": 1.0, "max_grad_norm": 1.0}]}
    raw["engine"] = {"vectorize": vectorize, "threads": threads, "device": device}
    raw["run"] = {"output_dir": str(out / str(vectorize)), "checkpoint_keep": 0, "plots": False}
    raw["eval"] = {"every": 1000, "local": False, "initial": False}
    return build_simulation(validate(raw))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=20, help="clients (all of them train every round)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds of each engine, after one warm-up round")
    ap.add_argument("--threads", type=int, default=1, help="engine.threads")
    ap.add_argument("--device", default="cpu", help='"cpu", "cuda" or "cuda:N"')
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    cuda = args.device.startswith("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        sims = [simulation(v, args.clients, args.rounds, args.threads, args.device, Path(tmp)) for v in (False, True)]
        times: list[list[float]] = [[], []]
        for r in range(1, args.rounds + 2):
            for i, sim in enumerate(sims):
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                sim.run_round(r)
                if cuda:
                    torch.cuda.synchronize()
                if r > 1:
                    times[i].append(time.perf_counter() - t0)
        a, b = (s.global_model.state_dict() for s in sims)
        diff = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
    seq, vec = (statistics.median(t) for t in times)
    pairs = sorted(s / v for s, v in zip(*times))
    print(f"max |sequential - vectorised| over the global model's entries after {args.rounds + 1} rounds: {diff:.2e}")
    print(f"commit {commit.strip()}; python benchmarks/dp_vectorized.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"device {torch.cuda.get_device_name() if cuda else 'cpu'}, {args.threads} thread(s), {args.clients} clients "
          f"a round, dp_sgd z=1 C=1 Poisson; medians of {args.rounds} alternating rounds after a warm-up")
    print(f"{'sequential s':>13} {'vectorised s':>13} {'speed-up':>9} {'per-pair ratios (min..max)':>28}")
    print(f"{seq:13.3f} {vec:13.3f} {seq / vec:8.2f}x {pairs[0]:13.2f} .. {pairs[-1]:.2f}")


if __name__ == "__main__":
    main()
