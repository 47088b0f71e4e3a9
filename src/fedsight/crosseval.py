"""Cross-site evaluation: a run's trained model evaluated on another data configuration's clients, and the
matrix of models x sites over several runs (NVFlare's cross-site evaluation: every model on every site's data).

A *site* is a data configuration: the run's config with its ``data``, ``partition``, ``validation`` or
``pretrain`` data settings changed (``SITE_KEYS``): another dataset of the same task, the same dataset read
from another folder, another partition into clients. The evaluation is the one a run does on its evaluation rounds
(``sim.evaluate()``: ``test/*`` of the site's global test set and, with ``eval.local``, ``local/*`` over the
site's clients' local test sets), with nothing trained.

Choices made:

* **What may change.** Settings of evaluation only (``EVALUATION_KEYS``) and the site keys above:
  they choose the examples the model sees, not the model. The run's seed, model, training and recipe stay the
  run's (``--set seed=...`` is refused: it is what the model was trained with).
* **The model must fit the site** (``model_signature``): the site's task must build the same model inputs and
  outputs as the run's (``ModelIO``: channels, image size, number of outputs, SR scale, frames per clip) and
  name its outputs the same (classification and segmentation: the class names in order; keypoints: the joint
  names in order). Any difference is refused before anything is evaluated, in one line naming the keys set,
  the two datasets and what differs. This builds the run's own task too, so the run's data must still be
  readable.
* **Per-client state belongs to the run's clients.** Whether a site's clients are the run's own is decided
  from the resolved config: the site's ``data``, ``partition``, ``validation`` and ``pretrain`` sections equal
  the run's (a partition is a deterministic function of dataset, spec and seed), ignoring the data loaders'
  performance settings (``NEUTRAL_DATA_KEYS``). Then the evaluation is exactly the run's, per-client state
  included. Otherwise (a *cross-site* evaluation) the client ids of the site name other clients, even when their
  count is the same, so no client's personal entries (FedBN/SiloBN normalisation layers, personal heads, Ditto
  models) are used: every site split, its global test set and each client's local test set, is evaluated with
  the global model as the run evaluates its own global test set. For FedBN/SiloBN that is the global model with
  the personal entries replaced by the example-weighted average over the run's clients (weights: their numbers
  of training examples in the run, ``NormSharing.client_average``); with ``test_stats = "fresh"`` the statistics
  are then recomputed on each site split (AdaBN), as in the run; with ``"domain"`` every domain of the site is
  evaluated as the run evaluates an unseen one (fresh statistics on its images). For a personal head or body
  (``personal``, ``local`` sharing) it is the global model's own entries. Each evaluation records which rule applied
  (``clients`` in ``evaluations.jsonl``: ``"own"`` or ``"global model only"``).
* **Inputs are standardised with the site's own training pool's statistics**, as the run's clients standardise
  theirs: each site preprocesses its own data.
* **Which model.** ``model = "last"``: the newest intact checkpoint. ``model = "best"``: the selected best global
  model, ``RUN_DIR/best.safetensors`` (``eval.select = "best"``; a state dict of the global model), loaded over
  the last checkpoint's global model; being one global model, it is evaluated with the global model only, as a
  cross-site evaluation is.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .config import ConfigError, parse_override, set_path, validate
from .crosseval_files import MATRIX_FILES, matrix_csv, matrix_markdown, matrix_rows, write_matrix
from .errors import RunFileError
from .runs import RunDir, RunLock

#: what ``evaluate_run`` may change: settings of evaluation only (a key or a prefix of keys)
EVALUATION_KEYS = ("eval", "engine", "recipe.sharing.test_stats", "task.per_image_miou", "task.eval_pixels",
                   "task.visual_images", "task.workers", "task.backend")
#: config sections that choose a site's data
SITE_SECTIONS = ("data", "partition", "validation", "pretrain")
#: what a cross-site evaluation may change besides evaluation settings: the data sections, of ``[pretrain]`` only
#: which examples the server's pre-training split takes from the pool (its training settings made the model)
SITE_KEYS = ("data", "partition", "validation", "pretrain.source", "pretrain.fraction", "pretrain.classes")

#: ``data`` parameters that change how the data is read, not which examples: ignored when deciding whether a
#: site's clients are the run's own
NEUTRAL_DATA_KEYS = ("workers", "backend", "cache_mb")

#: the models ``evaluate`` can load: the last checkpoint's, or the selected best global model
MODELS = ("last", "best")
BEST_FILE = "best.safetensors"

#: a site's name (``--site NAME:KEY=VALUE``): a column of the matrix and a file-name-safe label
_SITE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")


def _matches(key: str, prefixes: Sequence[str]) -> bool:
    return any(key == k or key.startswith(k + ".") for k in prefixes)


@dataclass(frozen=True)
class Site:
    """A data configuration: a name and the ``--set`` overrides that make it from a run's config (none: the
    run's own data)."""

    name: str
    overrides: tuple[str, ...] = ()


