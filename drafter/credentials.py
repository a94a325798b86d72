"""A client's credentials for the verifier: TLS (the CA that signed the verifier's certificate,
and for mutual TLS this client's certificate and key) and a bearer token read from a file, sent
as call metadata (``authorization: Bearer <token>``; see :mod:`goodspeed.verifier.auth`). No
model stack is imported, so light clients (``goodspeed generate``) use it too."""

from __future__ import annotations

from dataclasses import dataclass

import grpc


class CredentialsError(RuntimeError):
    """The token file cannot be read or is empty."""


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying ``token`` (none without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def read_token(path: str | None) -> str | None:
    """The token in ``path`` (one line; files keep tokens off command lines, where ``ps`` shows
    them), or None without a path."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as exc:
        raise CredentialsError(f"cannot read the token file {path}: {exc}") from None
    if not token:
        raise CredentialsError(f"the token file {path} is empty")
    return token


@dataclass(frozen=True)
class ClientTLS:
    """PEM file paths: ``ca`` verifies the verifier; ``cert`` + ``key`` are this client's
    certificate for mutual TLS (its common name is the caller's identity). ``server_name``
    overrides the name checked against the verifier's certificate (e.g. when dialling through a
    proxy address that the certificate does not list)."""

    ca: str
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise CredentialsError("give both --tls-cert and --tls-key (or neither)")

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path):
            try:
                with open(path, "rb") as f:
                    return f.read()
            except OSError as exc:
                raise CredentialsError(f"cannot read {path}: {exc}") from None

        return grpc.ssl_channel_credentials(read(self.ca), read(self.key) if self.key else None, read(self.cert) if self.cert else None)

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def client_tls(ca: str | None, cert: str | None = None, key: str | None = None, server_name: str | None = None) -> ClientTLS | None:
    """The CLI's --tls-* flags as a :class:`ClientTLS` (None without a CA: plaintext)."""
    if ca is None:
        if cert or key or server_name:
            raise CredentialsError("--tls-cert, --tls-key and --tls-server-name need --tls-ca")
        return None
    return ClientTLS(ca, cert, key, server_name)


def open_channel(address: str, tls: ClientTLS | None) -> grpc.Channel:
    """A channel to ``address``: TLS with ``tls``, plaintext without."""
    if tls is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, tls.credentials(), options=tls.options())


def open_aio_channel(address: str, tls: ClientTLS | None) -> grpc.aio.Channel:
    """The asyncio twin of :func:`open_channel`."""
    if tls is None:
        return grpc.aio.insecure_channel(address)
    return grpc.aio.secure_channel(address, tls.credentials(), options=tls.options())
