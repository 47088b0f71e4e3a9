"""Where this process stands among the ranks of a distributed run, and the checks every rank agrees on before
anything is written.

A process is a rank of a distributed run when ``torchrun`` (or ``fedsight run --nproc N``, which launches
through torchrun's own elastic API) set ``WORLD_SIZE`` above 1 in its environment, with ``RANK`` and
``LOCAL_RANK``; the process group's rendezvous is torchrun's (``MASTER_ADDR``/``MASTER_PORT``, ``env://``).

A round's messages (the order rank 0 sends each rank, the answers it gets back) travel on the CPU as a small
pickled header and one flat tensor of every tensor's bytes (``wire``), point to point; the checks before a run
are pickled objects (``torch.distributed``'s object collectives). The group's backend is ``gloo`` unless
``FEDSIGHT_DIST_BACKEND`` (``fedsight run --dist-backend``) says ``nccl``, under which the round's messages take a
gloo group of the same ranks (``wire_group``); either way a rank's training runs on its own device
(``rank_device``). The collectives' timeout is ``FEDSIGHT_DIST_TIMEOUT`` seconds
(default 6 hours): a worker waits for the next round while rank 0 evaluates and writes checkpoints.
"""

from __future__ import annotations

import atexit
import datetime
import hashlib
import json
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ConfigError, FedSightError

#: environment variable naming the process group's backend ("gloo", the default, or "nccl")
BACKEND_ENV = "FEDSIGHT_DIST_BACKEND"
#: environment variable: the collectives' timeout in seconds
TIMEOUT_ENV = "FEDSIGHT_DIST_TIMEOUT"
#: environment variable: the command ``--nproc`` was given in (JSON list), which run.json records as ``launched_by``
LAUNCH_ENV = "FEDSIGHT_LAUNCH_COMMAND"
BACKENDS = ("gloo", "nccl")


class RankFailed(FedSightError):
    """A rank other than rank 0 failed (its data, its training, its process): the message names the rank and
    its error in one line. The run directory is left as after the last checkpoint: resumable."""


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int

    @property
    def leader(self) -> bool:
        return self.rank == 0


def current() -> World | None:
    """This process's place in a distributed run, from torchrun's environment; None outside one (or in a world
    of one process, which is the in-process engine)."""
    try:
        size = int(os.environ.get("WORLD_SIZE", "1"))
        if size <= 1:
            return None
        return World(int(os.environ["RANK"]), size, int(os.environ.get("LOCAL_RANK", "0")))
    except (KeyError, ValueError):
        return None


def backend_name() -> str:
    """The process group's backend: ``FEDSIGHT_DIST_BACKEND``, checked (a ``ConfigError`` naming it)."""
    name = os.environ.get(BACKEND_ENV, "gloo").strip() or "gloo"
    if name not in BACKENDS:
        raise ConfigError(f"--dist-backend {name!r}: expected one of {', '.join(BACKENDS)}")
    if name == "nccl" and not (dist.is_nccl_available() and torch.cuda.is_available()):
        why = "this torch build has no NCCL" if not dist.is_nccl_available() else "no GPU is visible"
        raise ConfigError(f"--dist-backend nccl: not available here ({why}); use gloo")
    return name


def check_backend(name: str) -> str:
    """``name`` if this machine can run it, else the same ``ConfigError`` as ``backend_name``."""
    old = os.environ.get(BACKEND_ENV)
    os.environ[BACKEND_ENV] = name
    try:
        return backend_name()
    finally:
        if old is None:
            del os.environ[BACKEND_ENV]
        else:
            os.environ[BACKEND_ENV] = old


_WIRE: list[Any] = []


def join(world: World) -> None:
    """Join torchrun's process group (once per process; later runs of a sweep reuse it), and under NCCL a gloo group
    of the same ranks for the round's messages (``wire_group``)."""
    if dist.is_initialized():
        return
    name = backend_name()
    if name == "nccl":
        torch.cuda.set_device(world.local_rank % torch.cuda.device_count())
    seconds = float(os.environ.get(TIMEOUT_ENV, str(6 * 3600)))
    dist.init_process_group(name, timeout=datetime.timedelta(seconds=seconds))
    if name == "nccl":  # (a collective call: every rank joins, at the same point)
        _WIRE.append(dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=seconds)))


