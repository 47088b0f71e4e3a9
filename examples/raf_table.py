"""The RAF tables of docs/keypoints.md from the runs of ``examples/raf.toml``, in the layout of the paper's Tables II and III
(Lim et al., digest ``notes/002_raf.md`` section 4). Values are mean ± sample std over the complete runs
(seeds; n in the last column) of a variant (``RUN_ROOT/<variant>/seed<k>``), final round, in %.

* Table II: PCKh@0.5 of the global model at every inference resolution (the ladder, lowest first, then the
  unseen larger sizes), for each federation setting of the sweep (3 clients at high / mid / low resolution, and
  1 high + n low), with FedAvg, FedProx and each with RAF; the RAF rows are followed by the gain over the
  method without RAF, paired by seed (same partition and initial model).
* Table III: inference-time upsampling. The test crops are taken at the lowest rung (a low-resolution camera) and
  interpolated (bilinear, area, bicubic) to each larger input size before the final global model of ``fedavg`` and
  ``raf_fedavg`` runs on them (``KeypointTask.evaluate_at``); the first column is the native low-resolution input.

    python examples/raf_table.py runs/raf
    python examples/raf_table.py runs/raf --no-upsampling     # Table II only
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from feddrive_table import ci_cell, complete_runs, print_provenance
from ppfl_table import by_seed, config, fmt, header, last, load_model

SETTINGS = [("", "3 clients: high / mid / low"), ("onehigh_", "1 high + n low")]
METHODS = [("fedavg", "FedAvg", None), ("raf_fedavg", "FedAvg + RAF", "fedavg"),
           ("fedprox", "FedProx", None), ("raf_fedprox", "FedProx + RAF", "fedprox")]
MODES = ("bilinear", "area", "bicubic")


def sizes(run: Path) -> list[tuple[str, str]]:
    """(evaluation split, "HxW") of a run's test splits, lowest resolution first (``fedsight.tasks.keypoints``)."""
    row = last(run, "test/pckh")
    top = "x".join(str(v) for v in config(run)["task"].get("ladder", [[256, 192]])[0])
    out = [("test", top)] + [(k[: -len("/pckh")], k[len("test_"): -len("/pckh")]) for k in row
                             if k.startswith("test_") and k.endswith("/pckh") and k.count("_") == 1]
    return sorted(out, key=lambda s: [int(v) for v in s[1].split("x")])


def table_ii(root: Path) -> bool:
    shown = False
    for prefix, title in SETTINGS:
        present = [(prefix + v, label, base) for v, label, base in METHODS if complete_runs(root, prefix + v)]
        if not present:
            continue
        first = complete_runs(root, present[0][0])[0]
        cols = sizes(first)
        ladder = {"x".join(str(v) for v in s) for s in config(first)["task"].get("ladder", [])}
        print(f"\n**Table II ({title})**: PCKh@0.5 (%) of the global model by inference resolution "
              "(* = not a training resolution), final round; gain = with RAF - without, paired by seed: mean [95% CI] "
              "and verdict.\n")
        header(["method"] + [s + ("" if s in ladder else " *") for _, s in cols] + ["seeds"], len(cols) + 1)
        for variant, label, base in present:
            runs = complete_runs(root, variant)
            cells = [fmt([last(r, f"{split}/pckh")[f"{split}/pckh"] for r in runs], 1) for split, _ in cols]
            print(f"| {label} | " + " | ".join(cells) + f" | {len(runs)} |")
            if base is not None and complete_runs(root, prefix + base):
                b, v = by_seed(complete_runs(root, prefix + base)), by_seed(runs)
                pairs = sorted(b.keys() & v.keys())
                gains = [ci_cell({s: last(r, f"{sp}/pckh")[f"{sp}/pckh"] for s, r in v.items()},
                                 {s: last(r, f"{sp}/pckh")[f"{sp}/pckh"] for s, r in b.items()}, 1) for sp, _ in cols]
                print("| gain of RAF | " + " | ".join(gains) + f" | {len(pairs)} |")
        shown = True
    return shown


def table_iii(root: Path) -> bool:
    import torch

    from fedsight.api import build_task, load_run_config

    torch.set_num_threads(1)
    variants = [(v, label) for v, label, _ in METHODS[:2] if complete_runs(root, v)]
    if not variants:
        return False
    results: dict[tuple[str, str, str], list[float]] = {}
    targets: list[tuple[int, int]] = []
    low: tuple[int, int] | None = None
    task: Any = None
    for variant, _ in variants:
        for run in complete_runs(root, variant):
            cfg = load_run_config(run)
            if task is None:
                task = build_task(cfg)
                low = task.ladder[-1]
                targets = sorted({tuple(s) for s in task.params.sizes()} - {low})
            model = load_model(run, cfg, task)
            results.setdefault((variant, "native", "x".join(map(str, low))), []).append(
                task.evaluate_at(model, low)["pckh"])
            for mode in MODES:
                for size in targets:
                    results.setdefault((variant, mode, "x".join(map(str, size))), []).append(
                        task.evaluate_at(model, size, capture=low, mode=mode)["pckh"])
            print(f"upsampling: {run}", file=sys.stderr)
    low_s = "x".join(map(str, low))
    cols = ["x".join(map(str, s)) for s in targets]
    print(f"\n**Table III**: inference-time upsampling of {low_s} test crops, PCKh@0.5 (%) of the final global model; "
          f"the {low_s} column is the native low-resolution input.\n")
    header(["model", "interpolation", low_s] + cols + ["seeds"], len(cols) + 2)
    for variant, label in variants:
        n = len(complete_runs(root, variant))
        native = fmt(results[(variant, "native", low_s)], 1)
        for mode in MODES:
            cells = [fmt(results[(variant, mode, c)], 1) for c in cols]
            print(f"| {label} | {mode} | {native} | " + " | ".join(cells) + f" | {n} |")
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", type=Path, help="the sweep's run folder (runs/raf)")
    ap.add_argument("--no-upsampling", action="store_true", help="skip Table III (it evaluates the saved models)")
    args = ap.parse_args(argv)
    if not args.root.is_dir():
        print(f"error: {args.root} is not a folder of runs", file=sys.stderr)
        return 2
    shown = table_ii(args.root)
    if not args.no_upsampling:
        shown = table_iii(args.root) or shown
    if not shown:
        print(f"error: no complete run of examples/raf.toml under {args.root}", file=sys.stderr)
        return 1
    print_provenance(sorted(r for d in args.root.iterdir() if d.is_dir() for r in complete_runs(args.root, d.name)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
