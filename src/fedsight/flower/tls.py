"""TLS certificates and SuperNode authentication keys for a Flower deployment (``cryptography`` only,
no openssl or ssh-keygen binaries).

* ``make_tls(dir, hosts)``: a self-signed CA (``ca.crt``, ``ca.key``) and a server certificate
  (``server.pem``, ``server.key``) signed by it, valid for ``hosts`` (IP addresses and DNS names in the
  subjectAltName; default 127.0.0.1 and localhost). The SuperLink serves with ``server.pem`` /
  ``server.key``; SuperNodes and the ``flwr`` CLI trust ``ca.crt``.
* ``make_node_key(dir, name)``: an ECDSA P-384 key pair in OpenSSH format (``name`` private,
  ``name.pub`` public), what ``ssh-keygen -t ecdsa -b 384 -N ""`` writes. The public key is registered
  with ``flwr supernode register name.pub <connection>``; the SuperNode starts with
  ``--auth-supernode-private-key name``. Flower accepts only EC keys here.
* ``provisioning.write_provisioning(dir, partition_ids)``: ``provisioning.json``, which binds node ``k``'s public
  key to a FedSight partition for the ServerApp (``fedsight flower certs`` writes it with the node keys).

For production, use certificates from your organisation's CA; these are for tests, demos and closed
networks.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from ..safe_write import atomic_write_bytes


@dataclass
class TLSFiles:
    """PEM paths: the CA certificate (clients trust it), the server certificate and key."""

    ca_cert: Path
    server_cert: Path
    server_key: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "FedSight"), x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    # temp + rename (fedsight.safe_write): never through a symbolic link or into a FIFO; the file is made 0600
    atomic_write_bytes(path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()), mode=0o600)


_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def host_problem(host: str) -> str | None:
    """Why ``host`` cannot go into a server certificate's subjectAltName (None: it can): an IPv4 or IPv6
    address, or a DNS name of letters, digits and hyphens (labels of 1 to 63, no hyphen first or last, 253 at
    most in all, one trailing dot allowed; an internationalised name in its ``xn--`` form)."""
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    if not host:
        return "is empty: give a DNS name or an IP address"
    name = host[:-1] if host.endswith(".") else host
    if len(name) > 253:
        return f"is {len(name)} characters long: a DNS name has at most 253"
    bad = next((label for label in name.split(".") if not _LABEL.fullmatch(label)), None)
    if bad is not None:
        return (f"is neither an IP address nor a DNS name (label {bad!r}: letters, digits and hyphens, 1 to 63 of them, "
                "no hyphen first or last)")
    if name.rsplit(".", 1)[-1].isdigit():  # no top-level domain is all digits: "10.0.0.300" is a mistyped address
        return "is neither an IP address nor a DNS name (its last label is all digits)"
    return None


def make_tls(directory: str | Path, hosts: Sequence[str] = ("127.0.0.1", "localhost"), days: int = 365) -> TLSFiles:
    """CA + server certificate for ``hosts`` in ``directory`` (kept if already there); a host that cannot be in
    the certificate (``host_problem``) is a ``ValueError`` naming it, before anything is written."""
    if not hosts:
        raise ValueError("no host for the server certificate")
    for h in hosts:
        why = host_problem(h)
        if why is not None:
            raise ValueError(f"host {h!r} {why}")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    files = TLSFiles(ca_cert=d / "ca.crt", server_cert=d / "server.pem", server_key=d / "server.key")
    if files.ca_cert.is_file() and files.server_cert.is_file() and files.server_key.is_file():
        return files
    now = dt.datetime.now(dt.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name("FedSight test CA")).issuer_name(_name("FedSight test CA"))
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    alt: list[x509.GeneralName] = []
    for h in hosts:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            alt.append(x509.DNSName(h))
    srv_key = ec.generate_private_key(ec.SECP256R1())
    srv_cert = (
        x509.CertificateBuilder()
        .subject_name(_name(hosts[0])).issuer_name(ca_cert.subject)
        .public_key(srv_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _write_key(ca_key, d / "ca.key")
    atomic_write_bytes(files.ca_cert, ca_cert.public_bytes(serialization.Encoding.PEM))
    _write_key(srv_key, files.server_key)
    atomic_write_bytes(files.server_cert, srv_cert.public_bytes(serialization.Encoding.PEM))
    return files


def make_node_key(directory: str | Path, name: str) -> Path:
    """An ECDSA P-384 OpenSSH key pair ``directory/name`` (private) and ``name.pub``; returns the
    private key's path (kept if already there)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    priv = d / name
    if priv.is_file() and (d / f"{name}.pub").is_file():
        return priv
    key = ec.generate_private_key(ec.SECP384R1())
    atomic_write_bytes(priv, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                               serialization.NoEncryption()), mode=0o600)
    pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    atomic_write_bytes(d / f"{name}.pub", pub + f" fedsight-{name}\n".encode())
    return priv
