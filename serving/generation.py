"""The generation contract between a backend (an edge node's session pool, the verifier's local
serving) and the front that admits its requests (the HTTP API, a launcher):

- :class:`GenerationRequest`: a request reduced to tokens and sampling settings;
- :class:`Delta`: a piece of its output, the last one with its finish reason;
- :class:`StopStringMatched`: thrown into a backend's stream when a stop string ended the text;
- :class:`RequestError`: a refusal or failure by kind, which each front maps to its protocol's
  status (:data:`goodspeed.api.errors.HTTP_STATUS`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from goodspeed.lm.decoding.params import SamplingParams

# What went wrong, as a client should read it
ERROR_KINDS = (
    "invalid",  # the request itself: fix it before sending it again
    "unauthorized",  # no credentials, or ones not recognised
    "overloaded",  # no room now (queue full, a limit reached): retry later
    "unavailable",  # not serving (draining, its verifier unreachable): retry later or elsewhere
    "upstream",  # the service this one depends on (the verifier, to an edge node) failed or refused
    "timeout",  # that service did not answer in time
    "internal",  # this server failed
)


class RequestError(Exception):
    """A request refused or failed: its ``kind`` (:data:`ERROR_KINDS`), a message for the client,
    and optionally the request field at fault (``param``) and a machine-readable ``code``."""

    def __init__(self, kind: str, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None) -> None:
        if kind not in ERROR_KINDS:
            raise ValueError(f"error kind must be one of {', '.join(ERROR_KINDS)}, got {kind!r}")
        super().__init__(message)
        self.kind, self.message, self.param, self.code = kind, message, param, code
        self.retry_after_s = retry_after_s  # "overloaded": about when to retry, if the backend knows


@dataclass(frozen=True)
class GenerationRequest:
    """What a backend generates: a request reduced to tokens and sampling."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...]
    seed: int | None = None
    tpot_slo_ms: float | None = None
    logprobs: int | None = None  # each token's log-probability and this many top ones; None: none
    prompt_logprobs: int | None = None  # the prompt tokens' too (``echo``, ``prompt_logprobs``), with the first delta; None: none
    # The prompt's last ``generated`` tokens are output already (a request resumed from its verified
    # text): its penalties and grammar count them as output (the verifier checks the range).
    generated: int = 0

    def __post_init__(self) -> None:
        if self.tpot_slo_ms is not None and not (math.isfinite(self.tpot_slo_ms) and self.tpot_slo_ms > 0):
            raise ValueError("tpot_slo_ms must be > 0")


@dataclass(frozen=True)
class Delta:
    """New tokens of a request; the last delta has ``finished`` and a ``finish_reason``
    ("eos", "length", "cancelled" or "error: ...")."""

    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    error: RequestError | None = None  # with finish_reason "error: ...": what the client is told
    logprobs: list | None = None  # TokenLogprob of each of token_ids, for a request that asked for them
    prompt_logprobs: list | None = None  # the first delta's, if asked: TokenLogprob of each prompt token after the first


class StopStringMatched(Exception):
    """Thrown into a backend stream (``athrow``) when a stop string ended the text: the backend
    cancels the request as one that finished (``stop`` in its metrics), not one its client
    abandoned (``abort``). A backend that does not catch it is closed as on a disconnect."""
