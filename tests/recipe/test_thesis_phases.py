"""Fine-tuning scopes (train.freeze), the tempered softmax, OLL, cost accounting, WMA, and a full
Fed3R -> FT -> PP -> FP -> OLL pipeline from one config."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedsight import registry as R
from fedsight.api import build_simulation, execute
from fedsight.config import validate
from fedsight.models.base import FedModel
from fedsight.recipe.oll import OLL
from fedsight.runs import RunDir
from helpers import ToyTask, pipeline_config, tiny, toy_sim


class Deep(FedModel):
    """A two-layer model whose extractor costs FLOPs (the toy model's identity extractor costs none)."""

    def __init__(self, dim, classes, hidden=5):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(dim, hidden), nn.BatchNorm1d(hidden), nn.ReLU())
        self.head = nn.Linear(hidden, classes)
        self.feature_dim = hidden


class DeepToy(ToyTask):
    def build_model(self):
        return Deep(self.dim, self.classes)


def state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("freeze, trains", [(("backbone",), "head"), (("head",), "backbone")])
def test_freeze_trains_only_the_other_group_and_uploads_only_it(freeze, trains):
    task = DeepToy(sizes=(6, 5), dim=3, classes=3)
    sim = toy_sim(task=task, freeze=freeze, steps=2)
    before = state(sim.global_model)
    plan = sim.begin_round(1)
    res, _ = sim.run_client(plan, 0)
    groups = sim.global_model.parameter_groups()
    assert set(res.delta) == {k for k in groups[trains] if k in dict(sim.global_model.named_parameters())}
    after = state(sim.work_model)
    frozen_group = groups[freeze[0]]
    assert all(torch.equal(before[k], after[k]) for k in frozen_group)  # incl. BN running stats
    assert any(not torch.equal(before[k], after[k]) for k in groups[trains])
    # the frozen BN statistics are not a shared buffer either (nothing to upload)
    assert all(k not in res.buffers for k in frozen_group)


def test_flops_follow_the_backward_scope_and_bytes_the_shared_trainable_entries():
    task = DeepToy(sizes=(6, 4), dim=3, classes=4)
    f_phi, f_psi = 2 * 3 * 5, 2 * 5 * 4  # per example, 2 FLOPs per multiply-add
    n = 10
    for freeze, per_example, down in [
        ((), 3 * (f_phi + f_psi), None),
        (("backbone",), f_phi + 3 * f_psi, 4 * (5 * 4 + 4)),  # head only: dC + C floats
        (("head",), 3 * (f_phi + f_psi), None),
    ]:
        sim = toy_sim(task=task, freeze=freeze, steps=1)
        assert (sim.cost.forward, sim.cost.head) == (f_phi + f_psi, f_psi)
        row, _ = sim.train_round(1)
        assert row["cost/flops"] == n * per_example
        shared = [k for k, _ in sim.global_model.named_parameters() if k in sim.shared_params]
        shared += sim.shared_buffers
        sd = sim.global_model.state_dict()
        expect_down = sum(sd[k].numel() * sd[k].element_size() for k in shared)
        if down is not None:
            assert expect_down == down
        assert row["cost/down_bytes"] == 2 * expect_down  # two clients
        assert row["cost/up_bytes"] == 2 * expect_down  # FedAvg uploads what it downloads (Table 3.2)


def test_temperature_divides_the_logits_in_the_loss():
    task = ToyTask(sizes=(7,), dim=3, classes=3, seed=4)
    tau, lr = 0.1, 0.05
    sim = toy_sim(task=task, temperature=tau, lr=lr)
    ref = copy.deepcopy(sim.global_model)
    loss = F.cross_entropy(ref(task.xs[0]) / tau, task.ys[0])
    grads = torch.autograd.grad(loss, list(ref.parameters()))
    res, _ = sim.run_client(sim.begin_round(1), 0)
    assert res.metrics["train/loss"] == pytest.approx(float(loss.detach()), rel=1e-6)
    for (k, p), g in zip(ref.named_parameters(), grads):
        torch.testing.assert_close(res.delta[k], -lr * g, rtol=1e-5, atol=1e-7)


def test_oll_equals_training_a_pruned_classifier_with_local_labels():
    task = ToyTask(sizes=(9,), dim=3, classes=5, seed=2)
    task.ys[0] = torch.tensor([0, 2, 2, 0, 4, 2, 0, 4, 4])  # local classes {0, 2, 4}
    local = torch.tensor([0, 2, 4])
    sim = toy_sim(task=task, components=[OLL()], sharing=R.build(R.SHARING, "local"), steps=3, lr=0.3,
                  momentum=0.9, weight_decay=0.01)
    init = state(sim.global_model)
    sim.run()
    got = sim.store.get("personal", 0)
    # reference: a d x C_k classifier (Alg. 7) on relabelled targets, trained by plain torch SGD
    pruned = nn.Linear(3, 3)
    with torch.no_grad():
        pruned.weight.copy_(init["head.weight"][local])
        pruned.bias.copy_(init["head.bias"][local])
    remap = {0: 0, 2: 1, 4: 2}
    y = torch.tensor([remap[int(c)] for c in task.ys[0]])
    opt = torch.optim.SGD(pruned.parameters(), lr=0.3, momentum=0.9, weight_decay=0.01)
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(pruned(task.xs[0]), y).backward()
        opt.step()
    torch.testing.assert_close(got["head.weight"][local], pruned.weight.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["head.bias"][local], pruned.bias.detach(), rtol=1e-5, atol=1e-6)
    # the columns of absent classes are not part of the client's model: untouched by decay/momentum
    assert torch.equal(got["head.weight"][[1, 3]], init["head.weight"][[1, 3]])
    # at evaluation the client can only predict its local classes
    model = sim.load_client_model(0)
    with sim.eval_context(model, 0):
        pred = model(torch.randn(50, 3)).argmax(1)
    assert set(pred.tolist()) <= {0, 2, 4}
    with sim.eval_context(model, 0):
        pass
    assert set(model(torch.randn(200, 3) * 5).argmax(1).tolist()) - {0, 2, 4}  # the hook was removed


