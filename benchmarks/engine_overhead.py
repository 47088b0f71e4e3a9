"""Orchestration overhead of the in-process engine against a plain PyTorch loop.

Both do the same local training steps on the same batches: the quickstart model (small CNN) on digits,
20 clients with Dirichlet(0.3) label skew, 10 clients per round, 2 local epochs of batch 16, SGD. The
plain loop only loads the global weights into one model per client and runs forward/backward/step.
The engine adds client sampling, delta computation, the non-finite check, weighting, aggregation and
the server optimizer step (and, with --checkpoint, the per-round atomic checkpoint). Rounds alternate
between the two so that machine noise hits both alike; the ratio of the medians is printed.

    python benchmarks/engine_overhead.py [--rounds 20] [--threads 1] [--checkpoint]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


from fedsight.api import build_simulation
from fedsight.bench import plain_round
from fedsight.sweep import load
from fedsight.engine.simulation import sample_clients
from fedsight.runs import RunDir

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--checkpoint", action="store_true", help="include the per-round checkpoint in the engine time")
    args = ap.parse_args()
    spec = load(ROOT / "examples" / "quickstart.toml", ["eval.local=false", f"engine.threads={args.threads}"])[0]
    cfg = spec.config
    sim = build_simulation(cfg)
    task = sim.task
    model = task.build_model()
    global_state = {k: v.clone() for k, v in sim.global_model.state_dict().items()}
    m = sim.schedule.clients_per_round
    steps = sum(sim.local.num_steps(task.num_train_examples(c)) for c in range(task.num_clients)) / task.num_clients
    tmp = tempfile.TemporaryDirectory()
    run = RunDir(tmp.name)
    t_engine, t_plain = [], []
    for r in range(1, args.rounds + 1):
        t0 = time.perf_counter()
        sim.train_round(r)
        if args.checkpoint:
            run.save_checkpoint(r, sim.state_dict(), keep_last=2)
        t_engine.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        plain_round(task, model, global_state, sample_clients(cfg.seed, r, task.num_clients, m), r, cfg.seed, sim.local)
        t_plain.append(time.perf_counter() - t0)
    warm = slice(2, None)  # first rounds warm up allocators
    e, p = statistics.median(t_engine[warm]), statistics.median(t_plain[warm])
    print(f"workload: {m} clients/round, ~{steps:.1f} local steps/client, model {cfg.model.name}, threads {args.threads}")
    print(f"engine round (median of {len(t_engine[warm])}): {e * 1000:.1f} ms{' incl. checkpoint' if args.checkpoint else ''}")
    print(f"plain loop round:                {p * 1000:.1f} ms")
    print(f"overhead ratio engine/plain:     {e / p:.3f}")


if __name__ == "__main__":
    main()
