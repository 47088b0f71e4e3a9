"""Provisioning: which SuperNode key may answer for which FedSight client (partition) in a Flower deployment.

A Flower SuperNode proves on every request that it holds the private key of the public key it presents
(the SuperLink checks the signature), and the ServerApp sees that public key in the SuperLink's node list.
FedSight binds each partition to one such key, from a file written before the run, so that nothing a node
says at run time decides which client it is:

    {"format": "fedsight-flower-provisioning", "version": 1,
     "partitions": {"0": "ecdsa-sha2-nistp384 AAAAE2VjZHNh... fedsight-node0",
                    "1": "ecdsa-sha2-nistp384 AAAAE2VjZHNh... fedsight-node1"}}

``partitions`` maps each partition id (a decimal string, ``0 .. partition.num_clients - 1``, every one of
them) to the public key of the node that holds it, as an OpenSSH line (the node's ``.pub`` file, what
``flwr supernode register`` takes; the comment is ignored). ``fedsight flower certs DIR --node-keys N`` writes
``DIR/provisioning.json`` (node ``k`` for partition ``k``, or ``--partition-id`` per node); the ServerApp reads it
from the run-config key ``provisioning`` (``--provisioning`` of ``fedsight flower app`` and ``local``).

With the file, partition ``p`` is answered for only by the node whose key is provisioned for ``p``, under any
node id (a restarted SuperNode with its key gets its client back); a node whose key is not in the file, or is
provisioned for another partition, is refused (``rejected_update``) and nothing is bound to it. Without it,
client identity is not authenticated (``identity_note``). Every problem with the file is a ``ConfigError`` of
one line naming the file, raised before anything starts.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from ..errors import ConfigError, DataFileError

FORMAT = "fedsight-flower-provisioning"
VERSION = 1
FILE = "provisioning.json"
#: a provisioning file holds one short line per partition: anything larger is not one
MAX_BYTES = 16 << 20

_PEM, _SPKI = serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo


def _ssh_fingerprint(key: ec.EllipticCurvePublicKey) -> str:
    """``SHA256:...``, as ``ssh-keygen -lf node0.pub`` prints it."""
    blob = key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).split()[1]
    return "SHA256:" + base64.b64encode(hashlib.sha256(base64.b64decode(blob)).digest()).decode().rstrip("=")


def parse_public_key(line: str) -> ec.EllipticCurvePublicKey:
    """The EC public key of an OpenSSH public key line; ``ValueError`` saying why not."""
    try:
        key = serialization.load_ssh_public_key(line.strip().encode())
    except (ValueError, UnsupportedAlgorithm, UnicodeError) as exc:
        raise ValueError(f"not an OpenSSH public key ({' '.join(str(exc).split()) or type(exc).__name__})") from None
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise ValueError(f"{type(key).__name__.lstrip('_')} is not an EC key (Flower authenticates SuperNodes with "
                         "ECDSA keys only)")
    return key


def listed_form(key: ec.EllipticCurvePublicKey) -> str:
    """The key as the ServerApp sees it in the SuperLink's node list (``NodeInfo.public_key``: PEM
    SubjectPublicKeyInfo, Flower's ``public_key_to_bytes``), in hex."""
    return key.public_bytes(_PEM, _SPKI).hex()


def describe_listed(key_hex: str) -> str:
    """A listed node key (hex of its PEM bytes) for a message: its SSH fingerprint."""
    try:
        key = serialization.load_pem_public_key(bytes.fromhex(key_hex))
    except (ValueError, UnsupportedAlgorithm):
        return f"(a {len(key_hex) // 2}-byte key that is not a PEM public key)"
    if not isinstance(key, ec.EllipticCurvePublicKey):
        return f"(a {type(key).__name__.lstrip('_')})"
    return _ssh_fingerprint(key)


@dataclass
class Provisioning:
    """A read provisioning file: partition -> the listed form of its node's key (``listed_form``)."""

    path: Path
    keys: dict[int, str]
    fingerprints: dict[int, str]

    def __post_init__(self) -> None:
        self.partition_of = {k: p for p, k in self.keys.items()}

    def why_not(self, node: int, key_hex: str | None, pid: int) -> str | None:
        """Why ``node``, listed with ``key_hex`` (None: no key), may not answer for partition ``pid`` (None: it may)."""
        if key_hex is None:
            return f"node {node} presents no public key; the provisioning file {self.path} binds every client to a node key"
        owner = self.partition_of.get(key_hex)
        if owner is None:
            return f"node {node}'s key {describe_listed(key_hex)} is not in the provisioning file {self.path}"
        if owner != pid:
            return (f"node {node} answers for client {pid}, but its key {self.fingerprints[owner]} is provisioned for "
                    f"client {owner} ({self.path})")
        return None


def _no_duplicate_names(pairs: list[tuple[str, object]]) -> dict:
    names = [k for k, _ in pairs]
    dup = next((k for k in names if names.count(k) > 1), None)
    if dup is not None:
        raise ValueError(f"the name {dup!r} appears twice in one object")
    return dict(pairs)


