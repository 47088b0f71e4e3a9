"""Local vs non-local class-wise accuracy (``eval.class_split``, thesis Fig. 4.7)."""

from __future__ import annotations

import math

import pytest
import torch

from fedsight.class_split import LOCAL, NONLOCAL, chosen_clients, split_accuracy, summarize
from helpers import ToyTask, tiny, toy_sim


def test_split_accuracy_on_a_hand_built_case():
    correct = torch.tensor([3, 0, 1, 2, 5])
    count = torch.tensor([3, 2, 4, 0, 10])
    local = torch.tensor([True, False, True, False, False])
    # local: classes 0 and 2, 3/3 and 1/4 -> (1 + 0.25) / 2; non-local: classes 1 and 4 (3 has no test
    # example), 0/2 and 5/10 -> 0.25: class-wise means, not 5/12 pooled
    assert split_accuracy(correct, count, local) == pytest.approx((0.625, 0.25))
    lo, nl = split_accuracy(correct, count, torch.ones(5, dtype=torch.bool))  # a client holding every class
    assert lo == pytest.approx((1 + 0 + 0.25 + 0.5) / 4) and math.isnan(nl)  # class 3: no example
    row = summarize({3: (0.5, 0.1), 7: (0.9, math.nan)})
    assert row == {LOCAL: pytest.approx(0.7), NONLOCAL: pytest.approx(0.1), f"{LOCAL}/client3": 0.5,
                   f"{NONLOCAL}/client3": 0.1, f"{LOCAL}/client7": 0.9}


def test_chosen_clients_are_seeded_and_all_when_more_are_asked():
    assert chosen_clients(0, 10, 0) == () and chosen_clients(0, 5, 9) == (0, 1, 2, 3, 4)
    a = chosen_clients(3, 50, 4)
    assert a == chosen_clients(3, 50, 4) and len(set(a)) == 4 and a != chosen_clients(4, 50, 4)


def _by_hand(model, task, cid):
    with torch.no_grad():
        pred = model(task.test_x).argmax(1)
    own = set(task.client_labels(cid).tolist())
    accs = {c: float((pred[task.test_y == c] == c).float().mean()) for c in task.test_y.unique().tolist()}
    lo = [a for c, a in accs.items() if c in own]
    nl = [a for c, a in accs.items() if c not in own]
    return (sum(lo) / len(lo) if lo else math.nan), (sum(nl) / len(nl) if nl else math.nan)


def test_runtime_class_split_is_the_clients_model_on_the_test_set_under_its_hooks():
    from fedsight.recipe.oll import OLL

    task = ToyTask(sizes=(6, 6, 6), dim=3, classes=4, seed=3)
    task.test_x = torch.randn(60, 3, generator=torch.Generator().manual_seed(1))
    task.test_y = torch.arange(60) % 4
    task.ys = [torch.tensor([0, 1] * 3), torch.tensor([2, 3, 2, 3, 2, 2]), torch.tensor([0, 3] * 3)]
    sim = toy_sim(task=task, lr=0.5, steps=3)
    sim.run()
    gstate = sim.server.global_state()
    for cid in range(3):
        got = sim.runtime.class_split(cid, gstate)
        want = _by_hand(sim.global_model.eval(), task, cid)
        assert got == pytest.approx(want, nan_ok=True)
    masked = toy_sim(task=task, lr=0.5, steps=3, components=[OLL()])  # OLL: non-local is 0 by construction
    masked.run()
    for cid in range(3):
        lo, nl = masked.runtime.class_split(cid, masked.server.global_state())
        assert nl == 0.0 and lo > 0.0


def test_a_run_logs_the_split_and_draws_it(tmp_path):
    from fedsight.api import execute
    from fedsight.config import validate
    from fedsight.runs import RunDir

    raw = tiny(**{"partition": {"name": "classes", "classes_per_client": 2, "num_clients": 6, "local_test_fraction": 0.2},
                  "server.rounds": 2, "server.clients_per_round": 3, "eval.every": 1, "eval.class_split": 2})
    raw["stages"] = [{"name": "fedavg", "rounds": 1}, {"name": "fp", "rounds": 1, "recipe": {"sharing": "local"}}]
    run = tmp_path / "run"
    execute(validate(raw), run)
    rows = [r for r in RunDir(run).read_metrics() if "round" in r]
    clients = chosen_clients(0, 6, 2)
    for r in rows:
        per = [r[f"{LOCAL}/client{c}"] for c in clients]
        assert r[LOCAL] == pytest.approx(sum(per) / 2)
        assert all(f"{NONLOCAL}/client{c}" in r for c in clients)
    from fedsight.class_split import plot_class_split  # (what finish() draws when run.plots is on)

    assert plot_class_split(rows, run / "plots" / "class_split.png").stat().st_size > 0
    from fedsight.reporting import write_summary

    assert "](plots/class_split.png)" in write_summary(run, plot=False).read_text()
    assert plot_class_split([{"round": 1, "test/acc": 0.5}], tmp_path / "none.png") is None
    import json

    assert json.loads((run / "run.json").read_text())["metrics"][LOCAL] is True


def test_flower_refuses_class_split(tmp_path):
    from fedsight.config import ConfigError, validate
    from fedsight.flower.options import ServerOptions

    with pytest.raises(ConfigError, match="eval.class_split = 2: not on Flower"):
        ServerOptions(run_dir=tmp_path).checked_for(validate(tiny(**{"eval.class_split": 2})))
