"""A sweep's runs in parallel processes (``fedsight run --jobs N``).

Each worker is a fresh process (``spawn``: no state inherited from the parent's torch) that expands the same
config with the same overrides, runs the sweep member it is given by index through ``api.execute`` (the run
directory's lock, resume and skip rules as in a serial sweep) with its run's ``engine.threads`` (auto: 1), and
reports every finished round to the parent through a queue. A run gives the same numbers as in a serial sweep
(same config, seed and threads). A run that fails does not stop the others: its error is returned with its index.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

#: what the parent hears: ("round", index, round, row) after each round of run ``index``, and
#: ("phase", index, 0, {"phase": text}) when it starts and whenever its phase changes (``api.execute``'s on_phase)
Message = tuple[str, int, int, dict[str, Any]]


_MESSAGES: Any = None
#: this worker's state: a run is executing (SIGTERM interrupts it), and SIGTERM has come (no run starts after it)
_RUNNING = False
_STOPPED = False


def _init(messages: Any, parent: int | None = None) -> None:
    """A worker's start: the queue to the parent, SIGTERM stopping it as Ctrl-C does (its run is then
    marked interrupted at its last recorded round, and no later run starts in it: the pool may have queued
    one already), and the worker ending with its parent (a SIGKILLed ``fedsight run --jobs N`` leaves no run
    going on unseen; each is resumable as after a kill)."""
    import signal

    from .lifeline import die_with_parent

    # the pool lives (and its workers start) in run_parallel's thread, which joins them before it returns
    die_with_parent(parent, deathsig=True)
    global _MESSAGES
    _MESSAGES = messages

    def interrupt(signum: int, frame: Any) -> None:
        global _STOPPED
        _STOPPED = True
        if _RUNNING:  # between runs the worker just takes no further run (an exception there breaks the pool)
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def _worker(config: str, overrides: Sequence[str], only: Sequence[str], index: int, overwrite: bool,
            stop_after: int | None, smoke: bool) -> tuple[int, str, str | None]:
    """Run sweep member ``index``; (index, status, error message or None)."""
    global _RUNNING
    if _STOPPED:  # the pool had queued this run before the stop: it never starts
        return index, "interrupted", None
    _MESSAGES.put(("phase", index, 0, {"phase": "starting"}))
    from .api import execute
    from .errors import FedSightError
    from .sweep import load

    spec = load(config, overrides, only, smoke)[index]

    def on_round(r: int, row: dict[str, Any]) -> None:
        _MESSAGES.put(("round", index, r, {k: v for k, v in row.items() if isinstance(v, (int, float, str))}))

    try:
        _RUNNING = True
        if _STOPPED:  # SIGTERM came while this run was being set up
            raise KeyboardInterrupt
        out = execute(spec.config, spec.run_dir, overwrite=overwrite, stop_after=stop_after, on_round=on_round,
                      on_phase=lambda text: _MESSAGES.put(("phase", index, 0, {"phase": text})))
    except (FedSightError, FileNotFoundError, ValueError, OSError) as exc:
        return index, "failed", " ".join(str(exc).split())
    except KeyboardInterrupt:
        return index, "interrupted", None
    finally:
        _RUNNING = False
    return index, out.status, None


def run_parallel(config: Path, overrides: Sequence[str], only: Sequence[str], members: Sequence[int], jobs: int, *,
                 overwrite: bool = False, stop_after: int | None = None, smoke: bool = False,
                 on_message: Callable[[Message], None] | None = None) -> list[tuple[int, str, str | None]]:
    """Run the sweep's ``members`` (indices into the expanded sweep) in ``jobs`` processes; one (index, status,
    error) per member, in index order. ``on_message`` hears every finished round and every phase of every member
    (``Message``)."""
    ctx = mp.get_context("spawn")
    messages = ctx.Queue()
    pool = ProcessPoolExecutor(max_workers=max(1, min(jobs, len(members))), mp_context=ctx, initializer=_init,
                               initargs=(messages, os.getpid()))
    try:
        pending = {pool.submit(_worker, str(config), list(overrides), list(only), i, overwrite, stop_after, smoke)
                   for i in members}
        results = []
        while pending:
            done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            _drain(messages, on_message)
            results += [f.result() for f in done]
        _drain(messages, on_message)
    except BaseException:  # Ctrl-C or SIGTERM: every worker stops as a serial run would, its run marked interrupted
        import signal

        procs = list((getattr(pool, "_processes", None) or {}).values())  # shutdown sets it to None
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)
        for proc in procs:
            proc.join(60)
        raise
    pool.shutdown()
    return sorted(results)


def _drain(messages: Any, on_message: Callable[[Message], None] | None) -> None:
    while True:
        try:
            msg = messages.get_nowait()
        except queue_mod.Empty:
            return
        if on_message is not None:
            on_message(msg)
