"""FedVG: gradient-guided client weights from a server-held validation set (Devkota et al., "FedVG:
Gradient-Guided Aggregation for Enhanced Federated Learning", CVPR 2026 Findings, arXiv 2602.21399).
Equation numbers follow the seed digest ``notes/003_fedvg.md`` (the seed text lost its formulas; the
digest reconstructs them from the prose and the authors' code).

FedVG is a *client weighting* (``[recipe] weighting = {name = "fedvg"}``). Each round, for every
received client update, the server rebuilds the client model theta_k = theta^t + Delta_k, computes
the task's validation loss on the server-held set V,

    L_val(theta_k) = (1/|V|) sum_{(x, y) in V} l(f(x; theta_k), y)                     (Eq. 3)

backpropagates it once, and takes the norm of each parameter tensor's gradient. Then

    g_k = (1/L) sum_l ||grad_{theta_k^l} L_val(theta_k)||                              (Eq. 4 / E.11)
    s_k = 1 / (g_k + eps),   p_k = s_k / sum_{j in S_t} s_j                           (Eq. 5, Eq. 2)

with the pure math in ``fedsight.functional.fedvg``. ``score = "delta"`` is the paper's delta-norm variant
(E.10, the "delta" bars of the norm-type ablation, Fig. 8 / App. A.7.2): the same formulas on the norms of
the client's update instead of its validation gradient,

    g_k = (1/L) sum_l ||theta_k^l - theta_g^l|| = (1/L) sum_l ||Delta_k^l||                 (E.10)

so a client that moved less from the global model gets more weight, and the server needs no validation
pass (the paper motivates it by FedProx's drift penalty; it reports 69.99% against L1's 70.36%). The
paper names the variant beside L1, L2 and spectral without saying which norm it takes of the update;
here it is ``norm`` (L1 by default, FedVG's), applied to each tensor of the update as to a gradient.
Granularity ``"layer"`` gives one weight per
client and parameter tensor (E.13-E.16), ``"block"`` one per client and model-declared block
(``FedModel.blocks()``, E.17-E.21); both return per-state-key weights, which every aggregator that
uses weights accepts (mean, FedNova, Elastic, weighted Multi-Krum) and with which the engine also
averages BatchNorm running statistics.

Because the weighting slot feeds whatever aggregator and server optimizer the recipe has, FedVG
combines with every other method from config alone (paper §5.2, Eq. 8): ``weighting = "fedvg"`` plus
``components = [{name = "fedprox", mu = 0.01}]`` is FedProx + FedVG (FedVG weights *replace* the data
size weights, as the authors' ``fedgradprox.py``), likewise SCAFFOLD, FedDyn, Elastic, FedNova, and
server optimizers FedAvgM / FedAdam. FedDyn's dual-state correction and SCAFFOLD's control update
stay unweighted, as in the authors' ``fedgraddyn.py`` / ``fedgradscaffold.py``. The coordinate-wise
median and trimmed mean ignore client weights by design, so with them FedVG only weights the BatchNorm
statistics. ``mode = "average"`` is the paper's FedAvg + FedVG:
p_k = (b_k / sum_j b_j + s_k / sum_j s_j) / 2 with b the ``base`` weights (data size by default).

Choices (the paper is silent; the authors' code decides some):

* The validation loss is the task's own differentiable loss (``task.loss`` over
  ``task.eval_batches("val", batch_size)``), so FedVG works for any task that serves a "val" split.
  It is the exact mean over V: each batch's mean loss is weighted by its share of V (the authors' code
  sums per batch and averages over batches; the constant factor cancels in the normalisation).
* ``bn_mode = "train"`` (default, as the authors' code) normalises with each validation batch's own
  statistics; ``"eval"`` uses the client model's running statistics. Either way dropout is off (the
  authors' code runs the whole model in train mode, dropout included), so the score is a
  deterministic function of the client model and draws nothing from the RNG; the pass runs on a scratch copy of the
  global model (one deep copy for the whole run, reloaded per client), so nothing it does (running
  statistics updates) leaks into training. With ``bn_mode = "train"`` the batch size changes the score,
  and (for a model with BatchNorm) a trailing validation batch of a single example is merged into the
  batch before it.
* The normed tensors are the shared trainable parameters that receive a gradient (weights and biases
  count separately, BN affine parameters included), as in the authors' code. Non-shared entries
  (FedBN's local norm layers, personal heads) take the global model's values: FedVG then scores the
  shared part of the model.
* Cost accounting (logged every round into the metrics row): ``fedvg/server_passes`` (forward+backward
  batch passes), ``fedvg/server_examples`` (examples forwarded and backpropagated, K * |V|),
  ``fedvg/score_s`` (seconds spent scoring), ``fedvg/val_loss_mean`` (mean validation loss of the
  client models) and ``fedvg/weight_max`` (the largest model-level weight, a concentration check).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping
from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from ..device import model_device, to_device
from ..functional import fedvg as FV
from ..functional.aggregate import Weights, normalize_weights
from ..metrics import MetricSpec
from ..records import ClientResult
from ..registry import WEIGHTINGS, Params
from ..training import ServerContext
from .weighting import ClientWeighting

NAME = "fedvg"


class FedVGParams(Params):
    norm: Literal["l1", "l2", "spectral"] = Field(
        "l1", description="layer gradient norm: l1 (paper default), l2, spectral (matrices; 1-d tensors use l2)"
    )
    granularity: Literal["model", "block", "layer"] = Field(
        "model", description="one weight per client (model), per declared block, or per parameter tensor"
    )
    eps: float = Field(1e-8, gt=0, description="s_k = 1 / (g_k + eps)")
    mode: Literal["replace", "average"] = Field(
        "replace", description="replace the base weights, or average with them (the paper's FedAvg + FedVG)"
    )
    base: Literal["data_size", "uniform"] = Field("data_size", description="the weights averaged with in mode average")
    bn_mode: Literal["train", "eval"] = Field(
        "train", description="BatchNorm during the validation pass: batch statistics (authors' code) or running"
    )
    batch_size: int = Field(128, ge=1, description="validation batch size of the server pass")
    score: Literal["gradient", "delta"] = Field(
        "gradient", description="norms of: the validation gradient (FedVG), or the client's update (E.10)"
    )


def _batchnorm_train_only(model: nn.Module, bn_train: bool) -> None:
    """Eval mode everywhere (dropout off); BatchNorm layers in train mode if ``bn_train``."""
    model.eval()
    if bn_train:
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.train()


def model_blocks(model: nn.Module) -> dict[str, list[str]]:
    """The model's declared blocks (``FedModel.blocks()``); for another module, one block per direct
    child holding state."""
    if hasattr(model, "blocks"):
        return model.blocks()
    out = {n: [f"{n}.{k}" for k in m.state_dict(keep_vars=True)] for n, m in model.named_children()}
    return {k: v for k, v in out.items() if v}


def _val_batches(task: Any, batch_size: int, merge_single: bool):
    """``task.eval_batches("val", batch_size)``; with ``merge_single`` a trailing batch of one example
    is appended to the batch before it (BatchNorm cannot use batch statistics of a single example)."""
    prev = None
    for x, y in task.eval_batches("val", batch_size):
        if prev is not None:
            if merge_single and len(y) == 1 and torch.is_tensor(x) and torch.is_tensor(y):
                prev = (torch.cat([prev[0], x]), torch.cat([prev[1], y]))
                continue
            yield prev
        prev = (x, y)
    if prev is not None:
        yield prev


class FedVGWeighting(ClientWeighting):
    """FedVG client weights (Eq. 3-5; E.11-E.21) from the server-held validation split "val"."""

    name = NAME

    def __init__(self, params: FedVGParams | None = None):
        self.p = params or FedVGParams()
        self._scratch: tuple[nn.Module, nn.Module, dict[str, torch.Tensor]] | None = None

    def _scratch_model(self, model: nn.Module) -> tuple[nn.Module, dict[str, torch.Tensor]]:
        """One deep copy of the global model, made once and reused for every client and round."""
        if self._scratch is None or self._scratch[0] is not model:
            work = copy.deepcopy(model)
            for p in work.parameters():
                p.grad = None
            self._scratch = (model, work, work.state_dict(keep_vars=True))
        return self._scratch[1], self._scratch[2]

    @torch.no_grad()
    def _load_client(self, state: dict[str, torch.Tensor], gstate: Mapping[str, torch.Tensor], r: ClientResult) -> None:
        """theta_k = theta^t + Delta_k for the shared parameters, the client's shared buffers, the global
        model's values for everything else."""
        for k, v in state.items():
            v.copy_(gstate[k])
        for k, d in r.delta.items():
            state[k].add_(d.to(state[k]))
        for k, b in r.buffers.items():
            state[k].copy_(b)

    def validation_gradients(
        self, model: nn.Module, task: Any, keys: list[str]
    ) -> tuple[dict[str, torch.Tensor], float, int, int]:
        """Gradients of L_val (Eq. 3, the mean task loss over V) for the parameters ``keys``, the loss,
        the number of batch passes and of examples."""
        params = dict(model.named_parameters())
        tracked = [params[k] for k in keys if k in params and params[k].requires_grad]
        for p in model.parameters():
            p.grad = None
        _batchnorm_train_only(model, self.p.bn_mode == "train")
        loss_sum, passes, n = 0.0, 0, 0
        with torch.enable_grad():
            merge = self.p.bn_mode == "train" and any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
            device = model_device(model)
            for x, y in _val_batches(task, self.p.batch_size, merge):
                x, y = to_device(x, device), to_device(y, device)
                nb = len(y)
                loss = task.loss(model(x), y) * nb  # summed over the batch; divided by |V| below
                loss.backward()
                loss_sum += float(loss.detach())
                passes += 1
                n += nb
        if n == 0:
            raise ValueError("fedvg: the validation split 'val' is empty")
        grads = {k: params[k].grad / n for k in keys if k in params and params[k].grad is not None}
        for p in tracked:
            p.grad = None
        return grads, loss_sum / n, passes, n

    def weights(self, results: list[ClientResult], sctx: ServerContext) -> Weights:
        if self.p.score == "delta":  # E.10: no validation pass
            t0 = time.perf_counter()
            norms = [FV.layer_norms(r.delta, self.p.norm) for r in results]
            return self._finish(results, sctx, norms, None, 0, 0, t0)
        task = sctx.task
        if task is None:
            raise RuntimeError("fedvg: the server context carries no task to compute validation losses with")
        t0 = time.perf_counter()
        work, state = self._scratch_model(sctx.model)
        gstate = sctx.model.state_dict()
        keys = list(results[0].delta)
        norms, losses, passes, examples = [], [], 0, 0
        try:
            for r in results:
                self._load_client(state, gstate, r)
                grads, loss, np_, ne = self.validation_gradients(work, task, keys)
                norms.append(FV.layer_norms(grads, self.p.norm))
                losses.append(loss)
                passes += np_
                examples += ne
        except NotImplementedError as exc:
            raise RuntimeError(
                f"fedvg: task {getattr(task, 'name', task)!r} serves no validation batches ({exc}); FedVG needs a "
                'server-held validation set: set [validation] source = "carve" or "dataset"'
            ) from None
        return self._finish(results, sctx, norms, losses, passes, examples, t0, work)

    def _finish(self, results: list[ClientResult], sctx: ServerContext, norms: list[dict[str, torch.Tensor]],
                losses: list[float] | None, passes: int, examples: int, t0: float, work: nn.Module | None = None
                ) -> Weights:
        """Eq. 4-5 (or E.10) and Eq. 2 from the per-client layer norms, the mode, and the round's metrics
        (no ``val_loss_mean`` without a validation pass)."""
        state_keys = [*results[0].delta, *results[0].buffers]
        blocks = model_blocks(work if work is not None else sctx.model) if self.p.granularity == "block" else None
        w = FV.fedvg_weights(norms, self.p.granularity, self.p.eps, blocks, state_keys)
        if self.p.mode == "average":
            base = torch.tensor(
                [float(r.num_examples) if self.p.base == "data_size" else 1.0 for r in results], dtype=torch.float64
            )
            w = FV.average_weights(base, w)
        model_level = w if isinstance(w, torch.Tensor) else None
        if model_level is None:
            # the model-level weights (what buffers and unblocked keys get) for the concentration metric
            model_level = FV.client_weights_from_norms([FV.mean_layer_norm(n) for n in norms], self.p.eps)
            if self.p.mode == "average":
                model_level = FV.average_weights(base, model_level)
        sctx.metrics.update({
            f"{NAME}/server_passes": float(passes),
            f"{NAME}/server_examples": float(examples),
            f"{NAME}/score_s": time.perf_counter() - t0,
            **({f"{NAME}/val_loss_mean": sum(losses) / len(losses)} if losses else {}),
            f"{NAME}/weight_max": float(normalize_weights(model_level).max()),
        })
        return w


@WEIGHTINGS.register(
    NAME, params=FedVGParams, help="FedVG: inverse validation-gradient norms on a server-held set (Devkota et al. 2026)",
    requires={"val_split"},
    metrics=(
        MetricSpec(f"{NAME}/server_passes", False, "forward+backward batch passes of the server's scoring"),
        MetricSpec(f"{NAME}/server_examples", False, "examples the server scored (clients x |V|)"),
        MetricSpec(f"{NAME}/score_s", False, "seconds the server spent scoring"),
        MetricSpec(f"{NAME}/val_loss_mean", False, "mean validation loss of the client models"),
        MetricSpec(f"{NAME}/weight_max", None, "the largest client weight (concentration)"),
    ),
)
def _fedvg(params: FedVGParams) -> FedVGWeighting:
    return FedVGWeighting(params)
