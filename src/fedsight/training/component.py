"""The hooks a recipe part may implement (``Component``).

A recipe is a composition of parts (DESIGN.md section 1): local objective terms, update transforms,
a client weighting, an aggregator, a server optimizer, parameter sharing and stages. A *component* is
one named object that may contribute to several of these slots (SCAFFOLD adds a gradient correction on
the client and a server-side control update) and owns its state through ``state_dict()`` /
``load_state_dict()``. Every hook is optional; the default does nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..records import ClientResult
from .context import ClientContext, EvalContext, ServerContext, UploadContext

#: the shape of one uploaded tensor: an int per dimension, or a name for a size the server cannot know in advance
#: (bounded by ``ExtrasSpec.sizes``, and the same wherever the group repeats the name)
Shape = tuple[int | str, ...]


@dataclass(frozen=True)
class ExtrasSpec:
    """What every honest client of a stage uploads under ``result.extras[component.name]``, declared by the
    component from what the server knows (``Component.extras_spec``); the reply contract
    (``fedsight.engine.contract``) rejects a reply whose group differs.

    ``tensors``: exactly these names, each with its (shape, dtype); None for a component that declares nothing
    (any named finite tensors: a third-party component that predates declarations). ``sizes``: the inclusive
    bounds (low, high) of every named size in the shapes. ``check(group, result)``: what the values must be
    beyond shape, dtype and finiteness (the reason, or None), run only once everything else holds.
    ``required``: every honest client uploads the group (else it may be absent)."""

    tensors: Mapping[str, tuple[Shape, torch.dtype]] | None
    sizes: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    check: Callable[[Mapping[str, torch.Tensor], ClientResult], str | None] | None = None
    required: bool = True


@dataclass(frozen=True)
class OutputNoise:
    """A mechanism on one module's output in every training forward, with noise from the client's own generator
    (``dct_dp``), for vectorised training: ``module``, the module's qualified name; ``draw(shape, dtype)``, this
    client's noise for an output of that shape (its real examples only), drawn as its sequential training draws
    it, called once per forward in step order, outside the vectorised step; ``apply(output, noise)``, the
    mechanism on one client's output with that noise (pure: under vmap it sees one client's values)."""

    module: str
    draw: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
    apply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class VectorStep:
    """A component's part in one local step, as pure per-client functions, for vectorised training
    (``fedsight.training.vectorized``: the clients of a round trained together under ``torch.func.vmap``).

    ``tensors``: this client's own tensors (a control variate, a linear term), stacked over the clients by the
    trainer; each function sees one client's. ``loss_term(own, params, outputs, targets)``: the term
    ``Component.loss_term`` adds, from the client's trainable parameters ``params`` (name -> tensor) instead of
    the model's; ``grads(own, params, grads)``: the gradients ``Component.after_backward`` would leave (a new
    dict, nothing in place). Values every client shares (the received global model) may be closed over; a
    client's own values must come through ``tensors``.

    ``example_terms``: (term, reduction) pairs, each ``term(outputs, targets)`` of a batch being the ``reduction``
    ("mean" or "sum") over its examples of the same term of each example alone (a per-pixel loss over same-sized
    images): on a padded batch (``Task.loss_is_example_mean``) the trainer reduces them over the real examples
    only, where ``loss_term`` would see the padding.

    ``adam``: an ``AdamDirection`` (``fedsight.training.optim``) when ``after_backward`` turns the gradients into
    Adam's direction with moments fresh for each local pass (``local_adam``): moments are state across steps,
    which ``grads`` cannot keep, so the trainer keeps every client's stacked and computes the direction (its betas,
    eps and L2) at the component's place among the hooks.

    ``output_noise``: an ``OutputNoise`` where the component acts on a module's output inside the forward with
    random numbers (``dct_dp``, whose own hook the component removes: the trainer applies the mechanism). The
    step then runs under vmap (the fused forward calls no module).

    ``prepare(inputs, targets)``: what the component's ``loss_term`` needs of the client's batch that the weights in
    training do not change (a frozen teacher's pseudo-labels and logits: LADD's self-training), computed on the
    client's real batch before the step, outside the vectorised call and without gradient, drawing no random
    numbers: a tensor or a tuple or dict of tensors whose first dimension is the batch's examples. The component's
    ``loss_term`` then gets ``(targets, prepared)`` as its targets.

    ``outputs(own, outputs)``: the model's outputs as ``Component.outputs`` transforms them (OLL's mask of the
    classes a client does not hold), before the task loss and the other terms, in the components' order.

    ``forward_term(own, params, forward, inputs, outputs, targets)``: a term that runs the client's model again
    (RAF's forwards of lower-resolution copies of the batch): ``forward(x)`` is the model with the client's current
    weights in training mode on inputs ``x`` of the batch's examples (its BatchNorm layers normalise with the real
    examples' statistics and update their running statistics, as another forward of the model would); it returns
    each example's value (B,), or None, and the trainer adds their mean over the batch's real examples. The step
    then runs under vmap; a component with one declares ``Component.reruns_the_model`` (a model drawing dropout
    noise is then trained one client at a time). ``count(n)``: called once per local step of this client with its
    number of real examples, before the step's own FLOPs are counted: what the component's sequential hooks add to
    ``ctx.flops`` in that step (the extra forwards).

    ``clip_examples``: a clipping norm C where the component needs each example's gradient (DP-SGD): the trainer then
    computes, per client and step, the gradient of the objective of each real example alone through the model's
    forward (``fedsight.training.private_step``; what Opacus's per-sample hooks give), clips each to C over all the
    trainable parameters, and hands the component's ``grads`` in its ``own`` values, besides ``tensors``:
    ``clipped_sum`` (name -> the sum of the clipped gradients), ``example_mean`` (name -> the mean of the unclipped
    ones over the real examples, zero for an empty batch), ``examples`` (the number of real examples) and ``drawn``
    (what ``step_draw`` returned for this step). ``step_draw()``: called once per local step of this client, in step
    order, outside the vectorised call: the step's random tensors (name -> tensor), drawn from the client's own
    generator as its sequential ``after_backward`` draws them."""

    tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)
    loss_term: Callable[..., torch.Tensor | None] | None = None
    grads: Callable[..., Mapping[str, torch.Tensor]] | None = None
    example_terms: tuple[tuple[Callable[[Any, Any], torch.Tensor], str], ...] = ()
    adam: Any = None
    output_noise: OutputNoise | None = None
    forward_term: Callable[..., torch.Tensor | None] | None = None
    outputs: Callable[[Any, Any], Any] | None = None
    prepare: Callable[[Any, Any], Any] | None = None
    count: Callable[[int], None] | None = None
    clip_examples: float | None = None
    step_draw: Callable[[], Mapping[str, torch.Tensor]] | None = None


class Component:
    """Base class of multi-slot recipe components. Override only the hooks you need."""

    name: str = "component"
    #: whether ``client_end`` (or the component's trainer) attaches tensors to ``result.extras`` (uploads beyond the
    #: model update: central DP, which clips and noises the update only, refuses such a component at start). A
    #: component that sets it declares what it uploads in ``extras_spec``
    uploads_extras: bool = False
    #: whether ``after_backward`` adds a correction to the step *direction* rather than shaping the gradient
    #: (SCAFFOLD's ``c - c_i``). ``train.optimizer``'s Adam transform runs after the ``after_backward`` of
    #: every component before the first such one (DP-SGD's noisy clipped gradient, FedDyn's clipping) and
    #: before it, so the correction is added to the Adam direction (``fedsight.training.local.sgd_steps``)
    step_correction: bool = False
    #: whether ``client_start`` registers a module hook that acts inside every local step: vectorised training
    #: cannot run such a hook per client, so the stage trains one client at a time (``engine.vectorize = true``
    #: refuses it before the run). A hook that noises a layer's output can hand its mechanism to the trainer instead
    #: (``VectorStep.output_noise``, as ``dct_dp`` does) and leave this False
    hooks_the_model: bool = False
    #: whether the component's step term runs the model again on other inputs (``VectorStep.forward_term``: RAF).
    #: Vectorised training draws a model's dropout noise before the step for one forward only, so with such a
    #: component a model with dropout trains one client at a time
    reruns_the_model: bool = False
    #: whether the component noises a layer's output in every forward (``VectorStep.output_noise``: ``dct_dp``)
    noises_a_layer: bool = False
    #: whether the component may refuse the received global model (``ModelRefused``, or a fallback that trains
    #: from the client's own model: ``fedsight.recipe.ppfl_accept``): the round's row then counts the refusals
    #: (``clients/refused``)
    refuses_models: bool = False
    #: whether its ``vector_step`` asks for clipped per-example gradients (``VectorStep.clip_examples``: ``dp_sgd``)
    clips_examples: bool = False

    # -- client side ---------------------------------------------------------------------------
    def client_start(self, ctx: ClientContext) -> None:
        """Before the first local step (e.g. load this client's state)."""

    def transform_batch(self, ctx: ClientContext, inputs: Any, targets: Any) -> tuple[Any, Any]:
        """A training batch before the model sees it (data augmentation beyond the task's own, e.g. cutout or
        mixup on classification images): return the (inputs, targets) to train on, in the task's batch format
        (classification: images ``[B, C, H, W]`` and labels; segmentation: images and label maps; keypoints:
        crops and a dict of targets; see the task's ``train_batch``). Draw randomness from a generator seeded
        by ``fedsight.rng.torch_gen(ctx.seed, "<name>", ctx.round, ctx.client_id)`` (made in ``client_start``)
        so runs stay reproducible and resumable. Evaluation batches never pass here."""
        return inputs, targets

    def outputs(self, ctx: ClientContext, outputs: torch.Tensor) -> torch.Tensor:
        """Transform the model outputs before the loss (OLL masks the classes a client does not hold)."""
        return outputs

    def batch_positions(self, ctx: ClientContext, num_steps: int, gen: torch.Generator) -> list[torch.Tensor] | None:
        """The index batches of ``num_steps`` local steps drawn from ``gen``, or None for the
        loop's shuffled passes (DP-SGD draws Poisson batches; an empty batch is a step without data: the
        gradient is zero before ``after_backward``)."""
        return None

    def loss_term(self, ctx: ClientContext, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """An extra term added to the task loss (local objective), or None."""
        return None

    def after_backward(self, ctx: ClientContext) -> None:
        """Transform gradients in place after ``backward()`` and before the optimizer step."""

    def client_end(self, ctx: ClientContext, result: ClientResult) -> None:
        """Transform the upload or attach named extra tensors to ``result.extras``."""

    def vector_blocker(self) -> str | None:
        """Why this component, as configured, cannot train clients together although it has a ``vector_step`` (a
        setting whose step is not a function vmap can run), or None."""
        return None

    def vector_step(self, ctx: ClientContext) -> VectorStep | None:
        """This client's ``loss_term`` / ``after_backward`` as a ``VectorStep`` (called after ``client_start``), for
        training the round's clients together (``engine.vectorize``). A component that overrides ``outputs``,
        ``batch_positions``, ``loss_term`` or ``after_backward`` without overriding this one cannot be vectorised:
        the engine trains such a recipe one client after another (and says so). ``client_start``,
        ``transform_batch`` and ``client_end`` run per client as in sequential training, with ``ctx.model``
        holding that client's weights."""
        return None

    def extras_spec(self, ctx: UploadContext) -> ExtrasSpec | None:
        """What every honest client of the stage uploads under ``result.extras[self.name]`` in round ``ctx.round``
        (exact names, shapes, dtypes and value checks, from what the server knows), or None when it uploads
        nothing there. Every reply of the stage must carry exactly the declared groups (``engine.contract``).
        The default: nothing, or, for a component that sets ``uploads_extras`` without declaring, any named
        finite tensors (unchecked: declare them)."""
        return ExtrasSpec(None, required=False) if self.uploads_extras else None

    def secure_aggregation_problem(self, weighting: str) -> str | None:
        """Why this component cannot run when the server sees only the weighted mean of the round's updates
        (Flower's SecAgg+, ``fedsight.flower.secagg``; ``weighting`` is the stage's ``recipe.weighting``), or
        None. The default: a component that uploads extra tensors cannot (the secure sum carries the model
        update only). The plain metrics (``result.metrics``) still reach the server one by one."""
        if self.uploads_extras:
            return "uploads extra tensors beside the model update, which the secure sum does not carry"
        return None

    # -- server side ---------------------------------------------------------------------------
    def server_broadcast(self, sctx: "ServerContext") -> dict[str, torch.Tensor] | None:
        """Tensors sent to every sampled client with the global model this round (e.g. SCAFFOLD's
        server control variate); the client sees them as ``ctx.broadcast[self.name]``."""
        return None

    def client_broadcast(self, sctx: "ServerContext", client: int) -> dict[str, torch.Tensor] | None:
        """Tensors sent to one sampled client only (e.g. the teacher of the client's cluster); merged into
        ``ctx.broadcast[self.name]`` and counted in that client's download."""
        return None

    def aggregator(self) -> Any:
        """An ``Aggregator`` this component requires (Elastic, FedNova), or None. Claiming the slot
        together with a non-default ``recipe.aggregator`` or another component is a config error."""
        return None

    def weighting(self) -> Any:
        """A ``ClientWeighting`` this component requires, or None (same exclusivity rule)."""
        return None

    def trainer(self) -> Any:
        """A ``fedsight.client.Trainer`` (the client's local procedure) this component requires, or
        None for plain SGD (same exclusivity rule)."""
        return None

    def sample(self, round: int, num_clients: int, m: int, seed: int) -> list[int] | None:
        """The clients of ``round`` if this component chooses them (Fed3R visits each client once; an empty
        list makes a server-only round), or None for the engine's uniform sampling."""
        return None

    def adapt_model(self, model: nn.Module, seed: int) -> None:
        """Change a freshly built model's structure in place, once, for the whole run (Fed3R-RF puts a
        random-feature map in front of the classifier). Must be deterministic in ``seed``."""

    def eval_context(self, model: nn.Module, ctx: EvalContext) -> contextlib.AbstractContextManager:
        """Wraps the evaluation of ``model`` on ``ctx.split`` (``"test"`` or a client id), like
        ``Sharing.eval_context`` (OLL masks non-local classes, Ditto swaps in the personal model).
        Must restore the model on exit."""
        return contextlib.nullcontext()

    def evaluate(self, model: nn.Module, ctx: EvalContext, run: Any) -> Any:
        """The metric state of ``model`` on ``ctx.split``; ``run(ctx)`` evaluates (part of) a split with the
        rest of the hooks. Override to evaluate parts of a split separately and merge their states (a
        clustered model: each cluster's test images with that cluster's entries); the default runs once."""
        return run(ctx)

    def server_results(self, sctx: ServerContext, results: list[ClientResult]) -> list[ClientResult]:
        """The round's accepted results before weighting and aggregation, possibly transformed (norm bounding
        scales updates down); every component's transform applies in order, whatever the aggregator."""
        return results

    def server_round_end(self, sctx: ServerContext, results: list[ClientResult], weights: torch.Tensor) -> None:
        """After aggregation and the server optimizer step (e.g. update server-side state, or apply a
        correction to ``sctx.model``'s parameters as FedDyn does). ``weights`` are normalised. Called only
        in a round with at least one accepted update."""

    def server_step(self, sctx: ServerContext) -> None:
        """At the end of every round, after aggregation (if any) and ``server_round_end``: server-side work
        that does not depend on this round's updates, e.g. training ``sctx.model`` on data the server holds
        (LADD's source pre-training, in rounds where ``sample`` picks no client)."""

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"component {self.name!r} has no state but got keys {sorted(state)}")
