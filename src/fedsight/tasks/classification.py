"""Image classification: data held as normalised tensors, clients as index arrays into one pool."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..data.base import ArrayDataset, DatasetSplits, StoredDataset
from ..data.partition import ClientSplit, ClientSplits
from ..metrics import Mean, MetricSet, MetricState, PerClassAccuracy
from ..models.base import ModelIO
from ..registry import MODELS, PARTITIONERS, TASKS, NoParams, Params, build
from ..rng import np_rng
from .base import Task, TaskSpec, component_params

PROVIDES = frozenset({"class_labels", "class_logits", "server_split"})


def classification_metrics(num_classes: int = 0, class_names: Sequence[str] | None = None) -> MetricSet:
    """Top-1 accuracy, mean cross-entropy and every class's accuracy (``acc/<class name>``: its recall, for
    the classes present in a split; the family is declared without classes too, for the task's spec)."""
    return MetricSet([Mean("acc", True, "top-1 accuracy", (0.0, 1.0)),
                      Mean("loss", False, "mean cross-entropy", (0.0, float("inf"))),
                      PerClassAccuracy("class_acc", num_classes, "acc", class_names)], primary="acc")


class SplitImages:
    """One split's images, standardised with the training pool's per-channel statistics: a float tensor
    in memory (``x``), or an image store (``store``) whose uint8 batches are decoded and standardised when
    a batch is read."""

    def __init__(self, data: ArrayDataset | StoredDataset, mean: torch.Tensor, std: torch.Tensor,
                 index: np.ndarray | None = None):
        self.mean, self.std = mean, std
        self.device = torch.device("cpu")
        self.x: torch.Tensor | None = None
        self.store: Any = None
        if isinstance(data, StoredDataset):
            self.store = data.store if index is None else data.store.subset(index)
        else:
            x = data.x if index is None else data.x[torch.from_numpy(index)]
            self.x = ((x - mean) / std).contiguous()

    def __len__(self) -> int:
        return len(self.x) if self.x is not None else len(self.store)

    def standardize(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 ``[B, C, H, W]`` from the store -> standardised float32 on the task's device (the uint8
        batch crosses to the GPU, a quarter of the float bytes; pinned batches copy asynchronously)."""
        images = images.to(self.device, non_blocking=images.is_pinned())
        return (images.to(torch.float32).div_(255.0) - self.mean) / self.std

    def get(self, idx: torch.Tensor) -> torch.Tensor:
        if self.x is not None:
            return self.x[idx]
        return self.standardize(self.store.get(idx))

    def span(self, start: int, stop: int) -> torch.Tensor:
        if self.x is not None:
            return self.x[start:stop]
        return self.get(torch.arange(start, stop))

    def to(self, device: torch.device) -> None:
        """In memory: the images move. A store stays on the CPU (batches are decoded there); its batches
        are standardised on ``device``."""
        self.device = torch.device(device)
        if self.x is not None:
            self.x = self.x.to(device)
        else:
            self.mean, self.std = self.mean.to(device), self.std.to(device)


class ClassificationTask(Task):
    """Classification over images held in memory (digits, npz) or read from disk on demand (ImageFolder:
    decoding prefetched by the dataset's ``workers``, optional ``crop_flip`` augmentation drawn per sample
    from (seed, "augment", round, client, step, j), so batches are the same for any number of workers).
    Augmentation applies to the clients' training passes (``train_batches``); ``train_batch`` and every
    evaluation read the images as they are."""

    name = "classification"
    provides = PROVIDES
    loss_is_example_mean = True  # a cross-entropy mean over the batch

    @classmethod
    def spec(cls, params: Any = None) -> TaskSpec:
        return TaskSpec(classification_metrics().specs(), "acc", PROVIDES)

    def __init__(
        self,
        splits: DatasetSplits,
        clients: Sequence[ClientSplit],
        model_name: str,
        model_params: Params | None,
        val: ArrayDataset | StoredDataset | None = None,
        val_info: dict[str, Any] | None = None,
        pretrain: ArrayDataset | StoredDataset | None = None,
        pretrain_info: dict[str, Any] | None = None,
    ):
        """``val``: the server-held validation set V (``fedsight.data.server_split``), served as the
        evaluation split ``"val"``; it is standardised with the training pool's statistics.
        ``pretrain``: the server-held pre-training split (``fedsight.pretrain``), standardised the same
        way and served by ``pretrain_batches``."""
        self.splits = splits
        self.clients = clients
        #: what the thesis's data protocols did (``partition.rgb_shift`` / ``global_imbalance``), for partition.json
        self.protocols: dict[str, Any] = {}
        self.model_name = model_name
        self.model_params = model_params
        self.metrics = classification_metrics(splits.num_classes, list(splits.train.class_names))
        train, test = splits.train, splits.test
        # per-channel standardisation with statistics of the training pool
        if isinstance(train, StoredDataset):
            from ..data.pipeline import channel_stats

            m, s = channel_stats(train.store)  # one streaming pass: memory does not grow with the pool
            mean, std = m.view(1, -1, 1, 1), s.view(1, -1, 1, 1).clamp_min(1e-6)
        else:
            mean = train.x.mean(dim=(0, 2, 3), keepdim=True)
            std = train.x.std(dim=(0, 2, 3), keepdim=True).clamp_min(1e-6)
        self.mean, self.std = mean, std
        # the pool is stored client by client ([client 0 train, client 0 test, client 1 train, ...]) so a
        # client's data is a contiguous slice and a batch is a single gather
        packed = clients if isinstance(clients, ClientSplits) else ClientSplits.pack([c.train for c in clients],
                                                                                     [c.test for c in clients])
        n_train, n_test = packed.train_sizes(), packed.test_sizes()
        # client c's train examples at [start, mid), its local test examples at [mid, end): three offsets a client
        end = np.cumsum(n_train + n_test)
        mid = end - n_test
        start = mid - n_train
        self._bounds = np.stack([start, mid, end], axis=1)
        order = np.empty(int(end[-1]) if len(end) else 0, dtype=np.int64)
        order[np.repeat(start - packed.train_offsets[:-1], n_train) + np.arange(len(packed.train))] = packed.train
        order[np.repeat(mid - packed.test_offsets[:-1], n_test) + np.arange(len(packed.test))] = packed.test
        self.pool = SplitImages(train, mean, std, order)
        self.pool_y = train.y[torch.from_numpy(order)].contiguous()
        self._labels = self.pool_y.numpy().copy()  # CPU copy for partition statistics (pool_y may move)
        self.test = SplitImages(test, mean, std)
        self.test_y = test.y.contiguous()
        self.val = SplitImages(val, mean, std) if val is not None else None
        self.val_y = val.y.contiguous() if val is not None else None
        self.val_info = val_info
        # -- server-held pre-training split (fedsight.pretrain) --
        self.pretrain = SplitImages(pretrain, mean, std) if pretrain is not None else None
        self.pretrain_y = pretrain.y.contiguous() if pretrain is not None else None
        self.pretrain_info = pretrain_info
        # -- on-disk data: prefetching decoder and training augmentation --
        spec = train.loader if isinstance(train, StoredDataset) else None
        self.prefetcher = None
        self.augment = None
        if spec is not None:
            from ..data.pipeline import Prefetcher, RandomCropFlip

            self.prefetcher = Prefetcher(spec.workers, depth=max(2, 2 * spec.workers), backend=spec.backend,
                                         pin_memory=True)
            self.augment = RandomCropFlip(spec.crop_pad) if spec.augment == "crop_flip" else None

    # in-memory views, as before on-disk data existed (None for on-disk data)
    pool_x = property(lambda self: self.pool.x)
    test_x = property(lambda self: self.test.x)
    val_x = property(lambda self: self.val.x if self.val is not None else None)
    pretrain_x = property(lambda self: self.pretrain.x if self.pretrain is not None else None)

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    @property
    def num_classes(self) -> int:
        return self.splits.num_classes

    @property
    def model_io(self) -> ModelIO:
        return ModelIO("classification", in_channels=self.splits.in_channels, num_outputs=self.splits.num_classes,
                       image_size=self.splits.image_size)

    def build_model(self) -> nn.Module:
        return build(MODELS, self.model_name, self.model_params, io=self.model_io)

    def to(self, device: torch.device) -> "ClassificationTask":
        """Move the in-memory images and the labels to ``device`` once, so batches need no copy per step
        (on-disk images stay on the CPU and move per batch)."""
        for images in (self.pool, self.test, self.val, self.pretrain):
            if images is not None:
                images.to(device)
        for name in ("pool_y", "test_y", "val_y", "pretrain_y"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device))
        return self

    def _train_slice(self, client: int) -> slice:
        start, mid, _ = self._bounds[client]
        return slice(int(start), int(mid))

    def _test_slice(self, client: int) -> slice:
        _, mid, end = self._bounds[client]
        return slice(int(mid), int(end))

    def num_train_examples(self, client: int) -> int:
        start, mid, _ = self._bounds[client]
        return int(mid - start)

    def num_test_examples(self, client: int) -> int:
        _, mid, end = self._bounds[client]
        return int(end - mid)

    def client_labels(self, client: int) -> np.ndarray:
        return self._labels[self._train_slice(client)]

    def client_label_counts(self) -> np.ndarray:
        """[clients, classes] counts of each client's local training labels."""
        start, mid, end = self._bounds.T
        client = np.repeat(np.arange(len(start)), end - start)  # the client of every pool position
        train = np.arange(len(client)) < mid[client]
        flat = client[train] * self.num_classes + self._labels[train]
        return np.bincount(flat, minlength=len(start) * self.num_classes).reshape(len(start), self.num_classes)

    def num_val_examples(self) -> int:
        return 0 if self.val_y is None else len(self.val_y)

    def num_pretrain_examples(self) -> int:
        return 0 if self.pretrain_y is None else len(self.pretrain_y)

    def pretrain_class_counts(self) -> list[int]:
        if self.pretrain_y is None:
            return [0] * self.num_classes
        return np.bincount(self.pretrain_y.cpu().numpy(), minlength=self.num_classes).tolist()

    def pretrain_batches(self, batch_size: int, gen: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One shuffled pass (order ``torch.randperm(n, generator=gen)``) over the server's pre-training
        split in batches of ``batch_size``; a trailing batch of a single example joins the one before
        (batch norm needs two)."""
        if self.pretrain_y is None:
            raise ValueError('this run has no server-held pre-training split; set pretrain.source = "samples"')
        n = len(self.pretrain_y)
        perm = torch.randperm(n, generator=gen).to(self.pretrain_y.device)
        starts = list(range(0, n, batch_size))
        if len(starts) > 1 and n - starts[-1] == 1:
            starts.pop()
        for i, s in enumerate(starts):
            pos = perm[s : starts[i + 1] if i + 1 < len(starts) else n]
            yield self.pretrain.get(pos), self.pretrain_y[pos]

    def data_description(self) -> dict[str, Any]:
        """What ``RUN_DIR/partition.json`` records: per-client training label counts, class names and
        the server-held validation and pre-training sets' sizes and class histograms (None without)."""
        return {
            "class_names": list(self.splits.train.class_names),
            "client_label_counts": self.client_label_counts().tolist(),
            "validation": self.val_info,
            "pretrain": self.pretrain_info,
            **self.protocols,  # partition.rgb_shift / global_imbalance: groups and counts
        }

    def train_batch(self, client: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sl = self._train_slice(client)
        if self.pool.x is not None:
            return self.pool.x[sl][positions], self.pool_y[sl][positions]
        idx = positions.cpu() + sl.start
        return self.pool.get(idx), self.pool_y[idx.to(self.pool_y.device)]

    def stacks_train_batches(self) -> bool:
        """In-memory images served by this class's own ``train_batch`` (a subclass may change it)."""
        own = type(self).train_batch is ClassificationTask.train_batch
        return own and type(self).train_batches is ClassificationTask.train_batches and self.pool.x is not None

    def train_batch_stack(self, clients: Sequence[int], positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.from_numpy(self._bounds[np.asarray(clients, dtype=np.int64), 0]).to(positions.dtype)
        idx = (positions + starts[:, None]).to(self.pool_y.device)
        return self.pool.x[idx], self.pool_y[idx]

    def train_batches(
        self, client: int, batches: Iterable[torch.Tensor], *, seed: int = 0, round: int = 0
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """On-disk data: the batches decoded (and augmented) ahead by the prefetcher, in order; sample j
        of step s is augmented from the stream (seed, "augment", round, client, s, j)."""
        if self.prefetcher is None:
            yield from super().train_batches(client, batches, seed=seed, round=round)
            return
        from ..data.pipeline import BatchLoader

        start = self._train_slice(client).start
        jobs = [(pos.cpu().numpy() + start, ("augment", round, client, step)) for step, pos in enumerate(batches)]
        loader = BatchLoader(self.pool.store, self.augment, seed)
        for (idx, _), images in zip(jobs, self.prefetcher.map(loader, jobs)):
            yield self.pool.standardize(images), self.pool_y[torch.from_numpy(idx).to(self.pool_y.device)]

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs, targets)

    def example_losses(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs, targets, reduction="none")

    def _eval_split(self, split: str | int) -> tuple[SplitImages, torch.Tensor, int]:
        """(images, labels, offset of the split's first image in ``images``)."""
        if split == "test":
            return self.test, self.test_y, 0
        if split == "pretrain":
            if self.pretrain is None:
                raise ValueError('this run has no server-held pre-training split; set pretrain.source = "samples"')
            return self.pretrain, self.pretrain_y, 0
        if split == "val":
            if self.val is None:
                raise ValueError(
                    'this run has no server-held validation set (split "val"); set [validation] source = "carve" or "dataset"'
                )
            return self.val, self.val_y, 0
        sl = self._test_slice(int(split))
        return self.pool, self.pool_y[sl], sl.start

    def eval_batches(self, split: str | int, batch_size: int = 512, subset: Any = None
                     ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The split's examples (or its ``subset``: indices into it, in that order), standardised, in
        batches of at most ``batch_size``."""
        images, y, offset = self._eval_split(split)
        if subset is not None:
            idx = np.asarray(subset, dtype=np.int64)
            for a in range(0, len(idx), batch_size):
                chunk = torch.from_numpy(idx[a : a + batch_size])
                yield images.get(chunk + offset), y[chunk.to(y.device)]
            return
        spans = [(s, min(s + batch_size, len(y))) for s in range(0, len(y), batch_size)]
        if images.x is not None or self.prefetcher is None:
            for a, b in spans:
                yield images.span(offset + a, offset + b), y[a:b]
            return
        from ..data.pipeline import BatchLoader

        loader = BatchLoader(images.store)
        jobs = [(np.arange(offset + a, offset + b), None) for a, b in spans]
        for (a, b), raw in zip(spans, self.prefetcher.map(loader, jobs)):
            yield images.standardize(raw), y[a:b]

    def update_metrics(self, state: MetricState, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        acc, loss, per_class = self.metrics.metrics
        n, preds = len(targets), outputs.argmax(1)
        loss.update(state, F.cross_entropy(outputs, targets, reduction="sum"), n)
        acc.update(state, (preds == targets).sum(), n)
        per_class.update(state, preds, targets)


def _external_validation(cfg: Any, splits: DatasetSplits) -> ArrayDataset:
    """V from another dataset (``validation.source = "dataset"``): same image shape, labels matched to
    the training classes by name, or through ``validation.class_map`` (V may cover only some of them; classes
    it cannot place are an error or, with ``unmapped = "drop"``, left out), then ``duplicates_per_class``
    (``fedsight.data.server_split``)."""
    from ..data import load_dataset

    v = cfg.validation
    spec = dict(v.dataset or {})
    name = spec.pop("name")
    other = load_dataset(name, spec, seed=cfg.seed)
    part = other.train if v.split == "train" else other.test
    where = f"validation.dataset ({name})"
    if tuple(part.shape) != tuple(splits.train.shape):
        raise ValueError(
            f"{where}: images are {tuple(part.shape)} (C, H, W) but the training data's are "
            f"{tuple(splits.train.shape)}; resize them to match (e.g. the loader's image_size)"
        )
    names = list(splits.train.class_names)
    mapping = dict(v.class_map or {})
    bad = {k: t for k, t in mapping.items() if t not in names}
    if bad:
        k, t = next(iter(bad.items()))
        raise ValueError(f"validation.class_map: {k!r} maps to {t!r}, which is not a training class ({names})")
    absent = [k for k in mapping if k not in part.class_names]
    if absent:
        raise ValueError(f"validation.class_map: {absent} are not classes of {where} ({list(part.class_names)})")
    target = [mapping.get(c, c) for c in part.class_names]
    remap = np.array([names.index(t) if t in names else -1 for t in target], dtype=np.int64)
    y = remap[np.asarray(part.labels, dtype=np.int64)]
    if (y < 0).any() and v.unmapped == "error":
        unknown = sorted({part.class_names[c] for c in np.unique(np.asarray(part.labels)[y < 0])})
        raise ValueError(
            f"{where}: label space does not match the training data: classes {unknown} are not among the "
            f"training classes {names} (map them with validation.class_map, or drop them with "
            'validation.unmapped = "drop")'
        )
    keep = np.flatnonzero(y >= 0)
    if not len(keep):
        raise ValueError(f"{where}: none of its classes is a training class or mapped onto one")
    if v.duplicates_per_class:  # the authors' sampler: n random images of each class first, then the whole pool
        rng, n = np_rng(v.seed if v.seed is not None else cfg.seed, "validation-duplicates"), v.duplicates_per_class
        extra = []
        for c in np.unique(y[keep]):
            pool = keep[y[keep] == c]
            if len(pool) < n:
                raise ValueError(f"validation.duplicates_per_class = {n}: {where} has {len(pool)} images of {names[c]!r}")
            extra.append(np.sort(rng.choice(pool, size=n, replace=False)))
        keep = np.concatenate([*extra, keep])
    sub = part.subset(keep)
    if isinstance(sub, StoredDataset):
        sub = sub.materialize()  # V is the server's: small, held in memory
    return ArrayDataset(sub.x.clone(), torch.from_numpy(y[keep]), splits.train.num_classes, names)


@TASKS.register("classification", help="image classification: cross-entropy, accuracy, WMA over local test sets",
                spec=ClassificationTask.spec)
def build_classification_task(params: NoParams, *, cfg: Any) -> ClassificationTask:
    """The task of a validated config: load ``cfg.data``, carve the server-held splits
    (``fedsight.data.server_split``), partition the rest with ``cfg.partition``."""
    from ..data import load_dataset
    from ..data.partition import partition_from_config
    from ..data.server_split import carve_server_splits, split_summary, validation_subset

    splits = load_dataset(cfg.data.name, component_params(cfg.data), seed=cfg.seed)
    protocols: dict[str, Any] = {}
    if cfg.partition.global_imbalance is not None:  # thesis Table 3.11: before anything is carved or dealt
        from ..data.thesis_protocols import apply_global_imbalance

        splits, protocols["global_imbalance"] = apply_global_imbalance(splits, cfg.partition.global_imbalance,
                                                                       cfg.seed)
    names = list(splits.train.class_names)
    # V and the pre-training split leave the pool before partitioning: no client ever holds them
    server = carve_server_splits(cfg, splits.train.labels, splits.num_classes, names)
    val = splits.train.subset(server.held["val"]) if "val" in server.held else None
    if cfg.validation.source == "dataset":
        val = _external_validation(cfg, splits)
        val = val.subset(validation_subset(cfg.validation, val.labels, val.num_classes, cfg.seed))
        server.summaries["validation"] = split_summary("dataset", val.labels, val.num_classes, names,
                                                       imbalance=cfg.validation.imbalance)
    pre = splits.train.subset(server.held["pretrain"]) if "pretrain" in server.held else None
    attributes = {}
    if "client_of" in PARTITIONERS.get(cfg.partition.name).meta.get("needs", ()):
        if splits.client_of is None:
            raise ValueError(f"partition.name = 'predefined': dataset {cfg.data.name!r} has no client split of its "
                             "own (federated_csv has)")
        attributes["client_of"] = np.asarray(splits.client_of)[server.rest]
    if "val" in server.held or "pretrain" in server.held:
        splits = DatasetSplits(train=splits.train.subset(server.rest), test=splits.test)
    clients = partition_from_config(splits.train.labels, cfg, attributes)
    if cfg.partition.rgb_shift is not None:  # thesis Table 3.9: each client's domain, after the clients are dealt
        from ..data.thesis_protocols import apply_rgb_shift

        splits, protocols["rgb_shift"] = apply_rgb_shift(splits, clients, cfg.partition.rgb_shift, cfg.seed)
    model_params = MODELS.get(cfg.model.name).params(**component_params(cfg.model))
    task = ClassificationTask(
        splits, clients, cfg.model.name, model_params, val=val, val_info=server.summaries.get("validation"),
        pretrain=pre, pretrain_info=server.summaries.get("pretrain"),
    )
    task.protocols = protocols
    return task