def parse_sites(texts: Sequence[str]) -> list[Site]:
    """``--site NAME:KEY=VALUE`` options (repeatable; the overrides of one NAME accumulate in order) and
    ``--site NAME`` (the run's own data), as sites in the order first named."""
    order: list[str] = []
    sets: dict[str, list[str]] = {}
    for text in texts:
        name, sep, override = text.partition(":")
        name = name.strip()
        if not _SITE_NAME.fullmatch(name):
            raise ConfigError(f"--site {text!r}: expected NAME:KEY=VALUE (NAME: letters, digits, . _ + -), "
                              "e.g. --site other:data.split_seed=1")
        if sep and "=" not in override:
            raise ConfigError(f"--site {text!r}: expected NAME:KEY=VALUE after the site's name")
        if name not in sets:
            order.append(name)
            sets[name] = []
        if sep:
            parse_override(override)  # a malformed key=value fails here, naming it
            sets[name].append(override)
    return [Site(n, tuple(sets[n])) for n in order]


def split_overrides(overrides: Sequence[str]) -> list[tuple[list[str], Any, bool]]:
    """Each override as (path, value, whether it is a site key); an override of anything else is a
    ``ConfigError`` naming it and what may change."""
    out = []
    for text in overrides:
        path, value = parse_override(text)
        key = ".".join(path)
        site = _matches(key, SITE_KEYS)
        if not site and not _matches(key, EVALUATION_KEYS):
            raise ConfigError(f"--set {key}: changes what was trained; evaluate may change only evaluation settings "
                              f"({', '.join(EVALUATION_KEYS)}) and the data it evaluates on ({', '.join(SITE_KEYS)})")
        out.append((path, value, site))
    return out


def site_config(raw: dict[str, Any], changes: Sequence[tuple[list[str], Any, bool]]) -> dict[str, Any]:
    """The run's raw config with ``changes`` applied: a ``data.name`` or ``partition.name`` that names another
    dataset or partitioner starts that section afresh (the run's dataset's parameters would not fit another
    one; ``partition.num_clients`` and ``local_test_fraction`` are kept), and when a site key is set, the
    sampling settings of training (``clients_per_round``, ``fraction``, ``min_clients``, also in stages), which
    an evaluation does not use and which a site with fewer clients could not satisfy, are dropped."""
    raw = json.loads(json.dumps(raw))  # a deep copy of JSON values
    from .config_sections import PARTITION_KEYS

    for section, keep in (("data", ()), ("partition", PARTITION_KEYS)):
        new = [v for p, v, _ in changes if p == [section, "name"]]
        old = raw.get(section, {})
        old_name = old.get("name") if isinstance(old, dict) else old
        if new and new[-1] != old_name and isinstance(old, dict):
            raw[section] = {k: v for k, v in old.items() if k in keep}
    for path, value, _ in changes:
        set_path(raw, path, value)
    if any(site for _, _, site in changes):
        for server in [raw.get("server", {})] + [st.get("server", {}) for st in raw.get("stages", []) or []]:
            if isinstance(server, dict):
                for k in ("clients_per_round", "fraction", "min_clients"):
                    server.pop(k, None)
    return raw


def _data_sections(cfg: Any) -> dict[str, Any]:
    out = {s: getattr(cfg, s).model_dump(mode="json") for s in SITE_SECTIONS}
    out["data"] = {k: v for k, v in out["data"].items() if k not in NEUTRAL_DATA_KEYS}
    return out


