"""The client half of a round: local training and local evaluation of the clients a process holds.

One ``ClientRuntime`` holds one work model, reused by every client it serves (no per-client copy): the
global state is copied in, the client's personal entries on top, the client trains, its upload is read
off, and its personal entries and component state go to the ``ClientStateStore``, only if its update
is finite. In-process one runtime serves every client; on a Flower node (``fedsight.flower``) it serves
the node's client, with the node's own store on the node's disk. Nothing here knows the server.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..cost import ModelCost, model_cost
from ..device import to_device
from ..functional.aggregate import all_finite
from ..metrics import MetricState
from ..records import ClientResult
from ..rng import derive_seed, seed_torch
from ..state import PERSONAL, ClientStateStore
from ..tasks.base import Task
from ..errors import ConfigError, ModelRefused
from ..training import ClientState, Component, EvalContext
from ..training.local import make_result, start_client
from ..training.vectorized import blockers, start_stacks, train_together
from .contract import FiniteSeal
from .plan import Stage, StageLayout, build_models, personal_eval, stage_layout, stage_of_round

#: an allocation failure on any device (``torch.OutOfMemoryError`` from torch 2.5; CUDA's before)
OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def is_finite_result(res: ClientResult, seal: FiniteSeal | None = None) -> bool:
    """Every uploaded tensor and the training loss are finite. ``seal``: the tensors found finite already
    (``FiniteSeal``), not read again while it holds."""
    if seal is None or not seal.holds(res):
        finite = all_finite(res.delta) and all_finite(res.buffers)
        if not (finite and all(all_finite(v) for v in res.extras.values())):
            return False
    return math.isfinite(res.metrics.get("train/loss", 0.0))


@contextlib.contextmanager
def eval_hooks(stage: Stage, model: nn.Module, ctx: EvalContext):
    """The stage's sharing and components' evaluation contexts around an evaluation of ``model``."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(stage.recipe.sharing.eval_context(model, ctx))
        for c in stage.recipe.components:
            stack.enter_context(c.eval_context(model, ctx))
        yield


def evaluate_split(stage: Stage, model: nn.Module, ctx: EvalContext) -> MetricState:
    """The metric state of ``model`` on ``ctx.split`` under the stage's evaluation hooks. The sharing, then
    each component in order, decide how the split is evaluated (``evaluate(model, ctx, run)``: by default
    ``run(ctx)`` once; SiloBN by domain evaluates each domain with its clients' statistics, a clustered model
    each cluster's images with the cluster's entries) and the components' ``eval_context``s wrap every
    evaluation that reaches the task."""

    def leaf(c: EvalContext) -> MetricState:
        with contextlib.ExitStack() as stack:
            for comp in stage.recipe.components:
                stack.enter_context(comp.eval_context(model, c))
            if c.subset is None:  # (a task's own eval_state may not take a subset)
                return c.task.eval_state(model, c.split, c.batch_size)
            return c.task.eval_state(model, c.split, c.batch_size, c.subset)

    run = leaf
    for comp in reversed(stage.recipe.components):
        if type(comp).evaluate is not Component.evaluate:
            run = functools.partial(_component_evaluate, comp, model, run)
    return stage.recipe.sharing.evaluate(model, ctx, run)


def _component_evaluate(comp: Component, model: nn.Module, run: Any, ctx: EvalContext) -> MetricState:
    return comp.evaluate(model, ctx, run)


