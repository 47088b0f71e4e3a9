"""Fed3R / Fed3R-Sync / Fed3R-RF / FedNCM inside the engine, against scikit-learn on pooled features."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from sklearn.linear_model import Ridge
from sklearn.neighbors import NearestCentroid

from fedsight.recipe.fed3r import Fed3R, Fed3RParams, FedNCM, FedNCMParams, RFFHead
from helpers import ToyTask, toy_sim


def pooled(task: ToyTask):
    x = torch.cat(task.xs).double().numpy()
    y = torch.cat(task.ys).numpy()
    return x, y


def ridge_reference(z: np.ndarray, y: np.ndarray, classes: int, lam: float, normalize: bool):
    """Centralised ridge regression on [z, 1] with one-hot targets (sklearn), columns normalised by
    the weight rows' norm (bias divided by the same norm)."""
    za = np.hstack([z, np.ones((len(z), 1))])
    onehot = np.eye(classes)[y]
    w = Ridge(alpha=lam, fit_intercept=False, solver="cholesky").fit(za, onehot).coef_.T  # [p+1, C]
    if normalize:
        norms = np.linalg.norm(w[:-1], axis=0)
        w = w / np.where(norms > 0, norms, 1.0)
    return w[:-1].T, w[-1]  # weight [C, d], bias [C]


def rel_err(a, b):
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))


@given(
    sizes=st.lists(st.integers(1, 12), min_size=1, max_size=7),
    kappa=st.integers(1, 7),
    seed=st.integers(0, 10_000),
    lam=st.sampled_from([1e-3, 1e-2, 1.0]),
)
def test_fed3r_equals_centralised_ridge_for_any_partition_and_order(sizes, kappa, seed, lam):
    task = ToyTask(sizes=tuple(sizes), dim=4, classes=3, seed=seed)
    comp = Fed3R(Fed3RParams(lam=lam, normalize=True))
    k = task.num_clients
    rounds = math.ceil(k / min(kappa, k))
    sim = toy_sim(task=task, components=[comp], clients_per_round=min(kappa, k), rounds=rounds, seed=seed)
    sim.run()
    assert comp.visited.all()
    w_ref, b_ref = ridge_reference(*pooled(task), 3, lam, normalize=True)
    head = sim.global_model.head
    assert rel_err(head.weight.detach().double(), w_ref) < 1e-6
    if np.linalg.norm(b_ref) > 1e-3:
        assert rel_err(head.bias.detach().double(), b_ref) < 1e-6
    # the un-normalised float64 solution is centralised ridge itself (property 3)
    w_raw, b_raw = ridge_reference(*pooled(task), 3, lam, normalize=False)
    sol = comp.acc.solve().numpy()
    assert rel_err(sol.T, np.hstack([w_raw, b_raw[:, None]])) < 1e-9


