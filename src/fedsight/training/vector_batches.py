"""The inputs of the vectorised step (``fedsight.training.vectorized``): each client's batches and dropout noise,
drawn where and as its sequential training draws them, grouped into stacks step by step.

* each client's index batches come from its stream ("shuffle", round, client), its batches from
  ``task.train_batches`` and every component's ``transform_batch``, drawing from the client's own state of torch's
  global generator (``rng_states``: as its sequential training finds it after ``client_start``); or, from a task
  holding its examples in memory and no component transforming them, a step's batches of all the clients in one
  gather (``Task.train_batch_stack``);
* each client's ``nn.Dropout`` noise is drawn before the step, from the same state, in the order the forward calls
  the layers (``noise_calls`` probes the shapes once per batch shape): on a CPU the masks of sequential training
  bit for bit; so is the noise of a component's mechanism on a module's output (``VectorStep.output_noise``), from
  the client's own generator, for its real examples;
* at every step the clients still training are grouped by the structure, shapes and dtypes of their batches
  (without the batch size where a padded batch's mean can skip the padding), each group stacked and padded.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..device import to_device
from ..rng import torch_gen
from .component import Component, OutputNoise
from .context import ClientContext
from .local import batch_positions, chosen_positions

#: the positions of the padding batch of an empty (Poisson) batch: the client's first example, masked out
PAD = torch.zeros(1, dtype=torch.long)


@dataclass
class NormState:
    """What the functional layers of one forward share: the new running statistics the BatchNorms computed (by
    state key), the mask of the batch's real examples (None: every example is real), and the noise of this
    forward, one tensor per noise call (a dropout, a mechanism on a module's output) in call order (``noise_at``:
    the next one). While ``probe`` is a list, the noise calls only record themselves there (``noise_calls``)."""

    updates: dict[str, torch.Tensor] = field(default_factory=dict)
    mask: torch.Tensor | None = None
    noise: Sequence[torch.Tensor] = ()
    noise_at: int = 0
    probe: list[tuple[str, tuple[int, ...], torch.dtype, Any]] | None = None

    def next_noise(self, kind: str, t: Any, arg: Any) -> torch.Tensor | None:
        """The noise of this call (None while probing: the call is recorded as (kind, t's shape and dtype, arg))."""
        if self.probe is not None:  # (a value other than a tensor recorded by its type's name, for the error)
            tensor = isinstance(t, torch.Tensor)
            self.probe.append((kind, tuple(t.shape) if tensor else type(t).__name__, t.dtype if tensor else None, arg))
            return None
        self.noise_at += 1
        return self.noise[self.noise_at - 1]


def dropout_with_noise(m: nn.Module, state: NormState, x: torch.Tensor) -> torch.Tensor:
    """``m``'s forward with the noise drawn beforehand (``draw_noise``): ``x * noise``, as torch's dropout (or a
    layer dropping whole examples, ``dropout_modules``: its mask over the first dimension)."""
    if not m.training or m.p == 0:
        return x
    noise = state.next_noise("examples" if getattr(m, "drops_examples", False) else "dropout", x, m.p)
    return x if noise is None else x * noise


def output_with_noise(forward: Any, index: int, apply: Any, state: NormState, *args: Any, **kwargs: Any) -> Any:
    """A module's ``forward`` followed by a component's mechanism ``apply(output, noise)`` (``OutputNoise``, the
    client's ``index``-th), with the noise drawn beforehand (``draw_noise``)."""
    out = forward(*args, **kwargs)
    noise = state.next_noise("output", out, index)
    return out if noise is None else apply(out, noise)


def draw_noise(calls: Sequence[tuple[str, tuple[int, ...], torch.dtype, Any]], device: torch.device,
               outputs: Sequence[OutputNoise] = ()) -> list[torch.Tensor]:
    """The noise of each call of ``calls`` (``noise_calls``) in call order. A dropout's: on a CPU drawn from torch's
    global generator exactly as torch's dropout draws it (``empty_like(input).bernoulli_(1 - p).div_(1 - p)``):
    the masks of sequential training, bit for bit. On another device (where sequential dropout draws from that
    device's generator, which nothing seeds per client) it is drawn there, from a generator seeded by one number
    of the global CPU generator: a deterministic function of (seed, round, client), without building masks on the
    CPU and copying them over. A module output's: ``outputs[index].draw`` (the client's own generator)."""
    gen = None
    if device.type != "cpu" and any(kind != "output" for kind, *_ in calls):
        gen = torch.Generator(device=device)
        gen.manual_seed(int(torch.randint(2**62, (1,))))
    out = []
    for kind, shape, dtype, arg in calls:
        if kind == "output":
            out.append(outputs[arg].draw(shape, dtype))
            continue
        if kind == "examples":  # (a mask per example, broadcast over the rest)
            shape = (shape[0], *(1,) * (len(shape) - 1))
        noise = torch.empty(shape, dtype=dtype, device=device)
        out.append(noise.zero_() if arg == 1 else noise.bernoulli_(1 - arg, generator=gen).div_(1 - arg))
    return out


def dropout_modules(model: nn.Module) -> list[nn.Module]:
    """The model's layers that draw dropout noise (p > 0): ``nn.Dropout``, and layers that declare
    ``drops_examples`` (stochastic depth, ``fedsight.models.pose.DropPath``: ``x * mask`` with a mask over the first
    dimension, drawn as ``x.new_empty((N, 1, ...)).bernoulli_(1 - p).div_(1 - p)``)."""
    return [m for m in model.modules() if (type(m) is nn.Dropout or getattr(m, "drops_examples", False)) and m.p > 0]


@torch.no_grad()
def noise_calls(model: nn.Module, x: Any, state: NormState) -> list[tuple[str, tuple[int, ...], torch.dtype, Any]]:
    """(kind, shape, dtype, arg) of every noise call of a training forward of ``model`` on ``x`` in call order: each
    dropout's input (arg: p), each noised module output (arg: its ``OutputNoise``'s index). A forward that draws
    nothing: the calls pass their values through, the functional BatchNorms write only to ``state``."""
    state.probe = []
    try:
        model(x)
        return state.probe
    finally:
        state.probe = None
        state.updates.clear()


def _signature(leaves: Sequence[torch.Tensor], spec: Any, pad: bool) -> tuple:
    """What must be equal for batches (flattened: ``tree_flatten``) to be stacked: structure, shapes (without the
    batch size when ``pad``) and dtypes."""
    return (str(spec), *((tuple(t.shape[1:] if pad else t.shape), t.dtype) for t in leaves))


def stack_padded(tensors: Sequence[torch.Tensor], sizes: Sequence[int], size: int,
                 fill: float | None = None) -> torch.Tensor:
    """``tensors`` (``sizes[i]`` examples each) stacked along a new first dimension, each grown to ``size``
    examples by repeating its first one (real data: finite through any model), or by rows of ``fill``."""
    def grow(t: torch.Tensor, n: int) -> torch.Tensor:
        if n == size:
            return t
        shape = (size - n, *t.shape[1:])
        return torch.cat([t, t[:1].expand(shape) if fill is None else t.new_full(shape, fill)])
    return torch.stack([grow(t, n) for t, n in zip(tensors, sizes)])


class StepBatches:
    """The batches and noise of clients trained together (``ctxs``, on ``model``, with ``components``), step by
    step (``groups``). ``rng_states[i]``: torch's global CPU generator as client i's sequential training finds it
    after ``client_start`` (None: draw from the global generator as it is); ``pad``: clients whose batches differ
    only in their size share a group (padded); ``scope``: the backward's scope, for the FLOP count; ``outputs[i]``:
    client i's mechanisms on module outputs (``OutputNoise``, in the order ``output_with_noise`` indexes them);
    ``counts[i]``: client i's components' ``VectorStep.count`` functions; ``prepares[i]``: their ``VectorStep.prepare``
    functions, whose values go with the targets of each of client i's batches (``(targets, (prepared, ...))``)."""

    def __init__(self, ctxs: Sequence[ClientContext], components: Sequence[Component], model: nn.Module,
                 device: torch.device, rng_states: Sequence[torch.Tensor] | None, pad: bool, scope: Any,
                 outputs: Sequence[Sequence[OutputNoise]], counts: Sequence[Sequence[Any]],
                 prepares: Sequence[Sequence[Any]]):
        task, local = ctxs[0].task, ctxs[0].local
        self.ctxs, self.components, self.model, self.device = ctxs, components, model, device
        self.task, self.pad, self.scope = task, pad, scope
        # a task serving batches from tensors in memory gives a step's batches in one gather when no component
        # transforms them: nothing then draws from the clients' random states but their dropout noise
        self.prepares = prepares  # each client's ``VectorStep.prepare`` functions
        self.gather = task.stacks_train_batches() and not any(prepares) and all(
            type(c).transform_batch is Component.transform_batch for c in components)
        self.positions: list[list[Any]] = []
        self.iters: list[Iterator[Any]] = []
        for ctx in ctxs:  # (the batches a component chooses, DP-SGD's Poisson ones, as ``sgd_steps`` takes them)
            gen = torch_gen(ctx.seed, "shuffle", ctx.round, ctx.client_id)
            chosen = chosen_positions(ctx, components, ctx.num_steps, gen)
            self.positions.append(list(batch_positions(ctx.num_examples, local.batch_size, ctx.num_steps, gen)
                                       if chosen is None else chosen))
            if not self.gather:  # (an empty batch loads nothing: ``_client``)
                self.iters.append(iter(task.train_batches(ctx.client_id, [p for p in self.positions[-1] if len(p)],
                                                          seed=ctx.seed, round=ctx.round)))
        self.rng = list(rng_states) if rng_states is not None else None
        self.drops = bool(dropout_modules(model))
        self.outputs = outputs  # each client's mechanisms on module outputs
        self.noisy = self.drops or any(outputs)
        self.counts = counts  # each client's ``VectorStep.count`` functions
        self.probed: dict[tuple, list] = {}  # noise calls by batch signature

    def _client(self, i: int, s: int, norms: NormState, gathered: tuple[Any, int] | None = None
                ) -> tuple[Any, list[torch.Tensor]]:
        """Client i's batch of step s (after the components' transforms; None when ``gathered``: the stacked inputs
        of its group, row j its own) and its dropout noise, drawn from the client's own random state where its
        sequential training would draw them. An empty batch (Poisson sampling) is one padding example, the client's
        first, untransformed, with noise drawn for its forward: sequential training loads and draws nothing for it,
        so the client's random state is left as it was."""
        ctx, rng = self.ctxs[i], self.rng
        ctx.step = s
        batch = None
        n = len(self.positions[i][s])
        if rng is not None and (gathered is None or self.drops):
            torch.set_rng_state(rng[i])
        if gathered is None:
            if n:
                x, y = to_device(next(self.iters[i]), self.device)
                for c in self.components:
                    x, y = c.transform_batch(ctx, x, y)
            else:
                x, y = to_device(next(iter(self.task.train_batches(ctx.client_id, [PAD], seed=ctx.seed,
                                                                   round=ctx.round))), self.device)
            if self.prepares[i]:  # (a frozen teacher's pseudo-labels: the batch's targets go with them)
                with torch.no_grad():
                    y = (y, tuple(prepare(x, y) for prepare in self.prepares[i]))
            batch = (x, y)
        noise = []
        if self.noisy:
            if gathered is not None:  # (its row of the group's stack, without the padding: its own batch)
                x = tree_map(lambda t: t[gathered[1]][:max(n, 1)], gathered[0])
            sig = _signature(*tree_flatten(x), False)
            if sig not in self.probed:
                self.probed[sig] = noise_calls(self.model, x, norms)
            noise = draw_noise(self.probed[sig], self.device, self.outputs[i])
        if rng is not None and (batch is not None or self.drops) and n:
            rng[i] = torch.get_rng_state()
        for count in self.counts[i]:  # (what the components' sequential hooks count during the step, first)
            count(n)
        if ctx.cost is not None:
            ctx.flops += ctx.cost.train_step(n, self.scope)
        return batch, noise

    def groups(self, s: int, live: int, norms: NormState) -> Iterator[tuple[list[int], list[int], Any, dict[int, Any]]]:
        """The groups of step s of the first ``live`` clients (those still training): (clients, their batch sizes,
        their batches stacked and padded to the largest, each client's dropout noise). A client's size is its number
        of real examples: 0 for an empty batch, which is stacked as one padding example."""
        groups: dict[tuple, list[int]] = {}
        noise: dict[int, Any] = {}
        positions = self.positions
        if self.gather:
            for i in range(live):
                groups.setdefault(() if self.pad else (len(positions[i][s]),), []).append(i)
            for idx in groups.values():
                sizes = [len(positions[i][s]) for i in idx]
                # a short batch padded with its first example's index: the padding stack_padded gives
                where = stack_padded([positions[i][s] if len(positions[i][s]) else PAD for i in idx],
                                     [max(n, 1) for n in sizes], max(max(sizes), 1))
                xy = to_device(self.task.train_batch_stack([self.ctxs[i].client_id for i in idx], where), self.device)
                for j, i in enumerate(idx):
                    noise[i] = self._client(i, s, norms, (xy[0], j))[1]
                yield idx, sizes, xy, noise
            return
        flat = {}
        for i in range(live):
            batch, noise[i] = self._client(i, s, norms)
            flat[i] = tree_flatten(batch)
            groups.setdefault(_signature(*flat[i], self.pad), []).append(i)
        for idx in groups.values():
            rows = [len(flat[i][0][0]) for i in idx]
            columns = zip(*(flat[i][0] for i in idx))
            xy = tree_unflatten([stack_padded(c, rows, max(rows)) for c in columns], flat[idx[0]][1])
            yield idx, [n if len(positions[i][s]) else 0 for i, n in zip(idx, rows)], xy, noise
