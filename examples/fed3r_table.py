"""The Fed3R and personalisation tables of docs/fed3r.md from the runs of ``examples/fed3r.toml`` and
``examples/personalized.toml``: per variant, the rounds, the final round's global test accuracy, WMA and worst-10%
over the clients' local test sets (each client on its own model), the bytes sent up and down and the clients'
estimated GFLOPs of the whole run, mean ± sample std over its complete runs (seeds; n in the last column); then the
comparisons the docs discuss, paired by seed with their 95% CI and verdict (``fedsight.reporting``), and the
commit, command and machine of the runs.

    python examples/fed3r_table.py runs/fed3r runs/personalized
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from feddrive_table import ci_cell, complete_runs, print_provenance, seeds_of

FED3R = ["fedavg", "fedavg_psi", "fedncm", "fed3r", "fed3r_rf", "fed3r_sync", "fed3r_ft_f", "fed3r_ft_psi",
         "fed3r_ft_phi"]
PERSONAL = ["fedavg", "fedavg+fedsim_psi", "fedavg+fedalt_psi", "fedavg+pfedme_psi", "fedavg+ditto", "fedavg+fp",
            "fed3r+fp_phi", "fed3r+oll_fp_phi", "fed3r+fedavg_phi+fedsim_psi+fp_phi", "fed3r+fedavg_phi+oll_fp_phi"]
#: (which sweep, metric, variant, baseline): the differences docs/fed3r.md states
COMPARISONS = [
    ("fed3r", "test/acc", "fed3r", "fedavg"),
    ("fed3r", "test/acc", "fed3r_rf", "fed3r"),
    ("fed3r", "test/acc", "fedncm", "fed3r"),
    ("fed3r", "test/acc", "fed3r_ft_f", "fed3r"),
    ("fed3r", "test/acc", "fed3r_ft_phi", "fed3r"),
    ("fed3r", "test/acc", "fed3r_ft_psi", "fed3r"),
    ("personalized", "local/wma", "fedavg+ditto", "fedavg+fedsim_psi"),
    ("personalized", "local/wma", "fedavg+pfedme_psi", "fedavg+fedsim_psi"),
    ("personalized", "local/wma", "fedavg+pfedme_psi", "fedavg+fedalt_psi"),
    ("personalized", "local/wma", "fedavg+fp", "fedavg+ditto"),
    ("personalized", "local/wma", "fedavg+fp", "fedavg+fedsim_psi"),
    ("personalized", "local/wma", "fed3r+oll_fp_phi", "fed3r+fp_phi"),
    ("personalized", "local/wma", "fed3r+fedavg_phi+oll_fp_phi", "fed3r+fedavg_phi+fedsim_psi+fp_phi"),
    ("personalized", "local/worst10", "fed3r+oll_fp_phi", "fed3r+fp_phi"),
    ("personalized", "local/worst10", "fed3r+fedavg_phi+oll_fp_phi", "fed3r+fedavg_phi+fedsim_psi+fp_phi"),
]


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def last(run: Path, key: str) -> float:
    """The last logged value of ``key`` (the final round's, or its last evaluation's)."""
    return [r[key] for r in rows(run) if key in r][-1]


def cell(values: list[float], scale: float = 100.0, digits: int = 1) -> str:
    v = [scale * x for x in values]
    return f"{statistics.mean(v):.{digits}f} ± {statistics.stdev(v):.{digits}f}" if len(v) > 1 else f"{v[0]:.{digits}f}"


def table(root: Path, variants: list[str]) -> list[Path]:
    print("| method | rounds | test acc % | WMA % | worst-10% % | MB up + down | client GFLOPs | seeds |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    shown = []
    for v in variants:
        runs = complete_runs(root, v)
        if not runs:
            continue
        shown += runs
        mb = [(last(r, "cost/total_up_bytes") + last(r, "cost/total_down_bytes")) / 1e6 for r in runs]
        gflops = [last(r, "cost/total_flops") / 1e9 for r in runs]
        print(f"| {v} | {last(runs[0], 'round')} | {cell([last(r, 'test/acc') for r in runs])} | "
              f"{cell([last(r, 'local/wma') for r in runs])} | {cell([last(r, 'local/worst10') for r in runs])} | "
              f"{statistics.mean(mb):.2f} | {statistics.mean(gflops):.2f} | {len(runs)} |")
    return shown


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not all(Path(a).is_dir() for a in argv):
        print("usage: python examples/fed3r_table.py RUNS/fed3r RUNS/personalized (two folders of runs)",
              file=sys.stderr)
        return 2
    roots = {"fed3r": Path(argv[0]), "personalized": Path(argv[1])}
    runs = table(roots["fed3r"], FED3R)
    print()
    runs += table(roots["personalized"], PERSONAL)
    print("\nPaired by seed: the variant minus the baseline in points, its 95% CI (Student t) and verdict.\n")
    print("| metric | variant | baseline | difference |")
    print("|---|---|---|---|")
    for sweep, metric, variant, base in COMPARISONS:
        a, b = complete_runs(roots[sweep], variant), complete_runs(roots[sweep], base)
        if a and b:
            diff = ci_cell(seeds_of(a, lambda r: 100 * last(r, metric)), seeds_of(b, lambda r: 100 * last(r, metric)))
            print(f"| {metric} | {variant} | {base} | {diff} |")
    print_provenance(runs)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
