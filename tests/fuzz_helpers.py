"""Shared machinery of the fuzz suite (``test_fuzz.py``) and the kill test (``test_kill.py``).

* ``SLOW``: ``FEDSIGHT_SLOW=1`` (the suite's slow flag; ``FEDSIGHT_FUZZ_SLOW=1`` as before) selects the long mode (>= 500 fuzz cases, >= 20 kill moments); the default
  (CI) mode is a small, derandomized subset.
* ``cli(args)``: the ``fedsight`` entry point (``fedsight.cli.main``) run in this process with ``sys.argv``
  set, stdout/stderr captured; ``error_problems(result)`` lists how a failure's output breaks the error
  contract (non-zero exit, no traceback, one ``error:`` line naming the problem).
* ``digest(root)``: sha256 of every file under a folder, to check that a failing command left a run intact.
* ``COUNTS``: executed cases per test; ``conftest.py`` prints them at the end of the session.
* ``install_kill_hook()``: run inside a real ``fedsight`` process (``test_kill.py``), kills that process with
  SIGKILL at one chosen file-system moment (``FEDSIGHT_TEST_KILL_AT``).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import sys
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

SLOW = any(os.environ.get(flag, "") not in ("", "0") for flag in ("FEDSIGHT_SLOW", "FEDSIGHT_FUZZ_SLOW"))

#: test name -> cases executed in this session (printed by conftest's terminal summary)
COUNTS: Counter[str] = Counter()


def count(name: str, n: int = 1) -> None:
    COUNTS[name] += n


def fuzz_settings(fast: int, slow: int):
    """Hypothesis settings: ``fast`` derandomized examples in CI mode, ``slow`` random ones in the slow mode."""
    from hypothesis import HealthCheck, Phase, settings

    return settings(
        max_examples=slow if SLOW else fast,
        derandomize=not SLOW,
        deadline=None,
        database=None,
        phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink),
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )


# -- the command line, in process --------------------------------------------------------------------


@dataclass
class Result:
    args: list[str]
    code: int  # the exit status; -1: an exception escaped main()
    out: str
    err: str

    def show(self) -> str:
        return f"$ fedsight {' '.join(map(repr, self.args))}\nexit {self.code}\n--- stderr\n{self.err}--- stdout (tail)\n{self.out[-800:]}"


def cli(args: list[str], cwd: str | Path | None = None, env: dict[str, str] | None = None) -> Result:
    """``fedsight ARGS`` through ``fedsight.cli.main`` (the console script's function) in this process."""
    from fedsight import cli as C

    out, err = io.StringIO(), io.StringIO()
    saved_argv, saved_env = sys.argv, {k: os.environ.get(k) for k in (env or {})}
    sys.argv = ["fedsight", *args]
    os.environ.update(env or {})
    code = 0
    try:
        with contextlib.ExitStack() as stack:
            if cwd is not None:
                stack.enter_context(contextlib.chdir(cwd))
            stack.enter_context(contextlib.redirect_stdout(out))
            stack.enter_context(contextlib.redirect_stderr(err))
            try:
                C.main()
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException:  # noqa: BLE001 - main() is the boundary: nothing may get past it
                code = -1
                err.write(traceback.format_exc())
    finally:
        sys.argv = saved_argv
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return Result(list(args), code, out.getvalue(), err.getvalue())


PREFIX = "error: "
DEBUG_HINT = "(set FEDSIGHT_DEBUG=1 for the traceback)"
#: the catch-all boundary's text for an exception it did not expect: "error: KeyError: 'round'"
_LEAKED = re.compile(r"^error: (?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit|Interrupt|Iteration)\b:?")


def lines_of(text: str) -> list[str]:
    return [x for x in text.splitlines() if x.strip()]


def is_usage_box(res: Result) -> bool:
    """click/typer's usage error (``Usage: ...``, ``Try ...``, a boxed ``Error``; or the box alone)."""
    lines = lines_of(res.err)
    return bool(lines) and (lines[0].startswith("Usage: ") or lines[0].startswith("\u256d\u2500 Error"))


def error_problems(res: Result, *, codes: tuple[int, ...] = (1, 2), usage_box_ok: bool = False) -> list[str]:
    """How a failing command's result breaks the error contract (empty: it keeps it).

    The contract (docs/guarantees.md, ``fedsight.cli.main``): a non-zero exit (2 for configuration, 1
    otherwise), no traceback, and stderr of one line ``error: <what>`` naming the file, key or option.
    Accepted beyond that one line: the boundary's hint line for an OS error it reports (``(set
    FEDSIGHT_DEBUG=1 ...)``), and a configuration error's further lines, one per further problem, each
    starting with the same file (``error: c.toml: ...`` / ``c.toml: ...``). An internal exception's class
    name heading the message (``error: KeyError: ...``) counts as a traceback: the failure was not expected.
    ``usage_box_ok``: accept click's multi-line usage box (exit 2; a known deviation pinned elsewhere).
    """
    problems = []
    lines = lines_of(res.err)
    if res.code == 0:
        problems.append("exit status 0 for invalid input")
    elif res.code not in codes:
        problems.append(f"exit status {res.code}, expected one of {codes}")
    if "Traceback (most recent call last)" in res.err + res.out:
        problems.append("a traceback")
    if not lines:
        problems.append("nothing on stderr")
        return problems
    if usage_box_ok and is_usage_box(res):
        if res.code != 2 or not any("Error" in x for x in lines):
            problems.append("a usage error without exit 2 and an Error line")
        return problems
    if not lines[0].startswith(PREFIX):
        problems.append(f"stderr does not start with {PREFIX!r}: {lines[0][:120]!r}")
        return problems
    if _LEAKED.match(lines[0]):
        problems.append(f"an internal exception reached the catch-all boundary: {lines[0][:200]!r}")
    source = lines[0][len(PREFIX):].split(": ", 1)[0]
    for extra in lines[1:]:
        if extra.strip() == DEBUG_HINT:
            continue
        if ": " in lines[0][len(PREFIX):] and extra.startswith(source + ": "):
            continue  # one line per further problem of the same file
        problems.append(f"more than one line on stderr: {extra[:160]!r}")
        break
    return problems


# -- run directories --------------------------------------------------------------------------------


def digest(root: str | Path) -> dict[str, str]:
    """relative path -> sha256 of every file under ``root`` (folders as ``path/``)."""
    root = Path(root)
    out: dict[str, str] = {}
    if not root.exists():
        return out
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_dir():
            out[rel + "/"] = "dir"
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[rel] = "other"
    return out


def diff_digests(before: dict[str, str], after: dict[str, str]) -> list[str]:
    out = []
    for k in sorted(set(before) | set(after)):
        if k not in after:
            out.append(f"deleted {k}")
        elif k not in before:
            out.append(f"created {k}")
        elif before[k] != after[k]:
            out.append(f"changed {k}")
    return out


def metric_rows(run_dir: str | Path) -> list[dict]:
    """metrics.jsonl's round lines without event lines and without wall-clock fields (``time/...``)."""
    import json

    path = Path(run_dir) / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows if "event" not in r]


