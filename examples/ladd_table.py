"""The LADD table of docs/ladd.md from the runs of ``examples/ladd.toml``, in the layout of the thesis's component
ablation (Table 5.13): which parts are on (FDA pre-training, self-training, distillation to theta^0, the SWA
teacher, cluster aggregation) and the test mIoU of the final round, mean ± sample std over the complete runs.
The two source-only rows are the test mIoU at the end of the source stage (nothing adapted yet) of the runs
without and with FDA pre-training; then which parameters are cluster-specific (Table 5.18); then FedAvg +
self-training against LADD (cls) after 60 and after 300 adaptation rounds (the ``*_long`` variants); then every
adapted row against FedAvg + self-training, paired by seed with its 95% CI and verdict, and the runs' provenance.

    python examples/ladd_table.py runs/ladd
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from feddrive_table import cell, ci_cell, complete_runs, final, print_provenance, seeds_of

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


def source_end(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("stage") == "source" and "test/miou" in r][-1]


def main(root: Path) -> None:
    print("| FDA | ST | KD | SWAt | cluster aggr. | test mIoU (%) | seeds |")
    print("|:-:|:-:|:-:|:-:|:-:|---:|---:|")
    for flags, variant, when in ROWS:
        runs = complete_runs(root, variant)
        if runs:
            pick = source_end if when == "source" else final
            print(f"| {' | '.join(flags)} | {cell([pick(r)['test/miou'] for r in runs])} | {len(runs)} |")
    print()
    print("| cluster-specific parameters | test mIoU (%) | seeds |")
    print("|---|---:|---:|")
    for label, variant in PARTS:
        runs = complete_runs(root, variant)
        if runs:
            print(f"| {label} | {cell([final(r)['test/miou'] for r in runs])} | {len(runs)} |")
    print()
    print("| adaptation rounds | FedAvg + self-training | LADD (cls) | seeds |")
    print("|---:|---:|---:|---:|")
    for rounds, *variants in LENGTHS:
        groups = [complete_runs(root, v) for v in variants]
        if all(groups):
            cells = " | ".join(cell([final(r)["test/miou"] for r in runs]) for runs in groups)
            print(f"| {rounds} | {cells} | {' / '.join(str(len(runs)) for runs in groups)} |")
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
    print_provenance(sorted({r for _, v, _ in ROWS for r in complete_runs(root, v)}
                            | {r for _, v in PARTS for r in complete_runs(root, v)}
                            | {r for _, *vs in LENGTHS for v in vs for r in complete_runs(root, v)}))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/ladd"))
