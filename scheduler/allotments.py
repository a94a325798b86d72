"""The verifier's draft-length bookkeeping, as pure code: who drafts how much next round.

GoodSpeed (seeds 003_e4f9b92fd7e1d2ba, Algorithm 1, lines 13-16): after each verified round the
verifier updates every participant's smoothed acceptance and goodput (eqs. 3-4,
:class:`~goodspeed.scheduler.goodspeed.GoodputEstimator`) and asks the draft-length policy for
next round's ``S_i`` under the budget ``C`` (eq. 5 or a baseline, :mod:`.policy`).

:class:`DraftAllotments` is that step plus what a live system adds around it, in one place that
has no model, no tensors and no clock, so that the verification engine
(:mod:`goodspeed.verifier.engine`) and the simulator (:mod:`goodspeed.launch.simulate`) run the
same code:

* requests come and go: a drafter between requests holds no allotment; a newcomer gets an equal
  share of ``C`` but only what the others leave free this round (:meth:`start`);
* a drafter's ``S_i`` never exceeds its cap (the request's remaining tokens less the one the
  target adds, and ``max_draft_len``);
* drafters that did not take part in a round (a newcomer, a drafter that missed the deadline)
  keep their allotment, and the policy shares only what they leave of ``C``;
* sessions of one edge device share a utility term (:meth:`device_goodput`);
* managed sessions (the verifier's own local serving) are outside ``C`` and the policy: their
  caller sets their size (:meth:`set`);
* each session's period (seconds between its verdicts) is fitted online (:meth:`observe_period`,
  :class:`~goodspeed.scheduler.timing.PeriodEstimator`) for policies that allocate on tokens per
  second (``goodspeed-time``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from goodspeed.scheduler.goodspeed import GoodputEstimator, SmoothingConfig
from goodspeed.scheduler.policy import AllocationInputs, DraftLengthPolicy, make_policy
from goodspeed.scheduler.timing import PeriodEstimator


@dataclass
class _Entry:
    device: Hashable
    managed: bool
    active: bool = False  # has a request in progress
    allotted: int = 0


class DraftAllotments:
    """Per-session allotments, the smoothing state and the policy of one verifier."""

    def __init__(self, budget: int, policy: str | DraftLengthPolicy = "goodspeed", smoothing: SmoothingConfig | None = None,
                 max_draft_len: int = 16, rng: np.random.Generator | None = None) -> None:
        if budget < 0 or max_draft_len < 0:
            raise ValueError("budget and max_draft_len must be >= 0")
        self.budget, self.max_draft_len = int(budget), int(max_draft_len)
        self.estimator = GoodputEstimator(smoothing)
        self.periods = PeriodEstimator()
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.rng = rng if rng is not None else np.random.default_rng()
        self._entries: dict[Hashable, _Entry] = {}

    # ---------------------------------------------------------------------------- membership

    def join(self, session_id: Hashable, device: Hashable | None = None, managed: bool = False) -> None:
        if session_id in self._entries:
            raise ValueError(f"session {session_id!r} already joined")
        self.estimator.join(session_id)
        self._entries[session_id] = _Entry(session_id if device is None else device, managed)

    def leave(self, session_id: Hashable) -> None:
        self.estimator.leave(session_id)
        self.periods.leave(session_id)
        del self._entries[session_id]

    def cap(self, remaining: int) -> int:
        """Most tokens worth drafting with ``remaining`` new tokens left: the last one always
        comes from the target."""
        return max(0, min(self.max_draft_len, remaining - 1))

    def edge_active(self) -> list[Hashable]:
        return [sid for sid, e in self._entries.items() if e.active and not e.managed]

    def start(self, session_id: Hashable, remaining: int) -> int:
        """A request begins; returns its first allotment: an equal share of ``C``, but only what
        the other active drafters leave free this round (0 for a managed session)."""
        entry = self._entries[session_id]
        entry.active = True
        if entry.managed:
            entry.allotted = 0
            return 0
        active = self.edge_active()
        free = self.budget - sum(self._entries[s].allotted for s in active if s != session_id)
        entry.allotted = max(0, min(self.budget // len(active), free, self.cap(remaining)))
        return entry.allotted

    def end(self, session_id: Hashable) -> None:
        """The request is over: its allotment returns to the pool."""
        entry = self._entries[session_id]
        entry.active, entry.allotted = False, 0

    def device_of(self, session_id: Hashable) -> Hashable:
        """The edge device whose utility term the session counts towards."""
        return self._entries[session_id].device

    def allotted(self, session_id: Hashable) -> int:
        return self._entries[session_id].allotted

    def set(self, session_id: Hashable, num_tokens: int) -> None:
        """Override the next round's draft length (callers that choose sizes themselves)."""
        self._entries[session_id].allotted = int(num_tokens)

    # -------------------------------------------------------------------------------- rounds

    def observe(self, session_id: Hashable, acceptance_ratios, num_accepted: int) -> None:
        """Eqs. (3)-(4) for one verified row (see :meth:`GoodputEstimator.observe`)."""
        self.estimator.observe(session_id, acceptance_ratios, num_accepted)

    def observe_period(self, session_id: Hashable, draft_length: int, seconds: float) -> None:
        """The session's period that ended with a verified draft of ``draft_length`` tokens."""
        self.periods.observe(session_id, draft_length, seconds)

    def period_arrays(self, participants: Sequence[Hashable]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """``(base, per_token, mean)`` per participant, ``(1, 0, 1)`` for one not timed yet; None if
        none is timed."""
        fits = [self.periods.fit(s) for s in participants]
        if all(f is None for f in fits):
            return None
        return tuple(np.array([default if f is None else getattr(f, name) for f in fits], dtype=np.float64)
                     for name, default in (("base", 1.0), ("per_token", 0.0), ("mean", 1.0)))

    def schedule(self, participants: Sequence[Hashable], caps: Sequence[int], round_index: int) -> np.ndarray:
        """Next round's ``S_i`` for the edge sessions verified this round whose request goes on.

        ``caps[i]`` is participant ``i``'s cap (:meth:`cap` of its remaining tokens). Active
        drafters that did not take part keep their allotment, which is taken off ``C`` first.
        Returns the new allotments (also stored)."""
        if not participants:
            return np.zeros(0, dtype=np.int64)
        taking_part = set(participants)
        budget = max(0, self.budget - sum(self._entries[s].allotted for s in self.edge_active() if s not in taking_part))
        acceptance, goodput = self.estimator.arrays(participants)
        goodput = self.device_goodput(participants, goodput)
        measured, stale = self.estimator.evidence(participants)
        inputs = AllocationInputs(list(participants), acceptance, goodput, budget, np.asarray(caps, dtype=np.int64),
                                  round_index, self.rng, measured, stale,
                                  self.period_arrays(participants) if getattr(self.policy, "uses_periods", False) else None)
        lengths = np.asarray(self.policy.allocate(inputs), dtype=np.int64)
        for sid, length in zip(participants, lengths.tolist()):
            self._entries[sid].allotted = length
        return lengths

    def device_goodput(self, participants: Sequence[Hashable], goodput: np.ndarray) -> np.ndarray:
        """Each participant's DEVICE goodput: the sum of ``X`` over the device's active sessions.

        GoodSpeed's utility is ``sum_d log X_d`` over devices. A device serving several requests
        at once holds one session per request and ``X_d = sum_{r in d} X_r``, so the utility's
        gradient with respect to request ``r``'s goodput is ``U'(X_d)`` for every ``r`` in ``d``:
        eq. (5) stays the same separable problem with weight ``U'(X_d)`` on each of the device's
        requests. The budget then goes to devices in the paper's proportions, and inside a
        device to the requests with the highest marginal gain. A session alone on its device is
        unchanged (``X_d = X_r``).
        """
        devices = [self._entries[s].device for s in participants]
        if len(set(devices)) == len(participants) and all(d == s for d, s in zip(devices, participants)):
            return goodput
        wanted, totals = set(devices), {}
        for sid in self.edge_active():
            device = self._entries[sid].device
            if device in wanted:
                totals[device] = totals.get(device, 0.0) + self.estimator.get(sid).goodput
        return np.array([totals[d] for d in devices], dtype=np.float64)
