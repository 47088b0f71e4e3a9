"""What a run is made of (recipes, stages, the schedule) and what one round's server and clients agree on.

Shared by both halves of a round (``engine.server.Server`` and ``engine.client_runtime.ClientRuntime``)
and by every backend that connects them (in-process, Flower).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from ..records import ClientResult
from ..rng import np_rng
from ..training import ClientContext, Component, ServerContext
from ..training.local import SGD_TRAINER, LocalTraining, Trainer, constant_keys, frozen_keys
from .contract import FiniteSeal


@dataclass
class Recipe:
    weighting: Any
    aggregator: Any
    server_optimizer: Any
    sharing: Any
    components: list[Component] = field(default_factory=list)
    #: the clients' local procedure (plain SGD unless a component claims the slot)
    trainer: Trainer = SGD_TRAINER


@dataclass
class Stage:
    """A phase of a run: its own recipe and local training, up to global round ``end_round``
    (inclusive). The global model and the per-client state carry over from one stage to the next."""

    name: str
    end_round: int
    recipe: Recipe
    local: LocalTraining
    clients_per_round: int | None = None  # None: the schedule's


@dataclass(frozen=True)
class Schedule:
    rounds: int
    clients_per_round: int
    eval_every: int = 1
    #: FedDrive's ``avg_last_100`` window (``eval.last_rounds``, ``eval.last_every``; 0: none)
    eval_last_rounds: int = 0
    eval_last_every: int = 5
    eval_batch_size: int = 512
    eval_local: bool = True
    #: evaluate the initial model as round 0 (``eval.initial``)
    eval_initial: bool = True
    #: a round with fewer accepted updates is not aggregated (``too_few_clients`` and ``round_skipped`` events)
    min_clients: int = 1
    #: simulated client failure in-process (``engine.failures``): dropout probability, speed spread, deadline
    dropout: float = 0.0
    speed_sigma: float = 0.0
    deadline: float | None = None
    #: ``eval.select = "best"``: the validation metric the best global model is kept by, and its direction
    #: (``fedsight.model_selection``); None keeps the last model only
    select_metric: str | None = None
    select_higher: bool = True
    #: ``eval.class_split``: the clients whose accuracy on the global test set is split by their own classes
    #: (``fedsight.class_split``, thesis Fig. 4.7)
    class_split: tuple[int, ...] = ()


def clients_per_round(num_clients: int, count: int | None, fraction: float | None) -> int:
    if count is not None:
        return count
    if fraction is not None:
        return max(1, round(fraction * num_clients))
    return num_clients


def sample_clients(seed: int, round: int, num_clients: int, m: int, secret: bytes | None = None) -> list[int]:
    """m distinct clients, uniformly, from the stream ("sample", round); with ``secret`` (the server's, from the OS
    CSPRNG: ``fedsight.secret``) from that secret's stream ("sample", round) instead, which no party holding the
    seed can regenerate (central DP's amplification by sampling assumes a secret sample)."""
    if m >= num_clients:
        return list(range(num_clients))
    if secret is not None:
        from ..secret import secret_bytes

        rng = np.random.default_rng(int.from_bytes(secret_bytes(secret, 32, "sample", round), "little"))
    else:
        rng = np_rng(seed, "sample", round)
    return sorted(int(c) for c in rng.choice(num_clients, size=m, replace=False))


def build_models(task: Any, stages: Sequence[Stage], seed: int, count: int) -> list[nn.Module]:
    """``count`` fresh models of ``task``, built one after another from torch's global RNG (seed it
    first), then adapted, in that order, by every component of the stages (Fed3R-RF's head)."""
    models = [task.build_model() for _ in range(count)]
    for c in {id(c): c for st in stages for c in st.recipe.components}.values():
        for m in models:
            c.adapt_model(m, seed)
    return models


def stage_of_round(stages: Sequence[Stage], r: int) -> int:
    return next(i for i, st in enumerate(stages) if r <= st.end_round)


@dataclass(frozen=True)
class StageLayout:
    """Which state entries play which part in a stage, read from the model's structure and the stage's
    sharing and freezing (the same on the server and on every client: same model, same stage)."""

    #: parameters that do not train (``train.freeze``, or every one for a statistics pass)
    frozen: frozenset[str]
    #: entries no client can change (frozen parameters, statistics of frozen norm layers)
    constant: frozenset[str]
    #: shared trainable parameters: their deltas are uploaded and aggregated
    shared_params: tuple[str, ...]
    #: shared buffers that change (BatchNorm statistics): uploaded and averaged
    shared_buffers: tuple[str, ...]
    #: entries kept per client (FedBN's norm layers, personal heads)
    personal_keys: tuple[str, ...]


def stage_layout(model: nn.Module, stage: Stage) -> StageLayout:
    shared = stage.recipe.sharing.shared_keys(model)
    gparams = dict(model.named_parameters())
    if stage.recipe.trainer.trains:
        frozen = frozen_keys(model, stage.local.freeze)
    else:  # a statistics pass (Fed3R): nothing trains
        frozen = set(gparams)
    constant = constant_keys(model, frozen)
    return StageLayout(
        frozen=frozenset(frozen),
        constant=frozenset(constant),
        shared_params=tuple(k for k in gparams if k in shared and k not in frozen),
        shared_buffers=tuple(k for k, _ in model.named_buffers() if k in shared and k not in constant),
        personal_keys=tuple(k for k in model.state_dict() if k not in shared),
    )


def personal_eval(stage: Stage) -> bool:
    """Whether a component evaluates clients on their own models (Ditto, OLL): then a client's local
    test set is evaluated on the client's model, never the global one."""
    return any(type(c).eval_context is not Component.eval_context for c in stage.recipe.components)


@dataclass
class RoundPlan:
    """What the server decided at the start of a round: the clients, the broadcast, the global values
    they start from. ``Server.begin_round`` / ``Server.end_round`` are the server's half of a round; a
    backend runs the client half (in this process or on Flower nodes) and hands back ``Reply``s."""

    round: int
    sctx: ServerContext | None
    sampled: list[int]
    broadcast: dict[str, dict[str, torch.Tensor]]
    global_params: dict[str, torch.Tensor]
    t0: float = 0.0
    #: what components send to one sampled client only (``Component.client_broadcast``): {client: {name: tensors}}
    client_broadcast: dict[int, dict[str, dict[str, torch.Tensor]]] = field(default_factory=dict)

    def broadcast_for(self, client: int) -> dict[str, dict[str, torch.Tensor]]:
        """What ``client`` receives besides the global model: every component's broadcast to all, with its
        own entries merged in."""
        return merge_broadcast(self.broadcast, self.client_broadcast.get(client, {}))


def merge_broadcast(common: dict[str, dict[str, torch.Tensor]], own: dict[str, dict[str, torch.Tensor]]
                    ) -> dict[str, dict[str, torch.Tensor]]:
    """Broadcasts to all merged with one client's own (by component name; a client's entries win)."""
    if not own:
        return common
    out = {name: dict(tensors) for name, tensors in common.items()}
    for name, tensors in own.items():
        out.setdefault(name, {}).update(tensors)
    return out


@dataclass
class Reply:
    """One sampled client's answer: its result (None if it never answered), whether the client accepted
    its own update (finite values, state stored), why there is no result, and what the backend knows
    about where it ran (``info``, e.g. the Flower node) for the events."""

    client: int
    result: ClientResult | None
    accepted: bool = True
    reason: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    #: a reply arrived but could not be read (``reason`` says why): rejected, not lost
    rejected: bool = False
    #: the client refused the global model it received (``fedsight.errors.ModelRefused``): it trained nothing
    refused: bool = False
    #: the tensors of ``result`` the in-process backend found finite (``contract.FiniteSeal``): while it holds, the
    #: server does not read their values again. None for a reply that crossed a process boundary.
    finite_seal: FiniteSeal | None = None
    #: bytes the client sent, where they differ from its result's tensors (secure aggregation: masked integers,
    #: keys and shares); None: the result's size (``cost.result_bytes``)
    up_bytes: int | None = None


def refused_reply(client: int, exc: Exception) -> Reply:
    """The reply of a client whose component refused the global model (``ModelRefused``: message, info)."""
    info = {k: v for k, v in getattr(exc, "info", {}).items() if isinstance(v, (int, float, str, bool))}
    return Reply(client, None, False, str(exc), info, refused=True)


__all__ = [
    "ClientContext", "Recipe", "Reply", "refused_reply", "RoundPlan", "Schedule", "Stage", "StageLayout", "clients_per_round",
    "personal_eval", "sample_clients", "stage_layout", "stage_of_round",
]
