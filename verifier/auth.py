"""Who is calling: per-client bearer tokens checked against a file of hashes.

A token file (JSON) maps the SHA-256 of each token to the identity it stands for and that
identity's limits; the tokens themselves are never stored, only shown once when made
(``goodspeed tokens add``)::

    {"tokens": [{"identity": "edge-1", "sha256": "9f86d0...", "max_sessions": 2}]}

Clients send ``authorization: Bearer <token>`` metadata on every call. With a token file the
verifier answers a call without a valid token UNAUTHENTICATED; without one every caller is the
identity ``anonymous`` (a trusted network; unguessable session ids still keep sessions apart).
Sessions belong to the identity that joined them: a call naming another identity's session is
answered PERMISSION_DENIED.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

ANONYMOUS = "anonymous"
TOKEN_BYTES = 32


class AuthError(Exception):
    """Missing or unknown credentials (UNAUTHENTICATED)."""


class TokenFileError(ValueError):
    """The token file cannot be read or is malformed; the message names the problem."""


@dataclass(frozen=True)
class Identity:
    name: str
    max_sessions: int | None = None  # sessions this identity may hold at once (None: no own limit)


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class TokenAuth:
    """Bearer tokens from a token file; :meth:`identify` maps call metadata to an identity."""

    def __init__(self, entries: dict[str, Identity]) -> None:
        self._by_hash = dict(entries)

    @classmethod
    def from_file(cls, path: str | Path) -> "TokenAuth":
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise TokenFileError(f"{path}: {exc}") from None
        entries: dict[str, Identity] = {}
        for i, row in enumerate(data.get("tokens", []) if isinstance(data, dict) else []):
            digest, name, limit = row.get("sha256"), row.get("identity"), row.get("max_sessions")
            if not (isinstance(digest, str) and len(digest) == 64 and isinstance(name, str) and name):
                raise TokenFileError(f"{path}: entry {i} needs 'identity' and a 64-hex-digit 'sha256'")
            if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
                raise TokenFileError(f"{path}: entry {i}: max_sessions must be an integer >= 1")
            entries[digest.lower()] = Identity(name, limit)
        if not entries:
            raise TokenFileError(f"{path}: no tokens (add one with `goodspeed tokens add {path} NAME`)")
        return cls(entries)

    def identify(self, metadata) -> Identity:
        """The identity of ``authorization: Bearer <token>`` in ``metadata`` (pairs), or AuthError."""
        value = next((v for k, v in metadata or () if k == "authorization"), None)
        if value is None or not value.startswith("Bearer "):
            raise AuthError("missing credentials: send 'authorization: Bearer <token>'")
        digest = token_hash(value[len("Bearer "):])
        for known, identity in self._by_hash.items():  # constant time per entry
            if hmac.compare_digest(known, digest):
                return identity
        raise AuthError("unknown token")


def add_token(path: str | Path, identity: str, max_sessions: int | None = None) -> str:
    """Make a token for ``identity``, store only its hash in ``path`` (created 0600 if absent);
    returns the token, which is not kept anywhere else."""
    path = Path(path)
    data = {"tokens": []}
    if path.exists():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise TokenFileError(f"{path}: {exc}") from None
    token = secrets.token_urlsafe(TOKEN_BYTES)
    entry = {"identity": identity, "sha256": token_hash(token)}
    if max_sessions is not None:
        entry["max_sessions"] = int(max_sessions)
    data.setdefault("tokens", []).append(entry)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)
    return token
