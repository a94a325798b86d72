"""The engine's first stage: its sessions. Who joined, which session has a request and a KV slot,
whose prompt is still being prefilled (chunked prefill, first come first served), and the checks a
session must pass before it drafts.

Every other stage reads sessions through this table: the planner walks it in slot order, the apply
stage ends requests through it (:meth:`SessionTable.end`), and the engine's public calls (join,
leave, start, finish, resync) change it.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

from goodspeed.lm.runtime.kv_slots import SlotKVCache, SlotTable
from goodspeed.scheduler import DraftAllotments
from goodspeed.verifier import errors
from goodspeed.verifier.sessions import Request, Session


class SessionTable:
    """Sessions by id, their KV slots (:class:`~goodspeed.lm.runtime.kv_slots.SlotTable`) and the
    prefill queue."""

    def __init__(self, cache: SlotKVCache, fingerprint: str | None) -> None:
        self.by_id: dict[str, Session] = {}
        self.slots = SlotTable(cache)  # session id -> KV slot, for sessions with a request
        self.prefilling: list[str] = []  # sessions whose prompt is not all in KV yet, first come first served
        self.fingerprint = fingerprint

    @property
    def cache(self) -> SlotKVCache:
        return self.slots.cache

    def use_cache(self, cache: SlotKVCache) -> None:
        """Put a fresh cache under the sessions (tests and benchmarks pick its layout); only while
        no session holds a slot."""
        if self.slots.keys:
            raise RuntimeError("the KV cache can be replaced only while no request is in progress")
        self.slots = SlotTable(cache)

    def join(self, name: str, source: DraftAllotments, tokenizer_fingerprint: str | None = None,
             device: str | None = None, transit: bool = False) -> str:
        """Register a drafter whose drafts ``source`` sizes; returns its session id (see
        :meth:`VerificationEngine.join <goodspeed.verifier.engine.VerificationEngine.join>`)."""
        if source.full:
            raise errors.TooManyDraftersError(f"already serving {source.max_sessions} drafters")
        if tokenizer_fingerprint is not None and self.fingerprint and not tokenizer_fingerprint:
            raise errors.TokenizerMismatchError(
                f"drafter {name!r} sent no tokenizer fingerprint; the target's is {self.fingerprint[:12]}: "
                "send goodspeed.lm.models.fingerprint of the draft's tokenizer"
            )
        if tokenizer_fingerprint and self.fingerprint and tokenizer_fingerprint != self.fingerprint:
            raise errors.TokenizerMismatchError(
                f"drafter {name!r} tokenizer {tokenizer_fingerprint[:12]} != target tokenizer {self.fingerprint[:12]}: "
                "draft and target must share one tokenizer"
            )
        # 128 random bits: no client can guess another's session, and ids never repeat across
        # restarts (a drafter retrying its old id cannot land in a newcomer's session).
        session_id = f"{name}#{secrets.token_hex(16)}"
        source.join(session_id, device or session_id)
        self.by_id[session_id] = Session(session_id, name, source, transit=transit)
        return session_id

    def leave(self, session_id: str) -> None:
        session = self.get(session_id)
        if session.request is not None:
            self.end(session)
        session.source.leave(session_id)
        del self.by_id[session_id]

    def kv_usage(self) -> tuple[int, int]:
        """KV slots held and positions reserved per layer; safe to read from another thread (the
        metrics endpoint's) while the engine runs: it reads snapshots, never a table mid-change."""
        slots = self.slots
        return len(slots.keys), slots.cache.reserved_positions

    def get(self, session_id: str) -> Session:
        try:
            return self.by_id[session_id]
        except KeyError:
            raise errors.UnknownSessionError(f"unknown or evicted session {session_id!r}") from None

    def at(self, slot: int) -> Session:
        """The session whose request holds KV slot ``slot``."""
        return self.by_id[self.slots.keys[slot]]

    def request_at(self, slot: int) -> Request:
        return self.at(slot).request

    def in_slot_order(self) -> Iterator[tuple[int, Session]]:
        """``(slot, session)`` of every session with a request, in slot order."""
        for slot, session_id in enumerate(self.slots.keys):
            yield slot, self.by_id[session_id]

    def open(self, session: Session, request: Request, chunked: bool) -> int:
        """Give ``session`` (one with no request: the engine checked) its request and a KV slot;
        with ``chunked`` its prompt joins the prefill queue. Returns the slot."""
        slot = self.slots.add(session.session_id)
        session.request = request
        if chunked:
            self.prefilling.append(session.session_id)
        return slot

    def end(self, session: Session) -> None:
        """End the session's request: free its slot and everything its request held."""
        if session.session_id in self.prefilling:
            self.prefilling.remove(session.session_id)
        self.slots.remove(session.session_id)
        session.source.end(session.session_id)
        session.request, session.pending = None, None
        session.decoded, session.decoded_end, session.decoded_logprobs = [], None, []

    def prefilled(self, chunks: list[tuple[int, list[int]]]) -> list[str]:
        """Keep the prompt chunks' KV (right after the forward: slots move when a request ends);
        returns the sessions whose prompt is now all in."""
        done = []
        for slot, chunk in chunks:
            self.cache.commit(slot, self.cache.lengths[slot], list(range(len(chunk))))
            session = self.at(slot)
            if self.cache.lengths[slot] == session.request.prompt_len - 1:
                self.prefilling.remove(session.session_id)
                done.append(session.session_id)
        return done

    def start_drafting(self, session_ids: list[str]) -> dict[str, int]:
        """Prefilled sessions join drafting: their first draft lengths."""
        return {sid: self.by_id[sid].source.start(sid, self.by_id[sid].request.remaining) for sid in session_ids}

    def check_drafting(self, session: Session) -> None:
        """Raise unless the session may draft now: a request in progress, its prompt all in."""
        if session.request is None:
            raise errors.NoActiveRequestError(f"session {session.session_id} has no request in progress")
        if session.session_id in self.prefilling:
            raise errors.NoActiveRequestError(f"session {session.session_id}'s prompt is still being prefilled: "
                                              "draft once its request has started")

    def active_request(self, session_id: str) -> Request:
        """The session's request in progress (raises if it has none)."""
        session = self.get(session_id)
        if session.request is None:
            raise errors.NoActiveRequestError(f"session {session_id} has no request in progress")
        return session.request
