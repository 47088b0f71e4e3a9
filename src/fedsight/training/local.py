"""The local training loop, written once for every task and recipe.

Recipe components plug in through hooks (``fedsight.training.component.Component``): output transforms, extra
loss terms, gradient transforms after ``backward()``, and upload transforms at the end. What a client
does in a round is a ``Trainer``: plain SGD by default; a component may claim the slot with a different
local procedure (FedAlt's alternating passes, Ditto's personal model, Fed3R's statistics pass).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any
from dataclasses import dataclass

import torch
from torch import nn

from ..models.base import NORM_TYPES
from ..records import ClientResult
from ..rng import np_rng, torch_gen
from ..device import model_device, to_device
from ..tasks.base import Task
from .component import Component
from .context import ClientContext, ClientState
from .optim import AdamDirection

#: the parameter groups ``train.freeze`` may name (``FedModel.parameter_groups``)
FREEZABLE = ("backbone", "head", "norm")


OPTIMIZERS = ("sgd", "adam", "adamw")
LR_SCHEDULES = ("constant", "poly", "step", "cosine")


@dataclass(frozen=True)
class LocalTraining:
    """Local optimisation: whole epochs, a fixed number of steps, or (heterogeneous local
    work, as FedNova studies) a number of steps drawn per round and client uniformly from
    ``steps_range`` = (low, high) inclusive, from the stream ("steps", round, client).

    ``optimizer``: ``"sgd"`` (``torch.optim.SGD`` with ``momentum`` and coupled ``weight_decay``);
    ``"adam"``: ``torch.optim.Adam(lr, betas, eps, weight_decay)``, whose L2 decay ``wd p`` is added to the
    gradient before the moments; ``"adamw"``: ``torch.optim.AdamW(lr, betas, eps, weight_decay)``, the
    decoupled decay ``lr wd p``. Adam runs as a gradient transform on the SGD loop
    (``fedsight.training.optim.AdamDirection``, see ``sgd_steps`` for where it sits among the components'
    hooks) with ``momentum = 0``. Its moments start at zero at every local pass: every client in every round
    (clients keep nothing between rounds unless a component stores it in their state), and each of a
    trainer's passes (Ditto's personal pass, FedAlt's two blocks) starts its own.

    Learning rate. ``lr_schedule = "poly"`` decays the rate within each round (``lr_factor``); ``"step"``
    and ``"cosine"`` set each round's rate (``lr_at_round``) over the whole run of ``total_rounds`` rounds,
    as ``torch.optim.lr_scheduler.StepLR`` / ``CosineAnnealingLR(T_max = total_rounds, eta_min = lr_min)``
    stepped once per round. ``train_client`` hands the round's settings (``at_round``) to everything
    that reads ``ctx.local.lr``: the SGD step, SCAFFOLD's control-variate update, FedNova's normalising
    factor, Ditto's and pFedMe's steps.

    ``temperature`` divides the model's outputs before the task loss: the tempered softmax of thesis
    eq. 3.2 (tau = 0.1 after a Fed3R initialisation, Sec. 3.7); a model returning a tuple (main and auxiliary
    outputs) has every element divided. ``freeze`` names parameter groups that
    do not train (FT(psi) freezes ``backbone``, FT(phi) freezes ``head``); frozen parameters are neither
    uploaded nor re-downloaded, and normalisation layers whose parameters are all frozen run in eval mode
    (their running statistics stay fixed)."""

    batch_size: int
    lr: float
    epochs: int | None = 1
    steps: int | None = None
    steps_range: tuple[int, int] | None = None
    momentum: float = 0.0
    weight_decay: float = 0.0
    temperature: float = 1.0
    freeze: tuple[str, ...] = ()
    lr_schedule: str = "constant"
    lr_power: float = 0.9
    lr_horizon: float = 1.0
    optimizer: str = "sgd"
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    lr_gamma: float = 0.1
    lr_step_rounds: int | None = None
    lr_min: float = 0.0
    #: R of the cosine schedule: the run's rounds (``server.rounds``, every stage together)
    total_rounds: int | None = None

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"train.optimizer = {self.optimizer!r}: expected one of {', '.join(OPTIMIZERS)}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"train.lr_schedule = {self.lr_schedule!r}: expected one of {', '.join(LR_SCHEDULES)}")
        if self.optimizer != "sgd" and self.momentum:
            raise ValueError(f"train.momentum = {self.momentum} with train.optimizer = {self.optimizer!r}: Adam keeps "
                             "its own first moment (train.betas); set train.momentum = 0")
        if self.lr_schedule == "step" and (self.lr_step_rounds is None or self.lr_step_rounds < 1):
            raise ValueError("train.lr_schedule = 'step' needs train.lr_step_rounds >= 1")
        if self.lr_schedule == "cosine" and (self.total_rounds is None or self.total_rounds < 1):
            raise ValueError("train.lr_schedule = 'cosine' needs the run's total_rounds (server.rounds)")

    def lr_factor(self, step: int, num_steps: int) -> float:
        """The learning-rate multiplier at local step ``step`` (0-based) of ``num_steps``: 1 unless the
        schedule is the per-client poly one, ``(1 - step / (lr_horizon num_steps))^lr_power`` (restarted
        every round: FedDrive's clients build their scheduler in every round)."""
        if self.lr_schedule != "poly" or num_steps <= 0:
            return 1.0
        return max(0.0, 1.0 - step / (self.lr_horizon * num_steps)) ** self.lr_power

    def lr_at_round(self, round: int) -> float:
        """The base rate of round ``round`` (1-based; the engine's ``ctx.round``, counted over the whole run):
        ``lr`` for ``"constant"`` and ``"poly"``; ``lr lr_gamma^floor((round - 1) / lr_step_rounds)`` for
        ``"step"``; ``lr_min + (lr - lr_min) (1 + cos(pi (round - 1) / R)) / 2`` with R = ``total_rounds``
        for ``"cosine"`` (``lr`` in round 1, reaching ``lr_min`` only after the last round). A round past R
        is an error (the schedule covers the run it was built for)."""
        e = max(round - 1, 0)
        if self.lr_schedule == "step":
            assert self.lr_step_rounds is not None
            return self.lr * self.lr_gamma ** (e // self.lr_step_rounds)
        if self.lr_schedule == "cosine":
            R = self.total_rounds
            assert R is not None
            if e >= R:
                raise ValueError(f"train.lr_schedule = 'cosine': round {round} is past the schedule's {R} rounds")
            return self.lr_min + (self.lr - self.lr_min) * (1.0 + math.cos(math.pi * e / R)) / 2.0
        return self.lr

    def at_round(self, round: int) -> "LocalTraining":
        """These settings with ``lr`` the rate of round ``round`` (``lr_at_round``) and the schedule spent
        (``"constant"``: applying ``at_round`` again changes nothing): what a client sees as ``ctx.local``. The
        same object when the rate does not change across rounds."""
        if self.lr_schedule not in ("step", "cosine"):
            return self
        return dataclasses.replace(self, lr=self.lr_at_round(round), lr_schedule="constant")

    @property
    def step_weight_decay(self) -> float:
        """The weight decay of the loop's SGD step: ``weight_decay`` for SGD and AdamW (decoupled: the step
        adds ``lr wd p`` to the Adam direction), 0 for Adam (its L2 term enters the gradient before the
        moments, ``adam_direction``)."""
        return 0.0 if self.optimizer == "adam" else self.weight_decay

    def adam_direction(self) -> AdamDirection | None:
        """A fresh Adam transform for one local pass (``train.optimizer`` adam/adamw), or None for SGD."""
        if self.optimizer == "sgd":
            return None
        return AdamDirection(self.betas, self.eps, l2=self.weight_decay if self.optimizer == "adam" else 0.0)

    def num_steps(self, num_examples: int, seed: int = 0, round: int = 0, client: int = 0) -> int:
        if self.steps_range is not None:
            lo, hi = self.steps_range
            return int(np_rng(seed, "steps", round, client).integers(lo, hi + 1))
        if self.steps is not None:
            return self.steps
        assert self.epochs is not None
        return self.epochs * math.ceil(num_examples / self.batch_size)


def frozen_keys(model: nn.Module, groups: Sequence[str]) -> set[str]:
    """``state_dict`` keys of the parameters in ``groups`` (``FedModel.parameter_groups``)."""
    if not groups:
        return set()
    pg = getattr(model, "parameter_groups", None)
    if pg is None:
        raise ValueError(f"train.freeze = {list(groups)}: model {type(model).__name__} declares no parameter groups")
    named = pg()
    params = {k for k, _ in model.named_parameters()}
    return {k for g in groups for k in named[g] if k in params}


def frozen_norm_layers(model: nn.Module, frozen: set[str]):
    """(state-key prefix, module) of the normalisation layers whose parameters are all frozen: they
    run in eval mode, so their running statistics stay fixed."""
    for mod_name, module in model.named_modules():
        if isinstance(module, NORM_TYPES):
            prefix = f"{mod_name}." if mod_name else ""
            own = [prefix + n for n, _ in module.named_parameters(recurse=False)]
            if own and all(k in frozen for k in own):
                yield prefix, module


def constant_keys(model: nn.Module, frozen: set[str]) -> set[str]:
    """State entries that cannot change during local training: frozen parameters, and the buffers of
    normalisation layers whose parameters are all frozen."""
    out = set(frozen)
    for prefix, module in frozen_norm_layers(model, frozen):
        out.update(prefix + n for n, _ in module.named_buffers(recurse=False))
    return out


def batch_positions(num_examples: int, batch_size: int, num_steps: int, gen: torch.Generator):
    """Yield ``num_steps`` index batches: successive shuffled passes over 0..n-1 (the last batch of a
    pass may be smaller)."""
    done = 0
    while done < num_steps:
        perm = torch.randperm(num_examples, generator=gen)
        for s in range(0, num_examples, batch_size):
            yield perm[s : s + batch_size]
            done += 1
            if done == num_steps:
                return


def prepare_model(model: nn.Module, frozen: set[str]) -> None:
    """Train mode, ``requires_grad`` off for frozen parameters, fully frozen norm layers in eval mode.
    It runs for every client: one walk over the modules (``named_parameters`` walks them again), and
    ``model.train()`` only when some module is in eval mode (its ``nn.Module.__setattr__`` on each module costs
    more than a small client's update on the CPU)."""
    modules = list(model.named_modules())
    if not all(m.training for _, m in modules):
        model.train()
    seen: set[int] = set()  # a parameter shared by two modules is named once, as ``named_parameters`` does
    for prefix, m in modules:
        for name, p in m._parameters.items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            key = f"{prefix}.{name}" if prefix else name
            if p.requires_grad == (key in frozen):
                p.requires_grad_(key not in frozen)
    if frozen:
        for _, module in frozen_norm_layers(model, frozen):
            module.eval()


def backward_scope(ctx: ClientContext, params: Sequence[nn.Parameter]) -> str:
    """Which part a backward pass traverses when ``params`` train (for the FLOPs estimate)."""
    if not params:
        return "none"
    head = getattr(ctx.model, "head", None)
    head_ids = {id(p) for p in head.parameters()} if head is not None else set()
    return "head" if head_ids and all(id(p) in head_ids for p in params) else "all"


def tempered(out: Any, tau: float) -> Any:
    """The model's outputs divided by the temperature ``tau`` (every element of a tuple of main and auxiliary
    outputs)."""
    if tau == 1.0:
        return out
    return tuple(o / tau for o in out) if isinstance(out, (tuple, list)) else out / tau


def local_objective(ctx: ClientContext, components: Sequence[Component], x: torch.Tensor,
                    y: torch.Tensor) -> torch.Tensor:
    """The local objective on one batch (after every component's ``transform_batch``): the task loss of the
    (component-transformed) outputs divided by the temperature, plus every component's loss term."""
    for c in components:
        x, y = c.transform_batch(ctx, x, y)
    ctx.inputs = x
    out = ctx.model(x)
    for c in components:
        out = c.outputs(ctx, out)
    loss = ctx.task.loss(tempered(out, ctx.local.temperature), y)
    for c in components:
        term = c.loss_term(ctx, out, y)
        if term is not None:
            loss = loss + term
    return loss


def sgd_steps(
    ctx: ClientContext,
    components: Sequence[Component],
    params: Sequence[nn.Parameter],
    num_steps: int,
    *,
    stream: str = "shuffle",
    lr: float | None = None,
    extra_loss=None,
) -> torch.Tensor:
    """``num_steps`` local steps on ``params`` over the client's shuffled data (stream (``stream``, round,
    client)), with every component's hooks; returns the summed objective (in the model's floating dtype,
    on its device). ``extra_loss(model)`` adds a trainer's own term (Ditto's proximal term). Batches come
    from ``task.train_batches`` (which may prefetch) and move to the model's device. Adds the steps'
    FLOPs to ``ctx.flops``.

    Each step: ``backward()``, the components' ``after_backward`` in list order, then the SGD step
    (``train.lr`` times the poly factor, momentum, ``LocalTraining.step_weight_decay``). With
    ``train.optimizer`` adam/adamw, Adam's transform (fresh moments for this pass) runs among the hooks
    right before the first ``step_correction`` component (SCAFFOLD), after all of them if there is none:
    gradient-shaping hooks listed before it (DP-SGD, FedDyn's clipping) feed Adam, and SCAFFOLD's
    ``c - c_i`` is added to the Adam direction (``fedsight.recipe.local_adam`` explains why)."""
    task, model, local = ctx.task, ctx.model, ctx.local
    base_lr = local.lr if lr is None else lr
    opt = torch.optim.SGD(params, lr=base_lr, momentum=local.momentum, weight_decay=local.step_weight_decay)
    adam = local.adam_direction()
    at = direction_position(components)
    before, after = components[:at], components[at:]
    indexed = list(enumerate(params))
    scope = backward_scope(ctx, params)
    device = model_device(model)
    loss_sum = loss_accumulator(model)
    gen = torch_gen(ctx.seed, stream, ctx.round, ctx.client_id)
    positions = chosen_positions(ctx, components, num_steps, gen)
    if positions is None:
        positions = list(batch_positions(ctx.num_examples, local.batch_size, num_steps, gen))
    batches = iter(task.train_batches(ctx.client_id, [p for p in positions if len(p)], seed=ctx.seed, round=ctx.round))
    for step, pos in enumerate(positions):
        ctx.step = step
        opt.zero_grad(set_to_none=True)
        if len(pos):
            x, y = to_device(next(batches), device)
            loss = local_objective(ctx, components, x, y)
            if extra_loss is not None:
                loss = loss + extra_loss(model)
            loss.backward()
        else:  # an empty (Poisson) batch: no data, zero gradient; the hooks still run (DP noise)
            loss = torch.zeros((), device=device)
            for p in params:
                p.grad = torch.zeros_like(p)
        for c in before:
            c.after_backward(ctx)
        if adam is not None:
            adam.apply_(indexed)
        for c in after:
            c.after_backward(ctx)
        if local.lr_schedule == "poly":
            for group in opt.param_groups:
                group["lr"] = base_lr * local.lr_factor(step, num_steps)
        opt.step()
        loss_sum.add_(loss.detach())
        if ctx.cost is not None:
            ctx.flops += ctx.cost.train_step(len(pos), scope)
    return loss_sum


def direction_position(components: Sequence[Component]) -> int:
    """Where ``train.optimizer``'s Adam transform runs among the components' ``after_backward`` hooks:
    before the first ``step_correction`` component, or after every hook."""
    return next((i for i, c in enumerate(components) if c.step_correction), len(components))


def misplaced_after_correction(components: Sequence[Component]) -> list[str]:
    """Components that shape the gradient in ``after_backward`` but are listed after a step correction: with
    an Adam ``train.optimizer`` their hook would run after Adam's transform (a DP-SGD gradient would not be
    what Adam sees), so that order is refused."""
    at = direction_position(components)
    return [c.name for c in components[at:] if not c.step_correction
            and type(c).after_backward is not Component.after_backward]


def chosen_positions(ctx: ClientContext, components: Sequence[Component], num_steps: int,
                     gen: torch.Generator) -> list[torch.Tensor] | None:
    """The index batches a component chooses (``Component.batch_positions``; at most one may), or None."""
    chosen = [(c.name, b) for c in components if (b := c.batch_positions(ctx, num_steps, gen)) is not None]
    if len(chosen) > 1:
        raise ValueError(f"components {[n for n, _ in chosen]} both choose the local batches; keep one")
    return chosen[0][1] if chosen else None


def loss_accumulator(model: nn.Module) -> torch.Tensor:
    """A zero scalar to sum losses into: on the model's device, in the dtype of its first floating
    parameter (float32 for a model without one), so a float64 model sums in float64."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return torch.zeros((), device=model_device(model), dtype=dtype)


def make_result(ctx: ClientContext, components: Sequence[Component], loss_sum: float, steps: int,
                state: Mapping[str, torch.Tensor] | None = None,
                delta: Mapping[str, torch.Tensor] | None = None) -> ClientResult:
    """The upload: delta of the shared trainable parameters (local minus received global), the shared
    buffers, ``train/loss`` (mean objective over ``steps``); then every component's ``client_end``. ``state``:
    the client's trained model state when the work model does not hold it (clients trained together whose
    components' ``client_end`` do not read the model); by default the model's. ``delta``: the deltas of some
    entries, computed already (``vectorized.train_together``'s ``subtract``)."""
    params = dict(ctx.model.named_parameters()) if state is None else state
    buffers = dict(ctx.model.named_buffers()) if state is None else state
    given = dict(delta or {})
    with torch.no_grad():
        keys = [k for k in ctx.global_params if k not in given]
        local_params = [params[k].detach() for k in keys]
        computed = iter(torch._foreach_sub(local_params, [ctx.global_params[k] for k in keys]) if keys else ())
        delta = {k: given[k] if k in given else next(computed) for k in ctx.global_params}
    result = ClientResult(
        client_id=ctx.client_id,
        num_examples=ctx.num_examples,
        delta=delta,
        buffers={k: buffers[k].detach().clone() for k in ctx.shared_buffers},
        metrics={"train/loss": float(loss_sum) / max(steps, 1)},
        num_steps=steps,
    )
    for c in components:
        c.client_end(ctx, result)
    result.flops = ctx.flops
    return result


class Trainer:
    """A client's local procedure in one round. The default is ``ctx.num_steps`` SGD steps on every
    trainable parameter (FedAvg's local update, and FedSim's joint update of shared and personal
    parameters)."""

    name = "sgd"
    #: False for a statistics pass (Fed3R, FedNCM): no parameter trains in such a stage
    trains: bool = True
    #: whether the client receives the shared model (cost accounting): Fed3R uses a public extractor
    downloads_model: bool = True

    def train(self, ctx: ClientContext, components: Sequence[Component]) -> ClientResult:
        params = [p for p in ctx.model.parameters() if p.requires_grad]
        loss_sum = sgd_steps(ctx, components, params, ctx.num_steps)
        return make_result(ctx, components, float(loss_sum), ctx.num_steps)


SGD_TRAINER = Trainer()


def start_client(
    task: Task,
    model: nn.Module,
    client: int,
    round: int,
    seed: int,
    local: LocalTraining,
    components: Sequence[Component],
    global_params: dict[str, torch.Tensor],
    shared_buffers: Sequence[str],
    state: ClientState | None = None,
    broadcast: dict[str, dict[str, torch.Tensor]] | None = None,
    *,
    frozen: set[str] | None = None,  # the engine's per-stage set (everything for a statistics pass)
    global_state: dict[str, torch.Tensor] | None = None,
    personal_keys: Sequence[str] = (),
    cost=None,
    prepare: bool = True,
    noise: str = "simulated",
) -> ClientContext:
    """The context of ``client``'s local work in round ``round`` (1-based) on ``model``, which already holds the
    received global weights (and the client's personal entries), with ``local`` at that round's rate
    (``LocalTraining.at_round``: ``ctx.local.lr`` is the round's lr); the model prepared (``prepare_model``; not
    when ``prepare`` is False: the caller prepared it, with the same ``frozen``, and nothing changed it since) and
    every component's ``client_start`` run."""
    n = task.num_train_examples(client)
    frozen = set(frozen or ())
    local = local.at_round(round)  # the round's rate under a step or cosine schedule
    ctx = ClientContext(
        client_id=client, round=round, model=model, global_params=global_params, num_examples=n, seed=seed,
        state=state, num_steps=local.num_steps(n, seed, round, client), local=local, broadcast=broadcast or {},
        task=task, shared_buffers=list(shared_buffers), frozen=frozen, global_state=global_state or {},
        personal_keys=list(personal_keys), cost=cost, noise=noise,
    )
    if prepare:
        prepare_model(model, frozen)
    for c in components:
        c.client_start(ctx)
    return ctx


def train_client(task: Task, model: nn.Module, client: int, round: int, seed: int, local: LocalTraining,
                 components: Sequence[Component], *args, trainer: Trainer | None = None, **kwargs) -> ClientResult:
    """Run ``trainer`` (default: SGD) for one client (the rest of the arguments: ``start_client``'s).

    Returns the delta of the shared trainable parameters (local minus received global), the shared
    buffers after training, and the mean local objective ``train/loss`` over the steps taken.
    """
    ctx = start_client(task, model, client, round, seed, local, components, *args, **kwargs)
    return (trainer or SGD_TRAINER).train(ctx, components)
