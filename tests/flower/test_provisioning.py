"""The provisioning file (``fedsight.flower.provisioning``): what ``fedsight flower certs`` writes, how a bad file,
a bad host name or a provisioning file without node authentication is refused (one line naming the file or the
option, nothing started or written), and how ``fedsight flower local`` binds its nodes. The binding itself, under
attack, is in test_attacks.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tomli_w
from typer.testing import CliRunner

from fedsight.config import validate
from fedsight.errors import ConfigError
from fedsight.flower.cli import flower_app
from fedsight.flower.provisioning import listed_form, parse_public_key, read_provisioning

from helpers import tiny

pytestmark = pytest.mark.flower

CFG = {"partition.num_clients": 3, "server.clients_per_round": 3, "server.rounds": 1, "eval.local": False,
       "engine.threads": 1}


def _certs(*args: str):
    return CliRunner().invoke(flower_app, ["certs", *args])


def _one_line(output: str) -> str:
    lines = [x for x in output.splitlines() if x.strip()]
    assert len(lines) == 1, output
    return " ".join(output.split())


@pytest.fixture(scope="module")
def certs_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("certs")
    out = _certs(str(d), "--node-keys", "4")
    assert out.exit_code == 0, out.output
    return d


def test_certs_writes_the_provisioning_file_node_k_for_partition_k(certs_dir) -> None:
    """``provisioning.json``: format and version, partition k -> node k's ``.pub`` line, and that key in the form
    the SuperLink lists it (Flower's own ``public_key_to_bytes`` of the key ``flwr supernode register`` loads)."""
    from flwr.cli.supernode.register import try_load_public_key

    doc = json.loads((certs_dir / "provisioning.json").read_text())
    assert doc["format"] == "fedsight-flower-provisioning" and doc["version"] == 1
    assert doc["partitions"] == {str(k): (certs_dir / f"node{k}.pub").read_text().strip() for k in range(4)}
    prov = read_provisioning(certs_dir / "provisioning.json", 4)
    assert prov.keys == {k: try_load_public_key(certs_dir / f"node{k}.pub").hex() for k in range(4)}
    assert len(set(prov.keys.values())) == 4
    with pytest.raises(ConfigError, match=r"out of range: the run has partition.num_clients = 3"):
        read_provisioning(certs_dir / "provisioning.json", 3)


def test_certs_partition_ids_map_nodes_to_other_partitions(tmp_path) -> None:
    out = _certs(str(tmp_path), "--node-keys", "2", "--partition-id", "5", "--partition-id", "2")
    assert out.exit_code == 0, out.output
    doc = json.loads((tmp_path / "provisioning.json").read_text())["partitions"]
    assert doc == {"5": (tmp_path / "node0.pub").read_text().strip(), "2": (tmp_path / "node1.pub").read_text().strip()}
    for args, msg in [(["--partition-id", "1"], "--partition-id given 1 time(s) for --node-keys 2"),
                      (["--partition-id", "1", "--partition-id", "1"], "a partition is held by one node")]:
        d = tmp_path / f"bad{len(args)}"
        out = _certs(str(d), "--node-keys", "2", *args)
        assert out.exit_code == 2 and msg in _one_line(out.output) and not d.exists(), out.output


@pytest.mark.parametrize("host", ["", "bad host name!*", "-lead.example", "a" * 64 + ".example", "10.0.0.300",
                                  "[::1]", "under_score.example"])
def test_certs_refuses_a_host_that_cannot_be_in_the_certificate(tmp_path, host) -> None:
    """Issue 44: ``--host ''`` raised a ValueError and ``--host 'bad host name!*'`` went into the certificate."""
    out = _certs(str(tmp_path / "tls"), "--host", host)
    assert out.exit_code == 2 and _one_line(out.output).startswith(f"error: --host {host!r}"), out.output
    assert not (tmp_path / "tls").exists()


def test_certs_accepts_dns_names_and_ip_addresses(tmp_path) -> None:
    from cryptography import x509

    hosts = ["link.example.org", "xn--bcher-kva.example", "localhost", "10.0.0.5", "::1", "fd00::17", "node-1.lan."]
    out = _certs(str(tmp_path), *[a for h in hosts for a in ("--host", h)])
    assert out.exit_code == 0, out.output
    san = x509.load_pem_x509_certificate((tmp_path / "server.pem").read_bytes()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    assert {str(v) for v in san.get_values_for_type(x509.IPAddress)} == {"10.0.0.5", "::1", "fd00::17"}
    assert set(san.get_values_for_type(x509.DNSName)) == {"link.example.org", "xn--bcher-kva.example", "localhost",
                                                         "node-1.lan."}


# -- bad provisioning files: one line naming the file, nothing started ----------------------------------------------


def _rsa_line() -> str:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=1024).public_key()
    return key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()


def _doc(parts: dict) -> str:
    return json.dumps({"format": "fedsight-flower-provisioning", "version": 1, "partitions": parts})


BAD = {
    "missing": (None, "not found"),
    "a folder": ("<dir>", "is a folder, not a regular file"),
    "not JSON": ("{partitions: 1", "not valid JSON: line 1 column 2"),
    "not UTF-8": (b"\xff\xfe{}", "not UTF-8 text"),
    "not an object": ("[1, 2]", "must be a JSON object, not list"),
    "another format": ('{"format": "x", "version": 1, "partitions": {}}', "format = 'x', version = 1: expected"),
    "unknown key": ('{"format": "fedsight-flower-provisioning", "version": 1, "partitions": {}, "extra": 1}',
                    "unknown key(s) ['extra']"),
    "no partitions": (_doc({}), "partitions must be a non-empty object"),
    "bad partition id": ("<keys:-1>", "partition id '-1' is not a whole number"),
    "out of range": ("<keys:3>", "partition 3 is out of range: the run has partition.num_clients = 3 (partitions 0..2)"),
    "missing partition": ("<keys:drop2>", "no key for partition(s) 2 of the run's 3"),
    "same key twice": ("<keys:twice>", "partitions 0 and 1 have the same key SHA256:"),
    "not a key": ("<keys:garbage>", "partition 1: not an OpenSSH public key"),
    "an RSA key": ("<keys:rsa>", "partition 1: RSAPublicKey is not an EC key"),
    "a number for a key": ("<keys:number>", "partition 1: the key must be an OpenSSH public key line, not int"),
    "a name twice": ("<keys:dupname>", "not valid JSON: the name '0' appears twice in one object"),
}


def _write_bad(kind: str, path: Path, certs_dir: Path) -> None:
    content, _ = BAD[kind]
    lines = {k: (certs_dir / f"node{k}.pub").read_text().strip() for k in range(3)}
    if content is None:
        return
    if content == "<dir>":
        path.mkdir()
        return
    if isinstance(content, bytes):
        path.write_bytes(content)
        return
    if content.startswith("<keys:"):
        what = content[6:-1]
        parts: dict = {str(k): v for k, v in lines.items()}
        if what == "-1":
            parts["-1"] = parts.pop("0")
        elif what == "3":
            parts["3"] = (certs_dir / "node3.pub").read_text().strip()
        elif what == "drop2":
            del parts["2"]
        elif what == "twice":
            parts["1"] = parts["0"]
        elif what == "garbage":
            parts["1"] = "ecdsa-sha2-nistp384 AAAAnotbase64!! x"
        elif what == "rsa":
            parts["1"] = _rsa_line()
        elif what == "number":
            parts["1"] = 7
        if what == "dupname":
            text = _doc(parts)[:-2] + f', "0": "{lines[1]}"' + "}}"
        else:
            text = _doc(parts)
        path.write_text(text)
        return
    path.write_text(content)


@pytest.mark.parametrize("kind", sorted(BAD))
def test_a_bad_provisioning_file_is_one_line_naming_it_before_anything_starts(tmp_path, certs_dir, kind) -> None:
    """Through the ServerApp's own start (``server_main``: the run directory is never created) and through
    ``fedsight flower local`` (exit 2, one line, no process started, nothing written)."""
    from flower_direct import run_direct

    path = tmp_path / "prov.json"
    _write_bad(kind, path, certs_dir)
    want = BAD[kind][1]
    with pytest.raises(ConfigError) as exc:
        run_direct(validate(tiny(**CFG)), tmp_path / "run", tmp_path / "nodes", options={"provisioning": str(path)})
    assert str(exc.value).startswith(f"provisioning file {path}") and want in str(exc.value), str(exc.value)
    assert not (tmp_path / "run").exists()
    if kind not in ("missing", "out of range", "same key twice", "an RSA key"):
        return  # the CLI prints the same check's message; four of them suffice there
    cfg = tmp_path / "c.toml"
    cfg.write_text(tomli_w.dumps(tiny(**CFG)))
    out = CliRunner().invoke(flower_app, ["local", str(cfg), "--run-dir", str(tmp_path / "r"), "--node-auth",
                                          "--provisioning", str(path), "--workdir", str(tmp_path / "w")])
    assert out.exit_code == 2 and want in _one_line(out.output) and f"provisioning file {path}" in _one_line(out.output)
    assert not (tmp_path / "r").exists() and not (tmp_path / "w").exists()


def test_provisioning_without_node_authentication_is_refused(tmp_path, certs_dir) -> None:
    """``local --provisioning`` without ``--node-auth`` (SuperNodes without keys get temporary keys no file lists):
    one line naming --provisioning; ``run_local`` the same for its Python callers."""
    from fedsight.flower.local import run_local

    cfg = tmp_path / "c.toml"
    cfg.write_text(tomli_w.dumps(tiny(**CFG)))
    prov = certs_dir / "provisioning.json"
    out = CliRunner().invoke(flower_app, ["local", str(cfg), "--run-dir", str(tmp_path / "r"), "--provisioning", str(prov)])
    assert out.exit_code == 2 and _one_line(out.output).startswith(f"error: --provisioning {prov} binds clients to node "
                                                                   "keys: add --node-auth"), out.output
    with pytest.raises(ConfigError, match="given without node authentication"):
        run_local(validate(tiny(**CFG)), tmp_path / "r", options={"provisioning": str(prov)}, workdir=tmp_path / "w")
    assert not (tmp_path / "r").exists() and not (tmp_path / "w").exists()


def test_local_binds_its_nodes_with_the_certs_provisioning_file(tmp_path) -> None:
    """``local --node-auth`` (``provision_local``): with ``--tls-dir`` the node keys and provisioning.json of
    ``fedsight flower certs`` there are used as they are; without it one is written with new keys; a file that binds
    node k's key to another partition (the loopback deployment's node k holds partition k) is refused naming it."""
    from fedsight.flower.local import provision_local

    d = tmp_path / "tls"
    assert _certs(str(d), "--node-keys", "3").exit_code == 0
    before = (d / "provisioning.json").read_bytes()
    keys, prov = provision_local(d, 3)
    assert prov == d / "provisioning.json" and (d / "provisioning.json").read_bytes() == before
    assert keys == [d / f"node{k}" for k in range(3)]
    fresh, prov2 = provision_local(tmp_path / "work" / "keys", 3)
    assert prov2 == tmp_path / "work" / "keys" / "provisioning.json"
    assert read_provisioning(prov2, 3).keys == {
        k: listed_form(parse_public_key(Path(f"{fresh[k]}.pub").read_text())) for k in range(3)}
    swapped = tmp_path / "swapped"
    assert _certs(str(swapped), "--node-keys", "3", "--partition-id", "1", "--partition-id", "0",
                  "--partition-id", "2").exit_code == 0
    with pytest.raises(ConfigError, match=rf"provisioning file {swapped / 'provisioning.json'}: partition 0 is "
                                          r"provisioned for SHA256:\S+, but the loopback deployment's node 0"):
        provision_local(swapped, 3)


def test_app_carries_the_provisioning_file_and_says_when_identity_is_not_authenticated(tmp_path, certs_dir) -> None:
    """``fedsight flower app``: without --provisioning a note that client identity is not authenticated; with a file
    that is here it is checked now (a bad one: exit 2 naming it, no app written); with one only on the SuperLink
    host (not here) a note, and the ServerApp checks it at start. The app's run config carries the path."""
    import tomllib

    cfg = tmp_path / "c.toml"
    cfg.write_text(tomli_w.dumps(tiny(**CFG)))

    def app(name: str, *extra: str):
        out = CliRunner().invoke(flower_app, ["app", str(cfg), str(tmp_path / name), "--run-dir", str(tmp_path / "rd"),
                                              *extra])
        conf = tomllib.loads((tmp_path / name / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"] \
            if out.exit_code == 0 else None
        return out, conf

    out, conf = app("plain")
    assert out.exit_code == 0 and conf["provisioning"] == ""
    assert "note: client identity is not authenticated (no --provisioning)" in " ".join(out.output.split())
    good = read_provisioning(_three(certs_dir), 3).path
    out, conf = app("bound", "--provisioning", str(good))
    assert out.exit_code == 0 and conf["provisioning"] == str(good) and "not authenticated" not in out.output
    out, _ = app("bad", "--provisioning", str(certs_dir / "provisioning.json"))  # 4 partitions for 3 clients
    assert out.exit_code == 2 and "partition 3 is out of range" in _one_line(out.output) and not (tmp_path / "bad").exists()
    elsewhere = tmp_path / "on-the-superlink" / "provisioning.json"
    out, conf = app("remote", "--provisioning", str(elsewhere))
    assert out.exit_code == 0 and conf["provisioning"] == str(elsewhere)
    assert f"note: {elsewhere} is not here: the ServerApp reads and checks it" in " ".join(out.output.split())


def test_the_provisioned_key_names_the_partition_a_node_may_answer_for(certs_dir) -> None:
    """``Provisioning.why_not``: the provisioned node answers for its partition only; another partition, a key not in
    the file and no key at all are refused with the reason the ``rejected_update`` event carries."""
    prov = read_provisioning(certs_dir / "provisioning.json", 4)
    key = {k: listed_form(parse_public_key((certs_dir / f"node{k}.pub").read_text())) for k in range(4)}
    assert prov.why_not(7, key[1], 1) is None
    assert "answers for client 0, but its key SHA256:" in prov.why_not(7, key[1], 0)
    assert "is provisioned for client 1" in prov.why_not(7, key[1], 0)
    three = read_provisioning(_three(certs_dir), 3)
    assert "is not in the provisioning file" in three.why_not(7, key[3], 0)
    assert "presents no public key" in three.why_not(7, None, 0)


def _three(certs_dir: Path) -> Path:
    doc = json.loads((certs_dir / "provisioning.json").read_text())
    del doc["partitions"]["3"]
    out = certs_dir / "three.json"
    out.write_text(json.dumps(doc))
    return out
