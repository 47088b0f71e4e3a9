"""Real Flower processes on loopback, three deployments: `fedsight flower local` with 1 SuperLink + 3
SuperNodes running a SCAFFOLD recipe for 2 rounds (bit-identical to the in-process simulator), the same
with SecAgg+ (FedAvg, one round, equal to the in-process run within the quantisation), and one over TLS with
SuperNode authentication where a SuperNode is killed mid-run and then `fedsight flower local` is interrupted
with SIGINT (the TLS/auth refusals are checked on that deployment while it runs).

A deployment's time is mostly Flower's latency (polling sleeps, a fresh ClientApp process per message, a
round timeout), so the three run at once, each a `fedsight flower local` subprocess: a module fixture starts
them together and each test checks its own. Their CPU is not small either (a SuperLink, SuperNodes and
SuperExecs each, and a process importing torch and Flower for every message): the module runs on one pytest
worker (``xdist_group``).

Every deployment has its own free ports and a private FLWR_HOME under tmp_path, runtime dependency
installation off, status polling with a timeout, and every process it started is stopped by PID
(checked: none of them, nor any flower process under this test process, is alive afterwards).
A deployment round costs about 15 s (Flower's 3 s polling and a fresh ClientApp process per message),
so these runs skip Flower-side local evaluation (``eval.local = false``; the adapter's local
evaluation is compared with the simulator in test_adapter.py and test_simulation.py) and use the fewest
nodes and rounds their property needs."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import tomli_w
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from fedsight.api import execute
from fedsight.config import validate
from fedsight.engine.simulation import sample_clients
from fedsight.flower.cli import flower_app
from fedsight.flower.local import LocalDeployment, alive, descendants
from fedsight.flower.tls import make_node_key, make_tls

from helpers import tiny

#: the executables a loopback deployment starts (flwr's console scripts); without them the deployment
#: tests are skipped, not failed
_MISSING = [b for b in ("flower-superlink", "flower-supernode", "flower-superexec", "flwr")
            if not (Path(sys.executable).parent / b).exists() and shutil.which(b) is None]
#: one worker runs the whole module (`--dist loadgroup`, the README's test command): with the tests split over two
#: workers, each started the module fixture, eight deployments at once, and a 2-core machine missed their timeouts
pytestmark = [pytest.mark.flower, pytest.mark.xdist_group("flower-deployments"),
              pytest.mark.skipif(bool(_MISSING), reason=f"Flower executables not found: {', '.join(_MISSING)}")]

RUN = {"partition.num_clients": 3, "server.clients_per_round": 2, "server.rounds": 2, "eval.every": 1, "eval.local": False,
       "recipe.components": ["scaffold"], "recipe.weighting": "uniform", "engine.threads": 1}
TIMEOUT = 400  # seconds for a whole run: generous for a loaded 2-core CI machine running three deployments


def _flower_processes_alive() -> list[str]:
    out = []
    for pid in descendants(os.getpid()):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if alive(pid) and ("flower-" in cmd or "flwr" in cmd):
            out.append(f"{pid}: {cmd}")
    return out


def _rows(run_dir: Path) -> list[dict]:
    """The rows of ``run_dir/metrics.jsonl`` written so far (none before the file exists; a line still being
    written is left out)."""
    path = run_dir / "metrics.jsonl"
    text = path.read_text() if path.is_file() else ""
    return [json.loads(x) for x in text.splitlines(keepends=True) if x.endswith("\n") and x.strip()]


def _core(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "flower/"))} for r in rows]


def _processes_with_home(home: Path) -> dict[int, str]:
    """Live processes (any parent) whose FLWR_HOME is ``home``: pid -> command line."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if f"FLWR_HOME={home}".encode() in env and alive(int(entry)):
            out[int(entry)] = cmd
    return out


def _refusals(tmp_path: Path, home: Path) -> None:
    """On the running TLS + node-auth SuperLink of ``home``: plaintext clients (the flwr CLI with an insecure
    connection, a plain HTTP request) are refused; the two registered nodes are online; a node with an
    unregistered key is turned away (Flower exit code 305)."""
    import tomllib
    import urllib.request

    address = tomllib.loads((home / "config.toml").read_text())["superlink"]["fedsight-local"]["address"]
    probe = LocalDeployment(tmp_path / "probe", tls=make_tls(tmp_path / "tls"), node_auth=True)
    probe.port = int(address.rsplit(":", 1)[1])
    try:
        probe.write_connection()  # TLS, trusting only our CA
        probe.write_connection("plain", insecure=True)
        plain = probe._json_or_text("supernode", "list", "plain")
        assert plain.get("success") is False and "unavailable" in plain.get("error-message", ""), plain
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://{address}/health", timeout=5)
        assert len(probe.nodes_online()) == 2
        stranger = make_node_key(tmp_path / "keys", "stranger")
        rogue = probe.start_supernode(9, {"partition-id": 0, "num-partitions": 2}, auth_key=stranger)
        rc = rogue.popen.wait(timeout=90)
        assert rc != 0 and "Exit Code: 305" in probe.tail("supernode-9"), probe.tail("supernode-9")
    finally:
        probe.stop()
    assert all(not alive(p) for p in probe.all_pids())


