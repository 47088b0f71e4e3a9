"""The Flower adapter without Flower's runtime: records round trips, and whole FedSight runs whose
messages go straight to ClientApp objects (``flower_direct.DirectGrid``), compared with the
in-process simulator run of the same config and seed (``torch.equal`` on every global tensor, equal
metrics rows)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fedsight.api import execute
from fedsight.config import validate
from fedsight.engine.simulation import sample_clients
from fedsight.flower import records as FR
from fedsight.records import ClientResult

from flower_direct import run_direct
from flower_direct import wire as _wire
from helpers import tiny

pytestmark = pytest.mark.flower


def test_client_result_survives_the_wire_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    res = ClientResult(
        client_id=3, num_examples=17,
        delta={"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, 2, generator=g).t()},  # non-contiguous
        buffers={"bn.num_batches_tracked": torch.tensor(5), "bn.running_mean": torch.randn(4, generator=g)},
        metrics={"train/loss": 0.1234567891234567, "x": 1e-300},
        extras={"scaffold": {"w": torch.randn(3, 4, generator=g, dtype=torch.float64)}, "other": {}},
        num_steps=9, flops=123.5,
    )
    back, accepted = FR.read_result(_wire(FR.result_content(res, partition=3, accepted=False)))
    assert accepted is False
    assert (back.client_id, back.num_examples, back.num_steps, back.flops) == (3, 17, 9, 123.5)
    assert back.metrics == res.metrics
    for mine, theirs in ((res.delta, back.delta), (res.buffers, back.buffers), (res.extras["scaffold"], back.extras["scaffold"])):
        assert list(mine) == list(theirs)
        for k in mine:
            assert theirs[k].dtype == mine[k].dtype and theirs[k].shape == mine[k].shape
            assert torch.equal(theirs[k], mine[k])
    assert back.extras["other"] == {}
    assert back.buffers["bn.num_batches_tracked"].dim() == 0


def test_instruction_survives_the_wire():
    state = {"a": torch.arange(6.0).view(2, 3), "n": torch.tensor(2)}
    cfg, gstate, bc = FR.read_instruction(_wire(FR.instruction_content(4, [2, 0], state, {"scaffold": {"a": -state["a"]}}, **{"class-names": ["x", "y"]})))
    assert cfg["round"] == 4 and cfg["sampled"] == [2, 0] and list(cfg["class-names"]) == ["x", "y"]
    assert torch.equal(gstate["a"], state["a"]) and gstate["n"].dim() == 0
    assert torch.equal(bc["scaffold"]["a"], -state["a"])


def _rows(path):
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "flower/"))} for r in rows]


def _same_run(a, b):
    ma, mb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert list(ma) == list(mb)
    for k in ma:
        assert torch.equal(ma[k], mb[k]), k
    assert _rows(a) == _rows(b)
    assert (a / "client_weights.jsonl").read_text() == (b / "client_weights.jsonl").read_text()


SCAFFOLD = {"partition.num_clients": 3, "server.clients_per_round": 2, "server.rounds": 2, "eval.every": 1,
            "recipe.components": ["scaffold"], "recipe.weighting": "uniform", "engine.threads": 1}


def test_scaffold_over_flower_messages_equals_in_process(tmp_path):
    cfg = validate(tiny(**SCAFFOLD))
    execute(cfg, tmp_path / "inproc")
    grid = run_direct(cfg, tmp_path / "flower", tmp_path / "nodes")
    _same_run(tmp_path / "inproc", tmp_path / "flower")
    # SCAFFOLD's c_i lives on the nodes (one folder per node and Flower run), never in the run directory
    both = set(sample_clients(0, 1, 3, 2)) & set(sample_clients(0, 2, 3, 2))
    assert both, "the test needs a client sampled twice (its c_i from round 1 is used in round 2)"
    for c in range(3):
        files = list((tmp_path / "nodes" / f"node{c}").rglob("*.safetensors"))
        sampled = any(c in sample_clients(0, r, 3, 2) for r in (1, 2))
        assert [f.parent.name for f in files] == (["scaffold"] if sampled else [])
    assert not (tmp_path / "flower" / "client_state").exists()
    # round 1 asked every node which client it holds (no model sent), then each round trained only the sampled ones
    trains = [n for t, n in grid.sent if t == "train"]
    r1, r2 = ([1000 + c for c in sorted(sample_clients(0, r, 3, 2))] for r in (1, 2))
    assert trains[:3] == [1000, 1001, 1002] and sorted(trains[3:5]) == r1 and sorted(trains[5:]) == r2, trains
    info = json.loads((tmp_path / "flower" / "flower.json").read_text())
    assert info["node_of_client"] == {"0": 1000, "1": 1001, "2": 1002}


def test_personal_head_batchnorm_and_local_eval_equal_in_process(tmp_path):
    """FedPer-style personal heads (stored per client on its node), shared BatchNorm statistics, and
    local evaluation on the nodes (WMA, worst 10%) equal the simulator's."""
    cfg = validate(tiny(**{**SCAFFOLD, "recipe.components": [], "recipe.weighting": "data_size", "model.norm": "batch",
                           "recipe.sharing": {"name": "personal", "part": "head"}, "server.clients_per_round": 3}))
    execute(cfg, tmp_path / "inproc")
    run_direct(cfg, tmp_path / "flower", tmp_path / "nodes")
    _same_run(tmp_path / "inproc", tmp_path / "flower")
    rows = [r for r in _rows(tmp_path / "flower") if "local/wma" in r]
    assert len(rows) == 2
    for c in range(3):
        assert [f.parent.name for f in (tmp_path / "nodes" / f"node{c}").rglob("*.safetensors")] == ["personal"]


