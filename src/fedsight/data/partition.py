"""Partitioners: how a training pool is dealt out to federated clients, plus local train/test splits and
partition statistics (the heat map is ``fedsight.reporting.plot_partition_heatmap``).

Every partitioner is registered in :data:`fedsight.registry.PARTITIONERS` as
``factory(params, *, labels, num_clients, rng) -> list[np.ndarray]`` and returns one sorted int64 index
array per client such that every sample index ``0..N-1`` belongs to exactly one client. All randomness
comes from ``rng``; :func:`make_client_splits` derives it from the run seed, so a partition is a
deterministic function of (labels, partitioner spec, seed).

``labels`` are the pool's partition keys (class labels, or a segmentation image's domain). A partitioner
that needs more per-example information declares it in its registry entry (``needs``: names of
``attributes`` arrays the task passes, e.g. ``class_presence`` [N, C] for the class-imbalance split,
``client_of`` [N] for a dataset's predefined split) and receives them as keyword arguments.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, Sequence

import numpy as np
from pydantic import Field

from fedsight.registry import PARTITIONERS, NoParams, Params, build
from fedsight.rng import np_rng

__all__ = [
    "ClientSplit",
    "ClientSplits",
    "make_client_splits",
    "partition",
    "check_partition",
]


# --------------------------------------------------------------------------------------------- helpers


def _check_inputs(labels: np.ndarray, num_clients: int, what: str) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"{what}: labels must be a 1-D array, got shape {labels.shape}")
    if labels.dtype.kind not in "iub":
        raise ValueError(f"{what}: labels must be integers, got dtype {labels.dtype}")
    if num_clients < 1:
        raise ValueError(f"{what}: num_clients must be >= 1, got {num_clients}")
    if num_clients > len(labels):
        raise ValueError(f"{what}: num_clients={num_clients} exceeds the number of samples ({len(labels)})")
    return labels


def _finish(parts: Sequence[Sequence[int] | np.ndarray]) -> list[np.ndarray]:
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def _split_by_sizes(idx: np.ndarray, sizes: np.ndarray) -> list[np.ndarray]:
    return np.split(idx, np.cumsum(sizes)[:-1])


def largest_remainder(shares: np.ndarray, total: int) -> np.ndarray:
    """Non-negative integers summing to ``total`` that are within 1 of ``shares / shares.sum() * total``."""
    shares = np.asarray(shares, dtype=np.float64)
    exact = shares / shares.sum() * total
    out = np.floor(exact).astype(np.int64)
    rest = total - int(out.sum())
    if rest > 0:
        order = np.argsort(-(exact - out), kind="stable")
        out[order[:rest]] += 1
    return out


def check_partition(parts: Sequence[np.ndarray], n: int, num_clients: int, what: str = "partition") -> None:
    """Raise ``ValueError`` unless ``parts`` has ``num_clients`` arrays covering ``0..n-1`` exactly once."""
    if len(parts) != num_clients:
        raise ValueError(f"{what}: returned {len(parts)} clients, expected {num_clients}")
    seen = np.zeros(n, dtype=np.int64)
    for p in parts:
        p = np.asarray(p)
        if p.size and (p.min() < 0 or p.max() >= n):
            raise ValueError(f"{what}: index out of range 0..{n - 1}")
        np.add.at(seen, p.astype(np.int64), 1)
    if not np.all(seen == 1):
        raise ValueError(
            f"{what}: {int(np.sum(seen == 0))} samples unassigned and {int(np.sum(seen > 1))} assigned more than once"
        )


# -------------------------------------------------------------------------------------------------- iid


@PARTITIONERS.register("iid", help="uniform random split into near-equal client sizes")
def iid(params: Params, *, labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle and cut into ``num_clients`` parts whose sizes differ by at most one."""
    labels = _check_inputs(labels, num_clients, "iid")
    return _finish(np.array_split(rng.permutation(len(labels)), num_clients))


@PARTITIONERS.register("stratified", help="each client an equal share (within one) of every label: of every domain for "
                       "segmentation (FedDrive's uniform distribution)")
