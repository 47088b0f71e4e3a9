"""Bounded readers for the files FedSight reads but did not write: dataset split files and image lists,
annotation JSON, ``.npz`` archives and TOML configs.

Every reader here

* refuses anything but a regular file at once: a FIFO, a device, a socket or a folder is named as such
  (``os.stat`` first; then the file is opened with ``O_NONBLOCK`` and checked again with ``fstat``, so a FIFO
  swapped in between cannot block the process);
* refuses a file larger than its cap (:data:`MAX_JSON_BYTES`, :data:`MAX_TEXT_BYTES`, :data:`MAX_TOML_BYTES`,
  :data:`MAX_NPZ_BYTES`), read in one bounded read;
* decodes UTF-8 strictly, naming the line and column of the first byte that is not UTF-8;
* parses JSON within the parser's nesting limit (deeper documents are refused, naming the line, instead of a
  ``RecursionError``) and Python's integer-digit limit (``sys.get_int_max_str_digits()``: refused naming the
  line, instead of a bare ``ValueError``);
* fails with one line naming the file (and the line, or the array): :class:`~fedsight.errors.DataFileError`
  (a ``ValueError``), or :class:`~fedsight.errors.ConfigError` for a TOML config; a missing file is a
  ``FileNotFoundError`` whose message names it.
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
import tomllib
import zipfile
import zlib
from typing import Any

from .errors import ConfigError, DataFileError

__all__ = [
    "MAX_JSON_BYTES", "MAX_NPZ_BYTES", "MAX_TEXT_BYTES", "MAX_TOML_BYTES", "NpzArrays",
    "check_regular", "exists", "loads_json", "read_bytes", "read_json", "read_jsonl", "read_npz", "read_text",
    "read_text_lines", "read_toml",
]

#: the largest JSON file read (COCO's person_keypoints_train2017.json is about 240 MB)
MAX_JSON_BYTES = 2 << 30
#: the largest text list (split list, image list) read
MAX_TEXT_BYTES = 1 << 30
#: the largest TOML config read
MAX_TOML_BYTES = 64 << 20
#: the largest ``.npz`` archive opened (arrays are read from it, not the whole file)
MAX_NPZ_BYTES = 256 << 30

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _name(path: str | os.PathLike[str], what: str) -> str:
    return f"{what} {os.fspath(path)}" if what else os.fspath(path)


def check_regular(path: str | os.PathLike[str], what: str = "", limit: int | None = None,
                  error: type[Exception] = DataFileError) -> os.stat_result:
    """``os.stat(path)`` of a regular file of at most ``limit`` bytes; else ``error`` naming the file
    (``FileNotFoundError`` when there is nothing at ``path``)."""
    name = _name(path, what)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{name}: not found") from None
    except (OSError, ValueError) as exc:  # ValueError: an embedded NUL byte
        raise error(f"{name}: cannot be read: {getattr(exc, 'strerror', None) or exc}") from None
    _check_stat(st, name, limit, error)
    return st


def _check_stat(st: os.stat_result, name: str, limit: int | None, error: type[Exception]) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{name}: is {_kind(st.st_mode)}, not a regular file")
    if limit is not None and st.st_size > limit:
        raise error(f"{name}: {st.st_size} bytes, more than the {limit}-byte limit of this reader")


def _open(path: str | os.PathLike[str], name: str, limit: int | None, error: type[Exception]):
    """A binary file object of the regular file at ``path``, opened without blocking on a FIFO."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise FileNotFoundError(f"{name}: not found") from None
    except (OSError, ValueError) as exc:
        raise error(f"{name}: cannot be read: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        _check_stat(os.fstat(fd), name, limit, error)  # what was opened, should the path have changed since
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: str | os.PathLike[str], what: str = "", limit: int = MAX_JSON_BYTES,
               error: type[Exception] = DataFileError) -> bytes:
    """The bytes of the regular file at ``path`` (at most ``limit``); see the module for what is refused."""
    name = _name(path, what)
    size = check_regular(path, what, limit, error).st_size
    with _open(path, name, limit, error) as f:
        try:
            data = f.read(min(limit, size) + 1)  # not read(limit + 1): that allocates the whole limit
            if len(data) > size:  # it grew since: the rest in bounded pieces
                parts, total = [data], len(data)
                while total <= limit and (chunk := f.read(min(1 << 24, limit + 1 - total))):
                    parts.append(chunk)
                    total += len(chunk)
                data = b"".join(parts)
        except OSError as exc:
            raise error(f"{name}: cannot be read: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise error(f"{name}: more than the {limit}-byte limit of this reader")
    return data


def _line_col(data: bytes | str, pos: int) -> tuple[int, int]:
    nl = b"\n" if isinstance(data, bytes) else "\n"
    return data.count(nl, 0, pos) + 1, pos - (data.rfind(nl, 0, pos) + 1) + 1


def _decode(data: bytes, name: str, error: type[Exception]) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line, col = _line_col(data, exc.start)
        raise error(f"{name}: line {line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at column {col})") from None


def read_text(path: str | os.PathLike[str], what: str = "", limit: int = MAX_TEXT_BYTES,
              error: type[Exception] = DataFileError) -> str:
    """The UTF-8 text of the regular file at ``path`` (strict: a byte that is not UTF-8 is refused, naming its line)."""
    return _decode(read_bytes(path, what, limit, error), _name(path, what), error)


def read_text_lines(path: str | os.PathLike[str], what: str = "list", limit: int = MAX_TEXT_BYTES) -> list[str]:
    """The lines of a UTF-8 text file (split at ``\\n``, a trailing ``\\r`` kept: numbered as an editor does)."""
    text = read_text(path, what, limit)
    lines = text.split("\n")
    return lines[:-1] if lines and lines[-1] == "" else lines


def _too_deep_at(text: str, limit: int, scan: int = 64 << 20) -> int | None:
    """Where (an offset) JSON ``text`` first nests deeper than ``limit`` (within its first ``scan`` characters)."""
    depth, in_str, esc = 0, False, False
    for i, ch in enumerate(text[:scan]):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return i
        elif ch in "]}":
            depth -= 1
    return None


#: nesting of JSON the reader accepts at most (Python's parser itself stops near the recursion limit)
MAX_JSON_DEPTH = 500


def _parse_json(text: str, name: str, error: type[Exception]) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{name}: not valid JSON: line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except RecursionError:
        at = _too_deep_at(text, MAX_JSON_DEPTH)
        where = f"line {_line_col(text, at)[0]}: " if at is not None else ""
        raise error(f"{name}: {where}JSON nested too deeply (more than {MAX_JSON_DEPTH} levels)") from None
    except ValueError as exc:  # an integer past Python's digit limit ("Exceeds the limit (4300 digits) ...")
        digits = sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else 0
        m = re.search(r"\d{%d,}" % (digits + 1), text) if digits else None
        where = f"line {_line_col(text, m.start())[0]}: " if m else ""
        what = f"an integer of more than {digits} digits" if digits else " ".join(str(exc).split())
        raise error(f"{name}: {where}{what}") from None


def loads_json(text: str, name: str, error: type[Exception] = DataFileError) -> Any:
    """``text`` parsed as JSON within the limits of the module (a nesting or digit bomb is ``error`` naming
    ``name``: a file, or ``file:line`` for a line of a JSONL log); invalid JSON is left to the caller as
    ``json.JSONDecodeError``, to be phrased as its format asks."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        raise
    except (RecursionError, ValueError):
        try:
            _parse_json(text, name, error)  # raises, naming the line
        except error as exc:
            msg = str(exc)
            if "\n" not in text:  # one line of a log: ``name`` already says which
                msg = msg.replace(f"{name}: line 1: ", f"{name}: ", 1)
            raise error(msg) from None
        raise
    if isinstance(doc, (dict, list)):
        _check_depth(doc, name, error)
    return doc


def read_jsonl(path: str | os.PathLike[str], what: str = "JSONL file", limit: int = MAX_JSON_BYTES,
               error: type[Exception] = DataFileError) -> list[tuple[int, Any]]:
    """(line number, value) of every non-blank line of the JSON-lines file at ``path``, within the limits of
    the module; a line that fails is ``error`` naming ``file:line``."""
    name = _name(path, what)
    out = []
    for lineno, line in enumerate(read_text(path, what, limit, error).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            out.append((lineno, loads_json(line, f"{name}:{lineno}", error)))
        except json.JSONDecodeError as exc:
            raise error(f"{name}:{lineno}: not valid JSON: column {exc.colno}: {exc.msg}") from None
    return out


def read_json(path: str | os.PathLike[str], what: str = "JSON file", limit: int = MAX_JSON_BYTES,
              error: type[Exception] = DataFileError) -> Any:
    """The JSON document in the regular file at ``path``, within the limits of the module."""
    name = _name(path, what)
    text = read_text(path, what, limit, error)
    doc = _parse_json(text, name, error)
    if isinstance(doc, (dict, list)):
        _check_depth(doc, name, error)
    return doc


def _check_depth(doc: Any, name: str, error: type[Exception]) -> None:
    """Nesting below the parser's limit but past :data:`MAX_JSON_DEPTH` (later code may recurse over it)."""
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise error(f"{name}: JSON nested too deeply (more than {MAX_JSON_DEPTH} levels)")
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)) and c)


