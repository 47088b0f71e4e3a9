"""Real Flower processes on loopback: 1 SuperLink + 3 SuperNodes running a SCAFFOLD recipe for 2
rounds, a SuperNode killed mid-run (over TLS with SuperNode authentication), and TLS/auth refusals.

Every deployment has its own free ports and a private FLWR_HOME under tmp_path, runtime dependency
installation off, status polling with a timeout, and every process it started is stopped by PID
(checked: none of them, nor any flower process under this test process, is alive afterwards).
A deployment round costs about 15 s (Flower's 3 s polling and a fresh ClientApp process per message),
so these runs skip Flower-side local evaluation (``eval.local = false``; the adapter's local
evaluation is compared with the simulator in test_adapter.py and test_simulation.py)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
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
from fedsight.flower.local import LocalDeployment, alive, descendants, run_local
from fedsight.flower.tls import make_node_key, make_tls

from helpers import tiny

#: the executables a loopback deployment starts (flwr's console scripts); without them the deployment
#: tests are skipped, not failed
_MISSING = [b for b in ("flower-superlink", "flower-supernode", "flower-superexec", "flwr")
            if not (Path(sys.executable).parent / b).exists() and shutil.which(b) is None]
pytestmark = [pytest.mark.flower,
              pytest.mark.skipif(bool(_MISSING), reason=f"Flower executables not found: {', '.join(_MISSING)}")]

RUN = {"partition.num_clients": 3, "server.clients_per_round": 2, "server.rounds": 2, "eval.every": 1, "eval.local": False,
       "recipe.components": ["scaffold"], "recipe.weighting": "uniform", "engine.threads": 1}
TIMEOUT = 300  # seconds for a whole run: generous for a loaded 2-core CI machine


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


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines() if x.strip()]


def _core(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "flower/"))} for r in rows]


def test_loopback_deployment_equals_in_process(tmp_path):
    """`fedsight flower local CONFIG --nodes 3`: final global parameters bit-identical to the in-process
    simulator, same metrics rows, progress streamed, client state only on the nodes, no process left."""
    raw = tiny(**RUN)
    cfg_file = tmp_path / "run.toml"
    cfg_file.write_text(tomli_w.dumps(raw))
    execute(validate(raw), tmp_path / "inproc")
    t0 = time.monotonic()
    result = CliRunner().invoke(flower_app, [
        "local", str(cfg_file), "--nodes", "3", "--run-dir", str(tmp_path / "flower"), "--workdir", str(tmp_path / "work"),
        "--timeout", str(TIMEOUT), "--round-timeout", "120",
    ])
    elapsed = time.monotonic() - t0
    assert result.exit_code == 0, result.output
    assert "round 1" in result.output and "round 2" in result.output and "finished:completed" in result.output
    a, b = load_file(str(tmp_path / "inproc" / "model.safetensors")), load_file(str(tmp_path / "flower" / "model.safetensors"))
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert _core(_rows(tmp_path / "inproc")) == _core(_rows(tmp_path / "flower"))
    assert not (tmp_path / "flower" / "client_state").exists()
    state = sorted(p.relative_to(tmp_path / "work" / "node-state").parts[0] for p in (tmp_path / "work" / "node-state").rglob("*.safetensors"))
    sampled = sorted({c for r in (1, 2) for c in sample_clients(0, r, 3, 2)})
    assert sorted(set(state)) == [f"node{c}" for c in sampled]
    flwr_home = tmp_path / "work" / "flwr-home"
    assert (flwr_home / "config.toml").is_file()  # the private FLWR_HOME was used
    assert json.loads((tmp_path / "flower" / "flower-run.json").read_text())["status"] == "finished:completed"
    assert not _flower_processes_alive()
    print(f"loopback deployment, 3 nodes, 2 rounds: {elapsed:.1f} s")


def test_killed_supernode_over_tls_with_node_auth(tmp_path):
    """A SuperNode holding a client sampled in round 2 is killed when round 1 is logged: the run
    finishes with the other client (min-clients 1), and metrics.jsonl names the lost client and round.
    The whole run uses TLS and authenticated SuperNodes."""
    cfg = validate(tiny(**RUN))
    victim = sample_clients(0, 2, 3, 2)[0]
    killed: dict = {}

    def on_row(row, dep):  # called as metrics.jsonl grows (every 0.5 s); round 2 is already under way
        killed["dep"] = dep
        if row.get("round") == 1 and "event" not in row and "pids" not in killed:
            killed["pids"] = [dep.nodes[victim].pid, *descendants(dep.nodes[victim].pid)]
            dep.kill_node(victim)

    final = run_local(cfg, tmp_path / "flower", workdir=tmp_path / "work", options={"round-timeout": 30.0, "min-clients": 1},
                      timeout=TIMEOUT, on_row=on_row, tls_dir=tmp_path / "tls", node_auth=True, keep_workdir=True)
    assert final["status"] == "finished:completed"
    rows = _rows(tmp_path / "flower")
    lost = [r for r in rows if r.get("event") == "client_lost"]
    assert [(e["round"], e["client"]) for e in lost] == [(2, victim)]
    assert "no reply within 30 s" in lost[0]["reason"]
    rounds = [r for r in rows if "event" not in r]
    assert [(r["round"], r["clients/sampled"], r["clients/aggregated"]) for r in rounds] == [(1, 2, 2), (2, 2, 1)]
    weights = [json.loads(x) for x in (tmp_path / "flower" / "client_weights.jsonl").read_text().splitlines()]
    assert weights[1]["clients"] == [c for c in sample_clients(0, 2, 3, 2) if c != victim]
    # TLS and authentication were on: the SuperLink served TLS and required node keys
    link_log = (tmp_path / "work" / "logs" / "superlink.log").read_text()
    assert "--insecure" not in link_log
    dep = killed["dep"]
    assert dep.tls is not None and dep.node_auth
    assert all(not alive(p) for p in killed["pids"] + dep.all_pids())
    assert not _flower_processes_alive()


def test_tls_refuses_insecure_clients_and_admits_registered_nodes(tmp_path):
    """A TLS SuperLink with SuperNode authentication: plaintext clients (the flwr CLI with an insecure
    connection, a plain HTTP request) are refused; a node whose key was registered comes online; a node
    with an unregistered key is turned away (Flower exit code 305)."""
    import urllib.request

    tls = make_tls(tmp_path / "tls")
    with LocalDeployment(tmp_path / "work", tls=tls, node_auth=True) as dep:
        dep.start_superlink()  # waits for /health over https, trusting only our CA
        good = make_node_key(tmp_path / "keys", "node0")
        stranger = make_node_key(tmp_path / "keys", "stranger")
        dep.register_node(Path(f"{good}.pub"), name="node0")
        dep.start_supernode(0, {"partition-id": 0, "num-partitions": 2}, auth_key=good)
        rogue = dep.start_supernode(1, {"partition-id": 1, "num-partitions": 2}, auth_key=stranger)
        dep.write_connection("plain", insecure=True)
        plain = dep._json_or_text("supernode", "list", "plain")
        assert plain.get("success") is False and "unavailable" in plain.get("error-message", ""), plain
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://{dep.address}/health", timeout=5)
        deadline = time.monotonic() + 90
        while not dep.nodes_online() and time.monotonic() < deadline:
            time.sleep(1)
        assert len(dep.nodes_online()) == 1
        rc = rogue.popen.wait(timeout=max(1.0, deadline - time.monotonic()))
        assert rc != 0 and "Exit Code: 305" in dep.tail("supernode-1"), dep.tail("supernode-1")
        assert len(dep.nodes_online()) == 1
    assert all(not alive(p) for p in dep.all_pids())
    assert not _flower_processes_alive()
