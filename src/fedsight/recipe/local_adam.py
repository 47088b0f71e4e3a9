"""Local Adam as an update transform: the client optimiser that video super-resolution needs.

The local loop (``fedsight.client``) steps plain SGD. Video SR networks (BasicVSR, VRT, RVRT, IART) are
trained with Adam (FedVSR keeps each model's official recipe: Adam, lr 2e-4 to 4e-4, betas
(0.9, 0.99); digest section 3.3), and with SGD their Charbonnier loss barely moves. This component
turns every local step into an Adam step (Kingma & Ba 2015, Algorithm 1): in ``after_backward`` it
replaces each gradient g_t by

    m_t = beta1 m_{t-1} + (1 - beta1) g_t,   v_t = beta2 v_{t-1} + (1 - beta2) g_t^2,
    g_t <- (m_t / (1 - beta1^t)) / (sqrt(v_t / (1 - beta2^t)) + eps)

so that the loop's SGD step ``p <- p - lr g_t`` (``train.lr``, ``train.momentum = 0``) is exactly
``torch.optim.Adam(lr, betas, eps)``. The moments start at zero for every client in every round: the
FedVSR code rebuilds the client and its Adam optimiser at each fit (digest ambiguity 8). With
``train.weight_decay = wd`` the SGD step adds ``lr * wd * p``: decoupled weight decay (AdamW).

Order with SCAFFOLD: list ``local_adam`` *before* ``scaffold`` (hooks run in list order). Then each
step is ``y <- y - lr (d_t - c_i + c)`` with ``d_t`` the Adam direction, and option II's
``c_i+ = c_i - c + (x - y_i) / (K lr)`` becomes the client's mean Adam direction: control variates and
corrections live in the same (Adam-normalised) units. In the other order Adam would normalise
``g + c - c_i`` whose correction, measured in Adam-step units, dwarfs raw gradients. FedProx enters
through the loss and needs no ordering.
"""

from __future__ import annotations

import torch
from pydantic import Field

from ..registry import COMPONENTS, Params
from ..training import ClientContext, Component


class LocalAdamParams(Params):
    beta1: float = Field(0.9, ge=0, lt=1, description="first-moment decay (BasicSR/KAIR VSR configs: 0.9)")
    beta2: float = Field(0.99, ge=0, lt=1, description="second-moment decay (BasicSR/KAIR VSR configs: 0.99)")
    eps: float = Field(1e-8, gt=0, description="added to sqrt(v_hat)")


class LocalAdam(Component):
    """Turns the local SGD step into an Adam step with per-round fresh moments."""

    name = "local_adam"

    def __init__(self, params: LocalAdamParams | None = None):
        self.p = params or LocalAdamParams()

    def client_start(self, ctx: ClientContext) -> None:
        if ctx.local is not None and getattr(ctx.local, "momentum", 0.0):
            raise ValueError("local_adam: set train.momentum = 0 (Adam keeps its own first moment)")
        ctx.scratch[self.name] = {"t": 0, "m": {}, "v": {}}

    @torch.no_grad()
    def after_backward(self, ctx: ClientContext) -> None:
        s = ctx.scratch[self.name]
        s["t"] += 1
        t = s["t"]
        b1, b2 = self.p.beta1, self.p.beta2
        c1, c2 = 1.0 - b1**t, 1.0 - b2**t
        for k, p in ctx.model.named_parameters():
            if p.grad is None or not p.requires_grad:
                continue
            g = p.grad
            m = s["m"].get(k)
            if m is None:
                m = s["m"][k] = torch.zeros_like(g)
                s["v"][k] = torch.zeros_like(g)
            v = s["v"][k]
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            # torch.optim.Adam's arithmetic: (m / c1) / (sqrt(v) / sqrt(c2) + eps)
            g.copy_((m / c1) / (v.sqrt() / (c2**0.5) + self.p.eps))


@COMPONENTS.register(
    "local_adam",
    params=LocalAdamParams,
    help="local Adam (fresh moments each round) as a gradient transform on the SGD loop; train.lr is Adam's lr",
)
def _local_adam(params: LocalAdamParams) -> LocalAdam:
    return LocalAdam(params)
