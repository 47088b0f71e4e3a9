"""The local training loop, written once for every task and recipe.

Recipe components plug in through hooks (``fedsight.training.component.Component``): output transforms, extra
loss terms, gradient transforms after ``backward()``, and upload transforms at the end. What a client
does in a round is a ``Trainer``: plain SGD by default; a component may claim the slot with a different
local procedure (FedAlt's alternating passes, Ditto's personal model, Fed3R's statistics pass).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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

#: the parameter groups ``train.freeze`` may name (``FedModel.parameter_groups``)
FREEZABLE = ("backbone", "head", "norm")


@dataclass(frozen=True)
class LocalTraining:
    """Local optimisation: SGD over whole epochs, a fixed number of steps, or (heterogeneous local
    work, as FedNova studies) a number of steps drawn per round and client uniformly from
    ``steps_range`` = (low, high) inclusive, from the stream ("steps", round, client).

    ``temperature`` divides the model's outputs before the task loss: the tempered softmax of thesis
    eq. 3.2 (tau = 0.1 after a Fed3R initialisation, Sec. 3.7); a model returning a tuple (main and auxiliary
    outputs) has every element divided. ``lr_schedule = "poly"`` decays the rate within each round
    (``lr_factor``). ``freeze`` names parameter groups that
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

    def lr_factor(self, step: int, num_steps: int) -> float:
        """The learning-rate multiplier at local step ``step`` (0-based) of ``num_steps``: 1 for a constant
        rate; ``(1 - step / (lr_horizon num_steps))^lr_power`` for the per-client poly schedule (restarted
        every round: FedDrive's clients build their scheduler in every round)."""
        if self.lr_schedule != "poly" or num_steps <= 0:
            return 1.0
        return max(0.0, 1.0 - step / (self.lr_horizon * num_steps)) ** self.lr_power

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
    """Train mode, ``requires_grad`` off for frozen parameters, fully frozen norm layers in eval mode."""
    model.train()
    for k, p in model.named_parameters():
        p.requires_grad_(k not in frozen)
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


def local_objective(ctx: ClientContext, components: Sequence[Component], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The local objective on one batch: the task loss of the (component-transformed) outputs divided
    by the temperature, plus every component's loss term."""
    ctx.inputs = x
    out = ctx.model(x)
    for c in components:
        out = c.outputs(ctx, out)
    tau = ctx.local.temperature
    if tau != 1.0:
        tempered = tuple(o / tau for o in out) if isinstance(out, (tuple, list)) else out / tau
    else:
        tempered = out
    loss = ctx.task.loss(tempered, y)
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
    """``num_steps`` SGD steps on ``params`` over the client's shuffled data (stream (``stream``, round,
    client)), with every component's hooks; returns the summed objective (in the model's floating dtype,
    on its device). ``extra_loss(model)`` adds a trainer's own term (Ditto's proximal term). Batches come
    from ``task.train_batches`` (which may prefetch) and move to the model's device. Adds the steps'
    FLOPs to ``ctx.flops``."""
    task, model, local = ctx.task, ctx.model, ctx.local
    base_lr = local.lr if lr is None else lr
    opt = torch.optim.SGD(params, lr=base_lr, momentum=local.momentum, weight_decay=local.weight_decay)
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
        for c in components:
            c.after_backward(ctx)
        if local.lr_schedule != "constant":
            for group in opt.param_groups:
                group["lr"] = base_lr * local.lr_factor(step, num_steps)
        opt.step()
        loss_sum.add_(loss.detach())
        if ctx.cost is not None:
            ctx.flops += ctx.cost.train_step(len(pos), scope)
    return loss_sum


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


def make_result(ctx: ClientContext, components: Sequence[Component], loss_sum: float, steps: int) -> ClientResult:
    """The upload: delta of the shared trainable parameters (local minus received global), the shared
    buffers, ``train/loss`` (mean objective over ``steps``); then every component's ``client_end``."""
    params = dict(ctx.model.named_parameters())
    buffers = dict(ctx.model.named_buffers())
    with torch.no_grad():
        keys = list(ctx.global_params)
        local_params = [params[k].detach() for k in keys]
        delta = dict(zip(keys, torch._foreach_sub(local_params, [ctx.global_params[k] for k in keys]))) if keys else {}
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


def train_client(
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
    trainer: Trainer | None = None,
    frozen: set[str] | None = None,  # the engine's per-stage set (everything for a statistics pass)
    global_state: dict[str, torch.Tensor] | None = None,
    personal_keys: Sequence[str] = (),
    cost=None,
) -> ClientResult:
    """Run ``trainer`` (default: SGD) for one client on ``model``, which already holds the received
    global weights (and the client's personal entries).

    Returns the delta of the shared trainable parameters (local minus received global), the shared
    buffers after training, and the mean local objective ``train/loss`` over the steps taken.
    """
    n = task.num_train_examples(client)
    frozen = set(frozen or ())
    ctx = ClientContext(
        client_id=client, round=round, model=model, global_params=global_params, num_examples=n, seed=seed,
        state=state, num_steps=local.num_steps(n, seed, round, client), local=local, broadcast=broadcast or {},
        task=task, shared_buffers=list(shared_buffers), frozen=frozen, global_state=global_state or {},
        personal_keys=list(personal_keys), cost=cost,
    )
    prepare_model(model, frozen)
    for c in components:
        c.client_start(ctx)
    return (trainer or SGD_TRAINER).train(ctx, components)
