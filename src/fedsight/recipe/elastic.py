"""Elastic aggregation (Chen et al. 2023, "Elastic Aggregation for Federated Optimization", CVPR),
in the form the FedVG paper uses it as a baseline (its code: ``fedgradelastic.py``, from FL-bench).

Algorithm 1 of the paper, as implemented here:

* **Client k** (before local training, on the received global model theta^t): draw a random sample of
  m = max(1, floor(sample_ratio * n_k)) of its training examples and go over it in mini-batches of the
  local batch size. For every shared trainable parameter tensor i keep an exponential moving average

      S_{k,i} <- mu S_{k,i} + (1 - mu) ||dL/dtheta_i||^2        (S_{k,i} = 0 before the first batch)

  of the squared gradient norm of the task loss L on each mini-batch: the parameter's *sensitivity*.
  Then train locally as usual and upload Delta_k together with S_k (``result.extras["elastic"]``).
* **Server**: with p_k the normalised client weights (data size by default; FedVG's scores when the
  recipe's weighting is FedVG's),

      zeta_i  = 1 + tau - (sum_k p_k S_{k,i}) / max_k S_{k,i}
      Delta_i = zeta_i * sum_k p_k Delta_{k,i}

  so sensitive parameters (where the weighted mean sensitivity is close to the largest client's) move
  less (zeta -> tau) and insensitive ones move more (zeta -> 1 + tau). The recipe's server optimizer
  applies Delta (server SGD lr 1 = theta_i <- theta_i + zeta_i sum_k p_k Delta_{k,i}, the paper's
  update). A tensor with zero sensitivity at every client (no gradient) gets ratio 1, zeta = tau.

Choices where the paper and its code differ or leave room (say so when comparing numbers):

* Granularity: ``"tensor"`` (default) keeps one sensitivity per parameter tensor, as the authors'
  released code and FedVG's baseline do; ``"element"`` keeps one per scalar parameter (the squared
  gradient elementwise, zeta elementwise), closer to the paper's per-parameter notation; it costs an
  upload the size of the model.
* Measure: the paper describes sensitivity as the change of the prediction function's output
  (unsupervised, in the style of Memory Aware Synapses); the code this baseline follows uses the
  squared gradient norm of the supervised training loss, which is what we compute.
* The EMA starts from zero for every client in every round (the FedVG code reuses one buffer across
  clients and rounds, and accumulates gradients across mini-batches without zeroing, which we take to
  be accidental). The pass runs in eval mode (as the code does: BatchNorm statistics and dropout are
  untouched) and uses ``torch.autograd.grad``, so no ``.grad`` is left behind: local training is
  exactly what it would be without the component.
* Data: the authors' code trains locally only on the 1 - sample_ratio of the data not drawn for the
  sensitivity sample. We train on all of the client's data (the local loop is shared by every
  recipe); the sample is only read for the sensitivity pass.

The sample is ``torch.randperm(n_k, generator=fedsight.rng.torch_gen(seed, "elastic", round,
client))[:m]``, visited in that order in batches of ``local.batch_size``.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from ..functional.aggregate import Weights, normalize_weights, weights_for
from ..records import ClientResult
from ..registry import COMPONENTS, Params
from ..rng import torch_gen
from .aggregators import Aggregator
from ..training import ClientContext, Component, ExtrasSpec, UploadContext


class ElasticAggregator(Aggregator):
    """Delta_i = zeta_i sum_k p_k Delta_{k,i}, zeta_i = 1 + tau - (sum_k p_k S_{k,i}) / max_k S_{k,i}."""

    name = "elastic"

    def __init__(self, tau: float = 0.5):
        self.tau = float(tau)

    def zeta(self, sens: list[torch.Tensor], p: torch.Tensor) -> torch.Tensor:
        s = torch.stack([t.to(torch.float64) for t in sens])
        mean = torch.tensordot(p.to(s.device), s, dims=1)
        peak = s.max(dim=0).values
        ratio = torch.where(peak > 0, mean / peak.clamp_min(1e-300), torch.ones_like(mean))
        return 1.0 + self.tau - ratio

    def aggregate(self, results: list[ClientResult], weights: Weights) -> dict[str, torch.Tensor]:
        """Per-tensor weights (FedVG's layer/block granularity) enter both sums of tensor i."""
        out = {}
        for k, ref in results[0].delta.items():
            p = normalize_weights(weights_for(weights, k))
            zeta = self.zeta([_sensitivity(r, k) for r in results], p)
            stacked = torch.stack([r.delta[k].to(torch.float64) for r in results])
            mean = torch.tensordot(p.to(stacked.device), stacked, dims=1)
            out[k] = (zeta.to(mean.device) * mean).to(ref.dtype)
        return out


def _sensitivity(result: ClientResult, key: str) -> torch.Tensor:
    try:
        return result.extras["elastic"][key]
    except KeyError:
        raise ValueError(
            f"elastic aggregator: client {result.client_id} sent no sensitivity for {key!r} "
            "(extras['elastic']); use the 'elastic' recipe component, not the aggregator alone"
        ) from None


def _nonnegative(group, result) -> str | None:
    bad = sorted(k for k, t in group.items() if bool((t < 0).any()))
    return f"negative sensitivity in {', '.join(bad[:3])}" if bad else None


class ElasticParams(Params):
    tau: float = Field(0.5, ge=0, description="zeta = 1 + tau - mean/max sensitivity; tau is the smallest scale")
    mu: float = Field(0.95, ge=0, lt=1, description="decay of the sensitivity moving average over mini-batches")
    sample_ratio: float = Field(0.3, gt=0, le=1, description="fraction of client data sampled to measure sensitivity")
    granularity: Literal["tensor", "element"] = Field(
        "tensor", description="one sensitivity per parameter tensor (authors' code) or per scalar parameter"
    )


class Elastic(Component):
    """Client: parameter sensitivity on the received global model. Server: elastic aggregation."""
    uploads_extras = True  # the sensitivities S_k

    name = "elastic"

    def __init__(self, tau: float = 0.5, mu: float = 0.95, sample_ratio: float = 0.3, granularity: str = "tensor"):
        if granularity not in ("tensor", "element"):
            raise ValueError(f"elastic: granularity must be 'tensor' or 'element', got {granularity!r}")
        self.mu, self.sample_ratio, self.granularity = float(mu), float(sample_ratio), granularity
        self._aggregator = ElasticAggregator(tau)

    def client_start(self, ctx: ClientContext) -> None:
        if ctx.task is None:
            raise RuntimeError("elastic: the client context carries no task to draw the sensitivity sample from")
        model, n = ctx.model, ctx.num_examples
        names = list(ctx.global_params)
        by_name = dict(model.named_parameters())
        params = [by_name[k] for k in names]
        sens = {
            k: torch.zeros((), dtype=p.dtype, device=p.device) if self.granularity == "tensor" else torch.zeros_like(p)
            for k, p in zip(names, params)
        }
        m = max(1, int(self.sample_ratio * n)) if n > 0 else 0
        sample = torch.randperm(n, generator=torch_gen(ctx.seed, "elastic", ctx.round, ctx.client_id))[:m]
        bs = ctx.local.batch_size
        was_training = model.training
        model.eval()
        try:
            for s in range(0, m, bs):
                x, y = ctx.batch(sample[s : s + bs])
                loss = ctx.task.loss(model(x), y)
                grads = torch.autograd.grad(loss, params, allow_unused=True)
                for k, g in zip(names, grads):
                    if g is None:
                        sq = torch.zeros_like(sens[k])
                    elif self.granularity == "tensor":
                        sq = g.detach().pow(2).sum()
                    else:
                        sq = g.detach().pow(2)
                    sens[k] = self.mu * sens[k] + (1.0 - self.mu) * sq
        finally:
            model.train(was_training)
        ctx.scratch[self.name] = sens

    def client_end(self, ctx: ClientContext, result: ClientResult) -> None:
        result.extras[self.name] = ctx.scratch.pop(self.name)

    def extras_spec(self, ctx: UploadContext) -> ExtrasSpec | None:
        """S_k: per shared trainable entry, a scalar (``"tensor"``) or the entry's shape (``"element"``), in the
        entry's dtype, non-negative (a negative sensitivity would push zeta outside [tau, 1 + tau])."""
        if not ctx.trains:
            return None
        spec = {k: (() if self.granularity == "tensor" else shape, dtype) for k, (shape, dtype) in ctx.shared_spec().items()}
        return ExtrasSpec(spec, check=_nonnegative)

    def aggregator(self) -> ElasticAggregator:
        return self._aggregator


@COMPONENTS.register(
    "elastic", params=ElasticParams, help="Elastic aggregation by parameter sensitivity (Chen et al. 2023)"
)
def _elastic(params: ElasticParams) -> Elastic:
    return Elastic(params.tau, params.mu, params.sample_ratio, params.granularity)
