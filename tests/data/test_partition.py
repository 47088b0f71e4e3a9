"""Partitioners, local train/test splits, counts, summaries and heat maps.

Checks are properties (exact cover, determinism, class counts, size bounds) or independent references
(global label histograms, chi-square statistics, hand-computed entropies), never stored outputs.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats

from fedsight.data import ClientSplit, make_client_splits, partition_counts, partition_summary
from fedsight.data.partition import partition
from fedsight.reporting import plot_partition_heatmap
from fedsight.registry import PARTITIONERS, build
from fedsight.rng import np_rng

# Parameters that make each partitioner usable; partitioners added later run with their defaults.
PARAMS: dict[str, dict] = {"dirichlet": {"alpha": 0.5}}
ALL = PARTITIONERS.names()
# the dataset's own split is the same for every seed; the class-imbalance split is when whole classes fill clients
# exactly (its use of the seed is checked below)
SEED_FREE = {"predefined", "class_imbalance"}
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def params_for(name: str) -> dict:
    return dict(PARAMS.get(name, {}))


def attributes_for(name: str, labels: np.ndarray, num_clients: int) -> dict[str, np.ndarray]:
    """Per-example attributes for partitioners that declare ``needs``: each example shows its own label's
    class plus, for every third example, the next class; a predefined split deals examples round-robin."""
    labels = np.asarray(labels)
    out: dict[str, np.ndarray] = {}
    for need in PARTITIONERS.get(name).meta.get("needs", ()):
        if need == "class_presence":
            c = int(labels.max()) + 2 if labels.size and labels.ndim == 1 else 1
            presence = np.zeros((len(labels), c), dtype=bool)
            if labels.ndim == 1:
                presence[np.arange(len(labels)), labels] = True
                presence[np.arange(0, len(labels), 3), labels[::3] + 1] = True
            out[need] = presence
        elif need == "client_of":
            out[need] = np.arange(len(labels)) % num_clients
        else:
            raise AssertionError(f"no test attribute for {need!r}: teach attributes_for about it")
    return out


def run(name: str, labels: np.ndarray, num_clients: int, seed: int, **overrides) -> list[np.ndarray]:
    params = {**params_for(name), **overrides}
    return build(PARTITIONERS, name, params, labels=labels, num_clients=num_clients, rng=np.random.default_rng(seed),
                 **attributes_for(name, labels, num_clients))


@st.composite
def feasible_cases(draw) -> tuple[np.ndarray, int]:
    """Labels and a client count every built-in partitioner with its test parameters can handle:
    2..8 classes (at most 2 per client on average, so 'classes' with k=2 covers them), every class with at
    least 3 samples per client (so Dirichlet's min_size=2 is reachable and shards/classes fit)."""
    num_clients = draw(st.integers(1, 10))
    num_classes = draw(st.integers(2, max(2, min(8, 2 * num_clients))))
    sizes = draw(st.lists(st.integers(3 * num_clients, 3 * num_clients + 40), min_size=num_classes, max_size=num_classes))
    class_ids = draw(st.permutations(list(range(num_classes + 3))))[:num_classes]  # labels need not be 0..K-1
    labels = np.concatenate([np.full(s, c, dtype=np.int64) for s, c in zip(sizes, class_ids)])
    order = draw(st.permutations(list(range(len(labels)))))
    return labels[np.asarray(order)], num_clients


def assert_exact_cover(parts: list[np.ndarray], n: int, num_clients: int) -> None:
    assert len(parts) == num_clients
    for p in parts:
        assert p.dtype == np.int64
        assert np.all(np.diff(p) > 0), "each client's indices must be sorted and unique"
    allidx = np.concatenate(parts)
    assert len(allidx) == n
    assert np.array_equal(np.sort(allidx), np.arange(n))


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def classes_held(labels: np.ndarray, parts: list[np.ndarray]) -> list[int]:
    return [len(np.unique(labels[p])) for p in parts]


# ------------------------------------------------------------------------------- every partitioner


def test_builtin_partitioners_registered() -> None:
    assert {"iid", "dirichlet", "shards", "classes", "quantity"} <= set(ALL)


@pytest.mark.parametrize("name", ALL)
@SETTINGS
@given(case=feasible_cases(), seed=st.integers(0, 2**32 - 1))
def test_exact_cover_and_determinism(name: str, case, seed: int) -> None:
    labels, num_clients = case
    parts = run(name, labels, num_clients, seed)
    assert_exact_cover(parts, len(labels), num_clients)
    assert all(len(p) >= 1 for p in parts)
    assert same(parts, run(name, labels, num_clients, seed))
    if num_clients >= 2 and name not in SEED_FREE:
        assert any(not same(parts, run(name, labels, num_clients, seed + k)) for k in range(1, 6))


@pytest.mark.parametrize("name", ALL)
def test_too_many_clients_is_an_error(name: str) -> None:
    labels = np.array([0, 1, 0, 1, 2], dtype=np.int64)
    with pytest.raises(ValueError, match="num_clients"):
        run(name, labels, 6, 0)


@pytest.mark.parametrize("name", ALL)
def test_rejects_non_1d_labels(name: str) -> None:
    with pytest.raises(ValueError):
        run(name, np.zeros((10, 2), dtype=np.int64), 2, 0)


# ------------------------------------------------------------------------------------------------ iid


@SETTINGS
@given(case=feasible_cases(), seed=st.integers(0, 2**32 - 1))
def test_iid_sizes_differ_by_at_most_one(case, seed: int) -> None:
    labels, num_clients = case
    sizes = [len(p) for p in run("iid", labels, num_clients, seed)]
    assert max(sizes) - min(sizes) <= 1


# ------------------------------------------------------------------------------------------ dirichlet


@pytest.mark.parametrize("name", ["dirichlet", "quantity"])
@SETTINGS
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_min_size_respected(name: str, data, seed: int) -> None:
    num_clients = data.draw(st.integers(2, 8))
    n = data.draw(st.integers(20 * num_clients, 30 * num_clients))
    min_size = data.draw(st.integers(0, 8))
    labels = np.asarray(data.draw(st.lists(st.integers(0, 4), min_size=n, max_size=n)), dtype=np.int64)
    parts = run(name, labels, num_clients, seed, min_size=min_size)
    assert_exact_cover(parts, n, num_clients)
    assert min(len(p) for p in parts) >= min_size


@pytest.mark.parametrize("name", ["dirichlet", "quantity"])
def test_min_size_impossible_is_an_error(name: str) -> None:
    labels = np.arange(20) % 4
    with pytest.raises(ValueError, match="min_size"):
        run(name, labels, 5, 0, min_size=5)  # 5 x 5 > 20 samples


def test_dirichlet_gives_up_after_max_tries() -> None:
    # possible in principle, but not with this concentration within a few tries
    with pytest.raises(ValueError, match="alpha=0.001") as err:
        run("dirichlet", np.arange(200) % 4, 10, 0, min_size=19, max_tries=3, alpha=1e-3)
    assert "min_size=19" in str(err.value)


def test_quantity_min_size_never_needs_retries() -> None:
    # many clients, tiny beta, min_size taking almost every sample: sizes still respect min_size exactly
    labels = np.arange(1000) % 10
    for seed in range(5):
        parts = run("quantity", labels, 100, seed, beta=0.05, min_size=9)
        assert_exact_cover(parts, 1000, 100)
        assert min(len(p) for p in parts) >= 9


def balanced_labels(num_classes: int, per_class: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(num_classes), per_class))


