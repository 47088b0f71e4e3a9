"""Local normalisation layers: FedBN and SiloBN.

Both keep part of every normalisation layer on the client. The engine does the bookkeeping for any
sharing object: entries not in ``shared_keys`` are *personal*; a client's personal entries are loaded
before its local training and its local evaluation and saved after training (client-state key
``"personal"``, checkpointed with the run); a client never seen before starts from the global model's
values. The normalisation entries come from the model's declared groups
(``FedModel.parameter_groups()["norm"]``: parameters and buffers of normalisation layers), never from
parameter names.

- **FedBN** (Li, Jiang, Zhang, Kamp, Dou, ICLR 2021, "FedBN: Federated Learning on Non-IID Features
  via Local Batch Normalization", Algorithm 1): the server averages every parameter *except* the
  batch-normalisation layers; each client keeps its BN affine parameters (gamma, beta) and its running
  statistics (mu, sigma^2) local. The paper only has BatchNorm; we keep every declared normalisation
  layer local (GroupNorm/LayerNorm affine parameters too), the literal generalisation of "local
  normalisation layers".
- **SiloBN** (Andreux, du Terrail, Beguier, Tramel, 2020, "Siloed Federated Learning for Multi-Centric
  Histopathology Datasets"; summarised in the thesis Sec. 5.1.6): only the BN *statistics* (running_mean, running_var,
  num_batches_tracked) stay local; the learned BN affine parameters (gamma, beta) are shared and
  averaged like every other weight. Non-BN normalisation layers have no statistics, so they are
  entirely shared.

Test-time statistics (``test_stats``). Under FedBN/SiloBN the global model's own running statistics
are never aggregated (they stay at their initial values, mean 0 / variance 1), so they are meaningless
for evaluation. The engine wraps every evaluation in ``sharing.eval_context(model, ctx)``
(``fedsight.training.EvalContext``):

- ``"client"`` (default; the thesis' SiloBN "by domain" inference, FedDrive Sec. 5.2.2):

  * a client's local test split is evaluated with that client's own personal entries (the engine has
    already loaded them; nothing else happens here);
  * the global test split, which belongs to no client, is evaluated with the personal entries replaced
    by the **example-weighted average over the clients seen so far** (weights = their numbers of
    training examples; running_var is averaged as is, i.e. the mean of the clients' variances, not the
    pooled variance; integer counters such as ``num_batches_tracked`` keep the global model's value).
    Before any client has trained, the global model's values are used. The average reads every seen
    client's personal state from the store once per evaluation (memory: one model's worth).

- ``"fresh"`` (the thesis' "standard" SiloBN inference, i.e. AdaBN: statistics computed on the test
  domain with all other parameters frozen): before evaluating on a split, every BatchNorm-type layer
  that tracks running statistics has its statistics reset and recomputed on that split's inputs
  (``task.eval_inputs(split, eval_batch_size)``): momentum set to None (PyTorch's cumulative average
  over batches), only those layers in train mode (dropout stays off), forward under ``no_grad``; then the
  task evaluates in eval mode, and on exit the previous statistics, momenta and train/eval flags are
  restored. With one evaluation batch the statistics are exactly the split's mean and unbiased
  variance; with several batches they are the average of per-batch statistics (the usual AdaBN
  practice; for a deep network exact full-split statistics would need one pass per layer). This applies
  to local splits too (each client's test set gets its own fresh statistics). For FedBN the global
  split first gets the example-weighted average of the clients' non-statistics personal entries (the
  affine parameters), as in ``"client"``, since the global model's own ones are never trained.

- ``"domain"`` (the thesis' SiloBN "by domain" inference on seen domains, Sec. 5.2.2; needs a task with
  domains, e.g. segmentation): a global test split is evaluated domain by domain, each domain's images with
  the personal entries averaged over the clients that hold training images of that domain (weighted by how
  many; with one client per domain, as FedDrive's heterogeneous splits, that client's own statistics). A
  domain no client trained on gets fresh statistics on its own images (FedDrive evaluates unseen domains
  with its "standard" inference; FedBN's affine parameters are then the clients' average, as in "fresh"). The metric is computed from the merged state over all domains (one
  confusion matrix), not a mean over domains. Local splits use the client's own entries, as in ``"client"``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Literal

import numpy as np
import torch
from pydantic import Field
from torch import nn

from ..device import model_device, to_device
from ..metrics import MetricState
from ..models.base import swap_entries
from ..registry import SHARING, Params
from ..state import PERSONAL
from ..training import EvalContext
from .sharing import Sharing

#: BatchNorm-type layers: the ones with running statistics (BatchNorm1d/2d/3d, SyncBatchNorm, and
#: InstanceNorm when it tracks statistics)
_STAT_NORMS = (nn.modules.batchnorm._NormBase,)


class NormSharingParams(Params):
    test_stats: Literal["client", "fresh", "domain"] = Field(
        "client",
        description="test-time normalisation statistics: 'client' = each client's own running statistics "
        "(global test set: example-weighted average over the clients seen so far); 'fresh' = recomputed "
        "on the evaluated split's inputs (AdaBN; FedDrive's 'standard'); 'domain' = every global test image "
        "with the statistics of the training clients of its domain (FedDrive's 'by domain')",
    )


def _norm_group(model: nn.Module) -> list[str]:
    groups = getattr(model, "parameter_groups", None)
    if groups is None:
        raise TypeError(
            f"{type(model).__name__} declares no parameter groups; FedBN/SiloBN need a FedModel "
            "(fedsight.models.base) to know its normalisation layers"
        )
    return list(groups()["norm"])


def _stat_layers(model: nn.Module) -> list[tuple[str, nn.modules.batchnorm._NormBase]]:
    """Normalisation layers that keep running statistics (module types, not names)."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, _STAT_NORMS) and m.track_running_stats and m.running_mean is not None
    ]


