"""Who is calling: per-client bearer tokens checked against a file of hashes.

A token file (JSON) maps the SHA-256 of each token to the identity it stands for and that
identity's limits; the tokens themselves are never stored, only shown once when made
(``goodspeed tokens add``)::

    {"tokens": [{"identity": "edge-1", "sha256": "9f86d0...", "max_sessions": 2, "max_streams": 4,
                 "max_kv_tokens": 8192, "rate_per_s": 5}]}

Limits, each optional (absent: none of the identity's own): ``max_sessions`` (drafter sessions
held at once), ``max_streams`` (concurrent Generate streams), ``max_kv_tokens`` (prompt +
max_new_tokens summed over the identity's requests in progress, edge and local: the KV it may
hold), ``rate_per_s`` (new requests, StartRequest and Generate, per second; bursts of
``max(1, rate)``). Exceeding one is RESOURCE_EXHAUSTED.

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
import time
from dataclasses import dataclass
from pathlib import Path

from goodspeed.verifier.errors import LimitExceededError

ANONYMOUS = "anonymous"
TOKEN_BYTES = 32


class AuthError(Exception):
    """Missing or unknown credentials (UNAUTHENTICATED)."""


class TokenFileError(ValueError):
    """The token file cannot be read or is malformed; the message names the problem."""


LIMITS = ("max_sessions", "max_streams", "max_kv_tokens", "rate_per_s")


@dataclass(frozen=True)
class Identity:
    name: str
    max_sessions: int | None = None  # sessions this identity may hold at once (None: no own limit)
    max_streams: int | None = None
    max_kv_tokens: int | None = None
    rate_per_s: float | None = None


class Usage:
    """What each identity holds now (KV tokens, Generate streams) and its request-rate bucket.
    Not thread-safe: the servicer calls it from the event loop."""

    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self.kv_tokens: dict[str, int] = {}
        self.streams: dict[str, int] = {}
        self._bucket: dict[str, tuple[float, float]] = {}  # identity -> (tokens, at)

    def admit_request(self, who: Identity, kv_tokens: int) -> None:
        """A new request of ``kv_tokens`` (prompt + max new tokens): rate and KV checked, then both
        charged (a refused request charges neither)."""
        now = self.clock()
        if who.rate_per_s is not None:
            burst = max(1.0, who.rate_per_s)
            tokens, at = self._bucket.get(who.name, (burst, now))
            tokens = min(burst, tokens + (now - at) * who.rate_per_s)
            if tokens < 1.0:
                raise LimitExceededError(f"identity {who.name!r} is over its rate of {who.rate_per_s:g} requests/s")
        held = self.kv_tokens.get(who.name, 0)
        if who.max_kv_tokens is not None and held + kv_tokens > who.max_kv_tokens:
            raise LimitExceededError(f"identity {who.name!r} holds {held} KV tokens; {kv_tokens} more would pass its "
                                     f"max_kv_tokens {who.max_kv_tokens}")
        if who.rate_per_s is not None:
            self._bucket[who.name] = (tokens - 1.0, now)
        self.kv_tokens[who.name] = held + kv_tokens

    def release_request(self, name: str, kv_tokens: int) -> None:
        self.kv_tokens[name] = max(0, self.kv_tokens.get(name, 0) - kv_tokens)

    def open_stream(self, who: Identity, kv_tokens: int) -> None:
        """A Generate stream and its request (as :meth:`admit_request`): all charged, or nothing."""
        open_now = self.streams.get(who.name, 0)
        if who.max_streams is not None and open_now >= who.max_streams:
            raise LimitExceededError(f"identity {who.name!r} already has {open_now} Generate streams (its max_streams)")
        self.admit_request(who, kv_tokens)
        self.streams[who.name] = open_now + 1

    def close_stream(self, name: str, kv_tokens: int) -> None:
        self.streams[name] = max(0, self.streams.get(name, 0) - 1)
        self.release_request(name, kv_tokens)


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
            digest, name = row.get("sha256"), row.get("identity")
            if not (isinstance(digest, str) and len(digest) == 64 and isinstance(name, str) and name):
                raise TokenFileError(f"{path}: entry {i} needs 'identity' and a 64-hex-digit 'sha256'")
            limits = {key: row.get(key) for key in LIMITS if row.get(key) is not None}
            check_limits(limits, f"{path}: entry {i}: ")
            entries[digest.lower()] = Identity(name, **limits)
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


def check_limits(limits: dict, where: str = "") -> None:
    """Each limit of a token known, and a number > 0 (an integer but for ``rate_per_s``), else
    ``TokenFileError``: what the verifier checks when it loads a token file."""
    for key, value in limits.items():
        if key not in LIMITS:
            raise TokenFileError(f"{where}unknown limit {key!r}; known: {', '.join(LIMITS)}")
        integral = key != "rate_per_s"
        if isinstance(value, bool) or not isinstance(value, int if integral else (int, float)) or not value > 0:
            raise TokenFileError(f"{where}{key} must be {'an integer' if integral else 'a number'} > 0, got {value!r}")


def add_token(path: str | Path, identity: str, max_sessions: int | None = None, **limits) -> str:
    """Make a token for ``identity``, store only its hash in ``path`` (created 0600 if absent);
    returns the token, which is not kept anywhere else. An entry the verifier would refuse when
    it loads the file (an identity that is not a plain name, a limit <= 0) is refused here, before
    anything is written: one bad entry would stop the verifier from starting."""
    from goodspeed.verifier.fields import MAX_NAME_CHARS, PLAIN, is_plain_name

    if not is_plain_name(identity):
        raise TokenFileError(f"the identity must be 1-{MAX_NAME_CHARS} {PLAIN}, got {identity!r}")
    limits = {key: value for key, value in {"max_sessions": max_sessions, **limits}.items() if value is not None}
    check_limits(limits)
    path = Path(path)
    data = {"tokens": []}
    if path.exists():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise TokenFileError(f"{path}: {exc}") from None
    token = secrets.token_urlsafe(TOKEN_BYTES)
    data.setdefault("tokens", []).append({"identity": identity, "sha256": token_hash(token), **limits})
    try:
        write_private(path, json.dumps(data, indent=2))
    except OSError as exc:
        raise TokenFileError(f"{path}: cannot write: {exc.strerror or exc}") from None
    return token


def write_private(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (0600), replacing it whole: written
    to a temporary file first, so a reader never sees half of it."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
