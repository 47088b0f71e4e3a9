"""File modes of what FedSight writes (issue 44 follow-up): the atomic writers' temporary files are 0600
(``mkstemp``); before, every file they wrote kept that mode, where a plain write gives ``0666`` less the umask.
Now a written file gets the mode of the file it replaces, else the umask's; secrets stay 0600."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from fedsight.safe_write import atomic_write_bytes, atomic_write_text

from helpers import tiny


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def test_a_new_file_gets_the_umask_mode_and_a_replaced_one_keeps_its_mode(tmp_path, umask_022) -> None:
    atomic_write_text(tmp_path / "new.txt", "x")
    assert mode(tmp_path / "new.txt") == 0o644  # before: 0600
    old = tmp_path / "old.txt"
    old.write_text("y")
    old.chmod(0o640)
    atomic_write_bytes(old, b"z")
    assert mode(old) == 0o640 and old.read_bytes() == b"z"
    os.umask(0o027)
    atomic_write_text(tmp_path / "group.txt", "x")
    assert mode(tmp_path / "group.txt") == 0o640
    assert not [p for p in tmp_path.rglob(".*.tmp")]


def test_every_file_of_a_run_gets_the_umask_mode(tmp_path, umask_022) -> None:
    """config.json, status.json, run.json, checkpoints, model.safetensors, client state: 0644 under umask 022
    (before: 0600, except the appended logs)."""
    from fedsight.api import execute
    from fedsight.config import validate

    raw = tiny(**{"server.rounds": 1, "eval.local": False, "recipe.components": ["scaffold"],
                  "partition.num_clients": 3, "server.clients_per_round": 2, "eval.every": 1})
    execute(validate(raw), tmp_path / "run")
    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"config.json", "status.json", "run.json", "model.safetensors", "round-000001.safetensors"} <= names, names
    assert any("client_state" in p.parts for p in files)
    wrong = {str(p.relative_to(tmp_path)): oct(mode(p)) for p in files if mode(p) != 0o644}
    assert not wrong, wrong


def test_secrets_stay_0600(tmp_path, umask_022) -> None:
    """etlc keygen (also replacing a 0644 file with --force), a party's secret (fedsight.secret), the Flower
    server's central-DP secret (private/, a 0700 folder) and the Flower TLS keys."""
    import fuzz_helpers as H

    from fedsight.flower.dp import CentralDP
    from fedsight.flower.tls import make_node_key, make_tls
    from fedsight.secret import keep_secret

    key = tmp_path / "k.key"
    assert H.cli(["etlc", "keygen", "--out", str(key)]).code == 0
    assert mode(key) == 0o600
    key.chmod(0o644)
    assert H.cli(["etlc", "keygen", "--out", str(key), "--force"]).code == 0
    assert mode(key) == 0o600
    keep_secret(tmp_path / "client_state" / "secret")
    assert mode(tmp_path / "client_state" / "secret") == 0o600
    path = CentralDP.keep_secret(SimpleNamespace(secret=os.urandom(32)), tmp_path / "run")
    assert mode(path) == 0o600
    tls = make_tls(tmp_path / "tls")
    assert mode(tls.server_key) == 0o600 and mode(tmp_path / "tls" / "ca.key") == 0o600
    node_key = make_node_key(tmp_path / "tls", "node0")
    assert mode(node_key) == 0o600 and mode(tmp_path / "tls" / "node0.pub") == 0o644
    assert mode(tls.ca_cert) == 0o644  # a certificate is public
