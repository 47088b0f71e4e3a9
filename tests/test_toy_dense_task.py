"""A dense-prediction task defined entirely in this file: a dataset, a model and a task registered from
here, with a confusion-matrix metric (mIoU, per-class IoU, pixel accuracy) and a lower-is-better primary
metric. It must run under FedAvg, SCAFFOLD, FedVG, SiloBN, stages and the Flower direct-call path with no
change to the library, and its WMA / worst-10% must follow the metric's declared direction."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from sklearn.metrics import confusion_matrix
from torch import nn

from fedsight.api import build_task, execute
from fedsight.config import ConfigError, validate
from fedsight.data.partition import partition_from_config
from fedsight.data.server_split import carve_server_splits
from fedsight.metrics import ConfusionMatrix, Mean, MetricSet
from fedsight.models.base import FedModel, ModelIO
from fedsight.registry import DATASETS, MODELS, TASKS, NoParams, Params, build
from fedsight.tasks.base import Task, TaskSpec, component_params

CLASSES = ["ground", "box", "blob"]
IGNORE = 255


# -- the dataset: tiny scenes of a box and a blob on textured ground, three appearance domains -------


class ScenesParams(Params):
    images: int = 72
    size: int = 10


@DATASETS.register("toy_scenes", params=ScenesParams, task="toy_dense", help="tiny box-and-blob scenes (test only)")
def toy_scenes(p: ScenesParams, *, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1234)
    n, s = p.images + 24, p.size
    y = torch.zeros(n, s, s, dtype=torch.long)
    domain = torch.arange(n) % 3
    yy, xx = torch.meshgrid(torch.arange(s), torch.arange(s), indexing="ij")
    for i in range(n):
        t, lft = (int(v) for v in torch.randint(0, s - 4, (2,), generator=g))
        y[i, t : t + 3, lft : lft + 4] = 1
        cy, cx = (int(v) for v in torch.randint(2, s - 2, (2,), generator=g))
        y[i][((yy - cy) ** 2 + (xx - cx) ** 2) <= 2] = 2
    # appearance depends on the domain: offset and contrast of each class's intensity
    levels = torch.tensor([[0.1, 0.5, 0.9], [0.3, 0.65, 1.0], [0.0, 0.35, 0.7]])
    x = levels[domain[:, None, None], y] + 0.1 * torch.randn(n, s, s, generator=g)
    y[:, 0, :] = IGNORE  # an unlabelled top row, as street scenes have unlabelled pixels
    return {"x": x.unsqueeze(1), "y": y, "domain": domain, "train": slice(0, p.images), "test": slice(p.images, n)}


# -- the model: a two-layer fully convolutional net with BatchNorm ------------------------------------


class FCNParams(Params):
    width: int = 8


class FCN(FedModel):
    def __init__(self, width: int, io: ModelIO):
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(io.in_channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
        )
        self.head = nn.Conv2d(width, io.num_outputs, 1)


@MODELS.register("toy_fcn", params=FCNParams, task="toy_dense", help="tiny FCN (test only)",
                 provides={"parameter_groups", "norm_layers", "norm_stats"})
def toy_fcn(p: FCNParams, *, io: ModelIO) -> FCN:
    return FCN(p.width, io)


# -- the task -------------------------------------------------------------------------------------------


def dense_metrics() -> MetricSet:
    return MetricSet(
        [ConfusionMatrix("seg", len(CLASSES), IGNORE, CLASSES),
         Mean("count_err", False, "|predicted - true| foreground share per image")],
        primary="count_err",
    )


class ToyDenseTask(Task):
    name = "toy_dense"
    provides = frozenset({"class_logits", "server_split"})

    @classmethod
    def spec(cls, params: Any = None) -> TaskSpec:
        return TaskSpec(dense_metrics().specs(), "count_err", cls.provides)

    def __init__(self, data: dict[str, Any], pool: np.ndarray, clients, val: np.ndarray | None, model: Any,
                 summaries: dict[str, Any]):
        self.x, self.y = data["x"], data["y"]
        self.pool, self.clients, self.val, self.summaries = pool, clients, val, summaries
        self.test = np.arange(data["test"].start, data["test"].stop)
        self.model_spec = model
        self.metrics = dense_metrics()

    @property
    def model_io(self) -> ModelIO:
        return ModelIO("toy_dense", in_channels=1, num_outputs=len(CLASSES))

    def build_model(self) -> nn.Module:
        return build(MODELS, self.model_spec.name, component_params(self.model_spec), io=self.model_io)

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    def num_train_examples(self, client: int) -> int:
        return len(self.clients[client].train)

    def num_test_examples(self, client: int) -> int:
        return len(self.clients[client].test)

    def train_batch(self, client, positions):
        idx = torch.as_tensor(self.pool[self.clients[client].train])[positions]
        return self.x[idx], self.y[idx]

    def loss(self, outputs, targets):
        return F.cross_entropy(outputs, targets, ignore_index=IGNORE)

    def _split(self, split):
        if split == "test":
            return self.test
        if split == "val":
            return self.val
        return self.pool[self.clients[int(split)].test]

    def eval_batches(self, split, batch_size=512):
        idx = torch.as_tensor(self._split(split))
        for s in range(0, len(idx), batch_size):
            yield self.x[idx[s : s + batch_size]], self.y[idx[s : s + batch_size]]

    def data_description(self) -> dict[str, Any]:
        return {"validation": self.summaries.get("validation")}

    def update_metrics(self, state, outputs, targets):
        cm, count = self.metrics.metrics
        pred = outputs.argmax(1)
        cm.update(state, pred, targets)
        valid = targets != IGNORE
        share = lambda m: (m & valid).flatten(1).sum(1) / valid.flatten(1).sum(1)  # noqa: E731
        count.update(state, (share(pred != 0) - share(targets != 0)).abs().sum(), len(targets))


@TASKS.register("toy_dense", spec=ToyDenseTask.spec, help="toy dense prediction (test only)")
def build_toy_dense(params: NoParams, *, cfg: Any) -> ToyDenseTask:
    data = build(DATASETS, cfg.data.name, component_params(cfg.data), seed=cfg.seed)
    keys = data["domain"][data["train"]].numpy()
    server = carve_server_splits(cfg, keys, 3, ["d0", "d1", "d2"])
    clients = partition_from_config(keys[server.rest], cfg)
    return ToyDenseTask(data, server.rest, clients, server.held.get("val"), cfg.model, server.summaries)


# -- configs ----------------------------------------------------------------------------------------------


def raw(**over: Any) -> dict[str, Any]:
    from fedsight.config import set_path

    out = {
        "seed": 0, "run": {"name": "dense", "checkpoint_keep": 1, "plots": False}, "task": "toy_dense",
        "data": {"name": "toy_scenes"}, "model": {"name": "toy_fcn"},
        "partition": {"name": "classes", "classes_per_client": 1, "num_clients": 6, "local_test_fraction": 0.25},
        "train": {"epochs": 5, "batch_size": 8, "lr": 0.05, "momentum": 0.9}, "server": {"rounds": 3, "clients_per_round": 3},
        "eval": {"every": 1, "initial": False}, "engine": {"threads": 1},
    }
    for k, v in over.items():
        set_path(out, k.split("."), v)
    return out


def rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_model(cfg: Any, run_dir: Path, task: ToyDenseTask) -> nn.Module:
    torch.manual_seed(0)
    model = task.build_model()
    model.load_state_dict(load_file(str(run_dir / "model.safetensors")))
    return model.eval()


# -- the tests --------------------------------------------------------------------------------------------


def test_fedavg_metrics_merge_as_pooled_confusion_and_worst10_is_the_highest_error(tmp_path):
    cfg = validate(raw())
    execute(cfg, tmp_path / "run")
    last = [r for r in rows(tmp_path / "run") if "event" not in r][-1]
    task = build_task(cfg)
    model = final_model(cfg, tmp_path / "run", task)
    # global test set: mIoU and per-class IoU equal scikit-learn's confusion matrix on the same predictions
    with torch.no_grad():
        x, y = next(task.eval_batches("test", 10_000))
        pred = model(x).argmax(1)
    keep = y != IGNORE
    cm = confusion_matrix(y[keep].numpy(), pred[keep].numpy(), labels=[0, 1, 2]).astype(float)
    iou = np.diag(cm) / (cm.sum(0) + cm.sum(1) - np.diag(cm))
    assert last["test/miou"] == pytest.approx(float(np.nanmean(iou)), abs=1e-12)
    for name, v in zip(CLASSES, iou):
        assert last[f"test/iou/{name}"] == pytest.approx(float(v), abs=1e-12)
    assert last["test/pixel_acc"] == pytest.approx(np.trace(cm) / cm.sum(), abs=1e-12)
    # local: the merged mIoU is the pooled confusion matrix over all clients' test sets, not a mean of
    # per-client mIoUs; WMA and worst-10% are of the primary metric, and the worst client has the HIGHEST
    # error (the metric is lower-is-better)
    per_client, pooled = [], np.zeros((3, 3))
    for c in range(task.num_clients):
        vals = task.evaluate(model, c, 512)
        per_client.append((vals["count_err"], task.num_test_examples(c)))
        with torch.no_grad():
            xc, yc = next(task.eval_batches(c, 512))
            pc = model(xc).argmax(1)
        k = yc != IGNORE
        pooled += confusion_matrix(yc[k].numpy(), pc[k].numpy(), labels=[0, 1, 2])
    pooled_iou = np.diag(pooled) / (pooled.sum(0) + pooled.sum(1) - np.diag(pooled))
    assert last["local/miou"] == pytest.approx(float(np.nanmean(pooled_iou)), abs=1e-12)
    mean_of_mious = np.mean([task.evaluate(model, c, 512)["miou"] for c in range(task.num_clients)])
    assert abs(last["local/miou"] - mean_of_mious) > 1e-6  # the two differ here: the merge is the real one
    errs = [e for e, _ in per_client]
    assert last["local/worst10"] == pytest.approx(max(errs), abs=1e-12)
    assert last["local/worst10"] > min(errs)
    total = sum(n for _, n in per_client)
    assert last["local/wma"] == pytest.approx(sum(e * n for e, n in per_client) / total, abs=1e-12)
    # the run directory records the directions; reports and the CLI read them from there
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    assert meta["primary"] == "test/count_err"
    assert meta["metrics"]["test/count_err"] is False and meta["metrics"]["local/worst10"] is False
    assert meta["metrics"]["test/miou"] is True and meta["metrics"]["test/iou/*"] is True


def test_best_value_in_the_report_is_the_lowest_error(tmp_path):
    from fedsight.reporting import compare

    execute(validate(raw()), tmp_path / "run")
    table = compare([tmp_path / "run"], metrics=["test/count_err"])
    values = [r["test/count_err"] for r in rows(tmp_path / "run") if "test/count_err" in r]
    assert table.rows[0].best_mean == pytest.approx(min(values))
    assert table.rows[0].higher_is_better is False


@pytest.mark.parametrize("name,over", [
    ("scaffold", {"recipe.components": ["scaffold"]}),
    ("fedvg", {"recipe.weighting": "fedvg", "validation.source": "carve", "validation.fraction": 0.15}),
    ("silobn", {"recipe.sharing": {"name": "silobn", "test_stats": "client"}}),
    ("silobn fresh", {"recipe.sharing": {"name": "silobn", "test_stats": "fresh"}}),
])
def test_recipes_run_on_the_dense_task(tmp_path, name, over):
    cfg = validate(raw(**over))
    execute(cfg, tmp_path / "run")
    got = [r for r in rows(tmp_path / "run") if "event" not in r]
    assert len(got) == 3 and all(math.isfinite(r["test/miou"]) and math.isfinite(r["local/worst10"]) for r in got)
    assert got[-1]["clients/aggregated"] == 3
    state = tmp_path / "run" / "client_state"
    if name == "scaffold":
        assert sorted(p.name for p in state.iterdir()) == ["scaffold"]
    if name.startswith("silobn"):
        # BN statistics stay on the clients (found by module type), the affine parameters are shared
        entry = load_file(str(next((state / "personal").iterdir())))
        assert sorted(entry) == sorted(f"backbone.{i}.{b}" for i in (1, 4)
                                       for b in ("running_mean", "running_var", "num_batches_tracked"))
    if name == "fedvg":
        assert got[-1]["fedvg/server_examples"] == 3 * 11  # 3 clients x |V| (15% of 72, stratified by domain)
        assert json.loads((tmp_path / "run" / "partition.json").read_text())["validation"]["size"] == 11


def test_stages_on_the_dense_task(tmp_path):
    over = {"server.rounds": 3}
    cfg = raw(**over)
    cfg["stages"] = [{"name": "fedavg", "rounds": 2},
                     {"name": "head", "rounds": 1, "train": {"freeze": ["backbone"]}, "recipe": {"sharing": "silobn"}}]
    execute(validate(cfg), tmp_path / "run")
    got = [r for r in rows(tmp_path / "run") if "event" not in r]
    assert [r["stage"] for r in got] == ["fedavg", "fedavg", "head"]
    # the head-only stage uploads only the 1x1 head (weight + bias): 8*3 + 3 floats per client
    assert got[-1]["cost/up_bytes"] == 3 * 4 * (8 * 3 + 3)


def test_incompatible_parts_fail_at_config_time_naming_both_sides():
    cases = {
        "fed3r": ({"recipe.components": ["fed3r"]}, r"'fed3r' needs a class label .*task 'toy_dense' does not provide"),
        "oll": ({"recipe.components": ["oll"]}, r"'oll' needs a linear classifier head .*model 'toy_fcn'"),
        "fedvg": ({"recipe.weighting": "fedvg"}, r"'fedvg' needs a server-held validation set .*validation.source"),
        "dwt": ({"recipe.components": ["dwt_loss"]}, r"'dwt_loss' needs images as model outputs .*task 'toy_dense'"),
        "imbalance": ({"validation.source": "carve", "validation.imbalance": 0.5}, r"validation.imbalance = 0.5 needs a class label"),
    }
    for over, pattern in cases.values():
        with pytest.raises(ConfigError, match=pattern):
            validate(raw(**over))


@pytest.mark.flower
def test_dense_task_over_flower_messages_equals_in_process(tmp_path, monkeypatch):
    pytest.importorskip("flwr", reason="the Flower path needs the flower extra")
    for k, v in {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}.items():
        monkeypatch.setenv(k, v)
    sys.path.insert(0, str(Path(__file__).parent / "flower"))
    from flower_direct import run_direct

    cfg = validate(raw(**{"recipe.components": ["scaffold"], "recipe.sharing": "silobn", "server.rounds": 2}))
    execute(cfg, tmp_path / "inproc")
    run_direct(cfg, tmp_path / "flower", tmp_path / "nodes")
    a, b = load_file(str(tmp_path / "inproc" / "model.safetensors")), load_file(str(tmp_path / "flower" / "model.safetensors"))
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith(("time/", "flower/"))}  # noqa: E731
    assert [strip(r) for r in rows(tmp_path / "inproc")] == [strip(r) for r in rows(tmp_path / "flower")]
    assert "local/miou" in rows(tmp_path / "flower")[-1]
