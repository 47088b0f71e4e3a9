"""The in-process simulation engine: a ``Server`` and a ``ClientRuntime`` in one process, driven by the
one round loop (``engine.loop``) with the ``InProcessBackend``.

Fast by construction: data stays in memory as tensors (or is read lazily from disk), two model instances
live for the whole run (the global model, whose parameters the server optimizer owns, and one work model
reused by every client), clients are trained one after another in the same process, and every random
decision draws from a stream named by (seed, purpose, round, client) so a resumed run repeats an
uninterrupted one bit for bit.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from ..cost import ModelCost
from ..records import ClientResult
from ..rng import derive_seed
from ..state import PERSONAL, ClientStateStore
from ..tasks.base import Task
from ..training import ClientState
from ..training.local import LocalTraining
from .client_runtime import ClientRuntime, eval_hooks
from .loop import InProcessBackend, OnRound, evaluate, run_round, run_rounds
from .plan import Recipe, RoundPlan, Schedule, Stage, build_models, clients_per_round, sample_clients
from .server import Server

__all__ = ["PERSONAL", "Recipe", "RoundPlan", "Schedule", "Simulation", "Stage", "clients_per_round", "sample_clients"]


class Simulation:
    def __init__(
        self,
        task: Task,
        recipe: Recipe,
        local: LocalTraining,
        schedule: Schedule,
        seed: int,
        store: ClientStateStore | None = None,
        stages: list[Stage] | None = None,
        cost: ModelCost | None = None,
        device: torch.device | str = "cpu",
        *,
        vectorize: bool | str = False,
        max_clients_per_batch: int | None = None,
        noise: str = "simulated",
    ):
        """``stages``: the run's phases (default: one stage of ``recipe`` and ``local`` over every round);
        ``cost``: the model's per-example forward FLOPs if already known; ``vectorize``,
        ``max_clients_per_batch``: train each round's clients together (``ClientRuntime``); ``noise``: ``[privacy]
        noise``, where the clients' noise comes from (``fedsight.secret``)."""
        store = store if store is not None else ClientStateStore()
        stages = stages or [Stage("federated", schedule.rounds, recipe, local)]
        task.to(torch.device(device))
        # the global model, then the work model, from one seeded stream
        torch.manual_seed(derive_seed(seed, "init"))
        global_model, work_model = build_models(task, stages, seed, 2)
        self.server = Server(task, stages, schedule, seed, store, device, model=global_model)
        self.runtime = ClientRuntime(task, stages, seed, store, device, cost, eval_batch_size=schedule.eval_batch_size,
                                     model=work_model, vectorize=vectorize, max_clients_per_batch=max_clients_per_batch,
                                     noise=noise)
        self.backend = InProcessBackend(self.server, self.runtime)

    # -- the parts, as attributes -----------------------------------------------------------------

    task = property(lambda self: self.server.task)
    seed = property(lambda self: self.server.seed)
    stages = property(lambda self: self.server.stages)
    store = property(lambda self: self.server.store)
    global_model = property(lambda self: self.server.global_model)
    work_model = property(lambda self: self.runtime.work_model)
    cost = property(lambda self: self.runtime.cost)
    recipe = property(lambda self: self.server.recipe)
    local = property(lambda self: self.server.local)
    stage = property(lambda self: self.server.stage)
    stage_index = property(lambda self: self.server.stage_index)
    totals = property(lambda self: self.server.totals)
    last_weights = property(lambda self: self.server.last_weights)
    shared_params = property(lambda self: self.server.shared_params)
    shared_buffers = property(lambda self: self.server.shared_buffers)
    personal_keys = property(lambda self: self.server.personal_keys)

    @property
    def round(self) -> int:
        return self.server.round

    @round.setter
    def round(self, value: int) -> None:
        self.server.round = value

    @property
    def schedule(self) -> Schedule:
        return self.server.schedule

    @schedule.setter
    def schedule(self, value: Schedule) -> None:
        self.server.schedule = value
        self.runtime.eval_batch_size = value.eval_batch_size

    # -- rounds -----------------------------------------------------------------------------------

    def enter_round(self, r: int) -> None:
        self.server.enter_round(r)
        self.runtime.enter_round(r)

    def begin_round(self, r: int) -> RoundPlan:
        return self.server.begin_round(r)

    def run_client(self, plan: RoundPlan, cid: int) -> tuple[ClientResult, ClientState]:
        """One client's local work; its state saves are held until ``keep_client`` accepts them."""
        return self.runtime.run(plan.round, cid, self.server.global_state(), plan.broadcast)

    def keep_client(self, res: ClientResult, state: ClientState) -> bool:
        return self.runtime.keep(res, state)

    def train_round(self, r: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """One round without evaluation: sample, train, accept, aggregate, step (the metrics row without
        ``round``/``stage`` and timings of the whole round, and the events)."""
        self.enter_round(r)
        plan = self.server.begin_round(r)
        replies, events = self.backend.train(plan)
        results, spent = self.server.collect(plan, replies, events)
        return self.server.end_round(plan, results, events, spent), events

    def should_evaluate(self, r: int) -> bool:
        return self.server.should_evaluate(r)

    def run(self, on_round: OnRound | None = None, stop_after: int | None = None) -> None:
        """Run rounds ``self.round + 1 .. schedule.rounds`` (or up to ``stop_after``)."""
        run_rounds(self.server, self.backend, on_round, stop_after)

    def run_round(self, r: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        return run_round(self.server, self.backend, r)

    # -- evaluation -------------------------------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        return evaluate(self.server, self.backend, self.round)[0]

    @torch.no_grad()
    def load_client_model(self, client: int) -> nn.Module:
        """The work model holding the global model and ``client``'s personal entries."""
        return self.runtime.load(client, self.server.global_state())

    def eval_context(self, model: nn.Module, split: str | int) -> contextlib.AbstractContextManager:
        """The stage's evaluation hooks around an evaluation of ``model`` on ``split``."""
        ctx = self.runtime.eval_context(split) if isinstance(split, int) else self.server.eval_context(split, self.store)
        return eval_hooks(self.stages[self.server.stage_index], model, ctx)

    # -- state ------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return self.server.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.server.load_state_dict(state)
        self.runtime.enter_stage(self.server.stage_index)
