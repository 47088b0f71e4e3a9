"""Build and execute runs from validated configs: the library entry points behind the CLI."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w
import torch

from . import registry as R
from .client import SGD_TRAINER, LocalTraining
from .config import ConfigError, stage_configs, validate
from .engine.simulation import Recipe, Schedule, Simulation, Stage, clients_per_round
from .models.base import load_weights, save_weights
from .runs import RunDir, atomic_write_text
from .state import ClientStateStore
from .tasks.base import Task


def build_task(cfg: Any) -> Task:
    """The configured task (data loaded and partitioned), built by the task's registered builder."""
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
    rc = cfg.recipe
    components = [R.build(R.COMPONENTS, c.name, c) for c in rc.components]
    names = [c.name for c in components]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"recipe.components: {', '.join(dup)} listed twice")
    return Recipe(
        trainer=_claimed("trainer", components, what="local procedure") or SGD_TRAINER,
        weighting=_exclusive("weighting", rc.weighting, "data_size", R.WEIGHTINGS, components),
        aggregator=_exclusive("aggregator", rc.aggregator, "mean", R.AGGREGATORS, components),
        server_optimizer=R.build(R.SERVER_OPTIMIZERS, cfg.server.optimizer.name, cfg.server.optimizer),
        sharing=R.build(R.SHARING, rc.sharing.name, rc.sharing),
        components=components,
    )


def build_local(cfg: Any) -> LocalTraining:
    t = cfg.train
    return LocalTraining(
        batch_size=t.batch_size, lr=t.lr, epochs=t.epochs, steps=t.steps, momentum=t.momentum, weight_decay=t.weight_decay,
        steps_range=tuple(t.steps_range) if t.steps_range else None, temperature=t.temperature,
        freeze=tuple(t.freeze),
    )


def build_simulation(cfg: Any, task: Task | None = None, run_dir: str | Path | None = None, cost: Any = None) -> Simulation:
    """The simulation of ``cfg``; with ``run_dir``, per-client state spills to ``run_dir/client_state``;
    ``cost``: a known ``ModelCost`` (skips measuring it)."""
    if cfg.engine.threads:
        torch.set_num_threads(cfg.engine.threads)
    task = task or build_task(cfg)
    local = build_local(cfg)
    schedule = Schedule(
        rounds=cfg.server.rounds,
        clients_per_round=clients_per_round(task.num_clients, cfg.server.clients_per_round, cfg.server.fraction),
        eval_every=cfg.eval.every,
        eval_batch_size=cfg.eval.batch_size,
        eval_local=cfg.eval.local,
    )
    store = ClientStateStore(Path(run_dir) / "client_state") if run_dir is not None else None
    stages, end = [], 0
    for name, rounds, scfg in stage_configs(cfg):
        end += rounds
        m = clients_per_round(task.num_clients, scfg.server.clients_per_round, scfg.server.fraction)
        stages.append(Stage(name, end, build_recipe(scfg), build_local(scfg), m))
    sim = Simulation(task, build_recipe(cfg), local, schedule, cfg.seed, store, stages or None, cost=cost)
    if cfg.init.weights is not None:
        load_weights(sim.global_model, cfg.init.weights, strict=cfg.init.strict)
    elif cfg.pretrain.source != "none":  # the server's pre-trained extractor phi (fedsight.pretrain)
        from .pretrain import ensure_pretrained, load_backbone

        load_backbone(sim.global_model, ensure_pretrained(cfg, task))  # pre-trains when the file is missing
    return sim


def resolved(cfg: Any) -> dict[str, Any]:
    return cfg.model_dump(mode="json")


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


def run_status(run: RunDir) -> dict[str, Any]:
    p = run.path / "status.json"
    return json.loads(p.read_text()) if p.is_file() else {}


def write_status(run: RunDir, state: str, round: int, rounds: int) -> None:
    atomic_write_text(run.path / "status.json", json.dumps({"state": state, "round": round, "rounds": rounds}) + "\n")


OnRound = Callable[[int, dict[str, Any]], None]


