"""Side-by-side crops (LR | bicubic | each method | ground truth) of a finished `fedsight run examples/fedvsr.toml`.

    python examples/fedvsr_visuals.py runs/fedvsr [--seed 0]

Writes runs/fedvsr/visuals_<partition>.png for every partition of the sweep, one column per method.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fedsight.tasks.video_sr import assemble_visuals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("group", type=Path, help="the sweep folder, e.g. runs/fedvsr")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    runs: dict[str, dict[str, Path]] = {}
    for d in sorted(args.group.glob(f"*/*/seed{args.seed}")):  # <method>/<grid point>/seed<N>
        if (d / "plots" / "visuals.json").is_file():
            runs.setdefault(d.parent.name, {})[d.parent.parent.name] = d
    if not runs:
        raise SystemExit(f"no finished video runs under {args.group}/*/*/seed{args.seed}")
    for point, by_method in runs.items():
        label = point.split("=")[-1]
        out = assemble_visuals(by_method, args.group / f"visuals_{label}.png")
        print(f"{point}: {', '.join(by_method)} -> {out}")


if __name__ == "__main__":
    main()
