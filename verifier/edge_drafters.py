"""The edge drafters as the server and the round loop see them: one :class:`Drafter` (its session,
its request's KV tokens held against its identity's limit, and the smoothed timing of its rounds
that says when its next draft is due: :mod:`goodspeed.verifier.round_loop`'s async window), and
the :class:`DrafterRegistry` of them that the round loop owns."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from goodspeed.serving.metrics import RequestTimer
from goodspeed.verifier import errors
from goodspeed.verifier.auth import Identity

CYCLE_SMOOTHING = 0.2  # weight of a drafter's newest cycle in its moving averages (when its next draft is due)
DUE_DEVIATIONS = 2.0  # a drafter's next draft is due this many smoothed absolute deviations before its mean cycle


def _smoothed(mean: float | None, value: float) -> float:
    """``mean`` moved ``CYCLE_SMOOTHING`` of the way to ``value`` (``value`` itself when there is no mean yet)."""
    return value if mean is None else mean + CYCLE_SMOOTHING * (value - mean)


@dataclass
class Drafter:
    """One edge drafter's session, as the server and the round loop see it."""

    session_id: str
    name: str
    verdicts: asyncio.Queue
    identity: Identity  # who joined: only they may name this session
    kv_tokens: int = 0  # prompt + max_new_tokens of its request in progress, held against the identity's limit
    missed: int = 0
    in_request: bool = False
    receive_s: float | None = None  # this round: round open -> its draft arrived
    cycle_s: float | None = None  # its previous verdict sent -> this draft arrived (link + drafting)
    verdict_at: float | None = None  # perf_counter when its last verdict was sent (None: first of its request)
    cycle_mean_s: float | None = None  # smoothed cycle_s
    cycle_dev_s: float = 0.0  # smoothed |cycle_s - cycle_mean_s|: its next draft is due at verdict_at + due_after_s
    last_seen: float = field(default_factory=time.monotonic)
    joined_at: float = field(default_factory=time.monotonic)
    streaming: bool = False  # its verdict stream is open
    timer: RequestTimer | None = None  # its request in progress, for the request metrics
    transit: bool = False  # steps decode for it while its draft is away (it opted in, transit_tokens > 0)
    period_mean_s: float | None = None  # smoothed seconds between two of its verdicts (its whole round)
    tokens_mean: float | None = None  # smoothed tokens a verdict of its carries (transit-decoded ones included)

    def observe_cycle(self, cycle_s: float) -> None:
        """Smooth one measured cycle into the mean and the mean absolute deviation."""
        self.cycle_s = cycle_s
        if self.cycle_mean_s is not None:
            self.cycle_dev_s = _smoothed(self.cycle_dev_s, abs(cycle_s - self.cycle_mean_s))
        self.cycle_mean_s = _smoothed(self.cycle_mean_s, cycle_s)

    def observe_verdict(self, sent: float, tokens: int) -> None:
        """Smooth the round that a verdict sent at ``sent`` (``perf_counter``) carrying ``tokens``
        tokens ends: its period (since the previous verdict of the same request) and its tokens."""
        if self.verdict_at is not None:
            self.period_mean_s = _smoothed(self.period_mean_s, sent - self.verdict_at)
        self.tokens_mean = _smoothed(self.tokens_mean, tokens)

    @property
    def due_after_s(self) -> float | None:
        """Seconds after its last verdict by which its next draft may arrive (None: no estimate
        yet): the smoothed cycle less ``DUE_DEVIATIONS`` smoothed deviations, so a drafter whose
        cycles vary is due early and waited for, one behind a steady slow link is not."""
        if self.cycle_mean_s is None:
            return None
        return max(0.0, self.cycle_mean_s - DUE_DEVIATIONS * self.cycle_dev_s)

    def due_at(self, now: float) -> float:
        """When (``perf_counter``) its next draft is due: its last verdict plus :attr:`due_after_s`,
        or ``now`` with no verdict or no estimate yet (it may come any moment)."""
        due_after = self.due_after_s
        return now if self.verdict_at is None or due_after is None else self.verdict_at + due_after


class DrafterRegistry:
    """The edge drafters that joined, by session id, and what joining holds: the round loop owns
    it (:mod:`goodspeed.verifier.round_loop`), the RPC handlers add to it. Removing a drafter frees
    everything it held (its request's KV tokens against its identity, its verdict stream, its
    engine session) and updates the gauges; so does a request's end."""

    def __init__(self, engine, local, call: Callable[..., Awaitable], usage, metrics, log) -> None:
        self.engine, self.local, self.call, self.usage, self.metrics, self.log = engine, local, call, usage, metrics, log
        self.by_session: dict[str, Drafter] = {}

    def __contains__(self, session_id: str) -> bool:
        return session_id in self.by_session

    def get(self, session_id: str) -> Drafter | None:
        return self.by_session.get(session_id)

    def add(self, drafter: Drafter) -> None:
        self.by_session[drafter.session_id] = drafter
        self.metrics.active.set(len(self.by_session))

    async def remove(self, session_id: str, reason: str) -> None:
        """Forget a drafter, close its verdict stream and free its engine session (idempotent)."""
        drafter = self.by_session.pop(session_id, None)
        if drafter is None:
            return
        self.end_request(drafter)
        drafter.verdicts.put_nowait(None)
        try:
            await self.call(self.engine.leave, session_id)
        except errors.UnknownSessionError:
            pass
        self.metrics.active.set(len(self.by_session))
        self.update_gauges()
        self.log.event("drop", session=session_id, name=drafter.name, reason=reason)

    def end_request(self, drafter: Drafter, reason: str = "abort") -> None:
        """The drafter's request ended (finished, finished early or dropped): release its KV tokens."""
        self.usage.release_request(drafter.identity.name, drafter.kv_tokens)
        drafter.kv_tokens = 0
        if drafter.timer is not None:
            drafter.timer.finish(reason)
            drafter.timer = None

    def update_gauges(self) -> None:
        """``num_requests_running`` (edge requests in progress and local requests in the batch)
        and ``num_requests_waiting`` (local requests queued), from the state itself."""
        waiting = self.local.num_waiting if self.local is not None else 0
        self.metrics.requests.running.set(self.requests_in_progress() - waiting)
        self.metrics.requests.waiting.set(waiting)

    def requests_in_progress(self) -> int:
        local = self.local.num_active + self.local.num_waiting if self.local is not None else 0
        return sum(d.in_request for d in self.by_session.values()) + local
