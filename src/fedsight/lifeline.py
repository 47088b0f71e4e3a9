"""Worker processes that end with the process that started them, even when it is SIGKILLed.

:func:`die_with_parent` runs first thing in a worker (a ``ProcessPoolExecutor`` initializer, or called by
one). Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, so the kernel kills the worker the moment its parent
dies; the signal follows the *thread* that started the worker, so the caller asks for it only when that
thread outlives the worker (the main thread, or a thread that joins its pool before it ends). Everywhere: a
daemon thread polls ``os.getppid()`` every :data:`POLL_S` seconds and ends the worker once it changed (the
parent died and the worker was re-parented), also while the worker is busy computing. A parent that died
before the worker got this far is caught by comparing the PID it was given.
"""

from __future__ import annotations

import os
import sys
import threading
import time

__all__ = ["POLL_S", "die_with_parent"]

#: seconds between two checks of a worker's parent (the portable half)
POLL_S = 0.25


def _set_pdeathsig() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):  # no prctl: the polling thread still applies
        pass


def die_with_parent(parent: int | None = None, deathsig: bool = True) -> None:
    """End this process when its parent ends. ``parent``: the PID its parent must have (None: the one it has
    now, e.g. under a forkserver); ``deathsig``: also set Linux's parent-death signal (see the module)."""
    if deathsig:
        _set_pdeathsig()
    expected = os.getppid() if parent is None else int(parent)
    if os.getppid() != expected:  # the parent is already gone
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(POLL_S)
            if os.getppid() != expected:
                os._exit(1)

    threading.Thread(target=watch, name="fedsight-parent-watch", daemon=True).start()
