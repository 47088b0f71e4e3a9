"""``fedsight calibrate``: the softmax temperature of fine-tuning after Fed3R, chosen by minimum training
cross-entropy over the clients' training data (thesis Sec. 3.7 and 3.9.1, Fig. 3.3; Sec. 4.3.1, Fig. 4.4).

The thesis tunes tau once, on the Fed3R-initialised model before fine-tuning, and fixes the value for every
fine-tuning experiment ("The temperature value that guarantees the lowest CE loss has been chosen for all the
experiments"). Here: run the Fed3R stage (a run, or a variant, whose last stage is ``fed3r``), then
``fedsight calibrate RUN_DIR``, then set ``train.temperature`` of the fine-tuning stages to the value printed.

What is computed: the run's last checkpoint's global model (the classifier Fed3R wrote; no client's personal
entries, no evaluation hooks), in eval mode, on every client's training examples as Fed3R's statistics pass
reads them (``task.train_batch``: no augmentation). Each client's message is the sum of its examples' CE for
every candidate tau and its example count (``functional.temperature.ce_sums``); the server adds them
(``mean_ce``). A refinement (``refine = N``) is a golden-section search between the grid minimum's neighbours,
one more federated pass per candidate (N + 2 passes). Written: ``RUN_DIR/temperature.json`` (the candidates,
their mean CE, the choice) and ``RUN_DIR/plots/temperature.png`` (the curve, Fig. 3.3's axes), replaced by a
later calibration; nothing is written unless every pass succeeded.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .functional.temperature import DEFAULT_GRID, ce_sums, check_grid, golden_section, mean_ce, select

RESULT_FILE = "temperature.json"
PLOT_FILE = "plots/temperature.png"


@dataclass
class Calibration:
    """A calibration's record: the checkpoint's round and stage, the candidates (grid, then refinement
    points, each with its mean training CE), the chosen tau and its CE, whether the minimum lies at an end of
    the grid (then not bracketed: widen the grid), the clients and examples summed."""

    round: int
    stage: str
    grid: list[float]
    grid_ce: list[float]
    refined: list[tuple[float, float]]
    tau: float
    ce: float
    at_edge: bool
    clients: int
    examples: int


@torch.no_grad()
def client_ce(model: torch.nn.Module, task: Any, client: int, taus: Sequence[float],
              batch_size: int = 512) -> tuple[torch.Tensor, int]:
    """One client's message: its training examples' CE sums for ``taus`` and its number of examples."""
    from .device import model_device, to_device

    n = task.num_train_examples(client)
    total = torch.zeros(len(taus), dtype=torch.float64)
    for s in range(0, n, batch_size):
        x, y = to_device(task.train_batch(client, torch.arange(s, min(n, s + batch_size))), model_device(model))
        total += ce_sums(model(x), y, taus)
    return total, n


def federated_ce(model: torch.nn.Module, task: Any, taus: Sequence[float], batch_size: int = 512) -> tuple[torch.Tensor, int]:
    """The mean training CE over all clients for each of ``taus`` (each client's sums added by the server),
    and the number of examples summed."""
    was = model.training
    model.eval()
    try:
        sums, counts = zip(*(client_ce(model, task, k, taus, batch_size) for k in range(task.num_clients)))
    finally:
        model.train(was)
    return mean_ce(sums, counts), int(sum(counts))


def calibrate(model: torch.nn.Module, task: Any, grid: Sequence[float] = DEFAULT_GRID, refine: int = 0,
              batch_size: int = 512) -> tuple[list[float], list[float], list[tuple[float, float]], float, float, bool, int]:
    """(grid, its mean CE, refinement points, tau, its CE, at_edge, examples) for ``model`` on ``task``'s
    clients: the grid's minimum, refined by ``refine`` golden-section steps when it is not at an end."""
    taus = check_grid(grid)
    if refine < 0:
        raise ValueError(f"refine = {refine}: expected a number of steps >= 0")
    ce, n = federated_ce(model, task, taus, batch_size)
    i = select(taus, ce)
    tau, best = taus[i], float(ce[i])
    at_edge = i in (0, len(taus) - 1)
    points: list[tuple[float, float]] = []
    if refine and not at_edge:
        def f(t: float) -> float:
            v = float(federated_ce(model, task, [t], batch_size)[0][0])
            points.append((t, v))
            return v

        t, v, _ = golden_section(f, taus[i - 1], taus[i + 1], refine)
        if v < best:
            tau, best = t, v
    return taus, [float(v) for v in ce], points, tau, best, at_edge, n


def calibrate_run(run_dir: str | Path, grid: Sequence[float] = DEFAULT_GRID, refine: int = 0) -> Calibration:
    """Calibrate the temperature on a run's last checkpoint (see the module) and write ``temperature.json`` and
    ``plots/temperature.png`` into the run (under its lock; nothing is written when anything fails)."""
    from .api import build_simulation
    from .crosseval import _load_checkpoint, check
    from .runs import RunDir, RunLock
    from .safe_write import atomic_write_text, check_output, check_run_dir

    run = RunDir(run_dir)
    if not (run.path / "config.json").is_file():
        raise FileNotFoundError(f"{run.path}: not a run directory (no config.json)")
    taus = check_grid(grid)  # bad values fail before the data is loaded
    if refine < 0:
        raise ValueError(f"--refine {refine}: expected a number of steps >= 0")
    check_run_dir(run.path)
    for name in (RESULT_FILE, PLOT_FILE):
        check_output(run.path / name, owner=run.path, exists_ok=True)
    with RunLock(run.path):
        checked = check(run, [])
        sim = build_simulation(checked.cfg)
        rnd, _ = _load_checkpoint(run, sim, client_state=False)
        task = sim.task
        if getattr(task.model_io, "family", None) != "classification":
            raise ValueError(f"{run.path}: calibrate needs a classification run (the task is {task.name!r})")
        grid_, ce, points, tau, best, at_edge, n = calibrate(sim.global_model, task, taus, refine,
                                                            checked.cfg.eval.batch_size)
        out = Calibration(rnd, sim.server.stage, grid_, ce, points, tau, best, at_edge, task.num_clients, n)
        png = temperature_png(out)
        (run.path / "plots").mkdir(exist_ok=True)
        from .safe_write import atomic_write_bytes

        atomic_write_bytes(run.path / PLOT_FILE, png)
        atomic_write_text(run.path / RESULT_FILE, json.dumps(asdict(out), indent=1) + "\n")
    return out


def temperature_png(cal: Calibration) -> bytes:
    """The mean training CE against tau (log axis), the grid as dots, refinement points as crosses, the choice
    marked: the thesis's Figs. 3.3 / 4.4."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 3.4), layout="constrained")
    ax.plot(cal.grid, cal.grid_ce, "o-", color="C0", label="grid")
    if cal.refined:
        t, v = zip(*cal.refined)
        ax.plot(t, v, "x", color="C1", label="golden-section")
    ax.plot([cal.tau], [cal.ce], "*", color="C3", markersize=13, label=f"chosen τ = {cal.tau:.4g}")
    ax.set_xscale("log")
    finite = [v for v in cal.grid_ce if math.isfinite(v)]
    if finite and max(finite) > 20 * max(min(finite), 1e-12):
        ax.set_yscale("log")
    ax.set_xlabel("softmax temperature τ")
    ax.set_ylabel("mean training cross-entropy")
    ax.set_title(f"temperature by minimum training CE (round {cal.round}, {cal.clients} clients)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    buf = io.BytesIO()
    fig.savefig(buf, dpi=110, format="png")
    plt.close(fig)
    return buf.getvalue()


__all__ = ["Calibration", "calibrate", "calibrate_run", "client_ce", "federated_ce", "temperature_png"]
