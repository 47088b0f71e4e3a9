"""The server half of a round: sampling, broadcasts, accepting replies, weighting, aggregation, the server
optimizer, the components' server hooks and evaluation of the global model.

The server never trains a client: a backend (``engine.loop``) runs the client half in this process or on
Flower nodes and hands back ``Reply``s; every reply passes ``accept`` here, in one place for every
backend, before anything else touches it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..cost import nbytes, result_bytes, result_numbers
from ..device import to_device
from ..functional.aggregate import normalize, weighted_mean_state
from ..metrics import MetricState
from ..model_selection import SELECTED, Selection
from ..records import ClientResult
from ..rng import derive_seed
from ..state import ClientStateStore
from ..tasks.base import Task, local_summary
from ..training import EvalContext, ServerContext, UploadContext
from .client_runtime import evaluate_split
from ..recipe.aggregators import TooFewUpdates
from .contract import ReplyContract, check_result
from .plan import (
    Reply, RoundPlan, Schedule, Stage, StageLayout, build_models, sample_clients, stage_layout, stage_of_round,
)


def result_to(res: ClientResult, device: torch.device) -> ClientResult:
    """``res`` with its tensors on ``device`` (the same object when they already are)."""
    tensors = [*res.delta.values(), *res.buffers.values(), *(t for e in res.extras.values() for t in e.values())]
    if all(t.device == device for t in tensors):
        return res
    return dataclasses.replace(
        res, delta=to_device(res.delta, device), buffers=to_device(res.buffers, device),
        extras={k: to_device(v, device) for k, v in res.extras.items()},
    )


class Server:
    def __init__(
        self,
        task: Task,
        stages: Sequence[Stage],
        schedule: Schedule,
        seed: int,
        store: ClientStateStore | None = None,
        device: torch.device | str = "cpu",
        model: nn.Module | None = None,
    ):
        """``model``: the global model, built and adapted by the caller; without one, the server builds
        it from the stream (seed, "init") and adapts it for the stages' components. ``store``: the
        per-client state the global evaluation reads (FedBN's clients' normalisation entries) and the
        checkpoint indexes; an empty in-memory store without one."""
        self.task, self.schedule, self.seed = task, schedule, seed
        self.stages = list(stages)
        if self.stages[-1].end_round != schedule.rounds:
            raise ValueError(f"stages end at round {self.stages[-1].end_round}, the schedule at {schedule.rounds}")
        self.store = store if store is not None else ClientStateStore()
        self.device = torch.device(device)
        if model is None:
            torch.manual_seed(derive_seed(seed, "init"))
            model = build_models(task, self.stages, seed, 1)[0]
        self.global_model: nn.Module = model.to(self.device)
        self._gstate = self.global_model.state_dict(keep_vars=True)
        #: cumulative communication and computation over the run
        self.totals = {"up_bytes": 0.0, "down_bytes": 0.0, "flops": 0.0, "up_bytes_fp32": 0.0}
        #: named tensors server-side parts establish for later rounds and stages (``ServerContext.facts``)
        self.facts: dict[str, torch.Tensor] = {}
        #: the server's secret the client sample is drawn from (None: the seed; ``engine.plan.sample_clients``)
        self.sample_secret: bytes | None = None
        self.round = 0
        #: (client ids, normalised weights) of the last aggregation, for logging
        self.last_weights: tuple[list[int], Any] | None = None
        #: whether the task's client sizes are the clients' (else replies' counts are only bounded)
        self.sizes_known = True
        #: the bound on a reply's ``num_examples`` when the sizes are not known
        self.max_examples = 10**9
        #: whether statistics replies carry shares of a secure sum (Flower's SecAgg+, ``UploadContext.secure_sum``)
        self.secure_sum = False
        #: the best global model on the validation set so far (``eval.select = "best"``; None: the last is kept)
        self.selection = (Selection(schedule.select_metric, schedule.select_higher)
                          if schedule.select_metric is not None else None)
        self.stage_index = -1
        self._enter_stage(0)

    # -- stages -----------------------------------------------------------------------------------

    def _enter_stage(self, index: int) -> None:
        """Switch recipe and local training; a stage's server optimizer starts fresh."""
        st = self.stages[index]
        self.stage_index, self.stage, self.recipe, self.local = index, st.name, st.recipe, st.local
        self.layout: StageLayout = stage_layout(self.global_model, st)
        gparams = dict(self.global_model.named_parameters())
        self.recipe.server_optimizer.attach({k: gparams[k] for k in self.layout.shared_params})
        from ..recipe.norm_sharing import nonnegative_statistics

        #: shared buffers an honest reply never makes negative (the reply contract's ``nonneg``)
        self._nonneg = frozenset(nonnegative_statistics(self.global_model) & set(self.layout.shared_buffers))
        #: bytes a client downloads: the shared entries that can change (frozen ones are not re-sent)
        self.model_bytes = nbytes([self._gstate[k] for k in self.layout.shared_params + self.layout.shared_buffers])

    @property
    def shared_params(self) -> list[str]:
        return list(self.layout.shared_params)

    @property
    def shared_buffers(self) -> list[str]:
        return list(self.layout.shared_buffers)

    @property
    def personal_keys(self) -> list[str]:
        return list(self.layout.personal_keys)

    def enter_round(self, r: int) -> None:
        """Switch to the stage that round ``r`` belongs to (no-op within a stage)."""
        i = stage_of_round(self.stages, r)
        if i != self.stage_index:
            self._enter_stage(i)

    def global_state(self) -> dict[str, torch.Tensor]:
        """The whole global model state (live tensors: read, never write)."""
        return self._gstate

    # -- one round --------------------------------------------------------------------------------

    def begin_round(self, r: int) -> RoundPlan:
        """Sample the round's clients and collect the components' broadcasts."""
        m = self.stages[self.stage_index].clients_per_round or self.schedule.clients_per_round
        sampled = None
        for c in self.recipe.components:
            sampled = c.sample(r, self.task.num_clients, m, self.seed)
            if sampled is not None:
                break
        if sampled is None:
            sampled = sample_clients(self.seed, r, self.task.num_clients, m, self.sample_secret)
        sctx = ServerContext(
            round=r, model=self.global_model, num_clients=self.task.num_clients, sampled=sampled, seed=self.seed,
            rounds=self.schedule.rounds, task=self.task, facts=self.facts,
        )
        broadcast = {}
        for c in self.recipe.components:
            sent = c.server_broadcast(sctx)
            if sent is not None:
                broadcast[c.name] = {k: v.detach().clone() for k, v in sent.items()}
        per_client: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
        for c in self.recipe.components:
            for cid in sampled:
                own = c.client_broadcast(sctx, cid)
                if own is not None:
                    per_client.setdefault(cid, {})[c.name] = {k: v.detach().clone() for k, v in own.items()}
        global_params = {k: self._gstate[k].detach() for k in self.layout.shared_params}
        return RoundPlan(r, sctx, sampled, broadcast, global_params, time.perf_counter(), per_client)

    def contract(self, round: int | None = None) -> ReplyContract:
        """What a reply must be in round ``round`` (default: the next one) of the current stage
        (``engine.contract``): the server's own shared entries, its own client sizes unless ``sizes_known`` is
        off (Flower nodes with their own data), and the extras the stage's components declare."""
        r = self.round + 1 if round is None else round
        trains = self.recipe.trainer.trains
        ctx = UploadContext(
            round=r, model=self.global_model, state=self._gstate, shared_params=tuple(self.layout.shared_params),
            trains=trains, local=self.local, num_clients=self.task.num_clients, seed=self.seed, task=self.task,
            secure_sum=self.secure_sum,
        )
        extras = {c.name: spec for c in self.recipe.components if (spec := c.extras_spec(ctx)) is not None}
        return ReplyContract.of(self._gstate, self.layout.shared_params, self.layout.shared_buffers, trains,
                                max_examples=self.max_examples, extras=extras, nonneg=self._nonneg,
                                sizes=self.task.num_train_examples if self.sizes_known else None)

    def rejection(self, reply: Reply, contract: ReplyContract | None = None) -> str | None:
        """Why a reply's update cannot be used (None: it can). Every backend's replies pass here, checked
        against ``contract`` (the current stage's, built once per round by ``collect``)."""
        if reply.result is None:
            return reply.reason or "no result"
        if not reply.accepted:
            return "non-finite values"  # the client refused its own update (and stored no state)
        sealed = reply.finite_seal is not None and reply.finite_seal.holds(reply.result)
        return check_result(reply.result, reply.client, contract or self.contract(), finite_known=sealed)

    def collect(
        self, plan: RoundPlan, replies: Sequence[Reply], events: list[dict[str, Any]]
    ) -> tuple[list[ClientResult], dict[str, float]]:
        """The usable results, in the sampled order (aggregation sums in that order on every backend),
        and the costs the clients spent (only accepted results count: a rejected reply contributes to no metric,
        cost or loss; an honest client whose update was non-finite is not counted either). A sampled client
        without a result becomes a ``client_lost`` event, an unusable result a ``rejected_update``, a client that
        refused the global model a ``model_refused``."""
        by_client = {rep.client: rep for rep in replies}
        results: list[ClientResult] = []
        device = self.device
        spent = {"up_bytes": 0.0, "flops": 0.0, "up_bytes_fp32": 0.0}
        contract = self.contract(plan.round)
        for cid in plan.sampled:
            rep = by_client.get(cid)
            if rep is not None and rep.refused:
                events.append({"round": plan.round, "event": "model_refused", "client": cid, **rep.info,
                               "reason": rep.reason})
                continue
            if rep is not None and rep.rejected:
                events.append({"round": plan.round, "event": "rejected_update", "client": cid, **rep.info,
                               "reason": rep.reason})
                continue
            if rep is None or rep.result is None:
                info = rep.info if rep is not None else {}
                reason = rep.reason if rep is not None and rep.reason else "no reply"
                events.append({"round": plan.round, "event": "client_lost", "client": cid, **info, "reason": reason})
                continue
            why = self.rejection(rep, contract)
            if why is not None:
                events.append({"round": plan.round, "event": "rejected_update", "client": cid, **rep.info, "reason": why})
                continue
            # (after the contract: a rejected reply's numbers, its FLOPs above all, count nowhere)
            spent["up_bytes"] += result_bytes(rep.result) if rep.up_bytes is None else rep.up_bytes
            spent["flops"] += rep.result.flops
            spent["up_bytes_fp32"] += 4.0 * result_numbers(rep.result)  # the thesis's 4 bytes a number
            results.append(result_to(rep.result, device))
        return results, spent

    def end_round(
        self, plan: RoundPlan, results: list[ClientResult], events: list[dict[str, Any]], spent: dict[str, float]
    ) -> dict[str, Any]:
        """Weight, aggregate, step the server optimizer, run the components' server hooks; the
        round's metrics row (with the costs ``spent`` by the clients)."""
        r, sctx = plan.round, plan.sctx
        t_train = time.perf_counter() - plan.t0
        row: dict[str, Any] = {"clients/sampled": len(plan.sampled), "clients/aggregated": len(results)}
        if any(getattr(c, "refuses_models", False) for c in self.recipe.components):
            # refusals of the received model: clients that trained nothing (events) and clients that trained from
            # their own model instead (``fedsight.recipe.ppfl_accept``: their result's ``clients/refused`` is 1)
            row["clients/refused"] = (sum(1 for e in events if e.get("event") == "model_refused" and e.get("round") == r)
                                      + sum(int(res.metrics.get("clients/refused", 0)) for res in results))
        self.last_weights = None
        delta = None
        if results:
            for c in self.recipe.components:
                results = c.server_results(sctx, results)
            weights = self.recipe.weighting.weights(results, sctx)
            try:
                delta = self.recipe.aggregator.aggregate(results, weights)
            except TooFewUpdates as exc:  # e.g. Krum with K <= 2f + 2 updates left: the round is not aggregated
                events.append({"round": r, "event": "round_skipped", "reason": str(exc)})
                row["clients/aggregated"] = 0
            if delta is not None and getattr(self.recipe.aggregator, "degraded", None):
                events.append({"round": r, "event": "aggregator_degraded", "reason": self.recipe.aggregator.degraded})
        if delta is not None:
            self.recipe.server_optimizer.step(delta)
            if self.layout.shared_buffers:  # (through the aggregator's own rule: a robust one covers them too)
                rule = getattr(self.recipe.aggregator, "aggregate_buffers", None)
                buffers = (rule(results, weights) if rule is not None
                           else weighted_mean_state([res.buffers for res in results], weights))
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
        elif plan.sampled and not results:  # (no client sampled: a server-only round)
            events.append({"round": r, "event": "round_skipped", "reason": "no valid client update"})
        for c in self.recipe.components:
            c.server_step(sctx)
        row.update(sctx.metrics)
        events.extend({"round": r, **e} for e in sctx.events)
        down_each = nbytes([t for sent in plan.broadcast.values() for t in sent.values()])
        if self.recipe.trainer.downloads_model:
            down_each += self.model_bytes
        down = down_each * len(plan.sampled) + sum(nbytes([t for sent in own.values() for t in sent.values()])
                                                   for own in plan.client_broadcast.values())
        round_cost = {"up_bytes": spent["up_bytes"], "down_bytes": float(down), "flops": spent["flops"],
                      "up_bytes_fp32": spent["up_bytes_fp32"]}
        if r == 1:  # what the clients share once before training (a style bank; counted as sent in both)
            for k, v in self.task.setup_cost().items():
                round_cost[k] += float(v)
                if k == "up_bytes":
                    round_cost["up_bytes_fp32"] += float(v)
        for k, v in round_cost.items():
            self.totals[k] += v
            row[f"cost/{k}"] = v
            row[f"cost/total_{k}"] = self.totals[k]
        row["time/train_s"] = t_train
        row["time/aggregate_s"] = time.perf_counter() - plan.t0 - t_train
        return row

    # -- evaluation -------------------------------------------------------------------------------

    def should_evaluate(self, r: int) -> bool:
        """Every ``eval_every`` rounds, at the end of every stage (so each phase gets a number), and in the
        ``eval.last_rounds`` window (``fedsight.reporting.last_window.in_window``)."""
        from ..reporting.last_window import in_window

        sc = self.schedule
        return (r % sc.eval_every == 0 or any(r == st.end_round for st in self.stages)
                or in_window(r, sc.rounds, sc.eval_last_rounds, sc.eval_last_every))

    def eval_context(self, split: str | int, store: Any) -> EvalContext:
        return EvalContext(self.task, split, self.schedule.eval_batch_size, self.layout.personal_keys,
                           self.layout.shared_params, store, facts=self.facts)

    def evaluate_global(self, store: Any, val: bool = True) -> dict[str, float]:
        """``test/*`` (and ``test_<name>/*`` for a task's extra test sets): the global model on the global
        test sets, under the stage's evaluation hooks; ``store`` holds the clients' personal entries where a
        hook needs them (FedBN's test-time rule). With a model selection (and ``val``), ``val/*`` too: the
        global model on the server-held validation set."""
        out: dict[str, float] = {}
        splits = (*self.task.test_splits, *(("val",) if val and self.selection is not None else ()))
        for split in splits:
            state = evaluate_split(self.stages[self.stage_index], self.global_model, self.eval_context(split, store))
            out.update({f"{split}/{k}": v for k, v in self.task.metrics.compute(state).items()})
        return out

    def select(self, r: int, evaluated: dict[str, float], store: Any) -> dict[str, float]:
        """Offer round ``r``'s global model, scored ``evaluated``, to the model selection; after the last round,
        the selected model's ``selected/round``, ``selected/val/<metric>`` and its scores on the test sets
        (``selected/test/*``), evaluated with the global model's entries replaced by the selected ones for the
        time it takes. ``{}`` without a selection."""
        sel = self.selection
        if sel is None:
            return {}
        sel.offer(r, evaluated, self._gstate)
        if r != self.schedule.rounds or sel.model is None:
            return {}
        out: dict[str, float] = {f"{SELECTED}/round": sel.round, f"{SELECTED}/{sel.metric}": sel.value}
        last = {k: v.detach().clone() for k, v in self._gstate.items()}
        try:
            with torch.no_grad():
                for k, v in sel.model.items():
                    self._gstate[k].copy_(v)
            out.update({f"{SELECTED}/{k}": v for k, v in self.evaluate_global(store, val=False).items()})
        finally:
            with torch.no_grad():
                for k, v in last.items():
                    self._gstate[k].copy_(v)
        return out

    def summarize_local(self, per_client: dict[int, tuple[MetricState, int]]) -> dict[str, float]:
        """``local/*`` from {client: (local-test metric state, test size)}: WMA (eq. 4.4) and the worst 10 %
        of the primary metric (lowest when higher is better, highest otherwise) over clients with a
        non-empty test set, in client order, and the other metrics of the merged state."""
        metrics = self.task.metrics
        pm = metrics.primary
        states, values, counts = [], [], []
        for cid in sorted(per_client):
            state, n = per_client[cid]
            if n == 0:
                continue
            states.append(state)
            values.append(metrics.compute(state)[pm])
            counts.append(n)
        higher = metrics.higher_is_better(pm)
        out = {f"local/{k}": v for k, v in local_summary(values, counts, higher is not False).items()}
        out.update({f"local/{k}": v for k, v in metrics.compute(metrics.merge(states)).items() if k != pm})
        return out

    def client_metrics(self, r: int, per_client: dict[int, tuple[MetricState, int]]) -> dict[str, Any]:
        """The ``client_metrics`` event of round ``r``: every client's local-test metrics and test size (the
        run directory keeps it in ``client_metrics.jsonl``, not in ``metrics.jsonl``)."""
        metrics = self.task.metrics
        clients = {str(cid): {"n": n, **metrics.compute(state)} for cid, (state, n) in sorted(per_client.items())
                   if n > 0}
        return {"round": r, "event": "client_metrics", "clients": clients}

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
            "facts": {k: v.detach().clone() for k, v in self.facts.items()},
            **({"selection": self.selection.state_dict()} if self.selection is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.round = int(state["round"])
        self._enter_stage(int(state.get("stage_index", 0)))
        self.global_model.load_state_dict(state["model"])
        self.recipe.server_optimizer.load_state_dict(state["server_optimizer"])
        # parts' own state comes back as CPU tensors from disk: on the server's device it meets the
        # clients' uploads (a run started on a CPU may resume on a GPU and vice versa)
        self.recipe.weighting.load_state_dict(to_device(state.get("weighting", {}), self.device))
        self.recipe.aggregator.load_state_dict(to_device(state.get("aggregator", {}), self.device))
        comp_states = to_device(state.get("components", {}), self.device)
        for i, c in enumerate(self.recipe.components):
            c.load_state_dict(comp_states.get(f"{i}:{c.name}", {}))
        torch.set_rng_state(state["rng"]["torch"])
        self.totals.update({k: float(v) for k, v in state.get("totals", {}).items()})
        self.facts.clear()
        self.facts.update(to_device(state.get("facts", {}), self.device))
        self.store.load_state_dict(state.get("client_state", {}))
        if self.selection is not None:
            self.selection.load_state_dict(state.get("selection", {}), self._gstate)
