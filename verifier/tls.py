"""TLS for the verifier: server credentials from PEM files, re-read when they change (gRPC's at
each new handshake, the HTTPS front's every few seconds), and the loopback test behind refusing
plaintext where other machines can reach the daemon."""

from __future__ import annotations

import ipaddress
import os
import ssl
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

if TYPE_CHECKING:
    from goodspeed.verifier.server import ServerConfig


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _read_pem(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None


def _stamp(paths) -> tuple:
    """Each file's (modification time, size), None where it cannot be read: what tells a renewal."""
    out = []
    for path in paths:
        try:
            st = os.stat(path)
            out.append((st.st_mtime_ns, st.st_size))
        except OSError:
            out.append(None)
    return tuple(out)


class _ReloadingCertificates:
    """The PEM files of a TLS config, read again whenever one changes (mtime or size): gRPC asks
    before every new handshake, so a renewed certificate or CA is served without a restart and
    connections already open keep theirs. A half-written or broken set keeps the last good one."""

    def __init__(self, config: ServerConfig, on_reload=None) -> None:
        self.paths = [p for p in (config.tls_cert, config.tls_key, config.tls_client_ca) if p]
        self.config, self.on_reload = config, on_reload
        self.stamp = _stamp(self.paths)
        self.current = self._load()

    def _load(self) -> grpc.ServerCertificateConfiguration:
        def pem(path: str, kind: bytes) -> bytes:
            data = _read_pem(path)
            if b"-----BEGIN " + kind not in data or b"-----END " + kind not in data:  # e.g. half written
                raise ValueError(f"{path} holds no complete PEM {kind.decode()}")
            return data

        ca = pem(self.config.tls_client_ca, b"CERTIFICATE") if self.config.tls_client_ca else None
        key, cert = pem(self.config.tls_key, b"PRIVATE KEY"), pem(self.config.tls_cert, b"CERTIFICATE")
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        stamp = _stamp(self.paths)
        if stamp == self.stamp:
            return None
        self.stamp = stamp  # a broken set is reported once per change, not at every handshake
        try:
            self.current = self._load()
        except ValueError as exc:
            if self.on_reload is not None:
                self.on_reload(f"kept the previous certificates: {exc}")
            return None
        if self.on_reload is not None:
            self.on_reload("reloaded")
        return self.current


def server_credentials(config: ServerConfig, on_reload=None) -> grpc.ServerCredentials | None:
    """TLS credentials from the config's PEM files (mutual TLS with a client CA), reloaded when
    the files change; None: plaintext."""
    if config.tls_cert is None:
        return None
    certs = _ReloadingCertificates(config, on_reload)
    return grpc.dynamic_ssl_server_credentials(certs.current, certs.fetch, require_client_authentication=bool(config.tls_client_ca))


class ReloadingServerContext:
    """The HTTPS front's :class:`ssl.SSLContext`, its certificate following its files as gRPC's
    does: :meth:`check` (the daemon runs it every ``RELOAD_CHECK_S``) re-reads them when one
    changed, and loads a new pair into the live context only once it has loaded, whole and
    matching, into a scratch one (so a half-written renewal keeps the last good pair; OpenSSL
    would otherwise be left holding a new certificate with the old key). New handshakes get the new
    pair; connections already open keep theirs."""

    def __init__(self, cert: str, key: str, on_reload=None) -> None:
        self.cert, self.key, self.on_reload = cert, key, on_reload
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(cert, key)
        self.stamp = _stamp((self.cert, self.key))

    def check(self) -> bool:
        """Reload if the files changed; True when a new pair was loaded."""
        stamp = _stamp((self.cert, self.key))
        if stamp == self.stamp:
            return False
        self.stamp = stamp  # a broken pair is reported once per change
        try:
            with tempfile.TemporaryDirectory() as tmp:  # one read of each file, loaded twice (mode 0700)
                cert, key = Path(tmp, "cert.pem"), Path(tmp, "key.pem")
                cert.write_bytes(_read_pem(self.cert))
                key.write_bytes(_read_pem(self.key))
                ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
                self.context.load_cert_chain(cert, key)
        except (ValueError, OSError) as exc:  # ssl.SSLError is an OSError
            if self.on_reload is not None:
                self.on_reload(f"kept the previous certificate: {exc}")
            return False
        if self.on_reload is not None:
            self.on_reload("reloaded")
        return True