# -- SIGKILL at a chosen moment (runs inside the killed process) ---------------------------------------

KILL_ENV = "FEDSIGHT_TEST_KILL_AT"  # "<op>:<glob>:<n>:<when>", e.g. "replace:status.json:2:before"
ROOT_ENV = "FEDSIGHT_TEST_KILL_ROOT"  # only file operations under this folder count
TRACE_ENV = "FEDSIGHT_TEST_KILL_TRACE"  # append every counted operation here (one "op name" a line)


def install_kill_hook() -> None:
    """Wrap the file operations a run's writers use (safetensors' ``save_file``, the client store's
    ``atomic_write_bytes`` (as "save"), ``os.replace`` (which
    ``Path.replace`` calls), ``os.unlink`` (``Path.unlink``), the metrics/client-weights appends) and SIGKILL
    this process at the n-th operation of one kind on a file whose name matches a glob: ``before`` it,
    ``after`` it, or ``mid`` (``save``: the file half written; ``append``: half a line written).

    It kills this process with the same signal a user's ``kill -9`` (or the OOM killer) sends: nothing of
    the program runs after it, no ``finally``, no ``atexit``."""
    import fnmatch
    import signal

    spec = os.environ.get(KILL_ENV, "")
    root = Path(os.environ[ROOT_ENV]).resolve()
    trace = os.environ.get(TRACE_ENV)
    op_k, glob_k, n_k, when_k = spec.split(":") if spec else ("", "", "0", "")
    seen = Counter()

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def event(op: str, path: object) -> str | None:
        """The moment of this operation ('before'/'mid'/'after' kill), or None."""
        try:
            p = Path(os.fsdecode(path)).resolve()
        except (TypeError, ValueError):
            return None
        if not p.is_relative_to(root):
            return None
        if trace:
            with open(trace, "a") as f:
                f.write(f"{op} {p.relative_to(root).as_posix()}\n")
        if op != op_k or not fnmatch.fnmatch(p.name, glob_k):
            return None
        seen[op] += 1
        return when_k if seen[op] == int(n_k) else None

    real_replace, real_unlink = os.replace, os.unlink

    def replace(src, dst, *a, **kw):
        when = event("replace", dst)
        if when == "before":
            die()
        real_replace(src, dst, *a, **kw)
        if when == "after":
            die()

    def unlink(path, *a, **kw):
        when = event("unlink", path)
        if when == "before":
            die()
        real_unlink(path, *a, **kw)
        if when == "after":
            die()

    os.replace, os.unlink = replace, unlink

    import safetensors.torch as st

    from fedsight import runs, state

    real_save = st.save_file

    def save_file(tensors, filename, *a, **kw):
        when = event("save", filename)
        if when == "before":
            die()
        real_save(tensors, filename, *a, **kw)
        if when == "mid":
            size = os.path.getsize(filename)
            with open(filename, "r+b") as f:
                f.truncate(size // 2)
        if when in ("mid", "after"):
            die()

    st.save_file = runs.save_file = save_file

    real_atomic = state.atomic_write_bytes

    def atomic_write_bytes(path, data):  # the client store's writes: bytes to a temporary file, then renamed
        when = event("save", path)
        if when == "before":
            die()
        if when == "mid":  # half the bytes in the temporary file the real writer would leave
            tmp = Path(path).with_name(f".{Path(path).name}.killed.tmp")
            tmp.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(data[: len(data) // 2])
            die()
        real_atomic(path, data)
        if when == "after":
            die()

    state.atomic_write_bytes = atomic_write_bytes

    def appender(real, name):
        def wrapped(self, *a, **kw):
            path = self.path / name
            when = event("append", path)
            if when == "before":
                die()
            if when == "mid":
                size = path.stat().st_size if path.exists() else 0
                real(self, *a, **kw)  # the whole line, then cut it in half: a torn append
                new = path.stat().st_size
                with open(path, "r+b") as f:
                    f.truncate(size + (new - size) // 2)
                die()
            real(self, *a, **kw)
            if when == "after":
                die()

        return wrapped

    runs.RunDir.append_metrics = appender(runs.RunDir.append_metrics, runs.METRICS_FILE)
    runs.RunDir.append_client_weights = appender(runs.RunDir.append_client_weights, "client_weights.jsonl")


def zygote_main() -> None:
    """Run in a fresh interpreter (``python -c "import fuzz_helpers as h; h.zygote_main()"``): import FedSight
    once, then for each job of the JSON list on stdin (``{"case": folder, "spec": moment, "args": [...],
    "log": file}``) fork a process that runs ``fedsight ARGS`` (``fedsight.cli.main``, the console script's
    function) in ``case`` with the kill hook armed at ``spec``, two at a time. Prints one JSON object: case
    -> the process's exit status (``-9``: killed by SIGKILL). Forking from an interpreter that has done the
    imports (and no computation: no thread pool exists yet) saves each killed run the start-up time."""
    import json

    jobs = json.loads(sys.stdin.read())
    import sklearn.datasets  # noqa: F401 - the imports every job shares (digits; plots)

    import fedsight.api
    import fedsight.reporting.plots  # noqa: F401
    from fedsight import cli as C

    status: dict[str, int] = {}
    running: dict[int, str] = {}

    def reap() -> None:
        pid, st = os.wait()
        status[running.pop(pid)] = -os.WTERMSIG(st) if os.WIFSIGNALED(st) else os.WEXITSTATUS(st)

    for job in jobs:
        while len(running) >= int(os.environ.get("FEDSIGHT_TEST_PARALLEL", "2")):
            reap()
        pid = os.fork()
        if pid == 0:  # the job
            code = 70
            try:
                fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.chdir(job["case"])
                os.environ[KILL_ENV], os.environ[ROOT_ENV] = job["spec"], job["case"]
                install_kill_hook()
                sys.argv = ["fedsight", *job["args"]]
                try:
                    C.main()
                    code = 0
                except SystemExit as exc:
                    code = exc.code if isinstance(exc.code, int) else 1
            except BaseException:  # noqa: BLE001
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        running[pid] = job["case"]
    while running:
        reap()
    print(json.dumps(status))
