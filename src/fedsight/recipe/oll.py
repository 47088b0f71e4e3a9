"""OLL, Only Local Labels (thesis Sec. 4.2, Alg. 7).

Each client keeps only the classifier columns of the classes in its local training set, with a local
label mapping: a C_k-way softmax over its own classes. Non-local classes get probability exactly 0.

Implementation: instead of slicing the head to d x C_k and relabelling, the client masks the logits of
non-local classes to -inf before the loss and at its evaluation. This is the same model: the softmax
over the remaining C_k logits is Alg. 7's softmax with the local label mapping, the masked columns get
exactly zero gradient, and argmax over the unmasked logits is the local prediction. The masked rows are
restored after local training (so weight decay or momentum cannot touch them and a shared head uploads a
zero delta for them): they are never part of the client's model. The FLOPs estimate counts the full head
(an upper bound; the pruned d x C_k head of Alg. 7 saves (C - C_k)/C of F_psi, small next to F_phi).

Use it in a stage after the classifier is trained (Fed3R, FedAvg), usually with local fine-tuning
(``recipe.sharing = "local"``), e.g. OLL(Fed3R) + FP(phi). The thesis multiplies the fine-tuning
learning rate by 0.1 when OLL is applied, and by 0.1 again when the classifier was initialised with Fed3R
(Sec. 4.3.1): ``{name = "oll", lr = "auto"}`` applies that rule to the stage's ``train.lr``
(``auto_lr``); the default ``lr = "stage"`` trains with ``train.lr`` as set.

OLL with no fine-tuning (Table 4.18's x column: the federated classifier pruned to each client's classes and
used as it is) is an evaluation setting, not a stage: ``eval.oll = true`` adds ``OLLEval``, the same mask on
each client's local test set, to every stage (``fedsight evaluate RUN --set eval.oll=true`` for a finished run).
A local test sample of a class the client never trained on is always wrong under OLL (closed-set
assumption; its cross-entropy is infinite, so ``local/loss`` can be inf while accuracy is exact).
"""

from __future__ import annotations

import contextlib
from typing import Literal

import torch
from pydantic import Field
from torch import nn

from ..registry import COMPONENTS, Params
from ..device import model_device
from ..training import ClientContext, Component, EvalContext, VectorStep
from .fed3r import head_linear


def local_classes(task, client: int) -> torch.Tensor:
    """Boolean mask [C] of the classes in ``client``'s local training set."""
    labels = getattr(task, "client_labels", None)
    if labels is None:
        raise ValueError(f"oll needs a classification task with client labels; task {task.name!r} has none")
    mask = torch.zeros(task.num_classes, dtype=torch.bool)
    mask[torch.as_tensor(labels(client), dtype=torch.long)] = True
    return mask


def mask_logits(out: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return out.masked_fill(~keep, float("-inf"))


#: Sec. 4.3.1: "If the classifier is pruned using OLL, then the FP learning rate is multiplied by 0.1"
OLL_LR_FACTOR = 0.1
#: Sec. 3.9.1: fine-tuning after a classifier initialisation uses lr 0.01 instead of 0.1
INIT_LR_FACTOR = 0.1
#: the components whose stage initialises the classifier in closed form (Phase 1 of Sec. 3.9.1)
CLASSIFIER_INIT = ("fed3r", "fedncm")


def auto_lr(lr: float, initialised: bool) -> float:
    """The thesis's OLL fine-tuning learning rate (Sec. 4.3.1): ``lr`` (the stage's ``train.lr``, the rate of
    fine-tuning a classifier that was neither initialised nor pruned; 0.1 in the thesis) times 0.1 for OLL,
    times 0.1 again when an earlier stage initialised the classifier in closed form (``initialised``: a
    ``fed3r`` or ``fedncm`` stage), "resulting in a learning rate of 0.001" for Fed3R + OLL from 0.1. The
    thesis initialises with Fed3R only; FedNCM's closed-form classifier counts as an initialisation too. The
    rule does not depend on the number of local classes (the thesis states none that does)."""
    return lr * OLL_LR_FACTOR * (INIT_LR_FACTOR if initialised else 1.0)


class OLLParams(Params):
    lr: Literal["stage", "auto"] = Field(
        "stage", description='"stage": train.lr as set; "auto": train.lr x 0.1, x 0.1 again after a fed3r/fedncm '
        "stage (thesis Sec. 4.3.1: 0.1 -> 0.001 after Fed3R)")


class OLL(Component):
    name = "oll"

    def __init__(self, params: OLLParams | None = None):
        self.p = params or OLLParams()

    def adapt_model(self, model: nn.Module, seed: int) -> None:
        head_linear(model)  # a model without a linear head fails here, before any round

    def client_start(self, ctx: ClientContext) -> None:
        keep = local_classes(ctx.task, ctx.client_id).to(model_device(ctx.model))
        linear = head_linear(ctx.model)
        saved = {"weight": linear.weight.detach()[~keep].clone()}
        if linear.bias is not None:
            saved["bias"] = linear.bias.detach()[~keep].clone()
        ctx.scratch[self.name] = (keep, saved)

    def outputs(self, ctx: ClientContext, outputs: torch.Tensor) -> torch.Tensor:
        return mask_logits(outputs, ctx.scratch[self.name][0])

    def vector_step(self, ctx: ClientContext) -> VectorStep:
        """The same mask, each client's own (``client_end`` restores the masked rows per client, as sequentially)."""
        return VectorStep(tensors={"keep": ctx.scratch[self.name][0]},
                          outputs=lambda own, outputs: mask_logits(outputs, own["keep"]))

    @torch.no_grad()
    def client_end(self, ctx: ClientContext, result) -> None:
        keep, saved = ctx.scratch[self.name]
        linear = head_linear(ctx.model)
        prefix = _head_prefix(ctx.model, linear)
        for name, rows in saved.items():
            getattr(linear, name)[~keep] = rows
            key = f"{prefix}{name}"
            if key in result.delta:
                result.delta[key][~keep] = 0.0

    @contextlib.contextmanager
    def eval_context(self, model: nn.Module, ctx: EvalContext):
        if not isinstance(ctx.split, int):
            yield
            return
        keep = local_classes(ctx.task, ctx.split).to(model_device(model))
        handle = model.register_forward_hook(lambda _m, _i, out: mask_logits(out, keep))
        try:
            yield
        finally:
            handle.remove()


class OLLEval(Component):
    """``eval.oll = true``: OLL's mask on each client's local test set and nothing else (Table 4.18's x column,
    "OLL is directly employed on the federated classifier from Phase 1 or Phase 2 ... the columns associated
    with the classes in C minus C_k are removed from the latest classifier, which is then used to perform
    predictions", Sec. 4.3.5). Training is untouched; the global test set (``test/*``) is evaluated
    unmasked, as no client's classes apply to it. Added to every stage by ``fedsight.api.build_recipe``."""

    name = "oll_eval"

    def adapt_model(self, model: nn.Module, seed: int) -> None:
        head_linear(model)

    eval_context = OLL.eval_context


def _head_prefix(model: nn.Module, linear: nn.Linear) -> str:
    for name, module in model.named_modules():
        if module is linear:
            return f"{name}."
    raise ValueError("head not found in model")


@COMPONENTS.register("oll", params=OLLParams,
                     help="Only Local Labels: each client keeps only its local classes' classifier columns",
                     requires={"class_labels", "linear_head"})
def _oll(params: OLLParams) -> OLL:
    return OLL(params)
