"""Certificates for mutual TLS: a CA, a server certificate and one client certificate per name.

``goodspeed certs init DIR`` writes, for operators::

    DIR/ca.pem                      the CA (give it to the verifier's --tls-client-ca and to
                                    every client's --tls-ca)
    DIR/server.pem, DIR/server.key  the verifier's certificate, its SANs from --hosts
    DIR/NAME.pem, DIR/NAME.key      a client certificate whose common name NAME is the caller's
                                    identity on the verifier

and ``goodspeed launch`` makes the same, throwaway, for every run. Keys are ECDSA P-256, written
0600; nothing is overwritten (an existing file is an error naming it). :func:`renew_certs`
reissues the server's and clients' certificates under the same CA, each file replaced whole (a
reader sees the old file or the new one, never half of one): the verifier serves a renewed
certificate from its next handshake on, without a restart.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
VALID_DAYS = 365


class CertError(ValueError):
    """Certificates cannot be written as asked; the message says why."""


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(subject: str, issuer: x509.Name, public_key, days: int) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days)))


def _san(hosts: tuple[str, ...]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def _write(path: Path, data: bytes, private: bool) -> None:
    if path.exists():
        raise CertError(f"{path} exists; remove it or choose another directory")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _save(out_dir: Path, stem: str, key, cert: x509.Certificate) -> Issued:
    issued = Issued(out_dir / f"{stem}.pem", out_dir / f"{stem}.key")
    _write(issued.key, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption()), private=True)
    _write(issued.cert, cert.public_bytes(serialization.Encoding.PEM), private=False)
    return issued


def init_certs(out_dir: str | Path, names: tuple[str, ...] = ("client",), hosts: tuple[str, ...] = DEFAULT_HOSTS,
               days: int = VALID_DAYS) -> dict[str, Issued]:
    """Write a CA, a server certificate for ``hosts`` and a client certificate per name; returns
    ``{"ca": ..., "server": ..., NAME: ...}`` (the CA's key stays beside it, ``ca.key``)."""
    out_dir = Path(out_dir)
    if not names or len(set(names)) != len(names) or {"ca", "server"} & set(names):
        raise CertError(f"client names must be distinct and not 'ca' or 'server', got {list(names)}")
    from goodspeed.verifier.fields import MAX_NAME_CHARS, PLAIN, is_plain_name

    if bad := [n for n in names if not is_plain_name(n)]:  # a client certificate's common name is its identity
        raise CertError(f"client names must be 1-{MAX_NAME_CHARS} {PLAIN}, got {bad}")
    if not hosts:
        raise CertError("the server certificate needs at least one host (DNS name or IP)")
    if days < 1:
        raise CertError(f"certificates must be valid for at least 1 day, got {days}")
    out_dir.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (_builder("goodspeed CA", _name("goodspeed CA"), ca_key.public_key(), days)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .sign(ca_key, hashes.SHA256()))
    out = {"ca": _save(out_dir, "ca", ca_key, ca_cert)}

    def issue(stem: str, common_name: str, usage, san: x509.SubjectAlternativeName | None) -> Issued:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (_builder(common_name, ca_cert.subject, key.public_key(), days)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if san is not None:
            builder = builder.add_extension(san, critical=False)
        return _save(out_dir, stem, key, builder.sign(ca_key, hashes.SHA256()))

    out["server"] = issue("server", hosts[0], ExtendedKeyUsageOID.SERVER_AUTH, _san(tuple(hosts)))
    for name in names:
        out[name] = issue(name, name, ExtendedKeyUsageOID.CLIENT_AUTH, None)
    return out


def renew_certs(out_dir: str | Path, days: int = VALID_DAYS) -> dict[str, Issued]:
    """New keys and certificates, signed by ``out_dir``'s CA (``ca.pem``, ``ca.key``), for the
    server (the same hosts) and every client certificate there; each key, then its certificate,
    replaces the old file atomically (between the two a reader sees a new key beside the old
    certificate: the verifier keeps its last good pair until the two match again). Returns the
    renewed ``{stem: Issued}``."""
    out_dir = Path(out_dir)
    try:
        ca_cert = x509.load_pem_x509_certificate((out_dir / "ca.pem").read_bytes())
        ca_key = serialization.load_pem_private_key((out_dir / "ca.key").read_bytes(), password=None)
    except (OSError, ValueError) as exc:
        raise CertError(f"cannot read the CA in {out_dir}: {exc}") from None
    renewed = {}
    for cert_path in sorted(out_dir.glob("*.pem")):
        stem = cert_path.stem
        if stem == "ca" or not (out_dir / f"{stem}.key").exists():
            continue
        old = x509.load_pem_x509_certificate(cert_path.read_bytes())
        common_name = old.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
        key = ec.generate_private_key(ec.SECP256R1())
        builder = _builder(common_name, ca_cert.subject, key.public_key(), days)
        for extension in old.extensions:  # the same constraints, usage and hosts
            builder = builder.add_extension(extension.value, critical=extension.critical)
        cert = builder.sign(ca_key, hashes.SHA256())
        issued = Issued(cert_path, out_dir / f"{stem}.key")
        _replace(issued.key, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()), private=True)
        _replace(issued.cert, cert.public_bytes(serialization.Encoding.PEM), private=False)
        renewed[stem] = issued
    return renewed


def _replace(path: Path, data: bytes, private: bool) -> None:
    staging = path.with_name(f".{path.name}.new")
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(staging, path)
