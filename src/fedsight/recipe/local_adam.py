"""Local Adam as an update transform: the client optimiser that video super-resolution needs.

The local loop (``fedsight.training.local``) steps plain SGD. Video SR networks (BasicVSR, VRT, RVRT, IART) are
trained with Adam (FedVSR keeps each model's official recipe: Adam, lr 2e-4 to 4e-4, betas
(0.9, 0.99); digest section 3.3), and with SGD their Charbonnier loss barely moves. This component
turns every local step into an Adam step (Kingma & Ba 2015, Algorithm 1): in ``after_backward`` it
replaces each gradient g_t by Adam's direction (``fedsight.training.optim.AdamDirection``)

    m_t = beta1 m_{t-1} + (1 - beta1) g_t,   v_t = beta2 v_{t-1} + (1 - beta2) g_t^2,
    g_t <- (m_t / (1 - beta1^t)) / (sqrt(v_t / (1 - beta2^t)) + eps)

so that the loop's SGD step ``p <- p - lr g_t`` (``train.lr``, ``train.momentum = 0``) is exactly
``torch.optim.Adam(lr, betas, eps)``. The moments start at zero for every client in every round: the
FedVSR code rebuilds the client and its Adam optimiser at each fit (digest ambiguity 8). With
``train.weight_decay = wd`` the SGD step adds ``lr * wd * p``: decoupled weight decay (AdamW).

``train.optimizer = "adam" / "adamw"`` does the same from the ``train`` section (betas and eps from
``train.betas`` / ``train.eps``, Adam's coupled L2 decay available, moments fresh per local pass) and
places the transform itself; listing ``local_adam`` with it is a config error (pick one).

Order with SCAFFOLD: list ``local_adam`` *before* ``scaffold`` (hooks run in list order). Then each
step is ``y <- y - lr (d_t - c_i + c)`` with ``d_t`` the Adam direction, and option II's
``c_i+ = c_i - c + (x - y_i) / (K lr)`` becomes the client's mean Adam direction: control variates and
corrections live in the same (Adam-normalised) units. In the other order Adam would normalise
``g + c - c_i`` whose correction, measured in Adam-step units, dwarfs raw gradients. FedProx enters
through the loss and needs no ordering.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from ..registry import COMPONENTS, Params
from ..training import ClientContext, Component, VectorStep
from ..training.optim import AdamDirection


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
        ctx.scratch[self.name] = AdamDirection((self.p.beta1, self.p.beta2), self.p.eps)

    def after_backward(self, ctx: ClientContext) -> None:
        ctx.scratch[self.name].apply_((k, p) for k, p in ctx.model.named_parameters() if p.requires_grad)

    def vector_step(self, ctx: ClientContext) -> VectorStep:
        """The same Adam step for vectorised training: the trainer keeps the moments (``VectorStep.adam``)."""
        return VectorStep(adam=AdamDirection((self.p.beta1, self.p.beta2), self.p.eps))


def _check(spec: LocalAdamParams, cfg: Any) -> str | None:
    """``local_adam`` and ``train.optimizer = "adam"/"adamw"`` would both make the local step an Adam step."""
    opt = getattr(getattr(cfg, "train", None), "optimizer", "sgd")
    if opt != "sgd":
        return (f"local_adam and train.optimizer = {opt!r} both turn the local step into an Adam step; pick one "
                "(train.optimizer with train.betas / train.eps, or local_adam with train.optimizer = 'sgd')")
    return None


@COMPONENTS.register(
    "local_adam",
    params=LocalAdamParams,
    check=_check,
    help="local Adam (fresh moments each round) as a gradient transform on the SGD loop; train.lr is Adam's lr",
)
def _local_adam(params: LocalAdamParams) -> LocalAdam:
    return LocalAdam(params)
