"""FedDyn: federated learning with dynamic regularisation (Acar et al. 2021, ICLR, Algorithm 1).

One component filling three slots of the recipe:

* local objective term. Client k minimises (Algorithm 1, line 5 / eq. (1) of the method section)
  ``L_k(theta) - <grad L_k(theta_k^{t-1}), theta> + (alpha/2) ||theta - theta^{t-1}||^2``
  where ``theta^{t-1}`` is the received global model and ``grad L_k(theta_k^{t-1})`` is the client's
  persistent *linear term* ``lin_k`` (per-client state ``"feddyn"``, zeros for a client never sampled).
  The two extra terms are added to the task loss through autograd, summed over the shared trainable
  parameters.
* gradient transform. ``max_grad_norm`` (default 10, the setting of the FedVG seed's FedDyn baseline,
  which follows the authors' public code) clips the total gradient norm of the whole local objective
  over all model parameters with ``torch.nn.utils.clip_grad_norm_`` after ``backward()``; ``None``
  disables clipping (the paper's Algorithm 1 has none).
* after local training, Algorithm 1 line 6 (the first-order condition of the local problem):
  ``lin_k <- lin_k - alpha (theta_k^t - theta^{t-1})``, saved to the client's state.
* server (lines 9-10): ``h^t = h^{t-1} - alpha (1/m) sum_{k in P_t} (theta_k^t - theta^{t-1})`` with m
  the number of all clients (``sctx.num_clients``) and ``theta^t = (1/|P_t|) sum_{k in P_t} theta_k^t
  - (1/alpha) h^t``. The first part is the engine's aggregation: with ``recipe.weighting = "uniform"``
  and the default server optimizer (SGD, lr 1) the global model after the server step is exactly the
  mean of the client models, so those two settings give the paper's algorithm. ``server_round_end``
  then updates ``h`` from the uploaded deltas ``theta_k^t - theta^{t-1}`` and subtracts ``h / alpha``
  from the global model's shared parameters in place. With another weighting or server optimizer the
  correction is applied on top of whatever that step produced (a documented combination, not the paper).

Choices where the paper is silent: ``h`` covers the shared trainable parameters only and starts as
zeros (stored lazily: empty until the first aggregation); the server uses the uploaded deltas
(``result.delta``), the client's linear term uses its trained local model; a rejected (non-finite)
update does not enter ``h``.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field

from ..records import ClientResult
from ..registry import COMPONENTS, Params
from ..training import ClientContext, Component, ServerContext, VectorStep

KEY = "feddyn"


class FedDynParams(Params):
    alpha: float = Field(0.1, gt=0, description="regularisation strength alpha (Acar et al. 2021)")
    max_grad_norm: float | None = Field(
        10.0, gt=0, description="clip the local gradient's total norm to this value (None = no clipping)"
    )


class FedDyn(Component):
    """FedDyn (Acar et al. 2021, Algorithm 1) as a multi-slot recipe component."""

    name = KEY

    def __init__(self, alpha: float = 0.1, max_grad_norm: float | None = 10.0) -> None:
        if alpha <= 0:
            raise ValueError(f"feddyn: alpha must be > 0, got {alpha}")
        self.alpha = float(alpha)
        self.max_grad_norm = max_grad_norm
        #: the server state h over the shared trainable parameters (empty = all zeros)
        self.h: dict[str, torch.Tensor] = {}

    # -- client side -----------------------------------------------------------------------------

    def client_start(self, ctx: ClientContext) -> None:
        loaded = ctx.state.load(self.name) if ctx.state is not None else None
        lin = {
            k: loaded[k].to(g) if loaded is not None and k in loaded else torch.zeros_like(g)
            for k, g in ctx.global_params.items()
        }
        ctx.scratch[self.name] = {"lin": lin}

    def loss_term(self, ctx: ClientContext, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.term(ctx.global_params, ctx.scratch[self.name]["lin"], dict(ctx.model.named_parameters()), outputs)

    def term(self, global_params: dict[str, torch.Tensor], lin: dict[str, torch.Tensor],
             params: dict[str, torch.Tensor], outputs: torch.Tensor) -> torch.Tensor:
        """``- <lin_k, theta> + (alpha/2) ||theta - theta^{t-1}||^2`` over the shared trainable parameters."""
        main = outputs[0] if isinstance(outputs, (tuple, list)) else outputs  # (main, auxiliary) outputs
        term = main.new_zeros(())
        for k, p in params.items():
            if k in lin:
                term = term - (lin[k] * p).sum() + 0.5 * self.alpha * (p - global_params[k]).pow(2).sum()
        return term

    def after_backward(self, ctx: ClientContext) -> None:
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(ctx.model.parameters(), self.max_grad_norm)

    def clipped(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``clip_grad_norm_``'s rescaling as a pure function: every gradient times min(1, max / (norm + 1e-6))."""
        if self.max_grad_norm is None:
            return grads
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
        coef = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
        return {k: g * coef for k, g in grads.items()}

    def vector_step(self, ctx: ClientContext) -> VectorStep:
        g = ctx.global_params  # the same received model for every client of the round
        return VectorStep(tensors=ctx.scratch[self.name]["lin"],
                          loss_term=lambda lin, params, outputs, targets: self.term(g, lin, params, outputs),
                          grads=lambda lin, params, grads: self.clipped(grads))

    @torch.no_grad()
    def client_end(self, ctx: ClientContext, result: ClientResult) -> None:
        lin = ctx.scratch[self.name]["lin"]
        params = dict(ctx.model.named_parameters())
        new = {k: lin[k] - self.alpha * (params[k].detach() - g) for k, g in ctx.global_params.items()}
        if ctx.state is not None:
            ctx.state.save(self.name, new)

    # -- server side -----------------------------------------------------------------------------

    def secure_aggregation_problem(self, weighting: str) -> str | None:
        # h sums the round's updates; the secure mean times m is that sum only when the weights are equal
        if weighting != "uniform":
            return (f"sums the round's updates into its server state h, which the secure weighted mean gives only with "
                    f"recipe.weighting = 'uniform' (not {weighting!r})")
        return None

    @torch.no_grad()
    def server_round_end(self, sctx: ServerContext, results: list[ClientResult], weights: torch.Tensor) -> None:
        if not results:
            return
        m = float(sctx.num_clients)
        for k in results[0].delta:
            total = torch.stack([r.delta[k].to(torch.float64) for r in results]).sum(0)
            base = self.h.get(k)
            if base is None:
                base = torch.zeros_like(results[0].delta[k])
            self.h[k] = (base.to(torch.float64) - self.alpha * total / m).to(base.dtype)
        params = dict(sctx.model.named_parameters())
        for k, h in self.h.items():
            params[k].sub_(h.to(params[k]) / self.alpha)

    # -- state -----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"h": {k: v.detach().clone() for k, v in self.h.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.h = {k: v.detach().clone() for k, v in state.get("h", {}).items()}


@COMPONENTS.register(
    "feddyn",
    params=FedDynParams,
    help="FedDyn dynamic regularisation (Acar et al. 2021); use weighting 'uniform' + server SGD lr 1 for the paper",
)
def _feddyn(params: FedDynParams) -> FedDyn:
    return FedDyn(alpha=params.alpha, max_grad_norm=params.max_grad_norm)
