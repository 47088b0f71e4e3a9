"""Peak memory and decode/compute overlap of the lazy on-disk image pipeline.

(a) Writes two ImageFolder trees of random RGB PNGs (10 class folders; ``--images`` and ``--small`` files of
``--size`` x ``--size``) into a temporary folder, or into ``--data DIR`` where they are kept and reused.
(b) For each tree, a fresh process goes FedSight's own way: the ``imagefolder`` dataset (every file's header
checked), the classification task (one streaming pass for the channel statistics), then one augmented
training pass of every client (``train_batches``, 2 prefetching threads) and the test set; it reports its
peak RSS. Memory must not grow with the number of files: the target for the large/small ratio is <= 1.2.
(c) In a fresh process, a consumer trains a small CNN (forward + backward + SGD step, repeated so that the
compute per batch roughly matches the decode time per batch) on augmented batches of the large tree, decoded
inline (``Prefetcher(workers=0)``) or ahead on 2 threads (``Prefetcher(workers=2)``); it prints both rates in
images/s and their ratio (best of ``--repeats`` alternating runs).

    python benchmarks/image_pipeline.py --images 20000 --small 2000 --size 32 [--data DIR]

All measuring processes use ``torch.set_num_threads(1)``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def make_tree(root: Path, n: int, size: int, seed: int = 0) -> float:
    """``n`` random RGB PNGs in 10 class folders under ``root`` (skipped when already complete); seconds taken."""
    from PIL import Image

    from fedsight.rng import np_rng

    done = root / ".complete"
    if done.exists() and done.read_text() == f"{n} {size}":
        return 0.0
    t0 = time.perf_counter()
    for c in range(10):
        folder = root / f"class_{c}"
        folder.mkdir(parents=True, exist_ok=True)
        count = n // 10 + (c < n % 10)
        rng = np_rng(seed, "benchmark-images", n, c)
        # smooth colour fields plus noise: compresses like small natural images rather than pure noise
        cell = size // 4 + 1
        coarse = rng.integers(0, 256, (count, 4, 4, 3), dtype=np.uint8).repeat(cell, 1).repeat(cell, 2)
        noise = rng.integers(-24, 25, (count, size, size, 3))
        pixels = np.clip(coarse[:, :size, :size].astype(np.int16) + noise, 0, 255).astype(np.uint8)
        for k in range(count):
            Image.fromarray(pixels[k]).save(folder / f"img_{k:06d}.png", compress_level=1)
    done.write_text(f"{n} {size}")
    return time.perf_counter() - t0


MAKE_TREE_CHILD = r"""
import json, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from image_pipeline import make_tree
print(json.dumps({"seconds": make_tree(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))}))
"""

# the measuring children are started by this small process (numpy only): on Linux a child's ru_maxrss
# starts at the peak RSS of the process it was forked from
MEMORY_CHILD = r"""
import json, resource, sys, time
import numpy as np, torch
torch.set_num_threads(1)
from fedsight.api import build_task
from fedsight.config import validate
root, size = sys.argv[1], int(sys.argv[2])
def current_rss_kb():
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1])
import_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # the imports' transient peak
try:  # Linux: reset the high-water mark (and ru_maxrss) to the current RSS, so the peak below is the pipeline's
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    reset = True
except OSError:
    reset = False
after_imports = current_rss_kb()
# FedSight's own path: the imagefolder dataset (header check of every file), the classification task
# (one streaming statistics pass), then one augmented training pass of every client and the test set
t0 = time.perf_counter()
cfg = validate({"seed": 0, "model": {"name": "cnn"}, "server": {"rounds": 1},
                "data": {"name": "imagefolder", "train_dir": root, "image_size": size, "test_fraction": 0.1,
                         "augment": "crop_flip", "workers": 2},
                "partition": {"name": "iid", "num_clients": 10, "local_test_fraction": 0.0}})
