"""Vectorised local training: the clients of a round trained together as one computation.

Sequential training runs each sampled client's SGD steps one after another on one work model, so a small
model spends most of a step in per-operation overhead. Here the clients' weights are stacked along a leading
client dimension and every local step of every client is one ``torch.func.vmap`` of
``torch.func.grad`` over ``torch.func.functional_call`` of the same model: one kernel launch per operation for
all the clients (grouped convolutions, batched matrix products), on CPU and CUDA.

A model built only of common layers (``fedsight.training.fused``: convolutions, BatchNorm and GroupNorm, pooling,
activations, Linear, Dropout, residual adds; the small CNN, the ResNets, MobileNetV2) runs its forward for all
the clients as one ordinary computation instead, the clients folded into the channels, and is differentiated by
ordinary autograd: the same results, without functorch's per-operation cost and vmap's layout copies (measured
in ``docs/performance.md``). There, a task loss that is a mean of per-example losses (``Task.example_losses``)
with no component's term is computed for all the clients in one call, and an element-wise update (no component's
``grads``) runs on the stacks in place; otherwise the objective and the update are vmapped per client.

What each client computes is what ``fedsight.training.local.sgd_steps`` computes for it, to float tolerance
(the batched kernels round differently):

* the same index batches (each client's stream ("shuffle", round, client)), the same batches from
  ``task.train_batches`` and every component's ``transform_batch``, per client (or, from a task holding its
  examples in memory and no component transforming them, a step's batches of all the clients in one gather:
  ``Task.train_batch_stack``; the inputs of the steps come from ``fedsight.training.vector_batches``);
* unequal clients: at every step the clients that still have a step are grouped by the shapes of their batch
  (a short last batch, a client with fewer steps) and each group is one vmapped call; a client without a step
  is in no group, so its weights do not move (exactly, not by a zero mask);
* BatchNorm: a functional BatchNorm (``functional_batch_norm``) normalises each client's batch with its own
  statistics and returns each client's new running mean, variance and batch count, as ``nn.BatchNorm`` in train
  mode would leave them (torch's ``replace_all_batch_norm_modules_`` drops running statistics, which SiloBN and
  FedBN need); frozen norm layers (eval mode) read their running statistics;
* the local objective: the task loss of the tempered outputs plus every component's ``VectorStep`` terms;
  then every component's ``VectorStep.grads`` in list order, with ``train.optimizer``'s Adam / AdamW transform
  where ``sgd_steps`` puts it (or a component's own Adam, ``VectorStep.adam``, at its place), then SGD with
  ``train.momentum`` and ``train.weight_decay`` (torch's ``SGD`` update, momentum buffer starting at zero) at
  the step's rate (``train.lr_schedule = "poly"`` per client);
* randomness: each client's batches (and ``transform_batch``) draw from that client's own state of torch's
  global generator, which is what sequential training seeds per client; so does its ``nn.Dropout`` noise, drawn
  before the vmapped step in the order the forward calls the layers (``vector_batches.noise_calls`` probes the
  shapes once per batch shape), the masks of sequential training on a CPU bit for bit; a component's mechanism on
  a module's output (``VectorStep.output_noise``: ``dct_dp``) draws from the client's own generator likewise.

A component that clips each example's gradient (``VectorStep.clip_examples``: DP-SGD) makes the step
``fedsight.training.private_step``'s: a vmap over each client's batch of each example's gradient, inside the vmap
over the clients; its batches are the component's (``Component.batch_positions``: Poisson, an empty batch one
masked padding example) and its noise is drawn per step outside the call (``VectorStep.step_draw``).

One difference from ``torch.optim.SGD`` and ``AdamDirection``: a trainable parameter the loss does not reach gets a
zero gradient here (so weight decay, momentum and Adam's moments still move it), where they skip a parameter
without ``.grad``.

What cannot be vectorised (``blockers``) trains sequentially: a trainer other than the SGD loop's (Ditto's,
Fed3R's statistics pass, ...), a component that changes the step without a ``VectorStep`` or through a module hook
(``Component.hooks_the_model``; ``dct_dp`` hands its mechanism over instead: ``VectorStep.output_noise``) or that
says why it cannot as configured (``Component.vector_blocker``), a component that runs the model again within the
step (``Component.reruns_the_model``: RAF) with a model drawing dropout noise or a noised layer, a model that draws
random numbers in training other than through ``nn.Dropout`` or stochastic depth (``Dropout2d``, ...), a norm layer
with running statistics other than BatchNorm, per-example clipping on a task whose loss is not a mean of
per-example losses or beside a component that reruns the model or noises a layer (``_clipping_blockers``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_map

from ..device import model_device
from ..functional.aggregate import all_finite, finite_rows
from .component import Component, OutputNoise, VectorStep
from .context import ClientContext
from .fused import FusedPlan, clients_batch_norm
from .fused_trace import fused_plan
from .local import SGD_TRAINER, LocalTraining, backward_scope, direction_position, tempered
from .private_step import private_step
from .vector_batches import (
    NormState,
    StepBatches,
    dropout_modules,
    dropout_with_noise,
    output_with_noise,
    stack_padded,
)

#: the hooks that act inside a local step: a component overriding one needs a ``vector_step``
STEP_HOOKS = ("outputs", "batch_positions", "loss_term", "after_backward")


def blockers(model: nn.Module, components: Sequence[Component], trainer: Any, local: LocalTraining,
             task: Any = None) -> list[str]:
    """Why the stage's clients cannot be trained together (empty: they can); ``task``: the run's task, whose loss
    per-example clipping (``Component.clips_examples``) needs to be a mean of per-example losses."""
    out = _clipping_blockers(model, components, task)
    if trainer is not SGD_TRAINER:
        proc = getattr(trainer, 'name', type(trainer).__name__)
        out.append(f"the local procedure {proc!r} trains one client at a time")
    drops = [type(m).__name__ for m in dropout_modules(model)]
    noisy = [c.name for c in components if c.noises_a_layer]
    for c in components:
        if c.reruns_the_model and (drops or noisy):
            out.append(f"component {c.name!r} runs the model again within a step, and "
                       + (f"the model's dropout noise ({drops[0]})" if drops else f"the noise {noisy[0]!r} puts on a layer")
                       + " is drawn before the step for one forward only")
        if c.hooks_the_model:
            out.append(f"component {c.name!r} acts inside the forward through a module hook, one client at a time")
            continue
        overrides = [h for h in STEP_HOOKS if getattr(type(c), h) is not getattr(Component, h)]
        if overrides and type(c).vector_step is Component.vector_step:
            out.append(f"component {c.name!r} changes the local step ({', '.join(overrides)}) and has no vector_step")
        elif (why := c.vector_blocker()) is not None:
            out.append(f"component {c.name!r}: {why}")
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 and type(m) is not nn.Dropout:
            out.append(f"the model draws random numbers in training ({name or 'model'}: {type(m).__name__} "
                       f"p = {m.p:g}; only nn.Dropout is vectorised)")
        elif (isinstance(m, nn.modules.batchnorm._NormBase) and not isinstance(m, nn.modules.batchnorm._BatchNorm)
              and m.track_running_stats):
            out.append(f"{name}: {type(m).__name__} with running statistics (only BatchNorm is vectorised)")
    return out


def _clipping_blockers(model: nn.Module, components: Sequence[Component], task: Any) -> list[str]:
    """Why a component's per-example clipping (DP-SGD) cannot run in the vectorised step (``private_step``)."""
    clippers = [c.name for c in components if c.clips_examples]
    if not clippers:
        return []
    out = [f"components {clippers} both clip per-example gradients"] if len(clippers) > 1 else []
    for c in components:
        if c.reruns_the_model or c.noises_a_layer:
            out.append(f"component {c.name!r} {'runs the model again' if c.reruns_the_model else 'noises a layer'} "
                       f"within a step, which {clippers[0]!r}'s per-example gradients do not take apart")
    if task is not None and not getattr(task, "loss_is_example_mean", False):
        out.append(f"{clippers[0]!r} needs each example's gradient alone, and the task's loss is not a mean of "
                   f"per-example losses")
    out += [f"{clippers[0]!r}: {name} is a BatchNorm, which mixes a batch's examples" for name, m in model.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    return out


# -- functional BatchNorm (and dropout with noise drawn beforehand: ``vector_batches``) -----------------

def _batch_norm(m: nn.modules.batchnorm._BatchNorm, prefix: str, state: NormState, x: torch.Tensor) -> torch.Tensor:
    """``m``'s forward for one client (under vmap) as pure tensor operations: ``fused.clients_batch_norm`` of one
    client, its new running statistics put in ``state.updates``; with ``state.mask``, the batch statistics are
    those of the masked-in examples only (padding does not count)."""
    entries = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
    values = {prefix + n: t.unsqueeze(0) for n in entries if (t := getattr(m, n)) is not None}
    updates: dict[str, torch.Tensor] = {}
    mask = None if state.mask is None else state.mask.unsqueeze(0)
    y = clients_batch_norm(m, prefix, values, x, 1, mask, updates)
    state.updates.update({k: v.squeeze(0) for k, v in updates.items()})
    return y


@contextlib.contextmanager
def functional_batch_norm(model: nn.Module, outputs: Sequence[OutputNoise] = ()) -> Iterator[NormState]:
    """Within the block, every BatchNorm of ``model`` runs ``_batch_norm`` (vmap-safe: nothing in place) and
    puts its new running statistics, by state key, in the yielded state's ``updates``; every ``nn.Dropout`` runs
    ``dropout_with_noise`` (multiplies by the state's next noise tensor); the module of each of ``outputs`` applies
    its mechanism to its output with the state's next noise tensor (``output_with_noise``)."""
    state = NormState()
    patched = set()
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.forward = functools.partial(_batch_norm, m, f"{name}." if name else "", state)
            patched.add(m)
    for m in dropout_modules(model):
        m.forward = functools.partial(dropout_with_noise, m, state)
        patched.add(m)
    for index, spec in enumerate(outputs):
        m = model.get_submodule(spec.module)
        m.forward = functools.partial(output_with_noise, m.forward, index, spec.apply, state)
        patched.add(m)
    try:
        yield state
    finally:
        for m in patched:
            del m.forward


def batch_norm_buffers(model: nn.Module) -> set[str]:
    """State keys of the BatchNorm buffers (running statistics, batch counts)."""
    return {f"{name}.{b}" if name else b for name, m in model.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) for b, _ in m.named_buffers(recurse=False)}


