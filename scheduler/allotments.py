"""The verifier's draft-length bookkeeping, as pure code: who drafts how much next round.

GoodSpeed (arXiv 2512.09963, Algorithm 1, lines 13-16): after each verified round the
verifier updates every participant's smoothed acceptance and goodput (eqs. 3-4,
:class:`~goodspeed.scheduler.goodspeed.GoodputEstimator`) and asks the draft-length policy for
next round's ``S_i`` under the budget ``C`` (eq. 5 or a baseline, :mod:`.policy`).

:class:`DraftAllotments` is that step plus what a live system adds around it, in one place that
has no model, no tensors and no clock, so that the verification engine
(:mod:`goodspeed.verifier.engine`) and the simulator (:mod:`goodspeed.launch.experiments.simulate`) run the
same code:

* requests come and go: a drafter between requests holds no allotment; a newcomer gets an equal
  share of ``C`` but only what the others leave free this round (:meth:`start`);
* a drafter's ``S_i`` never exceeds its cap (the request's remaining tokens less the one the
  target adds, and ``max_draft_len``);
* drafters that did not take part in a round (a newcomer, a drafter that missed the deadline)
  keep their allotment, and the policy shares only what they leave of ``C``;
* with ``plan_shares`` (asynchronous rounds, :mod:`goodspeed.verifier.round_loop`), a step that
  verifies only some of the active drafters still asks the policy to split ``C`` among all of
  them, and its drafters take their planned shares as far as what the others hold leaves room:
  :meth:`schedule`;
* sessions of one edge device share a utility term (:meth:`device_goodput`);
* at most ``max_sessions`` sessions (the verifier's ``max_drafters``) join (:attr:`full`);
* each session's period (seconds between its verdicts) is fitted online (:meth:`observe_period`,
  :class:`~goodspeed.scheduler.timing.PeriodEstimator`) for policies that allocate on tokens per
  second (``goodspeed-time``).

Each source of drafts on a verifier holds one book: the edge drafters share the engine's
(budget ``C`` and the draft-length policy), and local serving keeps an
:class:`OwnerSizedAllotments` whose sizes it chooses itself with its own paper's rule (TETRIS,
AdaServe, TurboSpec, Nightjar). The engine verifies every source's drafts in one forward and asks
each session's book what it may draft; it has no notion of which source is which.
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
    active: bool = False  # has a request in progress
    allotted: int = 0
    cap: int = 0  # its request's cap when it was last sized (start or schedule): for planned shares


class DraftAllotments:
    """Per-session allotments, the smoothing state and the policy of one verifier."""

    def __init__(self, budget: int, policy: str | DraftLengthPolicy = "goodspeed", smoothing: SmoothingConfig | None = None,
                 max_draft_len: int = 16, rng: np.random.Generator | None = None, max_sessions: int | None = None) -> None:
        if budget < 0 or max_draft_len < 0:
            raise ValueError("budget and max_draft_len must be >= 0")
        if max_sessions is not None and max_sessions < 1:
            raise ValueError("max_sessions must be >= 1 (or None: no limit)")
        self.budget, self.max_draft_len, self.max_sessions = int(budget), int(max_draft_len), max_sessions
        self.estimator = GoodputEstimator(smoothing)
        self.periods = PeriodEstimator()
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.rng = rng if rng is not None else np.random.default_rng()
        # Asynchronous rounds: the policy splits C among every active session at each step (schedule).
        self.plan_shares = False
        self._entries: dict[Hashable, _Entry] = {}

    # ---------------------------------------------------------------------------- membership

    @property
    def full(self) -> bool:
        """``max_sessions`` sessions have joined: the next one is refused."""
        return self.max_sessions is not None and len(self._entries) >= self.max_sessions

    @property
    def max_allotment(self) -> int | None:
        """Largest draft a session of this book may be given (:meth:`set`); None: no limit."""
        return self.budget

    def join(self, session_id: Hashable, device: Hashable | None = None) -> None:
        if session_id in self._entries:
            raise ValueError(f"session {session_id!r} already joined")
        if self.full:
            raise ValueError(f"already holding {self.max_sessions} sessions (max_sessions)")
        self.estimator.join(session_id)
        self._entries[session_id] = _Entry(session_id if device is None else device)

    def leave(self, session_id: Hashable) -> None:
        self.estimator.leave(session_id)
        self.periods.leave(session_id)
        del self._entries[session_id]

    def cap(self, remaining: int) -> int:
        """Most tokens worth drafting with ``remaining`` new tokens left: the last one always
        comes from the target."""
        return max(0, min(self.max_draft_len, remaining - 1))

    def active(self) -> list[Hashable]:
        """Sessions with a request in progress."""
        return [sid for sid, e in self._entries.items() if e.active]

    def start(self, session_id: Hashable, remaining: int) -> int:
        """A request begins; returns its first allotment: an equal share of ``C``, but only what
        the other active drafters leave free this round."""
        entry = self._entries[session_id]
        entry.active = True
        active = self.active()
        free = self.budget - sum(self._entries[s].allotted for s in active if s != session_id)
        entry.cap = self.cap(remaining)
        entry.allotted = max(0, min(self.budget // len(active), free, entry.cap))
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
        """Override the next round's draft length (callers that choose sizes themselves), within
        ``[0, max_allotment]``."""
        limit = self.max_allotment
        if num_tokens < 0 or (limit is not None and num_tokens > limit):
            raise ValueError(f"allotment {num_tokens} outside [0, {limit}]")
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
        """Next round's ``S_i`` for the sessions verified this round whose request goes on.

        ``caps[i]`` is participant ``i``'s cap (:meth:`cap` of its remaining tokens). Active
        drafters that did not take part keep their allotment, which is taken off ``C`` first, so
        the allotments outstanding never sum to more than ``C``. Returns the new allotments (also
        stored).

        How the participants split what is free:

        * by default (the paper's lockstep round, where everyone takes part in most rounds) the
          policy splits it among them;
        * with :attr:`plan_shares` (asynchronous rounds, where a step often verifies one drafter
          and the others' drafts are on their way), the policy first splits all of ``C`` among
          every active session, the participants with their caps and the others with the caps
          their requests had when last sized. A participant gets its planned share when the
          participants' shares fit in what is free; otherwise the policy splits what is free
          among them, none above its planned share. Without the plan a lone participant would be
          given whatever the others happened to leave free (eq. 5 spends every unit that gains),
          so the split would follow the order in which verdicts come back rather than the policy.
        """
        if not participants:
            return np.zeros(0, dtype=np.int64)
        taking_part = set(participants)
        others = [s for s in self.active() if s not in taking_part]
        free = max(0, self.budget - sum(self._entries[s].allotted for s in others))
        caps = np.asarray(caps, dtype=np.int64).reshape(-1)
        if self.plan_shares and others:
            everyone = list(participants) + others
            every_cap = np.concatenate([caps, np.array([self._entries[s].cap for s in others], dtype=np.int64)])
            plan = self._allocate(everyone, every_cap, self.budget, round_index)[: len(participants)]
            lengths = plan if int(plan.sum()) <= free else self._allocate(participants, np.minimum(caps, plan), free, round_index)
        else:
            lengths = self._allocate(participants, caps, free, round_index)
        for sid, length, cap in zip(participants, lengths.tolist(), caps.tolist()):
            self._entries[sid].allotted, self._entries[sid].cap = length, cap
        return lengths

    def _allocate(self, sessions: Sequence[Hashable], caps: np.ndarray, budget: int, round_index: int) -> np.ndarray:
        """The policy's split of ``budget`` among ``sessions`` (each within its cap)."""
        acceptance, goodput = self.estimator.arrays(sessions)
        goodput = self.device_goodput(sessions, goodput)
        measured, stale = self.estimator.evidence(sessions)
        inputs = AllocationInputs(list(sessions), acceptance, goodput, budget, caps, round_index, self.rng, measured, stale,
                                  self.period_arrays(sessions) if getattr(self.policy, "uses_periods", False) else None)
        return np.asarray(self.policy.allocate(inputs), dtype=np.int64)

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
        for sid in self.active():
            device = self._entries[sid].device
            if device in wanted:
                totals[device] = totals.get(device, 0.0) + self.estimator.get(sid).goodput
        return np.array([totals[d] for d in devices], dtype=np.float64)


class OwnerSizedAllotments(DraftAllotments):
    """A book whose owner sizes every draft itself (local serving, with TETRIS, AdaServe,
    TurboSpec or Nightjar choosing what to verify): no budget ``C`` and no draft-length policy, so
    a session starts at 0 and keeps what :meth:`set` last gave it; acceptance and goodput are
    smoothed (eqs. 3-4) as for any session, and reported in its verdicts."""

    def __init__(self, smoothing: SmoothingConfig | None = None) -> None:
        super().__init__(0, "fixed", smoothing)  # the policy is never asked

    @property
    def max_allotment(self) -> None:
        return None

    def start(self, session_id: Hashable, remaining: int) -> int:
        entry = self._entries[session_id]
        entry.active, entry.allotted = True, 0
        return 0

    def schedule(self, participants: Sequence[Hashable], caps: Sequence[int], round_index: int) -> np.ndarray:
        """Sizes stay the owner's: the allotments as they are."""
        return np.array([self._entries[s].allotted for s in participants], dtype=np.int64)
