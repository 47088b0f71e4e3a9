"""Model selection (``eval.select = "best"``): keep the global model that is best on the validation set.

NVFlare's ``IntimeModelSelector`` keeps the best global model by a validation metric; FedSight's run otherwise
ends with the last one (``eval.select = "last"``, the default). Choices made:

* **Validation data only, never test.** ``select = "best"`` needs a server-held validation set (``[validation]``,
  served as the evaluation split ``"val"``); every evaluation round then also evaluates the global model on it
  and logs ``val/<metric>``, and the metric selected by (``eval.select_metric``, default ``val/<primary>``) must
  be an exact metric key of the task with a direction (``val/acc``, ``val/loss``; not a family such as
  ``val/acc/*``, whose members are known only once the data is loaded). Both are checked when the config is
  validated, before anything is written.
* **Which rounds compete.** Every evaluation round, round 0 (the initial model, ``eval.initial``) included: a run
  whose training never beats its start says so. A later round replaces the kept model only when it is strictly
  better (ties keep the earlier round, the cheaper model); a NaN never wins.
* **Resume-safe.** The kept model, its round and value are part of the server's state, so every checkpoint
  carries them and a resumed run keeps the best so far (and, as resume is bit-identical, ends with the same
  selection as an uninterrupted run). ``RUN_DIR/best.safetensors`` (the kept model's ``state_dict``) and
  ``RUN_DIR/best.json`` (round, metric, value) are written atomically whenever the selection changes, and
  again from the restored state when a session starts (a kill between the checkpoint and these files loses
  nothing).
* **Reported as selected on validation.** After the last round the selected model is evaluated on the test
  sets; the last round's metrics row gets ``selected/round``, ``selected/val/<metric>`` and
  ``selected/test/<metric>`` for every test metric (``selected/<split>/...`` for a task's extra test sets), which
  reach ``metrics.jsonl``, TensorBoard, MLflow, ``fedsight.run``'s ``final`` and ``summary.md``'s line "selected
  on validation: round R, val/acc = X". ``test/*`` of the last round stays the last model's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

BEST_WEIGHTS = "best.safetensors"
BEST_META = "best.json"
#: the prefix of what the selected model scores (``selected/round``, ``selected/val/acc``, ``selected/test/acc``)
SELECTED = "selected"


def _task_metrics(cfg: Any) -> tuple[Any, ...]:
    from . import registry as R

    return R.TASKS.get(cfg.task.name).meta["spec"](cfg.task).metrics


def selected_metric(cfg: Any) -> str | None:
    """The metric ``cfg`` selects by (``val/<key>``), None with ``eval.select = "last"``."""
    if cfg.eval.select != "best":
        return None
    if cfg.eval.select_metric is not None:
        return cfg.eval.select_metric
    from . import registry as R

    return f"val/{R.TASKS.get(cfg.task.name).meta['spec'](cfg.task).primary}"


def selection_of(cfg: Any) -> tuple[str, bool] | None:
    """(metric, higher is better) that ``cfg`` selects by; None with ``eval.select = "last"``."""
    metric = selected_metric(cfg)
    if metric is None:
        return None
    name = metric.split("/", 1)[1]
    return metric, next(m.higher_is_better for m in _task_metrics(cfg) if m.key == name) is not False


def selection_problems(cfg: Any) -> list[str]:
    """``eval.select_metric`` must name a validation metric the task logs, with a direction (one line, or none)."""
    if cfg.eval.select != "best" or cfg.eval.select_metric is None:
        return []
    key = cfg.eval.select_metric
    specs = [m for m in _task_metrics(cfg) if "*" not in m.key and m.higher_is_better is not None]
    choices = ", ".join(f"val/{m.key}" for m in specs)
    split, _, name = key.partition("/")
    if split != "val":
        return [f"eval.select_metric = {key!r}: a model is selected on the validation set, never on {split or 'test'} "
                f"data; choose one of {choices}"]
    if not any(m.key == name for m in specs):
        return [f"eval.select_metric = {key!r}: task {cfg.task.name!r} logs no such validation metric; choose one "
                f"of {choices}"]
    return []


def selection_directions(cfg: Any) -> dict[str, bool | None]:
    """The directions of what a selecting run adds to its last row (``selected/...``), for ``run.json``."""
    if cfg.eval.select != "best":
        return {}
    out: dict[str, bool | None] = {f"{SELECTED}/round": None}
    for m in _task_metrics(cfg):
        for split in ("val", "test", "test_*"):
            out[f"{SELECTED}/{split}/{m.key}"] = m.higher_is_better
    return out


class Selection:
    """The best global model so far by ``metric`` (``higher``: whether higher is better) and its round."""

    def __init__(self, metric: str, higher: bool):
        self.metric, self.higher = metric, higher
        self.round: int | None = None
        self.value: float | None = None
        self.model: dict[str, torch.Tensor] | None = None

    def offer(self, r: int, metrics: dict[str, Any], state: dict[str, torch.Tensor]) -> bool:
        """Keep ``state`` (a copy) as round ``r``'s model if its ``metrics[self.metric]`` is strictly better than
        the kept one's (a NaN never is). Whether it was kept."""
        v = metrics.get(self.metric)
        if v is None or not math.isfinite(float(v)):
            return False
        v = float(v)
        if self.value is not None and not (v > self.value if self.higher else v < self.value):
            return False
        self.round, self.value = r, v
        self.model = {k: t.detach().clone() for k, t in state.items()}
        return True

    def record(self) -> dict[str, Any]:
        """What ``best.json`` says: round, metric, value and the direction."""
        return {"round": self.round, "metric": self.metric, "value": self.value,
                "higher_is_better": self.higher, "selected_on": "validation"}

    def state_dict(self) -> dict[str, Any]:
        if self.model is None:
            return {}
        return {"round": self.round, "value": self.value, "model": dict(self.model)}

    def load_state_dict(self, state: dict[str, Any], like: dict[str, torch.Tensor]) -> None:
        """Restore from a checkpoint; ``like``: the global model's state, whose keys and shapes the kept model
        must have (a ``ValueError`` naming the first that differs)."""
        if not state:
            self.round = self.value = self.model = None
            return
        model = state["model"]
        if set(model) != set(like):
            raise ValueError(f"the selected model's entries differ from the model's ({sorted(set(model) ^ set(like))[0]})")
        for k, t in like.items():
            if tuple(model[k].shape) != tuple(t.shape):
                raise ValueError(f"the selected model's {k} has shape {tuple(model[k].shape)}, not {tuple(t.shape)}")
        self.round, self.value = int(state["round"]), float(state["value"])
        self.model = {k: model[k].to(device=t.device, dtype=t.dtype) for k, t in like.items()}


