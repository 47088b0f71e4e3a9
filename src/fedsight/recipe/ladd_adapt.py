"""LADD's adaptation stage (thesis Sec. 5.3.5-5.3.8): self-training with the SWA teacher and distillation to
theta^0 (``self_training``), cluster-specific aggregation and evaluation (``cluster_aggregation``). The stage
layout and the choices made where the thesis is ambiguous are in ``fedsight.recipe.ladd``."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field
from torch import nn

from ..device import model_device, to_device
from ..functional.clustering import assign
from ..functional.self_training import (
    IGNORE,
    entropy,
    kl_divergence,
    normalized_entropy4,
    pseudo_label_ce,
    pseudo_labels,
    soft_target_ce,
    swa_update,
)
from ..models.base import swap_entries
from ..records import ClientResult
from ..registry import COMPONENTS, Params
from ..training import ClientContext, Component, EvalContext, ServerContext, VectorStep
from ..tasks.segmentation import main_output, upsample
from .ladd import CENTROIDS, GROUPS, HALF, THETA0, _entries, cluster_prefix


def _groups(facts: dict[str, torch.Tensor], num_clients: int) -> np.ndarray:
    """The cluster of every client (all in cluster 0 before or without clustering)."""
    groups = facts.get(GROUPS)
    return groups.cpu().numpy() if groups is not None else np.zeros(num_clients, dtype=np.int64)


def _cluster_model(sctx: ServerContext, s: int) -> dict[str, torch.Tensor]:
    """theta_s = {u, v_s}: a copy of the global state with cluster s's specific entries (if any)."""
    state = {k: v.detach().clone() for k, v in sctx.model.state_dict().items()}
    state.update({k: v.clone() for k, v in _entries(sctx.facts, cluster_prefix(s)).items()})
    return state


def _frozen_copy(model: nn.Module, state: dict[str, torch.Tensor], batch_stats: bool = False) -> nn.Module:
    """``model`` with ``state`` loaded, frozen and in eval mode; with ``batch_stats`` its BatchNorm layers
    normalise with the statistics of the batch they see (train mode; their running statistics are never read)."""
    other = copy.deepcopy(model)
    other.load_state_dict({**other.state_dict(), **state})
    other.eval()
    if batch_stats:
        for m in other.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.train()
    for p in other.parameters():
        p.requires_grad_(False)
    return other


# ------------------------------------------------------------------------------------------ self-training


class SelfTrainingParams(Params):
    threshold: float = Field(0.9, ge=0, le=1, description="keep a pseudo-label whose probability exceeds this (0 or "
                             "1: off)")
    fraction: float = Field(0.66, ge=0, le=1, description="also keep the most confident fraction of each predicted "
                            "class's pixels in an image (0 or 1: off)")
    reduction: Literal["all", "kept"] = Field("all", description="the CE's denominator: all pixels (the authors' "
                                              "code) or the pseudo-labelled ones")
    teacher: Literal["swa", "model"] = Field("swa", description="pseudo-labels from the SWA teacher of the client's "
                                             "cluster (eq. 5.22) or from the client's own current model")
    pseudo: Literal["teacher_ce", "own_ce_kl"] = Field("teacher_ce", description="L_PSEUDO: CE to the teacher's "
                                                      "pseudo-labels (the authors' code) or eq. 5.19: CE to the "
                                                      "student's own + KL(student || teacher)")
    every: int = Field(1, ge=1, description="the teacher is updated every omega rounds of the stage")
    start: int = Field(0, ge=0, description="t_START: rounds of the stage before the teacher averages (a multiple of "
                       "every)")
    kd_lambda: float = Field(0.0, ge=0, description="weight of the distillation to theta^0 (the authors: 20; 0: off)")
    kd_alpha: float = Field(0.5, gt=0, description="theta^0's logits are scaled by this in the soft targets")
    kd_form: Literal["soft_ce", "kl"] = Field("soft_ce", description="the authors' soft-target CE (masked to the "
                                              "pseudo-labelled pixels) or eq. 5.20's KL(student || theta^0)")
    entropy_lambda: float = Field(0.0, ge=0, description="weight of the entropy term (eq. 5.21; the released "
                                  "configs: 0)")
    entropy: Literal["normalized4", "shannon"] = Field("normalized4", description="the code's ((H / log C)^2)^2 or "
                                                       "eq. 5.18's Shannon entropy")
    frozen_bn: Literal["running", "batch"] = Field("batch", description="BatchNorm of the frozen models (the SWA "
                                                   "teacher, theta^0): the statistics of the client's batch, as the "
                                                   "student's own (the authors' code), or their running statistics "
                                                   "(eval mode: the federation's average over every domain)")


