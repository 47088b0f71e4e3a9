"""Image classification: data held as normalised tensors, clients as index arrays into one pool."""

from __future__ import annotations

from typing import Any

from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..data import ArrayDataset, DatasetSplits
from ..data.partition import ClientSplit
from ..models import build_model
from ..registry import TASKS, NoParams, Params
from .base import Task, component_params


class ClassificationTask(Task):
    name = "classification"
    primary_metric = "acc"

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

    def build_model(self) -> nn.Module:
        return build_model(
            self.model_name,
            self.model_params,
            num_classes=self.splits.num_classes,
            in_channels=self.splits.in_channels,
            image_size=self.splits.image_size,
        )

    def num_train_examples(self, client: int) -> int:
        sl = self._train_slices[client]
        return sl.stop - sl.start

    def num_test_examples(self, client: int) -> int:
        sl = self._test_slices[client]
        return sl.stop - sl.start

    def client_labels(self, client: int) -> np.ndarray:
        return self.pool_y[self._train_slices[client]].numpy()

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
        return np.bincount(self.pretrain_y.numpy(), minlength=self.num_classes).tolist()

    def pretrain_batches(self, batch_size: int, gen: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One shuffled pass (order ``torch.randperm(n, generator=gen)``) over the server's pre-training
        split in batches of ``batch_size``; a trailing batch of a single example joins the one before
        (batch norm needs two)."""
        if self.pretrain_y is None:
            raise ValueError('this run has no server-held pre-training split; set pretrain.source = "samples"')
        n = len(self.pretrain_y)
        perm = torch.randperm(n, generator=gen)
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

    @torch.no_grad()
    def eval_sums(self, model: nn.Module, split: str | int, batch_size: int) -> dict[str, float]:
        was_training = model.training
        model.eval()
        correct = 0.0
        loss_sum = 0.0
        n = 0
        for xb, yb in self.eval_batches(split, batch_size):
            out = model(xb)
            n += len(yb)
            loss_sum += float(F.cross_entropy(out, yb, reduction="sum"))
            correct += float((out.argmax(1) == yb).sum())
        model.train(was_training)
        return {"correct": correct, "loss_sum": loss_sum, "n": float(n)}

    def finalize(self, sums: dict[str, float]) -> dict[str, float]:
        n = sums.get("n", 0.0)
        if n == 0:
            return {}
        return {"acc": sums["correct"] / n, "loss": sums["loss_sum"] / n}


@TASKS.register("classification", help="image classification: cross-entropy, accuracy, WMA over local test sets")
def build_classification_task(params: NoParams, *, cfg: Any) -> ClassificationTask:
    """The task of a validated config: load ``cfg.data``, partition with ``cfg.partition``."""
    from ..data import load_dataset
    from ..data.partition import partition_from_config
    from ..data.validation import check_needs_validation, split_validation, validation_summary
    from ..pretrain import pretrain_summary, split_pretrain
    from ..registry import MODELS

    check_needs_validation(cfg)
    splits = load_dataset(cfg.data.name, component_params(cfg.data), seed=cfg.seed)
    # the server-held validation set V is taken out of the training pool before partitioning: V never
    # reaches a client
    splits, val = split_validation(cfg.validation, splits, cfg.seed)
    # the server's pre-training split is taken out next, so no client (and not V) holds any of it
    splits, pre = split_pretrain(cfg.pretrain, splits, cfg.seed)
    clients = partition_from_config(splits.train.labels, cfg)
    model_params = MODELS.get(cfg.model.name).params(**component_params(cfg.model))
    return ClassificationTask(
        splits, clients, cfg.model.name, model_params, val=val, val_info=validation_summary(cfg.validation, val),
        pretrain=pre, pretrain_info=pretrain_summary(cfg.pretrain, pre),
    )