def test_dirichlet_large_alpha_is_close_to_global_distribution() -> None:
    labels = np.random.default_rng(1).choice(10, size=6000, p=np.linspace(1, 3, 10) / np.linspace(1, 3, 10).sum())
    global_p = np.bincount(labels, minlength=10) / len(labels)
    for seed in range(3):
        parts = run("dirichlet", labels, 6, seed, alpha=1e6)
        for p in parts:
            local = np.bincount(labels[p], minlength=10) / len(p)
            assert 0.5 * np.abs(local - global_p).sum() < 0.02
        sizes = np.array([len(p) for p in parts])
        assert sizes.max() / sizes.min() < 1.05


def test_dirichlet_small_alpha_gives_few_classes_per_client() -> None:
    labels = balanced_labels(10, 300)
    few = []
    for seed in range(3):
        parts = run("dirichlet", labels, 20, seed, alpha=0.01, min_size=0)
        assert_exact_cover(parts, len(labels), 20)
        held = [k for k, p in zip(classes_held(labels, parts), parts) if len(p)]
        few.append(np.median(held))
        # a class's samples go mostly to one client
        counts = partition_counts(labels, parts, 10)
        assert np.mean(counts.max(axis=0) / counts.sum(axis=0)) > 0.8
    assert max(few) <= 2
    # and a moderate alpha spreads classes far more
    parts = run("dirichlet", labels, 20, 0, alpha=10.0)
    assert np.median(classes_held(labels, parts)) >= 8


