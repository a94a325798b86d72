"""Plain dataclasses the engine takes and returns (the gRPC layer converts its messages to these)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from goodspeed.lm.decoding.params import TokenLogprob


@dataclass(frozen=True)
class SparseProbs:
    """One drafted position's draft distribution restricted to its support (top-k / top-p, or a
    drafter's capped proposal): ``token_ids [k]`` with ``probs [k]``, summing to 1."""

    token_ids: Sequence[int]
    probs: Sequence[float]


@dataclass(frozen=True)
class Draft:
    """What a drafter submits for one round.

    ``token_ids``: the ``S`` drafted tokens (a chain), or the nodes of a tree when ``parents``
    is given (``parents[k]``: index of node ``k``'s parent, -1 for the pending token).
    The draft distribution ``q`` is either ``dense_probs [S, V]`` or ``sparse_probs`` (one
    :class:`SparseProbs` per token). Greedy sessions send neither: their ``q`` is the point mass.
    A tree without ``q`` holds deterministic candidates (e.g. beam search).

    ``decode_ahead`` (an empty draft only): after this round the verifier decodes that many more
    rounds of the request by itself, one token a round, each with its verdict, before the
    drafter's next draft (:mod:`goodspeed.verifier.engine`, *Decoding ahead*);
    ``decode_ahead_until_match`` (with it): fewer, stopping after a round whose text ends in that
    many tokens that occurred earlier in it (0: all of them).
    """

    round_index: int
    token_ids: Sequence[int]
    parents: Sequence[int] | None = None
    dense_probs: np.ndarray | None = None
    sparse_probs: Sequence[SparseProbs] | None = None
    decode_ahead: int = 0
    decode_ahead_until_match: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class Verdict:
    """The verifier's answer to one draft."""

    session_id: str
    round_index: int
    num_drafted: int
    num_accepted: int  # leading token_ids equal to the draft's (its accepted drafts)
    token_ids: list[int]  # tokens appended this round: the accepted drafts, then correction/bonus (transit: see num_transit)
    committed_length: int  # prompt + generated tokens after this round
    prefix_hash: str  # goodspeed.lm.runtime.prefix.prefix_hash of those committed token ids
    next_draft_length: int  # S for the session's next round
    finished: bool
    finish_reason: str | None  # "length", "eos" or None
    acceptance: float  # alpha_hat after this round (eq. 3)
    goodput: float  # X after this round (eq. 4)
    num_transit: int = 0  # leading token_ids the verifier decoded while the draft was in transit
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token_ids, for a request that asked for them
    # A request's first verdict, where it asked for them: one per prompt token after the first
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    decode_ahead_left: int = 0  # rounds the verifier still decodes by itself after this one (a draft's decode_ahead)


@dataclass(frozen=True)
class RoundTimings:
    """Seconds spent per phase of one round."""

    assembly_s: float
    forward_s: float
    sampling_s: float
    scheduling_s: float

    @property
    def total_s(self) -> float:
        return self.assembly_s + self.forward_s + self.sampling_s + self.scheduling_s


@dataclass(frozen=True)
class RoundResult:
    round_index: int
    verdicts: dict[str, Verdict]
    timings: RoundTimings
    batch_rows: int  # rows in the target forward (all live slots)
    batch_tokens: int  # tokens the model's layers computed: the real ones when packed, else padding included
    verified_tokens: int = 0  # the participants' new tokens (pending + drafts), no padding
    draft_lengths: dict[str, int] = field(default_factory=dict)  # next S of every active session
    prefill_tokens: int = 0  # prompt tokens of chunked prefill packed into this step's forward
    started: dict[str, int] = field(default_factory=dict)  # sessions whose prefill completed -> first draft length
    transit_tokens: int = 0  # tokens decoded in transit this step (one per transit row)
    ahead: tuple[str, ...] = ()  # sessions whose next round the engine queued itself (Draft.decode_ahead)


@dataclass(frozen=True)
class PrefillStep:
    """A step that only prefilled prompt chunks (:meth:`VerificationEngine.prefill_step`)."""

    tokens: int
    seconds: float
    started: dict[str, int] = field(default_factory=dict)  # sessions whose prefill completed -> first draft length
