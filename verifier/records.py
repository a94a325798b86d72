"""The verifier's round record: one typed contract between the writer and every reader.

The verifier writes one :class:`RoundRecord` per verified round to its JSON log (an event
``{"event": "round", ...}``); the launcher's live table and summary (:mod:`goodspeed.launch.cluster.local`)
and the experiment runner (:mod:`goodspeed.launch.experiments.experiment`) read it back with
:meth:`RoundRecord.from_event`. A missing or unknown field, or another schema version, raises
:class:`RecordError` — a reader never shows a blank for a field the writer renamed.

Per drafter in the round (:class:`DrafterRound`): ``drafted`` (``S_i``), ``accepted`` (``m_i``),
``gained`` (tokens the drafter's text grew by: ``m_i + 1``, less at the request's end),
``acceptance`` (the smoothed ``alpha_hat_i`` after this round, GoodSpeed eq. 3), ``goodput`` (the
smoothed ``X_i``, eq. 4), ``next_draft_length`` (``S_i`` for the next round), ``finished``,
``receive_s`` (round open -> its draft arrived) and ``cycle_s`` (its previous verdict sent -> this
draft arrived: its link and its drafting; ``None`` for a request's first draft). The round: its
index, the phase seconds (``receive_s``, ``verify_s`` of which ``forward_s``, ``send_s``), the rows
in the forward (``batch``), the budget ``C``, the round ``mode`` (``sync`` or ``async``, see
:mod:`goodspeed.verifier.round_loop`: in async mode a record is one verification step), the wall
clock ``ts``, the prompt tokens of chunked prefill packed into the step's forward
(``prefill_tokens``, part of ``verify_s``), why the step closed (``closed``, one of
:data:`CLOSE_REASONS`; see :mod:`goodspeed.verifier.round_loop`) and, with local serving, a
:class:`LocalRound`.

Schema 2 added ``cycle_s`` and ``mode``; schema 3 ``prefill_tokens``; schema 4 ``closed``; schema 5
``transit`` (per drafter: tokens of ``gained`` the verifier decoded while the draft was in
transit) and ``transit_tokens`` (the step's transit rows; see :mod:`goodspeed.verifier.engine`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass

SCHEMA = 5
ROUND_MODES = ("sync", "async")  # the round loop's modes (goodspeed.verifier.round_loop)
# Async rounds: how a step's drafters share C. "plan": the policy splits C among every active
# drafter and they take their planned shares; "free": they split what the others' allotments leave.
# goodspeed.scheduler.DraftAllotments.schedule.
SHARE_MODES = ("plan", "free")
CLOSE_REASONS = ("all", "window", "none-due", "local", "transit")  # why a step closed (goodspeed.verifier.round_loop)


class RecordError(ValueError):
    """A round event that does not match this reader's schema."""


def _strict(cls, data: dict, where: str):
    """``cls(**data)`` with exactly the dataclass's fields (no fewer, no more)."""
    if not isinstance(data, dict):
        raise RecordError(f"{where}: expected an object, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    missing, unknown = names - set(data), set(data) - names
    if missing or unknown:
        raise RecordError(f"{where}: missing {sorted(missing)}, unknown {sorted(unknown)} (schema {SCHEMA})")
    return cls(**data)


@dataclass(frozen=True)
class DrafterRound:
    session: str
    name: str
    drafted: int
    accepted: int
    gained: int
    acceptance: float
    goodput: float
    next_draft_length: int
    finished: bool
    receive_s: float | None
    cycle_s: float | None = None
    transit: int = 0  # of ``gained``, tokens decoded while its draft was in transit (verifier.engine)


@dataclass(frozen=True)
class LocalRound:
    """Local serving's part of the round (:mod:`goodspeed.verifier.local`)."""

    requests: int
    drafted: int
    accepted: int
    emitted: int
    k: int
    waiting: int


@dataclass(frozen=True)
class RoundRecord:
    round: int
    receive_s: float
    verify_s: float
    forward_s: float
    send_s: float
    batch: int
    budget: int
    drafters: tuple[DrafterRound, ...]
    local: LocalRound | None = None
    mode: str = "sync"
    prefill_tokens: int = 0
    closed: str = "all"
    transit_tokens: int = 0  # tokens decoded in transit in this step (one per transit row)
    ts: float = dataclasses.field(default_factory=time.time)

    def to_event(self) -> dict:
        """The log event (``ts`` rounded to microseconds, as every log line)."""
        data = dataclasses.asdict(self)
        data["ts"] = round(self.ts, 6)
        return {"event": "round", "schema": SCHEMA, **data}

    def to_json(self) -> str:
        return json.dumps(self.to_event())

    @classmethod
    def from_event(cls, event: dict) -> RoundRecord:
        if not isinstance(event, dict) or event.get("event") != "round":
            raise RecordError("not a round event")
        if event.get("schema") != SCHEMA:
            raise RecordError(f"round event schema {event.get('schema')!r}; this reader reads schema {SCHEMA}")
        data = {k: v for k, v in event.items() if k not in ("event", "schema")}
        where = f"round {data.get('round', '?')}"
        drafters = data.get("drafters")
        if not isinstance(drafters, list):
            raise RecordError(f"{where}: drafters must be a list")
        data["drafters"] = tuple(_strict(DrafterRound, d, f"{where}, drafter row") for d in drafters)
        if data.get("local") is not None:
            data["local"] = _strict(LocalRound, data["local"], f"{where}, local")
        for key, allowed in (("mode", ROUND_MODES), ("closed", CLOSE_REASONS)):
            if key in data and data[key] not in allowed:
                raise RecordError(f"{where}: {key} {data[key]!r} is not one of {allowed}")
        return _strict(cls, data, where)