# -- the model's signature ---------------------------------------------------------------------------------


def model_signature(task: Any) -> dict[str, Any]:
    """What a task's model takes and gives (``task.model_io``) and the names of its outputs where they have a
    meaning per position: class names (classification, segmentation), joint names (keypoints). Two tasks with
    equal signatures build interchangeable models."""
    io_ = task.model_io
    sig: dict[str, Any] = {"family": io_.family, "in_channels": io_.in_channels, "num_outputs": io_.num_outputs,
                           "image_size": io_.image_size, "scale": io_.scale, "num_frames": io_.num_frames}
    if io_.family == "classification":
        sig["names"] = [str(n) for n in task.splits.train.class_names]
    elif io_.family == "segmentation":
        sig["names"] = [str(n) for n in task.class_names]
    elif io_.family == "keypoints":
        sig["names"] = [str(n) for n in task.skeleton.joint_names]
    return sig


def _names(names: Sequence[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)})" if len(names) > limit else "")


def signature_difference(run: dict[str, Any], site: dict[str, Any]) -> str | None:
    """How the site's model signature differs from the run's, in words (None: they are equal)."""
    outputs, one = {"classification": ("classes", "class"), "segmentation": ("classes", "class"),
                    "keypoints": ("joints", "joint")}.get(run["family"], ("output channels", "output channel"))
    say = {"family": lambda s, r: f"is {s} data, the model a {r} model",
           "in_channels": lambda s, r: f"has {s} input channels, the model {r}",
           "image_size": lambda s, r: f"has {s}x{s} images, the model {r}x{r}",
           "scale": lambda s, r: f"has an upscaling factor of {s}, the model {r}",
           "num_frames": lambda s, r: f"has {s} frames per clip, the model {r}"}
    for key, words in say.items():
        if run[key] != site[key]:
            return words(site[key], run[key])
    if run["num_outputs"] != site["num_outputs"] or len(run.get("names", ())) != len(site.get("names", ())):
        n = len(site["names"]) if "names" in site else site["num_outputs"]
        m = len(run["names"]) if "names" in run else run["num_outputs"]
        listed = f" ({_names(site['names'])})" if "names" in site else ""
        return f"has {n} {outputs}{listed}, the model {m}" + (f" ({_names(run['names'])})" if "names" in run else "")
    if run.get("names") != site.get("names"):
        i = next(i for i, (a, b) in enumerate(zip(run["names"], site["names"])) if a != b)
        return (f"names its {outputs} otherwise: {one} {i} is {site['names'][i]!r}, the model's {run['names'][i]!r} "
                f"(the model's {outputs}: {_names(run['names'])})")
    return None


# -- one run on one site ------------------------------------------------------------------------------------


@dataclass
class Checked:
    """A run and a site, checked and ready to evaluate: the config to evaluate with, whether the site's clients
    are the run's own, and the tasks built on the way (the run's own only for a cross-site evaluation)."""

    run: RunDir
    site: str
    cfg: Any
    changes: dict[str, Any]
    own_clients: bool
    task: Any = None
    run_task: Any = None
    model: str = "last"


class _Tasks:
    """Tasks built once per distinct (task, data, partition, validation, pretrain, model, seed) config, shared
    by the runs and sites that need the same one (a sweep's runs share their sites' data)."""

    def __init__(self) -> None:
        self.cache: dict[str, Any] = {}

    def get(self, cfg: Any) -> Any:
        from .api import build_task

        key = json.dumps({s: getattr(cfg, s).model_dump(mode="json") if hasattr(getattr(cfg, s), "model_dump")
                          else getattr(cfg, s) for s in ("task", "model", "seed", *SITE_SECTIONS)}, sort_keys=True)
        if key not in self.cache:
            self.cache[key] = build_task(cfg)
        return self.cache[key]


