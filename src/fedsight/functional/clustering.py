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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Clustering", "assign", "cluster_styles", "intra_cluster_distances"]


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