def read_provisioning(path: str | Path, num_clients: int | None = None) -> Provisioning:
    """The provisioning file at ``path`` (``fedsight.safe_read``), checked: its format, every key an EC
    OpenSSH public key, partition ids in ``0 .. num_clients - 1`` and every one of them present (when
    ``num_clients`` is given), no key provisioned twice. Else a one-line ``ConfigError`` naming the file."""
    from ..safe_read import loads_json, read_text

    path = Path(path)
    name = f"provisioning file {path}"
    try:
        text = read_text(path, "provisioning file", MAX_BYTES, ConfigError)
        doc = loads_json(text, name, ConfigError)
        json.loads(text, object_pairs_hook=_no_duplicate_names)
    except FileNotFoundError:
        raise ConfigError(f"{name}: not found (write it with `fedsight flower certs DIR --node-keys N`)") from None
    except (json.JSONDecodeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        where = f"line {exc.lineno} column {exc.colno}: {exc.msg}" if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise ConfigError(f"{name}: not valid JSON: {where}") from None
    except (DataFileError, OSError) as exc:
        raise ConfigError(f"{name}: cannot be read: {exc}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{name}: must be a JSON object, not {type(doc).__name__}")
    extra = sorted(set(doc) - {"format", "version", "partitions"})
    if extra:
        raise ConfigError(f"{name}: unknown key(s) {extra}; a provisioning file has format, version and partitions")
    if doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise ConfigError(f"{name}: format = {doc.get('format')!r}, version = {doc.get('version')!r}: expected "
                          f"{FORMAT!r} version {VERSION}")
    parts = doc.get("partitions")
    if not isinstance(parts, dict) or not parts:
        raise ConfigError(f"{name}: partitions must be a non-empty object (partition id -> OpenSSH public key)")
    keys: dict[int, str] = {}
    prints: dict[int, str] = {}
    for pid_text, line in parts.items():
        if not re.fullmatch(r"0|[1-9][0-9]{0,8}", pid_text):
            raise ConfigError(f"{name}: partition id {pid_text!r} is not a whole number 0, 1, 2, ...")
        pid = int(pid_text)
        if num_clients is not None and pid >= num_clients:
            raise ConfigError(f"{name}: partition {pid} is out of range: the run has partition.num_clients = "
                              f"{num_clients} (partitions 0..{num_clients - 1})")
        if not isinstance(line, str):
            raise ConfigError(f"{name}: partition {pid}: the key must be an OpenSSH public key line, not "
                              f"{type(line).__name__}")
        try:
            key = parse_public_key(line)
        except ValueError as exc:
            raise ConfigError(f"{name}: partition {pid}: {exc}") from None
        form = listed_form(key)
        twin = next((p for p, k in keys.items() if k == form), None)
        if twin is not None:
            raise ConfigError(f"{name}: partitions {twin} and {pid} have the same key {_ssh_fingerprint(key)}: a node "
                              "key answers for one partition")
        keys[pid], prints[pid] = form, _ssh_fingerprint(key)
    if num_clients is not None:
        missing = [p for p in range(num_clients) if p not in keys]
        if missing:
            shown = ", ".join(map(str, missing[:10])) + (", ..." if len(missing) > 10 else "")
            raise ConfigError(f"{name}: no key for partition(s) {shown} of the run's {num_clients} "
                              "(partition.num_clients): every client needs its node's key")
    return Provisioning(path, dict(sorted(keys.items())), dict(sorted(prints.items())))


def provisioning_text(partitions: Mapping[int, str]) -> str:
    """The provisioning file for ``partitions`` (partition id -> OpenSSH public key line)."""
    body = {str(p): " ".join(str(line).split()) for p, line in sorted(partitions.items())}
    return json.dumps({"format": FORMAT, "version": VERSION, "partitions": body}, indent=1) + "\n"


def write_provisioning(directory: str | Path, partition_ids: Iterable[int]) -> Path:
    """``directory/provisioning.json`` binding node ``k``'s key (``directory/node{k}.pub``, ``tls.make_node_key``)
    to the ``k``-th of ``partition_ids``, written atomically (``fedsight.safe_write``). Returns its path."""
    from ..safe_read import read_text
    from ..safe_write import atomic_write_text

    d = Path(directory)
    ids = list(partition_ids)
    if len(set(ids)) != len(ids):
        raise ValueError(f"partition ids {ids} name a partition twice")
    partitions: dict[int, str] = {}
    seen: dict[str, int] = {}
    for k, pid in enumerate(ids):
        pub = d / f"node{k}.pub"
        line = read_text(pub, "node public key", 1 << 16).strip()
        try:
            form = listed_form(parse_public_key(line))
        except ValueError as exc:
            raise ValueError(f"node public key {pub}: {exc}") from None
        if form in seen:
            raise ValueError(f"node public key {pub} is the key of node {seen[form]} too: each node needs its own key")
        seen[form], partitions[pid] = k, line
    out = d / FILE
    atomic_write_text(out, provisioning_text(partitions))
    return out


def check_local_nodes(prov: Provisioning, pubs: list[Path]) -> None:
    """A loopback deployment's node ``k`` (public key ``pubs[k]``) holds partition ``k``: ``ConfigError`` naming the
    provisioning file where partition ``k`` is provisioned for another key."""
    from ..safe_read import read_text

    for k, pub in enumerate(pubs):
        try:
            key = parse_public_key(read_text(pub, "node public key", 1 << 16, ConfigError))
        except ValueError as exc:
            raise ConfigError(str(exc) if isinstance(exc, ConfigError) else f"node public key {pub}: {exc}") from None
        if prov.keys.get(k) != listed_form(key):
            raise ConfigError(f"provisioning file {prov.path}: partition {k} is provisioned for "
                              f"{prov.fingerprints.get(k, 'no key')}, but the loopback deployment's node {k} holds "
                              f"partition {k} with the key {pub} ({_ssh_fingerprint(key)})")


def identity_note(prov: Provisioning | None) -> str:
    """What binds a client to a node in this run, for ``run.json`` and the start of the log."""
    if prov is not None:
        return (f"authenticated: each client is answered for only by the node key provisioned for it in {prov.path} "
                "(under any node id); other keys are rejected")
    return ("not authenticated: no provisioning file, so any node the SuperLink admits may answer for any client "
            "(its reply names the partition), and its update is aggregated as that client's, with that client's full "
            "weight; a client follows the node that answered for it last")
