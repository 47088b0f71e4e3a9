"""Personalised-FL local procedures of the thesis's Phases 3 and 4 (Sec. 4.1, 4.3.1): FedAlt, pFedMe and
Ditto, each a component that claims the client's ``Trainer`` slot.

The thesis gives no update equations for these methods (Sec. 4.1.2 only names them), so each follows its
paper, with the choices the papers leave open written down in the class docstrings:

* ``fedalt``  -- Pillutla et al. 2022, "Federated Learning with Partial Model Personalization" (ICML),
  Algorithm 1, alternating variant (FedAlt). Use with ``recipe.sharing = {name = "personal", part = ...}``;
  with plain SGD that sharing is FedSim.
* ``pfedme``  -- Dinh et al. 2020, "Personalized Federated Learning with Moreau Envelopes" (NeurIPS),
  Algorithm 1.
* ``ditto``   -- Li et al. 2021, "Ditto: Fair and Robust Federated Learning Through Personalization"
  (ICML), Algorithm 1. In a federated stage it keeps a personal model per client next to the global
  one; in a stage that shares nothing (``recipe.sharing = "local"``, the thesis's "FP + Ditto") it is
  local fine-tuning with a proximal pull towards the global model.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import torch
from pydantic import Field
from torch import nn

from ..training.local import (
    Trainer, backward_scope, batch_positions, local_objective, loss_accumulator, make_result, sgd_steps,
)
from ..models.base import swap_entries
from ..records import ClientResult
from ..registry import COMPONENTS, Params
from ..rng import torch_gen
from ..training import ClientContext, Component, EvalContext


def _epoch_steps(epochs: int, num_examples: int, batch_size: int) -> int:
    """Steps of ``epochs`` passes over ``num_examples`` in batches of ``batch_size`` (the last one of a
    pass may be smaller), as ``LocalTraining.num_steps`` counts epochs."""
    return epochs * math.ceil(num_examples / batch_size)


@contextlib.contextmanager
def _grad_only(params: Sequence[nn.Parameter], fixed: Sequence[nn.Parameter]):
    """Within the block, ``fixed`` parameters do not require gradients (held constant, and backward
    does not traverse what only they need); restored on exit."""
    saved = [p.requires_grad for p in fixed]
    try:
        for p in fixed:
            p.requires_grad_(False)
        for p in params:
            p.requires_grad_(True)
        yield
    finally:
        for p, r in zip(fixed, saved):
            p.requires_grad_(r)


def _prox(pairs: Sequence[tuple[nn.Parameter, torch.Tensor]], coef: float):
    """``extra_loss`` of (coef / 2) sum ||p - target||^2 over ``pairs`` (targets detached)."""

    def term(model: nn.Module) -> torch.Tensor:
        return 0.5 * coef * sum((p - t).pow(2).sum() for p, t in pairs)

    return term


# ---------------------------------------------------------------------------------------------------
# FedAlt
# ---------------------------------------------------------------------------------------------------


class FedAltParams(Params):
    personal_epochs: int = Field(
        1, ge=1,
        description="epochs of the personal pass (v with u fixed) before the shared pass; its steps are "
        "personal_epochs * ceil(n_k / batch_size)",
    )


class FedAltTrainer(Trainer):
    """FedAlt's local procedure (Pillutla et al. 2022, Algorithm 1 with the alternating update).

    The model is split into shared u (the keys of ``ctx.global_params``) and personal v (the client's
    trainable personal entries, ``ctx.personal_keys``), and each client k minimises its part of
    F(u, V) = (1/n) sum_k F_k(u, v_k) (the paper's objective, eq. (1)) by alternating blocks:

    1. v_k <- ``personal_epochs`` epochs of local SGD on F_k(u^t, .) with u fixed at the received u^t
       (stream "shuffle-personal");
    2. u_k <- ``ctx.num_steps`` local SGD steps on F_k(., v_k) with the new v_k fixed (the default stream
       "shuffle", so the shared pass draws the same batches as FedSim/FedAvg would).

    The upload is u_k - u^t (``make_result``); the engine keeps v_k as the client's personal state and
    evaluates the client with it. ``train/loss`` is the mean objective of the shared pass (the quantity
    comparable with FedSim's and FedAvg's ``train/loss``); the personal pass's mean is reported as
    ``train/personal_loss``. The fixed block does not require gradients during the other block's pass,
    so the backward pass (and the FLOPs estimate, which ``sgd_steps`` adds per pass) covers only what
    the trained block needs. Both passes use the local optimiser settings (lr, momentum, weight decay)
    with fresh optimiser state, and every component's hooks. Buffers (BatchNorm statistics) update in
    both passes, as the forward runs in train mode.
    """

    name = "fedalt"

    def __init__(self, personal_epochs: int = 1):
        self.personal_epochs = int(personal_epochs)

    def train(self, ctx: ClientContext, components: Sequence[Component]) -> ClientResult:
        named = dict(ctx.model.named_parameters())
        personal_keys = set(ctx.personal_keys)
        personal = [p for k, p in named.items() if k in personal_keys and p.requires_grad]
        shared = [named[k] for k in ctx.global_params]
        if not personal:
            raise ValueError(
                "fedalt: this stage has no trainable personal parameters; set recipe.sharing = "
                "{name = \"personal\", part = \"head\" | \"backbone\"} (and do not freeze that part)"
            )
        if not shared:
            raise ValueError(
                "fedalt: this stage shares no trainable parameters (recipe.sharing shares nothing, or the "
                "shared part is frozen); FedAlt needs recipe.sharing = {name = \"personal\", part = ...}"
            )
        personal_steps = _epoch_steps(self.personal_epochs, ctx.num_examples, ctx.local.batch_size)
        with _grad_only(personal, shared):
            personal_sum = sgd_steps(ctx, components, personal, personal_steps, stream="shuffle-personal")
        with _grad_only(shared, personal):
            shared_sum = sgd_steps(ctx, components, shared, ctx.num_steps)
        result = make_result(ctx, components, float(shared_sum), ctx.num_steps)
        result.metrics["train/personal_loss"] = float(personal_sum) / max(personal_steps, 1)
        return result


class FedAlt(Component):
    """FedAlt (alternating partial personalisation): see ``FedAltTrainer``."""

    name = "fedalt"

    def __init__(self, personal_epochs: int = 1):
        if personal_epochs < 1:
            raise ValueError(f"fedalt: personal_epochs must be >= 1, got {personal_epochs}")
        self._trainer = FedAltTrainer(personal_epochs)

    def trainer(self) -> Trainer:
        return self._trainer


@COMPONENTS.register(
    "fedalt", params=FedAltParams,
    help="FedAlt: personal pass (v, u fixed) then shared pass (u, v fixed) (Pillutla et al. 2022); use with sharing 'personal'",
)
def _fedalt(params: FedAltParams) -> FedAlt:
    return FedAlt(params.personal_epochs)


# ---------------------------------------------------------------------------------------------------
# pFedMe
# ---------------------------------------------------------------------------------------------------


class PFedMeParams(Params):
    lam: float = Field(
        15.0, gt=0,
        description="lambda: the Moreau-envelope regularisation (lambda/2)||theta - w||^2 of the inner problem",
    )
    inner_steps: int = Field(5, ge=1, description="K: inner solver steps per local step (the thesis's costs imply 2)")
    personal_lr: float = Field(0.01, gt=0, description="learning rate of the inner solver (the paper's personal learning rate)")


class PFedMeTrainer(Trainer):
    """pFedMe's client update (Dinh et al. 2020, Algorithm 1).

    pFedMe solves min_w (1/N) sum_i F_i(w) with the Moreau envelopes
    F_i(w) = min_theta { f_i(theta) + (lambda/2) ||theta - w||^2 } (the bi-level problem, eqs. (2)-(3)
    of the paper); the personalised model is theta_hat_i(w) = prox_{f_i/lambda}(w) and
    grad F_i(w) = lambda (w - theta_hat_i(w)). Each of the ``ctx.num_steps`` local steps r:

    1. draw a batch D (stream "shuffle", as ``sgd_steps`` draws them);
    2. approximately solve theta_tilde = argmin_theta f(theta; D) + (lambda/2) ||theta - w_r||^2 over the
       shared trainable parameters with K = ``inner_steps`` gradient steps of lr ``personal_lr``, starting
       from theta = w_r (the paper leaves the start open; the official code keeps theta from the previous
       local step instead);
    3. w_{r+1} = w_r - eta lambda (w_r - theta_tilde), eta = ``train.lr``.

    The upload is w_R - w^t. The server's w^{t+1} = (1 - beta) w^t + beta (1/S) sum_i w_{i,R} is
    ``server.optimizer = {name = "sgd", lr = beta}`` (w^t + beta * mean delta) with
    ``recipe.weighting = "uniform"`` for the paper's 1/S (any other weighting works too); no server code
    here.

    Partial personalisation (thesis Phase 3, pFedMe(phi) / pFedMe(psi)): personal parameters v are part
    of the personalised model theta = (theta_u, v); the same K inner steps update them, without a
    proximal term (there is no global value to pull them to), and they carry over from one local step
    to the next. After training the model holds w for the shared parameters and the client's
    theta_tilde for v, which the engine keeps as the client's personal state.

    Choices where the paper is silent:

    * the inner objective is the task loss of the tempered outputs (``train.temperature``) after every
      component's ``outputs`` hook, plus every component's ``loss_term``, plus the proximal term;
      ``after_backward`` hooks run after each inner backward;
    * ``train.weight_decay`` is applied in the inner steps (as an L2 term of f, like the official code's
      L2 coefficient); ``train.momentum`` must be 0 (Algorithm 1 takes plain steps);
    * ``train/loss`` is the mean over local steps of the objective at the start of each inner solve,
      i.e. f(w_r; D) (the proximal term is zero there);
    * FLOPs: K forward-backward passes per local step (``ctx.cost.train_step`` per inner step), so
      K = 2 gives the thesis's 6E F_f of Table 4.3. Buffers (BatchNorm statistics) update at every
      inner forward.
    """

    name = "pfedme"

    def __init__(self, lam: float = 15.0, inner_steps: int = 5, personal_lr: float = 0.01):
        self.lam, self.inner_steps, self.personal_lr = float(lam), int(inner_steps), float(personal_lr)

    def train(self, ctx: ClientContext, components: Sequence[Component]) -> ClientResult:
        model, local = ctx.model, ctx.local
        named = dict(model.named_parameters())
        personal_keys = set(ctx.personal_keys)
        shared = [named[k] for k in ctx.global_params]
        personal = [p for k, p in named.items() if k in personal_keys and p.requires_grad]
        if not shared:
            raise ValueError(
                "pfedme: this stage shares no trainable parameters; pFedMe needs a shared model "
                "(recipe.sharing = \"global\" or {name = \"personal\", part = ...})"
            )
        if local.momentum != 0.0:
            raise ValueError(f"pfedme: train.momentum must be 0 (Algorithm 1 takes plain steps), got {local.momentum}")
        if getattr(local, "optimizer", "sgd") != "sgd":
            raise ValueError(_pfedme_optimizer(local.optimizer))
        params = shared + personal
        scope = backward_scope(ctx, params)
        lam = self.lam
        inner = torch.optim.SGD(params, lr=self.personal_lr, weight_decay=local.weight_decay)
        with torch.no_grad():
            w = [p.detach().clone() for p in shared]
        loss_sum = loss_accumulator(model)
        gen = torch_gen(ctx.seed, "shuffle", ctx.round, ctx.client_id)
        for step, pos in enumerate(batch_positions(ctx.num_examples, local.batch_size, ctx.num_steps, gen)):
            ctx.step = step
            x, y = ctx.batch(pos)
            with torch.no_grad():
                for p, wi in zip(shared, w):  # theta <- w_r
                    p.copy_(wi)
            for i in range(self.inner_steps):
                loss = local_objective(ctx, components, x, y)
                if i == 0:
                    loss_sum.add_(loss.detach())
                objective = loss + 0.5 * lam * sum((p - wi).pow(2).sum() for p, wi in zip(shared, w))
                inner.zero_grad(set_to_none=True)
                objective.backward()
                for c in components:
                    c.after_backward(ctx)
                inner.step()
                if ctx.cost is not None:
                    ctx.flops += ctx.cost.train_step(len(pos), scope)
            with torch.no_grad():  # w_{r+1} = w_r - eta lambda (w_r - theta_tilde)
                for wi, p in zip(w, shared):
                    wi.sub_(local.lr * lam * (wi - p))
        with torch.no_grad():
            for p, wi in zip(shared, w):
                p.copy_(wi)
        return make_result(ctx, components, float(loss_sum), ctx.num_steps)


class PFedMe(Component):
    """pFedMe (Moreau-envelope personalisation): see ``PFedMeTrainer``."""

    name = "pfedme"

    def __init__(self, lam: float = 15.0, inner_steps: int = 5, personal_lr: float = 0.01):
        if lam <= 0 or inner_steps < 1 or personal_lr <= 0:
            raise ValueError(f"pfedme: need lam > 0, inner_steps >= 1, personal_lr > 0; got {lam}, {inner_steps}, {personal_lr}")
        self._trainer = PFedMeTrainer(lam, inner_steps, personal_lr)

    def trainer(self) -> Trainer:
        return self._trainer


def _pfedme_optimizer(name: str) -> str:
    return (f"pfedme runs its own solver (SGD inner steps, then w <- w - lr lambda (w - theta)); "
            f"train.optimizer = {name!r} would not apply: set train.optimizer = 'sgd'")


def _pfedme_check(spec: PFedMeParams, cfg) -> str | None:
    opt = getattr(getattr(cfg, "train", None), "optimizer", "sgd")
    return _pfedme_optimizer(opt) if opt != "sgd" else None


@COMPONENTS.register(
    "pfedme", params=PFedMeParams, check=_pfedme_check,
    help="pFedMe: K-step Moreau-envelope inner solve per local step (Dinh et al. 2020); server beta = sgd lr",
)
def _pfedme(params: PFedMeParams) -> PFedMe:
    return PFedMe(params.lam, params.inner_steps, params.personal_lr)


# ---------------------------------------------------------------------------------------------------
# Ditto
# ---------------------------------------------------------------------------------------------------

DITTO = "ditto"  # client-state key of the personal model v_k in a federated stage


class DittoParams(Params):
    mu: float = Field(
        0.1, ge=0,
        description="lambda of the paper: the proximal coefficient of (mu/2)||v_k - w||^2 towards the global model",
    )
    personal_epochs: int = Field(
        1, ge=1,
        description="federated stage: epochs of the personal-model update per round "
        "(personal_epochs * ceil(n_k / batch_size) steps); a stage that shares nothing uses train.epochs",
    )


class DittoTrainer(Trainer):
    """Ditto's client update (Li et al. 2021, Algorithm 1): each client solves
    min_{v_k} h_k(v_k; w*) = F_k(v_k) + (lambda/2) ||v_k - w*||^2, w* the global model (the paper's
    objective, eq. (2)); lambda is ``mu`` here.

    In a stage that shares parameters (``ctx.global_params`` non-empty), per round:

    (i)  the global-model update: the ordinary local SGD of every trainable parameter from the received
         w^t (``ctx.num_steps`` steps, stream "shuffle"); its delta is the upload, bit-identical to plain
         FedAvg's;
    (ii) the personal update: v_k (client state "ditto"; the received global model the first time) takes
         ``personal_epochs`` epochs of SGD on F_k(v) + (mu/2) ||v - w^t||^2 (stream "shuffle-ditto"),
         with w^t the received global model (``ctx.global_state``), and is saved back (every float state
         entry, so v_k keeps its own BatchNorm statistics). The work model is then restored to the state
         after (i), so the upload and any personal entries the engine keeps are those of (i).

    Evaluation (``Ditto.eval_context``) swaps v_k into the model for a client's local test set; a client
    that never trained a personal model is evaluated on the global model. The global test set is
    evaluated on the global model.

    In a stage that shares nothing (``recipe.sharing = "local"``, the thesis's Phase 4 "FP + Ditto"), the
    client's model already is its personal model (the engine keeps it as personal state) and w* is the
    model the federated stages produced (``ctx.global_state``, constant in such a stage): one pass of
    ``ctx.num_steps`` steps (``train.epochs``) on F_k(v) + (mu/2) ||v - w*||^2, stream "shuffle"; with
    mu = 0 exactly plain local fine-tuning.

    In both cases the proximal term covers the trainable parameters (not frozen ones, not buffers); the
    steps use the local optimiser settings and every component's hooks. ``train/loss`` is the mean
    objective of (i) (federated stage; v_k's is ``train/personal_loss``) or of the single pass (local
    stage). The federated stage's FLOPs include the personal pass. A non-finite v_k is not saved (the
    client keeps its previous one).
    """

    name = "ditto"

    def __init__(self, mu: float = 0.1, personal_epochs: int = 1):
        self.mu, self.personal_epochs = float(mu), int(personal_epochs)

    def _prox_pairs(self, ctx: ClientContext) -> list[tuple[nn.Parameter, torch.Tensor]]:
        return [(p, ctx.global_state[k].detach()) for k, p in ctx.model.named_parameters() if p.requires_grad]

    def train(self, ctx: ClientContext, components: Sequence[Component]) -> ClientResult:
        model = ctx.model
        params = [p for p in model.parameters() if p.requires_grad]
        if not ctx.global_params:  # nothing shared: local fine-tuning with the proximal pull
            if not ctx.global_state:
                raise ValueError("ditto: no global model to regularise towards (ctx.global_state is empty)")
            extra = _prox(self._prox_pairs(ctx), self.mu) if self.mu != 0.0 else None
            loss_sum = sgd_steps(ctx, components, params, ctx.num_steps, extra_loss=extra)
            return make_result(ctx, components, float(loss_sum), ctx.num_steps)

        if ctx.state is None:
            raise ValueError("ditto: a federated Ditto stage needs the per-client state store (ctx.state)")
        # (i) the global-model update: exactly the default trainer
        loss_sum = sgd_steps(ctx, components, params, ctx.num_steps)
        result = make_result(ctx, components, float(loss_sum), ctx.num_steps)
        state = model.state_dict()
        after_i = {k: v.detach().clone() for k, v in state.items()}
        # (ii) the personal model
        v_k = ctx.state.load(DITTO)
        if v_k is None:
            v_k = {k: v.detach() for k, v in ctx.global_state.items() if v.is_floating_point()}
        with torch.no_grad():
            for k, v in v_k.items():
                state[k].copy_(v)
        steps = _epoch_steps(self.personal_epochs, ctx.num_examples, ctx.local.batch_size)
        extra = _prox(self._prox_pairs(ctx), self.mu) if self.mu != 0.0 else None
        personal_sum = sgd_steps(ctx, components, params, steps, stream="shuffle-ditto", extra_loss=extra)
        new_v = {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}
        if all(bool(torch.isfinite(v).all()) for v in new_v.values()):
            ctx.state.save(DITTO, new_v)
        with torch.no_grad():
            for k, v in after_i.items():
                state[k].copy_(v)
        result.metrics["train/personal_loss"] = float(personal_sum) / max(steps, 1)
        result.flops = ctx.flops
        return result


class Ditto(Component):
    """Ditto (personal models with a proximal pull to the global one): see ``DittoTrainer``."""

    name = "ditto"

    def __init__(self, mu: float = 0.1, personal_epochs: int = 1):
        if mu < 0 or personal_epochs < 1:
            raise ValueError(f"ditto: need mu >= 0 and personal_epochs >= 1; got {mu}, {personal_epochs}")
        self._trainer = DittoTrainer(mu, personal_epochs)

    def trainer(self) -> Trainer:
        return self._trainer

    def eval_context(self, model: nn.Module, ctx: EvalContext) -> contextlib.AbstractContextManager:
        """A client's local test set is evaluated with its personal model v_k (client state "ditto") in a
        stage that shares parameters; in a stage that shares nothing the engine already evaluates the
        client's own model, and the global test set uses the global model."""
        if isinstance(ctx.split, str) or not ctx.shared_params or ctx.store is None:
            return contextlib.nullcontext()
        v_k = ctx.store.get(DITTO, int(ctx.split))
        if v_k is None:
            return contextlib.nullcontext()
        return swap_entries(model, v_k)


@COMPONENTS.register(
    "ditto", params=DittoParams,
    help="Ditto: per-client personal model with a proximal pull (mu/2)||v - w||^2 to the global one (Li et al. 2021)",
)
def _ditto(params: DittoParams) -> Ditto:
    return Ditto(params.mu, params.personal_epochs)
