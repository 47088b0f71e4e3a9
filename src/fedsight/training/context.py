"""What recipe hooks see: the client, server and evaluation contexts, and a client's persistent state.

These types sit below ``fedsight.recipe`` (whose parts implement the hooks) and below the engines (which
fill them in), so recipe parts never import an engine and an engine never hands a hook itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from ..device import model_device, to_device


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
    #: this round's local training settings (``fedsight.training.local.LocalTraining``: lr, momentum, batch
    #: size, ...); ``local.lr`` is already the round's rate under a step or cosine ``train.lr_schedule``
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
    #: the inputs of the current batch (set before the loss hooks: a teacher's pseudo-labels need them)
    inputs: Any = None
    #: ``[privacy] noise``: "simulated" (noise streams from the seed) or "secret" (from the client's secret,
    #: ``state.secret()``); components draw their noise with ``fedsight.secret.noise_generator``
    noise: str = "simulated"

    def batch(self, positions: torch.Tensor) -> tuple[Any, Any]:
        """The client's training examples at ``positions`` (inputs, targets), on the model's device."""
        return to_device(self.task.train_batch(self.client_id, positions), model_device(self.model))


class ClientState:
    """One client's view of the per-client state store: ``load(key)`` / ``save(key, tensors)``.

    Keys are component-chosen names (e.g. ``"scaffold"``). State lives on disk under the run
    directory and is only read for sampled clients, so memory does not grow with the number of
    clients; it is checkpointed with the run. ``load`` returns tensors on ``device`` (the model's), the
    store keeps CPU copies. Saves are held until the engine accepts the client's update (``commit``): a
    rejected (non-finite) update leaves no trace in the client's state.
    """

    def __init__(self, store: Any, client: int, round: int, device: torch.device | str = "cpu"):
        self._store, self.client, self.round = store, client, round
        self.device = torch.device(device)
        self._pending: dict[str, dict[str, torch.Tensor]] = {}
        self._always: set[str] = set()

    def load(self, key: str) -> dict[str, torch.Tensor] | None:
        if key in self._pending:
            return self._pending[key]
        got = self._store.get(key, self.client)
        return None if got is None else to_device(got, self.device)

    def secret(self) -> bytes:
        """This client's secret (32 bytes from the OS CSPRNG, drawn once and kept in the store's private folder;
        ``ClientStateStore.secret``): what its noise generators are seeded from under ``[privacy] noise =
        "secret"``. Never upload it, log it or put it in a metric."""
        return self._store.secret(f"client-{self.client:07d}")

    def shared_secret(self, name: str) -> bytes:
        """A secret every client of the store shares (the watermark key): only a store holding every client
        (in-process) has one; a single client's store (a Flower node) raises ``ConfigError``."""
        from ..errors import ConfigError

        if getattr(self._store, "one_client", False):
            raise ConfigError(f"{name}: a key shared by the clients cannot be drawn on one node; give every node the "
                              "same key file (key_file, `fedsight etlc keygen -o FILE`)")
        return self._store.secret(name)

    def save(self, key: str, tensors: dict[str, torch.Tensor], always: bool = False) -> None:
        """Hold ``tensors`` under ``key`` until the engine accepts the update; ``always``: keep them even if the
        update is rejected (what a client must never forget, such as the privacy it spent)."""
        self._pending[key] = {k: v.detach().clone() for k, v in tensors.items()}
        if always:
            self._always.add(key)

    @property
    def pending(self) -> dict[str, dict[str, torch.Tensor]]:
        return self._pending

    def commit(self, only_always: bool = False) -> None:
        """Write the held saves to the store (the engine calls this for an accepted update; for a rejected one
        with ``only_always``, which writes only the saves marked ``always``)."""
        for key, tensors in self._pending.items():
            if not only_always or key in self._always:
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
    #: the run's facts: named tensors a server-side part establishes for the parts of later rounds and
    #: stages (LADD's clients' styles and clusters); checkpointed with the server (``Server.facts``)
    facts: dict[str, torch.Tensor] = field(default_factory=dict)
    #: events a server-side part records this round (e.g. a clipped update); appended to the round's events
    events: list[dict[str, Any]] = field(default_factory=list)



@dataclass(frozen=True)
class UploadContext:
    """What the server knows about a round's replies before any arrives: what ``Component.extras_spec``
    declares the clients' extra uploads from (never from a reply)."""

    round: int
    #: the global model and its state (read, never write); ``state`` holds the shapes and dtypes
    model: nn.Module
    state: Any
    #: the stage's shared trainable entries (``ClientContext.global_params`` on the client)
    shared_params: Sequence[str]
    #: whether the stage's trainer trains: every built-in training trainer ends with ``make_result``, which runs
    #: each component's ``client_end``; a statistics pass (Fed3R, LADD's styles) uploads its own trainer's
    #: group only
    trains: bool
    #: the stage's ``LocalTraining`` (``local.at_round(round)`` is what the clients see as ``ctx.local``)
    local: Any
    num_clients: int
    seed: int = 0
    task: Any = None
    #: whether the replies carry shares of a secure sum (``fedsight.flower.secagg``: each client of a statistics
    #: round: the group's summed statistics ride on its first reply, zeros on the others; checked as a sum there)
    secure_sum: bool = False

    def shared_spec(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of every shared trainable entry of the global model."""
        return {k: (tuple(self.state[k].shape), self.state[k].dtype) for k in self.shared_params}


class StateReader(Protocol):
    """Read access to the per-client state (``fedsight.state.ClientStateStore``)."""

    def get(self, key: str, client: int) -> dict[str, torch.Tensor] | None: ...

    def clients(self, key: str) -> list[int]: ...


@dataclass
class EvalContext:
    """What an evaluation hook (``Sharing.eval_context``, ``Component.eval_context``) sees: the split
    being evaluated and read access to what the run knows about its clients. It replaces handing hooks
    the engine itself, so the same hook runs in-process and on the Flower server."""

    task: Any
    #: ``"test"`` (the global test set), a client id (its local test set) or a server-held split name
    split: str | int
    batch_size: int
    #: state keys kept per client in this stage (FedBN's norm layers, personal heads)
    personal_keys: Sequence[str] = ()
    #: the shared trainable parameters of this stage (empty: nothing is shared)
    shared_params: Sequence[str] = ()
    #: per-client state: the clients' personal entries (key ``"personal"``), Ditto's models, ...
    store: StateReader | None = None
    #: evaluate only these examples of the split (indices into it, e.g. one domain's images); None: all
    subset: Any = None
    #: the run's facts as the server knows them (``ServerContext.facts``); empty on a client's side
    facts: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def is_global_test(self) -> bool:
        """Whether the split is a global test set (``"test"`` or ``"test_<name>"``), which belongs to no
        client."""
        return isinstance(self.split, str) and (self.split == "test" or self.split.startswith("test_"))
