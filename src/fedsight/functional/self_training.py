"""Self-training on unlabelled images (LADD, thesis Sec. 5.3.6-5.3.7): pseudo-labels, their losses, the
distillation terms and the SWA teacher.

Logits are ``[B, C, H, W]``; pixel quantities are averaged over ``B H W``.

* ``pseudo_labels`` (the authors' ``SelfTrainingLoss``; the thesis says "the thresholding of FDA [213]"): the
  argmax of the (teacher's) prediction, kept where its probability exceeds ``threshold`` OR where it is among
  the ``floor(fraction n_c)`` most confident pixels of its predicted class c in that image (n_c pixels
  predicted c); every other pixel is ``IGNORE``. Either rule is off when its value is outside (0, 1).
* ``pseudo_label_ce``: cross-entropy to the pseudo-labels, summed over kept pixels and divided by all ``B H W``
  pixels (``reduction="all"``, the authors' code: ignored pixels count as zeros) or by the kept ones
  (``"kept"``).
* ``entropy``: eq. 5.18, the mean Shannon entropy of the prediction; ``normalized_entropy4``: the code's
  variant, ``(H / log C)^4``-like (``((H / log C)^2 + 1e-8)^2``).
* ``soft_target_ce``: the authors' "KD" term, ``-mean_pixels(mean_classes(softmax(alpha t) * log_softmax(s)))``
  (a soft-target cross-entropy divided by C, with the teacher's logits scaled by ``alpha``), optionally masked;
  ``kl_divergence``: eq. 5.20 as written, ``KL(p_s || p_t)`` per pixel.
* ``swa_update``: eq. 5.22, the teacher's running mean.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F

IGNORE = 255

__all__ = ["entropy", "kl_divergence", "normalized_entropy4", "pseudo_label_ce", "pseudo_labels", "soft_target_ce",
           "swa_update"]


@torch.no_grad()
def pseudo_labels(logits: torch.Tensor, threshold: float = 0.9, fraction: float = 0.66) -> torch.Tensor:
    """``[B, H, W]`` int64 pseudo-labels of ``logits`` (module docstring); unkept pixels are ``IGNORE``."""
    prob = logits.softmax(1)
    conf, label = prob.max(1)
    keep = conf > threshold if 0.0 < threshold < 1.0 else torch.zeros_like(conf, dtype=torch.bool)
    if 0.0 < fraction < 1.0:
        b, c = logits.shape[:2]
        flat_conf, flat_label = conf.reshape(b, -1), label.reshape(b, -1)
        top = torch.zeros_like(flat_label, dtype=torch.bool)
        for i in range(b):
            counts = torch.bincount(flat_label[i], minlength=c)
            for cls in torch.nonzero(counts).flatten().tolist():
                k = math.floor(int(counts[cls]) * fraction)
                if k == 0:
                    continue
                idx = torch.nonzero(flat_label[i] == cls).flatten()
                best = flat_conf[i, idx].topk(k).indices  # ties: the order topk returns
                top[i, idx[best]] = True
        keep = keep | top.reshape(conf.shape)
    return torch.where(keep, label, torch.full_like(label, IGNORE))


def pseudo_label_ce(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "all") -> torch.Tensor:
    """Cross-entropy of ``logits`` to pseudo-``labels`` (``IGNORE`` left out), divided by all pixels
    (``"all"``) or by the kept ones (``"kept"``; 0 when none is kept)."""
    ce = F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="none")
    if reduction == "all":
        return ce.mean()
    if reduction == "kept":
        n = (labels != IGNORE).sum()
        return ce.sum() / n.clamp_min(1)
    raise ValueError(f"reduction must be 'all' or 'kept', got {reduction!r}")


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Eq. 5.18: the mean over pixels of the prediction's Shannon entropy (nats)."""
    logp = logits.log_softmax(1)
    return -(logp.exp() * logp).sum(1).mean()


def normalized_entropy4(logits: torch.Tensor) -> torch.Tensor:
    """The authors' entropy term: ``((H / log C)^2 + 1e-8)^2`` averaged over pixels (H in nats)."""
    logp = logits.log_softmax(1)
    h = -(logp.exp() * logp).sum(1) / math.log(logits.shape[1])
    return ((h**2 + 1e-8) ** 2).mean()


def soft_target_ce(student: torch.Tensor, teacher: torch.Tensor, alpha: float = 0.5,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
    """``-mean_pixels(mask * mean_classes(softmax(alpha teacher) * log_softmax(student)))`` (the authors'
    ``KnowledgeDistillationLoss``; masked-out pixels count as zeros in the mean). The teacher gets no
    gradient."""
    t = (alpha * teacher.detach()).softmax(1)
    per_pixel = (t * student.log_softmax(1)).mean(1)
    if mask is not None:
        per_pixel = per_pixel * mask.to(per_pixel.dtype)
    return -per_pixel.mean()


def kl_divergence(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Eq. 5.20 as written: the mean over pixels of ``KL(p_student || p_teacher)``; the teacher gets no
    gradient."""
    logs, logt = student.log_softmax(1), teacher.detach().log_softmax(1)
    return (logs.exp() * (logs - logt)).sum(1).mean()


@torch.no_grad()
def swa_update(teacher: Mapping[str, torch.Tensor], model: Mapping[str, torch.Tensor], round: int, every: int,
               start: int) -> dict[str, torch.Tensor] | None:
    """Eq. 5.22 at the end of round ``round``: None (the teacher stays) unless ``round % every == 0``; before
    ``start`` a copy of ``model``; from ``start`` on ``(teacher tau + model) / (tau + 1)`` with ``tau = (round -
    start) / every`` (so the teacher restarts from the model at ``start``, a multiple of ``every``, and is then
    the plain mean of the models at the update rounds since). Floating-point entries average, integer ones
    (BatchNorm's counters) follow the model."""
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    if start % every != 0:
        raise ValueError(f"start = {start} must be a multiple of every = {every} (eq. 5.22's tau counts updates)")
    if round % every != 0:
        return None
    if round < start:
        return {k: v.detach().clone() for k, v in model.items()}
    tau = (round - start) / every
    out = {}
    for k, v in model.items():
        if v.is_floating_point():
            out[k] = (teacher[k].to(v.dtype) * tau + v) / (tau + 1)
        else:
            out[k] = v.detach().clone()
    return out
