"""The RAF tables of docs/keypoints.md from the runs of ``examples/raf.toml``, in the layout of the paper's Tables II and III
(Lim et al., digest ``notes/002_raf.md`` section 4). Values are mean ± sample std over the complete runs
(seeds; n in the last column) of a variant (``RUN_ROOT/<variant>/seed<k>``), final round, in %.

* Table II: PCKh@0.5 of the global model at every inference resolution (the ladder, lowest first, then the
  unseen larger sizes), for each federation setting of the sweep (3 clients at high / mid / low resolution, and
  1 high + n low), with FedAvg, FedProx and each with RAF; the RAF rows are followed by the gain over the
  method without RAF, paired by seed (same partition and initial model). Then the comparisons across rows, each
  paired by seed: FedProx - FedAvg, the 1 high + n low federation's FedAvg - the 3-client one (seed k of each:
  their partitions differ, so the pairing removes only the initial model's part of the spread) at every size,
  and each FedAvg/FedProx run's PCKh at the unseen sizes minus its own at the top rung (generalisation).
* Table III: inference-time upsampling. The test crops are taken at the lowest rung (a low-resolution camera) and
  interpolated (bilinear, area, bicubic) to each larger input size before the final global model of ``fedavg`` and
  ``raf_fedavg`` runs on them (``KeypointTask.evaluate_at``); the first column is the native low-resolution input.
  Below each model, paired by seed (same model): the bilinear upsampled input minus the native low-resolution one,
  and minus the native crop of the target size (what a sharper camera would have given the same model).

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
           ("fedprox", "FedProx", None), ("raf_fedprox", "FedProx + RAF", "fedprox"),
           ("fedprox_mu1e4", "FedProx, mu 1e-4", None), ("raf_fedprox_mu1e4", "FedProx, mu 1e-4 + RAF", "fedprox_mu1e4")]
MODES = ("bilinear", "area", "bicubic")


def sizes(run: Path) -> list[tuple[str, str]]:
    """(evaluation split, "HxW") of a run's test splits, lowest resolution first (``fedsight.tasks.keypoints``)."""
    row = last(run, "test/pckh")
    top = "x".join(str(v) for v in config(run)["task"].get("ladder", [[256, 192]])[0])
    out = [("test", top)] + [(k[: -len("/pckh")], k[len("test_"): -len("/pckh")]) for k in row
                             if k.startswith("test_") and k.endswith("/pckh") and k.count("_") == 1]
    return sorted(out, key=lambda s: [int(v) for v in s[1].split("x")])


COMPARISONS = [("FedProx - FedAvg", "fedprox", "fedavg"), ("FedProx, mu 1e-4 - FedAvg", "fedprox_mu1e4", "fedavg"),
               ("1 high + n low FedAvg - 3-client FedAvg", "onehigh_fedavg", "fedavg")]
GENERALISATION = [("fedavg", "FedAvg"), ("fedprox", "FedProx"), ("onehigh_fedavg", "1 high + n low FedAvg")]


def pckh(root: Path, variant: str, split: str) -> dict[int, float]:
    """seed -> final-round PCKh@0.5 (%) of ``split`` over the variant's complete runs."""
    return {s: last(r, f"{split}/pckh")[f"{split}/pckh"] for s, r in by_seed(complete_runs(root, variant)).items()}


def table_ii_comparisons(root: Path) -> bool:
    """Method - method and unseen size - top rung, paired by seed (``ci_cell``), at every inference size."""
    rows = [(label, v, b) for label, v, b in COMPARISONS if complete_runs(root, v) and complete_runs(root, b)]
    gen = [(v, label) for v, label in GENERALISATION if complete_runs(root, v)]
    if not rows and not gen:
        return False
    first = complete_runs(root, (rows[0][2] if rows else gen[0][0]))[0]
    cols = sizes(first)
    ladder = {"x".join(str(v) for v in s) for s in config(first)["task"].get("ladder", [])}
    top = "x".join(str(v) for v in config(first)["task"].get("ladder", [[256, 192]])[0])
    print("\n**Comparisons across rows** (PCKh@0.5 points, final round, paired by seed: mean [95% CI] and verdict; "
          "the federations of 3 and of 1 high + n low clients deal the images differently, so their seed k share "
          f"only the initial model; \"unseen - {top}\" is each run at a size no client trains at minus the same run "
          f"at {top}).\n")
    header(["comparison"] + [s + ("" if s in ladder else " *") for _, s in cols], len(cols))
    for label, v, b in rows:
        print(f"| {label} | " + " | ".join(ci_cell(pckh(root, v, sp), pckh(root, b, sp), 1) for sp, _ in cols) + " |")
    for v, label in gen:
        at_top = pckh(root, v, "test")
        cells = [ci_cell(pckh(root, v, sp), at_top, 1) if s not in ladder else "-" for sp, s in cols]
        print(f"| {label}: unseen - {top} | " + " | ".join(cells) + " |")
    return True


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
    results: dict[tuple[str, str, str], dict[int, float]] = {}  # (variant, mode, size) -> seed -> PCKh
    targets: list[tuple[int, int]] = []
    low: tuple[int, int] | None = None
    task: Any = None
    for variant, _ in variants:
        for seed, run in sorted(by_seed(complete_runs(root, variant)).items()):
            cfg = load_run_config(run)
            if task is None:
                task = build_task(cfg)
                low = task.ladder[-1]
                targets = sorted({tuple(s) for s in task.params.sizes()} - {low})
            model = load_model(run, cfg, task)
            for size in (low, *targets):
                results.setdefault((variant, "native", "x".join(map(str, size))), {})[seed] = \
                    task.evaluate_at(model, size)["pckh"]
            for mode in MODES:
                for size in targets:
                    results.setdefault((variant, mode, "x".join(map(str, size))), {})[seed] = \
                        task.evaluate_at(model, size, capture=low, mode=mode)["pckh"]
            print(f"upsampling: {run}", file=sys.stderr)
    low_s = "x".join(map(str, low))
    cols = ["x".join(map(str, s)) for s in targets]
    print(f"\n**Table III**: inference-time upsampling of {low_s} test crops, PCKh@0.5 (%) of the final global model; "
          f"the {low_s} column is the native low-resolution input; below each model, paired by seed (same model): "
          f"bilinear minus the native {low_s} input, and bilinear minus the native crop of the target size.\n")
    header(["model", "interpolation", low_s] + cols + ["seeds"], len(cols) + 2)
    for variant, label in variants:
        native = results[(variant, "native", low_s)]
        n = len(native)
        for mode in MODES:
            cells = [fmt(list(results[(variant, mode, c)].values()), 1) for c in cols]
            print(f"| {label} | {mode} | {fmt(list(native.values()), 1)} | " + " | ".join(cells) + f" | {n} |")
        up = {c: results[(variant, "bilinear", c)] for c in cols}
        print(f"| {label} | bilinear - native {low_s} | - | "
              + " | ".join(ci_cell(up[c], native, 1) for c in cols) + f" | {n} |")
        print(f"| {label} | bilinear - native crop of that size | - | "
              + " | ".join(ci_cell(up[c], results[(variant, "native", c)], 1) for c in cols) + f" | {n} |")
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
    shown = table_ii_comparisons(args.root) or shown
    if not args.no_upsampling:
        shown = table_iii(args.root) or shown
    if not shown:
        print(f"error: no complete run of examples/raf.toml under {args.root}", file=sys.stderr)
        return 1
    print_provenance(sorted(r for d in args.root.iterdir() if d.is_dir() for r in complete_runs(args.root, d.name)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
