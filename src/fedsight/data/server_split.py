"""Server-held splits: data carved out of the training pool before it is dealt to clients.

Two config sections hold data on the server that no client ever sees, for every task:

* ``[validation]``: a validation set V (FedVG scores client updates on it, seed digest
  ``notes/003_fedvg.md`` §1, §3.4), served as the evaluation split ``"val"``;
* ``[pretrain]`` (``fedsight.pretrain``): the server's pre-training split P (Fed3R's frozen extractor),
  served as ``"pretrain"``.

One mechanism carves both (``carve_server_splits``): it works on the pool's *partition keys* (class
labels for classification, clip categories for video, the domain of a street scene), so a stratified
carve keeps every key's share, whatever the task. V is carved first (stream ``np_rng(seed,
"validation")``), then P from what is left (``np_rng(seed, "pretrain")``); the rest is partitioned.

How many examples a stratified carve takes (``carve``):

* ``rounding = "total"`` (V): ``round(fraction * N)`` examples in all (at least 1, at most N - 1), each
  key getting its largest-remainder share (within one of ``fraction * n_c``);
* ``rounding = "per_key"`` (P): ``floor(fraction * n_c + 1/2)`` of each key c (only the listed keys with
  ``only``), and every key must keep at least one example for the clients.

Within a key, examples are drawn uniformly without replacement, keys in increasing order. Unstratified,
V is a uniform random subset of the pool.

More on V (``[validation]``):

* ``source = "carve"``: V is cut out of the training pool as above. This is the FedVG paper's main
  setup ("we allocate 10% of the dataset for V ... the remaining data is distributed across the
  clients"; the authors' code instead pools a 10% slice of every client's shard, which gives V the same
  pooled label distribution as a stratified carve).
* ``source = "dataset"``: V is a split (``split``, default its training split) of another registered
  dataset of the same task (the paper's "public" V, §5.3: STL-10 or CIFAR-100 for CIFAR-10). The task
  builder loads it (classification matches labels by class name).
* ``class_map`` (classification, ``source = "dataset"``): the paper's public V's name other classes than the
  training set's (§5.3, App. A.5): STL-10's "car" is CIFAR-10's "automobile"; CIFAR-100's bus and motorcycle
  stand for automobile, leopard, lion and tiger for cat, wolf and fox for dog. ``class_map`` maps V's class
  names onto training class names (many to one); a class neither mapped nor named as a training class is an
  error, or left out with ``unmapped = "drop"`` (STL-10's monkey, CIFAR-100's other 93 classes).
  ``duplicates_per_class = n`` reproduces the authors' two-step sampler (seed digest §A.5 [code]): it first
  draws n random images of each (mapped) class, then takes the whole pool, so those n appear twice; with
  n = 50 it gives the paper's counts (STL-10: 9 x 550 = 4,950; CIFAR-100: 3,650, e.g. bus 531 and motorcycle
  519 of automobile's 1,050). The draw is ``np_rng(seed, "validation-duplicates")``. Default 0: no duplicates.
* ``imbalance = rho`` (class labels only): a deliberately class-imbalanced V for the paper's
  imbalanced-V experiment (§5.4, App. A.7.1, E.8-E.9). From the V built as above,
  ``floor(imbalance_size * |V|)`` examples (the paper: half) are drawn with class proportions

      ``profile = "power"``     (authors' code, E.8):   p_c proportional to rho^c,            c = 0..C-1
      ``profile = "endpoints"``:                        p_c proportional to rho^(c / (C - 1))

  normalised to sum to one (E.9); class c gets n_c = floor(p_c * size) examples, capped by what V has
  of that class. rho = 1 is balanced. The carved examples left out of the imbalanced V are discarded
  (they go neither to V nor to clients), so the clients' data is the same as in the balanced experiment.

Every split is a deterministic function of (dataset, section, seed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import AfterValidator, Field, ValidationError, field_validator, model_validator

from ..errors import ConfigError
from ..registry import DATASETS, Params, off_but_set
from ..rng import check_seed, np_rng
from .partition import largest_remainder


class ValidationSection(Params):
    """``[validation]``: the server-held validation set V (see the module docstring)."""

    source: Literal["none", "carve", "dataset"] = Field(
        "none", description="none; carve: cut V out of the training pool; dataset: another dataset's split"
    )
    fraction: float = Field(0.1, gt=0, lt=1, description="carve: share of the training pool that becomes V")
    stratified: bool = Field(True, description="carve: keep every partition key's (class's) share of V equal to fraction")
    imbalance: float | None = Field(
        None, gt=0, le=1, description="rho in (0, 1]: class-imbalanced V (1 = balanced); see profile"
    )
    imbalance_profile: Literal["power", "endpoints"] = Field(
        "power", description="power: p_c ~ rho^c (authors' code); endpoints: p_c ~ rho^(c/(C-1))"
    )
    imbalance_size: float = Field(0.5, gt=0, le=1, description="imbalanced V keeps this share of |V| (paper: 1/2)")
    dataset: dict[str, Any] | None = Field(
        None, description='dataset: a dataset spec, e.g. {name = "npz", path = "other.npz"}'
    )
    split: Literal["train", "test"] = Field("train", description="dataset: which split of it becomes V")
    class_map: dict[str, str] | None = Field(
        None, description='dataset: its class names onto the training classes, e.g. {bus = "automobile"}')
    unmapped: Literal["error", "drop"] = Field(
        "error", description="dataset: its classes neither mapped nor named as a training class: error or drop")
    duplicates_per_class: int = Field(
        0, ge=0, description="dataset: draw this many of each class's images again (FedVG's code: 50)")
    seed: Annotated[int, AfterValidator(check_seed)] | None = Field(
        None, ge=0, description="seed of the carve / imbalance draw (default: the run seed)")

    @field_validator("dataset", mode="before")
    @classmethod
    def _dataset_spec(cls, value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, str):
            value = {"name": value}
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            raise ValueError('expected a dataset table with a name, e.g. {name = "npz", path = "v.npz"}')
        name = value["name"]
        if name not in DATASETS:
            raise ValueError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASETS.names())}")
        entry = DATASETS.get(name)
        try:
            params = entry.params(**{k: v for k, v in value.items() if k != "name"})
        except ValidationError as exc:
            errs = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
            allowed = ", ".join(entry.params.model_fields)
            raise ValueError(f"dataset {name!r}: {errs} (allowed: {allowed})") from None
        return {"name": name, **params.model_dump()}

    @model_validator(mode="after")
    def _consistent(self) -> "ValidationSection":
        if self.source == "none":
            off_but_set(self, "validation", "no validation set")
        if self.source == "dataset" and self.dataset is None:
            raise ValueError('validation.source = "dataset" needs validation.dataset (a dataset table)')
        if self.source != "dataset" and self.dataset is not None:
            raise ValueError(f'validation.dataset is set but validation.source = "{self.source}"; use source = "dataset"')
        if self.source != "dataset":
            for key in ("class_map", "unmapped", "duplicates_per_class"):
                if getattr(self, key) != type(self).model_fields[key].default:
                    raise ValueError(f'validation.{key} applies to source = "dataset" only, not "{self.source}"')
        return self


# -- index math -------------------------------------------------------------------------------------


def carve(
    keys: np.ndarray,
    fraction: float,
    rng: np.random.Generator,
    *,
    stratified: bool = True,
    rounding: Literal["total", "per_key"] = "total",
    only: list[int] | None = None,
    what: str = "server split",
) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (held, rest) index arrays of a pool with partition ``keys`` (see the module docstring)."""
    keys = np.asarray(keys, dtype=np.int64)
    n = len(keys)
    if stratified:
        classes, counts = np.unique(keys, return_counts=True)
        if only is not None:
            counts = np.where(np.isin(classes, only), counts, 0)
        if rounding == "total":
            size = min(max(int(np.floor(fraction * int(counts.sum()) + 0.5)), 1), n - 1)
            if size < 1:
                raise ValueError(f"{what}: cannot carve a server-held set out of {n} example(s)")
            take = largest_remainder(counts, size) if counts.sum() else np.zeros_like(counts)
        else:
            take = np.floor(fraction * counts + 0.5).astype(np.int64)
            starved = [int(c) for c, t, m in zip(classes, take, counts) if m > 0 and t >= m]
            if starved:
                raise ValueError(
                    f"{what}.fraction = {fraction} gives the server all {int(counts[classes == starved[0]][0])} pool "
                    f"example(s) of class {starved[0]}{' and classes ' + str(starved[1:]) if len(starved) > 1 else ''}, "
                    f"leaving the clients none; lower {what}.fraction (every class keeps at least one example for the clients)"
                )
        picked = [rng.choice(np.flatnonzero(keys == c), size=int(t), replace=False) for c, t in zip(classes, take) if t > 0]
        if not picked:
            raise ValueError(f"{what}: the server's split is empty ({what}.fraction = {fraction}); raise {what}.fraction")
        held = np.concatenate(picked)
    else:
        size = min(max(int(np.floor(fraction * n + 0.5)), 1), n - 1)
        if size < 1:
            raise ValueError(f"{what}: cannot carve a server-held set out of {n} example(s)")
        held = rng.choice(n, size=size, replace=False)
    held = np.sort(held.astype(np.int64))
    mask = np.ones(n, dtype=bool)
    mask[held] = False
    return held, np.flatnonzero(mask).astype(np.int64)