# -- the vmapped step ------------------------------------------------------------------------------

def _step_functions(ctx: ClientContext, hooks: Sequence[tuple[str, VectorStep]], adam: Any, at: int, masked: bool):
    """One client's step as two pure functions: ``objective(params, own, out, y, mask)``, the local objective of
    the model's outputs ``out`` (and the trainable parameters ``params``), and ``update(params, grads, opt, own,
    lr, bias)`` -> (new params, new optimizer state), the step from the objective's gradients (``lr``: the client's
    rate, or the stacked clients' rates (k,) when ``update`` runs on stacks without vmap).
    ``hooks``: each stepping component's name and first client's ``VectorStep`` (its functions serve every
    client), the first ``at`` of them before the Adam transform ``adam`` (``AdamDirection``, or None), the rest
    after (``_adam_at``). The objective's ``x`` and ``forward``: the step's inputs and the client's model as a
    function, for ``VectorStep.forward_term``; where a component prepares values of the batch
    (``VectorStep.prepare``), ``y`` is (targets, the prepared values in hook order). ``masked``: the batch is
    padded and ``mask`` marks its real examples: the task loss is the mean of the real examples' losses (``loss`` of
    each example alone, ``Task.loss_is_example_mean``); ``sums``: unmasked, the number of examples a term reduced by
    a sum is multiplied by (one example's objective standing for its batch's: ``private_step``). The
    optimizer state is SGD's momentum buffer (``"mom"``, starting at zero, which torch's first step equals) or
    Adam's moments (``"m"``, ``"v"``: ``fedsight.training.optim.AdamDirection``'s arithmetic, t = the step
    number); ``bias``: Adam's bias corrections."""
    task, local = ctx.task, ctx.local
    tau, momentum, wd = local.temperature, local.momentum, local.step_weight_decay
    example_loss = functools.partial(_one_example, task.loss)
    prepared = [name for name, vs in hooks if vs.prepare is not None]  # (their order in the batch: StepBatches)

    def objective(params, own, out, y, mask, x=None, forward=None, sums=None):
        extra = {}
        if prepared:  # the batch's targets and what the components prepared of it
            y, values = y
            extra = dict(zip(prepared, values))
        for name, vs in hooks:
            if vs.outputs is not None:
                out = vs.outputs(own[name], out)
        scaled = tempered(out, tau)
        loss = masked_mean(example_loss, scaled, y, mask) if masked else task.loss(scaled, y)
        for name, vs in hooks:
            if vs.loss_term is not None:
                term = vs.loss_term(own[name], params, out, (y, extra[name]) if name in extra else y)
                if term is not None:
                    loss = loss + term
            if vs.forward_term is not None:
                each = vs.forward_term(own[name], params, forward, x, out, y)
                if each is not None:
                    loss = loss + (real_mean(each, mask) if masked else each.mean())
            for fn, reduction in vs.example_terms:
                if not masked:  # (``sums``: one example's objective stands for n in a sum: ``private_step``)
                    loss = loss + (fn(out, y) * sums if sums is not None and reduction == "sum" else fn(out, y))
                else:
                    term = masked_mean(functools.partial(_one_example, fn), out, y, mask)
                    loss = loss + (term if reduction == "mean" else term * mask.sum())
        return loss

    def update(params, grads, opt, own, lr, bias):
        new_opt = {}
        for i, (name, vs) in enumerate(hooks):
            if i == at and adam is not None:
                grads, new_opt = _adam(adam, params, grads, opt, bias)
            if vs.grads is not None:
                grads = dict(vs.grads(own[name], params, grads))
        if at == len(hooks) and adam is not None:
            grads, new_opt = _adam(adam, params, grads, opt, bias)
        new_params = {}
        for k, p in params.items():  # (one fused kernel per term: the update is memory-bound)
            # on the stacks (``lr`` stacked) the update writes over the parameters and the momentum buffers, which
            # train_together owns (the same arithmetic: ``out=`` an operand): a result written to memory not read
            # just before costs that memory a second time (measured in docs/performance.md); not over a start
            # state every client's row of which is one tensor (stride 0)
            stacks = lr.dim() > 0
            d = grads[k] if wd == 0 else torch.add(grads[k], p, alpha=wd)
            if momentum != 0:
                d = torch.add(d, opt["mom"][k], alpha=momentum, out=opt["mom"][k] if stacks else None)
                new_opt.setdefault("mom", {})[k] = d
            rate = lr.view(-1, *(1,) * (p.dim() - 1)) if stacks else lr  # the stacks', or one client's
            over = stacks and (p.shape[0] == 1 or p.stride(0) != 0)
            new_params[k] = torch.addcmul(p, rate, d, value=-1, out=p if over else None)
        return new_params, new_opt

    return objective, update