def test_dirichlet_balance_option_keeps_sizes_closer() -> None:
    labels = balanced_labels(10, 400)
    spread = {}
    for balance in (False, True):
        ratios = []
        for seed in range(5):
            sizes = np.array([len(p) for p in run("dirichlet", labels, 10, seed, alpha=0.3, balance=balance)])
            ratios.append(sizes.std() / sizes.mean())
        spread[balance] = np.mean(ratios)
    assert spread[True] < spread[False]


# --------------------------------------------------------------------------------------------- shards


@SETTINGS
@given(case=feasible_cases(), spc=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_shards_at_most_shards_per_client_classes(case, spc: int, seed: int) -> None:
    labels, num_clients = case
    if num_clients * spc < len(np.unique(labels)):
        spc = math.ceil(len(np.unique(labels)) / num_clients)
    parts = run("shards", labels, num_clients, seed, shards_per_client=spc)
    assert_exact_cover(parts, len(labels), num_clients)
    assert max(classes_held(labels, parts)) <= spc


def test_shards_are_pathological_and_balanced_on_balanced_data() -> None:
    labels = balanced_labels(10, 600)
    parts = run("shards", labels, 100, 3, shards_per_client=2)
    assert_exact_cover(parts, len(labels), 100)
    sizes = np.array([len(p) for p in parts])
    assert sizes.min() == sizes.max() == 60  # 200 shards of 30 samples
    assert max(classes_held(labels, parts)) <= 2


def test_shards_fewer_shards_than_classes_still_covers() -> None:
    labels = balanced_labels(10, 20)
    parts = run("shards", labels, 2, 0, shards_per_client=2)  # 4 shards < 10 classes
    assert_exact_cover(parts, len(labels), 2)


# -------------------------------------------------------------------------------------------- classes


@SETTINGS
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_classes_exactly_k_per_client_and_all_classes_held(data, seed: int) -> None:
    num_clients = data.draw(st.integers(1, 12))
    k = data.draw(st.integers(1, 4))
    num_classes = data.draw(st.integers(k, max(k, min(10, num_clients * k))))
    per_class = data.draw(st.integers(num_clients, num_clients + 30))
    labels = balanced_labels(num_classes, per_class, seed % 1000)
    parts = run("classes", labels, num_clients, seed, classes_per_client=k)
    assert_exact_cover(parts, len(labels), num_clients)
    assert classes_held(labels, parts) == [k] * num_clients
    counts = partition_counts(labels, parts, num_classes)
    holders = (counts > 0).sum(axis=0)
    assert holders.min() >= 1
    assert holders.max() - holders.min() <= 1  # classes shared as evenly as the round robin allows
    for c in range(num_classes):  # each class split evenly among its holders
        held = counts[:, c][counts[:, c] > 0]
        assert held.max() - held.min() <= 1


def test_classes_errors() -> None:
    labels = balanced_labels(10, 10)
    with pytest.raises(ValueError, match="classes_per_client"):
        run("classes", labels, 2, 0, classes_per_client=3)  # 6 < 10 classes: samples left without a client
    with pytest.raises(ValueError, match="classes_per_client"):
        run("classes", labels, 20, 0, classes_per_client=11)


# ------------------------------------------------------------------------------------------- quantity


def test_quantity_keeps_label_proportions_while_sizes_vary() -> None:
    labels = np.random.default_rng(5).choice(8, size=8000, p=np.arange(1, 9) / 36)
    global_counts = np.bincount(labels, minlength=8)
    global_p = global_counts / len(labels)
    crit = stats.chi2.ppf(1 - 1e-4, df=7)
    ratios = []
    for seed in range(5):
        parts = run("quantity", labels, 8, seed, beta=0.5, min_size=2)
        assert_exact_cover(parts, len(labels), 8)
        sizes = np.array([len(p) for p in parts])
        ratios.append(sizes.max() / sizes.min())
        for p in parts:
            if len(p) < 200:
                continue
            observed = np.bincount(labels[p], minlength=8)
            expected = global_p * len(p)
            assert ((observed - expected) ** 2 / expected).sum() < crit
    assert np.median(ratios) > 3  # unlike iid (ratio ~1)


# ------------------------------------------------------------------------------ class imbalance / predefined


@st.composite
def presence_cases(draw) -> tuple[np.ndarray, int]:
    """Random per-image class presence, including images with no class at all (fully ignored label maps)."""
    num_clients = draw(st.integers(1, 6))
    n = draw(st.integers(num_clients, 60))
    c = draw(st.integers(1, 6))
    density = draw(st.floats(0.0, 0.9))
    seed = draw(st.integers(0, 2**16))
    return np.random.default_rng(seed).random((n, c)) < density, num_clients


@SETTINGS
@given(case=presence_cases(), seed=st.integers(0, 2**32 - 1))
def test_class_imbalance_terminates_covers_and_sizes_are_equal(case, seed: int) -> None:
    presence, k = case
    labels = np.zeros(len(presence), dtype=np.int64)
    parts = build(PARTITIONERS, "class_imbalance", {}, labels=labels, num_clients=k, rng=np.random.default_rng(seed),
                  class_presence=presence)
    assert_exact_cover(parts, len(presence), k)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == len(presence)


def test_class_imbalance_fills_the_first_client_from_the_rarest_class() -> None:
    # 40 images; class 2 in 3 images, class 1 in 9 (2 of them with class 2), class 0 in all. 4 clients of 10
    # images: client 0 takes the 3 images with class 2 (rarest), then the 7 images left with class 1 (rarest
    # among the remaining: 7 < 37). The other clients are left with class 0 only.
    presence = np.zeros((40, 3), dtype=bool)
    presence[:, 0] = True
    presence[[5, 17, 33], 2] = True
    with_1 = [1, 5, 8, 12, 17, 21, 26, 30, 39]  # 5 and 17 also hold class 2
    presence[with_1, 1] = True
    parts = build(PARTITIONERS, "class_imbalance", {}, labels=np.zeros(40, dtype=np.int64), num_clients=4,
                  rng=np.random.default_rng(0), class_presence=presence)
    first = set(parts[0].tolist())
    assert {5, 17, 33} | set(with_1) <= first and len(first) == 10
    for p in parts[1:]:
        assert not presence[p, 1:].any()
    # the seed picks which images of a class pool are taken when the pool is larger than needed
    draws = {tuple(build(PARTITIONERS, "class_imbalance", {}, labels=np.zeros(40, dtype=np.int64), num_clients=4,
                         rng=np.random.default_rng(s), class_presence=presence)[1]) for s in range(6)}
    assert len(draws) > 1


def test_class_imbalance_is_more_skewed_than_iid() -> None:
    rng = np.random.default_rng(3)
    presence = rng.random((400, 8)) < np.linspace(0.05, 0.9, 8)  # rare to common classes
    labels = np.zeros(400, dtype=np.int64)
    ci = build(PARTITIONERS, "class_imbalance", {}, labels=labels, num_clients=8, rng=np.random.default_rng(0),
               class_presence=presence)
    iid = build(PARTITIONERS, "iid", {}, labels=labels, num_clients=8, rng=np.random.default_rng(0))

    def spread(parts):  # how unevenly the rarest class is spread over clients
        held = np.array([presence[p, 0].sum() for p in parts])
        return held.max() / max(held.mean(), 1e-9)

    assert spread(ci) > 2 * spread(iid)


def test_predefined_uses_the_datasets_split_and_checks_the_client_count() -> None:
    client_of = np.array([2, 0, 1, 1, 0, 2, 2])
    parts = partition(np.zeros(7, dtype=np.int64), num_clients=3, partitioner="predefined", seed=5,
                      attributes={"client_of": client_of})
    assert [p.tolist() for p in parts] == [[1, 4], [2, 3], [0, 5, 6]]
    with pytest.raises(ValueError, match="3 clients but partition.num_clients = 4"):
        partition(np.zeros(7, dtype=np.int64), num_clients=4, partitioner="predefined", seed=5,
                  attributes={"client_of": client_of})
    with pytest.raises(ValueError, match=r"no images for client\(s\) \[1\]"):
        partition(np.zeros(4, dtype=np.int64), num_clients=3, partitioner="predefined", seed=5,
                  attributes={"client_of": np.array([0, 2, 2, 0])})


@pytest.mark.parametrize("name", ["predefined", "class_imbalance"])
def test_partitioner_missing_its_attributes_is_a_clear_error(name: str) -> None:
    with pytest.raises(ValueError, match=f"partitioner '{name}' needs per-example"):
        partition(np.zeros(10, dtype=np.int64), num_clients=2, partitioner=name, seed=0)


# ------------------------------------------------------------------------------- make_client_splits


@pytest.mark.parametrize("name", ALL)
@SETTINGS
@given(case=feasible_cases(), seed=st.integers(0, 2**32 - 1), frac=st.sampled_from([0.0, 0.1, 0.2, 0.25, 0.5]))
def test_client_splits_properties(name: str, case, seed: int, frac: float) -> None:
    labels, num_clients = case
    attrs = attributes_for(name, labels, num_clients)
    splits = make_client_splits(labels, num_clients=num_clients, partitioner=name, params=params_for(name), seed=seed,
                                local_test_fraction=frac, attributes=attrs)
    # the union of a client's train and test is the partition drawn from the documented stream
    parts = build(PARTITIONERS, name, params_for(name), labels=labels, num_clients=num_clients,
                  rng=np_rng(seed, "partition"), **attrs)
    assert len(splits) == num_clients
    for s, part in zip(splits, parts):
        assert isinstance(s, ClientSplit)
        assert s.train.dtype == np.int64 and s.test.dtype == np.int64
        assert len(np.intersect1d(s.train, s.test)) == 0
        assert np.array_equal(np.sort(np.concatenate([s.train, s.test])), np.sort(part))
        n = len(part)
        assert len(s.train) >= 1
        if frac == 0:
            assert len(s.test) == 0
        else:
            assert abs(len(s.test) - frac * n) <= 1
            # stratified: each class with >= 2 samples on the client is held out in proportion
            for c in np.unique(labels[part]):
                n_c = int(np.sum(labels[part] == c))
                t_c = int(np.sum(labels[s.test] == c))
                if n_c >= 2:
                    assert abs(t_c - frac * n_c) < 1
                    assert t_c <= n_c - 1
    again = make_client_splits(labels, num_clients=num_clients, partitioner=name, params=params_for(name), seed=seed,
                               local_test_fraction=frac, attributes=attrs)
    assert all(np.array_equal(a.train, b.train) and np.array_equal(a.test, b.test) for a, b in zip(splits, again))


def test_client_splits_differ_across_seeds_and_cover_everything() -> None:
    labels = balanced_labels(5, 40)
    a = make_client_splits(labels, num_clients=4, partitioner="iid", params=None, seed=0, local_test_fraction=0.25)
    b = make_client_splits(labels, num_clients=4, partitioner="iid", params=None, seed=1, local_test_fraction=0.25)
    assert any(not np.array_equal(x.test, y.test) for x, y in zip(a, b))
    everything = np.concatenate([np.concatenate([s.train, s.test]) for s in a])
    assert np.array_equal(np.sort(everything), np.arange(len(labels)))


def test_client_splits_tiny_clients_keep_a_training_sample() -> None:
    labels = np.arange(12) % 6  # 6 classes of 2 samples; 6 clients of 2 samples each
    splits = make_client_splits(labels, num_clients=6, partitioner="iid", params=None, seed=3, local_test_fraction=0.9)
    for s in splits:
        assert len(s.train) >= 1 and len(s) == 2
    one = make_client_splits(labels, num_clients=12, partitioner="iid", params=None, seed=3, local_test_fraction=0.5)
    assert all(len(s.train) == 1 and len(s.test) == 0 for s in one)


def test_client_splits_errors() -> None:
    labels = balanced_labels(3, 4)
    with pytest.raises(ValueError, match="num_clients"):
        make_client_splits(labels, num_clients=13, partitioner="iid", params=None, seed=0, local_test_fraction=0.2)
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="local_test_fraction"):
            make_client_splits(labels, num_clients=2, partitioner="iid", params=None, seed=0, local_test_fraction=bad)
    with pytest.raises(KeyError, match="nope"):
        make_client_splits(labels, num_clients=2, partitioner="nope", params=None, seed=0, local_test_fraction=0.2)
    with pytest.raises(ValueError):  # pydantic: unknown parameter
        make_client_splits(labels, num_clients=2, partitioner="iid", params={"x": 1}, seed=0, local_test_fraction=0.2)
    with pytest.raises(ValueError):  # pydantic: alpha must be > 0
        make_client_splits(
            labels, num_clients=2, partitioner="dirichlet", params={"alpha": 0}, seed=0, local_test_fraction=0.2
        )


