"""FedDrive on the generated street benchmark through real configs: extra test sets, SiloBN's test-time
statistics by domain, style banks and their cost, the poly schedule, the class-imbalance and predefined splits."""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import numpy as np
import pytest
import torch

from fedsight.api import build_simulation, execute
from fedsight.config import set_path, validate
from fedsight.plugins import load_builtin

load_builtin()

BASE: dict[str, Any] = {
    "seed": 0, "run": {"name": "s", "checkpoint_keep": 0},
    "task": {"name": "segmentation", "crop": [24, 40], "scale": [0.8, 1.2]},
    "data": {"name": "street", "towns": ["suburb", "rural"], "conditions": ["clear-day", "rain-day"], "cameras": ["car"],
             "per_domain": 5, "height": 32, "width": 48},
    "partition": {"name": "classes", "classes_per_client": 1, "num_clients": 2, "local_test_fraction": 0.25},
    "model": {"name": "bisenetv2", "width": 0.25, "head_channels": 16, "aux_channels": 8},
    "train": {"epochs": 1, "batch_size": 2, "lr": 0.05, "momentum": 0.9},
    "server": {"rounds": 1, "clients_per_round": 2}, "eval": {"batch_size": 4},
    "engine": {"threads": 1},
}


def config(**over: Any) -> dict[str, Any]:
    raw = copy.deepcopy(BASE)
    for k, v in over.items():
        set_path(raw, k.split("."), v)
    return raw


def test_a_run_logs_seen_and_unseen_test_sets_with_directions_and_pictures(tmp_path) -> None:
    out = execute(validate(config(**{"server.rounds": 2})), tmp_path / "run")
    run = out.run_dir
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "test/miou" in r][-1]
    for key in ("test/miou", "test_unseen/miou", "test_unseen/pixel_acc", "local/wma", "local/pixel_acc"):
        assert math.isfinite(last[key]), key
    meta = json.loads((run / "run.json").read_text())
    directions = meta["metrics"]
    assert directions["test_*/miou"] is True and directions["test_*/loss"] is False
    part = json.loads((run / "partition.json").read_text())
    # one domain per client: the two seen (suburb) domains; the rural town is unseen ("country")
    assert part["class_names"][:2] == ["suburb/clear-day/car", "suburb/rain-day/car"]
    assert sorted(map(tuple, np.asarray(part["client_label_counts"])[:, :2].tolist())) == [(0, 3), (3, 0)]
    assert part["tests"]["unseen"]["domains"] == ["rural/clear-day/car", "rural/rain-day/car"]
    for name in ("visuals.png", "visuals_unseen.png", "class_distribution.png", "curves.png"):
        assert (run / "plots" / name).stat().st_size > 1000, name


def _evaluate_with(model: torch.nn.Module, task: Any, split: str, subset, entries: dict[str, torch.Tensor]):
    """The metric state of ``subset`` of ``split`` with ``entries`` loaded into a copy of ``model``."""
    work = copy.deepcopy(model)
    state = work.state_dict()
    state.update(entries)
    work.load_state_dict(state)
    return task.eval_state(work, split, 4, subset)


def test_silobn_by_domain_evaluates_each_domain_with_its_clients_statistics() -> None:
    """Heterogeneous split, one seen domain per client: every seen-test image is evaluated with the BN
    statistics of the client of its domain, the merged confusion matrix gives the metric (FedDrive's 'by
    domain'); unseen domains have no client and get fresh statistics on their own images."""
    from fedsight.recipe.norm_sharing import fresh_statistics
    from fedsight.state import PERSONAL

    cfg = validate(config(**{"recipe.sharing": {"name": "silobn", "test_stats": "domain"}}))
    sim = build_simulation(cfg)
    sim.run()
    task, model = sim.task, sim.global_model
    got = sim.evaluate()
    counts = task.client_domain_counts()
    for split in ("test", "test_unseen"):
        states = []
        domains = task._split(split).domains
        for d in np.unique(domains):
            members = np.flatnonzero(domains == d)
            owner = np.flatnonzero(counts[:, d])
            if len(owner):
                (client,) = owner  # one client per seen domain
                states.append(_evaluate_with(model, task, split, members, sim.store.get(PERSONAL, int(client))))
            else:
                work = copy.deepcopy(model)
                with fresh_statistics(work, (x for x, _ in task.eval_batches(split, 4, subset=members))):
                    states.append(task.eval_state(work, split, 4, members))
        want = task.metrics.compute(task.metrics.merge(states))
        assert got[f"{split}/miou"] == pytest.approx(want["miou"], abs=1e-9), split
        assert got[f"{split}/loss"] == pytest.approx(want["loss"], rel=1e-6), split
    # 'client' (the clients' average) is a different rule on the same trained model
    sim.stages[0].recipe.sharing.test_stats = "client"
    assert sim.evaluate()["test/miou"] != got["test/miou"]


