"""FedSight's error types: the bottom of the import graph, so every layer can raise them.

An error of these types carries a message already phrased for the user (the CLI prints it as is, one
line per problem); anything else reaching an entry point is a bug.
"""

from __future__ import annotations

import errno
import re


class FedSightError(Exception):
    """Base of FedSight's expected failures."""


class ConfigError(FedSightError, ValueError):
    """A configuration problem: a bad value, a missing key, or parts that do not fit together. The
    message names the key (and, for an incompatible combination, both sides)."""


class RunFileError(FedSightError, ValueError):
    """A file of a run directory that is damaged or does not fit the run (a checkpoint missing a tensor, a
    client state of another shape, a status that is not an object). The message names the file and what to
    do; nothing has been changed when it is raised."""


class DataFileError(FedSightError, ValueError):
    """A data, annotation or list file that cannot be read as what it should be (not a regular file, too
    large, not UTF-8, not valid JSON, nested or numbered past the reader's limits, a damaged archive). The
    message names the file (and the line or key where there is one); ``fedsight.safe_read`` raises it."""


class OutputPathError(FedSightError, ValueError):
    """A path a command was asked to write that FedSight refuses (``fedsight.safe_write``): inside a run
    directory the command does not own, a device, FIFO, socket or folder where a file goes, a symbolic link, or
    an existing file without ``--force``. The message names the path and why; nothing has been written."""


class TrackingError(FedSightError):
    """An experiment tracker (MLflow: ``fedsight.mlflow_tracking``) that cannot be reached or written: one line
    naming its URI. Rounds already recorded in the run directory stay; the run resumes."""


class WriteError(FedSightError, OSError):
    """A write that failed (a full disk, a file-size limit, no permission): an ``OSError`` with the ``errno``
    of the failure and ``filename``, the file being written, which its message names. What was being replaced
    is unchanged (writes go to a temporary file first)."""

    HINTS = {errno.ENOSPC: "the disk is full", errno.EFBIG: "past the file-size limit, ulimit -f",
             errno.EDQUOT: "over the disk quota"}

    def __str__(self) -> str:
        hint = self.HINTS.get(self.errno or 0)
        why = self.strerror or "failed"
        return f"{self.filename}: cannot write it: {why}" + (f" ({hint})" if hint and hint not in why else "")


class ModelRefused(FedSightError):
    """A client refuses the global model it received (a failed integrity check such as a watermark
    verification): raised from a component's ``client_start``; the client trains nothing this round and the
    server logs a ``model_refused`` event with the message and ``info``."""

    def __init__(self, message: str, **info: object):
        super().__init__(message)
        self.info = dict(info)


#: torch's allocation failures are RuntimeErrors ("DefaultCPUAllocator: can't allocate memory", "CUDA out of memory")
_ALLOC_FAILED = re.compile(r"can't allocate memory|out of memory|alloc_cpu|DefaultCPUAllocator", re.IGNORECASE)


def describe_error(exc: BaseException) -> str:
    """One line for an error that escaped a command: the file and the OS's reason for file-system errors,
    else the exception's type and message."""
    if isinstance(exc, OSError) and exc.filename is not None and not isinstance(exc, FedSightError):
        what = f"{exc.strerror or type(exc).__name__}: {exc.filename}"
        return what + (f" -> {exc.filename2}" if exc.filename2 else "")
    if isinstance(exc, FedSightError) or (isinstance(exc, FileNotFoundError) and exc.filename is None and str(exc)):
        return " ".join(str(exc).split())  # phrased for the user already (FedSight's own, naming the file)
    if isinstance(exc, MemoryError) or (isinstance(exc, RuntimeError) and _ALLOC_FAILED.search(str(exc))):
        return "out of memory (a size in the config or the data is too large for this machine)"
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
