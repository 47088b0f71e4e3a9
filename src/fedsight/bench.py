"""``fedsight bench``: the engines' speed and memory on the same workloads, as ratios measured in one run.

Speed. For each workload (``WORKLOADS``: the quickstart's small CNN on digits, a small RDSN on the built-in SR
photographs, and one seed paper's model per task at its paper's size, ``paper-*``) every sampled client does the same local SGD steps on the same batches under

* a plain PyTorch loop (load the global weights, ``torch.optim.SGD`` over the client's batches: no sampling,
  no upload, no aggregation), the floor of any sequential simulator;
* the sequential engine (``engine.vectorize = false``) and the vectorised engine (``true``), at one torch thread
  and, where the machine has more cores, at all of them;
* Flower's Ray simulation engine (``fedsight flower simulate``'s engine), when ``flwr`` is installed.

In-process engines alternate round by round, so machine noise hits them alike; each row is the median of the
timed rounds after a warm-up round. Client updates/s = clients per round / seconds per round; ratios are
against the sequential engine at one thread.

Memory. Peak RSS of a SCAFFOLD run (per-client control variates in the on-disk state store) over 100, 10,000
and 100,000 clients, each in a fresh process, on scikit-learn's digits made large enough by a documented
generator (each copy shifted by up to one pixel with Gaussian noise of std 1/16, written as a MedMNIST-style npz).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import validate
from .rng import torch_gen
from .training.local import batch_positions


def cnn_workload(clients: int, rounds: int) -> dict[str, Any]:
    """The quickstart's model and local training (small CNN, batch 16, one epoch) on digits, Dirichlet(0.3) label
    skew over ``clients`` clients, every client every round."""
    return {
        "seed": 0, "data": {"name": "digits"},
        "partition": {"name": "dirichlet", "alpha": 0.3, "num_clients": clients, "local_test_fraction": 0.0},
        "model": {"name": "cnn"}, "train": {"epochs": 1, "batch_size": 16, "lr": 0.05},
        "server": {"rounds": rounds, "clients_per_round": clients}, "eval": {"every": rounds, "local": False},
    }


def sr_workload(clients: int, rounds: int) -> dict[str, Any]:
    """A small RDSN (16 features, 2 dense blocks of 3 layers) at x2 on the built-in photographs' 48-px tiles, IID,
    batch 8, one epoch, every client every round."""
    return {
        "seed": 0, "task": {"name": "image_sr"},
        "data": {"name": "builtin_sr", "scale": 2, "patch_size": 12, "tile": 48},
        "partition": {"name": "iid", "num_clients": clients, "local_test_fraction": 0.0},
        "model": {"name": "rdsn", "features": 16, "blocks": 2, "layers": 3, "growth": 8},
        "train": {"epochs": 1, "batch_size": 8, "lr": 0.01},
        "server": {"rounds": rounds, "clients_per_round": clients}, "eval": {"every": rounds, "local": False},
    }


def _paper(task: str | dict[str, Any], data: dict[str, Any], model: dict[str, Any], batch: int,
           steps: int = 2) -> Callable[[int, int], dict[str, Any]]:
    """A paper's own model on its task's built-in data: ``steps`` local SGD steps of ``batch`` a round, IID clients,
    every client every round (the models at their papers' sizes, the inputs small enough for a 2-core CPU)."""
    def build(clients: int, rounds: int) -> dict[str, Any]:
        return {
            "seed": 0, "task": task if isinstance(task, dict) else {"name": task}, "data": data,
            "partition": {"name": "iid", "num_clients": clients, "local_test_fraction": 0.0},
            "model": model, "train": {"steps": steps, "batch_size": batch, "lr": 0.01},
            "server": {"rounds": rounds, "clients_per_round": clients}, "eval": {"every": rounds, "local": False},
        }
    return build


#: name -> (title, config builder (clients, rounds), default clients a round); the ``paper-*`` workloads are one
#: seed paper's model per task at the paper's size (issue 46), on small built-in inputs
WORKLOADS: dict[str, tuple[str, Callable[[int, int], dict[str, Any]], int]] = {
    "cnn": ("small CNN on digits", cnn_workload, 50),
    "sr": ("small RDSN (x2) on the built-in photographs", sr_workload, 20),
    "paper-cls": ("MobileNetV2 (the thesis's, 2.2M) on digits", _paper(
        "classification", {"name": "digits"}, {"name": "mobilenetv2"}, 16), 4),
    "paper-seg": ("BiSeNetV2 (FedDrive's, 3.4M) on the built-in street scenes", _paper(
        "segmentation", {"name": "street"}, {"name": "bisenetv2"}, 2), 4),
    "paper-sr": ("EDSR baseline (64 x 16 blocks, 1.4M) x2 on 24-px LR patches", _paper(
        "image_sr", {"name": "builtin_sr", "scale": 2, "patch_size": 24, "tile": 48},
        {"name": "edsr", "features": 64, "blocks": 16}, 4), 4),
    "paper-vsr": ("BasicVSR with SPyNet (BasicSR's, 6.3M) x4, 3 frames of 16 px LR", _paper(
        "video_sr", {"name": "synthetic_video", "scale": 4, "num_frames": 3, "patch_size": 16},
        {"name": "basicvsr_basicsr"}, 1), 4),
    "paper-pose": ("ViTPose-S (22M) at 64x48 on the built-in figures", _paper(
        {"name": "keypoints", "ladder": [[64, 48]], "eval_sizes": [[64, 48]]}, {"name": "builtin_pose"},
        {"name": "vitpose_s", "image_size": [64, 48]}, 4), 4),
}


@dataclass
class Row:
    engine: str
    threads: int | None
    seconds: float | None  # per round (median); None: not measured (``note`` says why)
    clients: int
    note: str = ""

    @property
    def updates_per_s(self) -> float | None:
        return None if not self.seconds else self.clients / self.seconds


def _to(value: Any, device: torch.device) -> Any:
    """A batch's targets on ``device``: a tensor, or a task's dict of them (keypoints: heatmaps and weights)."""
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value.to(device) if torch.is_tensor(value) else value


def plain_round(task: Any, model: torch.nn.Module, global_state: dict[str, torch.Tensor], sampled: list[int],
                r: int, seed: int, local: Any) -> None:
    """What every sampled client computes in round ``r``, as a bare loop: the engine's batches (stream
    ("shuffle", r, client)), ``torch.optim.SGD``, nothing else."""
    device = next(model.parameters()).device
    for cid in sampled:
        model.load_state_dict(global_state)
        opt = torch.optim.SGD(model.parameters(), lr=local.lr, momentum=local.momentum, weight_decay=local.weight_decay)
        n = task.num_train_examples(cid)
        gen = torch_gen(seed, "shuffle", r, cid)
        for pos in batch_positions(n, local.batch_size, local.num_steps(n, seed, r, cid), gen):
            x, y = task.train_batch(cid, pos)
            loss = task.loss(model(x.to(device)), _to(y, device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()


def time_engines(raw: dict[str, Any], rounds: int, threads: list[int], device: str = "auto") -> list[Row]:
    """Seconds per round of the plain loop and both in-process engines at each thread count. Every round runs all
    of them on the same clients and batches, one after another; the thread counts take turns round by round
    (each one's first round warms up, the next ``rounds`` are timed)."""
    from .api import build_simulation

    total = (rounds + 1) * len(threads)
    raw = {**raw, "server": {**raw["server"], "rounds": total}, "eval": {"every": total, "local": False}}
    engine = {"device": device, "threads": 1}
    seq = build_simulation(validate({**raw, "engine": {**engine, "vectorize": False}}))
    vec, why = None, ""
    try:
        vec = build_simulation(validate({**raw, "engine": {**engine, "vectorize": True}}))
    except ValueError as exc:  # the workload's recipe cannot be vectorised (the message says why)
        why = str(exc)
    task, m = seq.task, seq.schedule.clients_per_round
    model = task.build_model().to(seq.server.device)
    global_state = {k: v.clone() for k, v in seq.global_model.state_dict().items()}
    engines: dict[str, Callable[[int], Any]] = {
        "plain loop": lambda r: plain_round(task, model, global_state, list(range(m)), r, seq.seed, seq.local),
        "sequential engine": seq.train_round,
    }
    if vec is not None:
        engines["vectorised engine"] = vec.train_round
    times: dict[tuple[str, int], list[float]] = {(name, t): [] for t in threads for name in engines}
    for r in range(1, total + 1):
        t = threads[(r - 1) % len(threads)]
        torch.set_num_threads(t)
        for name, fn in engines.items():
            start = time.perf_counter()
            fn(r)
            if r > len(threads):
                times[(name, t)].append(time.perf_counter() - start)
    torch.set_num_threads(1)
    rows = [Row(name, t, statistics.median(ts), m) for (name, t), ts in times.items()]
    if vec is None:
        rows.append(Row("vectorised engine", None, None, m, why))
    return rows


def time_flower(raw: dict[str, Any], rounds: int) -> Row:
    """Median seconds per round of Flower's Ray simulation engine on the workload (rounds after the first; the
    last, which evaluates, left out)."""
    m = raw["server"]["clients_per_round"]
    try:
        import flwr.simulation  # noqa: F401  (the ``flower`` extra: flwr with Ray)

        from .flower.simulation import flower_simulate
    except ImportError:
        from .flower import INSTALL

        return Row("Flower simulation (Ray)", None, None, m, f"not installed: {INSTALL}")
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # Ray's FutureWarning about GPU variables
    cfg = validate({**raw, "run": {"name": "flower", "checkpoint_keep": 1}, "engine": {"threads": 1, "device": "cpu"},
                    "server": {**raw["server"], "rounds": rounds}, "eval": {"every": rounds, "local": False}})
    quiet = logging.getLogger("flwr")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # Flower's deprecation notice of its own simulation entry point
    try:
        with tempfile.TemporaryDirectory(prefix="fedsight-bench-") as tmp:
            flower_simulate(cfg, Path(tmp) / "ray", num_cpus=1.0)
            rows = [json.loads(x) for x in (Path(tmp) / "ray" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    finally:
        quiet.setLevel(level)
    times = [r["time/round_s"] for r in rows if "event" not in r][1:-1]
    return Row("Flower simulation (Ray)", 1, statistics.median(times) if times else None, m,
               "" if times else "too few rounds to time")


# -- memory -----------------------------------------------------------------------------------------

def make_digits_npz(path: Path, copies: int, seed: int = 0) -> int:
    """scikit-learn's digits, ``copies`` times, each copy shifted by a random offset of up to one pixel and given
    Gaussian noise of std 1/16, as a MedMNIST-style npz (2,000 test images); returns the training images."""
    from sklearn.datasets import load_digits

    d = load_digits()
    rng = np.random.default_rng(seed)
    base = d.images / 16.0
    imgs = []
    for _ in range(copies):
        shifted = np.stack([np.roll(np.roll(im, rng.integers(-1, 2), 0), rng.integers(-1, 2), 1) for im in base])
        imgs.append((np.clip(shifted + rng.normal(0, 1 / 16, shifted.shape), 0, 1) * 255).round().astype(np.uint8))
    x = np.concatenate(imgs)
    y = np.tile(d.target, copies)[:, None].astype(np.int64)
    n_test = 2000
    np.savez(path, train_images=x[n_test:], train_labels=y[n_test:], test_images=x[:n_test], test_labels=y[:n_test])
    return len(x) - n_test


_CHILD = r"""
import json, re, resource, sys
from pathlib import Path
from fedsight.api import execute
from fedsight.config import validate
a = json.loads(sys.argv[1])
cfg = validate({
    "seed": 0, "run": {"name": f"c{a['clients']}", "output_dir": a["out"], "checkpoint_keep": 1},
    "data": {"name": "npz", "path": a["npz"]},
    "partition": {"name": "iid", "num_clients": a["clients"], "local_test_fraction": 0.0},
    "model": {"name": "cnn"}, "train": {"steps": 2, "batch_size": 1, "lr": 0.05},
    "server": {"rounds": a["rounds"], "clients_per_round": a["per_round"]},
    "recipe": {"weighting": "uniform", "components": ["scaffold"]},
    "eval": {"every": a["rounds"], "local": False}, "engine": {"threads": 1},
})
run_dir = Path(a["out"]) / f"c{a['clients']}"
execute(cfg, run_dir)
held = len(list((run_dir / "client_state" / "scaffold").glob("*.safetensors")))
try:  # this process's own high-water mark (ru_maxrss keeps the parent's across exec on Linux)
    peak = int(re.search(r"VmHWM:\s*(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024
except (OSError, AttributeError):
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"peak_rss_mb": peak, "with_state": held}))
"""


def peak_rss(client_counts: list[int], rounds: int, per_round: int) -> list[dict[str, Any]]:
    """Peak RSS (MB) and the clients holding state after ``rounds`` rounds of SCAFFOLD, ``per_round`` clients a
    round, over each number of clients, each run in a fresh process on the same generated data."""
    out = []
    with tempfile.TemporaryDirectory(prefix="fedsight-bench-mem-") as tmp:
        npz = Path(tmp) / "digits.npz"
        copies = -(-(max(client_counts) + 2000) // 1797)  # enough images for one a client
        images = make_digits_npz(npz, copies)
        for clients in client_counts:
            args = json.dumps({"npz": str(npz), "out": tmp, "clients": clients, "rounds": rounds,
                               "per_round": min(per_round, clients)})
            start = time.perf_counter()
            proc = subprocess.run([sys.executable, "-c", _CHILD, args], capture_output=True, text=True, check=False,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
            if proc.returncode != 0:
                raise RuntimeError(f"the {clients}-client memory run failed: {proc.stderr.strip().splitlines()[-1:]}")
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            out.append({"clients": clients, "images": images, "seconds": time.perf_counter() - start, **res})
    return out
