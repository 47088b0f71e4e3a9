"""Fed3R closed-form math against independent references (scikit-learn, numpy hand computations)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from sklearn.linear_model import Ridge
from sklearn.neighbors import NearestCentroid

from fedsight.functional.ridge import (
    RandomFourierFeatures,
    RidgeAccumulator,
    augment,
    client_statistics,
    ncm_classifier,
    normalize_columns,
    pack_upper,
    unpack_upper,
)


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


@st.composite
def federated_problems(draw):
    """Random features/labels, a partition over K clients (empty clients allowed) and an arrival order."""
    n = draw(st.integers(1, 60))
    d = draw(st.integers(1, 7))  # p = d + 1 <= 8 after augment
    c = draw(st.integers(2, 5))
    seed = draw(st.integers(0, 2**32 - 1))
    scale = draw(st.sampled_from([0.1, 1.0, 10.0]))
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(n, d)) * scale + rng.normal(size=d)
    y = rng.integers(0, c, size=n)
    k = draw(st.integers(1, 6))
    owner = np.array(draw(st.lists(st.integers(0, k - 1), min_size=n, max_size=n)))
    order = draw(st.permutations(range(k)))
    lam = draw(st.sampled_from([1e-3, 1e-2, 1.0]))
    return z, y, c, owner, list(order), lam


def sklearn_ridge(z_aug: np.ndarray, y: np.ndarray, c: int, lam: float) -> np.ndarray:
    """Centralised ridge regression on pooled augmented features and one-hot targets, as [p, C]."""
    onehot = np.eye(c)[y]
    model = Ridge(alpha=lam, fit_intercept=False, solver="cholesky").fit(z_aug, onehot)
    return model.coef_.T


@given(federated_problems())
def test_fed3r_equals_centralised_ridge(problem):
    z, y, c, owner, order, lam = problem
    zt = augment(torch.from_numpy(z))
    yt = torch.from_numpy(y)
    acc = RidgeAccumulator(zt.shape[1], c, lam)
    for k in order:
        mask = torch.from_numpy(owner == k)
        acc.add(client_statistics(zt[mask], yt[mask], c))
    assert acc.num_updates == len(order)
    w = acc.solve()
    assert w.dtype == torch.float64 and w.shape == (zt.shape[1], c)
    ref = sklearn_ridge(zt.numpy(), y, c, lam)
    assert rel_err(w.numpy(), ref) <= 1e-6
    np.testing.assert_array_equal(acc.counts.numpy(), np.bincount(y, minlength=c))


@given(federated_problems(), st.integers(1, 4))
def test_sync_groups_equal_per_client_statistics(problem, num_groups):
    z, y, c, owner, order, lam = problem
    zt = augment(torch.from_numpy(z))
    yt = torch.from_numpy(y)
    p = zt.shape[1]
    per_client = RidgeAccumulator(p, c, lam)
    clients = {}
    for k in order:
        mask = torch.from_numpy(owner == k)
        per_client.add(client_statistics(zt[mask], yt[mask], c))
        full = client_statistics(zt[mask], yt[mask], c, full_b=True)
        assert torch.equal(full["classes"], torch.arange(c))
        assert full["b"].shape == (c, p) and full["counts"].shape == (c,)
        absent = ~torch.isin(torch.arange(c), yt[mask])
        assert torch.all(full["b"][absent] == 0)
        clients[k] = full
    # Alg. 5: disjoint groups, each sending the (secure-aggregated) field-wise sum of its members
    grouped = RidgeAccumulator(p, c, lam)
    for g in range(num_groups):
        members = [clients[k] for k in order if k % num_groups == g]
        if not members:
            continue
        group = {name: sum(m[name] for m in members[1:]) + members[0][name] for name in ("A", "b", "counts")}
        group["classes"] = torch.arange(c)
        grouped.add(group)
    w_group, w_client = grouped.solve(), per_client.solve()
    assert rel_err(w_group.numpy(), w_client.numpy()) <= 1e-9
    torch.testing.assert_close(grouped.counts, per_client.counts, rtol=0, atol=0)


def test_client_statistics_by_hand():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(9, 3)).astype(np.float32)
    y = np.array([4, 1, 4, 4, 1, 2, 4, 1, 2])
    stats = client_statistics(torch.from_numpy(z), torch.from_numpy(y), num_classes=6)
    assert stats["A"].dtype == torch.float64 and stats["b"].dtype == torch.float64
    assert stats["classes"].tolist() == [1, 2, 4]
    z64 = z.astype(np.float64)
    np.testing.assert_allclose(unpack_upper(stats["A"], 3).numpy(), z64.T @ z64, rtol=1e-12)
    for row, cls in enumerate([1, 2, 4]):
        np.testing.assert_allclose(stats["b"][row].numpy(), z64[y == cls].sum(axis=0), rtol=1e-12)
    assert stats["counts"].tolist() == [3.0, 2.0, 4.0]
    with pytest.raises(ValueError, match="labels"):
        client_statistics(torch.from_numpy(z), torch.from_numpy(y), num_classes=4)


def test_augment_appends_ones():
    z = torch.randn(5, 3, dtype=torch.float32)
    out = augment(z)
    assert out.shape == (5, 4) and out.dtype == torch.float32
    assert torch.equal(out[:, :3], z) and torch.equal(out[:, 3], torch.ones(5))


@given(st.integers(1, 9), st.integers(0, 2**32 - 1))
def test_pack_unpack_round_trip(p, seed):
    rng = np.random.default_rng(seed)
    m = rng.normal(size=(p, p))
    sym = torch.from_numpy(m + m.T)
    packed = pack_upper(sym)
    assert packed.shape == (p * (p + 1) // 2,)
    assert torch.equal(unpack_upper(packed, p), sym)
    # row-major upper triangle, read from numpy independently
    np.testing.assert_array_equal(packed.numpy(), (m + m.T)[np.triu_indices(p)])


def test_pack_layout_and_bad_length():
    a = torch.tensor([[1.0, 2.0, 3.0], [2.0, 4.0, 5.0], [3.0, 5.0, 6.0]])
    assert pack_upper(a).tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    with pytest.raises(ValueError):
        unpack_upper(torch.zeros(5), 3)


def test_normalize_columns_by_hand():
    rng = np.random.default_rng(1)
    w = rng.normal(size=(5, 4))
    w[:, 2] = 0.0  # a class never seen
    got = normalize_columns(torch.from_numpy(w), has_bias_row=False).numpy()
    norms = np.sqrt((w**2).sum(axis=0))
    expected = np.zeros_like(w)
    for j in range(4):
        if norms[j] > 0:
            expected[:, j] = w[:, j] / norms[j]
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=0)
    assert not np.isnan(got).any()

    got_b = normalize_columns(torch.from_numpy(w), has_bias_row=True).numpy()
    wnorms = np.sqrt((w[:-1] ** 2).sum(axis=0))
    expected_b = np.zeros_like(w)
    for j in range(4):
        if wnorms[j] > 0:
            expected_b[:, j] = w[:, j] / wnorms[j]
    np.testing.assert_allclose(got_b, expected_b, rtol=1e-12, atol=0)
    np.testing.assert_allclose(np.linalg.norm(got_b[:-1][:, [0, 1, 3]], axis=0), 1.0, rtol=1e-12)
    assert not np.isnan(got_b).any()


def rff_pairs() -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(7)
    x = rng.normal(size=(6, 4))
    direction = rng.normal(size=(6, 4))
    direction /= np.linalg.norm(direction, axis=1, keepdims=True)
    dist = np.sqrt(np.array([0.25, 1.0, 2.0, 4.0, 6.0, 9.0]))
    return torch.from_numpy(x), torch.from_numpy(x + dist[:, None] * direction)


@pytest.mark.parametrize(
    ("convention", "kernel"),
    [
        ("rbf", lambda sq, sigma: np.exp(-sq / (2 * sigma**2))),
        ("thesis", lambda sq, sigma: np.exp(-sq / sigma)),
    ],
)
def test_rff_approximates_its_kernel(convention, kernel):
    sigma = 2.0
    x, x2 = rff_pairs()
    rff = RandomFourierFeatures(4, 20000, sigma=sigma, seed=3, convention=convention)
    approx = (rff(x) * rff(x2)).sum(dim=1).numpy()
    sq = ((x - x2) ** 2).sum(dim=1).numpy()
    np.testing.assert_allclose(approx, kernel(sq, sigma), atol=0.03, rtol=0)


def test_rff_conventions_differ_and_sample_as_documented():
    rbf = RandomFourierFeatures(4, 20000, sigma=2.0, seed=0, convention="rbf")
    th = RandomFourierFeatures(4, 20000, sigma=2.0, seed=0, convention="thesis")
    assert abs(rbf.omega.std().item() - 1 / 2.0) < 0.01
    assert abs(th.omega.std().item() - math.sqrt(2 / 2.0)) < 0.01
    assert abs(rbf.omega.mean().item()) < 0.01
    assert rbf.offset.min() >= 0 and rbf.offset.max() < 2 * math.pi
    assert abs(rbf.offset.mean().item() - math.pi) < 0.05
    with pytest.raises(ValueError):
        RandomFourierFeatures(4, 8, sigma=1.0, seed=0, convention="gaussian")


def test_rff_seeding_state_dict_and_dtype():
    a = RandomFourierFeatures(5, 64, sigma=1.5, seed=11)
    b = RandomFourierFeatures(5, 64, sigma=1.5, seed=11)
    c = RandomFourierFeatures(5, 64, sigma=1.5, seed=12)
    z = torch.randn(10, 5, dtype=torch.float64)
    assert torch.equal(a(z), b(z))
    assert not torch.allclose(a(z), c(z))
    assert "omega" not in a.state_dict() and "offset" not in a.state_dict()
    assert len(a.state_dict()) == 0
    names = {name for name, _ in a.named_buffers()}
    assert names == {"omega", "offset"}
    expected = math.sqrt(2 / 64) * torch.cos(z @ a.omega + a.offset)
    torch.testing.assert_close(a(z), expected, rtol=1e-12, atol=1e-12)
    out32 = a(z.float())
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32, expected.float(), rtol=1e-4, atol=1e-5)


def blobs(seed: int, present: list[int], num_classes: int, p: int = 5) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(num_classes, p)) * 3
    y = rng.choice(present, size=120)
    z = centres[y] + rng.normal(size=(120, p)) * 2.0
    return z, y


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ncm_euclidean_matches_nearest_centroid(seed):
    num_classes = 5
    present = [0, 1, 3, 4]  # class 2 never seen
    z, y = blobs(seed, present, num_classes)
    stats = client_statistics(torch.from_numpy(z), torch.from_numpy(y), num_classes, full_b=True)
    weight, bias = ncm_classifier(stats["b"], stats["counts"], normalize=False)
    assert weight.shape == (num_classes, 5) and bias.shape == (num_classes,)
    assert torch.isfinite(bias).all() and torch.all(weight[2] == 0)
    assert bias[2] < bias[[0, 1, 3, 4]].min()
    rng = np.random.default_rng(100 + seed)
    test = rng.normal(size=(300, 5)) * 5
    ours = (torch.from_numpy(test) @ weight.T + bias).argmax(dim=1).numpy()
    ref = NearestCentroid().fit(z, y).predict(test)
    np.testing.assert_array_equal(ours, ref)


def test_ncm_cosine_unit_rows_and_prediction():
    num_classes = 4
    z, y = blobs(5, [0, 1, 3], num_classes)
    sums = torch.zeros(num_classes, 5, dtype=torch.float64)
    counts = torch.zeros(num_classes, dtype=torch.float64)
    for cls in (0, 1, 3):
        sums[cls] = torch.from_numpy(z[y == cls].sum(axis=0))
        counts[cls] = float((y == cls).sum())
    weight, bias = ncm_classifier(sums, counts, normalize=True)
    norms = torch.linalg.vector_norm(weight, dim=1)
    torch.testing.assert_close(norms[[0, 1, 3]], torch.ones(3, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert norms[2] == 0
    assert bias.tolist() == [0.0, 0.0, -1.0, 0.0]
    means = np.stack([z[y == cls].mean(axis=0) for cls in (0, 1, 3)])
    test = np.random.default_rng(9).normal(size=(200, 5))
    test /= np.linalg.norm(test, axis=1, keepdims=True)
    cos = test @ (means / np.linalg.norm(means, axis=1, keepdims=True)).T
    ref = np.array([0, 1, 3])[cos.argmax(axis=1)]
    ours = (torch.from_numpy(test) @ weight.T + bias).argmax(dim=1).numpy()
    np.testing.assert_array_equal(ours, ref)


def test_accumulator_state_dict_round_trip():
    rng = np.random.default_rng(3)
    z = augment(torch.from_numpy(rng.normal(size=(30, 4))))
    y = torch.from_numpy(rng.integers(0, 3, size=30))
    acc = RidgeAccumulator(5, 3, 0.01)
    acc.add(client_statistics(z[:12], y[:12], 3))
    acc.add(client_statistics(z[12:20], y[12:20], 3))
    state = acc.state_dict()
    assert state["num_updates"] == 2 and isinstance(state["num_updates"], int)
    restored = RidgeAccumulator(5, 3, 0.01)
    restored.load_state_dict(state)
    assert torch.equal(restored.A, acc.A) and torch.equal(restored.B, acc.B)
    assert torch.equal(restored.counts, acc.counts) and restored.num_updates == 2
    assert torch.equal(restored.solve(), acc.solve())
    # the checkpoint is a copy, and resuming gives exactly the uninterrupted result
    last = client_statistics(z[20:], y[20:], 3)
    acc.add(last)
    assert restored.num_updates == 2 and not torch.equal(restored.A, acc.A)
    restored.load_state_dict(state)
    restored.add(last)
    assert torch.equal(restored.solve(), acc.solve())
    with pytest.raises(ValueError, match="dim"):
        RidgeAccumulator(6, 3, 0.01).load_state_dict(state)
    with pytest.raises(ValueError, match="lam"):
        RidgeAccumulator(5, 3, 1.0).load_state_dict(state)


@pytest.mark.parametrize(
    ("field", "bad"),
    [
        ("A", torch.zeros(14, dtype=torch.float64)),
        ("A", torch.zeros(5, 5, dtype=torch.float64)),
        ("b", torch.zeros(2, 4, dtype=torch.float64)),
        ("b", torch.zeros(3, 5, dtype=torch.float64)),
        ("classes", torch.tensor([0, 7])),
        ("classes", torch.tensor([1, 1])),
        ("counts", torch.zeros(3, dtype=torch.float64)),
    ],
)
def test_add_rejects_bad_field_and_changes_nothing(field, bad):
    z = augment(torch.randn(6, 4, dtype=torch.float64))
    y = torch.tensor([0, 2, 0, 2, 2, 0])
    stats = client_statistics(z, y, 3)
    assert stats["classes"].tolist() == [0, 2]
    acc = RidgeAccumulator(5, 3, 0.1)
    acc.add(stats)
    before = acc.state_dict()
    with pytest.raises(ValueError, match=f"'{field}'"):
        acc.add({**stats, field: bad})
    after = acc.state_dict()
    assert after["num_updates"] == 1
    for name in ("A", "B", "counts"):
        assert torch.equal(after[name], before[name])


def test_add_missing_field_is_named():
    acc = RidgeAccumulator(3, 2, 0.1)
    stats = client_statistics(torch.randn(4, 3), torch.tensor([0, 1, 1, 0]), 2)
    del stats["counts"]
    with pytest.raises(ValueError, match="'counts'"):
        acc.add(stats)


def test_solve_not_positive_definite_raises_clearly():
    acc = RidgeAccumulator(3, 2, 0.0)
    acc.add(client_statistics(torch.ones(4, 3), torch.tensor([0, 1, 1, 0]), 2))  # rank 1
    with pytest.raises(torch.linalg.LinAlgError, match="positive definite"):
        acc.solve()
    # lam = 0 with full-rank data is plain least squares
    rng = np.random.default_rng(0)
    z = rng.normal(size=(20, 3))
    y = rng.integers(0, 2, size=20)
    ls = RidgeAccumulator(3, 2, 0.0)
    ls.add(client_statistics(torch.from_numpy(z), torch.from_numpy(y), 2))
    ref = np.linalg.lstsq(z, np.eye(2)[y], rcond=None)[0]
    assert rel_err(ls.solve().numpy(), ref) <= 1e-10
