"""The engine's second stage: what one step runs (:class:`StepPlan`), read off the sessions.

A step has three kinds of rows:

* **Verification rows**: each queued draft as one row of new tokens, the session's pending token
  (its last committed token, not yet in the KV cache) followed by its drafts, over the session's
  KV slot. A tree's row carries its parents (ancestor masks).
* **Prompt chunks** (``EngineConfig.prefill_chunk``, vLLM's and Sarathi's chunked prefill): a new
  request's prompt is packed into the steps' forwards, at most ``prefill_chunk`` tokens a step,
  first come first served, as a row that attends on its own
  (:class:`goodspeed.lm.runtime.packing.AttentionGroup`) and whose logits are computed only where its
  request scores its prompt. One long prompt costs every other drafter's round at most one chunk.
  The request joins drafting (its first allotment) once its last chunk is in.
* **Transit rows** (``EngineConfig.transit_tokens``, asynchronous rounds only): a session that
  opted in (``join(transit=True)``) and has no draft queued (it is being drafted or is on the wire)
  gets plain decoding: its pending token and no drafts, so the step adds the target's next token to
  its text. At most ``transit_tokens`` such tokens per session between two of its verdicts; they
  only fill what the step's drafts leave of the budget ``C``, one token each, the sessions with the
  fewest tokens decoded in transit first, so a step's work stays bounded by ``C``.

When a draft arrives after ``m`` tokens were decoded in transit, it was drafted from the text as of
the session's last verdict, so its first ``m`` tokens stand where the decoded ones now do: if they
are equal the rest is verified after them (:func:`after_decoded`); otherwise nothing of it is, and
its row decodes one more token. A kept tail is a proposal from the draft given exactly the committed
text, with randomness of the drafter's own, so the rejection test stays exact for it; whether a
step decodes depends on timing and committed tokens only, never on the token it draws
(docs/DESIGN.md, *Lossless verification*).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from goodspeed.scheduler import DraftAllotments
from goodspeed.verifier.session_table import SessionTable
from goodspeed.verifier.sessions import EngineConfig, Request, Row, Session
from goodspeed.verifier.types import Draft
from goodspeed.verifier.verify_rows import RowInput

# The most prompt tokens a forward scores: a scored prompt is prefilled in pieces (chunks) of at
# most this many, which bounds its logits at [SCORE_BLOCK, V] (155 MB in bf16 at Qwen3's V).
SCORE_BLOCK = 512


@dataclass
class StepPlan:
    """What one step runs: ``rows`` through the target (verification rows, then transit rows),
    ``settled`` drafts answered without a forward (their request ended in transit), and ``chunks``
    of prompts, ``(slot, tokens)``."""

    rows: list[Row] = field(default_factory=list)
    settled: list[Row] = field(default_factory=list)
    chunks: list[tuple[int, list[int]]] = field(default_factory=list)

    @property
    def runs_forward(self) -> bool:
        return bool(self.rows or self.chunks)

    @property
    def prefill_tokens(self) -> int:
        return sum(len(c) for _, c in self.chunks)

    @property
    def verified_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.rows)

    @property
    def window(self) -> int:
        """Slots the forward spans, first to last."""
        slots = [r.slot for r in self.rows] + [slot for slot, _ in self.chunks]
        return (max(slots) - min(slots) + 1) if slots else 0

    def batch_tokens(self, packed: bool) -> int:
        """Tokens the model's layers compute: the real ones when packed, else padding included."""
        if packed:
            return self.verified_tokens + self.prefill_tokens
        q_len = max((len(r.tokens) for r in self.rows), default=0)
        return self.window * max([q_len] + [len(c) for _, c in self.chunks])


