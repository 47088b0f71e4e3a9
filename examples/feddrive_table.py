"""The FedDrive table of docs/segmentation.md from the runs of ``examples/feddrive.toml``, in the layout of the thesis's
Tables 5.3-5.5: per split and method, mIoU on the unseen domains and on the seen ones with the run's test-time
rule ("standard" for SiloBN/FedBN: statistics recomputed on the test data), and for SiloBN/FedBN also "by
domain" (every seen-test image with the statistics of its domain's training clients), obtained by
re-evaluating each run's final checkpoint (``fedsight evaluate RUN --set recipe.sharing.test_stats=domain``;
nothing is retrained, the result is appended to the run's ``evaluations.jsonl`` and reused on later calls).
Values are the final round's, mean ± sample std over the variant's complete runs (seeds; n in the last column);
then each heterogeneous method against heterogeneous FedAvg, and the other comparisons the docs make (``PAIRS``:
the distributions against uniform FedAvg, statistics by domain, LAB on SiloBN, SiloBN under class imbalance),
each paired by seed with its 95% CI and verdict; then the commit, command and machine of the runs.

    python examples/feddrive_table.py runs/feddrive
"""

from __future__ import annotations

import functools
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
#: the other comparisons docs/segmentation.md states: (label, (variant, column), (baseline, column)), paired by
#: seed; columns: "unseen", "seen" (the run's own test-time rule) and "domain" (seen, statistics by domain)
PAIRS = [
    ("heterogeneous - uniform FedAvg, unseen", ("het_fedavg", "unseen"), ("uniform_fedavg", "unseen")),
    ("heterogeneous - uniform FedAvg, seen", ("het_fedavg", "seen"), ("uniform_fedavg", "seen")),
    ("class imbalance - uniform FedAvg, unseen", ("ci_fedavg", "unseen"), ("uniform_fedavg", "unseen")),
    ("class imbalance - uniform FedAvg, seen", ("ci_fedavg", "seen"), ("uniform_fedavg", "seen")),
    ("SiloBN by domain - heterogeneous FedAvg, seen", ("het_silobn", "domain"), ("het_fedavg", "seen")),
    ("FedBN by domain - heterogeneous FedAvg, seen", ("het_fedbn", "domain"), ("het_fedavg", "seen")),
    ("FedBN by domain - uniform FedAvg, seen", ("het_fedbn", "domain"), ("uniform_fedavg", "seen")),
    ("SiloBN: by domain - standard, seen", ("het_silobn", "domain"), ("het_silobn", "seen")),
    ("FedBN: by domain - standard, seen", ("het_fedbn", "domain"), ("het_fedbn", "seen")),
    ("SiloBN + LAB - SiloBN, unseen", ("het_silobn_lab", "unseen"), ("het_silobn", "unseen")),
    ("SiloBN + LAB - SiloBN, seen (standard)", ("het_silobn_lab", "seen"), ("het_silobn", "seen")),
    ("SiloBN + LAB - SiloBN, seen (by domain)", ("het_silobn_lab", "domain"), ("het_silobn", "domain")),
    ("class imbalance: SiloBN - FedAvg, unseen", ("ci_silobn", "unseen"), ("ci_fedavg", "unseen")),
    ("class imbalance: SiloBN - FedAvg, seen", ("ci_silobn", "seen"), ("ci_fedavg", "seen")),
]


def complete_runs(root: Path, variant: str) -> list[Path]:
    """The variant's finished runs (an interrupted seed is left out until it is resumed and done)."""
    runs = sorted((root / variant).glob("seed*"))
    return [r for r in runs if (r / "status.json").is_file()
            and json.loads((r / "status.json").read_text()).get("state") == "complete"]


@functools.cache
def metric_rows(run: Path) -> list[dict]:
    """The rows of the run's metrics.jsonl, read once however many comparisons use them."""
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def final(run: Path) -> dict:
    return [r for r in metric_rows(run) if "test/miou" in r][-1]


@functools.cache
def by_domain(run: Path) -> dict:
    """The final checkpoint evaluated with statistics by domain (once; later calls read evaluations.jsonl)."""
    path = run / "evaluations.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row.get("set") == {"recipe.sharing.test_stats": "domain"}:
                return row
    from fedsight.crosseval import evaluate_run

    return evaluate_run(run, [BY_DOMAIN])[1]


def cell(values: list[float], digits: int = 1, scale: float = 100) -> str:
    """The values' mean ± sample std times ``scale`` (a fraction as a percentage), or the one value."""
    v = [scale * x for x in values]
    return f"{statistics.mean(v):.{digits}f} ± {statistics.stdev(v):.{digits}f}" if len(v) > 1 else f"{v[0]:.{digits}f}"


def seeds_of(runs: list[Path], value) -> dict[int, float]:
    """seed -> ``value(run)`` of each run (the seed from its config.json)."""
    return {int(json.loads((r / "config.json").read_text()).get("seed", 0)): value(r) for r in runs}


def ci_cell(method: dict[int, float], base: dict[int, float], digits: int = 1, higher: bool = True) -> str:
    """method - base paired by seed (``fedsight.reporting.paired_difference``): the mean difference, its 95% CI
    and the verdict ("better" / "worse" when the interval excludes 0, "within noise" otherwise), n pairs."""
    from fedsight.reporting import paired_difference

    d = paired_difference(method, base, higher)
    if d.mean is None:
        return "- (no common seed)"
    if d.ci is None:
        return f"{d.mean:+.{digits}f} (n={d.n}, no interval)"
    return f"{d.mean:+.{digits}f} [{d.ci[0]:+.{digits}f}, {d.ci[1]:+.{digits}f}] {d.verdict} (n={d.n})"


def print_provenance(runs: list[Path]) -> None:
    """The commit, command and machine of the runs behind the tables (``fedsight.reporting.provenance``)."""
    from fedsight.reporting import provenance

    if runs:
        print()
        print(provenance(runs))


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
    base = complete_runs(root, "het_fedavg")
    print("\nEach heterogeneous row minus heterogeneous FedAvg, paired by seed: mean difference in mIoU points, its 95% "
          "CI (Student t) and verdict.\n")
    print("| method | style | unseen | seen |")
    print("|---|---|---:|---:|")
    for variant, dist, method, style in ROWS:
        runs = complete_runs(root, variant)
        if dist != "Heterogeneous" or variant == "het_fedavg" or not runs or not base:
            continue
        cells = [ci_cell(seeds_of(runs, lambda r: 100 * final(r)[k]), seeds_of(base, lambda r: 100 * final(r)[k]))
                 for k in ("test_unseen/miou", "test/miou")]
        print(f"| {method} | {style or '-'} | {' | '.join(cells)} |")
    print("\nThe other comparisons, paired by seed: mIoU points, 95% CI (Student t), verdict.\n")
    print("| comparison | difference |")
    print("|---|---:|")
    for label, (variant, column), (other, other_column) in PAIRS:
        runs, base_runs = complete_runs(root, variant), complete_runs(root, other)
        if runs and base_runs:
            diff = ci_cell(seeds_of(runs, lambda r: 100 * _value(r, column)),
                           seeds_of(base_runs, lambda r: 100 * _value(r, other_column)))
            print(f"| {label} | {diff} |")
    print_provenance([r for variant, *_ in ROWS for r in complete_runs(root, variant)])


def _value(run: Path, column: str) -> float:
    if column == "domain":
        return by_domain(run)["test/miou"]
    return final(run)["test_unseen/miou" if column == "unseen" else "test/miou"]


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/feddrive"))
