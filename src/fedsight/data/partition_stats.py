"""Statistics of a partition: the clients x classes counts and the summary ``fedsight partition`` prints (client
sizes, classes a client holds, label entropy, the thesis's mean Jaccard index of eq. 3.27)."""

from __future__ import annotations

from typing import Literal, Sequence

import numpy as np

from .partition import ClientSplit

def partition_counts(
    labels: np.ndarray,
    splits: Sequence[ClientSplit] | Sequence[np.ndarray],
    num_classes: int,
    which: Literal["all", "train", "test"] = "all",
) -> np.ndarray:
    """``[clients, classes]`` int64 sample counts. For :class:`ClientSplit` items ``which`` picks the local
    train set, the local test set or both (default); plain index arrays are counted as they are."""
    labels = np.asarray(labels)
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"labels must lie in 0..{num_classes - 1}")
    out = np.zeros((len(splits), num_classes), dtype=np.int64)
    for i, s in enumerate(splits):
        if isinstance(s, ClientSplit):
            idx = {"all": s.all, "train": s.train, "test": s.test}[which]
        else:
            idx = np.asarray(s, dtype=np.int64)
        out[i] = np.bincount(labels[idx], minlength=num_classes)
    return out


def _entropy(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def mean_jaccard(counts: np.ndarray) -> float:
    """The thesis's mean Jaccard index of the clients' class sets (eq. 3.27, its Fig. 3.2 heterogeneity measure):
    ``J = 1/K^2 sum_k sum_h |C_k & C_h| / |C_k | C_h|`` over the K clients holding at least one sample (the sum
    includes k = h, each term 1, as the equation writes it; an empty client has no class set to compare). 1 when
    every client holds the same classes; 1/K when each class sits at exactly one client (Dirichlet alpha = 0)."""
    held = (np.asarray(counts) > 0)[np.asarray(counts).sum(axis=1) > 0].astype(np.int64)
    if len(held) == 0:
        return 0.0
    inter = held @ held.T
    sizes = held.sum(axis=1)
    union = sizes[:, None] + sizes[None, :] - inter
    return float((inter / union).sum() / len(held) ** 2)


def partition_summary(counts: np.ndarray) -> dict[str, float]:
    """Client sizes (min / median / max / mean), mean number of classes held per client, the mean Jaccard index
    of the clients' class sets (``mean_jaccard``, thesis eq. 3.27), and the mean per-client label entropy in nats
    next to the entropy of the pooled label distribution (entropies use clients with at least one sample)."""
    counts = np.asarray(counts)
    if counts.ndim != 2 or counts.shape[0] == 0:
        raise ValueError(f"counts must be a [clients, classes] matrix, got shape {counts.shape}")
    sizes = counts.sum(axis=1)
    nonempty = sizes > 0
    entropies = [_entropy(row / row.sum()) for row in counts[nonempty]]
    total = counts.sum()
    return {
        "num_clients": int(counts.shape[0]),
        "num_classes": int(counts.shape[1]),
        "total": int(total),
        "min_size": int(sizes.min()),
        "median_size": float(np.median(sizes)),
        "max_size": int(sizes.max()),
        "mean_size": float(sizes.mean()),
        "mean_classes_per_client": float((counts > 0).sum(axis=1).mean()),
        "mean_jaccard": mean_jaccard(counts),
        "mean_label_entropy": float(np.mean(entropies)) if entropies else 0.0,
        "global_label_entropy": _entropy(counts.sum(axis=0) / total) if total else 0.0,
    }