def check(run: RunDir, overrides: Sequence[str], site: str = "", model: str = "last",
          tasks: _Tasks | None = None) -> Checked:
    """Parse and validate ``overrides`` of ``run``'s config, decide whether the site's clients are the run's own,
    and for another site build both tasks and refuse a site whose model signature differs. ``site``: the
    site's name, for messages and records. Nothing is evaluated or written."""
    if model not in MODELS:
        raise ConfigError(f"--model {model!r}: expected one of {', '.join(MODELS)}")
    tasks = tasks or _Tasks()
    raw = run.read_config()
    changes = split_overrides(overrides)
    where = f"{run.path / 'config.json'} with --set"
    cfg = validate(site_config(raw, changes), where if not site else f"{where} (site {site})")
    run_cfg = validate(site_config(raw, [c for c in changes if not c[2]]), where)
    own = _data_sections(cfg) == _data_sections(run_cfg)
    if model == "best" and not (run.path / BEST_FILE).is_file():
        raise FileNotFoundError(f"{run.path / BEST_FILE}: no selected best model in this run (it needs "
                                "eval.select = \"best\"); evaluate the last checkpoint with --model last")
    out = Checked(run, site, cfg, {".".join(p): v for p, v, _ in changes}, own and model == "last", model=model)
    if not own:
        keys = [".".join(p) for p, _, s in changes if s]
        out.run_task = tasks.get(run_cfg)
        try:
            out.task = tasks.get(cfg)
        except ConfigError:
            raise
        except (ValueError, FileNotFoundError) as exc:  # the site's data cannot be loaded or partitioned so
            first = " ".join(str(exc).split())
            raise ConfigError(f"--set {', '.join(dict.fromkeys(keys))}: the site's data ({cfg.data.name}"
                              f"{f', site {site}' if site else ''}): {first}") from None
        diff = signature_difference(model_signature(out.run_task), model_signature(out.task))
        if diff is not None:
            keys = [k for k in keys if k.startswith("data.")] or keys  # the data's keys, where some are set
            raise ConfigError(f"--set {', '.join(dict.fromkeys(keys))}: the site's data ({cfg.data.name}"
                              f"{f', site {site}' if site else ''}) {diff}, trained on {run_cfg.data.name}: "
                              "evaluate needs data with the model's inputs and outputs")
    return out


