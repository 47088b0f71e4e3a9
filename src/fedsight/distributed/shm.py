"""A round's message between two ranks of one machine through POSIX shared memory instead of gloo's TCP.

gloo sends a message's payload over a TCP socket even between processes of one machine: 5.3 MB of the bench's
uploads took 2.9 ms a round on this project's 2-core CPU, where copying them is 0.12 ms (docs/performance.md,
"Distributed backend"). Here each direction between two ranks (``src`` to ``dst``) has one shared-memory segment:
the sender writes the payload into it (the one copy ``wire.send`` makes anyway) and sends gloo only the lengths
and the segment's generation; the receiver copies the payload out into a tensor of its own. The bytes are the
ones gloo would have delivered, so every number is unchanged.

One segment a direction suffices because the protocol alternates: rank 0 sends rank k an order and waits for its
answer before the next order, and rank k answers only after it has read the order (``engine._exchange``,
``engine.serve``), so a sender never writes a segment the receiver has not read out yet. A payload larger than the
segment makes a new one (the next generation, 1.5 times the size needed); the receiver attaches to it and removes
its name at once (the mapping stays valid on both sides), so a rank that dies leaves nothing in ``/dev/shm`` once
the other side has attached; each side unmaps at exit. Python's resource tracker is kept out of it (``_untracked``).

Used when every rank is on this machine (torchrun's ``LOCAL_WORLD_SIZE`` equals ``WORLD_SIZE``) and torchrun set a
run id (``TORCHELASTIC_RUN_ID``, which names the segments so that two runs never meet); ``FEDSIGHT_DIST_SHM=0``
turns it off (gloo's transfer, as across machines).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import sys
from collections.abc import Iterator
from typing import Any
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

import torch

#: environment variable: "0" sends every message over gloo even between ranks of one machine
ENV = "FEDSIGHT_DIST_SHM"
#: where POSIX shared memory lives on Linux (its free space is checked before a segment is made)
SHM_DIR = "/dev/shm"


def enabled() -> bool:
    """Whether messages between ranks go through shared memory (see the module docstring)."""
    env = os.environ
    return (env.get(ENV, "1") != "0" and bool(env.get("TORCHELASTIC_RUN_ID"))
            and env.get("LOCAL_WORLD_SIZE") is not None and env.get("LOCAL_WORLD_SIZE") == env.get("WORLD_SIZE")
            and os.path.isdir(SHM_DIR))


@contextlib.contextmanager
def _untracked() -> Iterator[dict[str, Any]]:
    """Keep Python's resource tracker out of a segment's creation, attachment and removal: it would unlink an
    attached segment at exit (CPython issue 82300), and torchrun's ranks share one tracker, whose set of names
    fails on the second removal of a name two ranks registered. Python 3.13+: ``track=False``; before, the
    tracker's two calls are replaced for the moment (the ranks' messages are sent from one thread)."""
    if sys.version_info >= (3, 13):
        yield {"track": False}
        return
    register, unregister = resource_tracker.register, resource_tracker.unregister
    resource_tracker.register = resource_tracker.unregister = lambda name, rtype: None  # type: ignore[assignment]
    try:
        yield {}
    finally:
        resource_tracker.register, resource_tracker.unregister = register, unregister


def _segment(name: str, size: int = 0) -> SharedMemory:
    """A new segment of ``size`` bytes (``size`` > 0), or the existing one called ``name``, untracked."""
    with _untracked() as kw:
        return SharedMemory(name=name, create=size > 0, size=size, **kw)


def _unlink(shm: SharedMemory) -> None:
    with _untracked():
        try:
            shm.unlink()
        except FileNotFoundError:
            pass


class _Segment:
    """One direction's current segment: its generation (1, 2, ...; 0 before the first) and a byte view of it."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.gen = 0
        self.shm: SharedMemory | None = None
        self.view: torch.Tensor | None = None

    def name(self, gen: int) -> str:
        return f"{self.prefix}-{gen}"

    def _map(self, shm: SharedMemory, gen: int) -> None:
        self.close()
        self.shm, self.gen = shm, gen
        self.view = torch.frombuffer(shm.buf, dtype=torch.uint8)

    def close(self, unlink: bool = False) -> None:
        if self.shm is None:
            return
        self.view = None  # (the tensor holds the mapping's buffer: released before it is closed)
        shm, self.shm = self.shm, None
        try:
            shm.close()
        except BufferError:  # (a view still held elsewhere: the mapping goes with the process)
            pass
        if unlink:
            _unlink(shm)


class Writer(_Segment):
    """The sending side of one direction."""

    def buffer(self, nbytes: int) -> tuple[int, torch.Tensor] | None:
        """(generation, a ``uint8`` tensor of ``nbytes`` bytes in the segment) to write the next message into, or
        None where a segment that large cannot be made: the message then goes over gloo. The shared-memory file
        system must have the room first (a write into a mapped segment beyond what it holds kills the process with
        SIGBUS; a container's ``/dev/shm`` is often 64 MB)."""
        if self.view is None or self.view.numel() < nbytes:
            size = max(1, nbytes + nbytes // 2)
            try:
                st = os.statvfs(SHM_DIR)
                if size > st.f_bavail * st.f_frsize:
                    return None
                shm = _segment(self.name(self.gen + 1), size)
            except OSError:
                return None
            self.close(unlink=True)  # (the previous generation's name, if the receiver has not removed it yet)
            self._map(shm, self.gen + 1)
        assert self.view is not None
        return self.gen, self.view[:nbytes]


class Reader(_Segment):
    """The receiving side of one direction."""

    def read(self, gen: int, nbytes: int) -> torch.Tensor:
        """The ``nbytes`` bytes the writer put in its segment of generation ``gen``, copied into a new tensor."""
        if gen != self.gen:
            shm = _segment(self.name(gen))
            self._map(shm, gen)
            _unlink(shm)  # attached: the name is no longer needed by either side
        assert self.view is not None
        return self.view[:nbytes].clone()


_WRITERS: dict[tuple[int, int], Writer] = {}
_READERS: dict[tuple[int, int], Reader] = {}


def _prefix(src: int, dst: int) -> str:
    run = re.sub(r"[^A-Za-z0-9_.-]", "-", os.environ.get("TORCHELASTIC_RUN_ID", "run"))[:80]
    return f"fedsight-{run}-{src}to{dst}"


def writer(src: int, dst: int) -> Writer:
    if (src, dst) not in _WRITERS:
        _WRITERS[src, dst] = Writer(_prefix(src, dst))
    return _WRITERS[src, dst]


def reader(src: int, dst: int) -> Reader:
    if (src, dst) not in _READERS:
        _READERS[src, dst] = Reader(_prefix(src, dst))
    return _READERS[src, dst]


@atexit.register
def close_all() -> None:
    """Unmap every segment, and remove the names this process created that no receiver removed."""
    for w in _WRITERS.values():
        w.close(unlink=True)
    for r in _READERS.values():
        r.close()
    _WRITERS.clear()
    _READERS.clear()
