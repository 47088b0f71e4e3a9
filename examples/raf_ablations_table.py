"""The tables of RAF's ablation experiments (``examples/raf_ablations.toml``; Lim et al., digest
``notes/002_raf.md`` sections 4.1, 4.2 and 4.4), in the layout of ``raf_table.py``: PCKh@0.5 (%) of the final
global model at every inference resolution (lowest first; * = not a training resolution), mean ± sample std over
the complete seeds, and each comparison as a difference paired by seed, its 95% CI and the verdict
(``feddrive_table.ci_cell``), with the paper's number beside ours where the paper prints one. Our ladder is the
paper's halved: our 64x48 / 96x72 / 128x96 stand for its 128x96 / 192x144 / 256x192.

* Table I (resolution drift): plain FedAvg over the six resolution triplets; the gain column is each triplet minus
  (low, low, low) at the lowest rung, paired by seed (same data, partition and initial model: only the clients'
  native resolutions differ).
* Fig. 6 (all clients at the high rung): FedAvg and FedAvg + RAF, and RAF's gain paired by seed at every size.
* Fig. 8 (client-side benefit): each client alone (CL), alone with MRKD (CL+KD) and, with ``--raf RUN_ROOT`` (the
  runs of ``examples/raf.toml``), the federated global model of ``raf_fedavg`` ("HML (RAF)"). CL+KD - CL is paired
  by seed (same data and initial model); RAF - CL is paired by seed too, but the two come from different
  experiments (the federation also holds the other clients' data), so the pairing only removes what the seed
  shares (the initial model and test set).

    python examples/raf_ablations_table.py runs/raf_ablations --raf runs/raf
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from feddrive_table import ci_cell, complete_runs, print_provenance
from ppfl_table import by_seed, config, fmt, header, last
from raf_table import sizes

#: Table I rows: (variant, the paper's triplet of native resolutions, the paper's PCKh at its 128x96)
TRIPLETS = [("drift_lll", "128 / 128 / 128", 52.8), ("drift_llm", "128 / 128 / 192", 52.9),
            ("drift_lmm", "128 / 192 / 192", 52.4), ("drift_llh", "128 / 128 / 256", 52.3),
            ("drift_lmh", "128 / 192 / 256", 51.6), ("drift_lhh", "128 / 256 / 256", 51.3)]
#: Fig. 8 panels: (client, CL variant, CL+KD variant or None: the low client has no rung below it)
CLIENTS = [("high", "cl_high", "cl_kd_high"), ("mid", "cl_mid", "cl_kd_mid"), ("low", "cl_low", None)]


def pckh(runs: list[Path], split: str) -> dict[int, float]:
    """seed -> final PCKh of ``split`` of each run."""
    key = f"{split}/pckh"
    return {s: last(r, key)[key] for s, r in by_seed(runs).items()}


def columns(run: Path) -> tuple[list[tuple[str, str]], list[str]]:
    """(split, "HxW") lowest first, and the header cells (* marks a size outside the ladder)."""
    cols = sizes(run)
    ladder = {"x".join(str(v) for v in s) for s in config(run)["task"].get("ladder", [])}
    return cols, [s + ("" if s in ladder else " *") for _, s in cols]


def row(label: str, runs: list[Path], cols: list[tuple[str, str]], extra: list[str] = ()) -> None:
    cells = [fmt(list(pckh(runs, split).values()), 1) for split, _ in cols]
    print(f"| {label} | " + " | ".join(cells + list(extra)) + f" | {len(runs)} |")


def gain_row(label: str, runs: list[Path], base: list[Path], cols: list[tuple[str, str]]) -> None:
    pairs = len(by_seed(runs).keys() & by_seed(base).keys())
    cells = [ci_cell(pckh(runs, split), pckh(base, split), 1) for split, _ in cols]
    print(f"| {label} | " + " | ".join(cells) + f" | {pairs} |")


def table_i(root: Path) -> list[Path]:
    present = [(v, t, p) for v, t, p in TRIPLETS if complete_runs(root, v)]
    if not present:
        return []
    cols, names = columns(complete_runs(root, present[0][0])[0])
    low = cols[0][0]
    base = complete_runs(root, "drift_lll")
    print(f"\n**Table I (resolution drift)**: PCKh@0.5 (%) of plain FedAvg's global model, 3 clients at the paper's "
          f"resolution triplets (ours halved), final round; gain = the triplet - (low, low, low) at {cols[0][1]} "
          "(the paper's 128x96 column), paired by seed: mean [95% CI] and verdict.\n")
    header(["clients (paper's heights)"] + names + ["paper at 128x96", f"gain at {cols[0][1]}", "seeds"], len(cols) + 3)
    used = []
    for variant, triplet, paper in present:
        runs = complete_runs(root, variant)
        used += runs
        gain = ci_cell(pckh(runs, low), pckh(base, low), 1) if base and variant != "drift_lll" else "-"
        row(triplet, runs, cols, [f"{paper:.1f}", gain])
    return used


def table_fig6(root: Path) -> list[Path]:
    base, raf = complete_runs(root, "allhigh_fedavg"), complete_runs(root, "allhigh_raf_fedavg")
    if not (base or raf):
        return []
    cols, names = columns((base or raf)[0])
    high = "x".join(str(v) for v in config((base or raf)[0])["task"]["ladder"][0])
    print(f"\n**Fig. 6 (every client at the high rung)**: PCKh@0.5 (%) of the global model, 4 clients all at {high}, "
          "final round; gain of RAF paired by seed (the paper: +27.6 at its 128x96 and +6.0 at its 192x144, our "
          "two lowest columns).\n")
    header(["method"] + names + ["seeds"], len(cols) + 1)
    if base:
        row("FedAvg", base, cols)
    if raf:
        row("FedAvg + RAF", raf, cols)
    if base and raf:
        gain_row("gain of RAF", raf, base, cols)
    return base + raf


def table_fig8(root: Path, raf_root: Path | None) -> list[Path]:
    used: list[Path] = []
    fed = complete_runs(raf_root, "raf_fedavg") if raf_root is not None else []
    for client, cl_v, kd_v in CLIENTS:
        cl = complete_runs(root, cl_v)
        kd = complete_runs(root, kd_v) if kd_v else []
        if not cl:
            continue
        cols, names = columns(cl[0])
        rung = config(cl[0])["task"].get("client_rungs", [0])[0]
        native = "x".join(str(v) for v in config(cl[0])["task"]["ladder"][rung])
        paper = " (the paper, low client at its 128x96: CL 46.7, RAF 57.2)" if kd_v is None else ""
        print(f"\n**Fig. 8, {client} client ({native})**: PCKh@0.5 (%) by inference resolution of the client's model "
              f"trained alone (CL), alone with MRKD (CL+KD) and of the federated RAF model (3 clients high / mid / "
              f"low), final round; gains paired by seed{paper}.\n")
        header(["training"] + names + ["seeds"], len(cols) + 1)
        row("CL", cl, cols)
        if kd:
            row("CL+KD", kd, cols)
        if fed:
            row("HML (RAF), raf.toml's raf_fedavg", fed, cols)
        if kd:
            gain_row("CL+KD - CL", kd, cl, cols)
        if fed:
            gain_row("RAF - CL", fed, cl, cols)
            if kd:
                gain_row("RAF - CL+KD", fed, kd, cols)
        used += cl + kd
    return used + fed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", type=Path, help="the sweep's run folder (runs/raf_ablations)")
    ap.add_argument("--raf", type=Path, default=None, help="examples/raf.toml's run folder (runs/raf): Fig. 8's RAF")
    args = ap.parse_args(argv)
    for path in [args.root] + ([args.raf] if args.raf is not None else []):
        if not path.is_dir():
            print(f"error: {path} is not a folder of runs", file=sys.stderr)
            return 2
    used = table_i(args.root) + table_fig6(args.root) + table_fig8(args.root, args.raf)
    if not used:
        print(f"error: no complete run of examples/raf_ablations.toml under {args.root}", file=sys.stderr)
        return 1
    print_provenance(sorted(set(used)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
