"""FedNova: normalised averaging of heterogeneous local work (Wang et al. 2020, "Tackling the Objective
Inconsistency Problem in Heterogeneous Federated Optimization", NeurIPS).

Client k runs tau_k local steps. Its cumulative update is a linear combination of the stochastic
gradients it computed, Delta_k = -eta G_k a_k, where a_k holds each step's weight in the final model
(Sec. 4, eqs. (5)-(7)). FedAvg's weighted mean sum_k p_k Delta_k lets clients that take more (or more
heavily weighted) steps dominate and converges to a mismatched objective. FedNova normalises first:

    d_k      = Delta_k / ||a_k||_1                  (normalised update, eta folded in)
    tau_eff  = sum_k p_k ||a_k||_1                  (effective number of steps)
    Delta    = tau_eff * sum_k p_k d_k              (aggregated update)

and the server moves x^{t+1} = x^t + Delta, i.e. the paper's x^{t+1} = x^t - tau_eff sum_k p_k eta d_k
with the paper's d_k = G_k a_k / ||a_k||_1 (a descent direction, so eta d_k = -Delta_k / ||a_k||_1).
This module returns Delta; the recipe's server optimizer then applies it as the pseudo-gradient -Delta.
Server SGD with lr 1 (the default) is FedNova exactly; server momentum or FedAdam on top give the
paper's "FedNova + server momentum" style variants.

The normalising factor ||a_k||_1 of the local solver (Sec. 4 "examples" and the appendix):

* vanilla SGD:                          ||a_k||_1 = tau_k
* SGD with momentum rho (PyTorch's form v <- rho v + g, w <- w - eta v):
                                        ||a_k||_1 = [tau_k - rho (1 - rho^tau_k) / (1 - rho)] / (1 - rho)
  (the gradient of step j moves the final model by eta sum_{i=0}^{tau_k-1-j} rho^i; summing over j)
* proximal SGD (FedProx, prox_mu > 0):  ||a_k||_1 = [1 - (1 - eta mu)^tau_k] / (eta mu)
* momentum and proximal term together: the exact value for this linear recursion. The gradient of the
  step m steps before the end moves the final model by -eta a(m), the impulse response of the scalar
  recursion v <- rho v + mu w, w <- w - eta v started from v = 1, w = -eta; ||a_k||_1 = sum_m |a(m)|. With
  both terms some a(m) are negative (the proximal pull overshoots with momentum), so the norm is not the
  signed sum of the coefficients; it reduces to the closed forms above when every a(m) is positive.

``tau_k`` and ``rho`` come from the client context (``ctx.num_steps``, ``ctx.local.momentum``); set
``prox_mu`` to the FedProx ``mu`` when both components are used (FedNova cannot see other
components). Weight decay is treated as part of the local objective's gradient and does not change
a_k, as in the authors' optimizer.

The weights p_k are the recipe weighting's (data size by default) normalised over the clients
aggregated this round. With equal ||a_k||_1 for every client, tau_eff = ||a||_1 and FedNova is
exactly FedAvg.

The server accepts a client's ``a`` only if it is the factor the server computes itself from the client's
example count and the round's local settings (``extras_spec``; ``fedsight.engine.contract``): a client cannot
rescale its own update or, through tau_eff, everyone else's.
"""

from __future__ import annotations

import math

import torch
from pydantic import Field

from ..functional.aggregate import Weights, normalize_weights, weights_for
from ..records import ClientResult
from ..registry import COMPONENTS, Params
from .aggregators import Aggregator
from ..training import ClientContext, Component, ExtrasSpec, UploadContext


def normalizing_factor(steps: int, lr: float, momentum: float = 0.0, prox_mu: float = 0.0) -> float:
    """||a_k||_1 of ``steps`` local steps (see the module docstring)."""
    if steps <= 0:
        return 0.0
    rho = float(momentum)
    if prox_mu == 0.0:
        if rho == 0.0:
            return float(steps)
        return (steps - rho * (1.0 - rho**steps) / (1.0 - rho)) / (1.0 - rho)
    if rho == 0.0:
        q = 1.0 - lr * prox_mu
        return (1.0 - q**steps) / (lr * prox_mu)
    v, w = 1.0, -lr  # a unit gradient in the first of m remaining steps: a(1) = 1
    total = 1.0
    for _ in range(steps - 1):
        v = rho * v + prox_mu * w
        w = w - lr * v
        total += abs(w / lr)
    return total