class SelfTraining(Component):
    name = "self_training"

    def __init__(self, params: SelfTrainingParams):
        if params.start % params.every:
            raise ValueError(f"self_training: start = {params.start} must be a multiple of every = {params.every}")
        if params.pseudo == "own_ce_kl" and params.teacher != "swa":
            raise ValueError("self_training: pseudo = 'own_ce_kl' (eq. 5.19) needs teacher = 'swa' (with the "
                             "student as its own teacher the KL term is 0)")
        self.params = params
        self.teachers: dict[int, dict[str, torch.Tensor]] = {}
        self.stage_start = 0
        self.received: np.ndarray | None = None  # clients that hold theta^0

    # -- server -------------------------------------------------------------------------------------

    def _begin(self, sctx: ServerContext) -> None:
        if self.stage_start == 0:
            self.stage_start = sctx.round
            self.received = np.zeros(sctx.num_clients, dtype=bool)
            if self.params.teacher == "swa":  # every cluster's teacher starts as its model at the stage's start
                self.teachers = {int(s): _cluster_model(sctx, int(s))
                                 for s in np.unique(_groups(sctx.facts, sctx.num_clients))}
            if self.params.kd_lambda > 0 and not _entries(sctx.facts, THETA0):
                raise ValueError("self_training: kd_lambda > 0 needs theta^0; run source_pretrain in an earlier stage")

    def client_broadcast(self, sctx: ServerContext, client: int) -> dict[str, torch.Tensor] | None:
        self._begin(sctx)
        out: dict[str, torch.Tensor] = {}
        if self.params.teacher == "swa":
            s = int(_groups(sctx.facts, sctx.num_clients)[client])
            teacher = self.teachers[s]
            out.update({"teacher:" + k: v for k, v in teacher.items()})
        if self.params.kd_lambda > 0 and not self.received[client]:  # type: ignore[index]
            out.update({"theta0:" + k: v for k, v in _entries(sctx.facts, THETA0).items()})
            self.received[client] = True  # type: ignore[index]
        return out or None

    def server_step(self, sctx: ServerContext) -> None:
        """Eq. 5.22 for every cluster's teacher, t = rounds since the stage began."""
        if self.params.teacher != "swa" or not self.stage_start:
            return
        t = sctx.round - self.stage_start + 1
        for s in np.unique(_groups(sctx.facts, sctx.num_clients)):
            model = _cluster_model(sctx, int(s))
            new = swa_update(self.teachers[int(s)], model, t, self.params.every, self.params.start)
            if new is not None:
                self.teachers[int(s)] = new

    # -- client -------------------------------------------------------------------------------------

    def client_start(self, ctx: ClientContext) -> None:
        sent = ctx.broadcast.get(self.name, {})
        scratch: dict[str, Any] = {}
        teacher = {k[len("teacher:"):]: v for k, v in sent.items() if k.startswith("teacher:")}
        if teacher:
            scratch["teacher"] = _frozen_copy(ctx.model, teacher, self.params.frozen_bn == "batch")
        if self.params.kd_lambda > 0:
            theta0 = {k[len("theta0:"):]: v for k, v in sent.items() if k.startswith("theta0:")}
            if theta0 and ctx.state is not None:
                ctx.state.save(self.name, theta0)  # kept by the client (sent once)
            elif ctx.state is not None:
                theta0 = ctx.state.load(self.name) or {}
            if not theta0:
                raise RuntimeError(f"client {ctx.client_id} holds no theta^0 for distillation")
            scratch["theta0"] = _frozen_copy(ctx.model, theta0, self.params.frozen_bn == "batch")
        ctx.scratch[self.name] = scratch

    def loss_term(self, ctx: ClientContext, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        return self.term(outputs, targets, self.prepare(ctx.scratch[self.name], ctx.inputs, targets))

    def prepare(self, scratch: dict[str, Any], x: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """What the term needs of a batch ``x`` (label maps ``targets``, whose size the logits are upsampled to)
        from the frozen models: the SWA teacher's pseudo-labels (``"labels"``; none when they come from the student
        itself) or, with ``pseudo = "own_ce_kl"``, its upsampled logits (``"teacher"``), and theta^0's upsampled
        logits (``"ref"``, with ``kd_lambda`` > 0)."""
        p, size = self.params, targets.shape[-2:]
        out = {}
        with torch.no_grad():
            if "teacher" in scratch:
                source = upsample(main_output(scratch["teacher"](x)), size)
                if p.pseudo == "own_ce_kl":
                    out["teacher"] = source
                else:
                    out["labels"] = pseudo_labels(source, p.threshold, p.fraction)
            if p.kd_lambda > 0:
                out["ref"] = upsample(main_output(scratch["theta0"](x)), size)
        return out

    def term(self, outputs: Any, targets: torch.Tensor, prepared: dict[str, torch.Tensor]) -> torch.Tensor:
        """The self-training loss of the student's ``outputs`` on a batch with label maps ``targets`` (their size),
        given ``prepare``'s values: one formula for sequential and vectorised training.

        ``pseudo = "teacher_ce"`` (default): ``L_CE(f(x; theta_k), y_teacher)``, one cross-entropy to the SWA
        teacher's thresholded hard labels, as the authors' released code trains (``SelfTrainingLoss`` with the
        teacher set) and as every number in docs/ladd.md was measured. ``"own_ce_kl"``: eq. 5.19 as the thesis
        writes it, ``L_PSEUDO = L_CE(f(x; theta_k), y_own) + KL(f(x; theta_k) || f(x; theta_hat_s))``: the CE to
        the student's own thresholded hard labels (detached) plus the per-pixel mean KL from the student to the
        cluster teacher's soft prediction (no gradient to the teacher). With ``entropy = "shannon"``,
        ``entropy_lambda = 1`` and ``kd_form = "kl"`` the whole loss is eq. 5.21, ``L_E + L_PSEUDO + lambda
        L_KD``. The code's form is the default because the released configs train it and the thesis's tables
        come from them; the thesis's own list of symbols defines L_PSEUDO differently again (L_E + L_TS)."""
        p = self.params
        student = upsample(main_output(outputs), targets.shape[-2:])
        labels = prepared.get("labels")
        if labels is None:  # pseudo-labels from the student's own prediction
            labels = pseudo_labels(student.detach(), p.threshold, p.fraction)
        loss = pseudo_label_ce(student, labels, p.reduction)
        if "teacher" in prepared:  # eq. 5.19's L_TS
            loss = loss + kl_divergence(student, prepared["teacher"])
        if p.entropy_lambda > 0:
            loss = loss + p.entropy_lambda * (normalized_entropy4(student) if p.entropy == "normalized4"
                                              else entropy(student))
        if p.kd_lambda > 0:
            ref = prepared["ref"]
            kd = (soft_target_ce(student, ref, p.kd_alpha, labels != IGNORE) if p.kd_form == "soft_ce"
                  else kl_divergence(student, ref))
            loss = loss + p.kd_lambda * kd
        return loss

    def vector_blocker(self) -> str | None:
        p = self.params
        if (p.teacher == "model" or p.pseudo == "own_ce_kl") and 0.0 < p.fraction < 1.0:
            what = "teacher = 'model'" if p.teacher == "model" else "pseudo = 'own_ce_kl'"
            return (f"{what} with 0 < fraction < 1 draws its pseudo-labels from the student inside the step by a "
                    "per-class ranking that vmap cannot run")
        return None

    def vector_step(self, ctx: ClientContext) -> VectorStep:
        """The frozen models run per client before the step (``VectorStep.prepare``), the loss in it."""
        scratch = ctx.scratch[self.name]
        return VectorStep(loss_term=lambda own, params, outputs, targets: self.term(outputs, *targets),
                          prepare=lambda x, targets: self.prepare(scratch, x, targets))

    # -- state --------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"stage_start": torch.tensor(self.stage_start),
                "received": torch.from_numpy(self.received if self.received is not None else np.zeros(0, bool)),
                "teachers": {str(s): dict(t) for s, t in self.teachers.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stage_start = int(state.get("stage_start", 0))
        received = state.get("received")
        self.received = received.cpu().numpy().astype(bool) if received is not None and len(received) else None
        if self.stage_start and self.received is None:
            self.received = np.zeros(0, dtype=bool)
        self.teachers = {int(s): dict(t) for s, t in state.get("teachers", {}).items()}


@COMPONENTS.register(
    "self_training", params=SelfTrainingParams, requires={"styles", "class_logits"},
    help="LADD: pseudo-labels from the cluster's SWA teacher (eq. 5.22), distillation to the pre-trained model",
)
def _self_training(params: SelfTrainingParams) -> SelfTraining:
    return SelfTraining(params)


# ----------------------------------------------------------------------------------- cluster aggregation


class ClusterAggregationParams(Params):
    part: Literal["head", "norm", "backbone", "all"] = Field(
        "head", description="the cluster-specific entries: the head (LADD cls), the normalisation layers, the "
        "backbone, or all (LADD all)")
    restyle: bool = Field(False, description="FDA-restyle every test image to its cluster's centroid style before "
                          "inference (the thesis, Sec. 5.3.8) instead of leaving it as it is (the authors' code)")


class ClusterAggregation(Component):
    name = "cluster_aggregation"

    def __init__(self, params: ClusterAggregationParams):
        self.params = params

    def _keys(self, model: nn.Module) -> list[str]:
        state = model.state_dict()
        if self.params.part == "all":
            return list(state)
        return [k for k in model.parameter_groups()[self.params.part] if k in state]

    def _ensure(self, sctx: ServerContext) -> np.ndarray:
        if GROUPS not in sctx.facts:
            raise ValueError("cluster_aggregation needs the clients' style clusters; run client_styles in an "
                             "earlier stage")
        groups = _groups(sctx.facts, sctx.num_clients)
        state = sctx.model.state_dict()
        for s in np.unique(groups):
            prefix = cluster_prefix(int(s))
            if not _entries(sctx.facts, prefix):  # v_s^0 = v^0 (Alg. 10)
                for k in self._keys(sctx.model):
                    sctx.facts[prefix + k] = state[k].detach().clone()
        return groups

    def client_broadcast(self, sctx: ServerContext, client: int) -> dict[str, torch.Tensor]:
        groups = self._ensure(sctx)
        return _entries(sctx.facts, cluster_prefix(int(groups[client])))

    def client_start(self, ctx: ClientContext) -> None:
        mine = ctx.broadcast.get(self.name, {})
        state = ctx.model.state_dict(keep_vars=True)
        with torch.no_grad():
            for k, v in mine.items():
                state[k].copy_(v)
                if k in ctx.global_params:  # the upload is relative to the cluster's values
                    ctx.global_params[k] = state[k].detach().clone()

    def server_round_end(self, sctx: ServerContext, results: list[ClientResult], weights: torch.Tensor) -> None:
        """Eq. 5.17 within every cluster with an update (data-size weights); the global model's cluster-specific
        entries become the clusters' mean (weighted by their numbers of clients)."""
        groups = self._ensure(sctx)
        keys = self._keys(sctx.model)
        for s in np.unique(groups):
            members = [r for r in results if groups[r.client_id] == s]
            if not members:
                continue  # a cluster with no sampled client keeps its entries
            prefix = cluster_prefix(int(s))
            n = torch.tensor([float(r.num_examples) for r in members], dtype=torch.float64)
            w = n / n.sum()
            for k in keys:
                cur = sctx.facts[prefix + k]
                if k in members[0].delta:
                    step = sum(float(wi) * r.delta[k].to(torch.float64) for wi, r in zip(w, members))
                    sctx.facts[prefix + k] = (cur.to(torch.float64) + step).to(cur.dtype)
                elif k in members[0].buffers:
                    if cur.is_floating_point():
                        mean = sum(float(wi) * r.buffers[k].to(torch.float64) for wi, r in zip(w, members))
                        sctx.facts[prefix + k] = mean.to(cur.dtype)
                    else:
                        sctx.facts[prefix + k] = max(r.buffers[k] for r in members).clone()
        sizes = np.bincount(groups)
        state = sctx.model.state_dict(keep_vars=True)
        with torch.no_grad():
            for k in keys:
                if state[k].is_floating_point():
                    mean = sum(float(sizes[s]) * sctx.facts[cluster_prefix(int(s)) + k].to(torch.float64)
                               for s in np.unique(groups)) / float(sizes.sum())
                    state[k].copy_(mean.to(state[k].dtype))

    def evaluate(self, model: nn.Module, ctx: EvalContext, run: Any) -> Any:
        """A global test image with the model of the cluster nearest to its style (other splits: the global
        model, whose cluster-specific entries are the clusters' mean). With ``restyle`` the image is first
        FDA-restyled (lambda 1, the styles' ``half``) to its cluster's centroid style mu_s (eq. 5.23, the mean of
        its clients' styles), the thesis's evaluation steps 1-4 (Sec. 5.3.8; it leaves which style unnamed: the
        centroid is the cluster's only style the server holds); the authors' code does not restyle (default)."""
        if GROUPS not in ctx.facts or CENTROIDS not in ctx.facts or not ctx.is_global_test:
            return run(ctx)
        styles = ctx.task.image_styles(ctx.split, int(ctx.facts[HALF]))
        nearest = assign(styles.reshape(len(styles), -1).cpu().numpy(), ctx.facts[CENTROIDS].cpu().numpy())
        base = np.arange(len(nearest)) if ctx.subset is None else np.asarray(ctx.subset, dtype=np.int64)
        states = []
        for s in np.unique(nearest[base]):
            members = base[nearest[base] == s]
            entries = _entries(ctx.facts, cluster_prefix(int(s)))
            with swap_entries(model, to_device(entries, model_device(model))) if entries \
                    else contextlib.nullcontext(), self._restyled(ctx, int(s)):
                states.append(run(dataclasses.replace(ctx, subset=members)))
        return ctx.task.metrics.merge(states)


    def _restyled(self, ctx: EvalContext, s: int) -> contextlib.AbstractContextManager:
        if not self.params.restyle:
            return contextlib.nullcontext()
        if not hasattr(ctx.task, "restyled"):
            raise ValueError(f"cluster_aggregation: restyle = true needs a task that restyles evaluation images "
                             f"(segmentation), not {getattr(ctx.task, 'name', type(ctx.task).__name__)!r}")
        half = int(ctx.facts[HALF])
        w = 2 * half + 1
        return ctx.task.restyled(ctx.facts[CENTROIDS][s].reshape(3, w, w), half)


@COMPONENTS.register(
    "cluster_aggregation", params=ClusterAggregationParams, requires={"styles", "parameter_groups"},
    help="LADD: cluster-specific entries averaged within style clusters (eq. 5.17), test images to the nearest cluster",
)
def _cluster_aggregation(params: ClusterAggregationParams) -> ClusterAggregation:
    return ClusterAggregation(params)