def test_silobn_by_domain_needs_a_task_with_domains() -> None:
    from helpers import tiny

    from fedsight.errors import ConfigError

    raw = tiny(**{"model.norm": "batch", "recipe.sharing": {"name": "silobn", "test_stats": "domain"}})
    with pytest.raises(ConfigError, match="'silobn' needs .*domain.* which task 'classification' does not provide"):
        validate(raw)


@pytest.mark.parametrize("style,entry_bytes", [("lab", 2 * 3 * 4), ("cfsi", 3 * 5 * 9 * 4)])
def test_the_style_bank_is_charged_once_before_round_one(style: str, entry_bytes: int) -> None:
    """What the bank clients upload (one entry per training image: LAB (mean, std) of 3 channels; CFSI a
    3-channel amplitude window, 2 floor(beta N / 2) + 1 frequencies a side: 5 x 9 for a 24 x 40 crop at beta 0.2)
    and every client downloads, on top of round 1's model traffic; later rounds cost the same as without."""
    def costs(**over):
        rows = []
        sim = build_simulation(validate(config(**{"server.rounds": 2, "eval.initial": False, **over})))
        sim.run(on_round=lambda r, row, events: rows.append(row))
        return sim.task, rows

    base_task, base = costs()
    task, styled = costs(**{"task.style": style, "task.style_beta": 0.2, "task.style_clients": 0.5})
    members = task.data_description()["style_bank"]["clients"]
    assert len(members) == 1  # ceil(0.5 x 2 clients)
    images = sum(task.num_train_examples(k) for k in members)
    bank = images * entry_bytes
    assert styled[0]["cost/up_bytes"] - base[0]["cost/up_bytes"] == bank
    assert styled[0]["cost/down_bytes"] - base[0]["cost/down_bytes"] == bank * task.num_clients
    assert styled[1]["cost/up_bytes"] == base[1]["cost/up_bytes"]


def test_poly_schedule_decays_the_rate_within_every_round(monkeypatch) -> None:
    from fedsight.training.local import LocalTraining

    local = LocalTraining(batch_size=2, lr=0.1, lr_schedule="poly", lr_power=0.9, lr_horizon=2.0)
    assert [local.lr_factor(s, 4) for s in range(4)] == pytest.approx([(1 - s / 8) ** 0.9 for s in range(4)])
    assert LocalTraining(batch_size=2, lr=0.1).lr_factor(3, 4) == 1.0
    seen: list[float] = []
    original = torch.optim.SGD.step

    def step(self, *a, **k):
        seen.append(self.param_groups[0]["lr"])
        return original(self, *a, **k)

    monkeypatch.setattr(torch.optim.SGD, "step", step)
    sim = build_simulation(validate(config(**{"train": {"lr_schedule": "poly", "steps": 3, "batch_size": 2, "lr": 0.05},
                                                   "server.rounds": 2})))
    sim.run()
    want = [0.05 * (1 - s / 3) ** 0.9 for s in range(3)]
    clients = [lr for lr in seen if lr != 1.0]  # FedAvg's server step is SGD with lr 1
    assert clients == pytest.approx(want * 4)  # 2 clients x 2 rounds, restarted every round


