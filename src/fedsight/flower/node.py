"""What a SuperNode holds: its client's data and its client's persistent state.

A SuperNode is one FedSight client; its FedSight client id is its ``partition-id`` node config. Its data
never leaves it and comes from one of two places:

* ``partition-id`` / ``num-partitions`` only: the node builds the run's dataset spec (``[data]``,
  ``[partition]`` of the FedSight config) and uses its own partition of it, exactly the client the
  in-process simulator would train (same images, same standardisation, same local test split);
* ``data-dir``: the node's own directory, what a real deployment has. It holds either one
  MedMNIST-style ``.npz`` (``train_images``/``train_labels`` = local training data,
  ``test_images``/``test_labels`` = local test data) or an ImageFolder tree ``train/<class>/<images>``
  (and optionally ``test/<class>/<images>``). Labels are global class indices (ImageFolder class
  folders are matched to the run's class names by name, so a node may lack classes). Images are
  standardised with the node's own statistics, the one difference to a simulated partition, whose
  statistics come from the whole training pool (no node can see that pool).

Per-client state (SCAFFOLD's ``c_i``, FedDyn's linear term, personal heads and local BatchNorm
layers: the "personal" entries) is a ``fedsight.state.ClientStateStore`` on the node's disk under
``state-dir`` (node config; default ``./fedsight-node-state``), in a folder per Flower run, so two runs
never share state. Every message is handled by a fresh process in a deployment, so the store's index
is rebuilt from the files (``restore_index``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..metrics import MetricState
from ..models.base import ModelIO
from ..state import ClientStateStore
from ..tasks.base import Task

DEFAULT_STATE_DIR = "fedsight-node-state"


# -- config ---------------------------------------------------------------------------------------


@lru_cache(maxsize=8)
def node_config_model(config_text: str) -> Any:
    """The validated FedSight config a node runs with: the run's config without its ``[init]`` checkpoint
    (the initial weights arrive with the global model; the file exists only on the server)."""
    from ..config import validate

    raw = json.loads(config_text)
    raw["init"] = {}
    return validate(raw, "flower run config (fedsight.*)")


# -- per-client state on the node's disk ----------------------------------------------------------


def restore_index(store: ClientStateStore) -> ClientStateStore:
    """Rebuild ``store``'s in-memory index from its files: the newest version of each (key, client);
    older versions (superseded, never committed) are deleted."""
    if store.root is None or not store.root.is_dir():
        return store
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key_dir in sorted(p for p in store.root.iterdir() if p.is_dir()):
        newest: dict[int, int] = {}
        for f in key_dir.glob("*.safetensors"):
            client, rnd = f.stem.split("-r")
            newest[int(client)] = max(newest.get(int(client), -1), int(rnd))
        if newest:
            clients = sorted(newest)
            state[key_dir.name] = {
                "clients": torch.tensor(clients, dtype=torch.int64),
                "rounds": torch.tensor([newest[c] for c in clients], dtype=torch.int64),
            }
    store.load_state_dict(state)
    return store


def state_root(node_config: Mapping[str, Any], run_id: int, partition: int, default: str | None = None) -> Path:
    """``<state-dir>/run-<run id>/client-<partition>``: this node's client state for one Flower run."""
    base = Path(str(node_config.get("state-dir") or default or Path.cwd() / DEFAULT_STATE_DIR)).expanduser()
    return base / f"run-{int(run_id)}" / f"client-{int(partition)}"


# -- data -----------------------------------------------------------------------------------------


class NodeTask(Task):
    """The task of a node holding one client's data under its global FedSight client id.

    ``inner`` is a task whose client ``inner_client`` is this node's data; client id ``client_id`` of
    the federation (one of ``num_clients``) is answered from it. Other clients' data are not here:
    asking for their sizes is an error. ``example_input`` serves this node's data (the model-cost
    probe's input)."""

    def __init__(self, inner: Task, inner_client: int, client_id: int, num_clients: int):
        self.inner, self.inner_client, self.client_id, self._num_clients = inner, inner_client, client_id, num_clients
        self.name = inner.name
        self.provides = inner.provides
        self.metrics = inner.metrics

    def _own(self, client: int) -> int:
        if int(client) != self.client_id:
            raise KeyError(f"client {client} is not on this node (it holds client {self.client_id})")
        return self.inner_client

    def _split(self, split: str | int) -> str | int:
        return self._own(split) if isinstance(split, int) else split

    @property
    def num_clients(self) -> int:
        return self._num_clients

    @property
    def num_classes(self) -> int:
        return self.inner.num_classes  # type: ignore[attr-defined]

    @property
    def model_io(self) -> ModelIO:
        return self.inner.model_io

    def build_model(self) -> nn.Module:
        return self.inner.build_model()

    def num_train_examples(self, client: int) -> int:
        return self.inner.num_train_examples(self._own(client))

    def num_test_examples(self, client: int) -> int:
        return self.inner.num_test_examples(self._own(client))

    def train_batch(self, client: int, positions: torch.Tensor) -> tuple[Any, Any]:
        return self.inner.train_batch(self._own(client), positions)

    def train_batches(self, client: int, batches: Iterable[torch.Tensor], *, seed: int = 0, round: int = 0) -> Iterator[Any]:
        return self.inner.train_batches(self._own(client), batches, seed=seed, round=round)

    def example_input(self) -> Any:
        return self.inner.train_batch(self.inner_client, torch.tensor([0]))[0]

    def loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        return self.inner.loss(outputs, targets)

    def update_metrics(self, state: MetricState, outputs: Any, targets: Any) -> None:
        self.inner.update_metrics(state, outputs, targets)

    def predict(self, model: nn.Module, inputs: Any) -> Any:
        return self.inner.predict(model, inputs)

    def eval_state(self, model: nn.Module, split: str | int, batch_size: int, subset: Any = None) -> MetricState:
        return self.inner.eval_state(model, self._split(split), batch_size, subset)

    def eval_batches(self, split: str | int, batch_size: int = 512, subset: Any = None) -> Iterator[tuple[Any, Any]]:
        return self.inner._batches(self._split(split), batch_size, subset)

    def eval_inputs(self, split: str | int, batch_size: int = 512, subset: Any = None) -> Iterator[Any]:
        return self.inner.eval_inputs(self._split(split), batch_size, subset)

    def client_labels(self, client: int) -> np.ndarray:
        return self.inner.client_labels(self._own(client))  # type: ignore[attr-defined]

    def to(self, device: torch.device) -> "NodeTask":
        self.inner.to(device)
        return self