task = build_task(cfg)
t_build = time.perf_counter() - t0
t1 = time.perf_counter()
seen = 0
for c in range(task.num_clients):
    n = task.num_train_examples(c)
    batches = [torch.arange(s, min(s + 64, n)) for s in range(0, n, 64)]
    for x, y in task.train_batches(c, batches, seed=0, round=1):
        seen += len(x)
for x, y in task.eval_batches("test", 256):
    seen += len(x)
t_read = time.perf_counter() - t1
print(json.dumps({"n": len(task.splits.train) + len(task.splits.test), "seen": seen, "read_s": t_read,
                  "stats_s": t_build, "mean": task.mean.flatten().tolist(), "std": task.std.flatten().tolist(),
                  "import_peak_kb": import_peak, "after_imports_kb": after_imports, "reset": reset,
                  "hwm_kb": int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1]),
                  "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""

THROUGHPUT_CHILD = r"""
import json, sys, time
import numpy as np, torch
import torch.nn.functional as F
torch.set_num_threads(1)
from fedsight.data.pipeline import BatchLoader, Prefetcher, RandomCropFlip, image_folder_store
from fedsight.rng import np_rng, torch_gen
root, (size, batches, repeats, workers) = sys.argv[1], map(int, sys.argv[2:6])
store, labels, _ = image_folder_store(root, size, 3)
loader = BatchLoader(store, RandomCropFlip(4), seed=0)
order = np_rng(0, "shuffle", 0, 0).permutation(len(store))
jobs = [(order[s * 64:(s + 1) * 64], ("augment", 0, 0, s)) for s in range(min(batches, len(store) // 64))]
g = torch_gen(0, "init")
model = torch.nn.Sequential(
    torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
    torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(4), torch.nn.Flatten(),
    torch.nn.Linear(32 * 16, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)

def train_step(x, y, reps):
    x = x.float().div_(255)
    for _ in range(reps):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

def timed(fn, n):
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n

# calibrate: compute per batch ~ decode per batch
decode_s = min(timed(lambda: loader(jobs[k % len(jobs)]), 5) for k in range(3))
x0, y0 = loader(jobs[0]), labels[torch.from_numpy(jobs[0][0])]
train_step(x0, y0, 2)
step_s = min(timed(lambda: train_step(x0, y0, 1), 5) for _ in range(3))
reps = max(1, round(decode_s / step_s))

def run(pf):
    t, c = time.perf_counter(), time.process_time()
    n = 0
    for (idx, _), x in zip(jobs, pf.map(loader, jobs)):
        train_step(x, labels[torch.from_numpy(idx)], reps)
        n += len(x)
    wall = time.perf_counter() - t
    return n / wall, (time.process_time() - c) / wall  # images/s, CPU cores used

inline, ahead = Prefetcher(0), Prefetcher(workers, depth=2, backend="thread")
list(ahead.map(loader, jobs[:2]))  # start the threads
runs = {"inline": [], "ahead": []}
for _ in range(repeats):
    runs["inline"].append(run(inline))
    runs["ahead"].append(run(ahead))
ahead.close()
best = {k: max(v) for k, v in runs.items()}
print(json.dumps({"decode_ms": decode_s * 1e3, "step_ms": step_s * 1e3, "reps": reps, "batches": len(jobs),
                  "inline": best["inline"][0], "ahead": best["ahead"][0], "cpu_inline": best["inline"][1],
                  "cpu_ahead": best["ahead"][1], "all": {k: [r for r, _ in v] for k, v in runs.items()}}))
"""


def run_child(code: str, *args: object) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        sys.exit(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=20_000, help="files in the large tree")
    ap.add_argument("--small", type=int, default=2_000, help="files in the small tree")
    ap.add_argument("--size", type=int, default=32, help="side of the square images (on disk and decoded)")
    ap.add_argument("--data", type=Path, default=None, help="keep (and reuse) the trees here instead of a temp dir")
    ap.add_argument("--batches", type=int, default=150, help="batches of 64 per throughput run")
    ap.add_argument("--repeats", type=int, default=3, help="alternating inline/prefetch runs; the best is reported")
    ap.add_argument("--workers", type=int, default=2, help="prefetch threads")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or Path(tmp)
        trees = {n: data / f"tree_{n}_{args.size}px" for n in (args.small, args.images)}
        load0 = os.getloadavg()
        for n, root in trees.items():
            secs = run_child(MAKE_TREE_CHILD, Path(__file__).resolve().parent, root, n, args.size)["seconds"]
            print(f"tree of {n:>6} PNGs at {root}: " + (f"written in {secs:.1f} s" if secs else "reused"))
        mem = {n: run_child(MEMORY_CHILD, root, args.size) for n, root in trees.items()}
        thr = run_child(THROUGHPUT_CHILD, trees[args.images], args.size, args.batches, args.repeats, args.workers)

    reset = all(r["reset"] for r in mem.values())
    print("\n(b) imagefolder dataset + classification task (statistics pass), then every client's augmented "
          "training pass and the test set, fresh process per tree")
    print("    peak RSS (ru_maxrss) of the pipeline phase" + (" (high-water mark reset after the imports)" if reset else
          " (could not reset the high-water mark: includes the imports)") + "; process peak includes the imports")
    print(f"{'images':>8} {'RSS after imports':>18} {'pipeline peak':>14} {'process peak':>13} {'pass s':>7} "
          f"{'build s':>8} {'eager f32 tensor':>17}")
    for n, r in mem.items():
        assert r["seen"] == n == r["n"], r
        r["process_peak_kb"] = max(r["import_peak_kb"], r["peak_rss_kb"])
        eager = n * 3 * args.size * args.size * 4 / 2**20
        print(f"{n:>8} {r['after_imports_kb'] / 1024:>15.1f} MB {r['peak_rss_kb'] / 1024:>11.1f} MB "
              f"{r['process_peak_kb'] / 1024:>10.1f} MB {r['read_s']:>7.2f} {r['stats_s']:>8.2f} {eager:>14.1f} MB")
    for what in ("peak_rss_kb", "process_peak_kb"):
        ratio = mem[args.images][what] / mem[args.small][what]
        label = "pipeline peak" if what == "peak_rss_kb" else "process peak"
        print(f"{label} RSS ratio {args.images} / {args.small} images: {ratio:.3f} "
              f"(target <= 1.2: {'ok' if ratio <= 1.2 else 'FAILED'})")
    m, s = mem[args.images]["mean"], mem[args.images]["std"]
    print(f"channel_stats of the large tree: mean {np.round(m, 4).tolist()}, std {np.round(s, 4).tolist()}")

    print(f"\nload average (1 min) before / after: {load0[0]:.2f} / {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    print(f"\n(c) small CNN training on augmented batches of 64, {thr['batches']} batches per run, 1 torch thread")
    print(f"decode+augment {thr['decode_ms']:.1f} ms/batch, one train step {thr['step_ms']:.1f} ms; "
          f"{thr['reps']} step(s) per batch")
    print(f"{'loader':<28} {'images/s':>9} {'CPU cores used':>15}")
    print(f"{'inline (workers=0)':<28} {thr['inline']:>9.0f} {thr['cpu_inline']:>15.2f}")
    print(f"{f'Prefetcher({args.workers} threads, depth 2)':<28} {thr['ahead']:>9.0f} {thr['cpu_ahead']:>15.2f}")
    print(f"speed-up: {thr['ahead'] / thr['inline']:.2f}x   (runs: inline {[round(v) for v in thr['all']['inline']]}, "
          f"prefetch {[round(v) for v in thr['all']['ahead']]})")
    if thr["cpu_ahead"] < 1.3:
        print(f"note: the prefetching run got only {thr['cpu_ahead']:.2f} CPU cores (other load on the machine); decoding "
              "can overlap compute only where a second core is free")


if __name__ == "__main__":
    main()