class Planner:
    """Builds each step's :class:`StepPlan` from the sessions; changes nothing."""

    def __init__(self, sessions: SessionTable, config: EngineConfig, own: DraftAllotments) -> None:
        self.sessions, self.config = sessions, config
        self.own = own  # the edge drafters' book: its drafts count against the budget C that transit rows fill

    def plan(self, prefill: bool = True) -> StepPlan:
        rows, settled = self.rows()
        return StepPlan(rows, settled, self.chunks() if prefill else [])

    def rows(self) -> tuple[list[Row], list[Row]]:
        """This step's rows (queued drafts, then transit decoding) and the drafts that need no
        forward (their request ended in transit: ``settled``)."""
        rows, settled, waiting = [], [], []
        for slot, session in self.sessions.in_slot_order():
            submitted = session.pending
            if submitted is None:
                if self.decodes_in_transit(session):
                    waiting.append((slot, session))
                continue
            request = session.request
            if session.decoded_end is not None:
                settled.append(Row(session, slot, RowInput(session.session_id, [], submitted, request.sampling, request.history), None))
                continue
            draft = after_decoded(submitted, session.decoded)
            parents = None if draft.parents is None else [-1] + [p + 1 for p in draft.parents]
            tokens = [request.committed[-1], *map(int, draft.token_ids)]
            rows.append(Row(session, slot, RowInput(session.session_id, tokens, draft, request.sampling, request.history),
                            parents, submitted=None if draft is submitted else submitted))
        if waiting:
            rows += self._transit_rows(rows, waiting)
        return rows, settled

    def _transit_rows(self, rows: list[Row], waiting: list[tuple[int, Session]]) -> list[Row]:
        """Transit rows for the ``waiting`` ``(slot, session)``: they fill what ``rows``' drafts
        leave of C, the sessions with the fewest tokens decoded in transit first (ties in slot order)."""
        room = self.config.budget - sum(r.input.draft.num_tokens for r in rows if r.session.source is self.own)
        chosen = sorted(waiting, key=lambda w: len(w[1].decoded))[: max(room, 0)]
        out = []
        for slot, session in sorted(chosen, key=lambda w: w[0]):
            request = session.request
            out.append(Row(session, slot, RowInput(session.session_id, [request.committed[-1]], Draft(session.round_index, []),
                                                   request.sampling, request.history), None, transit=True))
        return out

    def chunks(self) -> list[tuple[int, list[int]]]:
        """This step's prompt chunks: ``(slot, tokens)``, at most ``prefill_chunk`` tokens in all."""
        budget, out = self.config.prefill_chunk or 0, []
        for session_id in self.sessions.prefilling:
            if budget <= 0:
                break
            request, slot = self.sessions.by_id[session_id].request, self.sessions.slots.slot(session_id)
            done = self.sessions.cache.lengths[slot]
            n = min(request.prompt_len - 1 - done, budget, SCORE_BLOCK if request.prompt_logprobs is not None else budget)
            out.append((slot, request.committed[done : done + n]))
            budget -= n
        return out

    @staticmethod
    def prompt_pieces(request: Request, slot: int) -> list[tuple[int, list[int]]]:
        """A whole prompt's prefill (no chunked prefill) as forwards of one chunk each: all but its
        last token (which is pending), in pieces of at most :data:`SCORE_BLOCK` where it is scored."""
        prompt = request.committed
        piece = request.prompt_len if request.prompt_logprobs is None else SCORE_BLOCK
        return [(slot, prompt[start : min(start + piece, request.prompt_len - 1)]) for start in range(0, request.prompt_len - 1, piece)]

    def transit_room(self) -> tuple[str, ...]:
        """The sessions a step run now would decode for in transit: no draft queued, a request in
        progress, fewer than ``transit_tokens`` decoded since their last verdict."""
        return tuple(session.session_id for _, session in self.sessions.in_slot_order()
                     if session.pending is None and self.decodes_in_transit(session))

    def decodes_in_transit(self, session: Session) -> bool:
        """Whether this step decodes for the session while its draft is away."""
        return (session.transit and len(session.decoded) < self.config.transit_tokens and session.decoded_end is None
                and session.request is not None and session.request.remaining >= 1
                and session.session_id not in self.sessions.prefilling)


def after_decoded(draft: Draft, decoded: list[int]) -> Draft:
    """What is left to verify of ``draft`` once ``decoded`` (tokens decoded in transit since the
    text it was drafted from) stand in its first positions: its tail, when its first
    ``len(decoded)`` tokens equal them, with its ``q`` rows; else nothing (an empty draft). Trees
    with anything decoded in transit verify nothing."""
    m = len(decoded)
    if not m:
        return draft
    if draft.parents is not None or draft.num_tokens <= m or [int(t) for t in draft.token_ids[:m]] != decoded:
        return Draft(draft.round_index, [])
    return Draft(draft.round_index, list(draft.token_ids[m:]),
                 dense_probs=None if draft.dense_probs is None else draft.dense_probs[m:],
                 sparse_probs=None if draft.sparse_probs is None else list(draft.sparse_probs[m:]))
