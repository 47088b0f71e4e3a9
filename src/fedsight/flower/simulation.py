"""Flower's simulation engine (Ray) as a FedSight engine option, for runs larger than one process.

The same ServerApp and ClientApp as a deployment (``server_app`` / ``client_app``), run by
``flwr.simulation.run_simulation`` with one virtual SuperNode per FedSight client (Flower gives virtual
node ``k`` the node config ``partition-id = k``). Ray schedules the ClientApp calls on actors sized by
``client_resources`` (CPUs and GPUs per client: with 4 CPUs and ``num_cpus = 1`` four clients train at
once); each actor process builds the task once and serves many virtual nodes. Per-client state goes
to ``state_dir`` (default: a temporary folder removed afterwards), one folder per client, as on real
nodes.

Results equal the in-process simulator's bit for bit (same code on both sides, aggregation in the
sampled order); the cost is Ray's start-up (about 10 s) and a message round trip per client and round.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .options import preflight

#: the start of the deprecation notice ``flwr.simulation.run_simulation`` logs on every call (flwr 1.41): the
#: function is deprecated in favour of ``flwr run`` with a simulation federation, which needs an app directory,
#: a SuperLink and subprocesses, where FedSight runs its ServerApp and ClientApp objects in this process
RUN_SIMULATION_DEPRECATED = "The `run_simulation` function is deprecated"
#: the start of Ray's FutureWarning on every ``ray.init`` (about a future default for GPU variables with
#: ``num_gpus=0``; the behaviour FedSight relies on, Ray hiding GPUs from a client given none, is today's)
RAY_ACCELERATOR_TIP = "Tip: In future versions of Ray, Ray will no longer override accelerator"


class _DropRunSimulationNotice(logging.Filter):
    """Drops Flower's log record of ``run_simulation``'s deprecation, and only that one."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(isinstance(a, str) and a.startswith(RUN_SIMULATION_DEPRECATED) for a in
                       (record.args if isinstance(record.args, tuple) else ()))


@contextlib.contextmanager
def quiet_simulation_notices() -> Iterator[None]:
    """Around ``run_simulation``: silence exactly the two notices every run printed (Flower's deprecation
    banner for ``run_simulation``, Ray's accelerator FutureWarning); every other log record and warning
    passes, and both filters are removed afterwards."""
    flwr_logger = logging.getLogger("flwr")
    notice = _DropRunSimulationNotice()
    flwr_logger.addFilter(notice)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=re.escape(RAY_ACCELERATOR_TIP), category=FutureWarning)
            yield
    finally:
        flwr_logger.removeFilter(notice)


def flower_simulate(
    cfg: Any,
    run_dir: str | Path,
    *,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    ray_cpus: int | None = None,
    state_dir: str | Path | None = None,
    options: dict[str, Any] | None = None,
    verbose: bool = False,
) -> Path:
    """Run ``cfg`` on Flower's Ray simulation engine; the run directory is the usual one.

    ``num_cpus`` / ``num_gpus``: resources of one client (Ray's ``client_resources``); ``ray_cpus``:
    CPUs Ray may use in all (default: all of this machine's); ``options``: ServerApp run-config keys
    (``options.OPTIONS``: ``round-timeout``, ``min-clients``, ``dp-noise-multiplier``, ...). Options that do not fit
    the config (central DP's requirements, ``min-clients``) raise ``ConfigError`` before Ray starts
    (``options.preflight``)."""
    from flwr.simulation import run_simulation

    from ..api import resolved
    from .client_app import make_client_app
    from .run_config import flat_run_config
    from .server_app import make_server_app

    run_dir = Path(run_dir).absolute()
    preflight(cfg, options, run_dir)  # a ConfigError before Ray starts or anything is written
    own_state = state_dir is None
    state = Path(tempfile.mkdtemp(prefix="fedsight-flower-nodes-")) if own_state else Path(state_dir).absolute()
    settings = {**flat_run_config(resolved(cfg)), "run-dir": str(run_dir), "state-dir": str(state),
                "poll-interval": 0.05, **(options or {})}
    backend = {
        "client_resources": {"num_cpus": float(num_cpus), "num_gpus": float(num_gpus)},
        "init_args": {"num_cpus": int(ray_cpus or os.cpu_count() or 1), "include_dashboard": False,
                      "logging_level": "warning", "log_to_driver": bool(verbose)},
    }
    if num_gpus > 0:
        backend["init_args"]["num_gpus"] = max(1, int(num_gpus + 0.999))
    try:
        with quiet_simulation_notices():
            run_simulation(
                server_app=make_server_app(settings), client_app=make_client_app(settings),
                num_supernodes=int(cfg.partition.num_clients), backend_config=backend, verbose_logging=verbose,
            )
    finally:
        if own_state:
            shutil.rmtree(state, ignore_errors=True)
    status = run_dir / "status.json"
    if not status.is_file() or json.loads(status.read_text()).get("state") != "complete":
        raise RuntimeError(f"the Flower simulation did not complete; see {run_dir / 'metrics.jsonl'} and the log above")
    return run_dir