def _stacked_losses(ctx: ClientContext, hooks: Sequence[tuple[str, VectorStep]], masked: bool):
    """The clients' objectives (k,) from their stacked outputs (k, N, ...), targets and mask in one call, without
    vmap: where the objective is the task's loss alone (no component adds a term) and the task gives each example's
    loss (``Task.example_losses``, defined by the class that defines its ``loss``): each client's mean over its
    (real) examples, what ``objective`` computes. None otherwise."""
    task, tau = ctx.task, ctx.local.temperature
    if not getattr(task, "loss_is_example_mean", False) or any(
            vs.loss_term is not None or vs.example_terms or vs.forward_term is not None or vs.outputs is not None
            for _, vs in hooks):
        return None
    owner = lambda name: next((c for c in type(task).__mro__ if name in vars(c)), None)  # noqa: E731
    by = owner("example_losses")
    if by is None or by is not owner("loss"):  # (the base Task's raises; ``loss`` is abstract there)
        return None

    def losses(out: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        k, n = y.shape[:2]
        each = task.example_losses(tempered(out.flatten(0, 1), tau), y.flatten(0, 1)).view(k, n)
        return (each * mask).sum(1) / mask.sum(1) if masked else each.mean(1)

    return losses


def _vmapped_step(model: nn.Module, objective, update, norms: NormState, masked: bool, rest_dims):
    """The clients' step under ``vmap(grad(...))`` of the model's forward (any model): (params, other state,
    optimizer state, own tensors, inputs, targets, mask, dropout noise, lr, bias) -> (params, BatchNorm buffers,
    optimizer state, losses), everything but ``bias`` stacked over the clients (``rest``: where ``rest_dims``
    says). The functional BatchNorm computes the real examples' statistics on a padded batch (``norms.mask``)."""

    def loss_of(params, rest, own, x, y, mask, noise):
        norms.updates.clear()
        norms.noise, norms.noise_at = noise, 0

        def forward(inputs):  # (a forward term's model: the BatchNorm statistics go on from the forwards before)
            norms.mask = mask if masked else None
            try:
                return functional_call(model, {**params, **rest, **norms.updates}, (inputs,))
            finally:
                norms.mask = None

        out = forward(x)
        norms.noise = ()
        loss = objective(params, own, out, y, mask, x, forward)
        return loss, (loss.detach(), dict(norms.updates))

    def step(params, rest, opt, own, x, y, mask, noise, lr, bias):
        grads, (loss, new_buffers) = grad(loss_of, has_aux=True)(params, rest, own, x, y, mask, noise)
        new_params, new_opt = update(params, grads, opt, own, lr, bias)
        return new_params, new_buffers, new_opt, loss

    return vmap(step, in_dims=(0, rest_dims, 0, 0, 0, 0, 0, 0, 0, None), randomness="error")


def _fused_step(plan: FusedPlan, objective, update, masked: bool, rest_dims, elementwise: bool, direct=None):
    """The clients' step with the fused forward (``fedsight.training.fused``), the same signature and results as
    ``_vmapped_step``'s: the summed objectives differentiated by ordinary autograd with respect to the stacked
    parameters (each client's slice of the gradient is its own gradient); the objective vmapped over the clients,
    and the update too unless it is ``elementwise`` (no component's ``grads``, which may reduce over a client's
    tensors): then it runs on the stacks as they are, each client's rate broadcast over its rows (the same
    arithmetic without vmap's dispatch on every operation). ``direct``: the objectives in one call on tensor outputs
    and targets (``_stacked_losses``), or None."""
    vmapped = vmap(objective, in_dims=(0, 0, 0, 0, 0), randomness="error")

    def losses(params, own, out, y, mask):
        if direct is not None and isinstance(out, torch.Tensor) and isinstance(y, torch.Tensor):
            return direct(out, y, mask)
        return vmapped(params, own, out, y, mask)

    updates = update if elementwise else vmap(update, in_dims=(0, 0, 0, 0, 0, None), randomness="error")

    def step(params, rest, opt, own, x, y, mask, noise, lr, bias):
        k = len(lr)
        leaves = {n: p.detach().requires_grad_() for n, p in params.items()}
        values = {n: v if rest_dims[n] == 0 else v.expand(k, *v.shape) for n, v in rest.items()}
        new_buffers: dict[str, torch.Tensor] = {}
        with torch.enable_grad():
            out = plan.forward({**values, **leaves}, x, mask if masked else None, noise, new_buffers)
            loss = losses(leaves, own, out, y, mask)
            got = torch.autograd.grad(loss.sum(), list(leaves.values()), allow_unused=True)
        grads = {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(params.items(), got)}
        new_params, new_opt = updates(params, grads, opt, own, lr, bias)
        return new_params, new_buffers, new_opt, loss.detach()

    return step


def _adam(adam: Any, params, grads, opt, bias):
    """Adam's direction (``AdamDirection.apply_`` as a pure function): the new gradients and moments; ``bias``:
    (1 - beta1^t, sqrt(1 - beta2^t))."""
    b1, b2 = adam.beta1, adam.beta2
    out, m_new, v_new = {}, {}, {}
    for k, g in grads.items():
        if adam.l2:
            g = g + adam.l2 * params[k]
        m_new[k] = opt["m"][k] * b1 + (1 - b1) * g
        v_new[k] = opt["v"][k] * b2 + (1 - b2) * g * g
        out[k] = (m_new[k] / bias[0]) / (v_new[k].sqrt() / bias[1] + adam.eps)
    return out, {"m": m_new, "v": v_new}


def _one_example(fn, out: Any, y: Any) -> torch.Tensor:
    """``fn`` of one example as a batch of one."""
    return fn(tree_map(lambda t: t.unsqueeze(0), out), tree_map(lambda t: t.unsqueeze(0), y))


def real_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean of per-example ``values`` over the examples that ``mask`` marks real."""
    return (values * mask).sum() / mask.sum()


def masked_mean(per_example, out: Any, y: Any, mask: torch.Tensor) -> torch.Tensor:
    """The mean of ``per_example(out_j, y_j)`` over the examples j that ``mask`` marks real."""
    return real_mean(vmap(per_example)(out, y), mask)


def start_stacks(model: nn.Module, state: Mapping[str, torch.Tensor], n: int,
                 components: Sequence[Component] = ()) -> dict[str, torch.Tensor]:
    """Uninitialised stacks (n, ...) of ``state``'s entries, for ``train_together``'s ``starts``, in the memory
    layout its step computes in: the fused forward's (``FusedPlan.arrange``), or the ordinary contiguous one where
    the step runs under vmap (no plan for the model, or one of ``components`` noises a layer's output or reruns
    the model: ``vmapped_by``). Writing each client's start state into its row is then the only copy of it."""
    stacks = {k: torch.empty((n, *v.shape), dtype=v.dtype, device=v.device) for k, v in state.items()}
    plan = None if vmapped_by(components) else fused_plan(model)
    return stacks if plan is None else plan.arrange(stacks, empty=True)


def vmapped_by(components: Sequence[Component]) -> bool:
    """Whether ``components`` make the vectorised step run under vmap rather than the fused forward: one noises a
    layer's output (``Component.noises_a_layer``) or reruns the model (``Component.reruns_the_model``); both need
    the model's modules called per client."""
    return any(c.noises_a_layer or c.reruns_the_model for c in components)


def vmap_layout(stack: torch.Tensor) -> torch.Tensor:
    """``stack`` (n, ...) with each client's row in the ordinary contiguous layout (the same tensor where it is
    so already, an expanded one included), for the step under vmap. A row in the fused forward's layout (a
    convolution's weights channels-last, ``FusedPlan.arrange``) makes vmap's convolution return channels-last maps,
    and ``group_norm`` under vmap then fails: it copies its input into the input's suggested memory format, and
    vmap copies only into the contiguous one ("NYI: Tensor.clone(memory_format) inside vmap ... ChannelsLast")."""
    return stack if stack.dim() < 2 or stack[0].is_contiguous() else stack.contiguous()


class Trained(NamedTuple):
    """What ``train_together`` hands back, by client: its model state after its steps (``subtract``'s entries as
    deltas), the sum of its step objectives, and whether every tensor of that state was proven finite (by finite
    sums, ``functional.aggregate.finite_rows``, for the clients finishing together at once: False is "not
    proven", check the client's tensors themselves)."""

    states: list[dict[str, torch.Tensor]]
    losses: torch.Tensor
    finite: list[bool]


def train_together(
    ctxs: Sequence[ClientContext], starts: Mapping[str, torch.Tensor], components: Sequence[Component],
    steps: Sequence[Sequence[VectorStep | None]], rng_states: Sequence[torch.Tensor] | None = None,
    subtract: Mapping[str, torch.Tensor] | None = None,
) -> Trained:
    """Train the clients of ``ctxs`` (started: ``start_client``; all on one model, one stage) together.

    ``starts``: the clients' whole model states at the start (their global and personal entries), each entry
    stacked (row i: client i; ``start_stacks``; or, for clients that all start from one state, that state
    expanded over the rows), which the steps may update in place (the caller's stacks are consumed);
    ``steps[i]``: each component's ``vector_step`` for client i; ``rng_states[i]``: torch's global CPU generator
    as client i's sequential training would find it after ``client_start`` (seeded from the stream ("client",
    round, client)): each client's batches and ``transform_batch`` draw from their own state, so tasks that crop
    or augment with the global generator (image and video SR, keypoints) give every client the batches sequential
    training gives it.
    Returns each client's model state after its ``ctx.num_steps`` steps, the sum of each client's step
    objectives (in the model's floating dtype) and whether its state was proven finite (``Trained``);
    ``ctx.flops`` of each client is counted as in ``sgd_steps``. ``subtract``: values of trainable entries (the
    received global ones) to hand back each client's difference from instead of its final value (its upload's
    delta, contiguous, one subtraction for the clients finishing together as they leave the stacks, in place of
    copying their entries out; rows of one tensor per such set of clients). Clients given in the order of their
    step counts, most first, are trained without reordering their stacks."""
    ctx0 = ctxs[0]
    model, task, local = ctx0.model, ctx0.task, ctx0.local
    device = model_device(model)
    K = len(ctxs)
    # clients with more steps first: the clients still training at any step are then a prefix of the stacks,
    # which shrink (views, no copy) as clients finish, instead of being gathered and scattered back every step
    order = sorted(range(K), key=lambda i: -ctxs[i].num_steps)
    ctxs, steps = [ctxs[i] for i in order], [steps[i] for i in order]
    rng_states = [rng_states[i] for i in order] if rng_states is not None else None
    if order != list(range(K)):
        where = torch.tensor(order, device=device)
        starts = {k: v.index_select(0, where) for k, v in starts.items()}
    pad = bool(getattr(task, "loss_is_example_mean", False))
    trainable = [k for k, p in model.named_parameters() if p.requires_grad]
    subtract = dict(subtract or {})
    if not set(subtract) <= set(trainable):
        raise ValueError(f"subtract names entries that do not train: {sorted(set(subtract) - set(trainable))}")
    per_client = batch_norm_buffers(model) | set(ctx0.personal_keys)
    state_keys = list(starts)
    hooks = [(c.name, vs) for c, vs in zip(components, steps[0]) if vs is not None]
    # each client's mechanisms on module outputs (the first client's apply serves all): the step runs under vmap
    outputs = [[vs.output_noise for vs in client if vs is not None and vs.output_noise is not None] for client in steps]
    # ... or where a component's term runs the model again (``VectorStep.forward_term``), or clips each example's
    # gradient (``VectorStep.clip_examples``: ``private_step``)
    clipper = next(((name, vs.clip_examples) for name, vs in hooks if vs.clip_examples is not None), None)
    plan = None if outputs[0] or clipper or any(vs.forward_term is not None for _, vs in hooks) else fused_plan(model)
    if plan is None:  # (stacks laid out for the fused forward, by a caller that did not know: vmap's layout)
        starts = {k: vmap_layout(v) for k, v in starts.items()}
    P = {k: starts[k] for k in trainable}
    rest = {k: v if k in per_client else v[0] for k, v in starts.items() if k not in P}
    rest_dims = {k: 0 if k in per_client else None for k in rest}
    # the entries every client holds alike, checked once; each client's own, as it finishes (``retire``)
    alike_finite = all_finite({k: v for k, v in rest.items() if rest_dims[k] is None})
    proven = torch.zeros(K, dtype=torch.bool, device=device)
    adam, at = _adam_at(local, components, steps[0])
    own = {c.name: {k: torch.stack([steps[i][j].tensors[k] for i in range(K)]) for k in vs.tensors}
           for j, (c, vs) in enumerate(zip(components, steps[0])) if vs is not None}
    if plan is not None:
        P, own = plan.arrange(P), {name: plan.arrange(t) for name, t in own.items()}
    zeros = lambda: {k: torch.zeros_like(v) for k, v in P.items()}  # noqa: E731
    opt = {"mom": zeros()} if local.momentum != 0 else {}
    if adam is not None:
        opt = {"m": zeros(), "v": zeros()}
    dtype = next((v.dtype for v in P.values() if v.is_floating_point()), torch.float32)
    loss_sum = torch.zeros(K, device=device, dtype=dtype)
    scope = backward_scope(ctx0, [p for p in model.parameters() if p.requires_grad])

    counts = [[vs.count for vs in client if vs is not None and vs.count is not None] for client in steps]
    draws = [next(vs.step_draw for vs in client if vs is not None and vs.step_draw is not None) for client in steps
             ] if clipper else []
    prepares = [[vs.prepare for vs in client if vs is not None and vs.prepare is not None] for client in steps]
    batches = StepBatches(ctxs, components, model, device, rng_states, pad, scope, outputs, counts, prepares)

    finals: list[dict[str, torch.Tensor]] = [{}] * K  # by position in ``order``
    live = K  # clients still training: the first ``live`` of the stacks

    def retire(m: int) -> None:
        """The clients after the first m are done: keep their final states (``subtract``'s entries as deltas, one
        contiguous subtraction; the others copied while clients train on, as a view would keep the whole stack
        alive, or a view of the last ones where it is contiguous) and shrink the stacks to the first m (views)."""
        nonlocal P, opt, own, live
        if m == live:
            return
        stacked = {**P, **{k: v for k, v in rest.items() if rest_dims[k] == 0}}
        done = {}
        for k, v in stacked.items():
            rows = v[m:live]
            if k in subtract:
                with torch.no_grad():
                    done[k] = torch.sub(rows, subtract[k], out=torch.empty(rows.shape, dtype=rows.dtype, device=device))
            else:
                done[k] = rows if m == 0 and rows.is_contiguous() else rows.clone(memory_format=torch.contiguous_format)
        proven[m:live] = finite_rows(list(done.values())) if done else True
        split = {k: v.unbind(0) for k, v in done.items()}
        for j in range(m, live):
            finals[j] = {k: split[k][j - m] if k in split else rest[k] for k in state_keys}
        first = lambda v: v[:m]  # noqa: E731
        P, opt, own = tree_map(first, P), tree_map(first, opt), tree_map(first, own)
        rest.update({k: v[:m] for k, v in rest.items() if rest_dims[k] == 0})
        live = m

    def apply(vstep: Any, idx: list[int], *args: Any) -> None:
        """One step of the clients ``idx`` (all clients still training, or gathered and scattered back)."""
        nonlocal P, opt
        if len(idx) == live:
            P, new_buffers, opt, loss = vstep(P, rest, opt, own, *args)
            rest.update(new_buffers)
            loss_sum[:len(idx)].add_(loss)
            return
        where = torch.tensor(idx, device=device)
        pick = functools.partial(torch.index_select, dim=0, index=where)
        sub_rest = {k: pick(v) if rest_dims[k] == 0 else v for k, v in rest.items()}
        new_p, new_buffers, new_opt, loss = vstep(tree_map(pick, P), sub_rest, tree_map(pick, opt), tree_map(pick, own),
                                                  *args)
        for store, new in ((P, new_p), (rest, new_buffers), *((opt[n], new_opt[n]) for n in opt)):
            for k, v in new.items():
                store[k] = store[k].index_put((where,), v)  # deterministic on CUDA too
        loss_sum.index_add_(0, where, loss)

    with functional_batch_norm(model, outputs[0]) as norms:
        vsteps = {}
        for m in (False, True):
            objective, update = _step_functions(ctx0, hooks, adam, at, m)
            if clipper:  # (each example's objective alone: unmasked; the clipped sum masks the padding)
                vsteps[m] = private_step(model, _step_functions(ctx0, hooks, adam, at, False)[0], update, norms,
                                         rest_dims, *clipper, any(vs.loss_term is not None for _, vs in hooks))
                continue
            vsteps[m] = (_vmapped_step(model, objective, update, norms, m, rest_dims) if plan is None
                         else _fused_step(plan, objective, update, m, rest_dims,
                                          all(vs.grads is None for _, vs in hooks), _stacked_losses(ctx0, hooks, m)))
        b1, b2 = (adam.beta1, adam.beta2) if adam is not None else (0.0, 0.0)
        for s in range(max((c.num_steps for c in ctxs), default=0)):
            retire(sum(1 for c in ctxs if s < c.num_steps))
            for idx, sizes, xy, noise in batches.groups(s, live, norms):
                size = max(max(sizes), 1)  # (an empty batch is one padding example: ``StepBatches``)
                mask = (torch.arange(size, device=device) < torch.tensor(sizes, device=device)[:, None]).to(dtype)
                eps = [stack_padded(c, [max(n, 1) for n in sizes], size, 1.0) for c in zip(*(noise[i] for i in idx))]
                if clipper:  # (each client's draws of this step, in step order)
                    drawn = [draws[i]() for i in idx]
                    eps = (eps, {k: torch.stack([d[k] for d in drawn]) for k in drawn[0]})
                lr = torch.tensor([_rate(local, s, ctxs[i].num_steps) for i in idx], device=device, dtype=dtype)
                # Adam's bias corrections: t = s + 1 for every client at step s
                bias = torch.tensor([1.0 - b1 ** (s + 1), (1.0 - b2 ** (s + 1)) ** 0.5], device=device, dtype=dtype)
                apply(vsteps[min(sizes) < size], idx, *xy, mask, eps, lr, bias)
        retire(0)
    back = sorted(range(K), key=order.__getitem__)  # back[i]: client i's position in ``order``
    finite = proven.tolist()
    return Trained([finals[j] for j in back], loss_sum[back], [alike_finite and finite[j] for j in back])


def _adam_at(local: LocalTraining, components: Sequence[Component],
             steps: Sequence[VectorStep | None]) -> tuple[Any, int]:
    """The Adam transform of a vectorised step (``AdamDirection``: ``train.optimizer``'s, or the ``VectorStep.adam``
    of a component such as ``local_adam``, or None for SGD) and how many of the stepping components' hooks run
    before it: ``train.optimizer``'s before the first step correction (SCAFFOLD), after the hooks of the components
    listed before it (``sgd_steps``); a component's at its own place, as its ``after_backward`` runs."""
    hooks = [vs for vs in steps if vs is not None]
    own = next((i for i, vs in enumerate(hooks) if vs.adam is not None), None)
    if own is not None:
        return hooks[own].adam, own
    return local.adam_direction(), sum(1 for c, vs in zip(components[:direction_position(components)], steps)
                                       if vs is not None)


def _rate(local: LocalTraining, step: int, num_steps: int) -> float:
    return local.lr * local.lr_factor(step, num_steps) if local.lr_schedule == "poly" else local.lr