def imbalance_proportions(num_classes: int, rho: float, profile: str = "power") -> np.ndarray:
    """Class proportions of an imbalanced V (E.8-E.9): p_c proportional to rho^c ("power") or
    rho^(c/(C-1)) ("endpoints"), normalised to sum to one."""
    c = np.arange(num_classes, dtype=np.float64)
    if profile == "power":
        raw = rho**c
    elif profile == "endpoints":
        raw = rho ** (c / max(num_classes - 1, 1))
    else:
        raise ValueError(f"unknown imbalance profile {profile!r}")
    return raw / raw.sum()


def imbalance_counts(available: np.ndarray, rho: float, size: int, profile: str = "power") -> np.ndarray:
    """n_c = floor(p_c * size), capped by ``available[c]`` (the authors' sampler)."""
    p = imbalance_proportions(len(available), rho, profile)
    return np.minimum(np.floor(p * size).astype(np.int64), np.asarray(available, dtype=np.int64))


def imbalanced_subset(
    labels: np.ndarray, num_classes: int, rho: float, size: int, profile: str, rng: np.random.Generator
) -> np.ndarray:
    """Sorted positions into ``labels`` of an imbalanced subset with ``imbalance_counts`` per class."""
    labels = np.asarray(labels)
    available = np.bincount(labels, minlength=num_classes)
    take = imbalance_counts(available, rho, size, profile)
    picked = [rng.choice(np.flatnonzero(labels == c), size=int(t), replace=False) for c, t in enumerate(take) if t > 0]
    if not picked:
        raise ValueError(f"validation: the imbalanced validation set (rho={rho}, size={size}) is empty")
    return np.sort(np.concatenate(picked).astype(np.int64))


