"""``fedsight run CONFIG --nproc N`` (and ``resume``): the same command started again as N ranks on this machine
through torchrun's own elastic API (``torch.distributed.launcher``: a c10d rendezvous on a free local port, no
restarts), the ranks' output passed through. It is ``torchrun --standalone --nproc-per-node N -m fedsight run
CONFIG``; several machines use torchrun itself (docs/distributed.md).

The parent checks what it can before starting anything (the config, its device, ``--dist-backend``, ``--jobs``);
the ranks check the rest together before the run starts (``run``). When the run fails, rank 0 has said why in one
line and the launcher exits with its code; when a rank died without a word (killed, out of memory) the launcher
says which rank and how, in one line.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from .world import BACKEND_ENV, LAUNCH_ENV

#: the options the parent consumes (the ranks run the command without them)
OWN = ("--nproc", "--dist-backend")


def rank_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` (the command after ``fedsight``) without ``--nproc N`` and ``--dist-backend NAME`` (either
    form, ``--opt value`` or ``--opt=value``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in OWN:
            skip = True
            continue
        if any(arg.startswith(opt + "=") for opt in OWN):
            continue
        out.append(arg)
    return out


def launch(nproc: int, backend: str, argv: Sequence[str]) -> int:
    """Run ``fedsight ARGV`` (without the launcher's own options) as ``nproc`` ranks here; the exit code (rank 0's
    when it failed, else 1 for a rank that died, 0 on success)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from torch.distributed.elastic.multiprocessing.api import SignalException

    for name in list(logging.root.manager.loggerDict):  # the agent's own log lines (each module has its logger)
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ[BACKEND_ENV] = backend
    os.environ[LAUNCH_ENV] = json.dumps(["fedsight", *argv])  # the user's command, for run.json (the ranks run another)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: engine.threads sets each rank's torch threads
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"fedsight-{os.getpid()}",
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1)
    try:
        elastic_launch(config, sys.executable)("-m", "fedsight", *rank_argv(argv))
    except SignalException:  # Ctrl-C or SIGTERM: the ranks got it too, and rank 0 said where the run stopped
        return 130
    except ChildFailedError as exc:
        code, line = blame(exc.failures)
        if line:
            print(line, file=sys.stderr)
        return code
    return 0


def blame(failures: dict[int, Any]) -> tuple[int, str | None]:
    """The launcher's exit code and line for the ranks that failed ({rank: torch's ``ProcessFailure``}): rank 0's
    code and no line when it failed first with its own error line (1, 2, or 130 when interrupted); else the line
    naming the first rank that stopped. The agent stops the others of a failed run with SIGTERM, so a rank it
    stopped is blamed last, and on a tie (elastic stamps failures it detects together with one time) a rank killed
    by a signal before one that exited."""
    rank, failure = min(failures.items(), key=lambda kv: (kv[1].signal_name() == "SIGTERM", kv[1].timestamp,
                                                          kv[1].exitcode >= 0, kv[0]))
    leader = failures.get(0)
    if leader is not None and leader.exitcode in (1, 2, 130) and (rank == 0 or failure.exitcode >= 0):
        return leader.exitcode, None
    how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
    return 1, f"error: rank {rank} stopped ({how}); the run directory is resumable: run the same command again"


def dispatch(nproc: int, backend: str | None, jobs: int, configs: Sequence[object]) -> int | None:
    """What ``fedsight run``/``resume`` does with ``--nproc`` and ``--dist-backend``, once its ``configs`` are
    validated: None to go on in this process (one process, or rank 0 of a distributed run, whose ``api.execute``
    runs distributed), or the exit code of the launched ranks (``--nproc`` above 1), or 0 after serving every run
    as a worker rank. Bad options, and an ``engine.device`` this machine lacks, are a ``ConfigError`` before
    anything starts (runs, ``--jobs`` workers or ranks)."""
    from ..device import resolve_device
    from ..errors import ConfigError
    from .run import check_ranks, serve_runs
    from .world import check_backend, current

    world = current()
    if backend is not None:
        check_backend(backend)
    if world is None:  # a device this machine lacks: one line here, before any run, job or rank starts
        for cfg in configs:
            resolve_device(cfg.engine.device)
    if world is None and nproc == 1:
        if backend is not None:
            raise ConfigError("--dist-backend without --nproc N (N > 1) or torchrun: one process has no process group")
        return None
    if world is not None and nproc > 1:
        raise ConfigError(f"--nproc {nproc} under torchrun: torchrun started {world.size} ranks already; drop --nproc")
    if jobs > 1 and (nproc > 1 or world is not None):
        raise ConfigError(f"--jobs {jobs} with {max(nproc, world.size if world else 1)} ranks: a sweep's runs take "
                          "turns on the ranks; drop --jobs")
    if world is None:
        for cfg in configs:
            check_ranks(cfg, nproc)
        return launch(nproc, backend or "gloo", sys.argv[1:])
    if backend is not None:
        os.environ[BACKEND_ENV] = backend
    if world.leader:
        return None
    try:
        serve_runs(list(configs))
    except KeyboardInterrupt:  # Ctrl-C reaches every rank: rank 0 says where the run stopped, a worker nothing
        return 130
    return 0