def _local_splits(cfg: Any, data_dir: Path, class_names: list[str] | None):
    """(training pool, local test) of a classification node's own directory, as ``ArrayDataset``s
    with the run's number of classes."""
    from ..data.base import ArrayDataset, DatasetSplits
    from ..data.classification import ImageFolderParams, NpzParams, load_imagefolder, load_npz

    if not data_dir.is_dir():
        raise FileNotFoundError(f"data-dir {str(data_dir)!r} does not exist")
    npz = sorted(data_dir.glob("*.npz"))
    dp = cfg.data.model_dump()
    if npz:
        if len(npz) > 1:
            raise ValueError(f"data-dir {str(data_dir)!r} holds {len(npz)} .npz files; keep one")
        size = dp.get("image_size") if cfg.data.name in ("npz", "imagefolder") else None
        splits = load_npz(NpzParams(path=str(npz[0]), image_size=size), seed=cfg.seed)
        train, test = splits.train, splits.test
        num_classes = len(class_names) if class_names else train.num_classes
    elif (data_dir / "train").is_dir():
        params = {k: dp[k] for k in ("image_size", "channels") if k in dp}
        test_dir = data_dir / "test"
        splits = load_imagefolder(
            ImageFolderParams(train_dir=str(data_dir / "train"), test_dir=str(test_dir) if test_dir.is_dir() else None, **params),
            seed=cfg.seed,
        )
        # a node's own data is small: decode it into memory (the pool below is train + test)
        splits = DatasetSplits(train=splits.train.materialize(), test=splits.test.materialize())
        local_names = splits.train.class_names
        names = class_names or local_names
        unknown = sorted(set(local_names) - set(names))
        if unknown:
            raise ValueError(f"data-dir {str(data_dir)!r}: class folders {unknown} are not classes of this run ({names})")
        remap = torch.tensor([names.index(n) for n in local_names], dtype=torch.int64)
        train = ArrayDataset(splits.train.x, remap[splits.train.y], len(names), list(names))
        test = ArrayDataset(splits.test.x, remap[splits.test.y], len(names), list(names))
        num_classes = len(names)
    else:
        raise FileNotFoundError(
            f"data-dir {str(data_dir)!r} holds neither a .npz file nor an ImageFolder tree train/<class>/<images>"
        )
    names = list(class_names) if class_names else [str(c) for c in range(num_classes)]
    if len(train.y) and int(train.y.max()) >= num_classes:
        raise ValueError(f"data-dir {str(data_dir)!r}: label {int(train.y.max())} >= the run's {num_classes} classes")
    pool = ArrayDataset(torch.cat([train.x, test.x]), torch.cat([train.y, test.y]), num_classes, names)
    return pool, ArrayDataset(test.x, test.y, num_classes, names), len(train.y)


def build_node_task(cfg: Any, node_config: Mapping[str, Any], class_names: list[str] | None = None) -> Task:
    """The task a node trains on: its partition of the run's dataset spec, or its ``data-dir``."""
    partition = int(node_config["partition-id"])
    num_clients = int(cfg.partition.num_clients)
    if not 0 <= partition < num_clients:
        raise ValueError(f"partition-id {partition} is outside the run's {num_clients} clients")
    if "num-partitions" in node_config and int(node_config["num-partitions"]) != num_clients:
        raise ValueError(
            f"num-partitions = {node_config['num-partitions']} but the run has partition.num_clients = {num_clients}"
        )
    data_dir = node_config.get("data-dir")
    if not data_dir:
        return _shared_task(cfg.model_dump_json())
    if cfg.task.name != "classification":
        raise ValueError(f"data-dir nodes support classification tasks; this run's task is {cfg.task.name!r}")
    from ..data.base import DatasetSplits
    from ..data.partition import ClientSplit
    from ..registry import MODELS
    from ..tasks.base import component_params
    from ..tasks.classification import ClassificationTask

    pool, test, n_train = _local_splits(cfg, Path(str(data_dir)).expanduser(), class_names)
    split = ClientSplit(train=np.arange(n_train, dtype=np.int64), test=np.arange(n_train, len(pool), dtype=np.int64))
    model_params = MODELS.get(cfg.model.name).params(**component_params(cfg.model))
    inner = ClassificationTask(DatasetSplits(train=pool, test=test), [split], cfg.model.name, model_params)
    return NodeTask(inner, 0, partition, num_clients)


@lru_cache(maxsize=2)
def _shared_task(config_json: str) -> Task:
    """The run's task (dataset spec and partition), built once per process: a Ray actor serves many
    virtual nodes, a deployment's ClientApp process one message."""
    from ..api import build_task
    from ..config import validate

    return build_task(validate(json.loads(config_json)))
