"""Build and execute runs from validated configs: the library entry points behind the CLI."""

from __future__ import annotations

import dataclasses
import os
import json
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w
import torch

from . import __version__
from . import central_dp
from . import registry as R
from .capabilities import missing
from .config import ConfigError, provided, requirements, stage_configs, validate
from .device import configure_determinism, configure_threads, describe, keep_freed_memory, resolve_device
from .engine.plan import Recipe, Schedule, Stage, clients_per_round
from .engine.server import Server
from .engine.simulation import Simulation
from .metric_table import metric_directions
from .model_selection import sync_best, write_best
from .models.base import detect_capabilities, save_weights
from .weights import load_checkpoint
from .plugins import load_builtin
from .provenance import provenance
from .recipe.oll import CLASSIFIER_INIT, OLL, OLLEval, auto_lr
from .class_split import chosen_clients
from .errors import FedSightError, RunFileError
from .rng import PROCESS_STREAM
from .safe_write import check_run_dir
from .secret import privacy_note, server_side
from .runs import (CLIENT_METRICS_EVENT, CLIENT_METRICS_FILE, INTERRUPTED, Replacement, RunDir,
                   RunLock, atomic_write_text, last_values, read_run_meta)
from .state import ClientStateStore
from .tasks.base import Task
from .training.local import SGD_TRAINER, LocalTraining, direction_position, misplaced_after_correction

load_builtin()


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
            "command": [Path(sys.argv[0]).name, *sys.argv[1:]] if sys.argv else [], **provenance()}


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


OnRound = Callable[[int, dict[str, Any]], None]
#: what a run does now, for a progress display ("loading data", "building the model", ...: ``execute``)
OnPhase = Callable[[str], None]


def _no_phase(text: str) -> None:
    pass


def start_run_dir(run: RunDir, cfg: Any, task: Task, device: torch.device, partition: bool = True,
                  backend: str = "in-process", vectorize: bool | str | None = None,
                  privacy_noise: str | None = None, client_identity: str | None = None,
                  ranks: dict[str, Any] | None = None) -> None:
    """Write a run's config (first session only), its partition description (``partition``: the task's
    partition is the clients' data) and its ``run.json`` (``backend``: where the clients train; a run that
    trained on Flower never resumes in-process)."""
    res = resolved(cfg)
    if not run.exists():
        run.write_config(res, tomli_w.dumps(toml_safe(res)))
    describe_data = task.data_description() if partition else None
    if describe_data:  # per-client label counts and the server-held splits, for plots
        atomic_write_text(run.path / "partition.json", json.dumps(describe_data) + "\n")
    metrics, primary = metric_directions(cfg)
    session = {**session_info(device), "backend": backend}
    if isinstance(asked := cfg.engine.threads, int) and asked != session["threads"]:  # fewer CPUs here
        session["threads_requested"] = asked
    if vectorize is not None:  # the in-process engine's mode on this session's device (``vectorize_mode``)
        session["vectorize"] = vectorize
    if privacy_noise is not None:  # where the DP noise and keys came from (``fedsight.secret.privacy_note``)
        session["privacy_noise"] = privacy_noise
    if ranks:  # a distributed run: how many ranks trained the clients, over which process group
        session.update(ranks)
    if client_identity is not None:  # Flower: what binds a client to a node (``flower.provisioning.identity_note``)
        session["client_identity"] = client_identity
    run.write_run_meta(metrics, primary, session,
                       model_io=dataclasses.asdict(task.model_io))


def record_round(run: RunDir, server: Any, cfg: Any, r: int, row: dict[str, Any], events: list[dict[str, Any]]) -> None:
    """Write one finished round to the run directory: its events and metrics line, the client
    weights, a checkpoint (then the client store's commit, which the checkpoint indexes) and the status; round 0
    (the initial model's evaluation) writes its events and metrics line only."""
    for e in events:
        if e.get("event") == CLIENT_METRICS_EVENT:  # every client's numbers: a file of their own
            run.append_client_metrics({"round": e["round"], "stage": server.stage, "clients": e["clients"]})
        else:
            run.append_metrics({"stage": server.stage, **e})
    run.append_metrics(row)
    if cfg.run.tensorboard:
        run.log_events(r, row)
    sel = server.selection
    if r == 0:  # the initial model's evaluation: nothing trained, nothing to checkpoint (a resume redoes it)
        if sel is not None and sel.round == 0:
            write_best(run.path, sel)
        if cfg.run.mlflow:
            run.track(r, row, cfg.run)
        return
    if server.last_weights is not None:
        ids, w = server.last_weights
        run.append_client_weights(r, ids, w)
    run.save_checkpoint(r, server.state_dict(), keep_last=cfg.run.checkpoint_keep)
    server.store.commit()
    if sel is not None and sel.round == r:  # after the checkpoint, which holds it too (a kill in between: sync_best)
        write_best(run.path, sel)
    run.write_status("running", r, cfg.server.rounds)
    if cfg.run.mlflow:  # after the checkpoint: MLflow never holds a round a resumed run redoes (fedsight.mlflow_tracking)
        run.track(r, row, cfg.run)


