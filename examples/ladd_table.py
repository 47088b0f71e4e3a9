"""The LADD table of docs/ladd.md from the runs of ``examples/ladd.toml``, in the layout of the thesis's component
ablation (Table 5.13): which parts are on (FDA pre-training, self-training, distillation to theta^0, the SWA
teacher, cluster aggregation) and the test mIoU of the final round, mean ± sample std over the complete runs.
The two source-only rows are the test mIoU at the end of the source stage (nothing adapted yet) of the runs
without and with FDA pre-training; then which parameters are cluster-specific (Table 5.18); then FedAvg +
self-training against LADD (cls) after 60 and after 300 adaptation rounds (the ``*_long`` variants); then every
adapted row against FedAvg + self-training, and the other comparisons the docs make (``PAIRS``: FDA against none,
each adapted run against its own source-only model, the cluster-specific parts, the longer runs), each paired by
seed with its 95% CI and verdict; the frozen models' BatchNorm, running statistics against the batch's (the
``*_running`` variants against their twins); and the runs' provenance.

    python examples/ladd_table.py runs/ladd
"""

from __future__ import annotations

import sys
from pathlib import Path

from feddrive_table import cell, ci_cell, complete_runs, final, metric_rows, print_provenance, seeds_of

YES, NO = "✓", "✗"
ROWS = [  # (label flags FDA ST KD SWAt Cluster, variant, which round: "source" end of source stage or final)
    ((NO, NO, NO, NO, NO), "st_nofda", "source"),
    ((NO, YES, NO, NO, NO), "st_nofda", "final"),
    ((YES, NO, NO, NO, NO), "fedavg_st", "source"),
    ((NO, YES, YES, YES, YES), "ladd_nofda", "final"),
    ((YES, YES, NO, NO, NO), "fedavg_st", "final"),
    ((YES, YES, YES, NO, NO), "st_kd", "final"),
    ((YES, YES, YES, YES, NO), "st_kd_swat", "final"),
    ((YES, YES, YES, NO, YES), "st_kd_cluster", "final"),
    ((YES, YES, YES, YES, YES), "ladd_cls", "final"),
]
PARTS = [("none (FedAvg)", "st_kd_swat"), ("head: LADD (cls)", "ladd_cls"), ("all: LADD (all)", "ladd_all")]
LENGTHS = [(60, "fedavg_st", "ladd_cls"), (300, "fedavg_st_long", "ladd_cls_long")]
#: the frozen models' BatchNorm (``self_training.frozen_bn``): (label, the "running" variant, its "batch" twin)
FROZEN_BN = [
    ("ST + KD", "st_kd_running", "st_kd"),
    ("ST + KD + SWAt", "st_kd_swat_running", "st_kd_swat"),
    ("ST + KD + cluster heads", "st_kd_cluster_running", "st_kd_cluster"),
    ("LADD (cls)", "ladd_cls_running", "ladd_cls"),
    ("LADD (all)", "ladd_all_running", "ladd_all"),
]
#: the other comparisons docs/ladd.md states, each (label, (variant, round), (baseline variant, round)), paired by
#: seed; a variant's "source" round is the end of its own source stage (the same seed's pre-trained model), "first"
#: the first evaluation of its adaptation stage
PAIRS = [
    ("FDA pre-training: source-only with FDA - without", ("fedavg_st", "source"), ("st_nofda", "source")),
    ("self-training after FDA - its source-only model", ("fedavg_st", "final"), ("fedavg_st", "source")),
    ("self-training without FDA - its source-only model", ("st_nofda", "final"), ("st_nofda", "source")),
    ("self-training after FDA, first adaptation evaluation - its source-only model", ("fedavg_st", "first"),
     ("fedavg_st", "source")),
    ("FedAvg + self-training: final - first adaptation evaluation", ("fedavg_st", "final"), ("fedavg_st", "first")),
    ("LADD (cls): final - first adaptation evaluation", ("ladd_cls", "final"), ("ladd_cls", "first")),
    ("LADD without FDA - its source-only model", ("ladd_nofda", "final"), ("ladd_nofda", "source")),
    ("LADD (cls) - its source-only model", ("ladd_cls", "final"), ("ladd_cls", "source")),
    ("LADD (cls) - the same parts without cluster heads", ("ladd_cls", "final"), ("st_kd_swat", "final")),
    ("LADD (all) - the same parts without cluster-specific parameters", ("ladd_all", "final"), ("st_kd_swat", "final")),
    ("LADD (all) - LADD (cls)", ("ladd_all", "final"), ("ladd_cls", "final")),
    ("LADD (all) - FedAvg + self-training", ("ladd_all", "final"), ("fedavg_st", "final")),
    ("300 rounds: LADD (cls) - FedAvg + self-training", ("ladd_cls_long", "final"), ("fedavg_st_long", "final")),
    ("FedAvg + self-training: 300 - 60 rounds", ("fedavg_st_long", "final"), ("fedavg_st", "final")),
    ("LADD (cls): 300 - 60 rounds", ("ladd_cls_long", "final"), ("ladd_cls", "final")),
]


