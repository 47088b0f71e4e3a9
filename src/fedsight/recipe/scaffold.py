"""SCAFFOLD: stochastic controlled averaging (Karimireddy et al. 2020, ICML, Algorithm 1, option II).

One component filling two slots of the recipe:

* client side (update transform). Client i receives the server control variate ``c`` (a broadcast,
  ``ctx.broadcast["scaffold"]``) and keeps its own control variate ``c_i`` in its persistent state
  (``ctx.state`` key ``"scaffold"``; zeros for a client never sampled before). Every local step is
  Algorithm 1 line 10, ``y <- y - eta_l (g_i(y) - c_i + c)``, implemented as ``grad += c - c_i`` after
  ``backward()`` and before the local optimizer step. After the K local steps, option II of line 12:
  ``c_i+ = c_i - c + (x - y_i) / (K eta_l)`` with ``K = ctx.num_steps`` and ``eta_l = ctx.local.lr``;
  the client saves ``c_i+`` and uploads ``Delta c_i = c_i+ - c_i`` in ``result.extras["scaffold"]``
  (line 13; ``Delta y_i`` is the ordinary ``result.delta``).
* server side. The model update of line 16, ``x <- x + eta_g (1/|S|) sum_{i in S} Delta y_i``, is plain
  FedAvg aggregation followed by the server optimizer, so it is *not* re-implemented here: the paper's
  update is ``recipe.weighting = "uniform"`` (the paper's 1/|S| weights; SCAFFOLD being a component,
  any other weighting such as data size or FedVG's can be used instead) and
  ``server.optimizer = {name = "sgd", lr = eta_g}`` (momentum/adaptive server optimizers combine freely,
  e.g. SCAFFOLD + FedAvgM). The control update of line 17,
  ``c <- c + (|S|/N) (1/|S|) sum_{i in S} Delta c_i = c + (1/N) sum_{i in S} Delta c_i``, is done in
  ``server_round_end`` with the paper's unweighted mean regardless of the model weighting; N is the
  total number of clients (``sctx.num_clients``) and S the clients whose update was aggregated (an
  update rejected as non-finite does not enter ``c``).

Choices where the paper is silent:

* Local optimiser and learning-rate schedule. ``eta_l`` is the round's rate (``ctx.local.lr`` is already
  ``train.lr`` under ``train.lr_schedule`` "step" / "cosine" at this round), so a scheduled run divides
  by the rate its steps actually used. SCAFFOLD is a ``step_correction``: with ``train.optimizer =
  "adam"`` / ``"adamw"`` the loop applies Adam to the gradient first and then adds ``c - c_i`` (the order
  ``fedsight.recipe.local_adam`` documents), so ``c_i+`` is the client's mean corrected Adam direction
  (plus ``wd y`` under AdamW's decoupled decay, as under SGD's weight decay below). Components that shape
  the gradient (``dp_sgd``, ``feddyn``'s clipping) must then be listed before ``scaffold``.
* Option II is derived for plain local SGD. With local momentum or weight decay
  (``train.momentum`` / ``train.weight_decay``) the formula is applied as-is, i.e. ``(x - y_i)/(K eta_l)``
  is then the average *effective* step direction rather than the average corrected gradient.
* ``x - y_i`` is read from the trained local model (not from ``result.delta``), so a component that
  transforms the upload (noise, compression) does not leak into the control variates.
* ``c`` and ``c_i`` cover the shared trainable parameters only (``ctx.global_params``); personal
  parameters (FedPer-like sharing) are trained without correction. ``c`` starts as zeros and is stored
  lazily: before the first aggregation it is empty and clients read missing entries as zeros.
* A client that takes no local step (K = 0) keeps its ``c_i`` and uploads ``Delta c_i = 0``.
* The server accepts a reply only with ``Delta c_i`` of exactly the shared trainable entries, each with the
  global entry's shape and dtype, finite (``extras_spec``; ``fedsight.engine.contract``). Its values cannot be
  checked further: ``Delta c_i = -c - delta / (K eta_l)`` holds only up to rounding in the client's private
  ``c_i`` and only while no component transforms the delta.
"""

from __future__ import annotations

from typing import Any

import torch

from ..records import ClientResult
from ..registry import COMPONENTS, NoParams
from ..training import ClientContext, Component, ExtrasSpec, ServerContext, UploadContext, VectorStep

KEY = "scaffold"