def execute(
    cfg: Any,
    run_dir: str | Path,
    *,
    resume: bool = False,
    overwrite: bool = False,
    stop_after: int | None = None,
    on_round: OnRound | None = None,
    on_phase: OnPhase | None = None,
    simulation: Simulation | None = None,
) -> Outcome:
    """Run (or resume) one configured run in ``run_dir``.

    ``on_round(r, row)`` hears every recorded round; ``on_phase(text)`` what the run does while no round is
    recorded: "loading data", "building the model", "round 0: evaluating the initial model" (or "round k:
    training", the first round it runs), "writing the model, plots and summary".

    An existing run directory of the same resolved config is resumed from its last checkpoint (or
    skipped if complete); one of a different config is an error unless ``overwrite``. The run directory is
    locked throughout (``RunLock``): a second process on it fails at once. Runs in one process take turns
    (``rng.PROCESS_STREAM``): a thread calling this while another thread's run is under way waits for it.

    Under ``torchrun`` (``WORLD_SIZE`` > 1) every rank calls this with the same config: rank 0 runs the server and
    writes the run directory, the others train their share of each round's clients and return status "served"
    (``fedsight.distributed``). ``simulation``: one built by the caller (the distributed backend's rank 0) instead
    of from ``cfg``.
    """
    from .distributed.world import current

    if simulation is None and current() is not None:
        from .distributed.run import execute as execute_distributed

        return execute_distributed(cfg, run_dir, resume=resume, overwrite=overwrite, stop_after=stop_after,
                                   on_round=on_round, on_phase=on_phase)
    check_run_dir(run_dir)  # not inside another run, not a symbolic link or special file: before anything is built
    with PROCESS_STREAM:
        sim = simulation
        phase = on_phase or _no_phase
        if sim is None and not os.path.lexists(run_dir):  # a new run: data loaded and everything built before the lock file is
            sim = build_simulation(cfg, run_dir=Path(run_dir), on_phase=phase)  # made: a kill leaves nothing behind
        with RunLock(run_dir):
            return _execute(cfg, RunDir(run_dir), resume, overwrite, stop_after, on_round, sim, phase)


def _execute(cfg: Any, run: RunDir, resume: bool, overwrite: bool, stop_after: int | None,
             on_round: OnRound | None, sim: Simulation | None = None, phase: OnPhase = _no_phase) -> Outcome:
    res = experiment(resolved(cfg))
    if run.exists() and not overwrite:
        old = experiment(run.read_config())
        if old != res:
            try:  # a run written before a section or default was added resolves to the same config now
                old = experiment(resolved(validate(run.read_config(), str(run.path / "config.json"))))
            except ConfigError:
                pass
        if old != res:
            raise ConfigError(
                f"{run.path} holds a run of a different config; pick another run.name or output_dir, "
                "or pass --overwrite to replace it"
            )
        resume = True
    meta = read_run_meta(run.path) if resume else None
    if meta and any(s.get("backend") == "flower" for s in meta.get("sessions", []) if isinstance(s, dict)):
        raise RunFileError(f"{run.path} is a Flower run: it cannot continue in-process (its client state lives on "
                           "the nodes, and central DP's noise would be dropped); run it again with `fedsight flower "
                           "... --overwrite`")
    # load data and build everything first: bad input must fail before a run directory is written (a new run's
    # simulation is built before its lock is taken: ``execute``)
    if sim is None:
        sim = build_simulation(cfg, run_dir=run.path, on_phase=phase)
    status = run.read_status() if resume else {}
    if status.get("state") == "complete" and status["round"] >= cfg.server.rounds:
        rows = [r for r in run.read_metrics() if "event" not in r] if run.metrics_path.is_file() else []
        if _finished(run, rows, cfg):
            for note in _swept(run):  # a kill while its plots or summary were written
                run.append_metrics({"event": "run_repaired", "round": rows[-1]["round"], "stage": rows[-1].get("stage"),
                                    "note": note})
            return Outcome(run.path, "skipped", rows[-1])
    # --overwrite: the old run is set aside now and deleted once the new one has recorded a round
    replaced = Replacement(run.path) if overwrite and not resume else None
    try:
        return _execute_built(cfg, run, sim, resume, stop_after, on_round, replaced, phase)
    except BaseException:
        if replaced is not None:
            replaced.undo()
        raise


