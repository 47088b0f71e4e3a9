"""A Flower deployment on loopback: one SuperLink and N SuperNodes, driven end to end.

``LocalDeployment`` starts real Flower processes (``flower-superlink``, ``flower-supernode``) on free
loopback ports with a private ``FLWR_HOME``, runtime dependency installation and telemetry off; it
submits a FedSight app with ``flwr run``, polls the run's status with ``flwr ls`` (``flwr run`` exits
0 even when the run fails), and stops every process it started, by PID, with their descendants
(``flower-superexec``, ``flwr-serverapp``, ``flwr-clientapp``). Optionally with TLS
(``tls.make_tls``) and SuperNode authentication (keys registered with ``flwr supernode register``).

``run_local`` is what ``fedsight flower local`` does: the FedSight run directory is written by the
ServerApp (it runs on this machine), progress is streamed from its ``metrics.jsonl``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import INSTALL
from .tls import TLSFiles

CONNECTION = "fedsight-local"


class FlowerRunError(RuntimeError):
    """The Flower run failed, or did not finish in time; the message carries Flower's reason."""


class FlowerInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped ``run_local``: the Flower run was stopped on the SuperLink, then the
    SuperNodes and the SuperLink; the message says where the run directory was left."""


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (bound together, so distinct, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(")") + 2 :].split()[1])
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children first, depth first); Linux ``/proc`` only."""
    if not os.path.isdir("/proc"):
        return []
    kids, out, stack = _children(), [], [pid]
    while stack:
        for c in kids.get(stack.pop(), []):
            out.append(c)
            stack.append(c)
    return out


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not count)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return stat[stat.rfind(")") + 2] != "Z"
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path
    #: every PID seen under this process (recorded at stop, for checks)
    tree: list[int] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.popen.pid


def _signal(pids: list[int], sig: int) -> None:
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, sig)


