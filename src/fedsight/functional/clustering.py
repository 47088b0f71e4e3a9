"""Style-based client clustering (LADD, thesis Sec. 5.3.4, Algorithm 9) with scikit-learn.

Every client's style is a vector (its mean low-frequency amplitude window, flattened). For every candidate
number of clusters ``o`` and every seed ``r`` of ``seeds``, Lloyd's k-means (scikit-learn ``KMeans``, one
initialisation per seed) partitions the styles; of the seeds' partitions the one with the smallest total
intra-cluster distance ``sum_k delta_k`` wins (Alg. 9: ``delta_k`` = mean L2 distance of client k to the other
members of its cluster; the thesis writes the argmin over ``{m..n-1}``, a typo for the seeds). The number of
clusters is the one whose winning partition has the largest mean silhouette (scikit-learn's
``silhouette_samples``: ``(Delta_k - delta_k) / max(Delta_k, delta_k)``, 0 for a client alone in its
cluster, the definition Alg. 9 writes out). Ties go to the smaller ``o`` and the earlier seed.

Silhouettes need 2 <= o <= K - 1; a candidate outside that range is skipped, and with fewer than 3 clients
there is one cluster. Centroids are the members' mean styles (eq. 5.23); a new style (a test image's) goes to
the nearest centroid in L2 (``assign``), as the authors' code does with ``KMeans.predict``.

``clustering_accuracy`` scores a partition against the clients' true domains (thesis Sec. 5.3.14, Table 5.19
and Fig. 5.10: the cities of CrossCity): ``majority`` labels every cluster with its most frequent domain (the
thesis's "cluster labelled by its majority city", 68% on CrossCity), ``matching`` pairs clusters and domains
one to one to maximise the agreeing clients (scipy's ``linear_sum_assignment`` on the contingency table), so two
clusters cannot both claim one domain. ``matching <= majority`` always; they agree on Table 5.19.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Clustering", "assign", "cluster_styles", "clustering_accuracy", "contingency", "intra_cluster_distances"]


@dataclass(frozen=True)
class Clustering:
    """The chosen partition: ``labels`` [K] in ``0..k-1``, ``centroids`` [k, D], and for every candidate
    number of clusters tried, its winning seed and mean silhouette (``scores``: {o: (seed, silhouette)})."""

    labels: np.ndarray
    centroids: np.ndarray
    scores: dict[int, tuple[int, float]] = field(default_factory=dict)

    @property
    def k(self) -> int:
        return len(self.centroids)

    def members(self, cluster: int) -> np.ndarray:
        return np.flatnonzero(self.labels == cluster)


def intra_cluster_distances(styles: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """``delta_k`` of Alg. 9: the mean L2 distance of every client to the other members of its cluster (0 for a
    client alone in its cluster)."""
    d = np.sqrt(((styles[:, None, :] - styles[None, :, :]) ** 2).sum(-1))
    same = labels[:, None] == labels[None, :]
    np.fill_diagonal(same, False)
    n = same.sum(1)
    return np.where(n > 0, (d * same).sum(1) / np.maximum(n, 1), 0.0)


def _centroids(styles: np.ndarray, labels: np.ndarray, k: int) -> np.ndarray:
    return np.stack([styles[labels == c].mean(0) for c in range(k)])


def cluster_styles(styles: np.ndarray, ks: Sequence[int], seeds: Sequence[int]) -> Clustering:
    """Algorithm 9 over ``styles`` [K, D] for the candidate cluster numbers ``ks`` and k-means ``seeds``."""
    from sklearn.cluster import KMeans
    from sklearn.metrics import silhouette_samples

    styles = np.asarray(styles, dtype=np.float64)
    n = len(styles)
    if n == 0:
        raise ValueError("cluster_styles: no style to cluster")
    styles = styles.reshape(n, -1)
    if not seeds:
        raise ValueError("cluster_styles: seeds must name at least one k-means seed")
    candidates = sorted({int(o) for o in ks if 2 <= int(o) <= n - 1})
    if not candidates:
        labels = np.zeros(n, dtype=np.int64)
        return Clustering(labels, _centroids(styles, labels, 1), {})
    scores: dict[int, tuple[int, float]] = {}
    best: tuple[float, int, np.ndarray] | None = None
    for o in candidates:
        winner: tuple[float, int, np.ndarray] | None = None
        for r in seeds:
            labels = KMeans(n_clusters=o, n_init=1, random_state=int(r), algorithm="lloyd").fit_predict(styles)
            total = float(intra_cluster_distances(styles, labels).sum())
            if winner is None or total < winner[0]:
                winner = (total, int(r), labels)
        _, seed, labels = winner  # type: ignore[misc]
        if len(np.unique(labels)) < 2:  # identical styles: k-means found one cluster
            sil = 0.0
        else:
            sil = float(silhouette_samples(styles, labels).mean())
        scores[o] = (seed, sil)
        if best is None or sil > best[0]:
            best = (sil, o, labels)
    _, o, labels = best  # type: ignore[misc]
    # renumber clusters in order of first appearance, so equal partitions give equal labels
    _, first = np.unique(labels, return_index=True)
    order = np.argsort(first)
    remap = np.empty(labels.max() + 1, dtype=np.int64)
    remap[np.unique(labels)[order]] = np.arange(len(order))
    labels = remap[labels]
    return Clustering(labels, _centroids(styles, labels, int(labels.max()) + 1), scores)


def assign(styles: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """The nearest centroid (L2) of every style [N, D] (ties: the lower cluster id)."""
    styles = np.asarray(styles, dtype=np.float64).reshape(len(styles), -1)
    d = ((styles[:, None, :] - np.asarray(centroids, dtype=np.float64)[None]) ** 2).sum(-1)
    return d.argmin(1).astype(np.int64)


def contingency(truth: np.ndarray, clusters: np.ndarray, n_truth: int | None = None, n_clusters: int | None = None
                ) -> np.ndarray:
    """``[domains, clusters]`` int64: how many clients of each true domain fell in each cluster (Table 5.19)."""
    truth, clusters = np.asarray(truth, dtype=np.int64), np.asarray(clusters, dtype=np.int64)
    if truth.shape != clusters.shape or truth.ndim != 1:
        raise ValueError(f"truth {truth.shape} and clusters {clusters.shape} must be two vectors of one length")
    if len(truth) and (truth.min() < 0 or clusters.min() < 0):
        raise ValueError("domain and cluster ids must be >= 0")
    d = max(n_truth or 0, int(truth.max()) + 1 if len(truth) else 0)
    k = max(n_clusters or 0, int(clusters.max()) + 1 if len(clusters) else 0)
    table = np.zeros((d, k), dtype=np.int64)
    np.add.at(table, (truth, clusters), 1)
    return table


def clustering_accuracy(table: np.ndarray) -> dict[str, float]:
    """The accuracies of a contingency table (``contingency``): ``majority`` (each cluster takes its most
    frequent domain) and ``matching`` (a one-to-one pairing of clusters and domains, the best by scipy's
    Hungarian solver); fractions of all clients, NaN with none."""
    from scipy.optimize import linear_sum_assignment

    table = np.asarray(table, dtype=np.int64)
    n = int(table.sum())
    if n == 0:
        return {"majority": float("nan"), "matching": float("nan")}
    rows, cols = linear_sum_assignment(table, maximize=True)
    return {"majority": float(table.max(0).sum()) / n, "matching": float(table[rows, cols].sum()) / n}
