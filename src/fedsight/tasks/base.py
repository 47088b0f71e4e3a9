"""What every task provides to the algorithm-agnostic client loop, server and evaluation.

Algorithms never special-case a task: the local loop asks the task for batches and a loss, evaluation
asks it for a mergeable metric state, and a method that needs a task quantity (FedVG's validation loss)
gets it from here.

A task declares, without loading any data (``TaskSpec``, from its registry entry's ``spec``):

* its metrics (``fedsight.metrics.MetricSpec``: key and direction) and its primary metric, whose
  per-client values give WMA and the worst-10% mean; the run directory records them and reporting reads
  directions from there, never from metric names;
* its capabilities (``fedsight.capabilities``): class labels, class logits, server-held splits, images
  as outputs, visuals, ... Config validation checks them against what the recipe needs.

A task instance serves data by client and split:

* training: ``train_batch(client, positions)`` for index batches into the client's examples, or
  ``train_batches`` for a whole pass (tasks over files on disk prefetch there, so decoding overlaps
  compute);
* evaluation: ``eval_batches(split)`` with ``split`` = ``"test"`` (the global test set), a client id (its
  local test set) or a server-held split name (``"val"``, ``"pretrain"``); ``eval_state`` runs a model
  over a split and returns a ``MetricState``; states of several clients merge (``metrics.merge``) and
  ``metrics.compute`` turns a state into values.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from ..device import model_device, to_device
from ..metrics import MetricSet, MetricSpec, MetricState
from ..models.base import ModelIO


@dataclass(frozen=True)
class TaskSpec:
    """What a task declares before any data is loaded."""

    metrics: tuple[MetricSpec, ...]
    primary: str
    provides: frozenset[str]


class Task(ABC):
    name: ClassVar[str] = "task"
    #: capabilities this task provides (``fedsight.capabilities``)
    provides: ClassVar[frozenset[str]] = frozenset()
    #: the task's metrics (set by subclasses in ``__init__``)
    metrics: MetricSet
    #: whether ``loss`` of a batch is the mean over its examples of ``loss`` of each example alone (a cross-entropy,
    #: an L1 over same-sized images; not a segmentation loss averaged over the valid pixels of the whole batch):
    #: vectorised training then pads a short batch and masks the padding, so unequal clients still train in one
    #: call per step (``fedsight.training.vectorized``)
    loss_is_example_mean: ClassVar[bool] = False

    @property
    def primary_metric(self) -> str:
        return self.metrics.primary

    # -- model ------------------------------------------------------------------------------------

    @property
    @abstractmethod
    def model_io(self) -> ModelIO:
        """What the model factory needs to know about inputs and outputs."""

    @abstractmethod
    def build_model(self) -> nn.Module:
        """A fresh model; initialisation draws from torch's global RNG (seeded by the engine)."""

    # -- clients ----------------------------------------------------------------------------------

    @property
    @abstractmethod
    def num_clients(self) -> int: ...

    @abstractmethod
    def num_train_examples(self, client: int) -> int: ...

    @abstractmethod
    def num_test_examples(self, client: int) -> int: ...

    @abstractmethod
    def train_batch(self, client: int, positions: torch.Tensor) -> tuple[Any, Any]:
        """Inputs and targets of the client's training examples at ``positions`` (0..n_k-1)."""

    def train_batches(
        self, client: int, batches: Iterable[torch.Tensor], *, seed: int = 0, round: int = 0
    ) -> Iterator[tuple[Any, Any]]:
        """``train_batch`` for each index batch, in order (a task may prefetch ahead here; any
        randomness it draws must come from streams keyed by (seed, round, client, step))."""
        for positions in batches:
            yield self.train_batch(client, positions)

    def example_losses(self, outputs: Any, targets: Any) -> torch.Tensor:
        """Each example's loss (B,), for a task whose ``loss`` is their mean (``loss_is_example_mean``): vectorised
        training then computes every client's objective in one call (``fedsight.training.vectorized``) instead of
        one vmapped call per client. A task without it (the default) is served by vmap; a class that overrides
        ``loss`` must override this too, or it is not used."""
        raise NotImplementedError(f"task {self.name!r} gives no per-example loss")

    def stacks_train_batches(self) -> bool:
        """Whether ``train_batch_stack`` serves this task's training batches (default: no)."""
        return False

    def train_batch_stack(self, clients: Sequence[int], positions: torch.Tensor) -> tuple[Any, Any]:
        """``train_batch(clients[i], positions[i])`` of every i (``positions``: (k, B), on the CPU) as one gather,
        stacked along a new first dimension: the batches ``train_batches`` yields, with no random number drawn.
        Vectorised training fetches a step's batches so when ``stacks_train_batches()`` says the task can
        (in-memory tensors), instead of client by client."""
        raise NotImplementedError(f"task {self.name!r} fetches training batches one client at a time")

    def example_input(self) -> Any:
        """One training input (a batch of one) of some client: the model-cost probe's input."""
        for c in range(self.num_clients):
            if self.num_train_examples(c):
                return self.train_batch(c, torch.tensor([0]))[0]
        raise ValueError(f"task {self.name!r}: no client holds a training example")

    @abstractmethod
    def loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        """Mean task loss of a batch."""

    # -- evaluation -------------------------------------------------------------------------------

    @abstractmethod
    def eval_batches(self, split: str | int, batch_size: int = 512) -> Iterator[tuple[Any, Any]]:
        """(inputs, targets) of an evaluation split (``"test"``, a client id, or a server-held split
        such as ``"val"``) in batches of at most ``batch_size``, in a fixed order. Methods that need a
        differentiable task loss on server data (FedVG) use this with ``loss``."""

    def _batches(self, split: str | int, batch_size: int, subset: Any) -> Iterator[tuple[Any, Any]]:
        """``eval_batches`` of the whole split, or of ``subset`` (indices into the split; a task that can
        evaluate part of a split takes ``subset=`` in ``eval_batches``)."""
        if subset is None:
            return self.eval_batches(split, batch_size)
        return self.eval_batches(split, batch_size, subset=subset)  # type: ignore[call-arg]

    def eval_inputs(self, split: str | int, batch_size: int = 512, subset: Any = None) -> Iterator[Any]:
        """The model inputs of an evaluation split (or of ``subset`` of it), in the order ``eval_state`` sees
        them. Used by test-time adaptation of normalisation statistics (SiloBN/FedBN ``test_stats="fresh"``)."""
        for x, _ in self._batches(split, batch_size, subset):
            yield x

    @abstractmethod
    def update_metrics(self, state: MetricState, outputs: Any, targets: Any) -> None:
        """Fold one evaluated batch into ``state``."""

    def predict(self, model: nn.Module, inputs: Any) -> Any:
        """The model's evaluation output for a batch (tasks may chunk or post-process here)."""
        return model(inputs)

    @torch.no_grad()
    def eval_state(self, model: nn.Module, split: str | int, batch_size: int, subset: Any = None) -> MetricState:
        """The metric state of ``model`` (in eval mode, restored after) over ``split`` (or ``subset`` of it)."""
        was_training = model.training
        model.eval()
        device = model_device(model)
        state = self.metrics.new_state()
        try:
            for x, y in self._batches(split, batch_size, subset):
                x, y = to_device(x, device), to_device(y, device)
                self.update_metrics(state, self.predict(model, x), y)
        finally:
            model.train(was_training)
        return state

    def evaluate(self, model: nn.Module, split: str | int, batch_size: int = 512) -> dict[str, float]:
        """The metric values of ``model`` on ``split``."""
        return self.metrics.compute(self.eval_state(model, split, batch_size))

    # -- description and placement ----------------------------------------------------------------

    def data_description(self) -> dict[str, Any]:
        """What ``RUN_DIR/partition.json`` records (per-client key counts, server-held splits)."""
        return {}

    @property
    def test_splits(self) -> tuple[str, ...]:
        """The global evaluation splits: ``"test"`` (metrics ``test/*``) and extra named test sets such as
        ``"test_unseen"`` (metrics ``test_unseen/*``, e.g. FedDrive's unseen domains)."""
        return ("test",)

    def setup_cost(self) -> dict[str, float]:
        """Bytes that cross the network once, before round 1 (``up_bytes``, ``down_bytes``: a style bank the
        clients share); charged to round 1's cost."""
        return {}

    def to(self, device: torch.device) -> "Task":
        """Move data the task holds in memory to ``device`` (small in-memory pools); tasks over files
        keep their data on the CPU and batches move per step."""
        return self


