"""The typed record a client sends back to the server.

It maps one-to-one onto Flower's message records: ``delta`` and ``buffers`` and each entry of
``extras`` onto an ``ArrayRecord``, ``metrics`` (plus ``num_examples``) onto a ``MetricRecord``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ClientResult:
    client_id: int
    num_examples: int
    #: shared trainable parameters: local minus received global (name -> tensor)
    delta: dict[str, torch.Tensor]
    #: shared buffers after local training (e.g. BatchNorm running statistics), aggregated directly
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    #: scalars; ``train/loss`` is the mean local objective over the client's steps
    metrics: dict[str, float] = field(default_factory=dict)
    #: named extra tensors (control variates, sufficient statistics, ...), keyed by component
    extras: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    num_steps: int = 0
    #: estimated FLOPs the client spent (``fedsight.cost``): accounting, not model data (a Flower
    #: reply carries it in its metadata record)
    flops: float = 0.0

    @property
    def train_loss(self) -> float:
        return float(self.metrics["train/loss"])
