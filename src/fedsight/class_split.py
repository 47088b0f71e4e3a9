"""Local vs non-local class-wise accuracy of personalised models (thesis Sec. 4.3.5, Fig. 4.7).

Fig. 4.7 follows four random iNaturalist clients through full personalisation and plots, per client, "the
average classwise WMA of the local labels" and "of classes not present in the local client", "evaluated on the
original test set" (the global, FL test set), for FedAvg + FP(psi) and OLL(FedAvg) + FP(psi): FP biases the
classifier towards the client's classes over time, OLL does so at once (its non-local accuracy is 0 by
construction).

``eval.class_split = N`` reproduces it: N clients drawn once from the run seed (stream "class-split"; all of them
when N >= K) are evaluated at every evaluation round on the global test set, each on the model it is evaluated
with on its local test set (the global model plus its personal entries, under the stage's evaluation hooks: OLL's
mask, Ditto's personal model). For client k with training classes C_k:

* ``acc_local``: the mean over c in C_k of the accuracy on the test examples of class c (classes without test
  examples left out);
* ``acc_nonlocal``: the same over the classes not in C_k (undefined, left out of the mean over clients, for a
  client that holds every class with test examples).

Metrics: ``personal/acc_local_classes`` and ``personal/acc_nonlocal_classes``, the means over the N clients (of
those where each is defined), and each client's in the families ``personal/acc_local_classes/client<k>`` and
``personal/acc_nonlocal_classes/client<k>``; the run's plots get ``plots/class_split.png`` (one panel per client,
both curves against the round). Cost: N passes over the global test set per evaluation round. The mean over
classes is unweighted (a class-wise average, as the figure's caption says), not weighted by test examples.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

LOCAL = "personal/acc_local_classes"
NONLOCAL = "personal/acc_nonlocal_classes"
PLOT_FILE = "class_split.png"


def chosen_clients(seed: int, num_clients: int, n: int) -> tuple[int, ...]:
    """The ``n`` clients followed (all when ``n >= num_clients``), drawn once from (seed, "class-split"), sorted."""
    from .rng import np_rng

    if n <= 0:
        return ()
    if n >= num_clients:
        return tuple(range(num_clients))
    return tuple(sorted(int(c) for c in np_rng(seed, "class-split").choice(num_clients, size=n, replace=False)))


def split_accuracy(correct: torch.Tensor, count: torch.Tensor, local: torch.Tensor) -> tuple[float, float]:
    """(mean class-wise accuracy over the ``local`` classes, over the others) from per-class ``correct`` and
    ``count`` [C] and a boolean mask ``local`` [C]; classes with no test example are left out, and a side with no
    class left is NaN."""
    correct, count, local = correct.double().cpu(), count.double().cpu(), local.bool().cpu()
    has = count > 0
    acc = torch.where(has, correct / count.clamp(min=1), torch.zeros_like(correct))

    def mean(mask: torch.Tensor) -> float:
        m = mask & has
        return float(acc[m].mean()) if bool(m.any()) else math.nan

    return mean(local), mean(~local)


@torch.no_grad()
def class_counts(model: torch.nn.Module, task: Any, batch_size: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class correct predictions and examples [C] of ``model`` (eval mode, restored) on the global test set."""
    from .device import model_device, to_device

    was = model.training
    model.eval()
    c = task.num_classes
    correct, count = torch.zeros(c, dtype=torch.long), torch.zeros(c, dtype=torch.long)
    try:
        for x, y in task.eval_batches("test", batch_size):
            x, y = to_device(x, model_device(model)), to_device(y, model_device(model))
            pred = task.predict(model, x).argmax(1)
            y = y.long()
            count += torch.bincount(y.cpu(), minlength=c)
            correct += torch.bincount(y[pred == y].cpu(), minlength=c)
    finally:
        model.train(was)
    return correct, count


def summarize(per_client: Mapping[int, tuple[float, float]]) -> dict[str, float]:
    """The metrics row entries from {client: (acc_local, acc_nonlocal)}: the means over clients (NaN sides left
    out; a mean with no client left is not logged) and each client's value (NaN not logged)."""
    out: dict[str, float] = {}
    for i, key in enumerate((LOCAL, NONLOCAL)):
        vals = [v[i] for v in per_client.values() if not math.isnan(v[i])]
        if vals:
            out[key] = float(np.mean(vals))
    for cid in sorted(per_client):
        for i, key in enumerate((LOCAL, NONLOCAL)):
            if not math.isnan(per_client[cid][i]):
                out[f"{key}/client{cid}"] = per_client[cid][i]
    return out


def plot_class_split(rows: Sequence[Mapping[str, Any]], path: str | Path) -> Path | None:
    """``plots/class_split.png`` from the run's metrics rows: per client, its local-class (blue) and non-local
    (orange) class-wise accuracy against the round (Fig. 4.7's panels). None when no row has them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .reporting.plots import _save

    prefix = f"{LOCAL}/client"
    clients = sorted({int(k[len(prefix):]) for r in rows for k in r if k.startswith(prefix)})
    if not clients:
        return None
    cols = min(4, len(clients))
    nrows = math.ceil(len(clients) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.2 * cols, 2.6 * nrows), squeeze=False, sharey=True,
                             layout="constrained")
    # stage boundaries (dashed, named), as the run's curves.png marks them
    starts = [(r["round"], r["stage"]) for a, r in zip([None, *rows], rows)
              if "round" in r and "stage" in r and a is not None and a.get("stage") != r["stage"]]
    for ax, cid in zip(axes.flat, clients):
        for rnd, name in starts:
            ax.axvline(rnd - 0.5, color="0.5", linestyle="--", linewidth=0.8)
            ax.text(rnd - 0.4, 0.5, name, fontsize=7, color="0.4", rotation=90, ha="left", va="center",
                    transform=ax.get_xaxis_transform())
        for key, color, label in ((LOCAL, "C0", "local classes"), (NONLOCAL, "C1", "non-local classes")):
            pts = [(r["round"], r[f"{key}/client{cid}"]) for r in rows if f"{key}/client{cid}" in r and "round" in r]
            if pts:
                x, y = zip(*pts)
                ax.plot(x, y, "o-", color=color, label=label, markersize=3)
        ax.set_title(f"client {cid}", fontsize=9)
        ax.set_xlabel("round")
        ax.set_ylim(-0.03, 1.03)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(clients):]:
        ax.set_visible(False)
    axes[0, 0].set_ylabel("class-wise accuracy\n(global test set)")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle("accuracy on the client's own classes vs the others (thesis Fig. 4.7)", fontsize=10)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return _save(fig, path)


__all__ = ["LOCAL", "NONLOCAL", "chosen_clients", "class_counts", "plot_class_split", "split_accuracy", "summarize"]