class ClientRuntime:
    def __init__(
        self,
        task: Task,
        stages: Sequence[Stage],
        seed: int,
        store: ClientStateStore,
        device: torch.device | str = "cpu",
        cost: ModelCost | None = None,
        *,
        eval_batch_size: int = 512,
        model: nn.Module | None = None,
        vectorize: bool | str = False,
        max_clients_per_batch: int | None = None,
        noise: str = "simulated",
    ):
        """``noise``: ``[privacy] noise`` (``fedsight.secret``): "simulated" noise streams from the seed, or "secret"
        ones from each client's secret in ``store`` (a Flower node always passes "secret").

        ``model``: the work model, built and adapted by the caller (the in-process engine builds the
        global and the work model from one seeded stream); without one, the runtime builds it from the
        stream (seed, "init"). ``cost``: the model's per-example forward FLOPs if already known (a
        Flower node reuses the server's measurement instead of counting again). ``vectorize``: train a
        round's clients together (``run_many``) when the stage allows it: ``"auto"``, True (a stage that
        cannot is a ``ConfigError`` here) or False; at most ``max_clients_per_batch`` at once."""
        self.task, self.stages, self.seed, self.store = task, list(stages), seed, store
        self.vectorize, self.max_clients_per_batch = vectorize, max_clients_per_batch
        if noise not in ("simulated", "secret"):
            raise ValueError(f"noise = {noise!r}: expected 'simulated' or 'secret'")
        self.noise = noise
        #: what the runtime reports for the round's events (``run_many`` narrowing its width); the backend drains it
        self.events: list[dict[str, Any]] = []
        #: uploads of ``run_many`` whose tensors were proven finite as they were computed, by client, until ``keep``
        self._sealed: dict[int, FiniteSeal] = {}
        self.device = torch.device(device)
        self.eval_batch_size = eval_batch_size
        if model is None:
            torch.manual_seed(derive_seed(seed, "init"))
            model = build_models(task, self.stages, seed, 1)[0]
        self.work_model: nn.Module = model.to(self.device)
        self._wstate = self.work_model.state_dict(keep_vars=True)
        self.cost: ModelCost = cost or model_cost(self.work_model, to_device(task.example_input(), self.device))
        self.stage_index = -1
        if vectorize is True:  # every stage checked now: a stage that cannot fails before the run starts
            for stage in self.stages:
                self.vector_blockers(stage)
        self.enter_stage(0)

    # -- stages -----------------------------------------------------------------------------------

    def enter_stage(self, index: int) -> None:
        if index != self.stage_index:
            self.stage_index, self.stage = index, self.stages[index]
            self.layout: StageLayout = stage_layout(self.work_model, self.stage)
            self.sequential_reasons = self.vector_blockers(self.stage) if self.vectorize else []

    def vector_blockers(self, stage: Stage) -> list[str]:
        """Why ``stage``'s clients cannot be trained together (``fedsight.training.vectorized.blockers``); with
        ``vectorize = True`` a stage that cannot is a ``ConfigError``."""
        recipe = stage.recipe
        reasons = blockers(self.work_model, recipe.components, recipe.trainer, stage.local, self.task)
        if reasons and self.vectorize is True:
            raise ConfigError(f"engine.vectorize = true: stage {stage.name!r} cannot train its clients together: "
                             + "; ".join(reasons) + ' (use "auto" to train such a stage sequentially)')
        return reasons

    def vectorizes(self, num_clients: int) -> bool:
        """Whether this stage trains ``num_clients`` clients together (``run_many``)."""
        return bool(self.vectorize) and not self.sequential_reasons and num_clients >= 2

    def enter_round(self, r: int) -> None:
        self.enter_stage(stage_of_round(self.stages, r))

    # -- training ---------------------------------------------------------------------------------

    @torch.no_grad()
    def load(self, client: int, global_state: Mapping[str, torch.Tensor]) -> nn.Module:
        """The work model holding ``global_state`` and this client's personal entries (the global values
        for a client that has none yet)."""
        for k, v in global_state.items():
            self._wstate[k].copy_(v)
        if self.layout.personal_keys:
            personal = self.store.get(PERSONAL, client)
            if personal is not None:
                # only this stage's non-shared entries: a later stage that shares them again uses the
                # global values
                for k in self.layout.personal_keys:
                    if k in personal:
                        self._wstate[k].copy_(personal[k])
        return self.work_model

    def start(
        self, r: int, client: int, gstate: Mapping[str, torch.Tensor],
        broadcast: Mapping[str, Mapping[str, torch.Tensor]] | None = None, *, load: bool = True,
    ):
        """Load ``client``'s model into the work model and start its local work in round ``r`` (``gstate`` on the
        runtime's device): its context and state. ``load`` False: the work model holds that model already, prepared
        for this stage by the client started before (clients trained together from the same start)."""
        model = self.load(client, gstate) if load else self.work_model
        seed_torch(self.seed, "client", r, client)
        state = ClientState(self.store, client, r, self.device)
        lay = self.layout
        ctx = start_client(
            self.task, model, client, r, self.seed, self.stage.local, self.stage.recipe.components,
            {k: gstate[k].detach() for k in lay.shared_params}, lay.shared_buffers, state,
            {name: to_device(dict(t), self.device) for name, t in (broadcast or {}).items()},
            frozen=set(lay.frozen), global_state=dict(gstate), personal_keys=lay.personal_keys, cost=self.cost,
            prepare=load, noise=self.noise,
        )
        return ctx, state

    def run(
        self, r: int, client: int, global_state: Mapping[str, torch.Tensor],
        broadcast: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
    ) -> tuple[ClientResult, ClientState]:
        """One client's local work in round ``r`` from ``global_state`` (the whole global model state):
        its upload, and its state saves held in the returned ``ClientState`` until ``keep``."""
        self.enter_round(r)
        ctx, state = self.start(r, client, to_device(dict(global_state), self.device), broadcast)
        return self.stage.recipe.trainer.train(ctx, self.stage.recipe.components), state

    def run_many(
        self, r: int, clients: Sequence[int], global_state: Mapping[str, torch.Tensor],
        broadcast_for: Any = None,
    ) -> Iterator[tuple[int, ClientResult | ModelRefused, ClientState | None]]:
        """``run`` for several clients, trained together (``fedsight.training.vectorized``) at most
        ``max_clients_per_batch`` at a time: yields (client, its upload, its state), or (client, the
        ``ModelRefused``, None) for a client that refused the model, each group's clients in the order they are
        trained in (more local steps first). When the stage has personal entries (``keep`` reads them from the work
        model) or a component's ``client_end`` (which may read ``ctx.model``), the work model holds a client's
        trained weights while its upload is being consumed, so consume each before the next; otherwise the upload
        is read off the client's trained state and the work model is left alone (the deltas of clients that finish
        their steps together are then rows of one tensor each, computed as they leave the stacks; a component that
        keeps one beyond the round keeps those rows too). ``broadcast_for(client)``: what
        the client receives besides the model.

        Out of memory while training a group of clients together (a large model, many clients), the group starts
        over as two halves, and the width is kept for the rest of the run (a ``vectorize_width`` event in
        ``events``); nothing of the failed attempt is kept."""
        self.enter_round(r)
        self._sealed.clear()
        gstate = to_device(dict(global_state), self.device)
        components = self.stage.recipe.components
        local = self.stage.local.at_round(r)
        model_read = bool(self.layout.personal_keys) or any(
            type(c).client_end is not Component.client_end for c in components)
        # without personal entries or a component's client_start every client starts from the global state: the
        # work model loads it once a group and the stacks are one copy of it, expanded over the clients
        same_start = not self.layout.personal_keys and all(
            type(c).client_start is Component.client_start for c in components)
        subtract = {k: gstate[k] for k in self.layout.shared_params}  # (the shared entries that train)
        subtracted = set(subtract)
        width = self.max_clients_per_batch or len(clients)
        queue = [list(clients[i:i + width]) for i in range(0, len(clients), width)]
        while queue:
            # train_together's order, so that the start states go straight into its stacks (any order is right)
            group = sorted(queue.pop(0), key=lambda c: -local.num_steps(self.task.num_train_examples(c), self.seed,
                                                                         r, c))
            stacks = {} if same_start else start_stacks(self.work_model, self._wstate, len(group), components)
            started = []
            for cid in group:
                try:
                    ctx, state = self.start(r, cid, gstate, broadcast_for(cid) if broadcast_for else None,
                                            load=not (same_start and started))
                except ModelRefused as exc:
                    yield cid, exc, None
                    continue
                steps = [c.vector_step(ctx) for c in components]
                if not same_start:
                    with torch.no_grad():
                        for k, v in self._wstate.items():
                            stacks[k][len(started)].copy_(v)
                started.append((ctx, state, steps, torch.get_rng_state()))
            if not started:
                continue
            if same_start:  # one copy of the start state, every client's row a view of it (stride 0)
                stacks = {k: v.detach().clone().expand(len(started), *v.shape) for k, v in self._wstate.items()}
            ctxs, states, steps, rngs = zip(*started)
            # the uploads' deltas computed as the clients leave the stacks, unless the work model must hold each
            # client's trained weights, or a component moved a client's reference values (cluster aggregation: the
            # upload is relative to the cluster's entries), from which make_result then takes each client's delta
            rebased = any(ctx.global_params[k].data_ptr() != gstate[k].data_ptr() for ctx in ctxs for k in subtract)
            deltas = None if model_read or rebased else subtract
            try:
                trained = train_together(ctxs, {k: v[:len(ctxs)] for k, v in stacks.items()}, components, steps,
                                         rngs, subtract=deltas)
            except OUT_OF_MEMORY:
                if len(ctxs) == 1:
                    raise
                half = (len(ctxs) + 1) // 2
                ids = [c.client_id for c in ctxs]
                del started, ctxs, states, stacks, steps, rngs
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                queue[:0] = [ids[:half], ids[half:]]
                self.max_clients_per_batch = half
                self.events.append({"round": r, "event": "vectorize_width", "max_clients_per_batch": half,
                                    "reason": f"out of memory training {len(ids)} clients together"})
                continue
            del stacks
            for ctx, state, final, loss, finite in zip(ctxs, states, trained.states, trained.losses.tolist(),
                                                       trained.finite):
                if model_read:
                    with torch.no_grad():
                        for k, v in final.items():
                            self._wstate[k].copy_(v)
                    yield ctx.client_id, make_result(ctx, components, loss, ctx.num_steps), state
                    continue
                res = make_result(ctx, components, loss, ctx.num_steps, final, {k: final[k] for k in deltas or {}})
                # the upload holds the deltas and (copies of) the buffers train_together proved finite: keep need
                # not read them again
                if finite and deltas and not res.extras and set(res.delta) <= subtracted:
                    self._sealed[ctx.client_id] = FiniteSeal.of(res)
                yield ctx.client_id, res, state

    def train(
        self, r: int, client: int, global_state: Mapping[str, torch.Tensor],
        broadcast: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
    ) -> tuple[ClientResult, bool]:
        """``run`` then ``keep``: the upload and whether the client kept its outcome."""
        res, state = self.run(r, client, global_state, broadcast)
        return res, self.keep(res, state)

    def keep(self, res: ClientResult, state: ClientState) -> bool:
        """Keep a client's outcome (right after training, while the work model holds it) if every value
        is finite: its personal entries and held component state go to the store."""
        personal = self.personal_entries(res.client_id) if self.layout.personal_keys else {}
        pending = [t for tensors in state.pending.values() for t in tensors.values()]
        seal = self._sealed.pop(res.client_id, None)
        if not (is_finite_result(res, seal) and all_finite(personal) and all_finite(dict(enumerate(pending)))):
            state.commit(only_always=True)
            return False
        if personal:
            self.store.put(PERSONAL, res.client_id, state.round, personal)
        state.commit()
        return True

    def personal_entries(self, client: int) -> dict[str, torch.Tensor]:
        """The work model's entries to keep for ``client``: its changing personal entries, and the
        constant ones it already holds from an earlier stage (a personal head frozen for FP(phi))."""
        lay = self.layout
        # only a constant personal key needs the stored copy (a second read of the client's file otherwise)
        held = (self.store.get(PERSONAL, client) or {}) if any(k in lay.constant for k in lay.personal_keys) else {}
        return {k: self._wstate[k].detach() for k in lay.personal_keys if k not in lay.constant or k in held}

    # -- local evaluation -------------------------------------------------------------------------

    def uses_own_model(self) -> bool:
        """Whether clients are evaluated on their own models (personal entries or a personal-evaluation
        component) rather than on the global model."""
        return bool(self.layout.personal_keys) or personal_eval(self.stage)

    def eval_context(self, split: str | int) -> EvalContext:
        return EvalContext(self.task, split, self.eval_batch_size, self.layout.personal_keys,
                           self.layout.shared_params, self.store)

    def class_split(self, client: int, global_state: Mapping[str, torch.Tensor]) -> tuple[float, float]:
        """``client``'s (accuracy on its own classes, on the others), class-wise, on the global test set, with the
        model and evaluation hooks its local test set is evaluated with (``fedsight.class_split``)."""
        from ..class_split import class_counts, split_accuracy
        from ..recipe.oll import local_classes

        model = self.load(client, to_device(dict(global_state), self.device))
        with eval_hooks(self.stage, model, self.eval_context(client)):
            correct, count = class_counts(model, self.task, self.eval_batch_size)
        return split_accuracy(correct, count, local_classes(self.task, client))

    def local_state(
        self, client: int, global_state: Mapping[str, torch.Tensor], global_model: nn.Module | None = None
    ) -> MetricState:
        """The metric state of ``client``'s local test set on the model it is evaluated with: the global
        model (``global_model`` when the caller holds it, else ``global_state`` loaded into the work
        model), or the global shared entries plus its personal ones; inside the stage's evaluation hooks."""
        if self.uses_own_model() or global_model is None:
            model = self.load(client, to_device(dict(global_state), self.device))
        else:
            model = global_model
        return evaluate_split(self.stage, model, self.eval_context(client))
