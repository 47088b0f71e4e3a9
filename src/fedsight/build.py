"""Build a run's parts from a validated config: the task, the recipe, the local training, the schedule and
stages, the device, the simulation and the server; and the resolved config a run directory records. ``api``
re-exports them; the distributed backend builds its ranks' parts from here."""

from __future__ import annotations

import dataclasses
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import __version__
from . import registry as R
from .capabilities import missing
from .config import ConfigError, provided, requirements, stage_configs
from .device import configure_determinism, configure_threads, describe, keep_freed_memory, resolve_device
from .engine.plan import Recipe, Schedule, Stage, clients_per_round
from .engine.server import Server
from .engine.simulation import Simulation
from .metric_table import metric_directions
from .models.base import detect_capabilities
from .weights import load_checkpoint
from .plugins import load_builtin
from .provenance import provenance
from .recipe.oll import CLASSIFIER_INIT, OLL, OLLEval, auto_lr
from .class_split import chosen_clients
from .secret import server_side
from .state import ClientStateStore
from .tasks.base import Task
from .training.local import SGD_TRAINER, LocalTraining, direction_position, misplaced_after_correction

load_builtin()

OnRound = Callable[[int, dict[str, Any]], None]
#: what a run does now, for a progress display ("loading data", "building the model", ...: ``execute``)
OnPhase = Callable[[str], None]


def _no_phase(text: str) -> None:
    pass


def build_task(cfg: Any) -> Task:
    """The configured task (data loaded, server-held splits carved, partitioned), built by the task's
    registered builder."""
    return R.build(R.TASKS, cfg.task.name, cfg.task, cfg=cfg)


def _claimed(slot: str, components: list[Any], configured: tuple[str, Any] | None = None, what: str | None = None) -> Any:
    """The one part filling an exclusive slot: the configured one (``(label, part)``) or the one a
    component requires via ``component.<slot>()``; None if nobody claims it. Two claims are an error."""
    claims = [(c.name, getattr(c, slot)()) for c in components]
    claims = [(n, part) for n, part in claims if part is not None]
    if configured is not None:
        claims.insert(0, configured)
    if len(claims) > 1:
        raise ConfigError(f"recipe: {' and '.join(n for n, _ in claims)} both set the {what or slot}; keep one of them")
    return claims[0][1] if claims else None


def _exclusive(slot: str, configured: Any, default: str, registry: R.Registry[Any], components: list[Any]) -> Any:
    """An exclusive recipe slot with a config key: a non-default configured part counts as a claim."""
    part = R.build(registry, configured.name, configured)
    explicit = (f"recipe.{slot} = {configured.name!r}", part) if configured.name != default else None
    return _claimed(slot, components, explicit) or part


def build_recipe(cfg: Any) -> Recipe:
    """The recipe of ``cfg``. ``train.optimizer`` is not a component: the local loop places Adam's transform
    itself (``fedsight.training.local.sgd_steps``: before SCAFFOLD's correction, after every other
    gradient hook), so a gradient-shaping component listed after ``scaffold`` is refused with it."""
    rc = cfg.recipe
    components = [R.build(R.COMPONENTS, c.name, c) for c in rc.components]
    names = [c.name for c in components]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"recipe.components: {', '.join(dup)} listed twice")
    opt = cfg.train.optimizer  # (local_adam with it: refused when the config is validated, local_adam's check)
    if opt != "sgd" and (late := misplaced_after_correction(components)):
        first = components[direction_position(components)].name
        raise ConfigError(f"recipe.components: list {', '.join(late)} before {first}: with train.optimizer = {opt!r} "
                          f"Adam's transform runs right before {first}'s correction, and {', '.join(late)} must shape "
                          "the gradient Adam sees")
    if cfg.eval.oll and not any(isinstance(c, OLL) for c in components):
        components.append(OLLEval())  # OLL at evaluation only (Table 4.18's x column); after every other hook
    return Recipe(
        trainer=_claimed("trainer", components, what="local procedure") or SGD_TRAINER,
        weighting=_exclusive("weighting", rc.weighting, "data_size", R.WEIGHTINGS, components),
        aggregator=_exclusive("aggregator", rc.aggregator, "mean", R.AGGREGATORS, components),
        server_optimizer=R.build(R.SERVER_OPTIMIZERS, cfg.server.optimizer.name, cfg.server.optimizer),
        sharing=R.build(R.SHARING, rc.sharing.name, rc.sharing),
        components=components,
    )