class Scaffold(Component):
    """SCAFFOLD (Karimireddy et al. 2020, Algorithm 1, option II) as a multi-slot recipe component."""
    uploads_extras = True  # Delta c_i

    name = KEY
    step_correction = True  # train.optimizer's Adam transform runs before the correction

    def __init__(self) -> None:
        #: the server control variate c over the shared trainable parameters (empty = all zeros)
        self.c: dict[str, torch.Tensor] = {}

    # -- client side -----------------------------------------------------------------------------

    def client_start(self, ctx: ClientContext) -> None:
        sent = ctx.broadcast.get(self.name, {})
        loaded = ctx.state.load(self.name) if ctx.state is not None else None
        c_i, c, corr = {}, {}, {}
        for k, g in ctx.global_params.items():
            c[k] = sent[k].to(g) if k in sent else torch.zeros_like(g)
            c_i[k] = loaded[k].to(g) if loaded is not None and k in loaded else torch.zeros_like(g)
            corr[k] = c[k] - c_i[k]
        ctx.scratch[self.name] = {"c": c, "c_i": c_i, "corr": corr}

    @torch.no_grad()
    def after_backward(self, ctx: ClientContext) -> None:
        # Algorithm 1 line 10: y <- y - eta_l (g_i(y) - c_i + c)
        corr = ctx.scratch[self.name]["corr"]
        for k, p in ctx.model.named_parameters():
            if k not in corr or not p.requires_grad:
                continue
            if p.grad is None:  # parameter unused by this batch: its gradient is zero
                p.grad = corr[k].clone()
            else:
                p.grad.add_(corr[k])

    def vector_step(self, ctx: ClientContext) -> VectorStep:
        """Line 10 on the gradients of a vectorised step: ``g + (c - c_i)`` with this client's ``c - c_i``."""
        return VectorStep(tensors=ctx.scratch[self.name]["corr"],
                          grads=lambda corr, params, grads: {k: g + corr[k] if k in corr else g for k, g in grads.items()})

    @torch.no_grad()
    def client_end(self, ctx: ClientContext, result: ClientResult) -> None:
        s = ctx.scratch[self.name]
        c, c_i = s["c"], s["c_i"]
        params = dict(ctx.model.named_parameters())
        K, lr = ctx.num_steps, float(ctx.local.lr)
        if K > 0:
            # option II (line 12): c_i+ = c_i - c + (x - y_i) / (K eta_l)
            new = {k: c_i[k] - c[k] + (x - params[k].detach()) / (K * lr) for k, x in ctx.global_params.items()}
        else:
            new = {k: v.clone() for k, v in c_i.items()}
        if ctx.state is not None:
            ctx.state.save(self.name, new)
        result.extras[self.name] = {k: new[k] - c_i[k] for k in new}  # Delta c_i (line 13)

    # -- server side -----------------------------------------------------------------------------

    def extras_spec(self, ctx: UploadContext) -> ExtrasSpec | None:
        """Delta c_i: one tensor per shared trainable entry, with its shape and dtype, from every training client
        (its values are an update like the delta: the contract checks only that they are finite)."""
        return ExtrasSpec(ctx.shared_spec()) if ctx.trains else None

    def server_broadcast(self, sctx: ServerContext) -> dict[str, torch.Tensor] | None:
        return dict(self.c)

    @torch.no_grad()
    def server_round_end(self, sctx: ServerContext, results: list[ClientResult], weights: torch.Tensor) -> None:
        # line 17: c <- c + (|S|/N) * mean_{i in S} Delta c_i   (unweighted, as in the paper)
        ups = [r.extras[self.name] for r in results if self.name in r.extras]
        if not ups:
            return
        n = float(sctx.num_clients)
        for k in ups[0]:
            total = torch.stack([u[k].to(torch.float64) for u in ups]).sum(0)
            base = self.c.get(k)
            if base is None:
                base = torch.zeros_like(ups[0][k])
            self.c[k] = (base.to(torch.float64) + total / n).to(base.dtype)

    # -- state -----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"c": {k: v.detach().clone() for k, v in self.c.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.c = {k: v.detach().clone() for k, v in state.get("c", {}).items()}


@COMPONENTS.register(
    "scaffold",
    params=NoParams,
    help="SCAFFOLD control variates, option II (Karimireddy et al. 2020); use weighting 'uniform' for the paper",
)
def _scaffold(params: NoParams) -> Scaffold:
    return Scaffold()