def test_each_client_reports_once_and_sync_after_all_groups_equals_fed3r():
    task = ToyTask(sizes=(5, 7, 3, 6, 4), dim=3, classes=4, seed=3)
    one = Fed3R(Fed3RParams(sync=False))
    sim1 = toy_sim(task=task, components=[one], rounds=1)
    sim1.run()
    sync = Fed3R(Fed3RParams(sync=True))
    sim2 = toy_sim(task=task, components=[sync], clients_per_round=2, rounds=4)
    seen, rows = [], []
    for r in range(1, 5):
        seen.append(sim2.begin_round(r).sampled)  # the round's group (sampling has no side effect)
        rows.append(sim2.train_round(r)[0])
        sim2.round = r
        # usable after each round: the head is the ridge solution of the clients reported so far
        reported = np.flatnonzero(sync.visited)
        sub = ToyTask(sizes=(5, 7, 3, 6, 4), dim=3, classes=4, seed=3)
        z = torch.cat([sub.xs[c] for c in reported]).double().numpy()
        y = torch.cat([sub.ys[c] for c in reported]).numpy()
        w_ref, _ = ridge_reference(z, y, 4, 0.01, normalize=True)
        seen_classes = np.unique(y)
        assert rel_err(sim2.global_model.head.weight.detach().double()[seen_classes], w_ref[seen_classes]) < 1e-6
    flat = [c for s in seen[:3] for c in s]
    assert sorted(flat) == list(range(5)) and seen[3] == []  # ceil(5/2) = 3 rounds visit everyone once
    assert rows[3]["clients/aggregated"] == 0
    torch.testing.assert_close(sim2.global_model.head.weight, sim1.global_model.head.weight, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(sim2.global_model.head.bias, sim1.global_model.head.bias, rtol=1e-6, atol=1e-7)
    # Sync uploads the full d x C matrix, Fed3R only the local classes' columns (Table 3.2)
    p = 3 + 1
    exact = 0
    for c in range(5):
        ck = len(np.unique(task.ys[c].numpy()))
        exact += 8 * (p * (p + 1) // 2 + ck * p + ck + ck)  # A upper, b rows, class ids (int64), counts
    assert sim1.totals["up_bytes"] == exact
    # the thesis's count (Sec. 3.9.2): every number at 4 bytes, half the float64 and int64 bytes here
    assert sim1.totals["up_bytes_fp32"] == exact / 2
    assert sim1.totals["down_bytes"] == 0  # the public pre-trained extractor is not downloaded
    assert sim2.totals["up_bytes"] == 5 * 8 * (p * (p + 1) // 2 + 4 * p + 4 + 4)
    assert sim2.totals["up_bytes_fp32"] == 5 * 4 * (p * (p + 1) // 2 + 4 * p + 4 + 4)


def test_sampling_with_replacement_is_fedavgs_draw_minus_the_reported_and_ends_at_the_same_classifier():
    """Fig. 3.9's protocol: each round draws kappa of all K clients (engine.plan.sample_clients, as FedAvg), only
    clients not yet reported send; once all have reported the head equals the once-each run's (sums commute)."""
    from fedsight.engine.plan import sample_clients

    task = ToyTask(sizes=(5, 7, 3, 6, 4), dim=3, classes=4, seed=3)
    once = Fed3R(Fed3RParams(sync=True))
    sim1 = toy_sim(task=task, components=[once], clients_per_round=2, rounds=3)
    sim1.run()
    fed3r = Fed3R(Fed3RParams(sync=True, sampling="replacement"))
    sim = toy_sim(task=task, components=[fed3r], clients_per_round=2, rounds=60)
    reported: set[int] = set()
    rounds_to_all = None
    for r in range(1, 61):
        got = sim.begin_round(r).sampled
        assert got == [c for c in sample_clients(sim.seed, r, 5, 2) if c not in reported]
        sim.train_round(r)
        sim.round = r
        reported |= set(got)
        if rounds_to_all is None and len(reported) == 5:
            rounds_to_all = r
            break
    assert rounds_to_all is not None and rounds_to_all > 3  # more than ceil(5/2): a client was drawn twice
    torch.testing.assert_close(sim.global_model.head.weight, sim1.global_model.head.weight, rtol=1e-6, atol=1e-7)


def test_rounds_to_cover_half_the_clients_with_replacement_match_the_batch_coupon_collector():
    """Table 3.6 (Cifar100, K = 100, kappa = 10): 50% of the clients seen after 7 ± 1 rounds; the closed form of
    the expected unseen share after r rounds, (1 - kappa/K)^r, passes 0.5 at r = 6.6. Over 200 seeds of FedSight's
    draw the mean number of rounds is within [6.5, 7.5]."""
    from fedsight.engine.plan import sample_clients

    def rounds_to_half(seed: int) -> int:
        seen: set[int] = set()
        for r in range(1, 100):
            seen |= set(sample_clients(seed, r, 100, 10))
            if len(seen) >= 50:
                return r
        raise AssertionError("never")

    mean = float(np.mean([rounds_to_half(s) for s in range(200)]))
    assert math.log(0.5) / math.log(0.9) == pytest.approx(6.58, abs=0.01)
    assert 6.5 <= mean <= 7.5, mean


def test_rejected_client_is_revisited_and_resume_mid_stage_is_identical():
    task = ToyTask(sizes=(4, 5, 6, 3), dim=3, classes=3, seed=1)
    full = toy_sim(task=task, components=[Fed3R()], clients_per_round=1, rounds=4)
    full.run()
    a = toy_sim(task=task, components=[Fed3R()], clients_per_round=1, rounds=4)
    a.run(stop_after=2)
    state = a.state_dict()
    b = toy_sim(task=task, components=[Fed3R()], clients_per_round=1, rounds=4)
    b.load_state_dict(state)
    b.run()
    assert torch.equal(b.global_model.head.weight, full.global_model.head.weight)

    poisoned = ToyTask(sizes=(4, 5, 6, 3), dim=3, classes=3, seed=1)
    poisoned.xs[2] = poisoned.xs[2].clone()
    poisoned.xs[2][0, 0] = float("nan")
    comp = Fed3R()
    sim = toy_sim(task=poisoned, components=[comp], rounds=2)
    events = []
    sim.run(on_round=lambda r, row, ev: events.extend(ev))
    assert [e["client"] for e in events if e["event"] == "rejected_update"] == [2, 2]
    assert comp.visited.tolist() == [True, True, False, True]


def test_fed3r_rf_solves_ridge_on_the_models_random_features():
    task = ToyTask(sizes=(6, 8, 5), dim=3, classes=3, seed=2)
    comp = Fed3R(Fed3RParams(rff_dim=40, rff_sigma=2.0, lam=0.1))
    sim = toy_sim(task=task, components=[comp], rounds=1)
    assert isinstance(sim.global_model.head, RFFHead)
    assert not any("rff" in k for k in sim.global_model.state_dict())  # regenerated, never communicated
    torch.testing.assert_close(sim.global_model.head.rff.omega, sim.work_model.head.rff.omega, rtol=0, atol=0)
    sim.run()
    x, y = pooled(task)
    with torch.no_grad():
        z = sim.global_model.head.rff(torch.from_numpy(x).float()).double().numpy()
    w_ref, b_ref = ridge_reference(z, y, 3, 0.1, normalize=True)
    assert rel_err(sim.global_model.head.linear.weight.detach().double(), w_ref) < 1e-5
    # predictions of the model = argmax of the reference classifier on the lifted features
    pred = sim.global_model(torch.from_numpy(x).float()).argmax(1).numpy()
    assert (pred == (z @ w_ref.T + b_ref).argmax(1)).mean() == 1.0


@pytest.mark.parametrize("normalize", [False, True])
def test_fedncm_matches_nearest_centroid(normalize):
    task = ToyTask(sizes=(10, 12, 9), dim=4, classes=3, seed=5)
    comp = FedNCM(FedNCMParams(normalize=normalize))
    sim = toy_sim(task=task, components=[comp], clients_per_round=2, rounds=2)
    sim.run()
    x, y = pooled(task)
    xt = task.test_x.double().numpy()
    with torch.no_grad():
        pred = sim.global_model(task.test_x).argmax(1).numpy()
    if normalize:
        means = np.stack([x[y == c].mean(0) for c in range(3)])
        ref = (xt @ (means / np.linalg.norm(means, axis=1, keepdims=True)).T).argmax(1)
    else:
        ref = NearestCentroid().fit(x, y).predict(xt)
    assert (pred == ref).all()


def test_closed_form_stage_trains_nothing_and_logs_flops():
    task = ToyTask(sizes=(4, 5), dim=3, classes=3, seed=0)
    comp = Fed3R()
    sim = toy_sim(task=task, components=[comp], rounds=1)
    before = {k: v.clone() for k, v in sim.global_model.backbone.state_dict().items()}
    row, _ = sim.train_round(1)
    assert "train/loss" not in row
    assert all(torch.equal(v, sim.global_model.backbone.state_dict()[k]) for k, v in before.items())
    # ToyLinear's extractor is the identity (0 FLOPs): the cost is n (p(p+1) + p) with p = d + 1 = 4
    assert row["cost/flops"] == 9 * (4 * 5 + 4)


def test_fed3r_rf_head_follows_the_models_dtype():
    """A float64 model gets a float64 random-features head (it used to be built in the default dtype)."""
    from torch import nn

    class Double(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(3, 4).double()
            self.head = nn.Linear(4, 2).double()

        def forward(self, x):
            return self.head(self.body(x))

    model = Double()
    Fed3R(Fed3RParams(rff_dim=16, rff_sigma=1.0)).adapt_model(model, seed=0)
    assert isinstance(model.head, RFFHead) and model.head.linear.weight.dtype == torch.float64
    out = model(torch.randn(5, 3, dtype=torch.float64))
    assert out.dtype == torch.float64 and out.shape == (5, 2)


def test_an_fp32_model_update_costs_the_same_at_4_bytes_a_number():
    """``cost/up_bytes_fp32`` (the thesis's 4 bytes a number) equals ``cost/up_bytes`` for an FP32 model's update,
    round by round and in total."""
    sim = toy_sim(rounds=2)
    rows = [sim.train_round(r)[0] for r in (1, 2)]
    n_params = sum(p.numel() for p in sim.global_model.parameters())
    for i, row in enumerate(rows, start=1):
        assert row["cost/up_bytes_fp32"] == row["cost/up_bytes"] == 4 * n_params * sim.task.num_clients
        assert row["cost/total_up_bytes_fp32"] == i * row["cost/up_bytes"]