def _load_checkpoint(run: RunDir, sim: Any, client_state: bool) -> tuple[int, dict[str, Any]]:
    """Load the newest intact checkpoint into ``sim`` (``client_state`` False: without the run's per-client
    state, which stays out of this simulation); its round and state."""
    from .api import restore

    if client_state:
        rnd = restore(run, sim)
        if rnd is None:
            raise FileNotFoundError(f"{run.path}: no intact checkpoint to evaluate (run it first, with "
                                    "run.checkpoint_keep >= 1)")
        return rnd, {}
    ckpt = run.load_latest_checkpoint()
    if ckpt is None:
        raise FileNotFoundError(f"{run.path}: no intact checkpoint to evaluate (run it first, with "
                                "run.checkpoint_keep >= 1)")
    rnd, state = ckpt
    try:
        sim.load_state_dict({**state, "client_state": {}})
    except (KeyError, RuntimeError, ValueError, TypeError, IndexError, AttributeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise RunFileError(f"{run.ckpt_dir / f'round-{rnd:06d}.safetensors'}: does not fit this run's model or "
                           f"state ({first[:200]})") from None
    return rnd, state


@torch.no_grad()
def _global_model_only(checked: Checked, sim: Any, state: dict[str, Any]) -> None:
    """Make ``sim``'s global model the one the run evaluates its own global test set with: for a sharing that
    averages the clients' personal entries there (FedBN/SiloBN), the run's clients' example-weighted average
    (weights from the run's own task) replaces the global model's never-aggregated entries."""
    from .state import ClientStateStore
    from .training import EvalContext

    layout = sim.server.layout
    sharing = sim.stages[sim.server.stage_index].recipe.sharing
    if not layout.personal_keys or not hasattr(sharing, "client_average") or not state.get("client_state"):
        return
    run_task = checked.run_task
    if run_task is None:  # the selected best model on the run's own data: the run's task is the one evaluated
        run_task = sim.task
    store = ClientStateStore(checked.run.path / "client_state")
    store.load_state_dict(state["client_state"])
    gstate = sim.global_model.state_dict()
    keys = [k for k in layout.personal_keys if gstate[k].is_floating_point()]
    ctx = EvalContext(run_task, "test", 1, layout.personal_keys, layout.shared_params, store)
    for k, v in sharing.client_average(ctx, keys).items():
        gstate[k].copy_(v)


def _load_best(checked: Checked, sim: Any) -> int | None:
    """Load ``best.safetensors`` into ``sim``'s global model (the whole state dict, strictly); the round it was
    selected at when ``best.json`` beside it says so (else None)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = checked.run.path / BEST_FILE
    try:
        weights = load_file(str(path))
        sim.global_model.load_state_dict(weights, strict=True)
    except (OSError, SafetensorError, RuntimeError, ValueError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise RunFileError(f"{path}: not the run's global model ({first[:200]})") from None
    try:
        meta = json.loads((checked.run.path / "best.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    rnd = meta.get("round") if isinstance(meta, dict) else None
    return rnd if isinstance(rnd, int) and not isinstance(rnd, bool) else None


@dataclass
class Evaluation:
    """One model on one site: the checkpoint's round, the metrics (``sim.evaluate()``'s), each client's local
    metrics and which client state was used."""

    round: int
    stage: str
    metrics: dict[str, float]
    clients: dict[str, dict[str, float]] = field(default_factory=dict)
    client_rule: str = "own"


def evaluate_checked(checked: Checked) -> Evaluation:
    """Evaluate a checked (run, site): the run's last checkpoint (or its selected best model) on the site, as the
    run's evaluation rounds do. Nothing is written."""
    from .api import build_simulation
    from .engine.loop import evaluate

    run = checked.run
    if checked.own_clients:  # the run's own clients: its per-client state, spilled in its folder
        sim = build_simulation(checked.cfg, run_dir=run.path)
        rnd, state = _load_checkpoint(run, sim, client_state=True)
    else:
        sim = build_simulation(checked.cfg, task=checked.task or None)
        rnd, state = _load_checkpoint(run, sim, client_state=False)
        if checked.model == "best":
            rnd = _load_best(checked, sim) or rnd  # the round it was selected at, where best.json says
        _global_model_only(checked, sim, state)
    metrics, events = evaluate(sim.server, sim.backend, sim.round)
    clients = next((e["clients"] for e in events if e.get("event") == "client_metrics"), {})
    return Evaluation(rnd, sim.server.stage, metrics, clients,
                      "own" if checked.own_clients else "global model only")


def record(checked: Checked, ev: Evaluation) -> dict[str, Any]:
    """The ``evaluations.jsonl`` row of an evaluation: what was set, the site and model, the client rule."""
    row: dict[str, Any] = {"round": ev.round, "stage": ev.stage, "set": checked.changes}
    if checked.site:
        row["site"] = checked.site
    if checked.model != "last":
        row["model"] = checked.model
    if not checked.own_clients or checked.site:
        row["clients"] = ev.client_rule
    return {**row, **ev.metrics}


def evaluate_one(run_dir: str | Path, overrides: Sequence[str] = (), model: str = "last") -> tuple[Checked, Evaluation]:
    """``fedsight evaluate RUN_DIR --set ...``: check, evaluate, append to ``evaluations.jsonl`` (under the run's
    lock; nothing is written when a check fails)."""
    from .runs import EVALUATIONS_FILE
    from .safe_write import check_output, check_run_dir

    run = RunDir(run_dir)
    if not (run.path / "config.json").is_file():
        raise FileNotFoundError(f"{run.path}: not a run directory (no config.json)")
    check_run_dir(run.path)  # the output guard: not inside another run, not a symbolic link
    check_output(run.path / EVALUATIONS_FILE, owner=run.path, exists_ok=True)  # appended to: a regular file or nothing
    with RunLock(run.path):  # not while the run itself is training (or evaluated by another process)
        checked = check(run, overrides, model=model)
        ev = evaluate_checked(checked)
        run.append_evaluation(record(checked, ev))
    return checked, ev


# -- the matrix ----------------------------------------------------------------------------------------------