# ------------------------------------------------------------------------------- counts and summaries


@SETTINGS
@given(case=feasible_cases(), seed=st.integers(0, 1000))
def test_partition_counts_match_direct_counting(case, seed: int) -> None:
    labels, num_clients = case
    num_classes = int(labels.max()) + 1
    splits = make_client_splits(
        labels, num_clients=num_clients, partitioner="iid", params=None, seed=seed, local_test_fraction=0.2
    )
    counts = partition_counts(labels, splits, num_classes)
    assert counts.shape == (num_clients, num_classes)
    for i, s in enumerate(splits):
        for c in range(num_classes):
            assert counts[i, c] == sum(1 for j in np.concatenate([s.train, s.test]) if labels[j] == c)
    train = partition_counts(labels, splits, num_classes, which="train")
    test = partition_counts(labels, splits, num_classes, which="test")
    assert np.array_equal(train + test, counts)
    assert np.array_equal(counts.sum(axis=0), np.bincount(labels, minlength=num_classes))
    assert np.array_equal(partition_counts(labels, [s.train for s in splits], num_classes), train)


def test_partition_summary_against_hand_computed_values() -> None:
    counts = np.array([[5, 5, 5, 5], [10, 0, 0, 0], [0, 3, 3, 0], [1, 3, 0, 0], [0, 0, 0, 0]])
    s = partition_summary(counts)
    assert s["num_clients"] == 5 and s["total"] == 40
    assert s["min_size"] == 0 and s["max_size"] == 20 and s["median_size"] == 6
    assert s["mean_classes_per_client"] == pytest.approx((4 + 1 + 2 + 2 + 0) / 5)
    h_skewed = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    # entropy is averaged over the clients that hold data
    assert s["mean_label_entropy"] == pytest.approx((math.log(4) + 0 + math.log(2) + h_skewed) / 4)
    pooled = np.array([16, 11, 8, 5]) / 40
    assert s["global_label_entropy"] == pytest.approx(-(pooled * np.log(pooled)).sum())