def _finished(run: RunDir, rows: list[dict[str, Any]], cfg: Any) -> bool:
    """Whether a run whose ``status.json`` says complete is: its metric ``rows`` and its newest checkpoint reach
    the last round. A status that claims more (edited, or damaged) is not believed: the run resumes from its
    newest intact checkpoint instead of being skipped with rounds missing."""
    stems = run.checkpoints()
    newest = int(stems[-1].name.split("-")[1]) if stems else cfg.server.rounds
    return bool(rows) and rows[-1]["round"] >= cfg.server.rounds and newest >= cfg.server.rounds


def _execute_built(cfg: Any, run: RunDir, sim: Any, resume: bool, stop_after: int | None,
                   on_round: OnRound | None, replaced: Replacement | None, phase: OnPhase = _no_phase) -> Outcome:
    notes: list[str] = []
    run.check_layout()
    if resume:  # everything read and checked before anything is written
        done = run.read_status().get("round", 0)
        if done > 0 and not run.metrics_path.is_file():
            raise RunFileError(f"{run.metrics_path}: missing, but the run recorded {done} rounds; nothing was changed: "
                               "pass --overwrite to start the run over")
        if restore(run, sim, notes) is None and done > 0:
            raise RunFileError(f"{run.ckpt_dir}: no intact checkpoint of the {done} rounds recorded "
                               f"({'; '.join(notes) or 'none left'}); nothing was changed: pass --overwrite to start "
                               "the run over")
        central_dp.keep_server_secret(sim, run.path, resumed=True)  # read back (a RunFileError if lost)
        notes += run.truncate_metrics(sim.round)
    else:
        central_dp.keep_server_secret(sim, run.path, resumed=False)  # drawn and kept in RUN_DIR/private
    notes += _swept(run)  # also for a new run in a folder a killed run left before its config was written
    start_run_dir(run, cfg, sim.task, sim.server.device, vectorize=sim.runtime.vectorize,
                  backend=getattr(sim.backend, "name", "in-process"), ranks=getattr(sim.backend, "session", None),
                  privacy_noise=privacy_note(sim.stages, cfg.privacy.noise, ("central_dp",) if sim.backend.dp else ()))
    if not resume:
        for path in (run.metrics_path, run.weights_path, run.path / CLIENT_METRICS_FILE):
            path.unlink(missing_ok=True)
    if sim.server.selection is not None:  # the best model so far, as the restored checkpoint has it
        sync_best(run.path, sim.server.selection)
    for note in notes:  # a run_repaired event for each repair and each swept leftover (docs/guarantees.md)
        run.append_metrics({"event": "run_repaired", "round": sim.round, "stage": sim.server.stage, "note": note})
    if sim.backend.dp is not None and not resume:  # which accountant and assumption give the rows' dp/epsilon
        run.append_metrics(central_dp.accounting_event(sim.backend.dp, sim.server.stage))
    last: dict[str, Any] = {}
    run.open_tracking(cfg.run)  # before any round: an unreachable tracking server stops the run here

    def _on_round(r: int, row: dict[str, Any], events: list[dict[str, Any]]) -> None:
        record_round(run, sim.server, cfg, r, row, events)
        if replaced is not None:
            replaced.done()
        last.clear()
        last.update(row)
        if on_round is not None:
            on_round(r, row)

    try:
        initial = sim.round == 0 and sim.server.schedule.eval_initial
        phase("round 0: evaluating the initial model" if initial else f"round {sim.round + 1}: training")
        sim.run(on_round=_on_round, stop_after=stop_after)
        state = "complete" if sim.round >= cfg.server.rounds else "stopped"
        phase("writing the model, plots and summary" if state == "complete" else "writing the model")
        try:
            save_weights(sim.global_model, run.path / "model.safetensors")
            run.write_status(state, sim.round, cfg.server.rounds)
            if state == "complete":
                finish(run.path, sim.task, sim.global_model, sim.recipe.weighting.name, hooks=sim.eval_context,
                       plots=cfg.run.plots,
                       facts=sim.server.facts, events=run.events, tracking=run.tracking)
        except Exception as exc:  # a full disk, a file-size limit: the status says what failed, and the run resumes
            _record_failure(run, sim.round, cfg.server.rounds, exc)
            raise
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM through the CLI: the last completed round is checkpointed
        run.write_status(INTERRUPTED, sim.round, cfg.server.rounds)
        raise
    finally:
        run.close_events()
    return Outcome(run.path, state, last or None)


def _swept(run: RunDir) -> list[str]:
    """``sweep_leftovers`` of ``run``, each as the note of a ``run_repaired`` event."""
    return [f"{name}: a leftover of an interrupted write was removed" for name in run.sweep_leftovers()]


