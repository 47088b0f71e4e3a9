"""Client weightings: how much each upload counts in the aggregate."""

from __future__ import annotations

import torch

from ..records import ClientResult
from ..registry import WEIGHTINGS, NoParams
from ..training import ServerContext


class ClientWeighting:
    """Returns one non-negative weight per result; the aggregator normalises them."""

    name = "weighting"

    def weights(self, results: list[ClientResult], sctx: ServerContext) -> torch.Tensor:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class DataSizeWeighting(ClientWeighting):
    """w_k proportional to the client's number of training examples (FedAvg, McMahan et al. 2017)."""

    name = "data_size"

    def weights(self, results: list[ClientResult], sctx: ServerContext) -> torch.Tensor:
        return torch.tensor([float(r.num_examples) for r in results], dtype=torch.float64)


class UniformWeighting(ClientWeighting):
    """Every sampled client counts the same."""

    name = "uniform"

    def weights(self, results: list[ClientResult], sctx: ServerContext) -> torch.Tensor:
        return torch.ones(len(results), dtype=torch.float64)


@WEIGHTINGS.register("data_size", help="weights proportional to local training examples (FedAvg)")
def _data_size(params: NoParams) -> ClientWeighting:
    return DataSizeWeighting()


@WEIGHTINGS.register("uniform", help="equal weights for every sampled client")
def _uniform(params: NoParams) -> ClientWeighting:
    return UniformWeighting()