def read_toml(path: str | os.PathLike[str], what: str = "", limit: int = MAX_TOML_BYTES) -> dict[str, Any]:
    """A TOML config (UTF-8, at most ``limit`` bytes); every failure is a :class:`ConfigError` naming the file."""
    p = os.fspath(path)
    name = _name(p, what)
    try:
        data = read_bytes(p, what, limit, ConfigError)
    except FileNotFoundError:
        raise ConfigError(f"{name}: config file not found") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line, col = _line_col(data, exc.start)
        raise ConfigError(f"{name}: not UTF-8 text (byte 0x{data[exc.start]:02x} at line {line}, column {col}); "
                          "TOML files must be UTF-8") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{name}: invalid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{name}: invalid TOML: nested too deeply") from None
    except ValueError as exc:  # an integer past Python's digit limit
        digits = sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else 0
        m = re.search(r"\d{%d,}" % (digits + 1), text) if digits else None
        where = f"line {_line_col(text, m.start())[0]}: " if m else ""
        raise ConfigError(f"{name}: invalid TOML: {where}an integer of more than {digits} digits") from None


class NpzArrays(dict):
    """The arrays read from an ``.npz`` archive by :func:`read_npz`; ``files`` lists every array it holds."""

    files: list[str]


def read_npz(path: str | os.PathLike[str], what: str = "npz file", keys: list[str] | None = None,
             limit: int = MAX_NPZ_BYTES) -> NpzArrays:
    """The arrays ``keys`` (all when None; those the archive lacks are left out: see ``.files``) of the
    ``.npz`` archive at ``path``, read now, so that a damaged archive (not a zip, a bad CRC, a truncated or
    malformed member) fails here, naming the file and the array."""
    import numpy as np

    name = _name(path, what)
    check_regular(path, what, limit)
    with _open(path, name, limit, DataFileError) as f:
        magic = f.read(4)
        if magic not in (b"PK\x03\x04", b"PK\x05\x06", b"\x93NUM"):  # a zip archive (npz) or a .npy
            raise DataFileError(f"{name}: not a NumPy .npz archive (wrong file or corrupt)")
        f.seek(0)
        member = None
        try:
            obj = np.load(f, allow_pickle=False)
            if not isinstance(obj, np.lib.npyio.NpzFile):
                raise DataFileError(f"{name}: a single .npy array, not an .npz archive with named arrays")
            with obj:
                out = NpzArrays()
                out.files = list(obj.files)
                for member in (out.files if keys is None else [k for k in keys if k in out.files]):
                    arr = obj[member]
                    if not isinstance(arr, np.ndarray):  # a member that is not a .npy: numpy gives its bytes
                        raise DataFileError(f"{name}: array {member!r} is not a NumPy array (damaged or foreign)")
                    out[member] = arr
        except DataFileError:
            raise
        except MemoryError:
            where = f"array {member!r}" if member else "its index"
            raise DataFileError(f"{name}: {where} declares more data than fits in memory (damaged?)") from None
        except (OSError, ValueError, EOFError, KeyError, AttributeError, TypeError, IndexError, zipfile.BadZipFile,
                zlib.error, NotImplementedError, RuntimeError) as exc:
            where = f"array {member!r}: " if member else ""
            text = " ".join(str(exc).split())[:200]
            raise DataFileError(f"{name}: {where}damaged or not an .npz archive ({type(exc).__name__}: {text})") from None
    return out


def exists(path: str | os.PathLike[str]) -> bool:
    """Whether anything (a file, folder, FIFO, ...) is at ``path``: the readers then say what is wrong with it."""
    try:
        os.stat(path)
    except (OSError, ValueError):
        return False
    return True