def wire_group() -> Any:
    """The group a round's messages travel in: the default group under gloo (None), a gloo group of every rank
    under NCCL (its point-to-point operations take CUDA tensors only; the messages are on the CPU)."""
    return _WIRE[-1] if _WIRE else None


def finish(code: int) -> None:
    """End a rank's process with ``code`` once its work is done, without the interpreter's teardown: a gloo process
    group left to the C++ static destructors (destroyed explicitly or not) can abort the process at exit
    ("terminate called without an active exception", SIGABRT), which the launcher then reports as a failed rank
    after a run that had finished. Does nothing outside a process group (an ordinary process exits as usual).
    Python's exit handlers run and output is flushed first; every file FedSight writes is already closed and
    renamed into place by then."""
    if "torch.distributed" not in sys.modules or not dist.is_available() or not dist.is_initialized():
        return
    atexit._run_exitfuncs()  # Python's own exit handlers still run (writers' flushes); only C++ teardown is skipped
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def rank_device(cfg: Any, world: World) -> Any:
    """``cfg`` with ``engine.device`` naming this rank's GPU when it asks for CUDA without an index (``"auto"``
    on a machine with GPUs, ``"cuda"``): rank k of a node trains on ``cuda:k mod count``; a CPU or an explicit
    ``cuda:N`` is kept (the same config on every rank)."""
    spec = cfg.engine.device.strip()
    if spec in ("auto", "cuda") and torch.cuda.is_available():
        spec = f"cuda:{world.local_rank % torch.cuda.device_count()}"
        return cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"device": spec})})
    return cfg


def config_digest(cfg: Any) -> str:
    """What every rank must agree on: the experiment (``api.experiment``: the config without where the run
    lies) and the engine settings that change numbers (threads, vectorising), not the device (each rank has its
    own). 12 hex digits of SHA-256 over the sorted JSON."""
    from ..build import experiment, resolved

    res = resolved(cfg)
    engine = {k: v for k, v in res.get("engine", {}).items() if k != "device"}
    text = json.dumps({"experiment": experiment(res), "engine": engine}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def one_line(exc: BaseException) -> str:
    from ..errors import describe_error

    return " ".join(describe_error(exc).split())


def lost(exc: BaseException, who: str) -> RankFailed:
    """The error of a collective that failed because another rank went away (its process ended, the network
    broke): one line instead of gloo's. From here on SIGTERM ends this process quietly: the launcher stops the
    remaining ranks of a failed run that way, and its own line names the rank that stopped."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    reason = "the connection was reset" if "reset by peer" in first or "Connection closed" in first else first[:120]
    return RankFailed(f"lost contact with {who} ({reason}); the run directory is resumable: run the same command again")


def handshake(world: World, digest: str, error: BaseException | None, checks: Any = None) -> None:
    """Every rank says it is ready (its config digest, or the error that stopped it building its part); rank 0
    decides whether the run starts and tells the others. Raises on rank 0: its own error, a ``RankFailed`` naming
    the first rank that could not build, a ``ConfigError`` when the ranks' configs differ or ``checks()`` (rank 0's
    own checks, e.g. more ranks than clients a round) fails. A worker whose run does not start gets
    ``RunRefused`` (it exits quietly: rank 0 says why)."""
    said = [None] * world.size
    try:
        dist.all_gather_object(said, (digest, None if error is None else one_line(error)))
    except RuntimeError as exc:
        raise lost(exc, "the other ranks before the run") from None
    verdict: list[Any] = [None]
    if world.leader:
        try:
            if error is not None:
                raise error
            for rank, (theirs, err) in enumerate(said):
                if err is not None:
                    raise RankFailed(f"rank {rank}: {err}")
            for rank, (theirs, _) in enumerate(said):
                if theirs != digest:
                    raise ConfigError(f"rank {rank}'s config differs from rank 0's (config digest {theirs} against "
                                      f"{digest}): every rank must run the same config, overrides and seed")
            if checks is not None:
                checks()
        except BaseException as exc:
            verdict[0] = one_line(exc)
            dist.broadcast_object_list(verdict, src=0)
            raise
        dist.broadcast_object_list(verdict, src=0)
        return
    try:
        dist.broadcast_object_list(verdict, src=0)
    except RuntimeError as exc:
        raise lost(exc, "rank 0 before the run") from None
    if verdict[0] is not None:
        raise RunRefused(verdict[0])


class RunRefused(Exception):
    """On a worker: rank 0 did not start the run (it reports why); the worker goes on to the next run or exits."""
