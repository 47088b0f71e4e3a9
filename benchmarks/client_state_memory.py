"""Peak memory of a stateful recipe does not grow with the number of clients.

Runs the same SCAFFOLD recipe (client control variates in the per-client state store) on the same data
split over 100 and over 10,000 clients, each in a fresh process, and prints the peak resident set size
(RSS) of each run, their ratio, and how many clients hold state on disk. With ``--in-memory`` it also
runs the 10,000-client case with the state kept in RAM, to show what the on-disk store saves.

The data is scikit-learn's digits made 28x larger by a documented generator (each copy shifted by a
random offset of up to one pixel and given Gaussian noise of std 1/16), written as a MedMNIST-style
.npz, so that 10,000 clients hold 4 images each; both runs load the same file.

    python benchmarks/client_state_memory.py [--rounds 200] [--per-round 50] [--in-memory]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from fedsight.bench import make_digits_npz


CHILD = r"""
import json, resource, sys, shutil
from pathlib import Path
from fedsight.api import execute
from fedsight.config import validate
args = json.loads(sys.argv[1])
raw = {
    "seed": 0,
    "run": {"name": "mem", "output_dir": args["out"], "checkpoint_keep": 1},
    "data": {"name": "npz", "path": args["npz"]},
    "partition": {"name": "iid", "num_clients": args["clients"], "local_test_fraction": 0.0},
    "model": {"name": "cnn"},
    "train": {"steps": 2, "batch_size": 4, "lr": 0.05},
    "server": {"rounds": args["rounds"], "clients_per_round": args["per_round"]},
    "recipe": {"weighting": "uniform", "components": [{"name": "scaffold"}]},
    "eval": {"every": args["rounds"], "local": False},
}
cfg = validate(raw)
run_dir = Path(args["out"]) / f"c{args['clients']}"
if args["in_memory"]:
    from fedsight.api import build_simulation
    sim = build_simulation(cfg)          # no run directory: the store keeps tensors in RAM
    sim.run()
    with_state = len(sim.store.clients("scaffold"))
else:
    execute(cfg, run_dir)
    with_state = len(list((run_dir / "client_state" / "scaffold").glob("*.safetensors")))
peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"peak_rss_mb": peak_mb, "clients_with_state": with_state}))
"""


def run_child(**kw) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(kw)], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        sys.exit(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--per-round", type=int, default=50)
    ap.add_argument("--in-memory", action="store_true", help="also run 10,000 clients with state kept in RAM")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        npz = Path(tmp) / "digits28.npz"
        n = make_digits_npz(npz, copies=28)
        res = {}
        for clients in (100, 10_000):
            res[clients] = run_child(npz=str(npz), out=tmp, clients=clients, rounds=args.rounds,
                                     per_round=args.per_round, in_memory=False)
        print(f"data: {n} training images; SCAFFOLD, {args.rounds} rounds x {args.per_round} clients, state on disk")
        for clients, r in res.items():
            print(f"{clients:>6} clients: peak RSS {r['peak_rss_mb']:7.1f} MB, clients holding state: {r['clients_with_state']}")
        print(f"peak RSS ratio 10,000 / 100 clients: {res[10_000]['peak_rss_mb'] / res[100]['peak_rss_mb']:.3f}")
        if args.in_memory:
            r = run_child(npz=str(npz), out=tmp, clients=10_000, rounds=args.rounds, per_round=args.per_round, in_memory=True)
            print(f"10,000 clients, state in RAM: peak RSS {r['peak_rss_mb']:7.1f} MB, clients holding state: {r['clients_with_state']}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
