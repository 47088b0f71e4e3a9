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
learning rate by 0.1 when OLL is applied (Sec. 4.3.1): set ``train.lr`` of the stage accordingly.
A local test sample of a class the client never trained on is always wrong under OLL (closed-set
assumption; its cross-entropy is infinite, so ``local/loss`` can be inf while accuracy is exact).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..registry import COMPONENTS, NoParams
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


class OLL(Component):
    name = "oll"

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


def _head_prefix(model: nn.Module, linear: nn.Linear) -> str:
    for name, module in model.named_modules():
        if module is linear:
            return f"{name}."
    raise ValueError("head not found in model")


@COMPONENTS.register("oll", help="Only Local Labels: each client keeps only its local classes' classifier columns",
                     requires={"class_labels", "linear_head"})
def _oll(params: NoParams) -> OLL:
    return OLL()
