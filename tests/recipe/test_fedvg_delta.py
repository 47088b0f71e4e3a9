"""FedVG's delta-norm variant (E.10, the ablation of Fig. 8; issue 47): client weights from the norms of each
client's update, p_k = s_k / sum_j s_j with s_k = 1 / ((1/L) sum_l ||Delta_k^l|| + eps), checked against that
closed form written out here; no validation pass, no task needed."""

from __future__ import annotations

import math

import pytest
import torch

from fedsight import registry as R
from fedsight.api import build_simulation
from fedsight.config import validate
from fedsight.records import ClientResult
from fedsight.training import ServerContext

from helpers import ToyLinear, tiny

EPS = 1e-8


def results_with(deltas: list[dict[str, torch.Tensor]]) -> list[ClientResult]:
    return [ClientResult(client_id=i, num_examples=4 + i, delta=d, buffers={}) for i, d in enumerate(deltas)]


def closed_form(per_client_layer_norms: list[list[float]]) -> list[float]:
    s = [1.0 / (sum(ns) / len(ns) + EPS) for ns in per_client_layer_norms]
    return [v / sum(s) for v in s]


def test_model_weights_match_the_closed_form_with_no_task() -> None:
    model = ToyLinear(2, 2)
    # head.weight [2, 2] and head.bias [2]: L1 norms written out by hand
    deltas = [
        {"head.weight": torch.tensor([[1.0, -1.0], [0.0, 2.0]]), "head.bias": torch.tensor([0.5, -0.5])},  # 4, 1
        {"head.weight": torch.tensor([[0.1, 0.1], [0.1, -0.1]]), "head.bias": torch.tensor([0.0, 0.2])},   # .4, .2
        {"head.weight": torch.tensor([[3.0, 0.0], [0.0, 0.0]]), "head.bias": torch.tensor([1.0, 1.0])},    # 3, 2
    ]
    sctx = ServerContext(round=1, model=model, num_clients=3, sampled=[0, 1, 2], task=None)
    w = R.build(R.WEIGHTINGS, "fedvg", {"score": "delta"}).weights(results_with(deltas), sctx)
    expected = closed_form([[4.0, 1.0], [0.4, 0.2], [3.0, 2.0]])
    assert torch.allclose(w, torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=0)  # float32 deltas
    assert int(w.argmax()) == 1  # the client that moved least weighs most
    assert sctx.metrics["fedvg/server_passes"] == 0 and "fedvg/val_loss_mean" not in sctx.metrics
    # L2 norms: ||[[1,-1],[0,2]]|| = sqrt(6), ||[.5,-.5]|| = sqrt(.5), ...
    w2 = R.build(R.WEIGHTINGS, "fedvg", {"score": "delta", "norm": "l2"}).weights(results_with(deltas), sctx)
    expected2 = closed_form([[math.sqrt(6), math.sqrt(0.5)], [math.sqrt(0.04), 0.2], [3.0, math.sqrt(2)]])
    assert torch.allclose(w2, torch.tensor(expected2, dtype=torch.float64), rtol=1e-6, atol=0)  # float32 deltas


def test_layer_granularity_weights_each_tensor_by_its_own_update_norm() -> None:
    model = ToyLinear(2, 2)
    deltas = [{"head.weight": torch.full((2, 2), 1.0), "head.bias": torch.tensor([0.0, 0.1])},
              {"head.weight": torch.full((2, 2), 0.5), "head.bias": torch.tensor([1.0, 1.0])}]
    sctx = ServerContext(round=1, model=model, num_clients=2, sampled=[0, 1], task=None)
    w = R.build(R.WEIGHTINGS, "fedvg", {"score": "delta", "granularity": "layer"}).weights(results_with(deltas), sctx)
    assert torch.allclose(w["head.weight"], torch.tensor(closed_form([[4.0], [2.0]]), dtype=torch.float64))
    assert torch.allclose(w["head.bias"], torch.tensor(closed_form([[0.1], [2.0]]), dtype=torch.float64))


def test_a_run_with_the_delta_score_trains_and_skips_the_validation_pass() -> None:
    cfg = validate(tiny(**{"recipe.weighting": {"name": "fedvg", "score": "delta"}, "validation.source": "carve",
                           "server.rounds": 1, "eval.local": False}))
    rows = []
    build_simulation(cfg).run(on_round=lambda r, row, ev: rows.append(row))
    assert rows[-1]["fedvg/server_examples"] == 0 and 0 < rows[-1]["fedvg/weight_max"] < 1
    assert math.isfinite(rows[-1]["test/acc"])


def test_unknown_score_is_refused_naming_the_field() -> None:
    with pytest.raises(Exception, match="score"):
        validate(tiny(**{"recipe.weighting": {"name": "fedvg", "score": "drift"}, "validation.source": "carve"}))