def stratified(params: Params, *, labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """FedDrive's *uniform* distribution (thesis Sec. 5.2.1: "each client has access to the same number of images
    from all the domains"; its published IDDA uniform splits give each of 90 clients one image of 48 of the 90
    seen domains): every label's (domain's) indices are shuffled and dealt round-robin, the dealing position
    carried from one label to the next and started at a random client. So every client holds ``floor(n_l / K)``
    or ``ceil(n_l / K)`` samples of every label ``l`` and client sizes differ by at most one. ``iid`` equalises
    only the sizes: with few images per domain it leaves some clients without a domain another holds twice."""
    labels = _check_inputs(labels, num_clients, "stratified")
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    cursor = int(rng.integers(num_clients))
    for value in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == value))
        for j in range(num_clients):
            parts[(cursor + j) % num_clients].append(idx[j::num_clients])
        cursor = (cursor + len(idx)) % num_clients
    return _finish([np.concatenate(p) for p in parts])


# -------------------------------------------------------------------------------------------- dirichlet


class DirichletParams(Params):
    alpha: float = Field(gt=0, description="concentration; small = strong label skew, large = close to IID")
    min_size: int = Field(2, ge=0, description="every client must receive at least this many samples")
    max_tries: int = Field(1000, ge=1, description="redraws before giving up on min_size")
    balance: bool = Field(
        False,
        description="stop giving a class's samples to clients that already hold N/num_clients samples "
        "(the size-balancing tweak of the Yurochkin et al. code used by FL-bench/PFLlib)",
    )


