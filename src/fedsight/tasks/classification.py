"""Image classification: data held as normalised tensors, clients as index arrays into one pool."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..data import ArrayDataset, DatasetSplits
from ..data.partition import ClientSplit
from ..metrics import Mean, MetricSet, MetricState
from ..models.base import ModelIO
from ..registry import MODELS, TASKS, NoParams, Params, build
from .base import Task, TaskSpec, component_params

PROVIDES = frozenset({"class_labels", "class_logits", "server_split"})


def classification_metrics() -> MetricSet:
    return MetricSet([Mean("acc", True, "top-1 accuracy"), Mean("loss", False, "mean cross-entropy")], primary="acc")


class ClassificationTask(Task):
    name = "classification"
    provides = PROVIDES

    @classmethod
    def spec(cls, params: Any = None) -> TaskSpec:
        return TaskSpec(classification_metrics().specs(), "acc", PROVIDES)

    def __init__(
        self,
        splits: DatasetSplits,
        clients: list[ClientSplit],
        model_name: str,
        model_params: Params | None,
        val: ArrayDataset | None = None,
        val_info: dict[str, Any] | None = None,
        pretrain: ArrayDataset | None = None,
        pretrain_info: dict[str, Any] | None = None,
    ):
        """``val``: the server-held validation set V (``fedsight.data.validation``), served as the
        evaluation split ``"val"``; it is standardised with the training pool's statistics.
        ``pretrain``: the server-held pre-training split (``fedsight.pretrain``), standardised the same
        way and served by ``pretrain_batches``."""
        self.splits = splits
        self.clients = clients
        self.model_name = model_name
        self.model_params = model_params
        self.metrics = classification_metrics()
        train, test = splits.train, splits.test
        # per-channel standardisation with statistics of the training pool, applied once up front
        mean = train.x.mean(dim=(0, 2, 3), keepdim=True)
        std = train.x.std(dim=(0, 2, 3), keepdim=True).clamp_min(1e-6)
        self.mean, self.std = mean, std
        # the pool is stored client by client ([client 0 train, client 0 test, client 1 train, ...]) so a
        # client's data is a contiguous slice and a batch is a single gather
        order = np.concatenate([np.concatenate([c.train, c.test]) for c in clients]).astype(np.int64)
        order_t = torch.from_numpy(order)
        self.pool_x = ((train.x[order_t] - mean) / std).contiguous()
        self.pool_y = train.y[order_t].contiguous()
        self._labels = self.pool_y.numpy().copy()  # CPU copy for partition statistics (pool_y may move)
        self._train_slices: list[slice] = []
        self._test_slices: list[slice] = []
        start = 0
        for c in clients:
            self._train_slices.append(slice(start, start + len(c.train)))
            self._test_slices.append(slice(start + len(c.train), start + len(c.train) + len(c.test)))
            start += len(c.train) + len(c.test)
        self.test_x = ((test.x - mean) / std).contiguous()
        self.test_y = test.y.contiguous()
        self.val_x = ((val.x - mean) / std).contiguous() if val is not None else None
        self.val_y = val.y.contiguous() if val is not None else None
        self.val_info = val_info
        # -- server-held pre-training split (fedsight.pretrain) --
        self.pretrain_x = ((pretrain.x - mean) / std).contiguous() if pretrain is not None else None
        self.pretrain_y = pretrain.y.contiguous() if pretrain is not None else None
        self.pretrain_info = pretrain_info

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
        """Move the (small, in-memory) pools to ``device`` once, so batches need no copy per step."""
        for name in ("pool_x", "pool_y", "test_x", "test_y", "val_x", "val_y", "pretrain_x", "pretrain_y"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device))
        return self

    def num_train_examples(self, client: int) -> int:
        sl = self._train_slices[client]
        return sl.stop - sl.start

    def num_test_examples(self, client: int) -> int:
        sl = self._test_slices[client]
        return sl.stop - sl.start

    def client_labels(self, client: int) -> np.ndarray:
        return self._labels[self._train_slices[client]]

    def client_label_counts(self) -> np.ndarray:
        """[clients, classes] counts of each client's local training labels."""
        return np.stack([np.bincount(self.client_labels(c), minlength=self.num_classes) for c in range(self.num_clients)])

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
            yield self.pretrain_x[pos], self.pretrain_y[pos]

    def data_description(self) -> dict[str, Any]:
        """What ``RUN_DIR/partition.json`` records: per-client training label counts, class names and
        the server-held validation and pre-training sets' sizes and class histograms (None without)."""
        return {
            "class_names": list(self.splits.train.class_names),
            "client_label_counts": self.client_label_counts().tolist(),
            "validation": self.val_info,
            "pretrain": self.pretrain_info,
        }

    def train_batch(self, client: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sl = self._train_slices[client]
        return self.pool_x[sl][positions], self.pool_y[sl][positions]

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs, targets)

    def _eval_split(self, split: str | int) -> tuple[torch.Tensor, torch.Tensor]:
        if split == "test":
            return self.test_x, self.test_y
        if split == "pretrain":
            if self.pretrain_x is None:
                raise ValueError('this run has no server-held pre-training split; set pretrain.source = "samples"')
            return self.pretrain_x, self.pretrain_y
        if split == "val":
            if self.val_x is None:
                raise ValueError(
                    'this run has no server-held validation set (split "val"); set [validation] source = "carve" or "dataset"'
                )
            return self.val_x, self.val_y
        sl = self._test_slices[int(split)]
        return self.pool_x[sl], self.pool_y[sl]

    def eval_batches(self, split: str | int, batch_size: int = 512) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        x, y = self._eval_split(split)
        for s in range(0, len(y), batch_size):
            yield x[s : s + batch_size], y[s : s + batch_size]

    def update_metrics(self, state: MetricState, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        acc, loss = self.metrics.metrics
        n = len(targets)
        loss.update(state, F.cross_entropy(outputs, targets, reduction="sum"), n)
        acc.update(state, (outputs.argmax(1) == targets).sum(), n)


def _external_validation(cfg: Any, splits: DatasetSplits) -> ArrayDataset:
    """V from another dataset (``validation.source = "dataset"``): same image shape, labels matched to
    the training classes by name (V may cover only some of them)."""
    from ..data import load_dataset

    v = cfg.validation
    spec = dict(v.dataset or {})
    name = spec.pop("name")
    other = load_dataset(name, spec, seed=cfg.seed)
    part = other.train if v.split == "train" else other.test
    where = f"validation.dataset ({name})"
    if tuple(part.x.shape[1:]) != tuple(splits.train.x.shape[1:]):
        raise ValueError(
            f"{where}: images are {tuple(part.x.shape[1:])} (C, H, W) but the training data's are "
            f"{tuple(splits.train.x.shape[1:])}; resize them to match (e.g. the loader's image_size)"
        )
    names = list(splits.train.class_names)
    used = [part.class_names[c] for c in np.unique(part.y.numpy())]
    unknown = [c for c in used if c not in names]
    if unknown:
        raise ValueError(
            f"{where}: label space does not match the training data: classes {unknown} are not among the "
            f"training classes {names}"
        )
    remap = np.array([names.index(c) if c in names else -1 for c in part.class_names], dtype=np.int64)
    return ArrayDataset(part.x.clone(), torch.from_numpy(remap[part.y.numpy()]), splits.train.num_classes, names)


@TASKS.register("classification", help="image classification: cross-entropy, accuracy, WMA over local test sets",
                spec=ClassificationTask.spec)
def build_classification_task(params: NoParams, *, cfg: Any) -> ClassificationTask:
    """The task of a validated config: load ``cfg.data``, carve the server-held splits
    (``fedsight.data.server_split``), partition the rest with ``cfg.partition``."""
    from ..data import load_dataset
    from ..data.partition import partition_from_config
    from ..data.server_split import carve_server_splits, split_summary, validation_subset

    splits = load_dataset(cfg.data.name, component_params(cfg.data), seed=cfg.seed)
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
    if "val" in server.held or "pretrain" in server.held:
        splits = DatasetSplits(train=splits.train.subset(server.rest), test=splits.test)
    clients = partition_from_config(splits.train.labels, cfg)
    model_params = MODELS.get(cfg.model.name).params(**component_params(cfg.model))
    return ClassificationTask(
        splits, clients, cfg.model.name, model_params, val=val, val_info=server.summaries.get("validation"),
        pretrain=pre, pretrain_info=server.summaries.get("pretrain"),
    )
