"""A run directory's lock (``RunLock``: one process writes a run at a time) and the replacement of a whole run
directory that ``--overwrite`` does (``Replacement``: the old run moves aside and comes back if the new one fails
to start)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from .errors import RunFileError
from .safe_write import StrPath


class RunInUse(RunFileError):
    """Another process holds the run directory's lock (``RunLock``)."""


class RunLock:
    """An exclusive lock on a run directory while a process writes it: ``with RunLock(path): ...``.

    A second process (``fedsight run`` of the same config twice, ``run`` next to ``resume`` or ``evaluate``)
    fails at once with ``RunInUse`` naming the PID that holds it, before it reads or writes anything: two
    writers would interleave ``metrics.jsonl`` and the checkpoints. The lock is ``flock`` on a hidden sibling
    file ``.<name>.lock`` (not a file inside the directory: ``--overwrite`` moves the directory aside while the
    lock must stay), which holds the owner's PID and is removed on release; the operating system drops it when
    the process dies, so a killed run never leaves a stale lock. Parent folders created for the lock file are
    removed again on release when empty (a start that fails leaves nothing). Without ``fcntl`` (Windows) the
    lock is ``msvcrt.locking`` on the same file. Runs of one sweep take their locks side by side: a parent folder
    another process creates (or removes, empty) meanwhile is taken as it comes."""

    def __init__(self, path: StrPath):
        self.path = Path(path)
        self.file = self.path.parent / f".{self.path.name}.lock"
        self.fd: int | None = None
        self.created: list[Path] = []

    def _make_parents(self) -> None:
        for folder in reversed([self.file.parent, *self.file.parent.parents]):
            if not folder.exists():
                try:
                    folder.mkdir()
                except FileExistsError:  # another process made it meanwhile (a sweep's runs start side by side)
                    continue
                if folder not in self.created:  # made again after another process removed it: listed once
                    self.created.append(folder)

    def __enter__(self) -> "RunLock":
        while True:
            self._make_parents()
            try:
                fd = os.open(self.file, os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError:  # a process whose start failed removed an empty parent it had made: again
                continue
            try:
                _lock_fd(fd)
            except OSError:
                holder = os.read(fd, 64).decode("ascii", "replace").strip() or "unknown"
                os.close(fd)
                self._remove_created()
                raise RunInUse(f"{self.path} is in use by another FedSight process (PID {holder}); wait for it to "
                               "finish or stop it, or pick another run.name or output_dir") from None
            try:  # the holder before us may have removed the file between our open and our lock: lock the new one
                same = os.path.samestat(os.fstat(fd), os.stat(self.file))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.fd is not None:
            try:
                self.file.unlink(missing_ok=True)  # while locked: a newcomer then locks a fresh file
            except OSError:  # Windows does not remove an open file: it stays, unlocked
                pass
            os.close(self.fd)  # closing releases the lock
            self.fd = None
        self._remove_created()

    def _remove_created(self) -> None:
        for folder in reversed(self.created):
            try:
                folder.rmdir()  # only if empty: a run that wrote something keeps its folders
            except OSError:
                break
        self.created = []


def _lock_fd(fd: int) -> None:
    """An exclusive, non-blocking lock on ``fd``; OSError when another process holds it."""
    try:
        import fcntl
    except ImportError:  # Windows
        import msvcrt

        msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        return
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


class Replacement:
    """A run directory replaced by a new run (``overwrite``), deleted only once the new run is under way.

    ``Replacement(path)`` moves the FedSight run directory at ``path`` to a hidden sibling (nothing is
    deleted yet); ``done()`` deletes it once the new run has recorded its first round; ``undo()`` (the new
    run failed before that) deletes what the new run wrote and puts the old directory back. A path that
    exists but is not a FedSight run directory (no ``config.json``) and is not empty is refused with
    ``FileExistsError``: nothing else is ever replaced."""

    def __init__(self, path: StrPath):
        self.path = Path(path)
        self.aside: Path | None = None
        if not self.path.exists():
            return
        if not (self.path / "config.json").is_file():
            if self.path.is_dir() and not any(self.path.iterdir()):
                return
            raise FileExistsError(f"{self.path} exists and is not a FedSight run directory; refusing to replace it")
        self.aside = self.path.with_name(f".{self.path.name}.replaced")
        if self.aside.exists():  # left by a replacement that died before its first round: the older run
            shutil.rmtree(self.aside)
        os.replace(self.path, self.aside)

    def done(self) -> None:
        if self.aside is not None:
            shutil.rmtree(self.aside, ignore_errors=True)
            self.aside = None

    def undo(self) -> None:
        if self.aside is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            os.replace(self.aside, self.path)
            self.aside = None
