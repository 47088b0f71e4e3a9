"""FedProx: a proximal term in the local objective (Li et al. 2020, "Federated Optimization in
Heterogeneous Networks", MLSys).

Each selected client k approximately minimises (eq. (2))

    h_k(w; w^t) = F_k(w) + (mu / 2) ||w - w^t||^2

where F_k is the task loss and w^t the received global model. The norm runs over the shared trainable
parameters (``ctx.global_params``); personal parameters (FedBN's norm layers, personal heads) are not
pulled towards a global value they never received. The term enters through autograd as a
``loss_term``, so its gradient mu (w - w^t) is exact at every step and ``train/loss`` reports the
local objective h_k. The server side is unchanged (FedAvg with the recipe's weighting and server
optimizer). With mu = 0 the client trains exactly as without the component.
"""

from __future__ import annotations

import torch
from pydantic import Field

from ..registry import COMPONENTS, Params
from ..training import ClientContext, Component, VectorStep


class FedProxParams(Params):
    mu: float = Field(0.01, ge=0, description="proximal coefficient mu of (mu/2)||w - w^t||^2 (eq. (2))")


class FedProx(Component):
    """Adds (mu/2) ||w - w^t||^2 over the shared trainable parameters to every local step's loss."""

    name = "fedprox"

    def __init__(self, mu: float = 0.01):
        if mu < 0:
            raise ValueError(f"fedprox: mu must be >= 0, got {mu}")
        self.mu = float(mu)

    def client_start(self, ctx: ClientContext) -> None:
        ctx.scratch[self.name] = dict(ctx.model.named_parameters())  # looked up once, not at every step

    def loss_term(self, ctx: ClientContext, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        return self.term(ctx.global_params, ctx.scratch[self.name])

    def term(self, global_params: dict[str, torch.Tensor], params: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """(mu/2) ||w - w^t||^2 over the shared trainable parameters (None at mu = 0)."""
        if self.mu == 0.0:
            return None
        return 0.5 * self.mu * sum((params[k] - g).pow(2).sum() for k, g in global_params.items())

    def vector_step(self, ctx: ClientContext) -> VectorStep:
        g = ctx.global_params  # the same received model for every client of the round
        return VectorStep(loss_term=lambda own, params, outputs, targets: self.term(g, params))


@COMPONENTS.register("fedprox", params=FedProxParams, help="FedProx proximal term (mu/2)||w - w^t||^2 (Li et al. 2020)")
def _fedprox(params: FedProxParams) -> FedProx:
    return FedProx(params.mu)
