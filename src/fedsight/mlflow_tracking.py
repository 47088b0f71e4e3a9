"""MLflow tracking of a run (``[run] mlflow = true``), through MLflow's own client (``MlflowClient``).

The same content as the TensorBoard log (``fedsight.tensorboard``): every numeric metric of every row of
``metrics.jsonl`` at step = round (events are not metrics; a key's ``/`` after the first becomes ``.``,
``metric_name``: ``test/acc/3`` is ``test/acc.3``), and, when the run completes, its plots with
``summary.md`` and ``config.toml`` as artefacts. Params: the flattened resolved config (``train.lr``,
``partition.alpha``; a list as its text); tags: ``fedsight.commit`` (FedSight's source tree, ``-dirty`` when it
has changes), ``mlflow.source.git.commit`` (the working directory's, MLflow's own tag), ``fedsight.variant``
(the run's name: a sweep's variant), ``fedsight.seed``, ``fedsight.run_dir``.

Where it goes (choices made):

* By default a **local file store inside the run directory**, ``RUN_DIR/mlflow`` (``mlflow ui
  --backend-store-uri RUN_DIR/mlflow``). The run directory stays the one place that holds a run, with one
  writer (its lock): the store moves, is copied and is deleted (``--overwrite``) with the run, works offline,
  and needs no server. A SQLite store would need MLflow's schema migrations on creation (about 20 s here, per
  run) and more packages; MLflow 3 keeps the file store in maintenance mode behind ``MLFLOW_ALLOW_FILE_STORE``,
  which FedSight sets (unless already set) for file stores only; ``mlflow migrate-filestore`` converts one.
* ``run.mlflow_uri`` sends the run to any other tracking URI instead (``http://host:5000``,
  ``sqlite:///runs/mlflow.db``): the store a sweep's runs share, side by side, under the experiment
  ``run.mlflow_experiment``. The MLflow run's id is kept in ``RUN_DIR/mlflow.json`` either way.

Resume: each round is logged after its checkpoint, so what MLflow holds never runs ahead of what a resumed run
redoes. A session starts by comparing the MLflow run with ``metrics.jsonl`` (already cut back to the
checkpoint it resumes from): every (metric, round) missing is logged (a kill between a checkpoint and its
logging), none twice; and where the MLflow run holds a round past the last one kept (the newest checkpoint was
damaged and the run resumes from an older one), whose values MLflow cannot delete, that MLflow run is deleted
and a new one logs every round again. So every round appears once, with the values of ``metrics.jsonl``. A run
whose ``run.mlflow`` is turned on later logs its earlier rounds the same way. The MLflow run's status follows
``status.json``: FINISHED when complete, KILLED when stopped or interrupted, FAILED when a session failed.

``mlflow`` is imported only when a run tracks with it (the import takes seconds). Needs ``pip install
'fedsight[mlflow]'`` (``mlflow-skinny``); ``run.mlflow = true`` without it fails at validation, before
anything runs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from pathlib import Path
from typing import Any

from .errors import TrackingError

STORE_DIR = "mlflow"
RUN_FILE = "mlflow.json"
#: MLflow's batch limits (``log_batch``): metrics and params+tags per call
_MAX_METRICS, _MAX_PARAMS = 1000, 100
#: MLflow's longest param value
_MAX_PARAM_CHARS = 6000


def available() -> bool:
    return importlib.util.find_spec("mlflow") is not None


def tracking_uri(run_dir: str | Path, uri: str | None) -> str:
    """``uri``, or the file store ``RUN_DIR/mlflow`` as a ``file://`` URI."""
    return uri or (Path(run_dir).resolve() / STORE_DIR).as_uri()


def _is_file_store(uri: str) -> bool:
    return uri.startswith("file:") or "://" not in uri and not uri.startswith(("databricks", "sqlite", "http"))