def test_lost_client_is_recorded_and_the_round_goes_on(tmp_path):
    cfg = validate(tiny(**{**SCAFFOLD, "eval.local": False}))
    victim = sample_clients(0, 2, 3, 2)[0]

    def kill(grid, msg):  # the victim's node dies when its round-2 instruction arrives
        if msg.metadata.group_id == "2":
            grid.dead.add(1000 + victim)

    run_direct(cfg, tmp_path / "flower", tmp_path / "nodes", options={"round-timeout": 0.5}, kill_hook=kill)
    rows = [json.loads(x) for x in (tmp_path / "flower" / "metrics.jsonl").read_text().splitlines()]
    lost = [r for r in rows if r.get("event") == "client_lost"]
    assert [(e["round"], e["client"], e["node"]) for e in lost] == [(2, victim, 1000 + victim)]
    assert "no reply within" in lost[0]["reason"]
    rounds = [r for r in rows if "event" not in r]
    assert [r["clients/aggregated"] for r in rounds] == [2, 1]
    assert json.loads((tmp_path / "flower" / "status.json").read_text())["state"] == "complete"


def test_restarted_supernode_keeps_its_clients_state(tmp_path):
    """A SuperNode restarted between rounds comes back under a new Flower node id with the same disk:
    the server moves the client to the new node (``client_moved``), and since SCAFFOLD's c_i survived on
    disk the run still equals the in-process simulator bit for bit."""
    from flwr.app import Context, RecordDict

    cfg = validate(tiny(**{**SCAFFOLD, "eval.local": False}))
    both = sorted(set(sample_clients(0, 1, 3, 2)) & set(sample_clients(0, 2, 3, 2)))[0]  # trains in both rounds

    def restart(grid):  # once round 1 was sent, before round 2 picks its nodes
        if sum(t == "train" for t, _ in grid.sent) >= 3 and 1003 not in grid.contexts:
            old = grid.contexts[1000 + both]
            grid.dead.add(1000 + both)
            grid.contexts[1003] = Context(run_id=7, node_id=1003, node_config=dict(old.node_config), state=RecordDict(),
                                          run_config=dict(old.run_config))

    execute(cfg, tmp_path / "inproc")
    run_direct(cfg, tmp_path / "flower", tmp_path / "nodes", options={"round-timeout": 0.5}, nodes_hook=restart)
    a, b = load_file(str(tmp_path / "inproc" / "model.safetensors")), load_file(str(tmp_path / "flower" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = [json.loads(x) for x in (tmp_path / "flower" / "metrics.jsonl").read_text().splitlines()]
    moved = [r for r in rows if r.get("event") == "client_moved"]
    assert [(e["round"], e["client"], e["from_node"], e["to_node"]) for e in moved] == [(2, both, 1000 + both, 1003)]
    assert not [r for r in rows if r.get("event") == "client_lost"]


def test_min_clients_rule_skips_a_round_with_too_few_updates(tmp_path):
    cfg = validate(tiny(**{**SCAFFOLD, "eval.local": False}))
    victim = sample_clients(0, 2, 3, 2)[0]

    def kill(grid, msg):
        if msg.metadata.group_id == "2":
            grid.dead.add(1000 + victim)

    run_direct(cfg, tmp_path / "flower", tmp_path / "nodes", options={"round-timeout": 0.5, "min-clients": 2}, kill_hook=kill)
    rows = [json.loads(x) for x in (tmp_path / "flower" / "metrics.jsonl").read_text().splitlines()]
    events = [(r["event"], r["round"]) for r in rows if "event" in r]
    assert events == [("client_lost", 2), ("too_few_clients", 2), ("round_skipped", 2)]
    # the skipped round leaves the global model as round 1 left it: the in-process run of 1 round
    one = validate(tiny(**{**SCAFFOLD, "eval.local": False, "server.rounds": 1}))
    execute(one, tmp_path / "one")
    a, b = load_file(str(tmp_path / "one" / "model.safetensors")), load_file(str(tmp_path / "flower" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_client_app_error_becomes_a_lost_client_with_the_reason(tmp_path):
    cfg = validate(tiny(**{**SCAFFOLD, "eval.local": False, "server.rounds": 1, "server.clients_per_round": 3}))
    # node 1 points at a data directory that does not exist: its ClientApp raises
    extra = [{}, {"data-dir": str(tmp_path / "missing")}, {}]
    run_direct(cfg, tmp_path / "flower", tmp_path / "nodes", node_extra=extra, options={"round-timeout": 5})
    rows = [json.loads(x) for x in (tmp_path / "flower" / "metrics.jsonl").read_text().splitlines()]
    lost = [r for r in rows if r.get("event") == "client_lost"]
    assert [e["client"] for e in lost] == [1] and "does not exist" in lost[0]["reason"]
    assert rows[-1]["clients/aggregated"] == 2


def _write_client_npz(task, cid, path):
    """Client ``cid``'s partition as a MedMNIST-style npz of uint8 images (digits are k/16, so k*16 is exact)."""
    sl_tr, sl_te = task._train_slice(cid), task._test_slice(cid)
    raw = task.pool_x * task.std + task.mean  # undo the standardisation: values k/16
    img = lambda sl: np.round(raw[sl, 0].numpy() * 16).astype(np.uint8) * 16  # noqa: E731
    np.savez(path, train_images=img(sl_tr), train_labels=task.pool_y[sl_tr].numpy(),
             test_images=img(sl_te), test_labels=task.pool_y[sl_te].numpy())
    return sl_tr.stop - sl_tr.start, sl_te.stop - sl_te.start


def test_data_dir_nodes_train_on_their_own_files(tmp_path):
    """Nodes reading their own directories (a real deployment) train on exactly their files: local
    training and test counts, label sets, and a finite run end to end."""
    from fedsight.api import build_task

    cfg = validate(tiny(**{**SCAFFOLD, "server.clients_per_round": 3}))
    task = build_task(cfg)
    counts = []
    for c in range(3):
        (tmp_path / f"data{c}").mkdir()
        counts.append(_write_client_npz(task, c, tmp_path / f"data{c}" / "client.npz"))
    extra = [{"data-dir": str(tmp_path / f"data{c}")} for c in range(3)]
    run_direct(cfg, tmp_path / "flower", tmp_path / "nodes", node_extra=extra, options={"data": "data-dir"})
    rows = [json.loads(x) for x in (tmp_path / "flower" / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in rows if "event" in r]
    assert all(np.isfinite(r["train/loss"]) for r in rows)
    assert rows[-1]["clients/aggregated"] == 3 and "local/wma" in rows[-1]
    assert not (tmp_path / "flower" / "partition.json").exists()
    # the node task: its client id, its counts, the run's 10 classes even where the node lacks some
    from fedsight.flower.node import build_node_task, node_config_model

    ncfg = node_config_model(json.dumps(cfg.model_dump(mode="json")))
    names = [str(k) for k in range(10)]
    for c in range(3):
        nt = build_node_task(ncfg, {"partition-id": c, "data-dir": str(tmp_path / f"data{c}")}, names)
        assert (nt.num_train_examples(c), nt.num_test_examples(c)) == counts[c]
        assert nt.num_clients == 3 and nt.num_classes == 10
        assert torch.equal(nt.train_batch(c, torch.arange(counts[c][0]))[1], task.train_batch(c, torch.arange(counts[c][0]))[1])
        with pytest.raises(KeyError):
            nt.num_train_examples((c + 1) % 3)


def test_app_command_writes_a_flower_app_that_flwr_builds(tmp_path):
    import os
    import subprocess
    import sys
    import tomllib

    import tomli_w
    from typer.testing import CliRunner

    from fedsight.flower.cli import flower_app
    from fedsight.flower.run_config import config_from_run_config

    raw = tiny(**SCAFFOLD)
    (tmp_path / "run.toml").write_text(tomli_w.dumps(raw))
    out = CliRunner().invoke(flower_app, ["app", str(tmp_path / "run.toml"), str(tmp_path / "app"), "--run-dir",
                                          str(tmp_path / "rd"), "--round-timeout", "90", "--min-clients", "2"])
    assert out.exit_code == 0, out.output
    project = tomllib.loads((tmp_path / "app" / "pyproject.toml").read_text())
    app = project["tool"]["flwr"]["app"]
    assert app["components"] == {"serverapp": "fedsight_app.server_app:app", "clientapp": "fedsight_app.client_app:app"}
    assert project["project"]["dependencies"] == ["flwr>=1.41.0"]  # no torch: no per-run install of it
    conf = app["config"]
    assert validate(config_from_run_config(conf)).model_dump() == validate(raw).model_dump()
    assert conf["fedsight"]["server"]["rounds"] == raw["server"]["rounds"]  # one key per value (run_config)
    assert (conf["run-dir"], conf["round-timeout"], conf["min-clients"]) == (str(tmp_path / "rd"), 90.0, 2)
    env = {**os.environ, "FLWR_HOME": str(tmp_path / "home")}
    flwr = os.path.join(os.path.dirname(sys.executable), "flwr")
    built = subprocess.run([flwr, "build", "--app", str(tmp_path / "app")], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert built.returncode == 0 and list(tmp_path.glob("*.fab")), built.stdout + built.stderr
    bad = CliRunner().invoke(flower_app, ["app", str(tmp_path / "run.toml"), str(tmp_path / "app2"), "--set", "partition.alpha=-1"])
    assert bad.exit_code == 2 and "partition.alpha" in bad.output


def test_app_readme_names_flowers_own_default_ports(tmp_path):
    """Every port the generated README names is Flower's own default for what it describes: the SuperLink's
    one HTTP port (Fleet, Control and runtime APIs: SuperNodes, connections and `flower-superlink --port`) and a
    SuperNode's runtime API port; never the pre-1.41 Fleet/Control ports."""
    import importlib
    import re

    from flwr.common.constant import CONTROL_API_PORT, FLEETAPI_GRPC_RERE_PORT
    from flwr.supercore.constant import SUPERLINK_UVICORN_DEFAULT_PORT, SUPERNODE_UVICORN_DEFAULT_PORT

    from fedsight.flower.app import write_app

    # the constants are what Flower's own commands default to
    link = importlib.import_module("flwr.superlink.cli.flower_superlink")._parse_args_run_superlink()
    node = importlib.import_module("flwr.supernode.cli.flower_supernode")._parse_args_run_supernode()
    assert link.get_default("port") == SUPERLINK_UVICORN_DEFAULT_PORT
    assert node.get_default("port") == SUPERNODE_UVICORN_DEFAULT_PORT
    assert node.get_default("superlink").endswith(f":{SUPERLINK_UVICORN_DEFAULT_PORT}")

    write_app(validate(tiny(**SCAFFOLD)), tmp_path / "app", run_dir=tmp_path / "rd")
    text = (tmp_path / "app" / "README.md").read_text()
    ports = lambda pattern: {int(p) for p in re.findall(pattern, text)}  # noqa: E731
    assert ports(r"--superlink \S+:(\d+)") == ports(r'address = "\S+:(\d+)"') == {SUPERLINK_UVICORN_DEFAULT_PORT}
    assert ports(r"flower-superlink [^\n`]*--port (\d+)") == {SUPERLINK_UVICORN_DEFAULT_PORT}
    assert ports(r"flower-supernode [^\n`]*--port (\d+)") == {SUPERNODE_UVICORN_DEFAULT_PORT}
    assert ports(r"\b(\d{4,5})\b") == {SUPERLINK_UVICORN_DEFAULT_PORT, SUPERNODE_UVICORN_DEFAULT_PORT}
    assert not {int(FLEETAPI_GRPC_RERE_PORT), int(CONTROL_API_PORT)} & ports(r"\b(\d{4,5})\b")


def test_certs_command_makes_a_ca_signed_server_certificate_and_ec_node_keys(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key
    from typer.testing import CliRunner

    from fedsight.flower.cli import flower_app

    out = CliRunner().invoke(flower_app, ["certs", str(tmp_path), "--host", "10.0.0.5", "--host", "link.example", "--node-keys", "2"])
    assert out.exit_code == 0, out.output
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.crt").read_bytes())
    srv = x509.load_pem_x509_certificate((tmp_path / "server.pem").read_bytes())
    srv.verify_directly_issued_by(ca)  # raises unless the CA signed it
    san = srv.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["10.0.0.5"]
    assert san.get_values_for_type(x509.DNSName) == ["link.example"]
    for k in range(2):
        key = load_ssh_private_key((tmp_path / f"node{k}").read_bytes(), password=None)
        assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp384r1"
        pub = load_ssh_public_key((tmp_path / f"node{k}.pub").read_bytes())
        assert pub.public_numbers() == key.public_key().public_numbers()


def test_a_client_gets_its_own_broadcast_merged_over_the_common_one() -> None:
    common = {"teacher": {"a": torch.ones(2)}, "scaffold": {"c": torch.zeros(1)}}
    own = {3: {"teacher": {"a": torch.full((2,), 3.0), "b": torch.ones(1)}}, 5: {"other": {"z": torch.ones(1)}}}
    content = _wire(FR.instruction_content(1, [3, 5], {"w": torch.ones(1)}, common, own))
    _, _, for3 = FR.read_instruction(content, 3)
    assert torch.equal(for3["teacher"]["a"], torch.full((2,), 3.0)) and torch.equal(for3["teacher"]["b"], torch.ones(1))
    assert set(for3) == {"teacher", "scaffold"}
    _, _, for5 = FR.read_instruction(content, 5)
    assert torch.equal(for5["teacher"]["a"], torch.ones(2)) and "other" in for5
    _, _, anyone = FR.read_instruction(content)
    assert set(anyone) == {"teacher", "scaffold"} and torch.equal(anyone["teacher"]["a"], torch.ones(2))


@pytest.mark.parametrize("stop", [SystemExit(0), KeyboardInterrupt(), RuntimeError("task-token authentication failed")])
def test_a_run_ended_mid_way_is_left_interrupted_at_its_last_round(tmp_path, stop):
    """SIGINT/SIGTERM reach the ServerApp as SystemExit (Flower's exit handler) or KeyboardInterrupt; after
    `flwr stop` the Grid's next call fails (Flower answers 401). Raised while round 2's replies are awaited,
    each leaves the run directory 'interrupted' at round 1 (not 'running', never 'complete'), with round 1's
    row only."""
    cfg = validate(tiny(**{"partition.num_clients": 3, "server.clients_per_round": 2, "server.rounds": 3,
                           "eval.local": False, "engine.threads": 1}))

    def hook(grid, message):
        if message.metadata.group_id == "2":
            raise stop

    with pytest.raises(type(stop)):
        run_direct(cfg, tmp_path / "run", tmp_path / "nodes", kill_hook=hook)
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status == {"state": "interrupted", "round": 1, "rounds": 3}
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows if "event" not in r] == [1]
    assert not (tmp_path / "run" / "model.safetensors").exists() and not (tmp_path / "run" / "flower.json").exists()


def test_fedsight_resume_refuses_an_interrupted_flower_run(tmp_path):
    from fedsight.api import execute, load_run_config
    from fedsight.config import ConfigError

    cfg = validate(tiny(**{"partition.num_clients": 3, "server.clients_per_round": 2, "server.rounds": 2,
                           "eval.local": False, "engine.threads": 1}))

    def hook(grid, message):
        if message.metadata.group_id == "2":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_direct(cfg, tmp_path / "run", tmp_path / "nodes", kill_hook=hook)
    with pytest.raises((ConfigError, ValueError), match="Flower run"):
        execute(load_run_config(tmp_path / "run"), tmp_path / "run", resume=True)