# -- both sections on one pool ----------------------------------------------------------------------


@dataclass
class ServerSplits:
    """Index arrays into the pool as loaded: what stays for the clients (``rest``) and each server-held
    split (``held["val"]``, ``held["pretrain"]``), with a summary of each for ``partition.json``."""

    rest: np.ndarray
    held: dict[str, np.ndarray] = field(default_factory=dict)
    summaries: dict[str, dict[str, Any]] = field(default_factory=dict)


def key_counts(keys: np.ndarray, num_keys: int) -> list[int]:
    return [int(c) for c in np.bincount(np.asarray(keys, dtype=np.int64), minlength=num_keys)]


def carve_server_splits(cfg: Any, keys: np.ndarray, num_keys: int, key_names: list[str]) -> ServerSplits:
    """V (``cfg.validation``, when it is carved) and P (``cfg.pretrain``) out of a pool with partition
    ``keys``; see the module docstring. A V from another dataset is the task builder's (it returns no
    ``held["val"]`` here) and so is its summary."""
    keys = np.asarray(keys, dtype=np.int64)
    rest = np.arange(len(keys), dtype=np.int64)
    out = ServerSplits(rest)
    v = cfg.validation
    if v.source == "carve":
        rng = np_rng(v.seed if v.seed is not None else cfg.seed, "validation")
        held, kept = carve(keys, v.fraction, rng, stratified=v.stratified, rounding="total", what="validation")
        if v.imbalance is not None:
            size = int(np.floor(v.imbalance_size * len(held)))
            held = held[imbalanced_subset(keys[held], num_keys, v.imbalance, size, v.imbalance_profile, rng)]
        out.held["val"], out.rest = held, rest[kept]
        out.summaries["validation"] = split_summary("carve", keys[held], num_keys, key_names, imbalance=v.imbalance)
    p = cfg.pretrain
    if p.source != "none":
        if p.classes is not None:
            bad = [c for c in p.classes if c >= num_keys]
            if bad:
                raise ConfigError(
                    f"pretrain.classes = {p.classes}: class {bad[0]} is out of range; the dataset has {num_keys} "
                    f"classes (indices 0..{num_keys - 1})"
                )
        held, kept = carve(keys[out.rest], p.fraction, np_rng(cfg.seed, "pretrain"), rounding="per_key", only=p.classes,
                           what="pretrain")
        out.held["pretrain"], out.rest = out.rest[held], out.rest[kept]
        out.summaries["pretrain"] = split_summary(p.source, keys[out.held["pretrain"]], num_keys, key_names,
                                                  fraction=p.fraction, classes=p.classes)
    return out