@PARTITIONERS.register("dirichlet", params=DirichletParams, help="label skew: per-class Dirichlet(alpha) client shares")
def dirichlet(
    params: DirichletParams, *, labels: np.ndarray, num_clients: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Hsu et al. 2019: for each class c draw p_c ~ Dir(alpha * 1) over clients and deal out that class's samples
    in those proportions; redraw until every client holds at least ``min_size`` samples."""
    labels = _check_inputs(labels, num_clients, "dirichlet")
    n = len(labels)
    if params.min_size * num_clients > n:
        raise ValueError(
            f"dirichlet: min_size={params.min_size} x num_clients={num_clients} exceeds the {n} samples"
        )
    classes = np.unique(labels)
    by_class = [np.flatnonzero(labels == c) for c in classes]
    cap = n / num_clients
    for _ in range(params.max_tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        sizes = np.zeros(num_clients, dtype=np.int64)
        for idx_c in by_class:
            idx_c = rng.permutation(idx_c)
            p = rng.dirichlet(np.full(num_clients, params.alpha))
            if params.balance:
                p = p * (sizes < cap)
                p = p / p.sum()
            cuts = (np.cumsum(p) * len(idx_c)).astype(np.int64)[:-1]
            cuts = np.clip(cuts, 0, len(idx_c))
            for k, chunk in enumerate(np.split(idx_c, cuts)):
                parts[k].append(chunk)
                sizes[k] += len(chunk)
        if sizes.min() >= params.min_size:
            return _finish([np.concatenate(p) if p else [] for p in parts])
    raise ValueError(
        f"dirichlet: no draw in {params.max_tries} tries gave every one of {num_clients} clients at least "
        f"min_size={params.min_size} samples with alpha={params.alpha} ({n} samples, {len(classes)} classes); "
        "raise alpha, lower min_size or use fewer clients"
    )


# ----------------------------------------------------------------------------------------------- shards


class ShardsParams(Params):
    shards_per_client: int = Field(2, ge=1, description="label-sorted shards dealt to each client")


def _shards_per_class(class_sizes: np.ndarray, num_shards: int) -> np.ndarray:
    """Shards per class (each >= 1, <= class size, summing to num_shards) keeping shard sizes even
    (D'Hondt: repeatedly split the class whose shards are currently the largest)."""
    counts = np.ones(len(class_sizes), dtype=np.int64)
    heap = [(-size / 2.0, c) for c, size in enumerate(class_sizes) if size >= 2]
    heapq.heapify(heap)
    for _ in range(num_shards - len(class_sizes)):
        _, c = heapq.heappop(heap)
        counts[c] += 1
        if counts[c] < class_sizes[c]:
            heapq.heappush(heap, (-class_sizes[c] / (counts[c] + 1.0), c))
    return counts


@PARTITIONERS.register("shards", params=ShardsParams, help="McMahan et al. 2017 pathological non-IID label shards")
def shards(params: ShardsParams, *, labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Sort by label, cut into ``num_clients * shards_per_client`` shards, deal each client that many at random.

    When there are at least as many shards as classes, shards are cut inside class boundaries (each shard holds
    one class; shards per class proportional to class size), so a client holds at most ``shards_per_client``
    classes. Otherwise the label-sorted order is cut into equal shards as in McMahan et al.
    """
    labels = _check_inputs(labels, num_clients, "shards")
    n = len(labels)
    num_shards = num_clients * params.shards_per_client
    if num_shards > n:
        raise ValueError(
            f"shards: num_clients={num_clients} x shards_per_client={params.shards_per_client} = {num_shards} "
            f"shards exceed the {n} samples"
        )
    perm = rng.permutation(n)  # random order inside each class
    order = perm[np.argsort(labels[perm], kind="stable")]
    classes, class_sizes = np.unique(labels, return_counts=True)
    if num_shards >= len(classes):
        per_class = _shards_per_class(class_sizes, num_shards)
        shard_list: list[np.ndarray] = []
        for chunk, k in zip(_split_by_sizes(order, class_sizes), per_class):
            shard_list.extend(np.array_split(chunk, k))
    else:
        shard_list = np.array_split(order, num_shards)
    deal = rng.permutation(num_shards).reshape(num_clients, params.shards_per_client)
    return _finish([np.concatenate([shard_list[s] for s in row]) for row in deal])


# ---------------------------------------------------------------------------------------------- classes


class ClassesParams(Params):
    classes_per_client: int = Field(2, ge=1, description="distinct classes each client holds")


@PARTITIONERS.register("classes", params=ClassesParams, help="each client holds exactly classes_per_client classes")
def classes_per_client(
    params: ClassesParams, *, labels: np.ndarray, num_clients: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Client i takes classes ``perm[(i*k + j) mod K]``, j < k, for a random class permutation ``perm`` (so every
    class is held by floor or ceil of num_clients*k/K clients); a class's samples are split evenly, at random,
    among its holders."""
    labels = _check_inputs(labels, num_clients, "classes")
    k = params.classes_per_client
    classes = np.unique(labels)
    num_classes = len(classes)
    if k > num_classes:
        raise ValueError(f"classes: classes_per_client={k} exceeds the {num_classes} classes present")
    if num_clients * k < num_classes:
        raise ValueError(
            f"classes: num_clients={num_clients} x classes_per_client={k} < {num_classes} classes, so some samples "
            "would have no client; raise classes_per_client or num_clients"
        )
    perm = rng.permutation(num_classes)
    holders: list[list[int]] = [[] for _ in range(num_classes)]
    for i in range(num_clients):
        for j in range(k):
            holders[perm[(i * k + j) % num_classes]].append(i)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c_pos, c in enumerate(classes):
        idx_c = rng.permutation(np.flatnonzero(labels == c))
        owners = holders[c_pos]
        if len(idx_c) < len(owners):
            raise ValueError(
                f"classes: class {c} has {len(idx_c)} samples but must be shared by {len(owners)} clients"
            )
        for owner, chunk in zip(owners, np.array_split(idx_c, len(owners))):
            parts[owner].append(chunk)
    return _finish([np.concatenate(p) for p in parts])


# --------------------------------------------------------------------------------------------- quantity


class QuantityParams(Params):
    beta: float = Field(0.5, gt=0, description="Dirichlet concentration of client sizes; small = very unequal")
    min_size: int = Field(2, ge=0, description="every client receives at least this many samples")


@PARTITIONERS.register("quantity", params=QuantityParams, help="quantity skew: Dirichlet(beta) client sizes, IID labels")
def quantity(params: QuantityParams, *, labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Quantity skew with IID labels: draw q ~ Dir(beta * 1) over clients; client i gets
    ``min_size + q_i * (N - num_clients * min_size)`` samples (largest-remainder rounding), dealt at random.

    Reserving ``min_size`` per client up front (instead of redrawing until every client has enough, as
    NIID-Bench does) never fails, even for many clients and small ``beta``.
    """
    labels = _check_inputs(labels, num_clients, "quantity")
    n = len(labels)
    spare = n - params.min_size * num_clients
    if spare < 0:
        raise ValueError(f"quantity: min_size={params.min_size} x num_clients={num_clients} exceeds the {n} samples")
    for _ in range(100):
        q = rng.dirichlet(np.full(num_clients, params.beta))
        if np.isfinite(q).all() and q.sum() > 0:
            break
    else:  # pragma: no cover - numpy's Dirichlet sampler handles small concentrations
        raise ValueError(f"quantity: Dirichlet(beta={params.beta}) draws are not finite")
    sizes = params.min_size + largest_remainder(q, spare)
    return _finish(_split_by_sizes(rng.permutation(n), sizes))


class ClassImbalanceParams(Params):
    pass


@PARTITIONERS.register(
    "class_imbalance", params=ClassImbalanceParams, needs=("class_presence",),
    help="FedDrive's class-imbalance split (thesis Alg. 8): each client filled from the rarest remaining class",
)
def class_imbalance(
    params: ClassImbalanceParams, *, labels: np.ndarray, num_clients: int, rng: np.random.Generator,
    class_presence: np.ndarray,
) -> list[np.ndarray]:
    """Thesis Algorithm 8 (FedDrive v2): client k receives S_k images; while it has fewer, it takes
    ``min(S_k - n_k, |D^c*|)`` random images of the rarest class c* among the images not yet assigned,
    and those images leave every class pool. S_k are near-equal sizes (within one image of n / K; the
    thesis does not say how S is chosen).

    Fix (documented in the seed digest): the thesis computes c* once per client, before the loop; when
    D^c* empties before S_k is reached, the loop never ends. Here c* is recomputed inside the loop over
    the classes with images left, so every iteration assigns at least one image and the loop ends; images
    with no class at all (fully ignored label maps) are taken last, uniformly.
    """
    labels = _check_inputs(labels, num_clients, "class_imbalance")
    presence = np.asarray(class_presence, dtype=bool)
    n = len(labels)
    if presence.ndim != 2 or presence.shape[0] != n:
        raise ValueError(f"class_imbalance: class_presence must be [N={n}, C], got shape {presence.shape}")
    sizes = largest_remainder(np.ones(num_clients), n)
    free = np.ones(n, dtype=bool)
    parts: list[list[int]] = []
    for k in range(num_clients):
        mine: list[int] = []
        while len(mine) < sizes[k]:
            counts = presence[free].sum(0)
            present = np.flatnonzero(counts > 0)
            if len(present):
                c = int(present[np.argmin(counts[present])])  # the rarest class with images left (ties: lowest id)
                pool = np.flatnonzero(free & presence[:, c])
            else:
                pool = np.flatnonzero(free)
            take = rng.choice(pool, size=min(int(sizes[k]) - len(mine), len(pool)), replace=False)
            free[take] = False
            mine.extend(int(t) for t in take)
        parts.append(mine)
    return _finish(parts)


@PARTITIONERS.register(
    "predefined", params=NoParams, needs=("client_of",),
    help="the dataset's own client split (FedDrive's split files); partition.num_clients must match it",
)
def predefined(params: Params, *, labels: np.ndarray, num_clients: int, rng: np.random.Generator,
               client_of: np.ndarray) -> list[np.ndarray]:
    """Client k holds the images with ``client_of == k`` (as the dataset lists them)."""
    labels = _check_inputs(labels, num_clients, "predefined")
    client_of = np.asarray(client_of, dtype=np.int64)
    if client_of.shape != labels.shape or (len(client_of) and client_of.min() < 0):
        raise ValueError(f"predefined: client_of must be [N={len(labels)}] non-negative client ids, got shape {client_of.shape}")
    found = int(client_of.max()) + 1
    if found != num_clients:
        raise ValueError(f"predefined: the dataset's split has {found} clients but partition.num_clients = {num_clients}; "
                         f"set it to {found}")
    parts = [np.flatnonzero(client_of == k) for k in range(num_clients)]
    empty = [k for k, p in enumerate(parts) if len(p) == 0]
    if empty:
        raise ValueError(f"predefined: the dataset's split lists no images for client(s) {empty}")
    return parts


# ------------------------------------------------------------------------------------ client splits


@dataclass(frozen=True, eq=False)
class ClientSplit:
    """One client's data: sorted int64 indices into the training pool for local training and for the client's
    own held-out test set (compared by identity: fields are arrays)."""

    train: np.ndarray
    test: np.ndarray

    @property
    def all(self) -> np.ndarray:
        return np.sort(np.concatenate([self.train, self.test]))

    def __len__(self) -> int:
        return len(self.train) + len(self.test)


def partition(
    labels: np.ndarray,
    *,
    num_clients: int,
    partitioner: str,
    params: dict[str, Any] | Params | None = None,
    seed: int,
    attributes: Mapping[str, np.ndarray] | None = None,
) -> list[np.ndarray]:
    """Run a registered partitioner with the ``("partition",)`` stream of ``seed`` and check its output;
    ``attributes``: per-example arrays a partitioner may need (its entry's ``needs``)."""
    labels = np.asarray(labels)
    _check_inputs(labels, num_clients, partitioner)
    needs = PARTITIONERS.get(partitioner).meta.get("needs", ())
    missing = [n for n in needs if n not in (attributes or {})]
    if missing:
        raise ValueError(f"partitioner {partitioner!r} needs per-example {', '.join(missing)}, which this task's data "
                         "does not provide")
    extra = {n: np.asarray(attributes[n]) for n in needs}  # type: ignore[index]
    parts = build(PARTITIONERS, partitioner, params, labels=labels, num_clients=num_clients,
                  rng=np_rng(seed, "partition"), **extra)
    check_partition(parts, len(labels), num_clients, f"partitioner {partitioner!r}")
    return _finish(parts)


def _local_test_counts(local_labels: np.ndarray, fraction: float) -> tuple[list[np.ndarray], np.ndarray]:
    """Strata (positions into the client's array) and how many of each go to the local test set.

    Each class with >= 2 samples is a stratum; the samples of classes with a single sample form one pooled
    stratum (split at random). The total is round(fraction * n), at most n - 1; per stratum counts are within
    one of fraction * size and, where possible, leave at least one sample of each class for training.
    """
    n = len(local_labels)
    total = min(int(np.floor(fraction * n + 0.5)), n - 1)
    _, inverse, counts = np.unique(local_labels, return_inverse=True, return_counts=True)
    strata = [np.flatnonzero(inverse == i) for i in np.flatnonzero(counts >= 2)]
    singles = np.flatnonzero(counts[inverse] == 1)
    if len(singles):
        strata.append(singles)
    sizes = np.array([len(s) for s in strata], dtype=np.int64)
    caps = sizes - 1
    if len(singles):
        caps[-1] = sizes[-1]
    if total <= 0:
        return strata, np.zeros(len(strata), dtype=np.int64)
    exact = fraction * sizes
    take = np.minimum(np.floor(exact).astype(np.int64), caps)
    # hand out the rest one at a time by largest remainder, first within the caps, then (rarely) beyond them
    for limit in (caps, sizes):
        while take.sum() < total and np.any(take < limit):
            s = int(np.argmax(np.where(take < limit, exact - take, -np.inf)))
            take[s] += 1
    return strata, take


def partition_from_config(labels: np.ndarray, cfg: Any, attributes: Mapping[str, np.ndarray] | None = None) -> "ClientSplits":
    """``make_client_splits`` for a validated config's ``partition`` section and seed."""
    part = cfg.partition
    from ..config_sections import PARTITION_KEYS

    params = {k: v for k, v in part.model_dump().items() if k != "name" and k not in PARTITION_KEYS}
    if part.num_clients > len(labels):  # one line naming both keys and the data, not the partitioner's own check
        from ..errors import ConfigError

        data = cfg.data
        where = next((f"data.{k} = {str(getattr(data, k))!r}" for k in ("path", "root") if hasattr(data, k)),
                     f"data.name = {data.name!r}")
        raise ConfigError(f"partition.num_clients = {part.num_clients} exceeds the {len(labels)} samples of the "
                          f"training pool ({where}); every client needs at least one (partition.name = {part.name!r})")
    return make_client_splits(
        labels,
        num_clients=part.num_clients,
        partitioner=part.name,
        params=params,
        seed=cfg.seed,
        local_test_fraction=part.local_test_fraction,
        attributes=attributes,
    )


def make_client_splits(
    labels: np.ndarray,
    *,
    num_clients: int,
    partitioner: str,
    params: dict[str, Any] | Params | None = None,
    seed: int,
    local_test_fraction: float,
    attributes: Mapping[str, np.ndarray] | None = None,
) -> "ClientSplits":
    """Partition the training pool over clients, then split each client's samples into local train and test.

    The partition uses stream ``np_rng(seed, "partition")``; client ``i``'s local split uses
    ``np_rng(seed, "local-test", i)`` and is stratified by label (classes with a single sample on the client
    are pooled and split at random). Every client keeps at least one training sample.
    """
    if not 0.0 <= local_test_fraction < 1.0:
        raise ValueError(f"local_test_fraction must be in [0, 1), got {local_test_fraction}")
    labels = np.asarray(labels)
    parts = partition(labels, num_clients=num_clients, partitioner=partitioner, params=params, seed=seed,
                      attributes=attributes)
    trains, tests = [], []
    for cid, idx in enumerate(parts):
        if len(idx) == 0:
            raise ValueError(f"partitioner {partitioner!r} gave client {cid} no samples")
        if local_test_fraction == 0.0:
            trains.append(idx)
            continue
        rng = np_rng(seed, "local-test", cid)
        strata, take = _local_test_counts(labels[idx], local_test_fraction)
        test_pos: list[np.ndarray] = []
        for stratum, t in zip(strata, take):
            if t > 0:
                test_pos.append(rng.choice(stratum, size=int(t), replace=False))
        is_test = np.zeros(len(idx), dtype=bool)
        if test_pos:
            is_test[np.concatenate(test_pos)] = True
        trains.append(idx[~is_test])
        tests.append(idx[is_test])
    return ClientSplits.pack(trains, tests or [np.zeros(0, dtype=np.int64)] * len(trains))


class ClientSplits(Sequence[ClientSplit]):
    """Every client's ``ClientSplit``, stored compactly: the clients' training positions back to back in one array
    (client c's at ``train[train_offsets[c]:train_offsets[c + 1]]``), the local test positions likewise. Two arrays
    whatever the number of clients (100,000 clients cost a few MB, not a Python object and two arrays each);
    ``splits[c]`` is a ``ClientSplit`` of views."""

    def __init__(self, train: np.ndarray, train_offsets: np.ndarray, test: np.ndarray, test_offsets: np.ndarray):
        self.train, self.train_offsets = np.asarray(train, dtype=np.int64), np.asarray(train_offsets, dtype=np.int64)
        self.test, self.test_offsets = np.asarray(test, dtype=np.int64), np.asarray(test_offsets, dtype=np.int64)

    @classmethod
    def pack(cls, trains: Sequence[np.ndarray], tests: Sequence[np.ndarray]) -> "ClientSplits":
        """From each client's training and local test positions."""
        def packed(parts: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
            sizes = np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts))
            flat = np.concatenate(parts).astype(np.int64, copy=False) if len(parts) else np.zeros(0, dtype=np.int64)
            return flat, np.concatenate([[0], np.cumsum(sizes)])
        return cls(*packed(trains), *packed(tests))

    def __len__(self) -> int:
        return len(self.train_offsets) - 1

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"client {i} of {n}")
        i %= n
        return ClientSplit(train=self.train[self.train_offsets[i]:self.train_offsets[i + 1]],
                           test=self.test[self.test_offsets[i]:self.test_offsets[i + 1]])

    def train_sizes(self) -> np.ndarray:
        return np.diff(self.train_offsets)

    def test_sizes(self) -> np.ndarray:
        return np.diff(self.test_offsets)
