"""OLL with no fine-tuning (``eval.oll``, thesis Table 4.18's x column) and OLL's automatic learning rate
(``{name = "oll", lr = "auto"}``, Sec. 4.3.1)."""

from __future__ import annotations

import copy

import pytest
import torch

from fedsight.api import build_simulation, build_stages, build_task
from fedsight.config import ConfigError, validate
from helpers import tiny


def _fed3r_config(**over):
    raw = tiny(**{"partition": {"name": "classes", "classes_per_client": 2, "num_clients": 6,
                                "local_test_fraction": 0.3},
                  "server.rounds": 1, "server.clients_per_round": 6, "eval.every": 1, **over})
    raw["stages"] = [{"name": "fed3r", "rounds": 1, "recipe": {"components": ["fed3r"]}}]
    return raw


@torch.no_grad()
def test_eval_oll_equals_masking_the_logits_by_hand():
    sim = build_simulation(validate(_fed3r_config(**{"eval.oll": True})))
    sim.run()
    got = sim.evaluate()
    task, model = sim.task, sim.global_model.eval()
    correct = total = 0
    plain_correct = 0
    for cid in range(task.num_clients):
        keep = torch.zeros(task.num_classes, dtype=torch.bool)
        keep[torch.as_tensor(task.client_labels(cid), dtype=torch.long)] = True
        for x, y in task.eval_batches(cid):
            logits = model(x)
            masked = logits.masked_fill(~keep, float("-inf"))  # the d x C_k classifier of Alg. 7, by hand
            correct += int((masked.argmax(1) == y).sum())
            plain_correct += int((logits.argmax(1) == y).sum())
            total += len(y)
    assert total > 0
    assert got["local/wma"] == pytest.approx(correct / total, abs=1e-9)  # WMA (eq. 4.4): correct over all examples
    assert plain_correct < correct  # the mask changed something on this 2-class split
    # the global test set is not any client's: unmasked
    test_correct = sum(int((model(x).argmax(1) == y).sum()) for x, y in task.eval_batches("test"))
    test_n = sum(len(y) for _, y in task.eval_batches("test"))
    assert got["test/acc"] == pytest.approx(test_correct / test_n, abs=1e-9)


def test_eval_oll_needs_a_classifier():
    from test_conformance import VIDEO

    raw = copy.deepcopy(VIDEO)
    raw["eval"] = {**raw.get("eval", {}), "oll": True}
    with pytest.raises(ConfigError, match=r"eval.oll = true needs a class label .*task .video_sr."):
        validate(raw)


def _stages(lr_mode, first=("fed3r",), lr=0.1):
    raw = tiny(**{"server.rounds": 3, "train.lr": lr})
    raw["stages"] = [{"name": "init", "rounds": 1, "recipe": {"components": list(first)}},
                     {"name": "oll", "rounds": 1, "recipe": {"sharing": "local",
                                                             "components": [{"name": "oll", "lr": lr_mode}]}},
                     {"name": "after", "rounds": 1}]
    cfg = validate(raw)
    return build_stages(cfg, build_task(cfg))


def test_oll_auto_lr_is_the_thesis_rule():
    # Sec. 4.3.1: x 0.1 for OLL, x 0.1 again after a Fed3R initialisation: 0.1 -> 0.001
    st = _stages("auto")
    assert st[1].local.lr == pytest.approx(0.001)
    assert st[0].local.lr == st[2].local.lr == 0.1  # only the OLL stage
    assert _stages("auto", first=("fedncm",))[1].local.lr == pytest.approx(0.001)
    assert _stages("auto", first=())[1].local.lr == pytest.approx(0.01)  # no closed-form init: x 0.1 once
    assert _stages("stage")[1].local.lr == 0.1  # the default: train.lr as set
