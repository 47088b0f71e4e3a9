"""The one guard for every path a command writes at a user's word, and the one writer of whole files.

:func:`check_output` (a file: ``report --csv``, ``pretrain --out``, ``partition --out``, ``etlc`` outputs) and
:func:`check_output_folder` (a folder and the files a command puts in it: ``report --out``, ``flower certs``,
``flower app``) refuse, before anything is computed or written, with one line naming the path and why
(:class:`~fedsight.errors.OutputPathError`, exit 2):

* a path inside a run directory the command does not own (a folder with a run's ``config.json`` and
  ``status.json``: ``enclosing_run``), also through a symbolic link;
* a device, FIFO, socket or folder where a file goes (a temporary file renamed onto ``/dev/null`` would
  replace the device node), and a file where a folder goes;
* a symbolic link (the rename would replace the link, not what it points to);
* an existing file, unless ``force`` (the command's ``--force``).

:func:`check_run_dir` does the same for a run directory (``fedsight run``'s ``run.output_dir``, ``resume``,
``evaluate``): never inside another run, never a symbolic link or special file, nor below one.

:func:`atomic_write_bytes` writes every whole file FedSight writes (run files, plots, reports, weights): a
temporary file in the same folder, ``fsync``, then ``rename`` onto the path, and only onto nothing or a regular
file (what stands there is checked again just before the rename). The file gets the mode of the file it
replaces, else the mode a plain ``open`` would give (``0666`` less the umask); secrets pass ``mode=0o600``
(``fedsight.secret``, the server's central-DP key, TLS and node keys, ``etlc keygen``). A failed write (a full disk, a file-size
limit: ``ENOSPC``, ``EFBIG``) is a :class:`~fedsight.errors.WriteError` naming the file being written; the
temporary file is removed and what stood at the path is unchanged. :func:`append_line` appends a line to a
run's log the same way: a failure names the file.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .errors import OutputPathError, WriteError

__all__ = ["append_line", "atomic_write_bytes", "atomic_write_text", "check_output", "check_output_folder",
           "check_run_dir", "enclosing_run", "file_mode"]

StrPath = str | os.PathLike[str]

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link"),
          (stat.S_ISREG, "a file"))


def enclosing_run(path: StrPath) -> Path | None:
    """The FedSight run directory ``path`` lies in (or is), if any: a folder with ``config.json`` and
    ``status.json``. Commands that write a file by ``--out`` refuse paths inside a run."""
    p = Path(path).absolute()
    for folder in (p, *p.parents):
        if (folder / "config.json").is_file() and (folder / "status.json").is_file():
            return folder
    return None


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _lstat(path: Path, label: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        raise OutputPathError(f"{label}: a file stands where its folder should be") from None
    except OSError as exc:
        raise OutputPathError(f"{label}: cannot be checked ({exc.strerror or exc})") from None


def _label(option: str, path: StrPath) -> str:
    return f"{option} {os.fspath(path)}" if option else os.fspath(path)


def _inside_run(path: Path, owner: StrPath | None) -> Path | None:
    """The run directory ``path`` lies in (as written, and once symbolic links are resolved), unless it is
    ``owner``."""

    mine = Path(os.path.realpath(owner)) if owner is not None else None
    for p in (path.absolute(), Path(os.path.realpath(path))):
        run = enclosing_run(p)
        if run is not None and (mine is None or Path(os.path.realpath(run)) != mine):
            return run
    return None


def _check_name(path: StrPath, option: str) -> Path:
    text = os.fspath(path)
    if "\x00" in text:
        raise OutputPathError(f"{_label(option, text.replace(chr(0), '?'))}: holds a NUL byte; not a usable path")
    if not text:
        raise OutputPathError(f"{option or 'output path'}: empty; name a file")
    return Path(text)


def check_output(path: StrPath, option: str = "", *, force: bool = False, owner: StrPath | None = None,
                 exists_ok: bool = False) -> Path:
    """``path`` as a ``Path`` when a command may write the file there; else an ``OutputPathError`` naming it
    (``option``: how the user gave it, e.g. ``"--csv"``) and why. ``force``: an existing regular file may be
    replaced; ``owner``: the run directory the command writes (paths inside it are its own); ``exists_ok``: an
    existing regular file is the command's to replace (a default path of its own, not the user's)."""
    p = _check_name(path, option)
    label = _label(option, p)
    run = _inside_run(p, owner)
    if run is not None:
        raise OutputPathError(f"{label} is inside the run directory {run}; choose a path outside it")
    st = _lstat(p, label)
    if st is not None:
        if not stat.S_ISREG(st.st_mode):
            raise OutputPathError(f"{label}: is {_kind(st.st_mode)}, not a regular file; FedSight writes only "
                                  "regular files and replaces nothing else")
        if not (force or exists_ok):
            raise OutputPathError(f"{label}: exists; pass --force to replace it")
    for parent in p.absolute().parents:  # the nearest existing folder above it must be a folder
        pst = _lstat(parent, label)
        if pst is None:
            continue
        if not stat.S_ISDIR(os.stat(parent).st_mode if stat.S_ISLNK(pst.st_mode) else pst.st_mode):
            raise OutputPathError(f"{label}: {parent} is {_kind(pst.st_mode)}, not a folder")
        break
    return p


def check_output_folder(folder: StrPath, option: str = "", files: Iterable[str] = (), *, force: bool = False,
                        owner: StrPath | None = None) -> Path:
    """``folder`` as a ``Path`` when a command may write ``files`` (names in it) there: the folder is not inside a
    run directory the command does not own, is a folder (or nothing yet; a symbolic link to a folder is
    followed), and each of ``files`` passes :func:`check_output` (``force``: existing ones may be replaced)."""
    p = _check_name(folder, option)
    label = _label(option, p)
    run = _inside_run(p, owner)
    if run is not None:
        raise OutputPathError(f"{label} is inside the run directory {run}; choose a path outside it")
    try:
        st = os.stat(p)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise OutputPathError(f"{label}: cannot be checked ({exc.strerror or exc})") from None
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise OutputPathError(f"{label}: is {_kind(st.st_mode)}, not a folder")
    for name in files:
        check_output(p / name, "", force=force, owner=owner)
    return p


def check_run_dir(run_dir: StrPath, what: str = "") -> Path:
    """``run_dir`` as a ``Path`` when a run may be created, continued or evaluated there (``fedsight run``,
    ``resume``, ``evaluate``; ``what``: how the user gave it, e.g. ``run.output_dir = 'runs'``); else an
    ``OutputPathError`` naming it and why. Refused: a run directory inside another run directory (a run it does
    not own: also through a symbolic link), a run directory that is a symbolic link or not a folder, a folder
    above it that is not a folder (a FIFO, a device, a file, a symbolic link to nothing; a symbolic link to a
    folder is followed), and a lock file beside it (``.NAME.lock``, ``fedsight.runs.RunLock``) that is not a
    regular file. The run directory itself may exist: a run resumes, or is read back, in its own folder."""
    p = _check_name(run_dir, what)
    label = what or f"run directory {p}"
    for parent in (p.absolute().parent, Path(os.path.realpath(p.absolute().parent))):
        run = enclosing_run(parent)
        if run is not None:
            raise OutputPathError(f"{label}: the run directory {p} would be inside the run directory {run}, a run it "
                                  "does not own; choose an output_dir outside it")
    for parent in p.absolute().parents:  # the nearest existing folder above it must be a folder
        try:
            pst = os.lstat(parent)
        except (FileNotFoundError, NotADirectoryError):  # not there (or below a file: found further up)
            continue
        except OSError as exc:
            raise OutputPathError(f"{label}: {parent} cannot be checked ({exc.strerror or exc})") from None
        try:
            mode = os.stat(parent).st_mode if stat.S_ISLNK(pst.st_mode) else pst.st_mode
        except OSError:
            raise OutputPathError(f"{label}: {parent} is a symbolic link to nothing, not a folder") from None
        if not stat.S_ISDIR(mode):
            raise OutputPathError(f"{label}: {parent} is {_kind(mode)}, not a folder")
        break
    st = _lstat(p, label)
    if st is not None and stat.S_ISLNK(st.st_mode):
        raise OutputPathError(f"{label}: the run directory {p} is a symbolic link (to {os.readlink(p)}); FedSight "
                              "writes a run only into a folder of its own: give the folder it points to")
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise OutputPathError(f"{label}: the run directory {p} is {_kind(st.st_mode)}, not a folder")
    lock = p.parent / f".{p.name}.lock"
    lst = _lstat(lock, label)
    if lst is not None and not stat.S_ISREG(lst.st_mode):
        raise OutputPathError(f"{label}: the run's lock file {lock} is {_kind(lst.st_mode)}, not a regular file; "
                              "remove it (FedSight makes its own)")
    return p


def _failed(path: Path, exc: OSError) -> WriteError:
    return WriteError(exc.errno, exc.strerror or str(exc), os.fspath(path))


def _replaceable(path: Path) -> None:
    """Refuse a rename onto anything but nothing or a regular file (checked again at the moment of writing)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        raise OutputPathError(f"{path}: cannot write it: it is {_kind(st.st_mode)}, not a regular file, and FedSight "
                              "replaces nothing else")


