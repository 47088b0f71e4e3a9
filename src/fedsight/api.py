"""Build and execute runs from validated configs: the library entry points behind the CLI."""

from __future__ import annotations

import dataclasses
import os
import json
from pathlib import Path
from typing import Any

import tomli_w
import torch

from . import central_dp
from .config import ConfigError, validate
from .engine.simulation import Simulation
from .metric_table import metric_directions
from .model_selection import sync_best, write_best
from .models.base import save_weights
from .errors import FedSightError, RunFileError
from .rng import PROCESS_STREAM
from .safe_write import check_run_dir
from .secret import privacy_note
from .runs import (CLIENT_METRICS_EVENT, CLIENT_METRICS_FILE, INTERRUPTED, Replacement, RunDir,
                   RunLock, atomic_write_text, last_values, read_run_meta)
from .tasks.base import Task
from .build import (  # noqa: F401  (re-exported: the library's entry points; build.py loads the built-ins)
    build_task,
    build_recipe,
    build_local,
    build_schedule,
    build_stages,
    engine_device,
    vectorize_mode,
    check_model,
    initial_weights,
    build_simulation,
    build_server,
    progress_keys,
    session_info,
    resolved,
    experiment,
    toml_safe,
    Outcome,
    OnPhase,
    OnRound,
    _no_phase,
)




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

        return execute_distributed(cfg, run_dir, execute, resume=resume, overwrite=overwrite, stop_after=stop_after,
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
    if run.exists() and not overwrite:
        if not _same_experiment(run, cfg):
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
    rows = _complete_rows(run, cfg) if resume else None
    if rows is not None:  # skipped before anything is built: rerunning a finished sweep loads no data
        for note in _swept(run):  # a kill while its plots or summary were written
            run.append_metrics({"event": "run_repaired", "round": rows[-1]["round"], "stage": rows[-1].get("stage"),
                                "note": note})
        return Outcome(run.path, "skipped", rows[-1])
    # load data and build everything first: bad input must fail before a run directory is written (a new run's
    # simulation is built before its lock is taken: ``execute``)
    if sim is None:
        sim = build_simulation(cfg, run_dir=run.path, on_phase=phase)
    # --overwrite: the old run is set aside now and deleted once the new one has recorded a round
    replaced = Replacement(run.path) if overwrite and not resume else None
    try:
        return _execute_built(cfg, run, sim, resume, stop_after, on_round, replaced, phase)
    except BaseException:
        if replaced is not None:
            replaced.undo()
        raise


def _complete_rows(run: RunDir, cfg: Any) -> list[dict[str, Any]] | None:
    """The metric rows (events left out) of a run that its ``status.json`` says is complete and that is
    (``_finished``); None for any other run."""
    status = run.read_status()
    if status.get("state") != "complete" or status["round"] < cfg.server.rounds:
        return None
    rows = [r for r in run.read_metrics() if "event" not in r] if run.metrics_path.is_file() else []
    return rows if _finished(run, rows, cfg) else None


def _same_experiment(run: RunDir, cfg: Any) -> bool:
    """Whether the run in ``run`` is of ``cfg``'s experiment (``config.experiment``: what its numbers depend on)."""
    res = experiment(resolved(cfg))
    if experiment(run.read_config()) == res:
        return True
    try:  # a run written before a section or default was added resolves to the same config now
        return experiment(resolved(validate(run.read_config(), str(run.path / "config.json")))) == res
    except ConfigError:
        return False


def is_complete(cfg: Any, run_dir: str | Path) -> bool:
    """Whether ``execute(cfg, run_dir)`` would skip the run as complete: a run of the same experiment whose status,
    metrics and newest checkpoint reach the last round. Reads only; a run it cannot read is not complete (running
    it says why)."""
    run = RunDir(run_dir)
    try:
        return run.exists() and _same_experiment(run, cfg) and _complete_rows(run, cfg) is not None
    except (FedSightError, OSError, ValueError):
        return False


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
