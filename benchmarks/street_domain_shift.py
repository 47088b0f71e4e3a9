"""Domain shift of the built-in street scenes: train one segmentation model on a single domain, evaluate it on
held-out scenes of that domain and on shifted ones (rain, dusk, the bus camera, the rural town).

A model trained on clear-day scenes from a car in the five urban towns is tested on unseen scenes of the same
domain and on the same towns under rain and at dusk (appearance shift), from the bus camera (viewpoint
shift), and on the rural town (layout shift: no sidewalks, fields). It prints mIoU per test domain and the
drop against the training domain: the shift the FedDrive benchmark rests on must be real.

    python benchmarks/street_domain_shift.py [--steps 2500] [--lr 0.1] [--size 64 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from fedsight.data.seg_pipeline import SegBatchLoader
from fedsight.data.street import StreetParams, load_street
from fedsight.models.base import ModelIO
from fedsight.plugins import load_builtin
from fedsight.registry import MODELS, build
from fedsight.tasks.segmentation import IMAGENET_MEAN, IMAGENET_STD, pixel_loss, segmentation_metrics

URBAN = ["downtown", "suburb", "industrial", "oldtown", "boulevard"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2500)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--size", type=int, nargs=2, default=(64, 128), metavar=("H", "W"))
    ap.add_argument("--per-domain", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=0.1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_builtin()
    h, w = args.size
    t0 = time.perf_counter()
    data = load_street(StreetParams(towns=URBAN + ["rural"], conditions=["clear-day", "rain-day", "clear-dusk"],
                                    cameras=["car", "bus"], per_domain=args.per_domain, height=h, width=w,
                                    setting="none", test_fraction=0.25, workers=2), seed=0)
    names = data.domain_names
    print(f"rendered {len(names)} domains x {args.per_domain} scenes of {h}x{w} in {time.perf_counter() - t0:.0f} s")
    source = [d for d, n in enumerate(names) if n.endswith("/clear-day/car") and not n.startswith("rural")]
    pool, test = data.train, data.tests["test"]
    train_idx = np.flatnonzero(np.isin(pool.domains, source))
    mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    torch.manual_seed(0)
    model = build(MODELS, "bisenetv2", {}, io=ModelIO("segmentation", num_outputs=len(data.class_names)))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    loader = SegBatchLoader(pool.images, pool.labels, (h, w), (0.75, 1.5), True, seed=0)
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = args.lr * (1 - step / args.steps) ** 0.9
        x, y = loader((rng.choice(train_idx, args.batch, replace=False), ("bench", step), 0))
        out = model((x.float() / 255 - mean) / std)
        loss = sum(pixel_loss(o, y.long(), 0.25) for o in out)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % 250 == 0:
            print(f"step {step + 1}: loss {loss.item():.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    model.eval()
    metrics = segmentation_metrics(data.class_names, per_image=False)

    def miou(domains: list[int]) -> float:
        state = metrics.new_state()
        idx = np.flatnonzero(np.isin(test.domains, domains))
        with torch.no_grad():
            for a in range(0, len(idx), 16):
                j = idx[a : a + 16]
                x, y = test.images.get(j), torch.stack([test.labels.get_one(i) for i in j])
                metrics.metrics[0].update(state, model((x.float() / 255 - mean) / std).argmax(1), y.long())
        return 100 * metrics.compute(state)["miou"]

    def of(cond: str, cam: str, towns: list[str]) -> list[int]:
        return [d for d, n in enumerate(names) if n.split("/")[0] in towns and n.endswith(f"/{cond}/{cam}")]

    rows = [("source: urban, clear-day, car", of("clear-day", "car", URBAN)),
            ("rain (appearance)", of("rain-day", "car", URBAN)), ("dusk (appearance)", of("clear-dusk", "car", URBAN)),
            ("bus camera (viewpoint)", of("clear-day", "bus", URBAN)), ("rural town (layout)", of("clear-day", "car", ["rural"])),
            ("rural, rain, bus (all three)", of("rain-day", "bus", ["rural"]))]
    base = None
    print(f"\n{'test domain':32s} {'mIoU %':>7s} {'drop':>6s}")
    for label, doms in rows:
        m = miou(doms)
        base = m if base is None else base
        print(f"{label:32s} {m:7.1f} {base - m:6.1f}")


if __name__ == "__main__":
    main()