def record_round(run: RunDir, sim: Simulation, cfg: Any, r: int, row: dict[str, Any], events: list[dict[str, Any]]) -> None:
    """Write one finished round to the run directory: its events and metrics line, the client
    weights, a checkpoint (then the client store's commit, which the checkpoint indexes) and the status."""
    for e in events:
        run.append_metrics({"stage": sim.stage, **e})
    run.append_metrics(row)
    if sim.last_weights is not None:
        ids, w = sim.last_weights
        run.append_client_weights(r, ids, w)
    run.save_checkpoint(r, sim.state_dict(), keep_last=cfg.run.checkpoint_keep)
    sim.store.commit()
    write_status(run, "running", r, cfg.server.rounds)


def execute(
    cfg: Any,
    run_dir: str | Path,
    *,
    resume: bool = False,
    overwrite: bool = False,
    stop_after: int | None = None,
    on_round: OnRound | None = None,
) -> Outcome:
    """Run (or resume) one configured run in ``run_dir``.

    An existing run directory of the same resolved config is resumed from its last checkpoint (or
    skipped if complete); one of a different config is an error unless ``overwrite``.
    """
    run = RunDir(run_dir)
    res = resolved(cfg)
    if run.exists() and not overwrite:
        old = run.read_config()
        if old != res:
            try:  # a run written before a section or default was added resolves to the same config now
                old = resolved(validate(old, str(run.path / "config.json")))
            except ConfigError:
                pass
        if old != res:
            raise ConfigError(
                f"{run.path} holds a run of a different config; pick another run.name or output_dir, "
                "or pass --overwrite to replace it"
            )
        resume = True
    elif overwrite and run.path.exists():  # only reached when the user asked for it
        import shutil

        shutil.rmtree(run.path)
    # load data and build everything first: bad input must fail before a run directory is written
    sim = build_simulation(cfg, run_dir=run.path)
    if not run.exists():
        run.write_config(res, tomli_w.dumps(toml_safe(res)))
    describe = getattr(sim.task, "data_description", None)
    if describe is not None:  # per-client label counts and the server validation set, for plots
        atomic_write_text(run.path / "partition.json", json.dumps(describe()) + "\n")
    if resume:
        if run_status(run).get("state") == "complete":
            rows = [r for r in run.read_metrics() if "event" not in r]
            return Outcome(run.path, "skipped", rows[-1] if rows else None)
        ckpt = run.load_latest_checkpoint()
        if ckpt is not None:
            sim.load_state_dict(ckpt[1])
        run.truncate_metrics(sim.round)
    else:
        run.metrics_path.unlink(missing_ok=True)
        run.weights_path.unlink(missing_ok=True)
    last: dict[str, Any] = {}

    def _on_round(r: int, row: dict[str, Any], events: list[dict[str, Any]]) -> None:
        record_round(run, sim, cfg, r, row, events)
        last.clear()
        last.update(row)
        if on_round is not None:
            on_round(r, row)

    sim.run(on_round=_on_round, stop_after=stop_after)
    state = "complete" if sim.round >= cfg.server.rounds else "stopped"
    save_weights(sim.global_model, run.path / "model.safetensors")
    write_status(run, state, sim.round, cfg.server.rounds)
    if state == "complete":
        finish(run.path, sim)
    return Outcome(run.path, state, last or None)


def finish(run_dir: Path, sim: Simulation | None = None) -> None:
    """Plots and summary of a finished run (``write_summary`` draws plots/curves.png first)."""
    from .reporting import plot_client_weights, write_summary

    # -- task visuals (video SR: LR / output / ground-truth crops of the final global model) --
    save_visuals = getattr(sim.task, "save_visuals", None) if sim is not None else None
    if save_visuals is not None:
        save_visuals(sim.global_model, Path(run_dir) / "plots" / "visuals.png")
    # -- end task visuals --
    fixed = sim is not None and sim.recipe.weighting.name in ("data_size", "uniform")
    if (Path(run_dir) / "client_weights.jsonl").is_file() and not fixed:
        plot_client_weights(run_dir)  # before the summary, which links it; skipped for data-fixed weights
    write_summary(run_dir)


def load_run_config(run_dir: str | Path) -> Any:
    run = RunDir(run_dir)
    return validate(run.read_config(), str(run.path / "config.json"))


__all__ = ["build_task", "build_recipe", "build_simulation", "execute", "load_run_config", "Outcome"]
