"""One run of a distributed simulation, on every rank: rank 0 runs ``api.execute`` with the distributed backend;
every other rank builds its client half (data, stages, one work model) and serves rounds until rank 0 is done.

Before anything is written, every rank builds its part and the ranks meet (``world.handshake``): a rank that could
not build (bad data), ranks whose configs differ, more ranks than the clients a round samples, or clients that
draw noise from their own secrets, stop the run on every rank with one line from rank 0; the run directory is
not created (a new run) or not touched (an existing one).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..rng import PROCESS_STREAM
from .engine import DistributedBackend, ShippingStore, check_secrets, serve
from .world import RunRefused, World, config_digest, current, handshake, join, rank_device


def _check(cfg: Any, sim: Any, world: World) -> None:
    """Rank 0's checks before the run starts: every rank gets a client in every round of every stage, and no
    client draws its noise from its own secret."""
    for st in sim.stages:
        m = min(st.clients_per_round or sim.schedule.clients_per_round, sim.task.num_clients)
        if world.size > m:
            raise too_many_ranks(world.size, m, st.name if len(sim.stages) > 1 else None)
    check_secrets(cfg, sim.stages, world)


def too_many_ranks(ranks: int, clients: int, stage: str | None) -> ConfigError:
    where = f" in stage {stage!r}" if stage else ""
    plural = "s" if clients != 1 else ""
    return ConfigError(f"{ranks} ranks for {clients} client{plural} a round{where}: every rank needs a client to "
                       f"train; use at most {clients} (--nproc, or torchrun's --nproc-per-node x nodes)")


def check_ranks(cfg: Any, ranks: int) -> None:
    """Before any rank starts: the clients a round samples where the config says how many (``clients_per_round``
    of the run or of a stage; a ``fraction`` is checked by rank 0 once the data is loaded)."""
    from ..config import stage_configs

    stages = [(name, scfg) for name, _, scfg in stage_configs(cfg)] or [(None, cfg)]
    for name, scfg in stages:
        m = scfg.server.clients_per_round
        if m is not None and m < ranks:
            raise too_many_ranks(ranks, m, name if len(stages) > 1 else None)


def execute(cfg: Any, run_dir: str | Path, execute_one: Any, **kwargs: Any) -> Any:
    """``api.execute`` on a rank of a distributed run (``kwargs``: its keywords): rank 0 runs it with the
    distributed backend; any other rank serves it (``serve_run``) and returns an ``Outcome`` whose status is
    "served" (the run ran to its end, or to ``stop_after``), "failed" (rank 0 stopped it with an error, which rank
    0 raises) or "refused" (rank 0 did not start it), so that a script calling ``fedsight.api.execute`` runs
    unchanged on every rank under torchrun. ``execute_one``:
    ``api.execute`` itself, which rank 0 calls with the distributed simulation (passed in, so that this package
    never imports ``api``)."""
    from ..build import Outcome, build_simulation
    from ..safe_write import check_run_dir

    world = current()
    assert world is not None
    if not world.leader:
        return Outcome(Path(run_dir), serve_run(cfg), None)
    join(world)
    cfg = rank_device(cfg, world)
    phase = kwargs.get("on_phase") or (lambda text: None)
    with PROCESS_STREAM:
        sim, error = None, None
        try:
            check_run_dir(run_dir)
            sim = build_simulation(cfg, run_dir=Path(run_dir), on_phase=phase)
        except Exception as exc:  # noqa: BLE001 - every rank hears it at the handshake, then it is raised here
            error = exc
        handshake(world, config_digest(cfg), error, lambda: _check(cfg, sim, world))
        backend = DistributedBackend(sim.server, sim.runtime, world)
        backend.dp = sim.backend.dp  # central DP's admission (flower.dp.install_in_process)
        sim.backend = backend
        try:
            out = execute_one(cfg, run_dir, simulation=sim, **kwargs)
        except BaseException:
            backend.close(failed=True)  # the workers of `fedsight run` stop serving: this process ends here
            raise
        backend.close()
        return out


def build_worker(cfg: Any) -> tuple[Any, Any]:
    """A worker's client half: the task's data, the stages, one work model on its device; (runtime, schedule)."""
    from ..build import build_schedule, build_stages, build_task, engine_device, vectorize_mode
    from ..engine.client_runtime import ClientRuntime

    device = engine_device(cfg)
    task = build_task(cfg).to(device)
    schedule = build_schedule(cfg, task)
    runtime = ClientRuntime(task, build_stages(cfg, task), cfg.seed, ShippingStore(), device,
                            eval_batch_size=schedule.eval_batch_size,
                            vectorize=vectorize_mode(cfg.engine.vectorize, device),
                            max_clients_per_batch=cfg.engine.max_clients_per_batch, noise=cfg.privacy.noise)
    return runtime, schedule


def serve_run(cfg: Any) -> str:
    """A worker's part in one run of ``cfg``: "served" when the run ran to its end, "failed" when rank 0 stopped
    it with an error, "refused" when rank 0 did not start it."""
    world = current()
    assert world is not None and not world.leader
    join(world)
    cfg = rank_device(cfg, world)
    with PROCESS_STREAM:
        runtime = schedule = error = None
        try:
            runtime, schedule = build_worker(cfg)
        except Exception as exc:  # noqa: BLE001 - told to rank 0, which reports it
            error = exc
        try:
            handshake(world, config_digest(cfg), error)
        except RunRefused:
            return "refused"
        return "served" if serve(runtime, schedule, cfg.seed, world) else "failed"


def serve_runs(configs: list[Any]) -> None:
    """A worker's part in every run of a sweep, in the order rank 0 runs them, until one that rank 0 refused or
    that failed: there ``fedsight run`` stops on rank 0 with its one line, and the worker ends quietly (waiting
    for the next run's handshake, it would report rank 0 as lost)."""
    for cfg in configs:
        if serve_run(cfg) != "served":
            return
