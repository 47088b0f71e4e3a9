"""The table of docs/baselines.md from the runs of ``examples/baselines.toml``: per method the rounds, the final
round's global test accuracy, WMA and worst-10% over the clients' local test sets, the bytes sent and the clients'
estimated GFLOPs, mean ± sample std over its complete runs (``fed3r_table.table``); then every method against
FedAvg (and a few other pairs), paired by seed, with its 95% CI and verdict, for test accuracy and the worst
10% of clients; then the
commit, command and machine of the runs.

    python examples/baselines_table.py runs/baselines
"""

from __future__ import annotations

import sys
from pathlib import Path

from fed3r_table import last, table
from feddrive_table import ci_cell, complete_runs, print_provenance, seeds_of

METHODS = ["fedavg", "fedavgm", "fedadam", "fedyogi", "fedprox", "scaffold", "feddyn", "fednova", "elastic", "median",
           "trimmed_mean", "krum", "fedavg_bn", "fedbn", "silobn"]
#: further pairs docs/baselines.md discusses: (method, baseline)
PAIRS = [("fedavg_bn", "fedavgm"), ("fedbn", "fedavg_bn"), ("silobn", "fedavg_bn"), ("fedadam", "fedavgm")]


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python examples/baselines_table.py RUNS/baselines (a folder of runs)", file=sys.stderr)
        return 2
    root = Path(argv[0])
    runs = table(root, METHODS)
    print("\nEach method minus FedAvg (then the pairs the docs discuss), paired by seed: mean difference in points, its "
          "95% CI (Student t) and verdict.\n")
    print("| method | against | test accuracy | worst-10% clients |")
    print("|---|---|---|---|")
    for method, against in [(m, "fedavg") for m in METHODS[1:]] + PAIRS:
        mine, base = complete_runs(root, method), complete_runs(root, against)
        if mine and base:
            cells = [ci_cell(seeds_of(mine, lambda r: 100 * last(r, k)), seeds_of(base, lambda r: 100 * last(r, k)))
                     for k in ("test/acc", "local/worst10")]
            print(f"| {method} | {against} | {' | '.join(cells)} |")
    print_provenance(runs)
    return 0 if runs else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
