"""The engine's last stage: a step's verified rows applied. Each request commits its emitted tokens
(cut at its end), each session's book observes its acceptance (eq. 3), each book schedules next
round's draft lengths (eq. 5, or the configured baseline), and each draft gets its verdict.

Order matters: a finished request's allotment returns to its pool before the others share it, and
a request whose prefill completed this step joins after scheduling, taking what the others leave of
``C`` (docs/DESIGN.md, *GoodSpeed's allocation*).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from goodspeed.scheduler import DraftAllotments
from goodspeed.verifier.session_table import SessionTable
from goodspeed.verifier.sessions import Request, Row, Session
from goodspeed.verifier.types import Verdict
from goodspeed.verifier.verify_rows import RowOutcome, committed_logprobs


@dataclass
class Outcome:
    """One draft's result this step: the tokens its request committed, its accepted drafts, why its
    request ended (None: it goes on) and the emitted tokens' log-probabilities (if asked for)."""

    row: Row
    emitted: list[int]
    accepted: int
    reason: str | None
    logprobs: list


def row_logprobs(rows: list[Row], logits: torch.Tensor | None, checked: list[RowOutcome]) -> list[list]:
    """Each row's emitted tokens' :class:`TokenLogprob` where its request asked for them (``[]``
    elsewhere): the logits at the kept positions are those the emitted tokens follow."""
    wanted = [(i, out.kept[: len(out.emitted)], out.emitted, row.session.request.logprobs)
              for i, (row, out) in enumerate(zip(rows, checked)) if row.session.request.logprobs is not None]
    out: list[list] = [[] for _ in rows]
    if wanted:
        for (i, *_), lps in zip(wanted, committed_logprobs(logits, wanted)):
            out[i] = lps
    return out


def apply_rows(rows: list[Row], checked: list[RowOutcome], logprobs: list[list], settled: list[Row]) -> list[Outcome]:
    """Commit each row's verified tokens (already in its KV slot) to its request. A transit row's
    token joins what the session decoded since its verdict (a request that ends there is told with
    its next verdict); ``settled`` drafts, whose request ended in transit, emit nothing."""
    outcomes = []
    for row, out, lps in zip(rows, checked, logprobs):
        if row.transit:
            apply_transit(row, out, lps)
            continue
        session, request = row.session, row.session.request
        emitted, reason = until_end(request, out.emitted)
        request.commit(emitted)
        accepted = len(out.kept) - 1
        session.source.observe(session.session_id, out.ratios, accepted)
        outcomes.append(Outcome(row, emitted, accepted, reason, lps[: len(emitted)]))
    return outcomes + [Outcome(row, [], 0, row.session.decoded_end, []) for row in settled]


def apply_transit(row: Row, outcome: RowOutcome, logprobs: list) -> None:
    """Commit a transit row's token (the target's next one, already in the KV slot) to its request."""
    session, request = row.session, row.session.request
    emitted, session.decoded_end = until_end(request, outcome.emitted[:1])
    request.commit(emitted)
    session.decoded += emitted
    session.decoded_logprobs += logprobs[: len(emitted)]


def schedule(outcomes: list[Outcome], sessions: SessionTable, round_index: int) -> dict[str, Verdict]:
    """Next round's draft lengths, from each source's book, then the verdicts."""
    finished = {o.row.session.session_id for o in outcomes if o.reason}
    for sid in finished:
        sessions.by_id[sid].source.end(sid)  # its allotment returns to the pool before the others share it
    by_source: dict[int, tuple[DraftAllotments, list[Session]]] = {}
    for o in outcomes:
        if o.row.session.session_id not in finished:
            by_source.setdefault(id(o.row.session.source), (o.row.session.source, []))[1].append(o.row.session)
    for source, participants in by_source.values():
        source.schedule([s.session_id for s in participants], [source.cap(s.request.remaining) for s in participants], round_index)
    return {o.row.session.session_id: verdict(o, sessions) for o in outcomes}


def verdict(outcome: Outcome, sessions: SessionTable) -> Verdict:
    """The draft's verdict; the session moves to its next round (its request ends if it finished)."""
    row, emitted, accepted, reason = outcome.row, outcome.emitted, outcome.accepted, outcome.reason
    session = row.session
    request, prompt_scores = session.request, None
    if request.prompt_logprobs is not None and not request.prompt_scores_sent:  # its first verdict: the prompt is all in
        prompt_scores, request.prompt_scores_sent = tuple(request.prompt_scores), True
    decoded = session.decoded
    if decoded:  # the text grew in transit first: the drafter keeps what equals its draft
        emitted = decoded + emitted
        accepted = 0 if row.draft.parents is not None else common_prefix(row.draft.token_ids, emitted)
    est = session.source.estimator.get(session.session_id)
    result = Verdict(
        session_id=session.session_id,
        round_index=row.draft.round_index,
        num_drafted=row.draft.num_tokens,
        num_accepted=accepted,
        num_transit=len(decoded),
        token_ids=emitted,
        committed_length=len(request.committed),
        prefix_hash=request.hasher.hexdigest(),
        next_draft_length=0 if reason else session.source.allotted(session.session_id),
        finished=reason is not None,
        finish_reason=reason,
        acceptance=est.acceptance,
        goodput=est.goodput,
        logprobs=tuple(session.decoded_logprobs + outcome.logprobs) if request.logprobs is not None else None,
        prompt_logprobs=prompt_scores,
    )
    session.last_draft, session.last_verdict = row.draft, result
    session.round_index += 1
    session.pending = None
    session.decoded, session.decoded_end, session.decoded_logprobs = [], None, []
    if reason:
        sessions.end(session)
    return result


def until_end(request: Request, emitted: list[int]) -> tuple[list[int], str | None]:
    """``emitted`` cut where the request ends, and why it ends there (``"eos"``: its first EOS,
    kept; ``"length"``: its last token; ``"error: ..."``: its grammar failed, and its masks
    forced the EOS), or ``None`` if it goes on."""
    cut, reason = len(emitted), None
    eos_at = next((i for i, tok in enumerate(emitted) if tok in request.eos_token_ids), None)
    if eos_at is not None:
        cut, reason = eos_at + 1, "eos"
    if cut > request.remaining or (cut == request.remaining and reason is None):
        cut, reason = request.remaining, "length"
    constraint = request.history.constraint if request.history is not None else None
    if reason is not None and constraint is not None and constraint.failure is not None:
        reason = f"error: {constraint.failure}"
    return emitted[:cut], reason


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The number of leading positions where ``a`` and ``b`` hold the same token."""
    n = 0
    for x, y in zip(a, b):
        if int(x) != int(y):
            break
        n += 1
    return n