def _stat_keys(model: nn.Module) -> set[str]:
    keys = set()
    for name, m in _stat_layers(model):
        prefix = f"{name}." if name else ""
        keys.update(prefix + b for b, _ in m.named_buffers(recurse=False))
    return keys


def nonnegative_statistics(model: nn.Module) -> set[str]:
    """The state entries of ``model``'s statistics-tracking norm layers that no honest client can make negative:
    every ``running_var`` (a moving average of variances) and ``num_batches_tracked`` (a counter). The reply
    contract refuses an upload with a negative value in any of them."""
    keys = set()
    for name, m in _stat_layers(model):
        prefix = f"{name}." if name else ""
        keys.update(prefix + b for b, _ in m.named_buffers(recurse=False) if b in ("running_var", "num_batches_tracked"))
    return keys


@contextlib.contextmanager
def fresh_statistics(model: nn.Module, batches: Iterator[torch.Tensor]) -> Iterator[None]:
    """Recompute the running statistics of every statistics-tracking norm layer on ``batches``
    (cumulative average, momentum None), keep them while the context is open, then restore the
    previous statistics, momenta and train/eval flags."""
    layers = [m for _, m in _stat_layers(model)]
    flags = {m: m.training for m in model.modules()}
    saved = [
        (m, m.momentum, m.running_mean.clone(), m.running_var.clone(), m.num_batches_tracked.clone())
        for m in layers
    ]
    try:
        with torch.no_grad():
            model.eval()
            for m in layers:
                m.reset_running_stats()
                m.momentum = None
                m.train()
            if layers:
                for x in batches:
                    # one example: counted twice (same mean; a norm layer on a 1 x 1 map needs two values)
                    model(torch.cat([x, x]) if isinstance(x, torch.Tensor) and len(x) == 1 else x)
        for m, training in flags.items():
            m.training = training
        yield
    finally:
        with torch.no_grad():
            for m, momentum, mean, var, count in saved:
                m.momentum = momentum
                m.running_mean.copy_(mean)
                m.running_var.copy_(var)
                m.num_batches_tracked.copy_(count)
        for m, training in flags.items():
            m.training = training


