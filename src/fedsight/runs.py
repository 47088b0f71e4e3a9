"""Run directories: the format and its only reader and writer.

Layout::

    RUN_DIR/config.json          resolved config (also config.toml for reading)
    RUN_DIR/run.json             what the run logs: every metric's direction (higher or lower is better),
                                 the primary metric, what the model was built for (model_io), and where
                                 each session ran (device, threads, versions, git commits, command line)
    RUN_DIR/status.json          {"state": "running" | "stopped" | "interrupted" | "complete", "round": r, "rounds": R}
    RUN_DIR/metrics.jsonl        one JSON object per round (and ``{"event": ...}`` lines)
    RUN_DIR/client_weights.jsonl each round's aggregated clients and their normalised weights
    RUN_DIR/client_metrics.jsonl each evaluated round's local-test metrics of every client (eval.local)
    RUN_DIR/checkpoints/round-000007.safetensors + round-000007.json
    RUN_DIR/plots/*.png, RUN_DIR/summary.md
    RUN_DIR/tensorboard/         TensorBoard event files (``[run] tensorboard = true``)
    RUN_DIR/best.safetensors     the global model best on validation, and best.json: its round, metric and
                                 value (``[eval] select = "best"``: ``fedsight.model_selection``)
    RUN_DIR/mlflow/, mlflow.json MLflow tracking: the local store, and the MLflow run's id (``[run] mlflow =
                                 true``: ``fedsight.mlflow_tracking``)

A checkpoint is a safetensors file with every tensor of the run state and a JSON file with the rest
(round, stage, RNG states as tensors, optimizer hyper-parameters, the sha256 of the safetensors file).
Both are written to a temporary name and renamed; the JSON is written last and is the commit marker, so
a checkpoint with a missing or mismatching safetensors file is ignored. Nothing is pickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save_file

from .errors import RunFileError
from .run_lock import Replacement, RunInUse, RunLock  # noqa: F401  (re-exported: callers import them from here)
from .safe_read import MAX_JSON_BYTES, MAX_NPZ_BYTES, exists, loads_json
from .safe_read import read_bytes as _read_bytes
from .safe_read import read_text as _read_bounded
from .safe_write import append_line, atomic_write_bytes, atomic_write_text, enclosing_run, file_mode

__all__ = ["atomic_write_bytes", "atomic_write_text", "enclosing_run"]  # the writers' home is fedsight.safe_write; kept here too

CKPT_DIR = "checkpoints"
CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
RUN_META_FILE = "run.json"
EVALUATIONS_FILE = "evaluations.jsonl"
STATUS_FILE = "status.json"
CLIENT_METRICS_FILE = "client_metrics.jsonl"
#: the engine's per-client evaluation, written to ``CLIENT_METRICS_FILE`` instead of ``metrics.jsonl``
CLIENT_METRICS_EVENT = "client_metrics"
StrPath = str | os.PathLike[str]


def round_(x: float) -> float:
    return float(f"{x:.6g}")


# -- reading the logs -------------------------------------------------------------------------------


def _run_file(run_dir: StrPath, name: str) -> tuple[Path, str]:
    """(path, text) of a run directory's file; a missing one says the folder may not be a run."""
    path = Path(run_dir) / name
    try:
        return path, read_text(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file (is {Path(run_dir)} a FedSight run directory?)") from None


#: the largest checkpoint tensor file read
MAX_CHECKPOINT_BYTES = MAX_NPZ_BYTES
#: the largest run file read (``metrics.jsonl`` of a long run with per-class metrics stays far below)
MAX_RUN_FILE_BYTES = 4 * MAX_JSON_BYTES


def read_text(path: Path) -> str:
    """A run file's text through the bounded reader (``fedsight.safe_read``): a FIFO, device or folder in its
    place is refused at once, as is a file past :data:`MAX_RUN_FILE_BYTES` or one that is not UTF-8 (a
    ``RunFileError`` naming it; ``FileNotFoundError`` when it is missing)."""
    return _read_bounded(path, "", MAX_RUN_FILE_BYTES, RunFileError)


def _loads(where: str, text: str) -> Any:
    """``text`` parsed as JSON; a nesting or digit bomb is a ``RunFileError`` naming ``where`` (``file`` or
    ``file:line``); invalid JSON is left to the caller (``json.JSONDecodeError``)."""
    return loads_json(text, where, RunFileError)


def _jsonl(path: Path, text: str, torn: list[int] | None = None) -> list[tuple[int, Any]]:
    """(line number, parsed value) of each line of a JSONL log; blank lines and a torn last line (no newline
    after it, not JSON: a crash in the middle of an append, which ``resume`` drops) are skipped, the torn line's
    number appended to ``torn`` when given; any other line that is not JSON is a ``RunFileError`` naming
    ``file:line``."""
    lines = text.splitlines()
    out = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            out.append((lineno, _loads(f"{path}:{lineno}", line)))
        except json.JSONDecodeError as e:
            if lineno == len(lines) and not text.endswith("\n"):
                if torn is not None:
                    torn.append(lineno)
                continue
            raise RunFileError(f"{path}:{lineno}: invalid JSON: {e.msg}") from None
    return out


def _json_object(path: Path, text: str) -> dict[str, Any]:
    """``text`` (the content of ``path``) parsed as a JSON object; a ValueError naming the file otherwise."""
    try:
        obj = _loads(str(path), text)
    except json.JSONDecodeError as e:
        raise RunFileError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
    if not isinstance(obj, dict):
        raise RunFileError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def read_config(run_dir: StrPath) -> dict[str, Any]:
    """The resolved config of a run: the parsed ``RUN_DIR/config.json``.

    Raises ``FileNotFoundError`` or ``ValueError`` naming the file when it is missing, is not valid
    JSON, or is not a JSON object.
    """
    return _json_object(*_run_file(run_dir, CONFIG_FILE))


def _kept(r: Any, event: bool, last_round: int) -> bool:
    """Whether a run file's line of round ``r`` survives a resume from round ``last_round``."""
    if not isinstance(r, int):
        return True
    if r == 0 == last_round and not event:  # the initial model's evaluation is redone
        return False
    return r <= last_round


def read_metrics(run_dir: StrPath) -> list[dict[str, Any]]:
    """All records of ``RUN_DIR/metrics.jsonl``, in file order, event lines included.

    Blank lines are skipped, and so is a torn last line (no newline after it, not JSON: a crash in the middle of an
    append, which ``resume`` drops too), so a killed run reads as its complete rounds. Any other line that is not a
    JSON object, or a metrics line (one without ``"event"``) whose ``"round"`` is not an integer, raises
    ``ValueError`` naming ``file:line``.
    """
    path, text = _run_file(run_dir, METRICS_FILE)
    records: list[dict[str, Any]] = []
    for lineno, rec in _jsonl(path, text):
        if not isinstance(rec, dict):
            raise RunFileError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
        if "event" not in rec:
            rnd = rec.get("round")
            if not isinstance(rnd, int) or isinstance(rnd, bool):
                raise RunFileError(f"{path}:{lineno}: metrics line needs an integer 'round', got {rnd!r}")
        records.append(rec)
    return records


def last_values(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Each metric's last logged value over the metric lines of ``records`` (event lines skipped)."""
    out: dict[str, Any] = {}
    for rec in records:
        if "event" not in rec:
            out.update(rec)
    return out


def read_run_meta(run_dir: StrPath) -> dict[str, Any] | None:
    """``RUN_DIR/run.json`` (None for a run written before it existed); a damaged file names itself."""
    path = Path(run_dir) / RUN_META_FILE
    if not exists(path):  # anything there (a FIFO, a folder) is read, and refused, by the bounded reader
        return None
    meta = _json_object(path, read_text(path))
    if not isinstance(meta.get("metrics", {}), dict):
        raise RunFileError(f"{path}: expected a JSON object with a 'metrics' table")
    return meta


#: a run's states: "running" (or killed while running), "stopped" (``stop_after``), "interrupted" (Ctrl-C or
#: SIGTERM, at its last completed round), "complete"
INTERRUPTED = "interrupted"
STATES = ("running", "stopped", INTERRUPTED, "complete")


def read_status(run_dir: StrPath) -> dict[str, Any]:
    """``RUN_DIR/status.json`` ({} before the first round); one whose state, round or rounds are not of the
    recorded kinds is a ``RunFileError`` naming it."""
    path = Path(run_dir) / STATUS_FILE
    if not exists(path):  # anything there (a FIFO, a folder) is read, and refused, by the bounded reader
        return {}
    status = _json_object(path, read_text(path))
    counts = [status.get(k) for k in ("round", "rounds")]
    if status.get("state") not in STATES or not all(type(c) is int and c >= 0 for c in counts):
        raise RunFileError(f"{path}: expected {{\"state\": one of {', '.join(STATES)}, \"round\": int, \"rounds\": int}}, "
                           f"got {json.dumps(status)[:120]}")
    return status


# -- nested state <-> (JSON, flat tensors) ----------------------------------------------------------


def pack_state(obj: Any, tensors: dict[str, torch.Tensor], prefix: str) -> Any:
    """Replace every tensor in a nested dict/list structure by ``{"__tensor__": key}``."""
    if isinstance(obj, torch.Tensor):
        key = prefix
        tensors[key] = obj.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            tag = f"{type(k).__name__[0]}:{k}"  # keep int keys (optimizer state) distinct from str keys
            out[tag] = pack_state(v, tensors, f"{prefix}/{k}")
        return {"__dict__": out}
    if isinstance(obj, (list, tuple)):
        return {"__list__": [pack_state(v, tensors, f"{prefix}/{i}") for i, v in enumerate(obj)], "tuple": isinstance(obj, tuple)}
    if isinstance(obj, (bool, int, float, str)) or obj is None:
        return obj
    raise TypeError(f"cannot checkpoint value of type {type(obj).__name__} at {prefix}")


def _state_digest(packed: Any) -> str:
    """SHA-256 of a packed state's JSON structure (the marker records it: the tensors' SHA-256 alone would
    let an edited or damaged non-tensor entry through)."""
    return hashlib.sha256(json.dumps(packed, sort_keys=True).encode()).hexdigest()


def unpack_state(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]].clone()
        if "__dict__" in obj:
            out = {}
            for tag, v in obj["__dict__"].items():
                kind, key = tag.split(":", 1)
                out[int(key) if kind == "i" else key] = unpack_state(v, tensors)
            return out
        if "__list__" in obj:
            items = [unpack_state(v, tensors) for v in obj["__list__"]]
            return tuple(items) if obj.get("tuple") else items
    return obj


class RunDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        #: this session's TensorBoard writer (``fedsight.tensorboard.EventLog``), opened by the first logged round
        self.events: Any = None
        #: this session's MLflow run (``fedsight.mlflow_tracking.MlflowLog``; ``[run] mlflow = true``)
        self.tracking: Any = None

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def ckpt_dir(self) -> Path:
        return self.path / CKPT_DIR

    def exists(self) -> bool:
        return (self.path / "config.json").is_file()

    def read_config(self) -> dict[str, Any]:
        return read_config(self.path)

    def write_config(self, resolved: dict[str, Any], toml_text: str) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path / "config.toml", toml_text)  # first: config.json marks the directory as a run
        atomic_write_text(self.path / "config.json", json.dumps(resolved, indent=2, sort_keys=True) + "\n")

    def append_metrics(self, row: dict[str, Any]) -> None:
        append_line(self.metrics_path, json.dumps(row) + "\n")

    def log_events(self, r: int, row: dict[str, Any]) -> None:
        """Round ``r``'s metrics into the TensorBoard event files (``[run] tensorboard = true``)."""
        if self.events is None:
            from .tensorboard import EventLog

            earlier = [x for x in self.read_metrics() if "event" not in x] if self.metrics_path.is_file() else []
            self.events = EventLog(self.path, first_round=r, earlier=earlier)
        self.events.round(r, row)

    def open_tracking(self, settings: Any) -> None:
        """Connect this session's MLflow run (``settings``: the ``[run]`` section), level with ``metrics.jsonl``
        (``fedsight.mlflow_tracking``); nothing without ``mlflow = true`` or when already open."""
        if settings.mlflow and self.tracking is None:
            from .mlflow_tracking import MlflowLog

            self.tracking = MlflowLog(self, settings.mlflow_uri, settings.mlflow_experiment)

    def track(self, r: int, row: dict[str, Any], settings: Any) -> None:
        """Round ``r``'s metrics into MLflow, after its checkpoint (the first call opens the MLflow run, which
        logs every row of ``metrics.jsonl`` it lacks, this one's included)."""
        if self.tracking is None:
            self.open_tracking(settings)
        else:
            self.tracking.round(r, row)

    def close_events(self) -> None:
        if self.events is not None:
            self.events.close()
            self.events = None
        if self.tracking is not None:
            tracking, self.tracking = self.tracking, None
            tracking.close(self.read_status().get("state"))

    def append_client_metrics(self, row: dict[str, Any]) -> None:
        """One line of ``client_metrics.jsonl``: an evaluated round's local-test metrics of every client."""
        append_line(self.path / CLIENT_METRICS_FILE, json.dumps(row) + "\n", sync=False)

    def read_client_metrics(self) -> list[dict[str, Any]]:
        """Every line of ``client_metrics.jsonl`` (``[]`` without local evaluation)."""
        path = self.path / CLIENT_METRICS_FILE
        out = []
        for lineno, rec in _jsonl(path, read_text(path)) if exists(path) else []:
            if not (isinstance(rec, dict) and isinstance(rec.get("clients"), dict)):
                raise RunFileError(f"{path}:{lineno}: expected {{\"round\": int, \"clients\": {{...}}}}")
            out.append(rec)
        return out

    def append_evaluation(self, row: dict[str, Any]) -> None:
        """One line of ``evaluations.jsonl``: a later evaluation of the run's trained model (``fedsight
        evaluate``)."""
        append_line(self.path / EVALUATIONS_FILE, json.dumps(row) + "\n")

    def read_metrics(self) -> list[dict[str, Any]]:
        """Every line of metrics.jsonl (``[]`` before the first round)."""
        return read_metrics(self.path) if exists(self.metrics_path) else []

    def read_status(self) -> dict[str, Any]:
        return read_status(self.path)

    def write_status(self, state: str, round: int, rounds: int, **extra: Any) -> None:
        """``status.json``; ``extra``: further keys (``failed``: what failed after the last round)."""
        atomic_write_text(self.path / STATUS_FILE,
                          json.dumps({"state": state, "round": round, "rounds": rounds, **extra}) + "\n")

    def write_run_meta(self, metrics: dict[str, bool | None], primary: str, session: dict[str, Any],
                       model_io: dict[str, Any] | None = None) -> None:
        """Record the run's metric directions and primary metric, what its model was built for (``model_io``:
        ``fedsight.load_run`` rebuilds the model from it without the data), and append this session's
        environment (a resumed run adds a session: it may run on another device)."""
        old = read_run_meta(self.path) or {}
        sessions = list(old.get("sessions", [])) + [session]
        meta = {"format": 1, "primary": primary, "metrics": dict(sorted(metrics.items())), "sessions": sessions}
        if model_io is not None:
            meta["model_io"] = model_io
        atomic_write_text(self.path / RUN_META_FILE, json.dumps(meta, indent=1) + "\n")

    def truncate_metrics(self, last_round: int) -> list[str]:
        """Drop rows of rounds after ``last_round`` (written after the last checkpoint of a killed run; at
        ``last_round`` 0 the initial model's evaluation too, which the resumed run redoes), and a
        torn last line (a crash in the middle of an append). Returns what was repaired; any other line that is
        not a JSON object is a ``RunFileError`` naming ``file:line``, raised before either file is rewritten."""
        repaired, keep = [], {}
        for path in (self.metrics_path, self.weights_path, self.path / CLIENT_METRICS_FILE):
            if not exists(path):
                continue
            text = read_text(path)
            torn: list[int] = []
            rows = []
            for i, row in _jsonl(path, text, torn):
                if not isinstance(row, dict):
                    raise RunFileError(f"{path}:{i}: expected a JSON object, got {type(row).__name__}")
                rows.append(row)
            repaired += [f"{path.name}:{i}: a torn last line was dropped" for i in torn]
            keep[path] = [r for r in rows if _kept(r.get("round"), "event" in r, last_round)]
        for path, kept in keep.items():
            atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
        return repaired

    #: what a run writes, by kind: a file or a folder already there in place of one stops the run before it starts
    OUTPUTS = {"file": ("config.json", "config.toml", METRICS_FILE, "client_weights.jsonl", CLIENT_METRICS_FILE, STATUS_FILE, RUN_META_FILE,
                        "partition.json", "model.safetensors", "summary.md", "plots/curves.png",
                        "plots/client_weights.png", "best.safetensors", "best.json", "mlflow.json"),
               "folder": (CKPT_DIR, "client_state", "plots", "tensorboard", "private", "mlflow")}

    def check_layout(self) -> None:
        """A ``RunFileError`` if something other than a file (a folder) stands where the run writes a file, or
        a file where it keeps a folder, or a symbolic link in place of either (the run would write through it, or
        replace it mid-run): found before the run starts, not after a round is recorded."""
        for kind, names in self.OUTPUTS.items():
            for name in names:
                p = self.path / name
                if p.is_symlink():
                    raise RunFileError(f"{p}: a symbolic link, but the run writes its {name} there; move it away")
                if p.exists() and not (p.is_file() if kind == "file" else p.is_dir()):
                    raise RunFileError(f"{p}: not a {kind}, but the run writes its {name} there; move it away")

    @property
    def weights_path(self) -> Path:
        return self.path / "client_weights.jsonl"

    def append_client_weights(self, round: int, clients: list[int], weights: Any) -> None:
        """One line per round: the aggregated clients and their normalised weights (a list, or per
        state key a list for layer-/block-level weighting)."""
        if isinstance(weights, dict):
            w: Any = {k: [round_(v) for v in t.tolist()] for k, t in weights.items()}
        else:
            w = [round_(v) for v in torch.as_tensor(weights).tolist()]
        append_line(self.weights_path, json.dumps({"round": round, "clients": clients, "weights": w}) + "\n",
                    sync=False)

    def read_client_weights(self) -> list[dict[str, Any]]:
        if not exists(self.weights_path):
            return []
        out = []
        for lineno, rec in _jsonl(self.weights_path, read_text(self.weights_path)):
            if not (isinstance(rec, dict) and type(rec.get("round")) is int and isinstance(rec.get("clients"), list)
                    and isinstance(rec.get("weights"), (list, dict))):
                raise RunFileError(f"{self.weights_path}:{lineno}: expected {{\"round\": int, \"clients\": [...], "
                                   "\"weights\": [...]}")
            out.append(rec)
        return out

    # -- checkpoints ------------------------------------------------------------------------------

    def save_checkpoint(self, round: int, state: dict[str, Any], keep_last: int) -> Path:
        tensors: dict[str, torch.Tensor] = {}
        packed = pack_state(state, tensors, "s")
        stem = self.ckpt_dir / f"round-{round:06d}"
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.ckpt_dir, prefix=".ckpt.", suffix=".tmp")
        os.close(fd)
        try:
            save_file(tensors, tmp)
            data = Path(tmp).read_bytes()
            os.chmod(tmp, file_mode(stem.with_suffix(".safetensors")))  # not mkstemp's 0600: as any file written
            os.replace(tmp, stem.with_suffix(".safetensors"))
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        meta = {"round": round, "sha256": hashlib.sha256(data).hexdigest(), "state": packed,
                "state_sha256": _state_digest(packed)}
        atomic_write_text(stem.with_suffix(".json"), json.dumps(meta))
        if keep_last > 0:
            for old in self.checkpoints()[:-keep_last]:  # the marker last: a kill in between leaves a marker
                old.with_suffix(".safetensors").unlink(missing_ok=True)  # whose tensors fail the check (skipped)
                old.with_suffix(".json").unlink(missing_ok=True)
        return stem

    def sweep_leftovers(self) -> list[str]:
        """Delete what an interrupted writer leaves behind (FedSight is a run directory's only writer, so
        on resume nothing is mid-write): temporary files of atomic writes and checkpoints, and a checkpoint's
        tensor file or marker without the other. Returns the names deleted."""
        gone = []
        leftovers = [*self.path.glob(".*.tmp"), *self.path.glob("client_state/*/.*.tmp"), *self.path.glob("plots/.*.tmp"),
                     *self.path.glob("private/.*.tmp")]  # (the server's central-DP secret: fedsight.central_dp)
        if self.ckpt_dir.is_dir():
            leftovers += self.ckpt_dir.glob(".*.tmp")
            for f in self.ckpt_dir.glob("round-*.safetensors"):
                if not f.with_suffix(".json").is_file():
                    leftovers.append(f)
            for f in self.ckpt_dir.glob("round-*.json"):
                if not f.with_suffix(".safetensors").is_file():
                    leftovers.append(f)
        for f in leftovers:
            f.unlink(missing_ok=True)
            gone.append(f.relative_to(self.path).as_posix())
        return sorted(gone)

    def checkpoints(self) -> list[Path]:
        """Committed checkpoint stems (JSON marker present), oldest first."""
        if not self.ckpt_dir.is_dir():
            return []
        return sorted(p.with_suffix("") for p in self.ckpt_dir.glob("round-*.json"))

    def load_latest_checkpoint(self, notes: list[str] | None = None) -> tuple[int, dict[str, Any]] | None:
        """(round, state) of the newest intact checkpoint, or None if there is none. A checkpoint is
        intact when its marker is a JSON object whose round matches its file name and whose ``state`` refers
        only to tensors present in a tensor file of the recorded SHA-256; the newer ones that are not are skipped
        (never deleted: ``sweep_leftovers`` removes only half-written ones), each with a line in ``notes``."""
        notes = [] if notes is None else notes
        for stem in reversed(self.checkpoints()):
            name = stem.relative_to(self.path).as_posix()
            try:
                meta = _loads(str(stem.with_suffix(".json")), read_text(stem.with_suffix(".json")))
                data = _read_bytes(stem.with_suffix(".safetensors"), "", MAX_CHECKPOINT_BYTES, RunFileError)
                ok = (isinstance(meta, dict) and meta.get("round") == int(stem.name.split("-")[1]) and "state" in meta
                      and hashlib.sha256(data).hexdigest() == meta.get("sha256")
                      and meta.get("state_sha256", _state_digest(meta["state"])) == _state_digest(meta["state"]))
                if ok:
                    return meta["round"], unpack_state(meta["state"], load(data))
                notes.append(f"{name} is damaged (marker or tensors do not match); skipped")
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, ValueError, TypeError,
                    AttributeError, SafetensorError) as exc:
                notes.append(f"{name} is damaged ({type(exc).__name__}); skipped")
        return None
