"""Cost accounting: bytes on the wire and estimated client FLOPs (thesis Sec. 3.9.2, Tables 3.2-3.4).

Conventions, the thesis's where it states one:

* **Bytes** are what a message actually carries: every tensor's ``numel * element_size`` (FP32 models:
  4 bytes a parameter, as the thesis's plots assume). A client *downloads* the shared trainable
  parameters, the shared buffers and any component broadcast (SCAFFOLD's c); frozen entries never change
  within a stage and are not re-sent, so FedAvg(phi) costs b down and FedAvg(psi) dC (Table 3.2). Fed3R
  and FedNCM clients use the pre-trained, public feature extractor and download nothing. A client
  *uploads* its delta, shared buffers and extras (Fed3R statistics, SCAFFOLD's control delta).
* **Bytes at 4 a number** (``up_bytes_fp32``, logged as ``cost/up_bytes_fp32`` beside ``cost/up_bytes``): the
  same upload with every number counted at 4 bytes whatever its dtype, the thesis's convention ("plots multiply
  by 4 bytes (FP32)", Sec. 3.9.2, Tables 3.2 and 3.7). Fed3R's statistics travel as float64 (the server's
  solve needs it), so ``cost/up_bytes`` counts them at 8 bytes and shrinks Fed3R's advantage against the
  thesis's figures by up to half; compare with the thesis on ``cost/total_up_bytes_fp32``. For an FP32 model's
  update the two are equal. Integer tensors (Fed3R's class ids) count at 4 too: every number sent.
* **FLOPs** are estimated from the model's forward cost, counted once per model with
  ``torch.utils.flop_counter.FlopCounterMode`` (matrix products and convolutions, 2 FLOPs per
  multiply-add; element-wise work is not counted). A backward pass costs twice the forward of the part it
  traverses (B = 2F, as in the thesis): a training step costs 3 F_f per example, or F_phi + 3 F_psi when
  only the classifier trains (no backward through the frozen extractor). Fed3R's statistics cost
  F_phi + p(p+1) per example (the upper triangle of phi phi^T, one multiply-add per entry) plus p for
  the class sum.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ModelCost:
    """Per-example forward FLOPs of the whole model and of its classifier head (0 without a head)."""

    forward: float
    head: float = 0.0

    @property
    def features(self) -> float:
        return self.forward - self.head

    def train_step(self, examples: int, backward: str) -> float:
        """FLOPs of one training step on ``examples``: forward through everything, backward through
        ``backward`` = "all" (any extractor parameter trains), "head" (only the classifier) or "none"."""
        back = {"all": 2 * self.forward, "head": 2 * self.head, "none": 0.0}[backward]
        return examples * (self.forward + back)


def count_flops(fn, *args) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter, torch.no_grad():
        fn(*args)
    return float(counter.get_total_flops())


def model_cost(model: nn.Module, example: torch.Tensor) -> ModelCost:
    """Measure ``model``'s per-example forward cost on one example (batch of 1). The head's share is
    measured for models whose forward is ``head(features(x))`` (``FedModel.split_head``); for others
    (a VSR model's global skip) the whole forward counts as one part."""
    was = model.training
    model.eval()
    try:
        total = count_flops(model, example)
        head = 0.0
        if getattr(model, "split_head", False) and hasattr(model, "head"):
            with torch.no_grad():
                z = model.features(example)
            head = count_flops(model.head, z)
    finally:
        model.train(was)
    return ModelCost(forward=total, head=head)


def nbytes(tensors: Mapping[str, torch.Tensor] | Iterable[torch.Tensor]) -> int:
    values = tensors.values() if isinstance(tensors, Mapping) else tensors
    return int(sum(t.numel() * t.element_size() for t in values))


def result_numbers(result) -> int:
    """How many numbers a ``ClientResult`` uploads: delta, shared buffers and every extra tensor."""
    tensors = [*result.delta.values(), *result.buffers.values(), *(t for v in result.extras.values() for t in v.values())]
    return int(sum(t.numel() for t in tensors))


def result_bytes(result) -> int:
    """Upload size of a ``ClientResult``: delta, shared buffers and every extra tensor."""
    return nbytes(result.delta) + nbytes(result.buffers) + sum(nbytes(v) for v in result.extras.values())
