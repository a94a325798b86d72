"""One request on the drafter's side of the round protocol, whatever carries it.

Three drivers speak the protocol: the single-request client (:mod:`goodspeed.drafter.client`,
blocking gRPC), the edge node (:mod:`goodspeed.drafter.node`, asyncio gRPC, pooled sessions) and
the in-process driver (:mod:`goodspeed.launch.cluster.inprocess`, the engine called directly).
Each moves messages its own way; what a request *is* between them is this class, which performs
no I/O: its committed text and prefix hash, the round it is in and the length allotted to it, the
request to (re)start on a verifier, the checks a verdict must pass before its tokens count, what
its rounds did, and how it recovers:

* **lost** (the verifier no longer knows the session: it restarted, or dropped a drafter that
  missed its deadline): :meth:`DraftSession.lost`, then start :meth:`DraftSession.start_request`
  again on a new session. The committed text is the new prompt and its generated part is counted
  as output, so penalties and grammars go on where they were; the target's continuation of a
  verified prefix is still its own distribution, so the output stays lossless.
* **drifted** (a verdict whose committed length or prefix hash is not this drafter's, or one for
  a later round): :meth:`DraftSession.resync` takes the verifier's committed tokens.

The draft model's own state (its KV cache, pre-drafted tokens) is the driver's: a
:class:`~goodspeed.drafter.runner.DraftRunner` or one slot of a batched draft model. What a drafted
token's distribution is, and why the verifier's answer is exact, is in docs/DESIGN.md.

The simulator (:mod:`goodspeed.launch.experiments.simulate`) does not use it: a simulated drafter
has no text, only an acceptance profile, and what it shares with a real run is the verifier's
scheduling code (:class:`~goodspeed.scheduler.allotments.DraftAllotments`), not this protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from goodspeed.lm.decoding.history import TokenHistory
from goodspeed.lm.runtime.prefix import new_prefix_hasher, update_prefix_hasher
from goodspeed.serving.generation import GenerationRequest


class DrafterError(RuntimeError):
    """The drafter cannot continue (verifier gone past the timeout, or a refused request)."""


class SessionLost(Exception):
    """The verdict stream ended or the verifier no longer knows the session."""


class VerdictAhead(Exception):
    """A verdict for a later round than this drafter's: its view of the request is behind."""


def answers(verdict, round_index: int) -> bool:
    """Whether ``verdict`` (a wire or an engine verdict) answers round ``round_index``: False for
    an earlier round's (a retried submit can be answered twice; skip it), :class:`VerdictAhead`
    for a later one's."""
    if verdict.round_index > round_index:
        raise VerdictAhead(f"the verifier answered round {verdict.round_index} while this drafter waited for {round_index}")
    return verdict.round_index == round_index


@dataclass
class RequestStats:
    """What one request's rounds did."""

    rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    transit_tokens: int = 0  # of the request's tokens, those the verifier decoded while a draft was in transit
    repairs: int = 0  # lost sessions restarted and drifts resynchronised


class DraftSession:
    """One request's protocol state on a drafter (the module docstring)."""

    def __init__(self, request: GenerationRequest, stats: RequestStats | None = None) -> None:
        """``stats``: where its rounds are counted (a :class:`RequestStats`, or any object with its
        counters, as the client's ``RequestResult``); a new one if None."""
        self.request = request
        self.prompt_len = len(request.prompt_ids) - request.generated  # where the request's output begins
        self.stats = stats if stats is not None else RequestStats()
        self.length = 0  # S for the next round
        self.round_index = 0  # the verifier session's next round
        self.in_progress = False  # the verifier holds the request (started, not finished)
        self.prompt_scored = False  # its prompt's log-probabilities (if asked for) arrived
        self._take(request.prompt_ids)

    def _take(self, committed: Sequence[int]) -> None:
        self.committed = [int(t) for t in committed]
        self.hasher = new_prefix_hasher()
        update_prefix_hasher(self.hasher, self.committed)
        self._history: TokenHistory | None = None  # built when a driver first drafts from it

    @property
    def history(self) -> TokenHistory | None:
        """The text its penalties and grammar read, split as the verifier splits it (prompt, then
        output); None when its sampling adjusts no logits. Built on first use, so a driver whose
        draft model keeps its own (the single-request client's runner) costs nothing here."""
        if self._history is None and self.request.sampling.adjusts_logits:
            self._history = TokenHistory(self.committed[: self.prompt_len], self.committed[self.prompt_len :],
                                         self.request.sampling.structured)
        return self._history

    @property
    def key(self) -> str:
        return self.request.request_id

    @property
    def sampling(self):
        return self.request.sampling

    @property
    def generated(self) -> int:
        """Tokens of ``committed`` that are the request's output."""
        return len(self.committed) - self.prompt_len

    @property
    def output(self) -> list[int]:
        return self.committed[self.prompt_len :]

    @property
    def prefix_hash(self) -> str:
        """:func:`goodspeed.lm.runtime.prefix.prefix_hash` of ``committed``, kept incrementally."""
        return self.hasher.hexdigest()

    def start_request(self) -> GenerationRequest:
        """The request to start on a verifier session, first or after :meth:`lost`: the committed
        text as its prompt, what is left of its tokens, its output so far counted as output; the
        prompt's log-probabilities asked for only until they have arrived."""
        return replace(self.request, prompt_ids=list(self.committed), generated=self.generated,
                       max_tokens=self.request.max_tokens - (self.generated - self.request.generated),
                       prompt_logprobs=None if self.prompt_scored else self.request.prompt_logprobs)

    def started(self, length: int | None, round_index: int) -> None:
        """The verifier started it: ``length`` drafts for round ``round_index`` (None: its prompt
        is being prefilled in pieces; the step that completes it says the length)."""
        self.length, self.round_index, self.in_progress = length, round_index, True

    def apply(self, verdict) -> bool:
        """Commit a verdict (a wire or an engine verdict for this round), count it, and take the
        next round's length. True when this drafter's text still matches the verifier's
        (committed length and prefix hash); on False the driver resynchronises, or fails the
        request where its tokens already reached a client."""
        tokens = [int(t) for t in verdict.token_ids]
        self.committed.extend(tokens)
        update_prefix_hasher(self.hasher, tokens)
        if self._history is not None:  # drafting and committing alternate, so no draft reads it meanwhile
            self._history.extend(tokens, strict=False)
        self.stats.rounds += 1
        self.stats.drafted_tokens += verdict.num_drafted
        self.stats.accepted_tokens += verdict.num_accepted
        self.stats.transit_tokens += verdict.num_transit
        self.in_progress = not verdict.finished
        self.length, self.round_index = verdict.next_draft_length, verdict.round_index + 1
        return len(self.committed) == verdict.committed_length and self.prefix_hash == verdict.prefix_hash

    def lost(self) -> None:
        """The verifier lost the session: the request restarts from :meth:`start_request`."""
        self.stats.repairs += 1
        self.in_progress = False

    def resync(self, committed_ids: Sequence[int], length: int, round_index: int) -> None:
        """Take the verifier's committed tokens (its ``Resync`` answer): text, hash and output are
        rebuilt from them, so a repaired drift leaves no wrong token in the output."""
        prompt = self.request.prompt_ids
        if list(committed_ids[: len(prompt)]) != list(prompt):
            raise DrafterError(f"request {self.key}: the verifier's text does not start with this request's prompt")
        self._take(committed_ids)
        self.stats.repairs += 1
        self.started(length, round_index)
