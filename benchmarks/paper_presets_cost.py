"""Estimated GPU time of one run of each paper preset (``examples/paper/*.toml``), for docs/paper_presets.md.

An ESTIMATE, not a measurement: no GPU was available when it was written. For each preset it reads the config (the
first variant, or the one named below), counts the local training steps of one run from the paper's dataset sizes
(``SIZES``: examples a client holds, which the config cannot know before the data are on disk), measures the
model's forward FLOPs for one example at the preset's training input size with ``torch.utils.flop_counter`` on the
meta device (no compute; FLOPs = 2 x multiply-adds), and prices a step at

    max(3 x forward FLOPs x batch / THROUGHPUT, FLOOR)

(a backward pass costs about two forwards; ``FLOOR`` is the launch-bound time of one small step, which dominates
for 32 x 32 inputs). Extra forwards a method runs are added where they are large (LADD's teacher and theta^0: 2
more forwards a step; FedVG's server pass over V: 3 forwards of |V| examples per client a round). Evaluation is
left out. Presets whose model is merged from another branch are priced from the paper's own reported time.

    python benchmarks/paper_presets_cost.py         # the table of docs/paper_presets.md
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from fedsight.config import read_toml  # noqa: E402
from fedsight.models import build_model  # noqa: E402
from fedsight.plugins import load_builtin  # noqa: E402

THROUGHPUT = 40e12  # FLOP/s sustained: an assumption (about a quarter of an A100's dense TF32 peak)
FLOOR = 0.005  # seconds: the assumed launch-bound time of one small training step

#: preset -> (variant priced, model outputs, training input [H, W], examples a client holds, what they come from)
SIZES = {
    "fedvg_cifar10": ("fedvg", 10, (32, 32), 390, "CIFAR-10: 65% of 60,000 over 100 clients"),
    "fed3r_cifar100": ("fedavg", 100, (32, 32), 500, "CIFAR-100: one class of 500 a client"),
    "fed3r_gl": ("fed3r+fedavg", 2028, (224, 224), 120, "GL Users-160k: 119.9 a client"),
    "fed3r_inat": ("fed3r+fedavg", 1203, (224, 224), 13, "iNat Users-120k: 13.0 a client, 5 epochs"),
    "fed3r_inat_rgb_shift": ("fed3r+fedavg+fedrdn", 1203, (224, 224), 24,
                             "iNat Pers-Geo-100: 66,165 images over 2,714 clients"),
    "fed3r_cifar100_imbalance": ("fed3r", 100, (32, 32), 250, "CIFAR-100 variants: 25,000 images, one class a client"),
    "personalized_gl": ("fed3r+fedavg+oll_fp_psi", 2028, (224, 224), 44,
                        "GL Pers-Users-160k: 80.2 a client, 55% train"),
    "raf_table2": ("raf_fedavg", 16, (256, 192), 4000, "MPII: 4K instances a client (the high client's size)"),
    "feddrive_cityscapes": ("het_fedavg", 19, (512, 1024), 21, "Cityscapes: 2,975 images over 144 clients"),
    "ladd_cityscapes": ("ladd_cls", 19, (512, 1024), 21, "Cityscapes: 2,975 images over 144 clients"),
    "feddrive_idda": ("het_fedavg", 16, (512, 928), 48, "IDDA country: 48 images each of 90 clients"),
}

#: LADD's stages in which no client trains (styles: a statistics pass; source: the server pre-trains)
SERVER_ONLY = ("styles", "source")

#: presets whose model another branch registers: the paper's own reported time
REPORTED = {
    "fedvsr_table1_reds": "the paper: 46 h a run on 4x A6000 (RVRT, VRT and IART averaged)",
    "fedvsr_table1_kinetics": "the paper: 46 h a run on 4x A6000 (RVRT, VRT and IART averaged)",
    "fedvsr_table2_reds": "the paper: 46 h a run on 4x A6000 (RVRT, VRT and IART averaged)",
    "fedvsr_table2_kinetics": "the paper: 46 h a run on 4x A6000 (RVRT, VRT and IART averaged)",
    "ppfl_rdsn_tables": "the paper: 77,368 s (21.5 h) for the FL-RDSN run, 10 L40 (one a client); "
                        "the centralised run 82,800 s on 2 L40",
}


def forward_flops(name: str, params: dict, outputs: int, hw: tuple[int, int]) -> float:
    with torch.device("meta"):
        model = build_model(name, params, num_outputs=outputs, in_channels=3)
        x = torch.zeros(1, 3, *hw)
    model.eval()
    with FlopCounterMode(display=False) as counter:
        model(x)
    return float(counter.get_total_flops())


def merged(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def stage_plan(raw: dict, variant: str) -> list[tuple[int, dict, dict]]:
    """(rounds, train, server) of every stage of the variant (one stage when it has none)."""
    var = next(v for v in raw.get("variants", []) if v["name"] == variant)
    cfg = merged(raw, {k: v for k, v in var.items() if k not in ("name", "stages")})
    stages = var.get("stages", raw.get("stages"))
    if not stages:
        return [(cfg["server"]["rounds"], cfg["train"], cfg["server"])]
    return [(st["rounds"], merged(cfg["train"], st.get("train", {})), merged(cfg["server"], st.get("server", {})))
            for st in stages if st["name"] not in SERVER_ONLY]


def runs(raw: dict) -> int:
    """Runs of the whole preset: variants x seeds x grid points."""
    sweep = raw.get("sweep", {})
    return (len(raw.get("variants", [])) or 1) * len(sweep.get("seeds", [0])) * math.prod(
        len(v) for v in sweep.get("grid", {}).values())


def estimate(preset: Path) -> tuple[str, ...]:
    raw = read_toml(preset)
    variant, outputs, hw, n_k, source = SIZES[preset.stem]
    if raw.get("task", {}).get("double") == "all":  # FedDrive's double_dataset: every list and its mirror
        n_k, source = 2 * n_k, f"{source}, doubled"
    model = raw["model"]
    fwd = forward_flops(model["name"], {k: v for k, v in model.items() if k != "name"}, outputs, hw)
    steps = seconds = 0.0
    extra = 2 if preset.stem == "ladd_cityscapes" else 0  # the SWA teacher's and theta^0's forwards
    for rounds, train, server in stage_plan(raw, variant):
        clients = server["clients_per_round"]
        batch = train.get("batch_size", 32)
        per_round = train["steps"] if "steps" in train else train.get("epochs", 1) * math.ceil(n_k / batch)
        if any(c.get("name") in ("fed3r", "fedncm") if isinstance(c, dict) else c in ("fed3r", "fedncm")
               for c in raw.get("recipe", {}).get("components", [])):
            per_round = math.ceil(n_k / batch)  # one forward pass for the statistics (priced as a step)
        n = rounds * clients * per_round
        steps += n
        seconds += n * max((3 + extra) * fwd * batch / THROUGHPUT, FLOOR)
    if preset.stem == "ladd_cityscapes":  # the server's source pre-training: 15,000 steps of 16
        seconds += 15000 * max(3 * fwd * 16 / THROUGHPUT, FLOOR)
        steps += 15000
    if preset.stem == "fedvg_cifar10":  # the server's pass over V (6,000 examples) for each of 10 clients a round
        seconds += raw["server"]["rounds"] * 10 * max(3 * fwd * 6000 / THROUGHPUT, FLOOR * 6000 / 32)
    n = runs(raw)
    return (preset.stem, f"{fwd / 1e9:.3g} GFLOPs at {hw[0]}x{hw[1]}", f"{steps:,.0f} steps ({variant}; {source})",
            f"{seconds / 3600:.2g} GPU-hours", f"{n} runs: {n * seconds / 3600:.2g} GPU-hours, every run priced as this one")


def main() -> None:
    load_builtin()
    print(f"Estimates at {THROUGHPUT / 1e12:.0f} TFLOP/s sustained, at least {FLOOR * 1000:.0f} ms a step; "
          "training only, one run (one seed, one variant):\n")
    print("| preset | forward per example | local steps of one run | estimated time of one run | whole preset |")
    print("|---|---|---|---|---|")
    for preset in sorted((ROOT / "examples" / "paper").glob("*.toml")):
        if preset.stem in REPORTED:
            print(f"| `{preset.stem}` | - | - | {REPORTED[preset.stem]} | {runs(read_toml(preset))} runs |")
        else:
            print("| " + " | ".join([f"`{c}`" if i == 0 else c for i, c in enumerate(estimate(preset))]) + " |")


if __name__ == "__main__":
    main()