def _record_failure(run: RunDir, r: int, rounds: int, exc: BaseException) -> None:
    """After the last round, writing the final model, the status, the plots or the summary failed: the status
    goes back to "running" (``fedsight resume`` or the same ``run`` again redoes what is missing) and says what
    failed (``failed``: one line). A status that cannot be written either leaves the one before."""
    what = str(exc) if isinstance(exc, FedSightError) else f"{type(exc).__name__}: {exc}"
    try:
        run.write_status("running", r, rounds, failed=" ".join(f"finishing the run: {what}".split()))
    except Exception:  # noqa: BLE001 - the first failure is the one reported
        pass


def finish(run_dir: Path, task: Task | None = None, model: torch.nn.Module | None = None, weighting: str | None = None,
           hooks: Any = None, facts: dict[str, torch.Tensor] | None = None, events: Any = None,
           plots: bool = True, tracking: Any = None) -> None:
    """Plots and summary of a finished run (``write_summary`` draws plots/curves.png first; ``plots`` False,
    ``run.plots = false``: no figure at all, the summary and its tables only). ``hooks(model,
    split)``: the run's evaluation hooks, under which a task's visuals show the model as it was evaluated
    (SiloBN's test statistics); None shows the global model as it is. ``facts``: the run's facts, reported on
    by ``FACT_REPORTS`` (LADD's style clusters). A run with skipped rounds stays "complete" (every reader of
    ``status.json`` takes it as finished) and says which rounds, and why, in ``status.json``
    (``skipped_rounds``, ``skipped_causes``) and ``summary.md``. ``events``: the session's TensorBoard log, which
    gets the plots and the hparams; ``tracking``: its MLflow run, which gets the plots and the summary."""
    from .registry import FACT_REPORTS
    from .reporting import plot_client_weights, write_summary
    from .reporting.summary import skipped_status

    run = RunDir(run_dir)
    status, skipped = run.read_status(), skipped_status(run.read_metrics())
    if status and skipped:
        atomic_write_text(run.path / "status.json", json.dumps({**status, **skipped}) + "\n")
    for name, report in FACT_REPORTS.items():
        if facts and name in facts:
            report(Path(run_dir), facts, task)

    save_visuals = getattr(task, "save_visuals", None) if task is not None else None
    if plots and save_visuals is not None and model is not None:  # video SR crops, segmentation overlays
        save_visuals(model, Path(run_dir) / "plots" / "visuals.png", hooks)
    fixed = weighting in ("data_size", "uniform")
    if plots and (Path(run_dir) / "client_weights.jsonl").is_file() and not fixed:
        plot_client_weights(run_dir)  # before the summary, which links it; skipped for data-fixed weights
    if plots:
        from .class_split import PLOT_FILE, plot_class_split

        plot_class_split(run.read_metrics(), run.path / "plots" / PLOT_FILE)  # (nothing without eval.class_split)
    write_summary(run_dir, plot=plots)
    if events is not None:  # TensorBoard: the plots as images, the hparams with each metric's last value
        final = last_values(run.read_metrics())
        events.finish(run.path, run.read_config(), final, int(final.get("round", 0)))
    if tracking is not None:
        tracking.finish(run.path)


def load_run_config(run_dir: str | Path, engine: dict[str, Any] | None = None) -> Any:
    """A run directory's config; ``engine`` replaces entries of its ``[engine]`` section (resume on
    another device)."""
    run = RunDir(run_dir)
    raw = run.read_config()
    if engine:
        raw = {**raw, "engine": {**raw.get("engine", {}), **engine}}
    return validate(raw, str(run.path / "config.json"))




def restore(run: RunDir, sim: Any, notes: list[str] | None = None) -> int | None:
    """Load the newest intact checkpoint of ``run`` into ``sim``: its round, or None when there is none
    (``notes``: the newer damaged ones skipped). A checkpoint whose tensors do not fit the model or the
    recipe's state (another width, a missing client state) is a ``RunFileError`` naming it."""
    ckpt = run.load_latest_checkpoint(notes)
    if ckpt is None:
        return None
    try:
        sim.load_state_dict(ckpt[1])
    except RunFileError as exc:
        if notes:  # an older checkpoint: the client states it indexes were superseded by the damaged newer one's
            raise RunFileError(f"{exc}; {'; '.join(notes)}, and per-client state resumes only from the newest "
                               "checkpoint: pass --overwrite to start the run over") from None
        raise
    except (KeyError, RuntimeError, ValueError, TypeError, IndexError, AttributeError, FileNotFoundError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise RunFileError(f"{run.ckpt_dir / f'round-{ckpt[0]:06d}.safetensors'}: does not fit this run's model or "
                           f"state ({first[:200]})") from None
    return ckpt[0]


__all__ = [
    "Outcome", "build_local", "build_recipe", "build_schedule", "build_server", "build_simulation", "build_stages",
    "build_task", "execute", "load_run_config", "metric_directions", "record_round", "resolved", "restore",
]
