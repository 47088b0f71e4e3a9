"""The vectorised step with clipped per-example gradients (``VectorStep.clip_examples``: DP-SGD trained together).

The clients of a round are one ``torch.func.vmap`` over the clients of a ``vmap`` over each client's (padded) batch of
``torch.func.grad`` of one example's objective (torch.func's per-sample-gradient pattern). The objective of example
j is the local objective of the batch made of j alone, and its gradient is taken separately with respect to

* the trainable parameters as the model's forward uses them: example j's gradient g_j, what Opacus's
  ``GradSampleModule`` hooks compute (its per-sample gradients of a batch-mean loss, ``loss_reduction = "mean"``,
  are each example's gradient alone); it includes every term that reaches the parameters through the outputs
  (a distillation term on the logits);
* the same parameters as components' terms use them directly (FedProx's proximal term, the watermark regulariser):
  the data-independent part, which Opacus's hooks do not see and sequential DP-SGD takes as
  ``p.grad - mean_j g_j`` (no noise needed).

Each g_j is clipped to C over all the trainable parameters together, with Opacus's factor
``min(1, C / (||g_j|| + 1e-6))`` (the norm in float64, as ``dp_sgd`` computes it), and the clipped sum runs over
the batch's real examples only (the padding of a shorter batch, or of an empty Poisson batch, has weight 0). The
step's gradient before the hooks' ``grads`` is the mean over the real examples of both parts, the full objective's
gradient (zero for an empty batch, as sequential training leaves it); the clipping component's ``grads`` gets the
clipped sum, the forward part's mean, the number of real examples and its ``step_draw`` tensors (its noise) in its
``own`` values, and the rest of the update (other components' ``grads``, Adam, SGD) is ``vectorized``'s.

A term a component reduces over the examples by a sum (``VectorStep.example_terms`` with ``"sum"``) counts n_real
times in example j's objective: Opacus's per-sample gradient of a batch objective with the mean reduction is n
times example j's share of it, n times j's own term for a sum. The objective is computed per example, so the loss
the step reports is the mean over the real examples of the examples' objectives: the batch's objective.

Why not the fused forward (``fedsight.training.fused``): it computes one gradient per client by ordinary autograd,
with no per-example gradients; the per-example vmap runs every layer vmap can batch (every layer of a model the
vectorised engine trains, BatchNorm excepted: DP-SGD refuses it, as it mixes the examples of a batch).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_map

from .vector_batches import NormState


def private_step(model: nn.Module, objective, update, norms: NormState, rest_dims: dict[str, Any], name: str,
                 clip: float, direct: bool = True):
    """The clients' step, ``vectorized._vmapped_step``'s signature and results, with per-example clipping for the
    component ``name`` (norm ``clip``). ``objective``: the unmasked local objective (``_step_functions``), applied
    to each example alone; ``noise``: (the dropout noise tensors of the batch, the component's ``step_draw``
    tensors), both stacked over the clients. ``direct``: whether a component's term uses the parameters directly
    (a ``VectorStep.loss_term``); without one that gradient is zero and is not computed."""

    def example_loss(fwd, direct, rest, own, x, y, noise, sums):
        norms.updates.clear()
        norms.noise, norms.noise_at = [n.unsqueeze(0) for n in noise], 0
        one = lambda t: t.unsqueeze(0)  # noqa: E731  (the example as a batch of one)
        out = functional_call(model, {**fwd, **rest}, (tree_map(one, x),))
        norms.noise = ()
        loss = objective(direct, own, out, tree_map(one, y), None, sums=sums)
        return loss, loss.detach()

    per_example = vmap(grad(example_loss, argnums=(0, 1) if direct else 0, has_aux=True),
                       in_dims=(None, None, None, None, 0, 0, 0, None), randomness="error")

    def step(params, rest, opt, own, x, y, mask, noise, lr, bias):
        dropout, drawn = noise
        count = mask.sum()
        g, losses = per_example(params, params, rest, own, x, y, dropout, count)
        g_fwd, g_direct = g if direct else (g, None)
        weights = mask / count.clamp(min=1)
        # (each example's norm over all the parameters; ``vector_norm`` in float64 without a float64 copy)
        sq = sum(torch.linalg.vector_norm(g.flatten(1), dim=1, dtype=torch.float64).square() for g in g_fwd.values())
        factor = (clip / (sq.sqrt() + 1e-6)).clamp(max=1.0) * mask.to(torch.float64)
        both = torch.stack([factor, weights.to(torch.float64)])  # (the clipped sum and the mean: one product)
        sums = {k: torch.einsum("ji,i...->j...", both.to(g.dtype), g) for k, g in g_fwd.items()}
        clipped = {k: v[0] for k, v in sums.items()}
        mean_fwd = {k: v[1] for k, v in sums.items()}
        grads = dict(mean_fwd) if g_direct is None else {
            k: mean_fwd[k] + torch.einsum("i,i...->...", weights.to(g.dtype), g_direct[k]) for k, g in g_fwd.items()}
        mine = {**own[name], "clipped_sum": clipped, "example_mean": mean_fwd, "examples": count, "drawn": drawn}
        new_params, new_opt = update(params, grads, opt, {**own, name: mine}, lr, bias)
        return new_params, {}, new_opt, (losses * weights).sum()

    return vmap(step, in_dims=(0, rest_dims, 0, 0, 0, 0, 0, 0, 0, None), randomness="error")