def _cli(args: list[str], cwd: Path) -> subprocess.Popen:
    """`fedsight ARGS` in a subprocess, stdout and stderr merged, one line at a time. The child starts with
    SIGINT at its default, as from an interactive shell: a test session started in the background by a
    non-interactive shell (``pytest &``) ignores SIGINT, children inherit that, and Python then never raises
    KeyboardInterrupt."""
    import signal

    return subprocess.Popen([sys.executable, "-c", "from fedsight.cli import main; main()", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=cwd,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _loopback(d: Path) -> dict:
    """`fedsight flower local CONFIG --nodes 3`, and the in-process run of the same config while it runs."""
    raw = tiny(**RUN)
    (d / "run.toml").write_text(tomli_w.dumps(raw))
    t0 = time.monotonic()
    proc = _cli(["flower", "local", str(d / "run.toml"), "--nodes", "3", "--run-dir", str(d / "flower"),
                 "--workdir", str(d / "work"), "--timeout", str(TIMEOUT), "--round-timeout", "120"], d)
    try:
        execute(validate(raw), d / "inproc")
    except BaseException:
        proc.send_signal(__import__("signal").SIGINT)  # the deployment stops what it started
        proc.wait(timeout=120)
        raise
    output, _ = proc.communicate(timeout=TIMEOUT + 60)
    return {"rc": proc.returncode, "output": output, "elapsed": time.monotonic() - t0}


def _secagg(d: Path) -> dict:
    """`fedsight flower local CONFIG --nodes 3 --secagg` (FedAvg, one round of all three clients: setup, share
    keys, masked vectors and unmask are four exchanges with every node), and the plain in-process run."""
    raw = tiny(**{**RUN, "server.clients_per_round": 3, "server.rounds": 1, "recipe.components": []})
    (d / "run.toml").write_text(tomli_w.dumps(raw))
    t0 = time.monotonic()
    proc = _cli(["flower", "local", str(d / "run.toml"), "--nodes", "3", "--run-dir", str(d / "flower"), "--secagg",
                 "--workdir", str(d / "work"), "--timeout", str(TIMEOUT), "--round-timeout", "120"], d)
    try:
        execute(validate(raw), d / "inproc")
    except BaseException:
        proc.send_signal(__import__("signal").SIGINT)
        proc.wait(timeout=120)
        raise
    output, _ = proc.communicate(timeout=TIMEOUT + 60)
    return {"rc": proc.returncode, "output": output, "elapsed": time.monotonic() - t0}


ROUNDS = 20  # of the interrupted deployment
VICTIM = 0  # its client whose SuperNode is killed (node K holds client K; both are sampled every round)


def _interrupted(d: Path) -> dict:
    """`fedsight flower local` over TLS + node auth (2 nodes, ROUNDS rounds, round timeout 60 s, min-clients 1).
    Once round 1 is logged: the running processes' command lines, the refusals (``_refusals``, which take a
    while), then the SuperNode of client VICTIM is killed with its processes (SIGKILL: a crash); once a round
    aggregated without it is logged, SIGINT. ROUNDS leaves the run minutes of work, so the signal lands mid-run
    even on a loaded machine. (One deployment for the crash and the interruption: each deployment costs tens of
    seconds of CPU in Flower's processes, and four at once took most of a 2-core machine for three minutes.)"""
    import queue
    import signal
    import threading

    raw = tiny(**{**RUN, "partition.num_clients": 2, "server.rounds": ROUNDS, "recipe.components": []})
    (d / "run.toml").write_text(tomli_w.dumps(raw))
    work, rd = d / "work", d / "flower"
    proc = _cli(["flower", "local", str(d / "run.toml"), "--run-dir", str(rd), "--workdir", str(work),
                 "--tls-dir", str(d / "tls"), "--node-auth", "--timeout", str(TIMEOUT), "--round-timeout", "60",
                 "--min-clients", "1"], d)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    seen: dict = {"out": []}

    def wait_for(what: str, done: Callable[[], bool]) -> None:
        deadline = time.monotonic() + TIMEOUT
        while not done():
            if time.monotonic() > deadline or proc.poll() is not None:
                raise AssertionError(f"no {what}:\n" + "".join(seen["out"]))
            with contextlib.suppress(queue.Empty):
                seen["out"].append(lines.get(timeout=1))

    try:
        wait_for("round 1", lambda: any(x.split("s  ", 1)[-1].startswith("round 1 ") for x in seen["out"]))
        seen["running"] = _processes_with_home(work / "flwr-home")
        _refusals(d, work / "flwr-home")
        node = [pid for pid, cmd in _processes_with_home(work / "flwr-home").items()
                if "flower-supernode" in cmd and f"node-{VICTIM}.toml" in cmd]
        assert len(node) == 1, seen["running"]
        seen["killed"] = [node[0], *descendants(node[0])]
        seen["logged_before_kill"] = max(r["round"] for r in _rows(rd) if "event" not in r)
        for pid in seen["killed"]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait_for("round without the killed node",
                 lambda: any(r.get("clients/aggregated") == 1 for r in _rows(rd) if "event" not in r))
        proc.send_signal(signal.SIGINT)
        seen["rc"] = proc.wait(timeout=TIMEOUT)  # the shutdown waits for the ServerApp, slow on a loaded machine
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(0.5)
    while not lines.empty():
        seen["out"].append(lines.get())
    return seen


@pytest.fixture(scope="module")
def deployments(tmp_path_factory):
    """The three deployments, started together: name -> (its directory, a future of what it observed)."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = {"loopback": _loopback, "interrupted": _interrupted, "secagg": _secagg}
    dirs = {name: tmp_path_factory.mktemp(name) for name in jobs}
    with ThreadPoolExecutor(len(jobs)) as pool:
        yield {name: (dirs[name], pool.submit(job, dirs[name])) for name, job in jobs.items()}


@pytest.mark.slow  # FEDSIGHT_SLOW=1, as every deployment here
def test_loopback_deployment_equals_in_process(deployments):
    """`fedsight flower local CONFIG --nodes 3`: final global parameters bit-identical to the in-process
    simulator, same metrics rows, progress streamed, client state only on the nodes, no process left."""
    d, future = deployments["loopback"]
    result = future.result(timeout=TIMEOUT + 120)
    output = result["output"]
    assert result["rc"] == 0, output
    assert "round 1" in output and "round 2" in output and "finished:completed" in output
    a, b = load_file(str(d / "inproc" / "model.safetensors")), load_file(str(d / "flower" / "model.safetensors"))
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert _core(_rows(d / "inproc")) == _core(_rows(d / "flower"))
    assert not (d / "flower" / "client_state").exists()
    state = sorted(p.relative_to(d / "work" / "node-state").parts[0] for p in (d / "work" / "node-state").rglob("*.safetensors"))
    sampled = sorted({c for r in (1, 2) for c in sample_clients(0, r, 3, 2)})
    assert sorted(set(state)) == [f"node{c}" for c in sampled]
    flwr_home = d / "work" / "flwr-home"
    assert (flwr_home / "config.toml").is_file()  # the private FLWR_HOME was used
    assert json.loads((d / "flower" / "flower-run.json").read_text())["status"] == "finished:completed"
    assert not _processes_with_home(flwr_home)
    print(f"loopback deployment, 3 nodes, 2 rounds: {result['elapsed']:.1f} s (with two other deployments running)")


@pytest.mark.slow  # FEDSIGHT_SLOW=1 (about 2 minutes): the same protocol in-process is tests/flower/test_secagg.py
def test_secagg_deployment_equals_the_plain_in_process_run_to_the_quantisation(deployments):
    """SecAgg+ on a real loopback deployment (Flower's workflow on the SuperLink side, its mod in every
    ClientApp): the run completes with all three updates in the unmasked mean, and the final model is the
    plain in-process FedAvg model within a few quantisation levels (3.8e-6 each)."""
    d, future = deployments["secagg"]
    result = future.result(timeout=TIMEOUT + 120)
    assert result["rc"] == 0, result["output"]
    a, b = load_file(str(d / "inproc" / "model.safetensors")), load_file(str(d / "flower" / "model.safetensors"))
    gap = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert 0 < gap < 1e-4, gap
    rows = _rows(d / "flower")
    assert [r["clients/aggregated"] for r in rows if "event" not in r] == [3], rows
    assert not [r for r in rows if "event" in r], rows
    assert not _processes_with_home(d / "work" / "flwr-home")
    print(f"SecAgg+ loopback deployment, 3 nodes, 1 round: {result['elapsed']:.1f} s (with other deployments running)")


@pytest.mark.slow  # FEDSIGHT_SLOW=1 (about 2 minutes, most of it Flower's 60 s wait for the dead node): the suite's
# 10-minute budget on 2 cores; in CI the in-process and Ray paths run (tests/flower/test_simulation.py, test_secagg.py)
def test_killed_supernode_over_tls_with_node_auth(deployments):
    """The SuperNode holding client VICTIM is killed mid-run (after round 1, over TLS with authenticated
    SuperNodes): the round that was waiting for it aggregates the other client alone (min-clients 1), and
    metrics.jsonl names the lost client and round; the rounds before had both clients."""
    d, future = deployments["interrupted"]
    seen = future.result(timeout=TIMEOUT + 120)
    rows = _rows(d / "flower")
    lost = [r for r in rows if r.get("event") == "client_lost"]
    assert [e["client"] for e in lost] == [VICTIM], rows
    # the round in flight when the node died, or the next one if the node had already replied in it
    assert seen["logged_before_kill"] < lost[0]["round"] <= seen["logged_before_kill"] + 2, (seen["logged_before_kill"], lost)
    # whichever comes first: the round timeout, or Flower's own verdict (the node missed two heartbeats)
    assert "no reply within 60 s" in lost[0]["reason"] or "Node Unavailable" in lost[0]["reason"], lost
    rounds = [(r["round"], r["clients/sampled"], r["clients/aggregated"]) for r in rows if "event" not in r]
    assert rounds[: lost[0]["round"]] == [(r, 2, 2) for r in range(1, lost[0]["round"])] + [(lost[0]["round"], 2, 1)]
    weights = {w["round"]: w for w in map(json.loads, (d / "flower" / "client_weights.jsonl").read_text().splitlines())}
    assert weights[lost[0]["round"]]["clients"] == [1 - VICTIM]
    # --node-auth bound each client to its node's key from the start, with the provisioning file written beside the
    # keys in --tls-dir; the keys the SuperLink lists are the provisioned ones (every round had both clients)
    session = json.loads((d / "flower" / "run.json").read_text())["sessions"][-1]
    assert session["client_identity"].startswith("authenticated: each client is answered for only by the node key "
                                                 f"provisioned for it in {d / 'tls' / 'provisioning.json'}")
    assert not [r for r in rows if r.get("event") == "rejected_update"], rows
    assert all(not alive(p) for p in seen["killed"])


@pytest.mark.slow  # FEDSIGHT_SLOW=1: the same deployment as the killed-SuperNode test
def test_sigint_stops_the_run_on_the_superlink_first_and_marks_it_interrupted(deployments):
    """`fedsight flower local` (a subprocess, TLS + SuperNode authentication) gets SIGINT once round 1 is
    logged: the Flower run is stopped on the SuperLink first (its ServerApp exits), then the SuperNodes,
    then the SuperLink; the exit code is 130 with one line saying where the run stopped and that a Flower
    run cannot be resumed; status.json is 'interrupted' at the last recorded round, never 'complete'; no
    process is left; running the command again refuses the interrupted run directory in one line. While
    it ran, the SuperLink served TLS only and admitted only registered node keys (``_refusals``)."""
    d, future = deployments["interrupted"]
    seen = future.result(timeout=TIMEOUT + 120)
    work, rd = d / "work", d / "flower"
    link = [c for c in seen["running"].values() if "flower-superlink" in c]
    nodes = [c for c in seen["running"].values() if "flower-supernode" in c]
    assert len(link) == 1 and "--ssl-certfile" in link[0] and "--insecure" not in link[0]
    assert len(nodes) == 2 and all("--auth-supernode-private-key" in c for c in nodes)
    text = "".join(seen["out"])
    said = [x for x in seen["out"] if x.startswith("interrupted: ")]
    assert seen["rc"] == 130 and len(said) == 1, text
    status = json.loads((rd / "status.json").read_text())
    assert status["state"] == "interrupted" and 1 <= status["round"] < ROUNDS and status["rounds"] == ROUNDS
    assert f"at round {status['round']} of {ROUNDS}" in said[0] and "cannot be resumed" in said[0]
    assert [r["round"] for r in _rows(rd) if "event" not in r] == list(range(1, status["round"] + 1))
    order = [x.split(" ", 1)[1] for x in (work / "logs" / "shutdown.log").read_text().splitlines()]
    assert order[0].startswith("run ") and order[1] == "serverapp"
    assert sorted(order[2:4]) == ["supernode-0", "supernode-1"] and order[4:] == ["superlink"], order
    assert not _processes_with_home(work / "flwr-home")
    again = CliRunner().invoke(flower_app, ["local", str(d / "run.toml"), "--run-dir", str(rd)])
    assert again.exit_code == 2 and "a Flower run cannot be resumed: pass --overwrite" in " ".join(again.output.split())
    assert f"interrupted at round {status['round']} of {ROUNDS}" in " ".join(again.output.split())
    for _, other in deployments.values():  # the last test: every deployment is over, nothing of them is left
        other.exception(timeout=TIMEOUT + 120)
    assert not _flower_processes_alive()