class ClientExamples:
    """The sizes of a task whose clients are ``self.clients`` (``ClientSplit``: train and local-test positions)
    and whose client k trains on the rows ``client_rows(k)`` (images, instances, clip windows): list it before
    ``Task`` in the bases. The rows of every client are one tensor and offsets (``pack_rows``), not a tensor a
    client."""

    clients: Sequence[Any]
    _rows: torch.Tensor
    _row_offsets: np.ndarray

    def pack_rows(self, rows: Sequence[Any], what: str) -> None:
        """Keep each client's training rows (``rows[k]``: anything ``torch.as_tensor`` takes, int64), packed; a
        client without any is an error naming ``what`` it lacks."""
        sizes = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        empty = np.flatnonzero(sizes == 0)
        if len(empty):
            raise ValueError(f"client {int(empty[0])} has no {what}")
        self._rows = torch.cat([torch.as_tensor(np.asarray(r), dtype=torch.long) for r in rows])
        self._row_offsets = np.concatenate([[0], np.cumsum(sizes)])

    def client_rows(self, client: int) -> torch.Tensor:
        return self._rows[self._row_offsets[client]:self._row_offsets[client + 1]]

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    def num_train_examples(self, client: int) -> int:
        return int(self._row_offsets[client + 1] - self._row_offsets[client])

    def num_test_examples(self, client: int) -> int:
        return len(self.clients[client].test)


def component_params(spec: Any, drop: Sequence[str] = ()) -> dict[str, Any]:
    """A validated component spec's own parameters (without ``name`` and ``drop``)."""
    return {k: v for k, v in spec.model_dump().items() if k != "name" and k not in drop}


def local_summary(
    values: Sequence[float], counts: Sequence[int], higher_is_better: bool = True, worst_fraction: float = 0.1
) -> dict[str, float]:
    """WMA = sum_k (n_k^test / n^test) m_k (thesis eq. 4.4) and the mean over the worst
    ceil(worst_fraction * K) clients (the lowest values when higher is better, the highest otherwise),
    over clients with a non-empty local test set."""
    pairs = [(float(v), int(n)) for v, n in zip(values, counts, strict=True) if n > 0]
    if not pairs:
        return {}
    total = sum(n for _, n in pairs)
    wma = sum(v * n for v, n in pairs) / total
    k = max(1, math.ceil(worst_fraction * len(pairs)))
    worst = sorted((v for v, _ in pairs), reverse=not higher_is_better)[:k]
    return {"wma": wma, "worst10": sum(worst) / len(worst)}
