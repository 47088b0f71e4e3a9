"""CPU cost of RVRT with the plain-PyTorch guided deformable attention (``fedsight.models.rvrt``), for
docs/video_sr.md: process CPU time per LR frame of a forward pass (eval mode, no gradient) and of a training step
(forward and backward), one intra-op thread, at the small size the test suite uses and at the paper's size, and
the share of the forward spent in ``deform_attn`` (the part that replaces the authors' CUDA kernel) and in SPyNet.

    PYTHONPATH=src python benchmarks/rvrt_speed.py [--repeats 5] [--frames 4] [--side 32]

Prints a Markdown table (median and min-max over the repeats) with the commit and the command line. CPU time, not
wall time, so other processes on a shared machine disturb it less (caches and memory bandwidth still do).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch

import fedsight.models.deform_attn as gda_module
from fedsight.models.base import ModelIO
from fedsight.registry import MODELS, build

SIZES = {
    "small, published SPyNet": {"embed_dims": [8, 8, 8], "num_heads": [2, 2, 2], "num_blocks": [1, 1, 1], "window_size": [2, 4, 4],
                      "deformable_groups": 4, "attention_heads": 2},
    "paper (10.8M)": {},
}


class Clock:
    """CPU seconds spent inside wrapped callables."""

    def __init__(self):
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.process_time() - start
        return timed


def measure(params: dict, frames: int, side: int, train: bool) -> tuple[float, float, float]:
    """(CPU seconds per frame, share in deform_attn, share in SPyNet) of one forward (and backward if ``train``;
    the shares are then meaningless: autograd runs the backward outside the wrapped calls)."""
    torch.manual_seed(0)
    model = build(MODELS, "rvrt", params, io=ModelIO("video_sr", num_outputs=3, scale=4))
    model.train(train)
    x = torch.rand(1, frames, 3, side, side, generator=torch.Generator().manual_seed(1))
    gda, flow = Clock(), Clock()
    plain, spynet = gda_module.deform_attn, model.spynet.forward
    gda_module.deform_attn, model.spynet.forward = gda.wrap(plain), flow.wrap(spynet)
    try:
        start = time.process_time()
        if train:
            model(x).square().mean().backward()
        else:
            with torch.no_grad():
                model(x)
        total = time.process_time() - start
    finally:
        gda_module.deform_attn = plain
    return total / frames, gda.seconds / total, flow.seconds / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--frames", type=int, default=4)
    ap.add_argument("--side", type=int, default=32, help="LR frame side (output 4x)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"commit {commit}; `{' '.join(['python'] + sys.argv)}`; torch {torch.__version__}, 1 thread; "
          f"{args.frames} frames of {args.side}x{args.side} LR -> x4; median (min-max) over {args.repeats} runs\n")
    print("| size | pass | CPU s / frame | in deform_attn | in SPyNet |")
    print("|---|---|---|---|---|")
    for label, params in SIZES.items():
        for train in (False, True):
            measure(params, args.frames, args.side, train)  # warm-up (allocator, lazy init)
            runs = [measure(params, args.frames, args.side, train) for _ in range(args.repeats)]
            cols = []
            for i, fmt in enumerate(("{:.3f}", "{:.0%}", "{:.0%}")):
                vals = [r[i] for r in runs]
                cols.append(f"{fmt.format(statistics.median(vals))} ({fmt.format(min(vals))}-{fmt.format(max(vals))})")
            shares = ["-", "-"] if train else cols[1:]  # the backward runs outside the wrapped calls
            print(f"| {label} | {'forward + backward' if train else 'forward'} | {cols[0]} | {' | '.join(shares)} |")


if __name__ == "__main__":
    main()
