"""The one round loop, behind a backend that runs the client half of each round.

``run_round`` is every engine's round: the server samples and broadcasts (``Server.begin_round``), the
backend trains the sampled clients and returns one ``Reply`` each, the server accepts or rejects every
reply in one place (``Server.collect``), aggregates and steps (``Server.end_round``), and, on evaluation
rounds, ``evaluate`` scores the global model and summarises the clients' local test sets. Backends:

* ``InProcessBackend``: a ``ClientRuntime`` in this process trains and evaluates every client;
* ``fedsight.flower.server_app.FlowerBackend``: the clients' runtimes live on Flower SuperNodes.

Evaluation and personal-state handling therefore exist once, whatever runs the clients.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ..errors import ModelRefused
from ..metrics import MetricState
from ..records import ClientResult
from ..rng import np_rng
from .client_runtime import ClientRuntime
from .contract import FiniteSeal
from .plan import Reply, RoundPlan, refused_reply
from .server import Server


@dataclass
class ClientEvaluation:
    """What the clients contribute to an evaluation: each client's local-test metric state and test-set
    size, where the global evaluation reads the clients' personal entries (``store``), and events."""

    states: dict[int, tuple[MetricState, int]] = field(default_factory=dict)
    store: Any = None
    events: list[dict[str, Any]] = field(default_factory=list)


class Backend(Protocol):
    def enter_round(self, r: int) -> None: ...

    def train(self, plan: RoundPlan) -> tuple[list[Reply], list[dict[str, Any]]]:
        """One ``Reply`` per sampled client, in any order (a client that did not answer: result None),
        and events of the backend's own (a Flower client that moved to another node)."""

    def admit(self, plan: RoundPlan, results: list[ClientResult], events: list[dict[str, Any]]) -> list[ClientResult]:
        """The accepted results that are aggregated (a backend may hold back a round, e.g. too few)."""

    def round_metrics(self) -> dict[str, Any]:
        """Backend-specific entries of the round's metrics row."""

    def client_evaluation(self, r: int, *, local: bool, personal: bool) -> ClientEvaluation:
        """Local-test states (``local``) and the clients' personal entries (``personal``)."""


def client_speed(seed: int, client: int, sigma: float) -> float:
    """A client's simulated speed: exp(N(0, sigma^2)) from the stream (seed, "speed", client); 1 at sigma 0."""
    return float(np.exp(sigma * np_rng(seed, "speed", client).standard_normal())) if sigma > 0 else 1.0


class InProcessBackend:
    """Every client trains and evaluates in this process, on one ``ClientRuntime``."""

    def __init__(self, server: Server, runtime: ClientRuntime):
        self.server, self.runtime = server, runtime
        #: central DP (``fedsight.central_dp``, the Flower path's ``CentralDP``): admits only full releases, and each
        #: round's row has its privacy spent
        self.dp: Any = None
        #: the stages whose sequential training (``engine.vectorize`` on, but not possible) was reported
        self.said: set[int] = set()

    def enter_round(self, r: int) -> None:
        self.runtime.enter_round(r)

    def train(self, plan: RoundPlan) -> tuple[list[Reply], list[dict[str, Any]]]:
        """Every sampled client's update, with the schedule's simulated failures: a client that drops out
        (probability ``dropout``, from the stream (seed, "dropout", round, client)) does not train; one whose
        simulated time, its local steps over its speed (LogNormal(0, ``speed_sigma``), drawn once per client
        from (seed, "speed", client)), exceeds ``deadline`` trains but its update arrives too late and is not
        kept (its state is not stored either). Both are ``client_lost`` events with the reason. A client that
        refuses the global model (a component's ``ModelRefused``) trains nothing: a ``model_refused`` event."""
        sch, seed, runtime = self.server.schedule, self.server.seed, self.runtime
        gstate = self.server.global_state()
        replies: dict[int, Reply] = {}
        trainees = []
        for cid in plan.sampled:
            if sch.dropout > 0 and np_rng(seed, "dropout", plan.round, cid).random() < sch.dropout:
                replies[cid] = Reply(cid, None, False, f"dropped out (simulated, dropout = {sch.dropout:g})")
            else:
                trainees.append(cid)
        events = []
        if runtime.vectorizes(len(trainees)):
            runs = runtime.run_many(plan.round, trainees, gstate, plan.broadcast_for)
        else:
            runs = map(functools.partial(self._run_one, plan, gstate), trainees)
            if runtime.sequential_reasons and runtime.stage_index not in self.said:
                self.said.add(runtime.stage_index)
                events.append({"round": plan.round, "event": "sequential_training", "stage": runtime.stage.name,
                               "reasons": list(runtime.sequential_reasons)})
        for cid, res, state in runs:
            if isinstance(res, ModelRefused):
                replies[cid] = refused_reply(cid, res)
                continue
            if sch.deadline is not None:
                took = res.num_steps / client_speed(seed, cid, sch.speed_sigma)
                if took > sch.deadline:
                    state.commit(only_always=True)  # what the client must remember (privacy spent) it keeps
                    replies[cid] = Reply(cid, None, False, f"straggler: {took:.3g} unit-speed steps, past the deadline "
                                                           f"of {sch.deadline:g}")
                    continue
            kept = runtime.keep(res, state)  # (kept: every tensor of the upload was found finite)
            replies[cid] = Reply(cid, res, kept, finite_seal=FiniteSeal.of(res) if kept else None)
        events += runtime.events
        runtime.events.clear()
        return [replies[cid] for cid in plan.sampled], events

    def _run_one(self, plan: RoundPlan, gstate: dict[str, Any], cid: int) -> tuple[int, Any, Any]:
        try:
            res, state = self.runtime.run(plan.round, cid, gstate, plan.broadcast_for(cid))
        except ModelRefused as exc:
            return cid, exc, None
        return cid, res, state

    def admit(self, plan: RoundPlan, results: list[ClientResult], events: list[dict[str, Any]]) -> list[ClientResult]:
        return self.dp.admit(plan.round, results, events) if self.dp is not None else results

    def round_metrics(self) -> dict[str, Any]:
        return self.dp.privacy_spent() if self.dp is not None else {}

    def class_split(self, r: int, clients: tuple[int, ...]) -> dict[str, float]:
        """``eval.class_split``'s metrics (``fedsight.class_split``) of ``clients``, on this process's runtime."""
        from ..class_split import summarize

        gstate = self.server.global_state()
        return summarize({cid: self.runtime.class_split(cid, gstate) for cid in clients})

    def client_evaluation(self, r: int, *, local: bool, personal: bool) -> ClientEvaluation:
        out = ClientEvaluation(store=self.runtime.store)
        if local:
            task, gstate, gmodel = self.server.task, self.server.global_state(), self.server.global_model
            for cid in range(task.num_clients):
                n = task.num_test_examples(cid)
                if n > 0:
                    out.states[cid] = (self.runtime.local_state(cid, gstate, gmodel), n)
        return out