def _umask() -> int:
    """The process's umask, read without changing it where the OS tells it (Linux: ``/proc/self/status``);
    elsewhere set and restored at once."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode(path: StrPath) -> int:
    """The mode :func:`atomic_write_bytes` gives ``path`` by default: that of the regular file it replaces, else
    ``0666`` less the umask (what ``open(path, "w")`` gives)."""
    try:
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode):
            return stat.S_IMODE(st.st_mode)
    except OSError:
        pass
    return 0o666 & ~_umask()


def _write_all(f: Any, data: bytes, path: Path) -> None:
    """Write ``data`` to ``f``, the temporary file for ``path`` (one place, so a test can fail it: ``ENOSPC``)."""
    f.write(data)
    f.flush()
    os.fsync(f.fileno())


def atomic_write_bytes(path: StrPath, data: bytes, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` by a temporary file in its folder, ``fsync`` and rename; onto nothing or a
    regular file only. ``mode``: the file's permission bits (default: :func:`file_mode`; a secret: ``0o600``,
    which the temporary file has from the start). A failure is a ``WriteError`` naming ``path`` (an
    ``OSError`` with the failure's errno), or an ``OutputPathError`` for what stands there; either way no
    temporary file is left."""
    path = Path(path)
    _replaceable(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # mode 0600
    except WriteError:
        raise
    except OSError as exc:
        raise _failed(path, exc) from None
    try:
        with os.fdopen(fd, "wb") as f:
            want = file_mode(path) if mode is None else mode
            if want != 0o600 and hasattr(os, "fchmod"):
                os.fchmod(f.fileno(), want)
            _write_all(f, data, path)
        _replaceable(path)
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            if os.path.lexists(tmp):
                os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError) and not isinstance(exc, WriteError):
            raise _failed(path, exc) from None
        raise


def atomic_write_text(path: StrPath, text: str, mode: int | None = None) -> None:
    atomic_write_bytes(path, text.encode(), mode)


def append_line(path: StrPath, line: str, sync: bool = True) -> None:
    """Append ``line`` (with its newline) to the log ``path``; a failure is a ``WriteError`` naming it (a
    partial line it may leave is what a reader of the log drops as torn)."""
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            if sync:
                os.fsync(f.fileno())
    except WriteError:
        raise
    except OSError as exc:
        raise _failed(Path(path), exc) from None