def test_mean_jaccard_is_eq_3_27_against_scikit_learn_and_its_extremes() -> None:
    """Thesis eq. 3.27 term by term with scikit-learn's jaccard_score on the clients' class-presence vectors
    (an empty client left out), and the two extremes the equation implies: 1 when all clients hold the same
    classes, 1/K when each class sits at exactly one client (Dirichlet alpha = 0)."""
    from sklearn.metrics import jaccard_score

    rng = np.random.default_rng(0)
    counts = rng.integers(0, 3, size=(9, 6)) * (rng.random((9, 6)) < 0.5)
    counts[4] = 0  # an empty client
    held = [row > 0 for row in counts if row.sum() > 0]
    expected = sum(jaccard_score(a, b) for a in held for b in held) / len(held) ** 2
    assert partition_summary(counts)["mean_jaccard"] == pytest.approx(expected)
    assert partition_summary(np.full((5, 4), 3))["mean_jaccard"] == pytest.approx(1.0)
    assert partition_summary(np.eye(7, dtype=int) * 10)["mean_jaccard"] == pytest.approx(1 / 7)


@pytest.mark.parametrize("shape", [(10, 10), (100, 10), (7, 40)])
def test_plot_partition_heatmap_writes_png(tmp_path, shape) -> None:
    from PIL import Image

    counts = np.random.default_rng(0).integers(0, 50, size=shape)
    path = tmp_path / "heat.png"
    names = [f"class-{c}" for c in range(shape[1])]
    plot_partition_heatmap(counts, path, class_names=names, title="test")
    assert path.stat().st_size > 1000
    with Image.open(path) as im:
        assert im.format == "PNG"
        w, h = im.size
    assert w > 300 and h > 300


