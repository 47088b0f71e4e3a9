"""RAF (Lim, Lee, Lee & Cho, "Mitigating Resolution-Drift in Federated Learning: Case of Keypoint Detection"):
multi-resolution knowledge distillation (MRKD) as a local objective component.

A client at native rung r of the task's resolution ladder (``fedsight.tasks.keypoints``) builds, for every batch,
copies of its native crops at every rung below r (eq. 2: ``x^(i)``, i = 1..N_k-1, lower resolution for larger i;
resized with ``downsample`` interpolation, anti-aliased), runs the *same* network on each (eq. 3) and adds the
cascaded adjacent-rung self-distillation of eq. 5 to the task loss on the native rung (eq. 4):

    L_kd = sum_{i=1}^{N_k - 1} MSE( sg(y^(i-1)), U_i^{i-1} y^(i) ),      L_k = L_task + alpha L_kd     (eq. 6)

``sg`` is a stop-gradient (the teacher heatmap is detached: gradients flow only through the student), and
``U`` upsamples the student's heatmap to the teacher's heatmap grid (``upsample``: bilinear by default; the
paper says only "fixed linear upsampling", digest ambiguity 3; the authors' code uses nearest). The KD terms
are summed over rungs, not averaged, as eq. 5 writes (a 3-rung client gets two terms). The MSE is the task's
``JointsMSELoss`` with the student rung's joint weights (``kd_weights = "target"``; ``"all"`` distils every
joint channel, the paper does not say, ambiguity 6). A client at the lowest rung has no rung below it and
trains plainly (Fig. 4). The ``gamma`` l2 term of eq. 6 is the optimizer's weight decay
(``train.weight_decay``; with ``local_adam`` it is AdamW's decoupled decay, ambiguity 7), and FedProx, SCAFFOLD
or any weighting combine by listing them in the recipe: RAF changes the local objective only (section IV-B).

``teacher = "native"`` distils every rung from the native output instead of the adjacent higher rung (an
ablation the paper leaves open). ``mode = "code"`` reproduces the authors' published code
(``Icecoffee2500/RAF`` ``raf/hpe/federated/client.py::_train_step_multi``): a ground-truth heatmap loss on every
rung (targets regenerated at each rung's grid from the same augmented crop), adjacent-rung KD with the student
upsampled by nearest neighbour, and ``alpha`` unused (the code reads ``KD_ALPHA`` and ignores it): the term
added here is ``sum_{i>=1} (L_gt^(i) + L_kd^(i))``, the sum over rungs the code accumulates.

The extra forward and backward passes are charged to the client's FLOPs in proportion to each rung's pixels.
The term is one per-example formula (``RAF.term``) for sequential training and for vectorised training, where the
lower rungs' forwards of all the clients at one rung run in the step's one call (``VectorStep.forward_term``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from ..registry import COMPONENTS, Params
from ..training import ClientContext, Component, VectorStep

__all__ = ["RAF", "RAFParams", "resize"]


class RAFParams(Params):
    alpha: float = Field(1.0, ge=0, description="weight alpha of the KD term (eq. 6; the paper: 1)")
    mode: Literal["paper", "code"] = Field("paper", description="'paper' (eqs. 4-6) or 'code' (the authors' code: "
                                           "GT loss on every rung, unweighted nearest-upsampled KD)")
    upsample: Literal["bilinear", "bicubic", "nearest"] = Field(
        "bilinear", description="U: interpolation of the student heatmap to the teacher grid (code: nearest)")
    downsample: Literal["bilinear", "bicubic", "area"] = Field(
        "bilinear", description="interpolation that builds the lower-rung inputs (anti-aliased)")
    teacher: Literal["adjacent", "native"] = Field("adjacent", description="teacher of rung i: rung i-1 (eq. 5) or the native rung")
    kd_weights: Literal["target", "all"] = Field("target", description="joint weights of the KD MSE: the target weights or all joints")


def resize(x: torch.Tensor, size: tuple[int, int], mode: str) -> torch.Tensor:
    """``x`` [B, C, h, w] interpolated to ``size`` (anti-aliased when shrinking with bilinear/bicubic)."""
    if tuple(x.shape[-2:]) == tuple(size):
        return x
    if mode in ("bilinear", "bicubic"):
        shrink = size[0] < x.shape[-2] or size[1] < x.shape[-1]
        return F.interpolate(x, size=size, mode=mode, align_corners=False, antialias=shrink)
    return F.interpolate(x, size=size, mode=mode)


class RAF(Component):
    """Adds RAF's multi-resolution self-distillation (eq. 5, or the authors' code) to the local objective."""

    name = "raf"
    reruns_the_model = True

    def __init__(self, params: RAFParams | None = None):
        self.p = params or RAFParams()

    def loss_term(self, ctx: ClientContext, outputs: torch.Tensor, targets: dict[str, torch.Tensor]) -> torch.Tensor | None:
        each = self.term(ctx.task, ctx.model, ctx.inputs, outputs, targets)
        if each is not None:
            self.count(ctx, ctx.inputs.shape[0])
        return None if each is None else each.mean()

    def term(self, task: Any, forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, outputs: torch.Tensor,
             targets: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """Each example's added term (B,) for a batch ``x`` of native crops (their rung read off their size; None at
        the lowest rung), the model's ``outputs`` on them and their ``targets``; ``forward``: the model (the client's
        own weights). One formula for sequential and vectorised training; the batch's term is the mean (eq. 5's
        MSEs are means over examples, joints and pixels, and every example has as many)."""
        from ..tasks.keypoints import joints_mse

        native = tuple(x.shape[-2:])
        rungs = task.sizes_below(native)
        if not rungs:
            return None
        p = self.p
        code = p.mode == "code"
        up = "nearest" if code else p.upsample
        teacher = outputs.detach()
        weight = targets["weight"]
        total = outputs.new_zeros(outputs.shape[0])
        for size in rungs:
            y = forward(resize(x, size, p.downsample))
            if code or p.kd_weights == "target":
                scale = torch.tensor([size[1] / native[1], size[0] / native[0]], device=x.device)
                hm, w = task.heatmap_targets((targets["joints"] + 0.5) * scale - 0.5, weight, size)
            kd_w = w if p.kd_weights == "target" else torch.ones_like(weight)
            kd = joints_mse(resize(y, tuple(teacher.shape[-2:]), up), teacher, kd_w, each=True)
            total = total + (joints_mse(y, hm, w, each=True) + kd if code else p.alpha * kd)
            if p.teacher == "adjacent":
                teacher = y.detach()
        return total

    def count(self, ctx: ClientContext, n: int) -> None:
        """The extra forwards' and backwards' FLOPs of a step of ``n`` native crops, in proportion to each rung's
        pixels."""
        if ctx.cost is None:
            return
        native = ctx.task.native_size(ctx.client_id)
        for size in ctx.task.rungs_below(ctx.client_id):
            ctx.flops += ctx.cost.train_step(n, "all") * (size[0] * size[1]) / (native[0] * native[1])

    def vector_step(self, ctx: ClientContext) -> VectorStep:
        task = ctx.task
        return VectorStep(forward_term=lambda own, params, forward, x, outputs, targets: self.term(
            task, forward, x, outputs, targets), count=functools.partial(self.count, ctx))


@COMPONENTS.register("raf", params=RAFParams, requires=frozenset({"resolution_ladder"}),
                     help="RAF multi-resolution heatmap self-distillation against resolution drift (Lim et al.)")
def _raf(params: RAFParams) -> RAF:
    return RAF(params)
