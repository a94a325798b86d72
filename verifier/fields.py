"""Client-chosen text checked where it enters the verifier: names and ids reach session ids,
logs and metrics, so they are bounded and plain (an invalid one is INVALID_ARGUMENT)."""

from __future__ import annotations

import re

from goodspeed.verifier import errors

NAME_PATTERN = re.compile(r"[A-Za-z0-9._:@+-]+")
MAX_NAME_CHARS, MAX_MODEL_NAME_CHARS, MAX_REQUEST_ID_CHARS = 64, 256, 128
MAX_PROMPT_CHARS_PER_TOKEN = 64  # a text prompt longer than this x the context cannot fit it


def is_plain_name(value: str, max_chars: int = MAX_NAME_CHARS) -> bool:
    """1 to ``max_chars`` characters of ``[A-Za-z0-9._:@+-]``: what a drafter's name, a token's
    identity and a certificate's common name must be, as they reach session ids, logs and metrics."""
    return len(value) <= max_chars and NAME_PATTERN.fullmatch(value) is not None


PLAIN = "characters of [A-Za-z0-9._:@+-]"


def check_identifier(field: str, value: str, max_chars: int) -> str:
    """A client-chosen name that reaches session ids, logs and metrics: bounded and plain, else
    :class:`~goodspeed.verifier.errors.MalformedDraftError` (INVALID_ARGUMENT)."""
    if not is_plain_name(value, max_chars):
        shown = value[:32] + ("..." if len(value) > 32 else "")
        raise errors.MalformedDraftError(f"{field} must be 1-{max_chars} {PLAIN}, got {shown!r} ({len(value)} chars)")
    return value


def check_free_text(field: str, value: str, max_chars: int) -> str:
    if len(value) > max_chars or not value.isprintable():
        raise errors.MalformedDraftError(f"{field} must be at most {max_chars} printable characters ({len(value)} given)")
    return value