def split_summary(source: str, keys: np.ndarray, num_keys: int, key_names: list[str], **extra: Any) -> dict[str, Any]:
    """A server-held split's source, size and per-key histogram (``RUN_DIR/partition.json``)."""
    if len(keys) == 0:
        raise ValueError(f"the server-held split ({source}) is empty")
    return {"source": source, "size": int(len(keys)), "class_counts": key_counts(keys, num_keys),
            "class_names": list(key_names), **extra}


def validation_subset(v: ValidationSection, keys: np.ndarray, num_keys: int, seed: int) -> np.ndarray:
    """Positions kept of a V loaded from another dataset (all of them, or an imbalanced subset)."""
    keys = np.asarray(keys, dtype=np.int64)
    if v.imbalance is None:
        return np.arange(len(keys), dtype=np.int64)
    rng = np_rng(v.seed if v.seed is not None else seed, "validation")
    size = int(np.floor(v.imbalance_size * len(keys)))
    return imbalanced_subset(keys, num_keys, v.imbalance, size, v.imbalance_profile, rng)


def validation_dataset(cfg: Any, kind: type, what: str) -> Any:
    """The dataset ``cfg.validation.dataset`` names, built with the run's seed; one that is not a ``kind``
    (``what``: "a video dataset") is an error naming the key."""
    from ..registry import build

    v = cfg.validation
    for key in ("class_map", "unmapped", "duplicates_per_class"):
        if getattr(v, key) != type(v).model_fields[key].default:
            raise ValueError(f"validation.{key} applies to classification only (it maps and draws class labels)")
    spec = dict(v.dataset or {})
    name = spec.pop("name")
    other = build(DATASETS, name, spec, seed=cfg.seed)
    if not isinstance(other, kind):
        raise ValueError(f"validation.dataset = {name!r} is not {what}")
    return other


def keep_validation(cfg: Any, summaries: dict[str, Any], labels: np.ndarray, num_keys: int,
                    key_names: Any) -> np.ndarray:
    """The positions of a validation set loaded from another dataset that the run keeps
    (``validation_subset``), its summary recorded in ``summaries["validation"]``."""
    keep = validation_subset(cfg.validation, labels, num_keys, cfg.seed)
    summaries["validation"] = split_summary("dataset", np.asarray(labels)[keep], num_keys, list(key_names))
    return keep



def carve_pool(cfg: Any, splits: Any, kind: type, what: str, check: Any = None) -> tuple[Any, Any, Any]:
    """The server-held validation set of a task whose ``splits`` have a ``train`` pool and named ``tests``
    (image SR, keypoints: each with ``labels``, ``class_names`` and ``subset``): carved from the pool by label
    (``carve_server_splits``) or taken from ``validation.dataset`` (a ``kind``, ``what`` in its error; its
    train split or first test set; ``check(other)`` may refuse it). Returns (splits without the carved
    examples, the validation subset or None, its summary or None)."""
    import dataclasses

    pool = splits.train
    names = list(pool.class_names)
    server = carve_server_splits(cfg, pool.labels, len(names), names)
    val = pool.subset(server.held["val"]) if "val" in server.held else None
    if cfg.validation.source == "dataset":
        other = validation_dataset(cfg, kind, what)
        if check is not None:
            check(other)
        part = other.train if cfg.validation.split == "train" else next(iter(other.tests.values()))
        val = part.subset(keep_validation(cfg, server.summaries, part.labels, len(part.class_names), part.class_names))
    if len(server.rest) != len(pool):
        splits = dataclasses.replace(splits, train=pool.subset(server.rest))
    return splits, val, server.summaries.get("validation")