class NormSharing(Sharing):
    """Shares everything except (part of) the normalisation layers; see the module docstring."""

    def __init__(self, name: str, local_affine: bool, test_stats: str = "client"):
        self.name = name
        #: FedBN keeps the norm layers' parameters local too; SiloBN only their statistics
        self.local_affine = local_affine
        self.test_stats = test_stats

    def local_keys(self, model: nn.Module) -> set[str]:
        norm = set(_norm_group(model))
        if self.local_affine:
            return norm
        buffers = {k for k, _ in model.named_buffers()}
        return norm & buffers  # BN running_mean / running_var / num_batches_tracked

    def shared_keys(self, model: nn.Module) -> set[str]:
        return set(model.state_dict()) - self.local_keys(model)

    # -- evaluation -------------------------------------------------------------------------------

    def client_average(self, ctx: EvalContext, keys: list[str], weights: dict[int, float] | None = None
                       ) -> dict[str, torch.Tensor]:
        """Weighted mean of the floating-point personal ``keys`` over the clients that have personal state
        (weights: ``weights[c]`` for the clients in ``weights``, else every client's number of training
        examples); {} if none has."""
        clients = ctx.store.clients(PERSONAL) if ctx.store is not None else []
        if weights is not None:
            clients = [c for c in clients if c in weights]
        if not clients or not keys:
            return {}
        acc: dict[str, torch.Tensor] = {}
        total = 0.0
        dtypes: dict[str, torch.dtype] = {}
        for c in clients:
            w = float(weights[c] if weights is not None else ctx.task.num_train_examples(c))
            entries = ctx.store.get(PERSONAL, c)
            for k in keys:
                v = entries[k]
                dtypes[k] = v.dtype
                acc[k] = acc.get(k, 0) + w * v.to(torch.float64)
            total += w
        if total <= 0:
            return {}
        return {k: (v / total).to(dtypes[k]) for k, v in acc.items()}

    @contextlib.contextmanager
    def eval_context(self, model: nn.Module, ctx: EvalContext) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if ctx.is_global_test:
                state = model.state_dict()
                personal = [k for k in ctx.personal_keys if state[k].is_floating_point()]
                if self.test_stats == "fresh":
                    stats = _stat_keys(model)
                    personal = [k for k in personal if k not in stats]  # recomputed below anyway
                avg = self.client_average(ctx, personal)
                if avg:
                    stack.enter_context(swap_entries(model, avg))
            if self.test_stats == "fresh":
                stack.enter_context(self._fresh(model, ctx))
            yield

    def evaluate(self, model: nn.Module, ctx: EvalContext, run: Callable[[EvalContext], MetricState]) -> MetricState:
        """``test_stats = "domain"`` on a global test split: each domain's images (``task.domain_groups``)
        evaluated with the personal entries averaged over the clients holding training images of that domain
        (weights: their numbers of such images; FedDrive's code picks one such client); a domain no client
        trained on (an unseen domain) is evaluated as the "fresh" rule evaluates a global split: fresh
        statistics on its own images (FedDrive's 'standard' inference) and, for FedBN, the clients' average of
        the other personal entries. The domains' metric states merge (one confusion matrix over the split)."""
        if self.test_stats != "domain" or not ctx.is_global_test or ctx.subset is not None:
            return super().evaluate(model, ctx, run)
        counts = ctx.task.client_domain_counts()
        state = model.state_dict()
        personal = [k for k in ctx.personal_keys if state[k].is_floating_point()]
        stats = _stat_keys(model)
        states = []
        for d, members in ctx.task.domain_groups(ctx.split):
            part = dataclasses.replace(ctx, subset=members)
            owners = {int(c): float(counts[c, d]) for c in np.flatnonzero(counts[:, d])}
            entries = self.client_average(ctx, personal, owners) if owners else {}
            with contextlib.ExitStack() as stack:
                if entries:
                    stack.enter_context(swap_entries(model, entries))
                else:
                    others = self.client_average(ctx, [k for k in personal if k not in stats])
                    if others:
                        stack.enter_context(swap_entries(model, others))
                    stack.enter_context(self._fresh(model, part))
                states.append(run(part))
        return ctx.task.metrics.merge(states)

    def _fresh(self, model: nn.Module, ctx: EvalContext) -> contextlib.AbstractContextManager:
        device = model_device(model)
        inputs = (ctx.task.eval_inputs(ctx.split, ctx.batch_size) if ctx.subset is None
                  else ctx.task.eval_inputs(ctx.split, ctx.batch_size, ctx.subset))
        return fresh_statistics(model, (to_device(x, device) for x in inputs))


def _requires(needs: str) -> Callable[[NormSharingParams], set[str]]:
    return lambda p: {needs, "domains"} if p.test_stats == "domain" else {needs}


@SHARING.register(
    "fedbn", params=NormSharingParams, requires=_requires("norm_layers"),
    help="FedBN (Li et al. 2021): normalisation layers (parameters and statistics) stay local",
)
def _fedbn(params: NormSharingParams) -> NormSharing:
    return NormSharing("fedbn", local_affine=True, test_stats=params.test_stats)


@SHARING.register(
    "silobn", params=NormSharingParams, requires=_requires("norm_stats"),
    help="SiloBN (Andreux et al. 2020): BN statistics stay local, BN affine parameters are shared",
)
def _silobn(params: NormSharingParams) -> NormSharing:
    return NormSharing("silobn", local_affine=False, test_stats=params.test_stats)
