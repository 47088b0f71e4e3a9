"""Recipe components: the hooks a recipe part may implement, and the contexts they see.

A recipe is a composition of parts (DESIGN.md section 1): local objective terms, update transforms,
a client weighting, an aggregator, a server optimizer, parameter sharing and stages. A *component* is
one named object that may contribute to several of these slots (SCAFFOLD adds a gradient correction on
the client and a server-side control update) and owns its state through ``state_dict()`` /
``load_state_dict()``. Every hook is optional; the default does nothing.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..records import ClientResult


@dataclass
class ClientContext:
    """What a client-side hook sees during one client's local training."""

    client_id: int
    round: int
    model: nn.Module
    #: the received global values of the shared trainable parameters (read-only)
    global_params: dict[str, torch.Tensor]
    num_examples: int
    #: the run seed; derive random streams with ``fedsight.rng`` from (seed, purpose, round, client)
    seed: int = 0
    #: this client's persistent state (see ``ClientState``); survives across rounds and resumes
    state: "ClientState | None" = None
    #: total local steps this client takes in this round
    num_steps: int = 0
    #: the local training settings (``fedsight.client.LocalTraining``: lr, momentum, batch size, ...)
    local: Any = None
    #: what each component's ``server_broadcast`` sent this round, by component name
    broadcast: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    step: int = 0
    #: per-client scratch space for components during one local training
    scratch: dict[str, Any] = field(default_factory=dict)
    #: the task (``fedsight.tasks.base.Task``), for components that need extra passes over the
    #: client's data (Elastic's sensitivity sample): ``task.train_batch(client_id, positions)``
    task: Any = None
    #: names of the shared buffers uploaded with the result (BatchNorm statistics)
    shared_buffers: list[str] = field(default_factory=list)
    #: parameters that do not train this stage (``train.freeze``, or every one for a statistics pass)
    frozen: set[str] = field(default_factory=set)
    #: the whole global model state this round (read-only): the proximal target of Ditto, which in a
    #: stage that shares nothing (full personalisation) is the model the federated stages produced
    global_state: dict[str, torch.Tensor] = field(default_factory=dict)
    #: state keys kept per client (not shared) in this stage
    personal_keys: list[str] = field(default_factory=list)
    #: the model's per-example forward cost (``fedsight.cost.ModelCost``), None if unknown
    cost: Any = None
    #: estimated FLOPs spent so far by this client in this round (trainers add to it)
    flops: float = 0.0


class ClientState:
    """One client's view of the per-client state store: ``load(key)`` / ``save(key, tensors)``.

    Keys are component-chosen names (e.g. ``"scaffold"``). State lives on disk under the run
    directory and is only read for sampled clients, so memory does not grow with the number of
    clients; it is checkpointed with the run. Saves are held until the engine accepts the client's
    update (``commit``): a rejected (non-finite) update leaves no trace in the client's state.
    """

    def __init__(self, store: Any, client: int, round: int):
        self._store, self.client, self.round = store, client, round
        self._pending: dict[str, dict[str, torch.Tensor]] = {}

    def load(self, key: str) -> dict[str, torch.Tensor] | None:
        if key in self._pending:
            return self._pending[key]
        return self._store.get(key, self.client)

    def save(self, key: str, tensors: dict[str, torch.Tensor]) -> None:
        self._pending[key] = {k: v.detach().clone() for k, v in tensors.items()}

    @property
    def pending(self) -> dict[str, dict[str, torch.Tensor]]:
        return self._pending

    def commit(self) -> None:
        """Write the held saves to the store (the engine calls this for an accepted update)."""
        for key, tensors in self._pending.items():
            self._store.put(key, self.client, self.round, tensors)
        self._pending.clear()


@dataclass
class ServerContext:
    """What a server-side hook sees in one round."""

    round: int
    model: nn.Module
    num_clients: int
    sampled: list[int]
    seed: int = 0
    #: total rounds of the run (decay schedules, e.g. FedVSR's exponent)
    rounds: int = 0
    #: the task (server-side passes on server-held data, e.g. FedVG's validation gradients)
    task: Any = None
    #: scalars a server-side part reports for this round; merged into the round's metrics row
    metrics: dict[str, float] = field(default_factory=dict)


class Component:
    """Base class of multi-slot recipe components. Override only the hooks you need."""

    name: str = "component"

    # -- client side ---------------------------------------------------------------------------
    def client_start(self, ctx: ClientContext) -> None:
        """Before the first local step (e.g. load this client's state)."""

    def outputs(self, ctx: ClientContext, outputs: torch.Tensor) -> torch.Tensor:
        """Transform the model outputs before the loss (OLL masks the classes a client does not hold)."""
        return outputs

    def loss_term(self, ctx: ClientContext, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """An extra term added to the task loss (local objective), or None."""
        return None

    def after_backward(self, ctx: ClientContext) -> None:
        """Transform gradients in place after ``backward()`` and before the optimizer step."""

    def client_end(self, ctx: ClientContext, result: ClientResult) -> None:
        """Transform the upload or attach named extra tensors to ``result.extras``."""

    # -- server side ---------------------------------------------------------------------------
    def server_broadcast(self, sctx: "ServerContext") -> dict[str, torch.Tensor] | None:
        """Tensors sent to every sampled client with the global model this round (e.g. SCAFFOLD's
        server control variate); the client sees them as ``ctx.broadcast[self.name]``."""
        return None

    def aggregator(self) -> Any:
        """An ``Aggregator`` this component requires (Elastic, FedNova), or None. Claiming the slot
        together with a non-default ``recipe.aggregator`` or another component is a config error."""
        return None

    def weighting(self) -> Any:
        """A ``ClientWeighting`` this component requires, or None (same exclusivity rule)."""
        return None

    def trainer(self) -> Any:
        """A ``fedsight.client.Trainer`` (the client's local procedure) this component requires, or
        None for plain SGD (same exclusivity rule)."""
        return None

    def sample(self, round: int, num_clients: int, m: int, seed: int) -> list[int] | None:
        """The clients of ``round`` if this component chooses them (Fed3R visits each client once), or
        None for the engine's uniform sampling."""
        return None

    def adapt_model(self, model: nn.Module, seed: int) -> None:
        """Change a freshly built model's structure in place, once, for the whole run (Fed3R-RF puts a
        random-feature map in front of the classifier). Must be deterministic in ``seed``."""

    def eval_context(self, model: nn.Module, sim: Any, split: str | int) -> contextlib.AbstractContextManager:
        """Wraps the evaluation of ``model`` on ``split`` (``"test"`` or a client id), like
        ``Sharing.eval_context`` (OLL masks non-local classes, Ditto swaps in the personal model).
        Must restore the model on exit."""
        return contextlib.nullcontext()

    def server_round_end(self, sctx: ServerContext, results: list[ClientResult], weights: torch.Tensor) -> None:
        """After aggregation and the server optimizer step (e.g. update server-side state, or apply a
        correction to ``sctx.model``'s parameters as FedDyn does). ``weights`` are normalised."""

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"component {self.name!r} has no state but got keys {sorted(state)}")
