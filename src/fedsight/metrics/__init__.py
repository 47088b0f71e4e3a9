"""Metric states that merge across batches and clients, and the declared direction of every metric."""

from .state import (REDUCTIONS, ConfusionMatrix, Mean, Metric, MetricSet, MetricSpec, MetricState, PerClassAccuracy,
                    direction)

__all__ = ["REDUCTIONS", "ConfusionMatrix", "Mean", "Metric", "MetricSet", "MetricSpec", "MetricState", "PerClassAccuracy",
           "direction"]
