"""A local-serving request and what its client hears: :class:`LocalRequest` (its spec beside its
state: the text so far, its times, its draft's stream and penalties' history), :class:`TokenEvent`
(new tokens, then the finish), and the records of one iteration (:class:`LocalWork`,
:class:`StepReport`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from goodspeed.lm.decoding.history import TokenHistory
from goodspeed.lm.decoding.seeding import torch_generator
from goodspeed.serving.generation import GenerationRequest
from goodspeed.verifier.types import RoundResult


@dataclass(frozen=True)
class TokenEvent:
    """What a request's callback receives: new tokens (with their clock times) and, at the end,
    the finish reason ("length", "eos", "cancelled" or "error: ...")."""

    request_id: str
    token_ids: list[int]
    times: list[float]
    finished: bool = False
    finish_reason: str | None = None
    summary: dict | None = None  # the last event: the request's statistics (LocalRequest.summary)
    logprobs: list | None = None  # TokenLogprob of each of token_ids, for a request that asked for them
    prompt_logprobs: list | None = None  # the first event's, if asked: TokenLogprob of each prompt token after the first


@dataclass
class LocalRequest:
    """A local request's state beside its spec (what was asked, as admitted: its id assigned, its
    seed resolved, its sampling holding its ending tokens)."""

    spec: GenerationRequest
    on_event: Callable[[TokenEvent], None] | None
    arrival: float
    session_id: str | None = None
    decode_start: float | None = None  # clock time the prefill finished
    generated: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    token_logprobs: list = field(default_factory=list)  # TokenLogprob of each generated token, if asked for
    prompt_token_logprobs: list | None = None  # TokenLogprob of each prompt token after the first, if asked for
    finish_reason: str | None = None
    finished_at: float | None = None
    drafted: int = 0  # draft tokens sent for verification
    accepted: int = 0
    acceptance: float | None = None  # smoothed acceptance (eq. 3), as its last verdict carried it
    committed: list[int] = field(init=False)  # prompt + generated, kept in step (not rebuilt per use)
    generator: torch.Generator | None = field(init=False)  # a seeded request's draft stream
    history: TokenHistory | None = field(init=False)  # what its draft's penalties read, if it has any

    request_id = property(lambda self: self.spec.request_id)
    prompt_ids = property(lambda self: self.spec.prompt_ids)
    sampling = property(lambda self: self.spec.sampling)
    max_new_tokens = property(lambda self: self.spec.max_tokens)
    eos_token_ids = property(lambda self: self.spec.eos_token_ids)
    seed = property(lambda self: self.spec.seed)
    logprobs = property(lambda self: self.spec.logprobs)  # each token's log-probability and this many top ones
    prompt_logprobs = property(lambda self: self.spec.prompt_logprobs)  # the prompt's too, in the first event
    tpot_slo_s = property(lambda self: None if self.spec.tpot_slo_ms is None else self.spec.tpot_slo_ms / 1000)

    def __post_init__(self) -> None:
        self.committed = list(self.prompt_ids) + self.generated
        self.generator = None if self.seed is None else torch_generator(self.seed, "request", "draft")
        self.history = TokenHistory(self.prompt_ids, self.generated, self.sampling.structured) if self.sampling.adjusts_logits else None

    def commit(self, tokens: list[int], at: float) -> None:
        self.generated.extend(tokens)
        self.committed.extend(tokens)
        self.token_times.extend([at] * len(tokens))
        if self.history is not None:
            self.history.extend(tokens, strict=False)

    @property
    def cap(self) -> int:
        """Most draft depth worth verifying: the last new token always comes from the target."""
        return max(0, self.max_new_tokens - len(self.generated) - 1)

    @property
    def tpot_s(self) -> float | None:
        """Time per output token: decoding time over tokens (prefill and queueing excluded)."""
        if not self.generated or self.decode_start is None:
            return None
        end = self.finished_at if self.finished_at is not None else self.token_times[-1]
        return (end - self.decode_start) / len(self.generated)

    @property
    def slo_met(self) -> bool | None:
        if self.tpot_slo_s is None or self.tpot_s is None:
            return None
        return self.tpot_s <= self.tpot_slo_s

    def summary(self) -> dict:
        return {
            "request_id": self.request_id, "prompt_tokens": len(self.prompt_ids), "new_tokens": len(self.generated),
            "arrival": self.arrival, "decode_start": self.decode_start, "finished_at": self.finished_at,
            "finish_reason": self.finish_reason, "tpot_s": self.tpot_s, "tpot_slo_s": self.tpot_slo_s,
            "slo_met": self.slo_met, "drafted": self.drafted, "accepted": self.accepted,
        }


@dataclass(frozen=True)
class StepReport:
    """One iteration: the engine's round (edge verdicts included) and the local bookkeeping."""

    round: RoundResult | None
    requests: int  # local requests in the batch
    drafted: int  # local draft tokens verified
    accepted: int
    emitted: int  # local tokens streamed
    duration_s: float
    k: int | None  # the chain length chosen this step (chain policies)


@dataclass(frozen=True)
class LocalWork:
    """What :meth:`LocalServing.submit_work` queued for one step: the requests that drafted, their
    plans (and the chain length chosen), and the clock around the planning."""

    started: float
    planning: float
    planned: float
    reqs: list[LocalRequest]
    plans: dict
    k: int | None
    drafted: int
    context: int  # committed KV entries when the step was planned (what its forward reads)
