"""LADD's building blocks against independent references: Algorithm 9's clustering (planted groups, the
restart and silhouette rules recomputed by hand), pseudo-label masks computed pixel by pixel, the KD and
entropy terms from their formulas, and the SWA teacher of eq. 5.22 as a plain mean."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsight.functional.clustering import assign, cluster_styles, intra_cluster_distances
from fedsight.functional.self_training import (
    IGNORE,
    entropy,
    kl_divergence,
    normalized_entropy4,
    pseudo_label_ce,
    pseudo_labels,
    soft_target_ce,
    swa_update,
)

SETTINGS = settings(max_examples=25, deadline=None)


# ------------------------------------------------------------------------------------------- clustering


@SETTINGS
@given(k=st.integers(2, 5), per=st.integers(3, 8), dim=st.integers(5, 27), seed=st.integers(0, 2**31 - 1))
def test_clustering_recovers_planted_style_groups(k: int, per: int, dim: int, seed: int) -> None:
    """Planted groups the silhouette rule must find: centres on randomly rotated orthogonal axes, all 20*sqrt(2)
    apart, spread 0.5 per dimension. (Centres drawn at random could land 5.7 apart beside one 60 away, and
    then two clusters are the better silhouette: Hypothesis found that case.)"""
    rng = np.random.default_rng(seed)
    centres = np.linalg.qr(rng.normal(size=(dim, k)))[0].T * 20  # k orthonormal directions in R^dim
    truth = np.repeat(np.arange(k), per)
    styles = centres[truth] + rng.normal(size=(k * per, dim)) * 0.5
    perm = rng.permutation(len(truth))
    styles, truth = styles[perm], truth[perm]
    res = cluster_styles(styles, ks=range(2, 8), seeds=[0, 1, 2])
    assert res.k == k
    # the same partition up to renaming: every planted group is one cluster and vice versa
    pairs = {(int(t), int(c)) for t, c in zip(truth, res.labels)}
    assert len(pairs) == k and len({t for t, _ in pairs}) == k and len({c for _, c in pairs}) == k
    for c in range(k):
        assert np.allclose(res.centroids[c], styles[res.labels == c].mean(0))
    # new styles near a planted centre go to its cluster
    probe = centres + rng.normal(size=centres.shape) * 0.5
    want = [dict(pairs)[t] for t in range(k)]
    assert assign(probe, res.centroids).tolist() == want


def test_restart_and_silhouette_rules_match_a_hand_recomputation() -> None:
    """For every candidate k the winning seed has the smallest total intra-cluster distance (Alg. 9), and the
    chosen k the largest mean silhouette, both recomputed here with scikit-learn directly."""
    from sklearn.cluster import KMeans
    from sklearn.metrics import silhouette_score

    rng = np.random.default_rng(4)
    styles = np.concatenate([rng.normal(m, 1.0, size=(6, 4)) for m in (0, 3, 6, 9)])  # overlapping groups
    res = cluster_styles(styles, ks=[2, 3, 4, 5], seeds=[0, 1, 2, 3])
    best_k, best_sil = None, -2.0
    for k in (2, 3, 4, 5):
        totals = []
        for r in (0, 1, 2, 3):
            lab = KMeans(n_clusters=k, n_init=1, random_state=r).fit_predict(styles)
            d = np.linalg.norm(styles[:, None] - styles[None], axis=-1)
            delta = [d[i, (lab == lab[i]) & (np.arange(len(lab)) != i)].mean() if (lab == lab[i]).sum() > 1 else 0.0
                     for i in range(len(lab))]
            totals.append((sum(delta), r, lab))
        total, r, lab = min(totals, key=lambda x: (x[0], x[1]))
        sil = silhouette_score(styles, lab)
        assert res.scores[k][0] == r and res.scores[k][1] == pytest.approx(sil, abs=1e-12)
        if sil > best_sil:
            best_k, best_sil = k, sil
    assert res.k == best_k


def test_intra_cluster_distance_is_the_mean_distance_to_the_other_members() -> None:
    styles = np.array([[0.0, 0.0], [3.0, 4.0], [6.0, 8.0], [100.0, 0.0]])
    labels = np.array([0, 0, 0, 1])
    assert intra_cluster_distances(styles, labels).tolist() == [7.5, 5.0, 7.5, 0.0]


def test_too_few_clients_give_one_cluster() -> None:
    res = cluster_styles(np.array([[0.0], [1.0]]), ks=[2, 3], seeds=[0])
    assert res.k == 1 and res.labels.tolist() == [0, 0] and res.scores == {}
    with pytest.raises(ValueError, match="no style"):
        cluster_styles(np.zeros((0, 3)), ks=[2], seeds=[0])


# ---------------------------------------------------------------------------------------- pseudo-labels


def reference_pseudo_labels(logits: np.ndarray, threshold: float, fraction: float) -> np.ndarray:
    """Pixel by pixel: keep a pixel if its top probability exceeds the threshold, or if fewer than
    floor(fraction n_c) pixels of its predicted class c in its image are strictly more confident (no ties)."""
    e = np.exp(logits - logits.max(1, keepdims=True))
    prob = e / e.sum(1, keepdims=True)
    conf, lab = prob.max(1), prob.argmax(1)
    out = np.full(lab.shape, IGNORE, dtype=np.int64)
    for b in range(lab.shape[0]):
        for i in range(lab.shape[1]):
            for j in range(lab.shape[2]):
                c = lab[b, i, j]
                same = conf[b][lab[b] == c]
                k = math.floor(len(same) * fraction) if 0 < fraction < 1 else 0
                rank = int((same > conf[b, i, j]).sum())
                if (0 < threshold < 1 and conf[b, i, j] > threshold) or rank < k:
                    out[b, i, j] = c
    return out


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), threshold=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
       fraction=st.sampled_from([0.0, 0.34, 0.66, 1.0]), scale=st.sampled_from([0.5, 2.0, 6.0]))
def test_pseudo_label_masks_match_a_pixel_by_pixel_computation(seed, threshold, fraction, scale) -> None:
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(2, 4, 5, 6)) * scale  # continuous: no ties
    got = pseudo_labels(torch.from_numpy(logits), threshold, fraction)
    assert got.tolist() == reference_pseudo_labels(logits, threshold, fraction).tolist()


def test_pseudo_label_ce_reductions() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 4, 4)
    labels = torch.randint(0, 3, (2, 4, 4))
    labels[0, :2] = IGNORE
    kept = labels != IGNORE
    ce = F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="none")
    assert pseudo_label_ce(logits, labels, "all").item() == pytest.approx(ce[kept].sum().item() / labels.numel())
    assert pseudo_label_ce(logits, labels, "kept").item() == pytest.approx(ce[kept].mean().item())
    assert pseudo_label_ce(logits, torch.full_like(labels, IGNORE), "kept").item() == 0.0


# ------------------------------------------------------------------------------------------ KD, entropy


def test_distillation_and_entropy_terms_follow_their_formulas() -> None:
    torch.manual_seed(1)
    s, t = torch.randn(2, 5, 3, 4, requires_grad=True), torch.randn(2, 5, 3, 4)
    mask = torch.rand(2, 3, 4) > 0.5
    ps, pt = s.softmax(1), (0.5 * t).softmax(1)
    want = -((pt * ps.log()).mean(1) * mask).mean()
    assert soft_target_ce(s, t, 0.5, mask).item() == pytest.approx(want.item(), rel=1e-6)
    # eq. 5.20: KL(p_s || p_t), against torch's kl_div (which computes KL(target || input))
    ref = F.kl_div(t.log_softmax(1), s.log_softmax(1), reduction="none", log_target=True).sum(1).mean()
    assert kl_divergence(s, t).item() == pytest.approx(ref.item(), rel=1e-6)
    assert kl_divergence(s, s.detach()).item() == pytest.approx(0.0, abs=1e-6)
    h = -(ps * ps.log()).sum(1)
    assert entropy(s).item() == pytest.approx(h.mean().item(), rel=1e-6)
    assert normalized_entropy4(s).item() == pytest.approx((((h / math.log(5)) ** 2 + 1e-8) ** 2).mean().item(), rel=1e-6)
    uniform = torch.zeros(1, 5, 2, 2)
    assert entropy(uniform).item() == pytest.approx(math.log(5))
    # the teacher is a target: no gradient reaches it
    t.requires_grad_(True)
    (soft_target_ce(s, t) + kl_divergence(s, t)).backward()
    assert t.grad is None and s.grad is not None


# -------------------------------------------------------------------------------------------- teacher


@SETTINGS
@given(every=st.integers(1, 4), starts=st.integers(0, 6), rounds=st.integers(1, 25), seed=st.integers(0, 1000))
def test_swa_teacher_is_the_mean_of_the_models_since_the_start(every: int, starts: int, rounds: int, seed: int) -> None:
    """Eq. 5.22 unrolled, the teacher starting as the pre-trained model (the model of round 0, Alg. 10): after
    round t it is the model of the last update round before t_START, or from t_START on the plain mean of the
    models at the update rounds t_START, t_START + omega, ..., <= t."""
    start = starts * every
    g = torch.Generator().manual_seed(seed)
    models = {t: {"w": torch.randn(3, generator=g, dtype=torch.float64), "n": torch.tensor(t)} for t in range(rounds + 1)}
    teacher = models[0]
    for t in range(1, rounds + 1):
        new = swa_update(teacher, models[t], t, every, start)
        if new is not None:
            teacher = new
    updates = [t for t in range(rounds + 1) if t % every == 0]  # round 0: the pre-trained model
    averaged = [t for t in updates if t >= start]
    if averaged:
        want = torch.stack([models[t]["w"] for t in averaged]).mean(0)
        assert torch.allclose(teacher["w"], want) and int(teacher["n"]) == averaged[-1]
    else:
        assert torch.equal(teacher["w"], models[updates[-1]]["w"])
    with pytest.raises(ValueError, match="multiple of every"):
        swa_update(teacher, teacher, 6, 4, 2)


# ------------------------------------------------------------------------- eq. 5.19 / 5.21 as written


@pytest.mark.parametrize("threshold, fraction", [(0.6, 0.0), (0.0, 0.5), (0.7, 0.4)])
def test_eq_5_19_and_5_21_as_the_thesis_writes_them(threshold: float, fraction: float) -> None:
    """``pseudo = "own_ce_kl"``: CE to the student's own thresholded labels + KL(student || teacher) (eq. 5.19);
    with the Shannon entropy at weight 1 and eq. 5.20's KL to theta^0 the loss is eq. 5.21. Checked against a
    hand computation (numpy pseudo-labels, torch's kl_div, which computes KL(target || input)). The default
    stays the authors' CE to the teacher's labels."""
    from fedsight.recipe.ladd_adapt import SelfTraining, SelfTrainingParams

    torch.manual_seed(3)
    s = (2 * torch.randn(2, 5, 6, 7)).requires_grad_(True)
    t, ref = 2 * torch.randn(2, 5, 6, 7), torch.randn(2, 5, 6, 7)
    targets = torch.zeros(2, 6, 7, dtype=torch.long)
    common = {"threshold": threshold, "fraction": fraction, "reduction": "all"}
    thesis = SelfTraining(SelfTrainingParams(pseudo="own_ce_kl", entropy="shannon", entropy_lambda=1.0,
                                             kd_form="kl", kd_lambda=3.0, **common))
    got = thesis.term(s, targets, {"teacher": t, "ref": ref})
    own = torch.from_numpy(reference_pseudo_labels(s.detach().numpy(), threshold, fraction))
    ce = F.cross_entropy(s, own, ignore_index=IGNORE, reduction="sum") / own.numel()
    kl = lambda a, b: F.kl_div(b.log_softmax(1), a.log_softmax(1), reduction="none", log_target=True).sum(1).mean()  # noqa: E731
    ps = s.softmax(1)
    want = -(ps * ps.log()).sum(1).mean() + ce + kl(s, t) + 3.0 * kl(s, ref)
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    t.requires_grad_(True)
    thesis.term(s, targets, {"teacher": t, "ref": ref}).backward()
    assert t.grad is None and s.grad is not None  # the teacher is a target
    # the default (the authors' code): one CE to the teacher's thresholded labels, nothing else
    code = SelfTraining(SelfTrainingParams(**common))
    labels = torch.from_numpy(reference_pseudo_labels(t.detach().numpy(), threshold, fraction))
    want_code = F.cross_entropy(s, labels, ignore_index=IGNORE, reduction="sum") / labels.numel()
    assert code.term(s, targets, {"labels": labels}).item() == pytest.approx(want_code.item(), rel=1e-5)


def test_eq_5_19_needs_the_swa_teacher() -> None:
    from fedsight.recipe.ladd_adapt import SelfTraining, SelfTrainingParams

    with pytest.raises(ValueError, match="own_ce_kl.*needs teacher = 'swa'"):
        SelfTraining(SelfTrainingParams(pseudo="own_ce_kl", teacher="model"))


# ----------------------------------------------------------------------- clustering accuracy (Table 5.19)


def test_clustering_accuracy_of_the_thesis_table_5_19_and_hand_cases() -> None:
    from fedsight.functional.clustering import clustering_accuracy, contingency

    table = np.array([[76, 22, 17, 6], [7, 70, 38, 1], [26, 10, 73, 8], [6, 0, 9, 103]])  # Rome, Rio, Tokyo, Taipei
    acc = clustering_accuracy(table)
    assert acc["majority"] == pytest.approx(322 / 472) and acc["matching"] == pytest.approx(322 / 472)  # 68.2%
    # two clusters whose majority is the same domain: majority counts both, one-to-one matching only one
    truth, clusters = np.array([0, 0, 0, 0, 1, 1]), np.array([0, 0, 1, 1, 1, 1])
    t = contingency(truth, clusters)
    assert t.tolist() == [[2, 2], [0, 2]]
    assert clustering_accuracy(t) == {"majority": pytest.approx(4 / 6), "matching": pytest.approx(4 / 6)}
    truth, clusters = np.array([0, 0, 1, 1, 2, 2]), np.array([0, 0, 0, 1, 1, 1])
    acc = clustering_accuracy(contingency(truth, clusters))
    assert acc["majority"] == pytest.approx(4 / 6) and acc["matching"] == pytest.approx(4 / 6)
    truth, clusters = np.array([0, 0, 0, 1, 1, 1]), np.array([0, 1, 0, 1, 0, 1])
    acc = clustering_accuracy(contingency(truth, clusters))  # the majority: 2 + 2; one-to-one: 2 + 2
    assert acc == {"majority": pytest.approx(4 / 6), "matching": pytest.approx(4 / 6)}
    truth, clusters = np.array([0, 0, 1, 1]), np.array([0, 0, 0, 0])  # one cluster for two domains
    assert clustering_accuracy(contingency(truth, clusters)) == {"majority": 0.5, "matching": 0.5}
    truth, clusters = np.array([0, 1, 2, 2]), np.array([0, 0, 1, 1])
    assert clustering_accuracy(contingency(truth, clusters))["majority"] == pytest.approx(3 / 4)
    with pytest.raises(ValueError, match="one length"):
        contingency(np.array([0, 1]), np.array([0]))


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(2, 40), d=st.integers(1, 5), k=st.integers(1, 5))
def test_clustering_accuracy_against_sklearn_and_a_brute_force_matching(seed, n, d, k) -> None:
    """Perfect one-to-one accuracy exactly when scikit-learn's adjusted Rand index is 1 (same partition up to
    renaming, with as many clusters as domains); the matching equals a brute force over every injective pairing;
    neither depends on the clusters' names; matching <= majority."""
    import itertools

    from sklearn.metrics import adjusted_rand_score

    from fedsight.functional.clustering import clustering_accuracy, contingency

    rng = np.random.default_rng(seed)
    truth, clusters = rng.integers(0, d, n), rng.integers(0, k, n)
    if rng.random() < 0.3:  # sometimes a renamed copy of the truth
        clusters = rng.permutation(max(d, k))[truth]
    table = contingency(truth, clusters)
    acc = clustering_accuracy(table)
    rows, cols = table.shape
    best = 0
    for perm in itertools.permutations(range(max(rows, cols)), min(rows, cols)):
        pairs = zip(range(rows), perm) if rows <= cols else zip(perm, range(cols))
        best = max(best, sum(int(table[i, j]) for i, j in pairs))
    assert acc["matching"] == pytest.approx(best / n)
    assert acc["matching"] <= acc["majority"] + 1e-12
    same = len(np.unique(truth)) == len(np.unique(clusters)) and adjusted_rand_score(truth, clusters) == pytest.approx(1.0)
    assert (acc["matching"] == pytest.approx(1.0)) == same
    renamed = rng.permutation(table.shape[1])
    assert clustering_accuracy(table[:, renamed]) == pytest.approx(acc)
