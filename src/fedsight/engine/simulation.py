"""The in-process simulation engine.

Fast by construction: data stays in memory as tensors, two model instances live for the whole run (the
global model, whose parameters the server optimizer owns, and one work model reused by every client),
clients are trained one after another in the same process, and every random decision draws from a
stream named by (seed, purpose, round, client) so a resumed run repeats an uninterrupted one bit for
bit.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..client import SGD_TRAINER, LocalTraining, Trainer, constant_keys, frozen_keys, train_client
from ..cost import ModelCost, model_cost, nbytes, result_bytes
from ..functional.aggregate import all_finite, normalize, weighted_mean_state
from ..recipe.base import ClientState, Component, ServerContext
from ..recipe.server_opt import ServerOptimizer
from ..records import ClientResult
from ..rng import derive_seed, np_rng, seed_torch
from ..state import ClientStateStore
from ..tasks.base import Task, local_summary, merge_sums


@dataclass
class Recipe:
    weighting: Any
    aggregator: Any
    server_optimizer: ServerOptimizer
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
    eval_batch_size: int = 512
    eval_local: bool = True


def clients_per_round(num_clients: int, count: int | None, fraction: float | None) -> int:
    if count is not None:
        return count
    if fraction is not None:
        return max(1, round(fraction * num_clients))
    return num_clients


def sample_clients(seed: int, round: int, num_clients: int, m: int) -> list[int]:
    """m distinct clients, uniformly, from the stream ("sample", round)."""
    if m >= num_clients:
        return list(range(num_clients))
    return sorted(int(c) for c in np_rng(seed, "sample", round).choice(num_clients, size=m, replace=False))


PERSONAL = "personal"  # client-state key of the non-shared model entries


@dataclass
class RoundPlan:
    """What the server decided at the start of a round: the clients, the broadcast, the global values
    they start from. ``begin_round`` / ``end_round`` are the server's half of a round; a deployment
    (Flower) runs the client half elsewhere and feeds the results back."""

    round: int
    sctx: ServerContext
    sampled: list[int]
    broadcast: dict[str, dict[str, torch.Tensor]]
    global_params: dict[str, torch.Tensor]
    t0: float = 0.0


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
    ):
        """``cost``: the model's per-example forward FLOPs if already known (a deployment node reuses
        the server's measurement instead of counting again in every fresh process)."""
        self.task, self.schedule, self.seed = task, schedule, seed
        self.store = store if store is not None else ClientStateStore()
        self.stages = stages or [Stage("federated", schedule.rounds, recipe, local)]
        if self.stages[-1].end_round != schedule.rounds:
            raise ValueError(f"stages end at round {self.stages[-1].end_round}, the schedule at {schedule.rounds}")
        torch.manual_seed(derive_seed(seed, "init"))
        self.global_model: nn.Module = task.build_model()
        self.work_model: nn.Module = task.build_model()
        adapters = {id(c): c for st in self.stages for c in st.recipe.components}
        for c in adapters.values():
            c.adapt_model(self.global_model, seed)
            c.adapt_model(self.work_model, seed)
        #: per-example forward FLOPs (whole model, classifier head), for the cost estimate
        self.cost: ModelCost = cost or model_cost(self.work_model, task.train_batch(0, torch.tensor([0]))[0])
        #: cumulative communication and computation over the run
        self.totals = {"up_bytes": 0.0, "down_bytes": 0.0, "flops": 0.0}
        self._gstate = self.global_model.state_dict(keep_vars=True)
        self._wstate = self.work_model.state_dict(keep_vars=True)
        self.round = 0
        #: (client ids, normalised weights) of the last aggregation, for logging
        self.last_weights: tuple[list[int], Any] | None = None
        self._enter_stage(0)

    def _enter_stage(self, index: int) -> None:
        """Switch recipe and local training; a stage's server optimizer starts fresh."""
        st = self.stages[index]
        self.stage_index, self.stage, self.recipe, self.local = index, st.name, st.recipe, st.local
        shared = self.recipe.sharing.shared_keys(self.global_model)
        gparams = dict(self.global_model.named_parameters())
        if self.recipe.trainer.trains:
            self.frozen = frozen_keys(self.global_model, self.local.freeze)
        else:  # a statistics pass (Fed3R): nothing trains
            self.frozen = set(gparams)
        #: entries no client can change this stage (frozen parameters, statistics of frozen norm layers)
        self.constant = constant_keys(self.global_model, self.frozen)
        self.shared_params = [k for k in gparams if k in shared and k not in self.frozen]
        self.shared_buffers = [k for k, _ in self.global_model.named_buffers() if k in shared and k not in self.constant]
        #: entries that stay on the client (FedBN's norm layers, personal heads): loaded per client
        self.personal_keys = [k for k in self.global_model.state_dict() if k not in shared]
        self.recipe.server_optimizer.attach({k: gparams[k] for k in self.shared_params})
        #: bytes a client downloads: the shared entries that can change (frozen ones are not re-sent)
        self.model_bytes = nbytes([self._gstate[k] for k in self.shared_params + self.shared_buffers])

    def stage_of_round(self, r: int) -> int:
        return next(i for i, st in enumerate(self.stages) if r <= st.end_round)

    def enter_round(self, r: int) -> None:
        """Switch to the stage that round ``r`` belongs to (no-op within a stage)."""
        if self.stage_of_round(r) != self.stage_index:
            self._enter_stage(self.stage_of_round(r))

    # -- one round --------------------------------------------------------------------------------

    @torch.no_grad()
    def load_client_model(self, client: int) -> nn.Module:
        """The work model holding the global shared entries and this client's personal entries
        (the global model's values for a client that has none yet)."""
        for k, v in self._gstate.items():
            self._wstate[k].copy_(v)
        if self.personal_keys:
            personal = self.store.get(PERSONAL, client)
            if personal is not None:
                # only this stage's non-shared entries: a later stage that shares them again uses the
                # global values
                for k in self.personal_keys:
                    if k in personal:
                        self._wstate[k].copy_(personal[k])
        return self.work_model

    def begin_round(self, r: int) -> RoundPlan:
        """Sample the round's clients and collect the components' broadcasts."""
        m = self.stages[self.stage_index].clients_per_round or self.schedule.clients_per_round
        sampled = None
        for c in self.recipe.components:
            sampled = c.sample(r, self.task.num_clients, m, self.seed)
            if sampled is not None:
                break
        if sampled is None:
            sampled = sample_clients(self.seed, r, self.task.num_clients, m)
        sctx = ServerContext(
            round=r, model=self.global_model, num_clients=self.task.num_clients, sampled=sampled, seed=self.seed,
            rounds=self.schedule.rounds, task=self.task,
        )
        broadcast = {}
        for c in self.recipe.components:
            sent = c.server_broadcast(sctx)
            if sent is not None:
                broadcast[c.name] = {k: v.detach().clone() for k, v in sent.items()}
        global_params = {k: self._gstate[k].detach() for k in self.shared_params}
        return RoundPlan(r, sctx, sampled, broadcast, global_params, time.perf_counter())

    def run_client(self, plan: RoundPlan, cid: int) -> tuple[ClientResult, ClientState]:
        """One client's local work; its state saves are held in the returned ``ClientState`` until
        ``keep_client`` accepts the update."""
        model = self.load_client_model(cid)
        seed_torch(self.seed, "client", plan.round, cid)
        state = ClientState(self.store, cid, plan.round)
        res = train_client(
            self.task, model, cid, plan.round, self.seed, self.local, self.recipe.components,
            plan.global_params, self.shared_buffers, state, plan.broadcast,
            trainer=self.recipe.trainer, frozen=self.frozen, global_state=self._gstate,
            personal_keys=self.personal_keys, cost=self.cost,
        )
        return res, state

    def keep_client(self, res: ClientResult, state: ClientState) -> bool:
        """Accept or reject a client's update (right after ``run_client``, while the work model holds
        its result). Accepted: its personal entries and held state saves go to the store. Rejected
        (non-finite): nothing of it is kept."""
        personal = self.personal_entries(res.client_id) if self.personal_keys else {}
        pending = [t for tensors in state.pending.values() for t in tensors.values()]
        if not (self.accept(res, personal) and all_finite(dict(enumerate(pending)))):
            return False
        if personal:
            self.store.put(PERSONAL, res.client_id, state.round, personal)
        state.commit()
        return True

    def personal_entries(self, client: int) -> dict[str, torch.Tensor]:
        """The work model's entries to keep for ``client``: its changing personal entries, and the
        constant ones it already holds from an earlier stage (a personal head frozen for FP(phi))."""
        # only a constant personal key needs the stored copy (a second read of the client's file otherwise)
        held = (self.store.get(PERSONAL, client) or {}) if any(k in self.constant for k in self.personal_keys) else {}
        return {k: self._wstate[k].detach() for k in self.personal_keys if k not in self.constant or k in held}

    def train_round(self, r: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Sample, train each sampled client, aggregate, step the server optimizer."""
        plan = self.begin_round(r)
        results: list[ClientResult] = []
        events: list[dict[str, Any]] = []
        spent = {"up_bytes": 0.0, "flops": 0.0}
        for cid in plan.sampled:
            res, state = self.run_client(plan, cid)
            spent["up_bytes"] += result_bytes(res)
            spent["flops"] += res.flops
            if not self.keep_client(res, state):
                events.append({"round": r, "event": "rejected_update", "client": cid, "reason": "non-finite values"})
                continue
            results.append(res)
        return self.end_round(plan, results, events, spent), events

    @staticmethod
    def accept(res: ClientResult, personal: dict[str, torch.Tensor]) -> bool:
        """A rejected update is neither averaged in nor kept as the client's personal state."""
        finite = all_finite(res.delta) and all_finite(res.buffers) and all_finite(personal)
        finite = finite and all(all_finite(v) for v in res.extras.values())
        return finite and math.isfinite(res.metrics.get("train/loss", 0.0))

    def end_round(
        self, plan: RoundPlan, results: list[ClientResult], events: list[dict[str, Any]], spent: dict[str, float]
    ) -> dict[str, Any]:
        """Weight, aggregate, step the server optimizer, run the components' server hooks; the
        round's metrics row (with the costs ``spent`` by the clients)."""
        r, sctx = plan.round, plan.sctx
        t_train = time.perf_counter() - plan.t0
        row: dict[str, Any] = {"clients/sampled": len(plan.sampled), "clients/aggregated": len(results)}
        self.last_weights = None
        if results:
            weights = self.recipe.weighting.weights(results, sctx)
            delta = self.recipe.aggregator.aggregate(results, weights)
            self.recipe.server_optimizer.step(delta)
            if self.shared_buffers:
                buffers = weighted_mean_state([res.buffers for res in results], weights)
                with torch.no_grad():
                    for k, v in buffers.items():
                        self._gstate[k].copy_(v)
            norm_weights = normalize(weights)
            self.last_weights = ([res.client_id for res in results], norm_weights)
            for c in self.recipe.components:
                c.server_round_end(sctx, results, norm_weights)
            trained = [res for res in results if "train/loss" in res.metrics]  # statistics passes have none
            if trained:
                n = sum(res.num_examples for res in trained)
                row["train/loss"] = sum(res.metrics["train/loss"] * res.num_examples for res in trained) / n
        else:
            events.append({"round": r, "event": "round_skipped", "reason": "no valid client update"})
        row.update(sctx.metrics)
        down_each = nbytes([t for sent in plan.broadcast.values() for t in sent.values()])
        if self.recipe.trainer.downloads_model:
            down_each += self.model_bytes
        round_cost = {"up_bytes": spent["up_bytes"], "down_bytes": float(down_each * len(plan.sampled)), "flops": spent["flops"]}
        for k, v in round_cost.items():
            self.totals[k] += v
            row[f"cost/{k}"] = v
            row[f"cost/total_{k}"] = self.totals[k]
        row["time/train_s"] = t_train
        row["time/aggregate_s"] = time.perf_counter() - plan.t0 - t_train
        return row

    # -- evaluation -------------------------------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        bs = self.schedule.eval_batch_size
        with self.eval_context(self.global_model, "test"):
            sums = self.task.eval_sums(self.global_model, "test", bs)
        out = {f"test/{k}": v for k, v in self.task.finalize(sums).items()}
        if self.schedule.eval_local:
            per_client = {
                cid: (self.client_eval_sums(cid), self.task.num_test_examples(cid))
                for cid in range(self.task.num_clients)
                if self.task.num_test_examples(cid) > 0
            }
            out.update(self.summarize_local(per_client))
        return out

    def client_eval_sums(self, cid: int) -> dict[str, float]:
        """Client ``cid``'s local-test sums on the model it is evaluated with: the global model, or the
        global shared entries plus its personal ones (and whatever a component's ``eval_context`` does)."""
        model = self.load_client_model(cid) if self.personal_keys or self.personal_eval else self.global_model
        with self.eval_context(model, cid):
            return self.task.eval_sums(model, cid, self.schedule.eval_batch_size)

    def summarize_local(self, per_client: dict[int, tuple[dict[str, float], int]]) -> dict[str, float]:
        """``local/*`` metrics from {client: (local-test sums, test size)}: WMA (eq. 4.4) and worst 10 % of
        the primary metric over clients with a non-empty test set, in client order, and the pooled others."""
        pm = self.task.primary_metric
        parts, values, counts = [], [], []
        for cid in sorted(per_client):
            sums, n = per_client[cid]
            if n == 0:
                continue
            parts.append(sums)
            values.append(self.task.finalize(sums)[pm])
            counts.append(n)
        out = {f"local/{k}": v for k, v in local_summary(values, counts).items()}
        out.update({f"local/{k}": v for k, v in self.task.finalize(merge_sums(parts)).items() if k != pm})
        return out

    @property
    def personal_eval(self) -> bool:
        """Whether a component evaluates clients on their own models (Ditto, OLL): then the work model
        is used, never the global one."""
        return any(type(c).eval_context is not Component.eval_context for c in self.recipe.components)

    @contextlib.contextmanager
    def eval_context(self, model: nn.Module, split: str | int):
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.recipe.sharing.eval_context(model, self, split))
            for c in self.recipe.components:
                stack.enter_context(c.eval_context(model, self, split))
            yield

    def should_evaluate(self, r: int) -> bool:
        """Every ``eval_every`` rounds, and at the end of every stage (so each phase gets a number)."""
        return r % self.schedule.eval_every == 0 or any(r == st.end_round for st in self.stages)

    # -- the loop ---------------------------------------------------------------------------------

    def run(
        self,
        on_round: Callable[[int, dict[str, Any], list[dict[str, Any]]], None] | None = None,
        stop_after: int | None = None,
    ) -> None:
        """Run rounds ``self.round + 1 .. schedule.rounds`` (or up to ``stop_after``)."""
        last = self.schedule.rounds if stop_after is None else min(self.schedule.rounds, stop_after)
        while self.round < last:
            r = self.round + 1
            self.enter_round(r)
            t0 = time.perf_counter()
            row, events = self.train_round(r)
            if self.should_evaluate(r):
                te = time.perf_counter()
                row.update(self.evaluate())
                row["time/eval_s"] = time.perf_counter() - te
            row["time/round_s"] = time.perf_counter() - t0
            self.round = r
            if on_round is not None:
                on_round(r, {"round": r, "stage": self.stage, **row}, events)

    # -- state ------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "stage": self.stage,
            "stage_index": self.stage_index,
            "model": {k: v.detach().clone() for k, v in self.global_model.state_dict().items()},
            "server_optimizer": self.recipe.server_optimizer.state_dict(),
            "weighting": self.recipe.weighting.state_dict(),
            "aggregator": self.recipe.aggregator.state_dict(),
            "components": {f"{i}:{c.name}": c.state_dict() for i, c in enumerate(self.recipe.components)},
            "rng": {"torch": torch.get_rng_state()},
            "totals": dict(self.totals),
            "client_state": self.store.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.round = int(state["round"])
        self._enter_stage(int(state.get("stage_index", 0)))
        self.global_model.load_state_dict(state["model"])
        self.recipe.server_optimizer.load_state_dict(state["server_optimizer"])
        self.recipe.weighting.load_state_dict(state.get("weighting", {}))
        self.recipe.aggregator.load_state_dict(state.get("aggregator", {}))
        comp_states = state.get("components", {})
        for i, c in enumerate(self.recipe.components):
            c.load_state_dict(comp_states.get(f"{i}:{c.name}", {}))
        torch.set_rng_state(state["rng"]["torch"])
        self.totals.update({k: float(v) for k, v in state.get("totals", {}).items()})
        self.store.load_state_dict(state.get("client_state", {}))