def build_local(cfg: Any, total_rounds: int | None = None) -> LocalTraining:
    """The ``train`` section as ``LocalTraining``. ``total_rounds``: R of the cosine schedule, the whole run's
    ``server.rounds`` (default ``cfg.server.rounds``; a stage's config holds only the stage's rounds, so
    a caller building a stage passes the run's)."""
    t = cfg.train
    return LocalTraining(
        batch_size=t.batch_size, lr=t.lr, epochs=t.epochs, steps=t.steps, momentum=t.momentum, weight_decay=t.weight_decay,
        steps_range=tuple(t.steps_range) if t.steps_range else None, temperature=t.temperature,
        freeze=tuple(t.freeze), lr_schedule=t.lr_schedule, lr_power=t.lr_power, lr_horizon=t.lr_horizon,
        optimizer=t.optimizer, betas=tuple(t.betas), eps=t.eps, lr_gamma=t.lr_gamma, lr_step_rounds=t.lr_step_rounds,
        lr_min=t.lr_min, total_rounds=total_rounds or cfg.server.rounds,
    )


def build_schedule(cfg: Any, task: Task) -> Schedule:
    from .model_selection import selection_of

    metric, higher = selection_of(cfg) or (None, True)
    return Schedule(
        rounds=cfg.server.rounds,
        clients_per_round=clients_per_round(task.num_clients, cfg.server.clients_per_round, cfg.server.fraction),
        eval_every=cfg.eval.every,
        eval_last_rounds=cfg.eval.last_rounds,
        eval_last_every=cfg.eval.last_every,
        eval_batch_size=cfg.eval.batch_size,
        eval_local=cfg.eval.local,
        eval_initial=cfg.eval.initial,
        min_clients=cfg.server.min_clients,
        dropout=cfg.server.dropout,
        speed_sigma=cfg.server.speed_sigma,
        deadline=cfg.server.deadline,
        select_metric=metric,
        select_higher=higher,
        class_split=chosen_clients(cfg.seed, task.num_clients, cfg.eval.class_split),
    )


def build_stages(cfg: Any, task: Task) -> list[Stage]:
    """The run's stages: one per ``[[stages]]`` entry, or one stage of the whole run."""
    stages, end = [], 0
    for name, rounds, scfg in stage_configs(cfg):
        end += rounds
        m = clients_per_round(task.num_clients, scfg.server.clients_per_round, scfg.server.fraction)
        stages.append(Stage(name, end, build_recipe(scfg), build_local(scfg, total_rounds=cfg.server.rounds), m))
    stages = stages or [Stage("federated", cfg.server.rounds, build_recipe(cfg), build_local(cfg))]
    initialised = False  # OLL's lr = "auto" (``recipe.oll.auto_lr``): has an earlier stage set the classifier?
    for stage in stages:
        if any(isinstance(c, OLL) and c.p.lr == "auto" for c in stage.recipe.components):
            stage.local = dataclasses.replace(stage.local, lr=auto_lr(stage.local.lr, initialised))
        initialised = initialised or any(c.name in CLASSIFIER_INIT for c in stage.recipe.components)
    return stages


def engine_device(cfg: Any) -> torch.device:
    """Resolve ``[engine]``: the device (checked), torch's threads, CUDA determinism."""
    device = resolve_device(cfg.engine.device)
    configure_threads(cfg.engine.threads)
    configure_determinism(cfg.engine.deterministic, device)
    if device.type == "cpu":
        keep_freed_memory(cfg.engine.heap_keep_mb)
    return device


def vectorize_mode(setting: bool | str, device: torch.device) -> bool | str:
    """``engine.vectorize`` for a run on ``device``: ``"auto"`` trains a round's clients together on CUDA (where a
    stage allows it) and one at a time on a CPU, where the batched kernels (grouped convolutions, NCHW pooling)
    and the splitting of unequal batches cost more than the per-operation overhead they save (docs/performance.md
    has the measurements); True and False apply on any device."""
    if setting == "auto":
        return "auto" if device.type == "cuda" else False
    return setting


def check_model(cfg: Any, model: torch.nn.Module) -> None:
    """The built model must have every model capability the config's parts need (the registry's
    declaration was checked at config time; this reads the model itself)."""
    for c in [cfg] + [scfg for _, _, scfg in stage_configs(cfg)]:
        have, names = provided(c)
        have = {**have, "model": detect_capabilities(model)}
        model_reqs = [r for r in requirements(c) if any(_kind(n) == "model" for n in r.needs)]
        problems = missing(model_reqs, have, {**names, "model": f"the built model {cfg.model.name!r}"})
        if problems:
            raise ConfigError("\n".join(problems))


def _kind(capability: str) -> str:
    from .capabilities import CAPABILITIES

    return CAPABILITIES[capability].kind