def source_end(run: Path) -> dict:
    return [r for r in metric_rows(run) if r.get("stage") == "source" and "test/miou" in r][-1]


def adapt_first(run: Path) -> dict:
    """The first evaluation of the adaptation stage (round 20 in examples/ladd.toml: 4 rounds in)."""
    return next(r for r in metric_rows(run) if r.get("stage") == "adapt" and "test/miou" in r)


def _pick(when: str):
    return {"source": source_end, "first": adapt_first}.get(when, final)


def main(root: Path) -> None:
    print("| FDA | ST | KD | SWAt | cluster aggr. | test mIoU (%) | seeds |")
    print("|:-:|:-:|:-:|:-:|:-:|---:|---:|")
    for flags, variant, when in ROWS:
        runs = complete_runs(root, variant)
        if runs:
            print(f"| {' | '.join(flags)} | {cell([_pick(when)(r)['test/miou'] for r in runs])} | {len(runs)} |")
    print()
    print("| cluster-specific parameters | test mIoU (%) | seeds |")
    print("|---|---:|---:|")
    for label, variant in PARTS:
        runs = complete_runs(root, variant)
        if runs:
            print(f"| {label} | {cell([final(r)['test/miou'] for r in runs])} | {len(runs)} |")
    print()
    print("| adaptation rounds | FedAvg + self-training | LADD (cls) | test loss: FedAvg + ST | test loss: LADD (cls) "
          "| test loss: FedAvg + ST - LADD (cls), paired | seeds |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for rounds, *variants in LENGTHS:
        groups = [complete_runs(root, v) for v in variants]
        if all(groups):
            cells = " | ".join(cell([final(r)["test/miou"] for r in runs]) for runs in groups)
            losses = " | ".join(cell([final(r)["test/loss"] for r in runs], digits=2, scale=1) for runs in groups)
            loss_diff = ci_cell(*(seeds_of(runs, lambda r: final(r)["test/loss"]) for runs in groups), digits=2,
                                higher=False)
            print(f"| {rounds} | {cells} | {losses} | {loss_diff} | {' / '.join(str(len(runs)) for runs in groups)} |")
    base = complete_runs(root, "fedavg_st")
    print("\nEach adapted row minus FedAvg + self-training (FDA, final round), paired by seed: mIoU points, 95% CI "
          "(Student t), verdict.\n")
    print("| FDA | ST | KD | SWAt | cluster aggr. | difference |")
    print("|:-:|:-:|:-:|:-:|:-:|---:|")
    for flags, variant, when in ROWS:
        runs = complete_runs(root, variant)
        if when == "final" and variant != "fedavg_st" and runs and base:
            diff = ci_cell(seeds_of(runs, lambda r: 100 * final(r)["test/miou"]),
                           seeds_of(base, lambda r: 100 * final(r)["test/miou"]))
            print(f"| {' | '.join(flags)} | {diff} |")
    print("\nThe other comparisons, paired by seed (source-only: the end of that run's own source stage): mIoU "
          "points, 95% CI (Student t), verdict.\n")
    print("| comparison | difference |")
    print("|---|---:|")
    for label, (variant, when), (other, other_when) in PAIRS:
        runs, base_runs = complete_runs(root, variant), complete_runs(root, other)
        if runs and base_runs:
            diff = ci_cell(seeds_of(runs, lambda r: 100 * _pick(when)(r)["test/miou"]),
                           seeds_of(base_runs, lambda r: 100 * _pick(other_when)(r)["test/miou"]))
            print(f"| {label} | {diff} |")
    frozen = [(label, complete_runs(root, run_v), complete_runs(root, batch_v)) for label, run_v, batch_v in FROZEN_BN]
    if any(runs for _, runs, _ in frozen):
        print("\nThe frozen models' BatchNorm (theta^0 and the SWA teacher): running statistics against the batch's, "
              "final test mIoU (%); difference = running - batch, paired by seed, 95% CI (Student t), verdict.\n")
        print("| parts (lambda = 20) | running | batch | difference | seeds |")
        print("|---|---:|---:|---:|---:|")
        for label, runs, batch in frozen:
            if runs and batch:
                diff = ci_cell(seeds_of(runs, lambda r: 100 * final(r)["test/miou"]),
                               seeds_of(batch, lambda r: 100 * final(r)["test/miou"]))
                print(f"| {label} | {cell([final(r)['test/miou'] for r in runs])} | "
                      f"{cell([final(r)['test/miou'] for r in batch])} | {diff} | {len(runs)} / {len(batch)} |")
    print_provenance(sorted({r for _, v, _ in ROWS for r in complete_runs(root, v)}
                            | {r for _, v in PARTS for r in complete_runs(root, v)}
                            | {r for _, *vs in LENGTHS for v in vs for r in complete_runs(root, v)}
                            | {r for _, v, _ in FROZEN_BN for r in complete_runs(root, v)}))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/ladd"))
