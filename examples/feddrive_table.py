"""The FedDrive table of docs/segmentation.md from the runs of ``examples/feddrive.toml``, in the layout of the thesis's
Tables 5.3-5.5: per split and method, mIoU on the unseen domains and on the seen ones with the run's test-time
rule ("standard" for SiloBN/FedBN: statistics recomputed on the test data), and for SiloBN/FedBN also "by
domain" (every seen-test image with the statistics of its domain's training clients), obtained by
re-evaluating each run's final checkpoint (``fedsight evaluate RUN --set recipe.sharing.test_stats=domain``;
nothing is retrained, the result is appended to the run's ``evaluations.jsonl`` and reused on later calls).
Values are the final round's, mean ± sample std over the variant's complete runs (seeds; n in the last column).

    python examples/feddrive_table.py runs/feddrive
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROWS = [  # (variant, distribution, method, style)
    ("uniform_fedavg", "Uniform", "FedAvg", ""),
    ("het_fedavg", "Heterogeneous", "FedAvg", ""),
    ("het_fedavg_cfsi", "Heterogeneous", "FedAvg", "CFSI"),
    ("het_fedavg_lab", "Heterogeneous", "FedAvg", "LAB"),
    ("het_fedavgm", "Heterogeneous", "FedAvgM", ""),
    ("het_fedadam", "Heterogeneous", "FedAdam", ""),
    ("het_fedbn", "Heterogeneous", "FedBN", ""),
    ("het_silobn", "Heterogeneous", "SiloBN", ""),
    ("het_silobn_lab", "Heterogeneous", "SiloBN", "LAB"),
    ("ci_fedavg", "Class imbalance", "FedAvg", ""),
    ("ci_silobn", "Class imbalance", "SiloBN", ""),
]
BY_DOMAIN = "recipe.sharing.test_stats=domain"


def complete_runs(root: Path, variant: str) -> list[Path]:
    """The variant's finished runs (an interrupted seed is left out until it is resumed and done)."""
    runs = sorted((root / variant).glob("seed*"))
    return [r for r in runs if (r / "status.json").is_file()
            and json.loads((r / "status.json").read_text()).get("state") == "complete"]


def final(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "test/miou" in r][-1]


def by_domain(run: Path) -> dict:
    """The final checkpoint evaluated with statistics by domain (once; later calls read evaluations.jsonl)."""
    path = run / "evaluations.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row.get("set") == {"recipe.sharing.test_stats": "domain"}:
                return row
    from fedsight.api import evaluate_run

    return evaluate_run(run, [BY_DOMAIN])[1]


def cell(values: list[float]) -> str:
    v = [100 * x for x in values]
    return f"{statistics.mean(v):.1f} ± {statistics.stdev(v):.1f}" if len(v) > 1 else f"{v[0]:.1f}"


def main(root: Path) -> None:
    print("| distribution | method | style | unseen | seen | seen (by domain) | seeds |")
    print("|---|---|---|---:|---:|---:|---:|")
    for variant, dist, method, style in ROWS:
        runs = complete_runs(root, variant)
        if not runs:
            continue
        last = [final(r) for r in runs]
        domain = ""
        if method in ("SiloBN", "FedBN"):
            domain = cell([by_domain(r)["test/miou"] for r in runs])
        print(f"| {dist} | {method} | {style or '-'} | {cell([x['test_unseen/miou'] for x in last])} | "
              f"{cell([x['test/miou'] for x in last])} | {domain or '-'} | {len(runs)} |")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/feddrive"))
