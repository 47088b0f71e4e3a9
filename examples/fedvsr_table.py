"""The table of docs/video_sr.md from the runs of ``examples/fedvsr.toml``: per method and partition the final
round's PSNR and SSIM on Y and on RGB, mean ± sample std over its complete runs; then each method minus FedAvg on
the same partition, paired by seed, with its 95% CI and verdict (PSNR-Y in dB, SSIM-Y in thousandths), the
ablation pairs the docs discuss (F-ALA against F-GLA; FedVSR against each of its two parts), and FedAvg's
one-photo-per-client partition against its iid one; then the commit, command and machine of the runs.

    python examples/fedvsr_table.py runs/fedvsr
"""

from __future__ import annotations

import sys
from pathlib import Path

from fed3r_table import cell, last
from feddrive_table import ci_cell, complete_runs, print_provenance, seeds_of

#: (variant, label) in the config's order
METHODS = [("fedavg", "FedAvg"), ("fedprox", "FedProx (μ 1e-3)"), ("scaffold", "SCAFFOLD"),
           ("fedavg_dwt", "FedAvg + DWT loss (F-L_HiFr)"), ("fedavg_ala", "FedAvg + loss-aware weighting (F-ALA)"),
           ("fedavg_gla", "FedAvg + greedy loss-aware weighting (F-GLA)"), ("fedvsr", "FedVSR")]
#: the grid's folder name -> label
PARTITIONS = [("name=iid", "iid"), ("name=classes", "one photo per client")]
#: further pairs docs/video_sr.md discusses: (method, baseline)
PAIRS = [("fedavg_gla", "fedavg_ala"), ("fedvsr", "fedavg_dwt"), ("fedvsr", "fedavg_ala")]


def _cells(runs: list[Path], base: list[Path]) -> list[str]:
    return [ci_cell(seeds_of(runs, lambda r: scale * last(r, key)), seeds_of(base, lambda r: scale * last(r, key)),
                    digits) for key, scale, digits in (("test/psnr_y", 1.0, 2), ("test/ssim_y", 1000.0, 1))]


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python examples/fedvsr_table.py RUNS/fedvsr (a folder of runs)", file=sys.stderr)
        return 2
    root, shown = Path(argv[0]), []
    print("| method | partition | PSNR-Y | SSIM-Y | PSNR-RGB | SSIM-RGB | seeds |")
    print("|---|---|---|---|---|---|---:|")
    for variant, label in METHODS:
        for part, plabel in PARTITIONS:
            runs = complete_runs(root / variant, part)
            if not runs:
                continue
            shown += runs
            psnr_y, ssim_y, psnr_rgb, ssim_rgb = (
                [last(r, k) for r in runs] for k in ("test/psnr_y", "test/ssim_y", "test/psnr_rgb", "test/ssim_rgb"))
            print(f"| {label} | {plabel} | {cell(psnr_y, 1, 2)} | {cell(ssim_y, 1, 4)} | {cell(psnr_rgb, 1, 2)} | "
                  f"{cell(ssim_rgb, 1, 4)} | {len(runs)} |")
    print("\nEach method minus FedAvg on the same partition (then the pairs the docs discuss), paired by seed: mean "
          "difference, its 95% CI (Student t) and verdict; PSNR-Y in dB, SSIM-Y in thousandths.\n")
    print("| method | against | partition | PSNR-Y (dB) | SSIM-Y (x1000) |")
    print("|---|---|---|---|---|")
    for method, against in [(m, "fedavg") for m, _ in METHODS[1:]] + PAIRS:
        for part, plabel in PARTITIONS:
            runs, base = complete_runs(root / method, part), complete_runs(root / against, part)
            if runs and base:
                print(f"| {method} | {against} | {plabel} | {' | '.join(_cells(runs, base))} |")
    iid, classes = complete_runs(root / "fedavg", "name=iid"), complete_runs(root / "fedavg", "name=classes")
    if iid and classes:
        print(f"| fedavg, one photo per client | fedavg, iid | (paired by seed) | {' | '.join(_cells(classes, iid))} |")
    print_provenance(shown)
    return 0 if shown else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
