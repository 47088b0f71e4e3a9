"""Datasets (loaders registered in ``DATASETS``) and partitioners (registered in ``PARTITIONERS``)."""

from __future__ import annotations

from typing import Any

from fedsight.data import classification, federated_csv, partition  # noqa: F401  (registers loaders and partitioners)
from fedsight.data.base import ArrayDataset, DatasetSplits
from fedsight.data.partition import ClientSplit, make_client_splits
from fedsight.data.partition_stats import partition_counts, partition_summary
from fedsight.registry import DATASETS, Params, build

__all__ = [
    "ArrayDataset",
    "ClientSplit",
    "DatasetSplits",
    "load_dataset",
    "make_client_splits",
    "partition_counts",
    "partition_summary",
]


def load_dataset(name: str, params: dict[str, Any] | Params | None = None, seed: int = 0) -> DatasetSplits:
    """Load the registered dataset ``name`` with validated ``params``."""
    return build(DATASETS, name, params, seed=seed)