def _key(key: str) -> str:
    """A metric or param name as MLflow accepts it (letters, digits, ``_ - . / :`` and spaces; others become
    ``_``)."""
    return re.sub(r"[^\w\-./: ]", "_", key)


def metric_name(key: str) -> str:
    """The MLflow name of a metric key: every ``/`` after the first becomes ``.`` (``test/acc/3`` ->
    ``test/acc.3``, ``selected/test/acc`` -> ``selected/test.acc``). MLflow's file store keeps a metric in a file
    named by its key, so ``test/acc`` and ``test/acc/3`` could not both exist; the first ``/`` stays, the group
    MLflow's UI shows a metric under."""
    head, sep, rest = _key(key).partition("/")
    return head + sep + rest.replace("/", ".")


def _numbers(row: dict[str, Any]) -> dict[str, float]:
    return {metric_name(k): float(v) for k, v in row.items()
            if k not in ("round", "event") and isinstance(v, (int, float)) and not isinstance(v, bool)}


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        elif v is not None:
            text = json.dumps(v) if isinstance(v, (list, bool)) else str(v)
            out[_key(key)] = text if len(text) <= _MAX_PARAM_CHARS else text[:_MAX_PARAM_CHARS - 1] + "…"
    return out


def _tags(config: dict[str, Any], run_dir: Path) -> dict[str, str]:
    from . import __version__
    from .provenance import git_commit

    run = config.get("run") or {}
    tags = {"fedsight.variant": str(run.get("name", "")), "fedsight.seed": str(config.get("seed", "")),
            "fedsight.run_dir": str(run_dir.resolve()), "fedsight.version": __version__,
            "mlflow.runName": f"{run.get('name', 'run')}/seed{config.get('seed', '')}"}
    own = git_commit(str(Path(__file__).resolve().parent))
    if own is not None:
        tags["fedsight.commit"] = own["commit"] + ("-dirty" if own["dirty"] else "")
    cwd = git_commit(str(Path.cwd()))
    if cwd is not None:
        tags["mlflow.source.git.commit"] = cwd["commit"]
    return tags


