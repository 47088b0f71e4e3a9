"""Aggregators: how weighted client deltas become one update."""

from __future__ import annotations

import torch

from ..functional.aggregate import weighted_mean_state
from ..records import ClientResult
from ..registry import AGGREGATORS, NoParams


class TooFewUpdates(ValueError):
    """An aggregator cannot combine this round's number of updates (Krum's K > 2f + 2): the server skips the
    round's aggregation with a ``round_skipped`` event instead of failing the run."""


class Aggregator:
    """Turns the round's client results and their (unnormalised) weights into one delta."""

    name = "aggregator"
    #: set by ``aggregate`` when it combined the round in a weaker way than configured (Krum with fewer updates
    #: than its ``byzantine`` needs, ``too_few = "degrade"``); the server records it as an event
    degraded: str | None = None

    def aggregate(self, results: list[ClientResult], weights: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def aggregate_buffers(self, results: list[ClientResult], weights: torch.Tensor) -> dict[str, torch.Tensor]:
        """The new values of the shared buffers (BatchNorm statistics) from the clients' ``buffers``, called after
        ``aggregate`` on the same results: their weighted mean here; a robust aggregator applies its own rule, so
        the statistics cannot bypass it."""
        return weighted_mean_state([r.buffers for r in results], weights)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class MeanAggregator(Aggregator):
    """The weighted mean of client deltas, sum_k w_k Delta_k / sum_k w_k."""

    name = "mean"

    def aggregate(self, results: list[ClientResult], weights: torch.Tensor) -> dict[str, torch.Tensor]:
        return weighted_mean_state([r.delta for r in results], weights)


@AGGREGATORS.register("mean", help="weighted mean of client deltas")
def _mean(params: NoParams) -> MeanAggregator:
    return MeanAggregator()