def initial_weights(cfg: Any, model: torch.nn.Module, task: Task, device: torch.device) -> None:
    """Load ``[init] weights`` or the server's pre-trained extractor (pre-training it when missing)."""
    if cfg.init.weights is not None:
        load_checkpoint(model, cfg.init.weights, cfg.init.layout, strict=cfg.init.strict, exclude=cfg.init.exclude)
    elif cfg.pretrain.source != "none":  # the server's pre-trained extractor phi (fedsight.pretrain)
        from .pretrain import ensure_pretrained, load_backbone

        load_backbone(model, ensure_pretrained(cfg, task, device))  # pre-trains when the file is missing


def build_simulation(cfg: Any, task: Task | None = None, run_dir: str | Path | None = None, cost: Any = None,
                     on_phase: OnPhase | None = None) -> Simulation:
    """The in-process simulation of ``cfg``; with ``run_dir``, per-client state spills to
    ``run_dir/client_state``; ``cost``: a known ``ModelCost`` (skips measuring it); ``on_phase`` hears
    "loading data" and "building the model"."""
    device = engine_device(cfg)
    if task is None:
        (on_phase or _no_phase)("loading data")
        task = build_task(cfg)
    (on_phase or _no_phase)("building the model")
    store = ClientStateStore(Path(run_dir) / "client_state") if run_dir is not None else None
    sim = Simulation(task, None, None, build_schedule(cfg, task), cfg.seed, store, build_stages(cfg, task),
                     cost=cost, device=device, vectorize=vectorize_mode(cfg.engine.vectorize, device),
                     max_clients_per_batch=cfg.engine.max_clients_per_batch, noise=cfg.privacy.noise)
    check_model(cfg, sim.global_model)
    initial_weights(cfg, sim.global_model, task, device)
    if cfg.privacy.central_dp is not None:  # the recipe checked against the mechanism (a ConfigError)
        from .flower.dp import install_in_process

        install_in_process(sim, cfg)
    return sim


def build_server(cfg: Any, task: Task | None = None) -> Server:
    """The server half alone (a Flower ServerApp: the clients' half runs on the nodes)."""
    device = engine_device(cfg)
    task = task or build_task(cfg)
    task.to(device)
    with server_side():  # the server holds none of the clients' secrets (their watermark key file)
        server = Server(task, build_stages(cfg, task), build_schedule(cfg, task), cfg.seed, device=device)
    check_model(cfg, server.global_model)
    initial_weights(cfg, server.global_model, task, device)
    return server


def progress_keys(cfg: Any) -> list[tuple[str, str]]:
    """(metric key, short label) pairs a progress line shows for runs of ``cfg``: the primary test
    metric, WMA, the test loss and the training loss."""
    metrics, primary = metric_directions(cfg)
    keys = [(primary, primary.split("/", 1)[1]), ("local/wma", "wma")]
    if "test/loss" in metrics:
        keys.append(("test/loss", "loss"))
    keys.append(("train/loss", "train"))
    return keys + ([("dp/epsilon", "eps")] if cfg.privacy.central_dp is not None else [])


def session_info(device: torch.device) -> dict[str, Any]:
    """What ``run.json`` records about this session: where it ran (device, threads, torch and its CUDA build),
    with what (package versions, git commits: ``provenance``) and the exact command line."""
    import datetime as dt

    return {"started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), **describe(device),
            "fedsight": __version__, "python": platform.python_version(),
            "command": command_line(), **provenance()}


def command_line() -> list[str]:
    """This process's command line as a user would retype it: the program's name, not its path (``python -m
    fedsight`` runs ``__main__.py``: recorded as ``fedsight``)."""
    if not sys.argv:
        return []
    name = Path(sys.argv[0]).name
    return ["fedsight" if name == "__main__.py" else name, *sys.argv[1:]]


def resolved(cfg: Any) -> dict[str, Any]:
    return cfg.model_dump(mode="json")


def experiment(config: dict[str, Any]) -> dict[str, Any]:
    """A resolved config without ``[engine]`` nor where the run directory lies and how many checkpoints it
    keeps: what a run computes, not where or how fast. A run started on a GPU resumes on a CPU (and vice
    versa, or with other threads); a copied or moved run directory resumes from its new place; ``run.json``
    records each session's engine."""
    out = {k: v for k, v in config.items() if k != "engine"}
    if isinstance(out.get("run"), dict):
        out["run"] = {k: v for k, v in out["run"].items()
                      if k not in ("output_dir", "checkpoint_keep", "tensorboard", "mlflow", "mlflow_uri",
                                   "mlflow_experiment")}
    return out


def toml_safe(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: toml_safe(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [toml_safe(v) for v in obj]
    return obj


@dataclass
class Outcome:
    run_dir: Path
    status: str  # "complete", "stopped", "skipped" (already complete)
    last_row: dict[str, Any] | None
