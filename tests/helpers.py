"""Shared builders for engine/CLI tests: a tiny but real digits federation."""

from __future__ import annotations

import copy
from typing import Any

TINY: dict[str, Any] = {
    "seed": 0,
    # no figures: drawing them is most of a tiny run's time; tests of the plots set run.plots
    "run": {"name": "tiny", "output_dir": "runs", "checkpoint_keep": 0, "plots": False},
    "data": {"name": "digits"},
    "partition": {"name": "dirichlet", "alpha": 0.5, "num_clients": 6, "local_test_fraction": 0.2},
    "model": {"name": "cnn", "channels": [8], "hidden": 16},
    "train": {"epochs": 1, "batch_size": 32, "lr": 0.1},
    "server": {"rounds": 4, "clients_per_round": 3},
    # round 0 (the initial model's evaluation, on by default) is tested where it is the point
    # (test_engine, test_conformance, the Flower adapter): elsewhere it would only cost time
    "eval": {"every": 2, "initial": False},
}


def tiny(**over: Any) -> dict[str, Any]:
    """TINY with dotted-key overrides, e.g. tiny(**{"server.rounds": 2})."""
    from fedsight.config import set_path

    raw = copy.deepcopy(TINY)
    for k, v in over.items():
        set_path(raw, k.split("."), v)
    return raw


def pipeline_config(**over: Any) -> dict[str, Any]:
    """The thesis's phases in one config: Fed3R (2 rounds of 3 clients) -> FT(phi) -> FedSim(psi) -> FP(psi)
    -> OLL, one round each after Fed3R."""
    raw = tiny(**{"server.rounds": 6, "server.clients_per_round": 3, "eval.every": 1, **over})
    raw["stages"] = [
        {"name": "fed3r", "rounds": 2, "recipe": {"components": ["fed3r"]}},  # 6 clients, 3 a round
        {"name": "ft", "rounds": 1, "train": {"temperature": 0.1, "freeze": ["head"], "lr": 0.01}},
        {"name": "fedsim", "rounds": 1, "train": {"temperature": 0.1}, "recipe": {"sharing": {"name": "personal", "part": "head"}}},
        {"name": "fp", "rounds": 1, "train": {"temperature": 0.1, "freeze": ["backbone"]}, "recipe": {"sharing": "local"}},
        {"name": "oll", "rounds": 1, "train": {"temperature": 0.1, "lr": 0.01}, "server": {"clients_per_round": 6},
         "recipe": {"sharing": "local", "components": ["oll"]}},
    ]
    return raw


def poisoned_config(**over: Any) -> tuple[dict[str, Any], list[int]]:
    """A 4-round run whose middle stage (2 rounds) has every client upload an update scaled past float32's
    range (the registered ``attack`` component, scale 1e39: inf), so every update of those rounds is
    non-finite and rejected; returns the config and those rounds, read from its stages."""
    raw = tiny(**{"partition.num_clients": 3, "server.clients_per_round": 2, "server.rounds": 4, "eval.every": 1,
                  "eval.local": False, "engine.threads": 1, **over})
    attack = {"name": "attack", "fraction": 1.0, "kind": "scale", "scale": 1e39}
    raw["stages"] = [{"name": "clean", "rounds": 1}, {"name": "poisoned", "rounds": 2, "recipe": {"components": [attack]}},
                     {"name": "after", "rounds": 1}]
    first = 1 + sum(st["rounds"] for st in raw["stages"][:1])
    return raw, list(range(first, first + raw["stages"][1]["rounds"]))


# -- a toy task for hand-checkable algorithm tests -----------------------------------------------

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from fedsight.models.base import FedModel, ModelIO  # noqa: E402
from fedsight.tasks.base import Task  # noqa: E402
from fedsight.tasks.classification import classification_metrics  # noqa: E402


class ToyLinear(FedModel):
    """Softmax regression: identity backbone (on flat features), linear head."""

    def __init__(self, dim: int, classes: int, bn: bool = False):
        super().__init__()
        self.backbone = nn.BatchNorm1d(dim) if bn else nn.Identity()
        self.head = nn.Linear(dim, classes)
        self.feature_dim = dim


