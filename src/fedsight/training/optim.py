"""Adam as a gradient transform on the local SGD loop: the arithmetic behind ``train.optimizer`` and the
``local_adam`` component, written once.

The local loop (``fedsight.training.local.sgd_steps``) steps ``torch.optim.SGD`` (momentum 0). An Adam
step is that SGD step applied to Adam's direction instead of the gradient: after ``backward()`` each
gradient g_t of a parameter p is replaced, in place, by

    g_t <- g_t + wd_L2 p                          (``l2``: Adam's coupled L2 weight decay, else 0)
    m_t = beta1 m_{t-1} + (1 - beta1) g_t,   v_t = beta2 v_{t-1} + (1 - beta2) g_t^2
    g_t <- (m_t / (1 - beta1^t)) / (sqrt(v_t) / sqrt(1 - beta2^t) + eps)

(Kingma & Ba 2015, Algorithm 1, in ``torch.optim.Adam``'s arithmetic, t counted per parameter like
torch's per-parameter ``step``), so that ``p <- p - lr g_t`` is ``torch.optim.Adam(lr, betas, eps,
weight_decay=wd_L2)``. With the L2 term off and the SGD step's own ``weight_decay = wd`` the step is
``p <- p - lr (g_t + wd p)``: decoupled weight decay, i.e. ``torch.optim.AdamW(lr, betas, eps, wd)``
(the same update, rounded differently). Parameters without a gradient in a step are skipped, as torch does.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import torch


class AdamDirection:
    """Adam's moments for a set of parameters, keyed by any hashable (a parameter name or an index), and
    the in-place transform of their gradients into Adam's direction. The moments start at zero when the
    object is built: a fresh ``AdamDirection`` is a fresh optimiser."""

    def __init__(self, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, l2: float = 0.0):
        self.beta1, self.beta2 = float(betas[0]), float(betas[1])
        self.eps, self.l2 = float(eps), float(l2)
        #: key -> (steps taken, first moment, second moment)
        self.state: dict[Hashable, tuple[int, torch.Tensor, torch.Tensor]] = {}

    @torch.no_grad()
    def apply_(self, params: Iterable[tuple[Hashable, torch.Tensor]]) -> None:
        """Replace the gradient of every (key, parameter) that has one by Adam's direction, advancing that
        parameter's moments by one step."""
        b1, b2 = self.beta1, self.beta2
        for key, p in params:
            g = p.grad
            if g is None:
                continue
            if self.l2:
                g.add_(p, alpha=self.l2)
            t, m, v = self.state.get(key) or (0, torch.zeros_like(g), torch.zeros_like(g))
            t += 1
            self.state[key] = (t, m, v)
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            g.copy_((m / (1.0 - b1**t)) / (v.sqrt() / ((1.0 - b2**t) ** 0.5) + self.eps))