def test_oll_with_every_class_present_equals_the_unfiltered_model():
    task = ToyTask(sizes=(12,), dim=3, classes=3, seed=6)
    task.ys[0] = torch.arange(12) % 3
    kw = dict(task=task, sharing=R.build(R.SHARING, "local"), steps=2, lr=0.2, weight_decay=0.01)
    a = toy_sim(components=[OLL()], **kw)
    b = toy_sim(**kw)
    a.run()
    b.run()
    pa, pb = a.store.get("personal", 0), b.store.get("personal", 0)
    assert all(torch.equal(pa[k], pb[k]) for k in pb)


def test_wma_equals_a_hand_computation_over_personal_models():
    raw = tiny(**{"server.rounds": 2, "eval.every": 1})
    raw["stages"] = [{"name": "fedavg", "rounds": 1}, {"name": "fp", "rounds": 1, "recipe": {"sharing": "local"}}]
    sim = build_simulation(validate(raw))
    rows = []
    sim.run(on_round=lambda r, row, ev: rows.append(row))
    correct = total = 0
    accs, sizes = [], []
    for c in range(sim.task.num_clients):
        model = sim.load_client_model(c).eval()
        x, y = next(sim.task.eval_batches(c, 10_000))
        with torch.no_grad():
            hits = int((model(x).argmax(1) == y).sum())
        correct, total = correct + hits, total + len(y)
        accs.append(hits / len(y))
        sizes.append(len(y))
    assert rows[-1]["local/wma"] == pytest.approx(correct / total, abs=1e-12)
    # eq. 4.4: sum_k n_k^test / n^test acc_k, and the worst-10% mean (one client of six)
    assert rows[-1]["local/wma"] == pytest.approx(sum(a * n for a, n in zip(accs, sizes)) / sum(sizes))
    assert rows[-1]["local/worst10"] == pytest.approx(min(accs))


def test_full_pipeline_runs_resumes_bit_identically_and_accounts_costs(tmp_path):
    cfg = validate(pipeline_config())
    execute(cfg, tmp_path / "full")
    execute(cfg, tmp_path / "cut", stop_after=1)  # inside the Fed3R stage
    execute(cfg, tmp_path / "cut", resume=True, stop_after=4)
    execute(cfg, tmp_path / "cut", resume=True)
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]  # noqa: E731
    full, cut = strip(RunDir(tmp_path / "full").read_metrics()), strip(RunDir(tmp_path / "cut").read_metrics())
    assert full == cut
    assert [r["stage"] for r in full] == ["fed3r", "fed3r", "ft", "fedsim", "fp", "oll"]
    assert full[1]["fed3r/clients_reported"] == 6
    # costs: Fed3R downloads nothing; FP/OLL communicate nothing; totals are cumulative
    assert full[0]["cost/down_bytes"] == 0 and full[4]["cost/up_bytes"] == full[4]["cost/down_bytes"] == 0
    assert full[-1]["cost/total_flops"] == pytest.approx(sum(r["cost/flops"] for r in full))
    # FedSim(psi): the personal head is not communicated (Table 4.2: b down per client)
    sim = build_simulation(cfg)
    size = {k: v.numel() * v.element_size() for k, v in sim.global_model.state_dict().items()}
    body = sum(v for k, v in size.items() if not k.startswith("head."))
    assert full[3]["cost/down_bytes"] == 3 * body


@pytest.mark.parametrize("part, other", [("head", "backbone"), ("backbone", "head")])
def test_personal_sharing_keeps_one_group_on_the_client(part, other):
    task = DeepToy(sizes=(6, 5), dim=3, classes=3)
    sim = toy_sim(task=task, sharing=R.build(R.SHARING, "personal", {"part": part}), steps=2)
    groups = sim.global_model.parameter_groups()
    before = state(sim.global_model)
    sim.run()
    params = dict(sim.global_model.named_parameters())
    assert set(sim.shared_params) == {k for k in groups[other] if k in params}
    assert set(sim.personal_keys) == set(groups[part])
    after = state(sim.global_model)
    assert all(torch.equal(before[k], after[k]) for k in groups[part])  # never aggregated
    p0, p1 = sim.store.get("personal", 0), sim.store.get("personal", 1)
    assert set(p0) == set(groups[part]) and any(not torch.equal(p0[k], p1[k]) for k in p0 if p0[k].is_floating_point())