def needs_client_entries(server: Server) -> bool:
    """Whether the global-test evaluation reads the clients' personal entries (FedBN/SiloBN evaluate with
    their example-weighted mean, ``NormSharing.client_average``)."""
    return bool(server.layout.personal_keys) and hasattr(server.recipe.sharing, "client_average")


def evaluate(server: Server, backend: Backend, r: int) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """``test/*`` of the global model (with a model selection, ``val/*`` and, after the last round, the selected
    model's ``selected/*``) and, with ``eval.local``, ``local/*`` of the clients' test sets."""
    local = server.schedule.eval_local
    ev = backend.client_evaluation(r, local=local, personal=needs_client_entries(server))
    out = server.evaluate_global(ev.store)
    out.update(server.select(r, out, ev.store))  # eval.select = "best": the best model on val so far
    if server.schedule.class_split:  # eval.class_split (in-process and distributed; Flower refuses it)
        out.update(backend.class_split(r, server.schedule.class_split))
    if local:
        out.update(server.summarize_local(ev.states))
        return out, [*ev.events, server.client_metrics(r, ev.states)]
    return out, ev.events


def run_round(server: Server, backend: Backend, r: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One round: train, accept, aggregate, evaluate when due. Returns the metrics row and the events."""
    server.enter_round(r)
    backend.enter_round(r)
    t0 = time.perf_counter()
    plan = server.begin_round(r)
    replies, events = backend.train(plan)
    results, spent = server.collect(plan, replies, events)
    results = backend.admit(plan, results, events)
    if results and len(results) < server.schedule.min_clients:
        events.append({"round": r, "event": "too_few_clients", "accepted": len(results),
                       "min_clients": server.schedule.min_clients})
        results = []
    row = server.end_round(plan, results, events, spent)
    row.update(backend.round_metrics())
    if server.should_evaluate(r):
        te = time.perf_counter()
        evaluated, eval_events = evaluate(server, backend, r)
        row.update(evaluated)
        events += eval_events
        row["time/eval_s"] = time.perf_counter() - te
    row["time/round_s"] = time.perf_counter() - t0
    server.round = r
    return {"round": r, "stage": server.stage, **row}, events


def evaluate_initial(server: Server, backend: Backend) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Round 0: the initial global model, before any training, evaluated as every evaluation round is (the
    first stage's hooks, ``test/*`` and, with ``eval.local``, ``local/*``). Evaluation draws from no stream
    that training reads, so rounds 1.. are the same with or without it. Returns the metrics row and events."""
    server.enter_round(0)
    backend.enter_round(0)
    t0 = time.perf_counter()
    evaluated, events = evaluate(server, backend, 0)
    return {"round": 0, "stage": server.stage, **evaluated, "time/eval_s": time.perf_counter() - t0}, events


OnRound = Callable[[int, dict[str, Any], list[dict[str, Any]]], None]


def run_rounds(server: Server, backend: Backend, on_round: OnRound | None = None, stop_after: int | None = None) -> None:
    """Round 0 (``evaluate_initial``, with ``eval.initial`` and no round done yet), then rounds
    ``server.round + 1 .. schedule.rounds`` (or up to ``stop_after``)."""
    last = server.schedule.rounds if stop_after is None else min(server.schedule.rounds, stop_after)
    if server.round == 0 and server.schedule.eval_initial and last > 0:
        row, events = evaluate_initial(server, backend)
        if on_round is not None:
            on_round(0, row, events)
    while server.round < last:
        r = server.round + 1
        row, events = run_round(server, backend, r)
        if on_round is not None:
            on_round(r, row, events)