class LocalDeployment:
    """SuperLink + SuperNodes on 127.0.0.1, each a process this object started and will stop."""

    def __init__(self, workdir: str | Path, *, tls: TLSFiles | None = None, node_auth: bool = False,
                 env: dict[str, str] | None = None):
        self.workdir = Path(workdir).absolute()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.home = self.workdir / "flwr-home"
        self.home.mkdir(exist_ok=True)
        self.logs = self.workdir / "logs"
        self.logs.mkdir(exist_ok=True)
        self.tls, self.node_auth = tls, node_auth
        self.env = {
            **os.environ,
            "FLWR_HOME": str(self.home),
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        self.port = 0
        self.superlink: Proc | None = None
        self.nodes: dict[int, Proc] = {}
        self.stopped: list[Proc] = []
        #: what was stopped, in order ("run N", "serverapp", process names), also in logs/shutdown.log
        self.shutdown: list[str] = []

    # -- processes --------------------------------------------------------------------------------

    def _bin(self, name: str) -> str:
        here = Path(sys.executable).parent / name
        found = str(here) if here.exists() else shutil.which(name)
        if found is None:
            raise FileNotFoundError(f"{name} not found: install the flower extra (in a FedSight clone: {INSTALL})")
        return found

    def _spawn(self, name: str, args: list[str]) -> Proc:
        log = self.logs / f"{name}.log"
        f = open(log, "ab")
        try:
            popen = subprocess.Popen([self._bin(args[0]), *args[1:]], stdout=f, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self.env, cwd=self.workdir, start_new_session=True)
        finally:
            f.close()
        return Proc(name, popen, log)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start_superlink(self, timeout: float = 60.0) -> Proc:
        """Start the SuperLink on a free port; wait until ``/health`` answers."""
        self.port = free_ports(1)[0]
        args = ["flower-superlink", "--host", "127.0.0.1", "--port", str(self.port), "--disable-runtime-dependency-installation"]
        if self.tls is None:
            args.append("--insecure")
        else:
            args += ["--ssl-ca-certfile", str(self.tls.ca_cert), "--ssl-certfile", str(self.tls.server_cert),
                     "--ssl-keyfile", str(self.tls.server_key)]
        if self.node_auth:
            args.append("--enable-supernode-auth")
        self.superlink = self._spawn("superlink", args)
        self._wait_health(timeout)
        self.write_connection()
        return self.superlink

    def _wait_health(self, timeout: float) -> None:
        scheme = "http" if self.tls is None else "https"
        ctx = None if self.tls is None else ssl.create_default_context(cafile=str(self.tls.ca_cert))
        deadline = time.monotonic() + timeout
        while True:
            assert self.superlink is not None
            if self.superlink.popen.poll() is not None:
                raise FlowerRunError(f"the SuperLink exited with code {self.superlink.popen.returncode}:\n{self.tail('superlink')}")
            try:
                with urllib.request.urlopen(f"{scheme}://{self.address}/health", timeout=2, context=ctx) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise FlowerRunError(f"the SuperLink did not answer /health within {timeout:g} s:\n{self.tail('superlink')}")
            time.sleep(0.2)

    def write_connection(self, name: str = CONNECTION, *, insecure: bool | None = None) -> None:
        """``$FLWR_HOME/config.toml`` with the SuperLink connection ``name`` (the default one)."""
        import tomli_w

        conn: dict[str, Any] = {"address": self.address}
        if insecure if insecure is not None else self.tls is None:
            conn["insecure"] = True
        else:
            assert self.tls is not None
            conn["root-certificates"] = str(self.tls.ca_cert)
        cfg_path = self.home / "config.toml"
        import tomllib

        data = tomllib.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        data.setdefault("superlink", {})
        data["superlink"].setdefault("default", name)
        data["superlink"][name] = conn
        cfg_path.write_text(tomli_w.dumps(data))

    def start_supernode(self, index: int, node_config: dict[str, Any], *, auth_key: Path | None = None,
                        name: str | None = None) -> Proc:
        """A SuperNode with its node config (written to a TOML file: any path or string is safe)."""
        import tomli_w

        cfg_file = self.workdir / f"node-{index}.toml"
        cfg_file.write_text(tomli_w.dumps(node_config))
        port = free_ports(1)[0]
        args = ["flower-supernode", "--superlink", self.address, "--port", str(port), "--node-config", str(cfg_file)]
        if self.tls is None:
            args.append("--insecure")
        else:
            args += ["--root-certificates", str(self.tls.ca_cert)]
        if auth_key is not None:
            args += ["--auth-supernode-private-key", str(auth_key)]
        proc = self._spawn(name or f"supernode-{index}", args)
        self.nodes[index] = proc
        return proc

    def kill_node(self, index: int) -> None:
        """Kill SuperNode ``index`` and its descendants at once (SIGKILL: a crash, not a shutdown)."""
        proc = self.nodes.pop(index)
        self._stop(proc, sig=signal.SIGKILL)

    def _stop(self, proc: Proc, sig: int = signal.SIGTERM, grace: float = 5.0) -> None:
        self._stop_all([proc], sig, grace)

    def _stop_all(self, procs: list[Proc], sig: int = signal.SIGTERM, grace: float = 5.0) -> None:
        """Signal ``procs`` and their descendants together, wait up to ``grace`` s, SIGKILL what is left."""
        trees = {}
        for proc in procs:
            trees[proc.pid] = descendants(proc.pid)
            proc.tree = [proc.pid, *trees[proc.pid]]
        for proc in procs:
            _signal([proc.pid], sig)
            _signal(trees[proc.pid], sig)
        deadline = time.monotonic() + grace
        for proc in procs:
            try:
                proc.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal([proc.pid], signal.SIGKILL)
                proc.popen.wait(timeout=grace)
        # descendants that ignored the signal (or appeared meanwhile)
        late = [p for proc in procs for p in trees[proc.pid] + descendants(proc.pid) if alive(p)]
        deadline = time.monotonic() + grace
        while late and time.monotonic() < deadline:
            time.sleep(0.1)
            late = [p for p in late if alive(p)]
        _signal(late, signal.SIGKILL)
        for proc in procs:
            self.stopped.append(proc)
            self._note(proc.name)

    def _note(self, what: str) -> None:
        self.shutdown.append(what)
        with open(self.logs / "shutdown.log", "a") as f:
            f.write(f"{time.time():.3f} {what}\n")

    def serverapps(self) -> list[int]:
        """PIDs of the live ``flwr-serverapp`` processes under the SuperLink (one per running run)."""
        out = []
        for pid in descendants(self.superlink.pid) if self.superlink is not None else []:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"flwr-serverapp" in cmd and alive(pid):
                out.append(pid)
        return out

    def stop_run(self, run_id: int, grace: float = 15.0) -> None:
        """Stop run ``run_id`` on the SuperLink (``flwr stop``), then wait ``grace`` s for its ServerApp
        process to exit (it notices the stop at its next heartbeat), then SIGTERM it (Flower's exit handler
        ends it gracefully; FedSight's ServerApp marks the run directory interrupted), SIGKILL as a last resort."""
        self.flwr("stop", str(run_id), CONNECTION, check=False, timeout=60)
        self._note(f"run {run_id}")
        apps = self.serverapps()
        deadline = time.monotonic() + grace
        while apps and time.monotonic() < deadline:
            time.sleep(0.2)
            apps = [p for p in apps if alive(p)]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            _signal(apps, sig)
            deadline = time.monotonic() + 10.0
            while apps and time.monotonic() < deadline:
                time.sleep(0.2)
                apps = [p for p in apps if alive(p)]
        self._note("serverapp")

    def stop(self) -> None:
        """Stop every process this deployment started (nodes first, then the SuperLink), by PID. A running
        Flower run is stopped first with ``stop_run`` (``run_local`` does on SIGINT/SIGTERM)."""
        if self.nodes:  # all at once (each takes seconds to shut down)
            self._stop_all([self.nodes.pop(index) for index in list(self.nodes)])
        if self.superlink is not None:
            self._stop(self.superlink)
            self.superlink = None

    def all_pids(self) -> list[int]:
        return [p for proc in self.stopped for p in proc.tree]

    def __enter__(self) -> "LocalDeployment":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- the flwr CLI -----------------------------------------------------------------------------

    def tail(self, name: str, lines: int = 40) -> str:
        p = self.logs / f"{name}.log"
        return "\n".join(p.read_text(errors="replace").splitlines()[-lines:]) if p.is_file() else "(no log)"

    def flwr(self, *args: str, timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run([self._bin("flwr"), *args], capture_output=True, text=True, env=self.env,
                             cwd=self.workdir, timeout=timeout)
        if check and out.returncode != 0:
            raise FlowerRunError(f"flwr {' '.join(args)} exited with {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
        return out

    def _json_or_text(self, *args: str) -> dict[str, Any]:
        """``flwr ARGS --format json`` parsed, whatever the exit code (Flower reports errors in the JSON)."""
        out = self.flwr(*args, "--format", "json", check=False)
        start = out.stdout.find("{")
        if start < 0:
            return {"success": False, "error-message": (out.stdout + out.stderr)[-2000:]}
        return json.loads(out.stdout[start:])

    def _json(self, *args: str) -> dict[str, Any]:
        out = self.flwr(*args, "--format", "json")
        text = out.stdout
        start = text.find("{")
        if start < 0:
            raise FlowerRunError(f"flwr {' '.join(args)} printed no JSON:\n{text[-2000:]}\n{out.stderr[-2000:]}")
        return json.loads(text[start:])

    def submit(self, app_dir: str | Path, run_config: str | None = None) -> int:
        """``flwr run APP CONNECTION``: upload the app, return the run id."""
        args = ["run", str(app_dir), CONNECTION]
        if run_config:
            args += ["--run-config", run_config]
        data = self._json(*args)
        if not data.get("success") or data.get("run-id") is None:
            raise FlowerRunError(f"flwr run did not create a run: {data}")
        return int(data["run-id"])

    def run_status(self, run_id: int) -> dict[str, Any]:
        data = self._json("ls", CONNECTION, "--run-id", str(run_id))
        runs = data.get("runs") or []
        return runs[0] if runs else {"status": "unknown"}

    def nodes_online(self) -> list[dict[str, Any]]:
        data = self._json("supernode", "list", CONNECTION)
        return [n for n in data.get("nodes", []) if n.get("status") == "online"]

    def register_node(self, public_key: Path, name: str | None = None) -> None:
        args = ["supernode", "register", str(public_key), CONNECTION]
        if name:
            args += ["--name", name]
        self.flwr(*args)

    def wait_run(self, run_id: int, timeout: float, on_poll: Callable[[], None] | None = None,
                 poll: float = 3.0, busy_poll: float = 30.0, tick: float = 0.5) -> dict[str, Any]:
        """Poll the run's status (``flwr ls``) until it is finished (returns its row) or ``timeout`` passes
        (the run is stopped, ``FlowerRunError``). ``on_poll`` runs every ``tick`` s (progress, test hooks).

        Each ``flwr ls`` is a process importing Flower (1.2 s of CPU here): asked every 3 s, that is a third of
        a core for the whole run. So the status is asked every ``poll`` s only while no ServerApp process runs
        under our SuperLink (before the run starts, and once it has ended), and every ``busy_poll`` s while one
        runs (Flower stopping the run from outside, the one case then, is noticed that much later)."""
        deadline = time.monotonic() + timeout
        next_status = 0.0
        while True:
            if on_poll is not None:
                on_poll()
            now = time.monotonic()
            if now >= next_status or (next_status - now > poll and not self.serverapps()):
                st = self.run_status(run_id)
                if str(st.get("status", "")).startswith("finished"):
                    return st
                next_status = time.monotonic() + (busy_poll if self.serverapps() else poll)
            if self.superlink is not None and self.superlink.popen.poll() is not None:
                raise FlowerRunError(f"the SuperLink died:\n{self.tail('superlink')}")
            if time.monotonic() > deadline:
                self.flwr("stop", str(run_id), CONNECTION, check=False)
                raise FlowerRunError(f"run {run_id} did not finish within {timeout:g} s (status {st.get('status')})")
            time.sleep(tick)

    def run_log(self, run_id: int) -> str:
        out = self.flwr("log", str(run_id), CONNECTION, "--show", check=False, timeout=60)
        return out.stdout + out.stderr


def _follow(path: Path, seen: int, emit: Callable[[dict[str, Any]], None]) -> int:
    """Emit the rows of ``path`` after the first ``seen`` complete lines; the new count."""
    if not path.is_file():
        return seen
    lines = path.read_text().splitlines(keepends=True)
    complete = [ln for ln in lines if ln.endswith("\n")]
    for ln in complete[seen:]:
        if ln.strip():
            emit(json.loads(ln))
    return len(complete)


def provision_local(keys_dir: Path, n: int, given: str | Path | None = None) -> tuple[list[Path], Path]:
    """The node keys of a loopback deployment with node authentication and the provisioning file that binds
    them: node ``k``'s key pair is ``keys_dir/node{k}`` (``tls.make_node_key``: kept if there, as
    ``fedsight flower certs DIR --node-keys N`` left it, else made) and node ``k`` holds partition ``k``. The file is
    ``given`` (``--provisioning``), else ``keys_dir/provisioning.json`` if certs wrote it, else written there now
    (``provisioning.write_provisioning``). A ``ConfigError`` naming the file when it does not bind node ``k``'s key
    to partition ``k``. Returns (the private keys, the provisioning file)."""
    from .provisioning import FILE, check_local_nodes, read_provisioning, write_provisioning
    from .tls import make_node_key

    private = [make_node_key(keys_dir, f"node{k}") for k in range(n)]
    path = Path(given) if given is not None else keys_dir / FILE
    if given is None and not path.exists():
        write_provisioning(keys_dir, range(n))
    check_local_nodes(read_provisioning(path, n), [Path(f"{p}.pub") for p in private])
    return private, path.absolute()


def run_local(
    cfg: Any,
    run_dir: str | Path,
    *,
    nodes: int | None = None,
    workdir: str | Path | None = None,
    options: dict[str, Any] | None = None,
    timeout: float = 3600.0,
    on_row: Callable[[dict[str, Any], "LocalDeployment"], None] | None = None,
    tls_dir: str | Path | None = None,
    node_auth: bool = False,
    data_dirs: list[str | Path] | None = None,
    keep_workdir: bool = False,
) -> dict[str, Any]:
    """Start a SuperLink and ``nodes`` SuperNodes (SuperNode ``k`` holds FedSight client ``k``) on
    loopback, run ``cfg`` as a Flower app, stream ``metrics.jsonl`` rows to ``on_row``, and stop every
    process. Returns the run's final ``flwr ls`` row; raises ``FlowerRunError`` if the run failed.

    ``tls_dir``: TLS for the SuperLink (certificates generated there by ``tls.make_tls`` if missing);
    ``node_auth``: SuperNode authentication (one ECDSA key per node, registered before it starts), every client
    bound to its node's key from the start (``provision_local``);
    ``data_dirs``: node ``k`` reads its own data from ``data_dirs[k]`` instead of its partition."""
    from ..errors import ConfigError
    from .app import write_app
    from .options import preflight

    n_clients = int(cfg.partition.num_clients)
    n = nodes or n_clients
    if n != n_clients:
        raise ValueError(f"--nodes {n}: a SuperNode holds one FedSight client, and the run has partition.num_clients = {n_clients}")
    if data_dirs is not None and len(data_dirs) != n:
        raise ValueError(f"{len(data_dirs)} data directories for {n} nodes")
    run_dir = Path(run_dir).absolute()
    opts = {"min-nodes": n, **(options or {})}
    if data_dirs is not None:
        opts["data"] = "data-dir"
    if opts.get("provisioning") and not node_auth:
        raise ConfigError(f"provisioning file {opts['provisioning']} given without node authentication (--node-auth): "
                          "SuperNodes without keys get temporary keys that no provisioning file lists")
    preflight(cfg, opts, run_dir)  # a ConfigError before any process starts or anything is written
    own = workdir is None
    work = Path(tempfile.mkdtemp(prefix="fedsight-flower-")) if own else Path(workdir).absolute()
    keys: list[Path | None] = [None] * n
    try:
        if node_auth:  # every client bound to its node's key from the start
            keys_dir = Path(tls_dir).absolute() if tls_dir is not None else work / "keys"
            keys[:], prov = provision_local(keys_dir, n, opts.get("provisioning") or None)
            opts["provisioning"] = str(prov)
        app_dir = write_app(cfg, work / "app", run_dir=run_dir, options=opts)
    except BaseException:
        if own and not keep_workdir:
            shutil.rmtree(work, ignore_errors=True)
        raise
    tls = None
    if tls_dir is not None or node_auth:
        from .tls import make_tls

        tls = make_tls(Path(tls_dir or work / "tls"))
    dep = LocalDeployment(work, tls=tls, node_auth=node_auth)
    emit = (lambda row: on_row(row, dep)) if on_row is not None else (lambda row: None)
    run_id: int | None = None
    restore = _sigterm_interrupts()
    try:
        dep.start_superlink()
        for k in range(n):
            key = keys[k]
            if key is not None:
                dep.register_node(Path(f"{key}.pub"), name=f"node{k}")
            nc: dict[str, Any] = {"partition-id": k, "num-partitions": n, "state-dir": str(work / "node-state" / f"node{k}")}
            if data_dirs is not None:
                nc["data-dir"] = str(Path(data_dirs[k]).absolute())
            dep.start_supernode(k, nc, auth_key=key)
        run_id = dep.submit(app_dir)
        seen = [0]

        def poll() -> None:
            seen[0] = _follow(run_dir / "metrics.jsonl", seen[0], emit)

        final = dep.wait_run(run_id, timeout, on_poll=poll)
        poll()
        final["run-id"] = run_id
        if final.get("status") != "finished:completed":
            log = dep.run_log(run_id)
            raise FlowerRunError(f"run {run_id} {final.get('status')}: {final.get('status-details')}\n{log[-4000:]}")
        status = run_dir / "status.json"
        if not status.is_file() or json.loads(status.read_text()).get("state") != "complete":
            raise FlowerRunError(f"run {run_id} finished but {run_dir} is not complete:\n{dep.run_log(run_id)[-4000:]}")
        (run_dir / "flower-run.json").write_text(json.dumps(final, indent=2) + "\n")
        return final
    except KeyboardInterrupt:  # SIGINT, or SIGTERM (_sigterm_interrupts): the run first, then the processes
        with _signals_ignored():
            if run_id is not None:
                dep.stop_run(run_id)
            dep.stop()
        raise FlowerInterrupted(_interrupted(run_dir, run_id)) from None
    finally:
        with _signals_ignored():
            dep.stop()
        restore()
        if own and not keep_workdir:
            shutil.rmtree(work, ignore_errors=True)


def _interrupted(run_dir: Path, run_id: int | None) -> str:
    """Mark ``run_dir`` interrupted at its last recorded round (unless it completed); one line saying so."""
    from ..runs import INTERRUPTED, RunDir

    if run_id is None:
        return "interrupted before the Flower run was submitted; every process started was stopped"
    run = RunDir(run_dir)
    st = run.read_status() if (run_dir / "status.json").is_file() else {}
    if st.get("state") == "complete":
        return f"interrupted after run {run_id} completed; run directory: {run_dir}"
    if st.get("state") in ("running", INTERRUPTED):
        run.write_status(INTERRUPTED, int(st["round"]), int(st["rounds"]))
        where = f"at round {st['round']} of {st['rounds']}; {run_dir} is marked '{INTERRUPTED}'"
    else:
        where = "before its first round"
    return (f"run {run_id} stopped on the SuperLink, then the SuperNodes and the SuperLink, {where}. A Flower run "
            "cannot be resumed (`fedsight resume` does not apply): start it again with --overwrite")


def _sigterm_interrupts() -> Callable[[], None]:
    """Make SIGTERM raise KeyboardInterrupt like SIGINT (main thread only); returns the undo."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, handler)
    return lambda: signal.signal(signal.SIGTERM, old)


@contextlib.contextmanager
def _signals_ignored():
    """SIGINT and SIGTERM ignored while the processes are being stopped (a second Ctrl-C must not leave
    SuperNodes or a SuperLink behind); main thread only."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