class MlflowLog:
    """One session's MLflow run of ``run`` (a ``runs.RunDir``), found again through ``RUN_DIR/mlflow.json`` or
    created, and brought level with ``metrics.jsonl`` (see the module docstring)."""

    def __init__(self, run: Any, uri: str | None, experiment: str):
        self.run_dir = Path(run.path)
        self.uri = tracking_uri(self.run_dir, uri)
        self.finished = False
        try:
            self._open(run, experiment)
        except TrackingError:
            raise
        except Exception as exc:  # noqa: BLE001 - an unreachable server, a damaged store: one line, not a traceback
            raise TrackingError(f"MLflow tracking at {self.uri}: {_first_line(exc)}") from None

    def _open(self, run: Any, experiment: str) -> None:
        if _is_file_store(self.uri):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # (MLflow 3's file store: the module docstring)
            from mlflow.store.tracking.file_store import FileStore

            # MLflow caches a store per URI for the process's life: one whose folder went (a run started over in
            # this process, --overwrite) would fail; a FileStore made here lays the folder out again
            FileStore(self.uri, self.uri)
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.uri)
        rows = [r for r in run.read_metrics() if "event" not in r] if run.metrics_path.is_file() else []
        self.run_id = self._known_run()
        logged = self._logged() if self.run_id is not None else {}
        last = max((int(r["round"]) for r in rows), default=-1)
        if self.run_id is not None and any(s > last for steps in logged.values() for s in steps):
            self.client.delete_run(self.run_id)  # it holds rounds this run redoes: MLflow cannot delete a value
            self.run_id, logged = None, {}
        if self.run_id is None:
            self._create(run, experiment)
        else:
            self.client.update_run(self.run_id, status="RUNNING")
        missing = []
        for row in rows:
            r = int(row["round"])
            missing += [(k, v, r) for k, v in _numbers(row).items() if r not in logged.get(k, ())]
        self._log(missing)

    def _known_run(self) -> str | None:
        """The run id in ``mlflow.json`` when it names an active run of this store."""
        from .safe_read import exists, read_text

        path = self.run_dir / RUN_FILE
        if not exists(path):
            return None
        try:
            rec = json.loads(read_text(path, error=TrackingError))
        except ValueError:
            return None  # damaged: a new MLflow run logs every round
        if not isinstance(rec, dict) or rec.get("uri") != self.uri or not isinstance(rec.get("run_id"), str):
            return None  # another store (run.mlflow_uri changed): a run of its own there
        try:
            found = self.client.get_run(rec["run_id"])
        except Exception:  # noqa: BLE001 - not in this store (deleted, or the store was removed)
            return None
        return rec["run_id"] if found.info.lifecycle_stage == "active" else None

    def _logged(self) -> dict[str, set[int]]:
        """The steps the MLflow run holds, per metric."""
        keys = self.client.get_run(self.run_id).data.metrics
        return {k: {m.step for m in self.client.get_metric_history(self.run_id, k)} for k in keys}

    def _create(self, run: Any, experiment: str) -> None:
        from mlflow.entities import Param

        from .safe_write import atomic_write_text

        found = self.client.get_experiment_by_name(experiment)
        if found is not None and found.lifecycle_stage == "active":
            exp_id = found.experiment_id
        else:
            try:
                exp_id = self.client.create_experiment(experiment)
            except Exception:  # noqa: BLE001 - another process of a sweep created it meanwhile
                exp_id = self.client.get_experiment_by_name(experiment).experiment_id
        config = run.read_config()
        tags = _tags(config, self.run_dir)
        created = self.client.create_run(exp_id, tags=tags, run_name=tags["mlflow.runName"])
        self.run_id = created.info.run_id
        params = [Param(k, v) for k, v in _flat(config).items()]
        for i in range(0, len(params), _MAX_PARAMS):
            self.client.log_batch(self.run_id, params=params[i:i + _MAX_PARAMS], synchronous=True)
        atomic_write_text(self.run_dir / RUN_FILE, json.dumps({"uri": self.uri, "run_id": self.run_id,
                                                               "experiment_id": exp_id}) + "\n")

    def _log(self, values: list[tuple[str, float, int]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, r) for k, v, r in values]
        for i in range(0, len(metrics), _MAX_METRICS):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + _MAX_METRICS], synchronous=True)

    def round(self, r: int, row: dict[str, Any]) -> None:
        """Round ``r``'s metrics (after its checkpoint)."""
        self._guard(self._log, [(k, v, r) for k, v in _numbers(row).items()])

    def finish(self, run_dir: Path) -> None:
        """The finished run's plots, ``summary.md`` and ``config.toml`` as artefacts; the MLflow run FINISHED."""
        def _finish() -> None:
            run_dir_ = Path(run_dir)
            for name in ("summary.md", "config.toml"):
                if (run_dir_ / name).is_file():
                    self.client.log_artifact(self.run_id, str(run_dir_ / name))
            for png in sorted((run_dir_ / "plots").glob("*.png")):
                self.client.log_artifact(self.run_id, str(png), artifact_path="plots")
            self.client.set_terminated(self.run_id, status="FINISHED")

        self._guard(_finish)
        self.finished = True

    def close(self, state: str | None) -> None:
        """End this session: a run that did not finish is KILLED (stopped or interrupted, ``state``) or FAILED."""
        if not self.finished:
            status = "KILLED" if state in ("stopped", "interrupted") else "FAILED"
            try:
                self.client.set_terminated(self.run_id, status=status)
            except Exception:  # noqa: BLE001 - closing after a failure: the first failure is the one reported
                pass

    def _guard(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001
            raise TrackingError(f"MLflow tracking at {self.uri}: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return text[:300] + ("…" if len(text) > 300 else "")