@dataclass
class Matrix:
    """Models (runs) x sites: the evaluations, the headline metric and its direction."""

    runs: list[Path]
    labels: list[str]
    sites: list[Site]
    common: tuple[str, ...]
    model: str
    headline: str
    higher_is_better: bool | None
    cells: dict[tuple[int, int], tuple[Checked, Evaluation]]

    def value(self, i: int, j: int, key: str) -> float | None:
        v = self.cells[i, j][1].metrics.get(key)
        return None if v is None else float(v)


def _labels(paths: list[Path]) -> list[str]:
    import os

    if len(paths) == 1:
        return [paths[0].name]
    base = Path(os.path.commonpath([p.absolute() for p in paths]))
    return [p.absolute().relative_to(base).as_posix() or p.name for p in paths]


def cross_evaluate(run_dirs: Sequence[str | Path], sites: Sequence[Site], common: Sequence[str] = (),
                   model: str = "last") -> Matrix:
    """Evaluate every run's model on every site (``common``: overrides applied to every site, before the
    site's own). Every (run, site) is checked before anything is evaluated, and nothing is written here:
    ``append_matrix`` appends the rows to the runs' ``evaluations.jsonl``."""
    from .metric_table import metric_directions

    seen: dict[Path, Path] = {}
    for p in run_dirs:  # a run named twice (a folder and a run inside it) is one row
        seen.setdefault(Path(p).resolve(), Path(p))
    runs = [RunDir(p) for p in seen.values()]
    if not sites:
        raise ConfigError("no site to evaluate on: give --site NAME:KEY=VALUE (or --site NAME for the runs' own data)")
    tasks = _Tasks()
    checked: dict[tuple[int, int], Checked] = {}
    with contextlib.ExitStack() as stack:
        for run in runs:
            if not (run.path / "config.json").is_file():
                raise FileNotFoundError(f"{run.path}: not a run directory (no config.json)")
            stack.enter_context(RunLock(run.path))
        for i, run in enumerate(runs):
            for j, site in enumerate(sites):
                checked[i, j] = check(run, [*common, *site.overrides], site.name, model, tasks)
        heads = {metric_directions(c.cfg)[1] for c in checked.values()}
        if len(heads) > 1:
            raise ConfigError(f"the runs log different primary metrics ({', '.join(sorted(heads))}); cross-evaluate "
                              "runs of one task at a time")
        headline = heads.pop()
        directions = metric_directions(checked[0, 0].cfg)[0]
        cells = {ij: (c, evaluate_checked(c)) for ij, c in checked.items()}
    return Matrix([r.path for r in runs], _labels([r.path for r in runs]), list(sites), tuple(common), model,
                  headline, directions.get(headline), cells)


def append_matrix(matrix: Matrix) -> None:
    """Append each evaluation of ``matrix`` to its run's ``evaluations.jsonl`` (under the run's lock)."""
    for i, path in enumerate(matrix.runs):
        run = RunDir(path)
        with RunLock(run.path):
            for j in range(len(matrix.sites)):
                run.append_evaluation(record(*matrix.cells[i, j]))


__all__ = ["MATRIX_FILES", "MODELS", "SITE_KEYS", "Site", "append_matrix", "check", "cross_evaluate", "evaluate_one",
           "matrix_csv", "matrix_markdown", "matrix_rows", "model_signature", "parse_sites", "signature_difference",
           "write_matrix"]


def evaluate_run(run_dir: str | Path, overrides: Sequence[str] = (), *, model: str = "last") -> tuple[int, dict[str, float]]:
    """Evaluate a run's trained model again, from its last checkpoint (``model = "best"``: its selected best global
    model), with nothing trained. ``overrides`` (``--set`` syntax) may change evaluation settings
    (``EVALUATION_KEYS``, e.g. ``recipe.sharing.test_stats=domain``: SiloBN's statistics by domain instead of fresh
    ones) and the data evaluated on (``fedsight.crosseval.SITE_KEYS``: another dataset of the task, another
    partition: a cross-site evaluation, refused when the data's model inputs or classes differ from the model's;
    ``fedsight.crosseval`` says what happens to per-client state). The metrics go to ``RUN_DIR/evaluations.jsonl``
    and are returned with the checkpoint's round. Overrides of anything that would change what was trained are
    refused, before anything is evaluated or written."""
    _, ev = evaluate_one(run_dir, overrides, model)
    return ev.round, ev.metrics