class ToyTask(Task):
    """K clients, each with a few random points in R^dim and labels in [classes]; batches are whole
    client datasets when batch_size >= n, so one local step is one full-batch gradient step."""

    name = "toy"

    def __init__(self, sizes=(4, 6, 5), dim=3, classes=3, seed=0, bn=False, val=None):
        #: optional server-held validation points (x, y), served as eval_batches("val") (FedVG tests)
        self.val = val
        g = torch.Generator().manual_seed(seed)
        self.xs = [torch.randn(n, dim, generator=g) for n in sizes]
        self.ys = [torch.randint(0, classes, (n,), generator=g) for n in sizes]
        self.test_x = torch.randn(8, dim, generator=g)
        self.test_y = torch.randint(0, classes, (8,), generator=g)
        self.dim, self.classes, self.bn = dim, classes, bn
        self.metrics = classification_metrics()

    @property
    def num_clients(self):
        return len(self.xs)

    def build_model(self):
        return ToyLinear(self.dim, self.classes, self.bn)

    @property
    def num_classes(self):
        return self.classes

    def client_labels(self, client):
        return self.ys[client].numpy()

    def num_train_examples(self, client):
        return len(self.ys[client])

    def num_test_examples(self, client):
        return 0

    def train_batch(self, client, positions):
        return self.xs[client][positions], self.ys[client][positions]

    def loss(self, outputs, targets):
        return F.cross_entropy(outputs, targets)

    @property
    def model_io(self):
        return ModelIO("classification", in_channels=self.dim, num_outputs=self.classes)

    def update_metrics(self, state, outputs, targets):
        acc, loss, *_ = self.metrics.metrics
        loss.update(state, F.cross_entropy(outputs, targets, reduction="sum"), len(targets))
        acc.update(state, (outputs.argmax(1) == targets).sum(), len(targets))

    def eval_batches(self, split, batch_size=512):
        """The evaluation points (the shared test points for every split; ``val`` for "val" when
        given), in batches."""
        x, y = self.val if split == "val" and self.val is not None else (self.test_x, self.test_y)
        for s in range(0, len(x), batch_size):
            yield x[s : s + batch_size], y[s : s + batch_size]


def toy_sim(*, components=(), aggregator=None, weighting=None, server_opt=None, sharing=None, task=None,
            lr=0.1, steps=1, batch_size=1000, momentum=0.0, clients_per_round=None, rounds=1, seed=0, steps_range=None,
            **local_kw):
    """A Simulation over ToyTask built from recipe objects (no config). Defaults: FedAvg, full-batch
    single-step local SGD, every client every round."""
    from fedsight import registry as R
    from fedsight.training.local import LocalTraining
    from fedsight.engine.simulation import Recipe, Schedule, Simulation

    task = task or ToyTask()
    recipe = Recipe(
        weighting=weighting or R.build(R.WEIGHTINGS, "data_size"),
        aggregator=aggregator or R.build(R.AGGREGATORS, "mean"),
        server_optimizer=server_opt or R.build(R.SERVER_OPTIMIZERS, "sgd"),
        sharing=sharing or R.build(R.SHARING, "global"),
        components=list(components),
    )
    claims = [c.trainer() for c in components if c.trainer() is not None]
    if claims:
        recipe.trainer = claims[0]
    local = LocalTraining(batch_size=batch_size, lr=lr, epochs=None, steps=None if steps_range else steps,
                          steps_range=steps_range, momentum=momentum, **local_kw)
    schedule = Schedule(rounds=rounds, clients_per_round=clients_per_round or task.num_clients, eval_local=False,
                        eval_initial=False)
    return Simulation(task, recipe, local, schedule, seed)


def close(a, b, atol=1e-6, rtol=1e-5):
    """np.testing.assert_allclose on tensors (torch.testing's first call costs seconds of imports)."""
    import numpy as np

    np.testing.assert_allclose(np.asarray(a.detach()), np.asarray(b.detach()), atol=atol, rtol=rtol)
