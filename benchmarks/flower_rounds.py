"""Seconds per round of the same FedSight workload on three engines, as ratios in one run.

The workload: examples/quickstart.toml's "fedavg" variant, seed 0 (small CNN on digits, Dirichlet(0.3)), with
SCAFFOLD and uniform weighting, N clients (default 4, all sampled every round), 1 local epoch of batch 32,
one torch thread, global test evaluation every round (no local evaluation: it would add a message round trip
per round on Flower). Engines:

* in-process: ``fedsight.api.execute`` (the simulator);
* Flower simulation: ``fedsight.flower.simulation.flower_simulate`` (Ray, one CPU per client);
* loopback deployment: ``fedsight.flower.local.run_local`` (1 SuperLink + N SuperNodes, real processes).

Per engine it prints the wall time, the first round (start-up: Ray, process spawns) and the median of
the later rounds (``time/round_s`` of ``metrics.jsonl``), then the ratios of the later-round medians to
the in-process one. It also checks that the three final models are bit-identical.

    python benchmarks/flower_rounds.py [--clients 4] [--rounds 4] [--skip-deployment]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fedsight.api import execute
from fedsight.sweep import load

ROOT = Path(__file__).resolve().parents[1]


def round_times(run_dir: Path) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r["time/round_s"] for r in rows if "event" not in r]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--skip-deployment", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    sets = [
        f"partition.num_clients={args.clients}", f"server.clients_per_round={args.clients}", f"server.rounds={args.rounds}",
        "eval.every=1", "eval.local=false", 'recipe.components=["scaffold"]', 'recipe.weighting="uniform"',
        "engine.threads=1", "train.epochs=1", "train.batch_size=32", "run.checkpoint_keep=1",
    ]
    cfg = load(ROOT / "examples" / "quickstart.toml", sets)[0].config
    torch.set_num_threads(1)
    results: dict[str, tuple[float, list[float], Path]] = {}
    with tempfile.TemporaryDirectory(prefix="fedsight-flower-bench-") as tmp:
        tmp_path = Path(tmp)

        t = time.perf_counter()
        execute(cfg, tmp_path / "inproc")
        results["in-process"] = (time.perf_counter() - t, round_times(tmp_path / "inproc"), tmp_path / "inproc")

        from fedsight.flower.simulation import flower_simulate

        t = time.perf_counter()
        flower_simulate(cfg, tmp_path / "ray", num_cpus=1.0)
        results["flower simulation (ray)"] = (time.perf_counter() - t, round_times(tmp_path / "ray"), tmp_path / "ray")

        if not args.skip_deployment:
            from fedsight.flower.local import run_local

            t = time.perf_counter()
            run_local(cfg, tmp_path / "deploy", options={"round-timeout": 300.0}, timeout=3600)
            results["loopback deployment"] = (time.perf_counter() - t, round_times(tmp_path / "deploy"), tmp_path / "deploy")

        from safetensors.torch import load_file

        ref = load_file(str(results["in-process"][2] / "model.safetensors"))
        same = {name: all(torch.equal(ref[k], load_file(str(p / "model.safetensors"))[k]) for k in ref)
                for name, (_, _, p) in results.items()}

        base = statistics.median(results["in-process"][1][1:] or results["in-process"][1])
        print(f"\n{args.clients} clients x {args.rounds} rounds, quickstart CNN on digits, SCAFFOLD, {os.cpu_count()} CPUs")
        print(f"{'engine':26s} {'wall s':>8s} {'round 1 s':>10s} {'later rounds s (median)':>24s} {'ratio':>9s}  bit-identical")
        for name, (wall, times, _) in results.items():
            later = statistics.median(times[1:] or times)
            print(f"{name:26s} {wall:8.2f} {times[0]:10.3f} {later:24.3f} {later / base:9.1f}  {same[name]}")


if __name__ == "__main__":
    main()