class FedNovaAggregator(Aggregator):
    """Delta = tau_eff sum_k p_k Delta_k / ||a_k||_1 with tau_eff = sum_k p_k ||a_k||_1."""

    name = "fednova"

    def aggregate(self, results: list[ClientResult], weights: Weights) -> dict[str, torch.Tensor]:
        """Per-tensor weights (FedVG's layer/block granularity) apply FedNova tensor by tensor, each
        with its own p and tau_eff."""
        a = torch.tensor([_factor(r) for r in results], dtype=torch.float64)
        out = {}
        for k, ref in results[0].delta.items():
            p = normalize_weights(weights_for(weights, k))
            tau_eff = (p * a).sum()
            # coefficient of Delta_k: p_k tau_eff / a_k (a client that took no step contributes nothing)
            coef = torch.where(a > 0, p * tau_eff / a.clamp_min(1e-300), torch.zeros_like(a))
            stacked = torch.stack([r.delta[k].to(torch.float64) for r in results])
            out[k] = torch.tensordot(coef.to(stacked.device), stacked, dims=1).to(ref.dtype)
        return out


def _factor(result: ClientResult) -> float:
    try:
        return float(result.extras["fednova"]["a"])
    except KeyError:
        raise ValueError(
            f"fednova aggregator: client {result.client_id} sent no normalising factor "
            "(extras['fednova']['a']); use the 'fednova' recipe component, not the aggregator alone"
        ) from None


class FedNovaParams(Params):
    prox_mu: float = Field(
        0.0, ge=0, description="FedProx mu used by the clients' local objective, if any (changes ||a_k||_1)"
    )


class FedNova(Component):
    """Client: report ||a_k||_1 of its local solver. Server: the FedNova aggregator."""
    uploads_extras = True  # the normalising factor a_i

    name = "fednova"

    def __init__(self, prox_mu: float = 0.0):
        self.prox_mu = float(prox_mu)
        self._aggregator = FedNovaAggregator()

    def client_end(self, ctx: ClientContext, result: ClientResult) -> None:
        local = ctx.local
        a = normalizing_factor(ctx.num_steps, local.lr, getattr(local, "momentum", 0.0), self.prox_mu)
        result.extras[self.name] = {"a": torch.tensor(a, dtype=torch.float64)}

    def aggregator(self) -> FedNovaAggregator:
        return self._aggregator

    def extras_spec(self, ctx: UploadContext) -> ExtrasSpec | None:
        """``a``: a float64 scalar from every training client, equal to the factor the server computes itself
        from the client's (contract-checked) example count and the round's local settings: its steps
        ``local.num_steps(n, seed, round, client)``, rate and momentum, and ``prox_mu``. Any other value would
        rescale the client's own update (a small ``a``) or every other one (a large ``a`` inflates tau_eff)."""
        if not ctx.trains:
            return None
        seed, r, local = ctx.seed, ctx.round, ctx.local

        def check(group, result) -> str | None:
            at = local.at_round(r)
            steps = at.num_steps(int(result.num_examples), seed, r, int(result.client_id))
            want = normalizing_factor(steps, at.lr, getattr(at, "momentum", 0.0), self.prox_mu)
            got = float(group["a"])
            if not math.isclose(got, want, rel_tol=1e-9, abs_tol=0.0):
                return f"a = {got!r}, but {steps} local steps give ||a||_1 = {want!r}"
            return None

        return ExtrasSpec({"a": ((), torch.float64)}, check=check)


@COMPONENTS.register(
    "fednova",
    params=FedNovaParams,
    help="FedNova normalised averaging for heterogeneous local steps (Wang et al. 2020)",
)
def _fednova(params: FedNovaParams) -> FedNova:
    return FedNova(params.prox_mu)