def test_temperature_divides_every_output_of_a_model_with_auxiliary_heads() -> None:
    from fedsight.training.context import ClientContext
    from fedsight.training.local import LocalTraining, local_objective

    sim = build_simulation(validate(config(**{"train.temperature": 0.5})))
    task, model = sim.task, sim.global_model
    model.train()
    x, y = task.train_batch(0, torch.tensor([0, 1]))
    torch.manual_seed(0)
    outs = model(x)
    assert isinstance(outs, tuple) and len(outs) == 5
    ctx = ClientContext(client_id=0, round=1, model=model, global_params={}, num_examples=2, seed=0,
                        local=LocalTraining(batch_size=2, lr=0.1, temperature=0.5), task=task)
    torch.manual_seed(0)
    got = local_objective(ctx, [], x, y)
    assert got.item() == pytest.approx(task.loss(tuple(o / 0.5 for o in outs), y).item(), rel=1e-6)


def test_class_imbalance_split_of_street_scenes() -> None:
    """Thesis Alg. 8 through the task builder: equal client sizes, every training image once, and the first
    client holds every image of the rarest class."""
    raw = config(**{"partition": {"name": "class_imbalance", "num_clients": 3, "local_test_fraction": 0.0},
                    "data.towns": ["suburb", "oldtown"], "data.setting": "none"})
    task = build_simulation(validate(raw)).task
    sizes = [task.num_train_examples(k) for k in range(3)]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == len(task.pool)
    owned = np.concatenate([c.train for c in task.clients])
    assert sorted(owned.tolist()) == list(range(len(task.pool)))
    presence = np.stack([np.bincount(task.pool.labels.get_one(i).numpy().ravel(), minlength=256)[:13] > 0
                         for i in range(len(task.pool))])
    counts = presence.sum(0)
    rare = int(np.argmin(np.where(counts > 0, counts, 10**9)))
    if counts[rare] <= sizes[0]:
        assert set(np.flatnonzero(presence[:, rare]).tolist()) <= set(task.clients[0].train.tolist())


def test_predefined_split_needs_a_dataset_that_has_one() -> None:
    raw = config(**{"partition": {"name": "predefined", "num_clients": 2, "local_test_fraction": 0.0}})
    with pytest.raises(ValueError, match="dataset 'street' has no client split of its own"):
        build_simulation(validate(raw))


def test_evaluate_a_finished_run_again_with_other_test_statistics(tmp_path) -> None:
    """``fedsight evaluate``: the last checkpoint re-evaluated gives the run's own last metrics; with
    SiloBN's statistics switched to "domain" it gives what a run trained with "domain" logs (training does
    not depend on the test-time rule); settings that would change training are refused."""
    from fedsight.crosseval import evaluate_run
    from fedsight.errors import ConfigError

    def last(run_dir):
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [r for r in rows if "test/miou" in r][-1]

    fresh = execute(validate(config(**{"recipe.sharing": {"name": "silobn", "test_stats": "fresh"}})),
                    tmp_path / "fresh").run_dir
    by_domain = execute(validate(config(**{"recipe.sharing": {"name": "silobn", "test_stats": "domain"}})),
                        tmp_path / "domain").run_dir
    r, again = evaluate_run(fresh)
    assert r == 1 and {k: again[k] for k in last(fresh) if k in again} == {k: v for k, v in last(fresh).items() if k in again}
    _, switched = evaluate_run(fresh, ["recipe.sharing.test_stats=domain"])
    want = last(by_domain)
    for key in ("test/miou", "test/loss", "test_unseen/miou", "local/wma"):
        assert switched[key] == want[key], key
    lines = [json.loads(line) for line in (fresh / "evaluations.jsonl").read_text().splitlines()]
    assert [x["set"] for x in lines] == [{}, {"recipe.sharing.test_stats": "domain"}] and lines[1]["round"] == 1
    with pytest.raises(ConfigError, match="--set model.width: changes what was trained"):
        evaluate_run(fresh, ["model.width=1.0"])
    with pytest.raises(FileNotFoundError, match="not a run directory"):
        evaluate_run(tmp_path)
