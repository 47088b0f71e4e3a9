"""What ``fedsight report`` wrote before, so that the same report run again replaces it without ``--force``.

A report folder (``--out``) holds ``.fedsight-report.json``: the sha256 of each file the last report wrote
(``report.md``, ``report.html`` and the curves by name, a ``--csv`` file by its absolute path). A file at one of
those paths whose bytes still have the recorded digest is FedSight's own earlier output and is replaced; anything
else (a file the user wrote or edited, a record that is missing or damaged) needs ``--force``, as before. A file
the last report wrote, unchanged, that this one does not write (a ``curves.png`` replaced by a curves figure per
section) is removed. The record is read by the bounded reader and written by the atomic writer
(``fedsight.safe_read``, ``fedsight.safe_write``).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

__all__ = ["RECORD", "Outputs"]

#: the record of what the last report wrote, in the report folder
RECORD = ".fedsight-report.json"


def _digest(path: Path) -> str | None:
    """sha256 of the regular file at ``path`` (None for anything else, or a file that cannot be read)."""
    from ..safe_read import read_bytes

    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None
        return hashlib.sha256(read_bytes(path)).hexdigest()
    except (OSError, ValueError):
        return None


class Outputs:
    """The files a report into ``out`` wrote before (its record), and the record of this one."""

    def __init__(self, out: str | os.PathLike[str]):
        self.out = Path(out)
        self.record_path = self.out / RECORD
        self.before: dict[str, str] = {}
        if self.record_path.is_file() and not self.record_path.is_symlink():
            from ..safe_read import read_json

            try:
                doc = read_json(self.record_path, "report record", limit=1 << 20)
            except (OSError, ValueError):
                doc = None
            files = doc.get("files") if isinstance(doc, dict) else None
            if isinstance(files, dict):
                self.before = {k: v for k, v in files.items() if isinstance(k, str) and isinstance(v, str)}

    def _key(self, path: Path) -> str:
        return path.name if path.parent == self.out else os.path.abspath(path)

    def ours(self, path: str | os.PathLike[str]) -> bool:
        """Whether ``path`` holds, unchanged, what an earlier report into this folder wrote there."""
        p = Path(path)
        recorded = self.before.get(self._key(p))
        return recorded is not None and _digest(p) == recorded

    def remove_stale(self, paths: list[Path]) -> list[Path]:
        """Remove the files of the report folder that the last report wrote and this one (``paths``) did not
        (``curves.png`` of a one-section report, once the runs need a curves figure per section), where they
        are still unchanged; return them. Files the user changed, and ``--csv`` files elsewhere, stay."""
        keep = {self._key(p) for p in paths}
        gone = []
        for key in self.before:
            path = self.out / key
            if key not in keep and "/" not in key and os.sep not in key and self.ours(path):
                path.unlink()
                gone.append(path)
        return gone

    def record(self, paths: list[Path]) -> None:
        """Write the record of ``paths`` (this report's files)."""
        from ..safe_write import atomic_write_text

        files = {self._key(p): d for p in paths if (d := _digest(p)) is not None}
        atomic_write_text(self.record_path, json.dumps({"format": 1, "files": files}, indent=1) + "\n")
