"""Sequential against vectorised rounds of the papers' recipes, on the examples' data and models.

`fedsight bench` times the issue's two workloads (a small CNN, a small RDSN); this script times the recipes of the
seed papers that vectorise, each from its example config: RAF (`examples/raf.toml`, `raf_fedavg`, ViTPose at three
rungs), LADD's adaptation stage (`examples/ladd.toml`, `ladd_cls`: SWA teacher, distillation to theta^0, cluster
heads; its styles stage and a two-step source stage run first, untimed), PPFL-RDSN (`examples/ppfl_rdsn.toml`,
`fedavg`: RDSN with UDC, local Adam) and FedVSR (`examples/fedvsr.toml`, `fedvsr`: BasicVSR, DWT loss,
loss-aware aggregation). Two simulations of each are built, `engine.vectorize = false` and the vectorised one
(`"auto"` on CUDA, the default there; `true` on a CPU, where LADD's styles stage makes `true` refuse the run, so
LADD is timed on CUDA only); rounds alternate between them after a warm-up, and the medians and their ratio are
printed. Evaluation is off. On a CPU `"auto"` trains one client at a time: see docs/performance.md.

    python benchmarks/vectorised_recipes.py [--device auto|cpu|cuda] [--rounds 4] [--clients 12] [-r raf -r ladd ...]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fedsight.api import build_simulation
from fedsight.config import ConfigError
from fedsight.sweep import load

ROOT = Path(__file__).resolve().parents[1]
LADD_STAGES = ('stages=[{name="styles",rounds=1,recipe={components=[{name="client_styles",half=1}]}},'
               '{name="source",rounds=1,recipe={components=[{name="source_pretrain",steps=2,steps_per_round=2,'
               'batch_size=8}]}},{name="adapt",rounds=60}]')
#: recipe -> (example config, variant, overrides (CLIENTS: the clients a round), untimed rounds before the timed ones)
RECIPES = {
    "raf": ("raf.toml", "raf_fedavg", ["partition.num_clients=CLIENTS", "server.clients_per_round=CLIENTS"], 1),
    "ladd": ("ladd.toml", "ladd_cls", [LADD_STAGES, "server.clients_per_round=CLIENTS"], 3),
    "ppfl": ("ppfl_rdsn.toml", "fedavg", ["partition.num_clients=CLIENTS", "server.clients_per_round=CLIENTS"], 1),
    "fedvsr": ("fedvsr.toml", "fedvsr", ["partition.num_clients=CLIENTS", "server.clients_per_round=CLIENTS"], 1),
}


def simulation(recipe: str, vectorize: str, device: str, clients: int, out: Path):
    name, variant, sets, _ = RECIPES[recipe]
    sets = [s.replace("CLIENTS", str(clients)) for s in sets]
    sets += [f"engine.vectorize={vectorize}", f"engine.device={device}", "eval.every=1000",
             f"run.output_dir={out / vectorize}", "server.rounds=62" if recipe == "ladd" else "server.rounds=50"]
    spec = load(ROOT / "examples" / name, sets, [variant])[0]
    return build_simulation(spec.config)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="auto", help='"auto" (CUDA when available), "cpu", "cuda" or "cuda:N"')
    ap.add_argument("--rounds", type=int, default=4, help="timed rounds of each engine (after the warm-up)")
    ap.add_argument("--clients", type=int, default=12, help="clients a round (LADD: of its 18)")
    ap.add_argument("-r", "--recipe", action="append", choices=sorted(RECIPES), help="repeatable; default: all")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
    print(f"device: {torch.cuda.get_device_name() if cuda else 'cpu'}; {args.clients} clients a round; medians of "
          f"{args.rounds} alternating rounds after a warm-up")
    print(f"{'recipe':8} {'sequential s':>13} {'vectorised s':>13} {'speed-up':>9}")
    for recipe in args.recipe or list(RECIPES):
        with tempfile.TemporaryDirectory() as tmp:
            try:
                seq = simulation(recipe, "false", args.device, min(args.clients, 18), Path(tmp))
                vec = simulation(recipe, "auto" if cuda else "true", args.device, min(args.clients, 18), Path(tmp))
            except ConfigError as exc:  # (LADD on a CPU: its styles stage trains one client at a time)
                print(f"{recipe:8} not timed: {exc}")
                continue
            warm = RECIPES[recipe][3]
            times: dict[int, list[float]] = {0: [], 1: []}
            for r in range(1, warm + args.rounds + 1):
                for i, sim in enumerate((seq, vec)):
                    if cuda:
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    sim.run_round(r)
                    if cuda:
                        torch.cuda.synchronize()
                    if r > warm:
                        times[i].append(time.perf_counter() - t0)
            a, b = statistics.median(times[0]), statistics.median(times[1])
            print(f"{recipe:8} {a:13.3f} {b:13.3f} {a / b:8.2f}x", flush=True)


if __name__ == "__main__":
    main()