def write_best(run_dir: str | Path, sel: Selection) -> None:
    """``best.safetensors`` then ``best.json`` (the marker, written last), each atomically; nothing when no
    round has been selected yet."""
    from safetensors.torch import save

    from .safe_write import atomic_write_bytes, atomic_write_text

    if sel.model is None:
        return
    run_dir = Path(run_dir)
    atomic_write_bytes(run_dir / BEST_WEIGHTS, save({k: t.detach().contiguous().cpu() for k, t in sel.model.items()}))
    atomic_write_text(run_dir / BEST_META, json.dumps(sel.record()) + "\n")


def sync_best(run_dir: str | Path, sel: Selection) -> None:
    """When a session starts: the best files as the (restored) selection has them, written again (a kill between
    a checkpoint and ``write_best`` lost nothing) or removed (left by a run that is started over)."""
    if sel.model is not None:
        write_best(run_dir, sel)
    else:
        for name in (BEST_META, BEST_WEIGHTS):  # the marker first
            (Path(run_dir) / name).unlink(missing_ok=True)


def read_best(run_dir: str | Path) -> dict[str, Any] | None:
    """``best.json`` of a run (None without one); a damaged one is a ``RunFileError`` naming it."""
    from .errors import RunFileError
    from .safe_read import exists, loads_json, read_text

    path = Path(run_dir) / BEST_META
    if not exists(path):
        return None
    try:
        rec = loads_json(read_text(path, error=RunFileError), str(path), RunFileError)
    except ValueError as exc:
        raise RunFileError(f"{path}: not a JSON record of the selected model ({exc})") from None
    if not (isinstance(rec, dict) and isinstance(rec.get("round"), int) and isinstance(rec.get("metric"), str)
            and isinstance(rec.get("value"), (int, float))):
        raise RunFileError(f"{path}: expected {{\"round\": int, \"metric\": str, \"value\": number}}")
    return rec


def selected_line(record: dict[str, Any], final: dict[str, Any]) -> str:
    """``round R, val/acc = X; its test metrics: test/acc = Y, ...`` (``record``: ``best.json``; ``final``: the
    last row with ``selected/*``) for summaries."""
    from .reporting.fmt import _fmt

    text = f"round {record['round']}, {record['metric']} = {_fmt(record['value'])}"
    tests = [(k[len(SELECTED) + 1:], v) for k, v in final.items()  # not a family's members (test/acc/3)
             if k.startswith(f"{SELECTED}/") and k.count("/") == 2 and not k.startswith(f"{SELECTED}/val/")]
    if tests:
        text += "; its test metrics: " + ", ".join(f"{k} = {_fmt(v)}" for k, v in tests)
    return text