def test_plot_partition_heatmap_rejects_wrong_class_names(tmp_path) -> None:
    with pytest.raises(ValueError):
        plot_partition_heatmap(np.ones((3, 4), dtype=int), tmp_path / "x.png", class_names=["a", "b"])


@pytest.mark.parametrize("key, plural", [("class", "classes"), ("domain", "domains")])
def test_partition_heatmap_title_names_the_key_in_plural(tmp_path, monkeypatch, key, plural) -> None:
    from matplotlib.figure import Figure

    titles = []
    original = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (titles.append(self._suptitle.get_text()),
                                                                  original(self, *a, **k)))
    plot_partition_heatmap(np.array([[3, 1], [0, 4]]), tmp_path / "p.png", key=key)
    assert f"1.5 {plural}/client" in titles[-1]


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 3)), min_size=1, max_size=12), seed=st.integers(0, 99))
def test_client_splits_pack_every_client_into_two_arrays(sizes, seed) -> None:
    """Packing is lossless: indexing (positive, negative, slices) gives each client's own arrays back."""
    from fedsight.data.partition import ClientSplits

    rng = np.random.default_rng(seed)
    trains = [np.sort(rng.choice(1000, n, replace=False)) for n, _ in sizes]
    tests = [np.sort(rng.choice(1000, m, replace=False)) for _, m in sizes]
    packed = ClientSplits.pack(trains, tests)
    assert len(packed) == len(sizes)
    for c in range(len(sizes)):
        for got in (packed[c], packed[c - len(sizes)]):
            assert np.array_equal(got.train, trains[c]) and np.array_equal(got.test, tests[c])
    assert [np.array_equal(s.train, t) for s, t in zip(packed[1::2], trains[1::2])] == [True] * len(trains[1::2])
    assert list(packed.train_sizes()) == [n for n, _ in sizes] and list(packed.test_sizes()) == [m for _, m in sizes]
    with pytest.raises(IndexError):
        packed[len(sizes)]


def test_100000_clients_are_stored_in_a_few_arrays_and_match_the_partitioner() -> None:
    labels = np.arange(100_000) % 10
    splits = make_client_splits(labels, num_clients=100_000, partitioner="iid", seed=0, local_test_fraction=0.0)
    parts = partition(labels, num_clients=100_000, partitioner="iid", seed=0)
    assert len(splits) == 100_000 and all(np.array_equal(splits[c].train, parts[c]) for c in (0, 1, 4_567, 99_999))
    arrays = [v for v in vars(splits).values() if isinstance(v, np.ndarray)]
    assert len(arrays) == 4 and sum(a.nbytes for a in arrays) <= 8 * (100_000 + 2 * 100_001 + 1)


@SETTINGS
@given(st.lists(st.integers(0, 5), min_size=8, max_size=120), st.integers(1, 8), st.integers(0, 2**31))
def test_stratified_gives_every_client_an_equal_share_of_every_label(labels, k, seed) -> None:
    """FedDrive's uniform distribution: every client holds floor(n_l / K) or ceil(n_l / K) of every label, and
    client sizes differ by at most one."""
    labels = np.asarray(labels)
    k = min(k, len(labels))
    parts = build(PARTITIONERS, "stratified", {}, labels=labels, num_clients=k, rng=np.random.default_rng(seed))
    counts = np.stack([np.bincount(labels[p], minlength=6) for p in parts])
    n_l = np.bincount(labels, minlength=6)
    assert np.all(counts >= n_l // k) and np.all(counts <= -(-n_l // k))
    sizes = counts.sum(1)
    assert sizes.max() - sizes.min() <= 1


def test_stratified_deals_feddrive_idda_uniform_one_image_of_48_domains() -> None:
    """The published IDDA uniform split's shape: 90 domains of 48 images over 90 clients -> 48 images each, one
    from each of 48 distinct domains; iid leaves some client with a domain twice."""
    labels = np.repeat(np.arange(90), 48)
    parts = build(PARTITIONERS, "stratified", {}, labels=labels, num_clients=90, rng=np.random.default_rng(0))
    assert all(len(p) == 48 and len(np.unique(labels[p])) == 48 for p in parts)
    iid = build(PARTITIONERS, "iid", {}, labels=labels, num_clients=90, rng=np.random.default_rng(0))
    assert any(len(np.unique(labels[p])) < 48 for p in iid)
