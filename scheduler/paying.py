"""A drafter's own length rule: draft only what pays, so speculation never makes a request slower.

The verifier allots each drafter ``S_i`` (GoodSpeed's allocation of the budget ``C``); a drafter
may send fewer. With acceptance ``a`` (the chance the target takes each drafted token, given it
took the ones before), a round drafting ``S`` tokens yields ``l(a, S) = (1 - a^(S+1)) / (1 - a)``
tokens (eq. 4 of TurboSpec, Liu et al., arXiv 2406.14066) and costs the drafter::

    T(S) = S * t_draft + t_round + S * t_verify

where ``t_draft`` is its own drafting time per token (a model's forward; a lookup's: about 0),
``t_round`` the round trip of a draft of nothing (link and the verifier's step) and ``t_verify``
what each drafted token adds to it. :func:`paying_draft_length` picks the ``S <= S_i`` with the
most tokens per second, ``l(a, S) / T(S)``, as TurboSpec's Listing 2 picks ``k``; ``S = 0`` (one
token a round, the target's own decoding) wins wherever a drafted token costs more than it is
expected to bring. The choice reads past rounds only, never a token drawn this round, so it
leaves the output's distribution unchanged.

:class:`PayingLength` keeps the estimates: per request its acceptance (counts of accepted tokens
and of rejections, which a chain's verdict gives, decayed so a request's acceptance can move with
its text, starting from the drafter's pooled acceptance over its recent verdicts), and per drafter
the times (a smoothed mean of the drafting time; ``t_round`` and ``t_verify`` fitted by least
squares over recent rounds, the slope taken from ``default_verify_ratio`` until the rounds'
lengths vary enough to fit it: at least three distinct lengths, so one odd round cannot set the
slope alone; rounds over :data:`OUTLIER_RATIO` times the median, as a new batch shape's first
forward, are left out). A request at ``S = 0`` drafts one token after ``probe_every``
rounds, so its acceptance is heard again and speculation resumes where it pays again; each probe
that is rejected doubles the wait before the next (up to ``max_probe_every`` rounds), and one that
is accepted, or a paying length, resets it, so text that never pays costs ever fewer probes.

For a batch (local serving), :meth:`PayingLength.batch_costs` fits the step's time on its longest
chain as well, and :func:`paying_lengths` picks every request's length from per-position
acceptance paths; given a ``floor``, only among lengths that keep each request at that fraction of
plain decoding's pace over its life (the batch's most tokens a second can otherwise slow a
request whose own drafts do not pay). A lookup's drafts are worth what the context it matched says
(:class:`EvidenceAcceptance`: acceptance kept by match length), so a node or a batch drafting by
lookup looks the longest draft up first and keeps the prefix that pays.

>>> paying_draft_length(0.8, 8, draft_s_per_token=0.0, round_s=0.030, verify_s_per_token=0.001)
8
>>> paying_draft_length(0.3, 8, draft_s_per_token=0.010, round_s=0.030, verify_s_per_token=0.001)
0
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np

from goodspeed.scheduler.goodspeed import expected_goodput


def paying_draft_length(acceptance: float, allotted: int, draft_s_per_token: float, round_s: float,
                        verify_s_per_token: float) -> int:
    """``argmax_{0 <= S <= allotted} l(a, S) / (S * (t_draft + t_verify) + t_round)``; ties go to
    the smaller ``S``."""
    if not 0.0 <= acceptance <= 1.0 or allotted < 0 or round_s <= 0 or draft_s_per_token < 0 or verify_s_per_token < 0:
        raise ValueError("need acceptance in [0, 1], allotted >= 0, round_s > 0 and non-negative per-token times")
    lengths = np.arange(allotted + 1)
    rate = expected_goodput(acceptance, lengths) / (lengths * (draft_s_per_token + verify_s_per_token) + round_s)
    return int(np.argmax(rate))


def paying_batch_lengths(acceptance, allotted: int, step_s: float, verify_s_per_token: float,
                         draft_s_per_step: float, credit=None, floor: float = 0.0) -> list[int]:
    """A batch's draft lengths with the most expected tokens per second: each request ``i`` with
    acceptance ``a_i`` drafts ``S_i <= allotted``, its ``s``-th token accepted with probability
    ``a_i^s`` (:func:`paying_lengths` with those paths, ``credit`` and ``floor``).

    >>> paying_batch_lengths([0.9, 0.1], 4, step_s=0.03, verify_s_per_token=0.002, draft_s_per_step=0.0)
    [4, 0]
    """
    a = [float(x) for x in acceptance]
    if any(not 0.0 <= x <= 1.0 for x in a) or allotted < 0:
        raise ValueError("need acceptances in [0, 1] and allotted >= 0")
    return paying_lengths(acceptance_paths(a, allotted), step_s, verify_s_per_token, draft_s_per_step, credit, floor)


def acceptance_paths(acceptance, allotted: int) -> list[list[float]]:
    """Each request's chance of its ``s``-th drafted token being taken, ``a^s`` for ``s <= allotted``."""
    return [[float(x) ** s for s in range(1, allotted + 1)] for x in acceptance]


def paying_lengths(paths, step_s: float, verify_s_per_token: float, draft_s_per_step: float,
                   credit=None, floor: float = 0.0) -> list[int]:
    """A batch's draft lengths with the most expected tokens per second, where request ``i`` may
    draft up to ``len(paths[i])`` tokens, its ``s``-th accepted (with the ones before it) with
    probability ``paths[i][s-1]`` (non-increasing in ``s``): a lookup's proposal at its evidence's
    acceptance, behind tokens a grammar forces (probability 1). A step costs ``step_s +
    verify_s_per_token * sum_i S_i + draft_s_per_step * max_i S_i`` (the draft model drafts the
    batch together, one forward a step) and yields ``sum_i (1 + sum_{s <= S_i} paths[i][s-1])``
    tokens. For each longest length ``m``, the best set of ``n`` units is the ``n`` largest gains
    (``s <= m``; a request's gains fall with ``s``, so each takes a prefix), and the best ``n`` is
    read off all of them; the best ``m`` wins (ties: the shorter). ``S = 0`` for all where nothing
    pays.

    ``floor > 0`` keeps every request at least that fraction of plain decoding's pace (one token a
    ``step_s``) over its life: ``credit[i]`` is how many tokens request ``i`` is ahead of it so
    far (the tokens it got, less ``floor`` times the steps it waited on, each in
    :func:`plain_steps`), and a set of lengths is taken only if every request is expected to stay
    ahead after this step, ``credit[i] + 1 + g_i >= floor * cost / step_s`` with ``g_i`` its
    expected accepted tokens: another request's drafts may slow a request that drafts little only
    by what it has gained before (or ``1 - floor`` of a step a step). Among the same candidates
    as above (exact where the best of all keeps every request ahead, or where the request held
    back cannot gain from drafting itself), the best that keeps every request ahead wins; where
    none does, nothing is drafted (a request behind after a step that lost regains ``1 - floor``
    a plain step).

    >>> paying_lengths([[1.0, 1.0, 0.2], [0.9, 0.8], []], step_s=0.03, verify_s_per_token=0.002, draft_s_per_step=0.0)
    [2, 2, 0]
    >>> paying_lengths([[1.0, 1.0, 0.2], [0.9, 0.8], []], 0.03, 0.002, 0.0, credit=[0, 0, 0.25], floor=1.0)
    [2, 1, 0]
    """
    p = [[float(x) for x in path] for path in paths]
    if (any(not 0.0 <= x <= 1.0 for path in p for x in path) or any(b > a for path in p for a, b in zip(path, path[1:]))
            or step_s <= 0 or verify_s_per_token < 0 or draft_s_per_step < 0):
        raise ValueError("need paths of non-increasing probabilities in [0, 1], step_s > 0 and non-negative per-token times")
    if not 0.0 <= floor <= 1.0:
        raise ValueError(f"floor must lie in [0, 1], got {floor}")
    ahead = None
    if floor > 0:
        ahead = np.zeros(len(p)) if credit is None else np.asarray(credit, dtype=np.float64)
        if ahead.shape != (len(p),) or not np.isfinite(ahead).all():
            raise ValueError("credit needs one finite number a path")
    best, best_rate = [0] * len(p), len(p) / step_s
    for longest in range(1, max(map(len, p), default=0) + 1):
        units = sorted(((g, i) for i, path in enumerate(p) for g in path[:longest]), key=lambda u: (-u[0], u[1]))
        gains = np.cumsum([g for g, _ in units])
        counts = np.arange(1, len(units) + 1)
        costs = step_s + draft_s_per_step * longest + verify_s_per_token * counts
        rates = (len(p) + gains) / costs
        if ahead is not None:  # each request's expected tokens after each prefix of the units, against the floor
            mine = np.zeros((len(units), len(p)))
            mine[np.arange(len(units)), [i for _, i in units]] = [g for g, _ in units]
            kept = (ahead + 1.0 + np.cumsum(mine, axis=0) >= floor * costs[:, None] / step_s - 1e-12).all(axis=1)
            rates = np.where(kept, rates, -np.inf)
        n = int(np.argmax(rates)) + 1
        if rates[n - 1] > best_rate:
            lengths = [0] * len(p)
            for _, i in units[:n]:
                lengths[i] += 1
            best, best_rate = lengths, float(rates[n - 1])
    return best


def plain_steps(lengths, step_s: float, verify_s_per_token: float, draft_s_per_step: float) -> float:
    """A step drafting ``lengths`` in steps of plain decoding (``step_s``, nothing drafted): what
    it costs each request waiting on it, against which :func:`paying_lengths`' ``floor`` weighs
    the tokens it brings.

    >>> plain_steps([2, 0], 0.03, 0.003, 0.0)
    1.2
    """
    return (step_s + verify_s_per_token * sum(lengths) + draft_s_per_step * max(lengths, default=0)) / step_s


def probe_wait(misses: int, probe_every: int, max_probe_every: int) -> int:
    """Rounds at S = 0 before a probe: ``probe_every``, doubled for each rejected probe in a row
    (``misses``), at most ``max_probe_every``."""
    return min(probe_every << min(misses, 30), max_probe_every)


OUTLIER_RATIO = 4.0  # rounds slower than this many times the window's median stay out of the round-time fit
PRIOR_WEIGHT = 2.0  # verdicts' worth of the pooled acceptance a new request starts with
POOLED_DECAY = 0.95  # the pooled counts' decay a verdict (its memory: some 20 verdicts)


@dataclass
class _Acceptance:
    accepted: float = 1.0  # a prior of one accepted token and one rejection: a = 0.5 before any verdict
    rejected: float = 1.0
    idle_rounds: int = 0  # rounds in a row at S = 0
    misses: int = 0  # probes in a row whose token was rejected
    probing: bool = False  # the last length given was a probe, its verdict not yet heard

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


@dataclass
class PayingLength:
    """The estimates :func:`paying_draft_length` reads, kept from a drafter's own rounds."""

    decay: float = 0.8  # weight of the past in a request's acceptance counts, per round
    smoothing: float = 0.2  # weight of a new sample in the drafting time's mean
    default_verify_ratio: float = 0.03  # t_verify / t_round until the rounds' lengths let it be fitted
    window: int = 64  # rounds the round-time fit reads
    probe_every: int = 8  # a request at S = 0 drafts one token after this many rounds
    max_probe_every: int = 64  # the longest wait, after rejected probes have doubled it
    draft_s_per_token: float = 0.0
    _rounds: deque = field(init=False)  # (drafted, round seconds, longest chain) of the last ``window`` rounds
    _requests: dict = field(default_factory=dict)
    _pooled: _Acceptance = field(default_factory=_Acceptance)  # every request's verdicts, decayed slowly

    def __post_init__(self) -> None:
        if not (0 <= self.decay < 1 and 0 < self.smoothing <= 1 and self.default_verify_ratio >= 0 and self.window >= 2
                and 1 <= self.probe_every <= self.max_probe_every):
            raise ValueError("PayingLength needs decay in [0, 1), smoothing in (0, 1], default_verify_ratio >= 0, "
                             "window >= 2 and 1 <= probe_every <= max_probe_every")
        self._rounds = deque(maxlen=self.window)

    def forget(self, request: Hashable) -> None:
        self._requests.pop(request, None)

    def acceptance(self, request: Hashable) -> float:
        return self._state(request).rate

    def _state(self, request: Hashable) -> _Acceptance:
        """A request's counts; a new one starts from the drafter's pooled acceptance (its recent
        requests', as :data:`PRIOR_WEIGHT` verdicts), so a request whose text is like the last
        ones' does not begin by over-drafting."""
        state = self._requests.get(request)
        if state is None:
            rate = self._pooled.rate
            state = self._requests[request] = _Acceptance(PRIOR_WEIGHT * rate, PRIOR_WEIGHT * (1.0 - rate))
        return state

    def round_costs(self) -> tuple[float, float] | None:
        """``(t_round, t_verify)`` from the recent rounds; None before any."""
        if not self._rounds:
            return None
        s, t, _ = self._samples()
        return self._fit_tokens(s, t)

    def _fit_tokens(self, s: np.ndarray, t: np.ndarray) -> tuple[float, float]:
        if (var := float(s.var())) >= 0.5 and len(set(s.tolist())) >= 3:  # least squares, in closed form
            slope = float(((s - s.mean()) * (t - t.mean())).mean()) / var
            intercept = float(t.mean()) - slope * float(s.mean())
            if intercept > 0:
                return float(intercept), float(max(0.0, slope))
        base = float(t.mean()) / (1.0 + self.default_verify_ratio * float(s.mean()))
        return base, self.default_verify_ratio * base

    def batch_costs(self) -> tuple[float, float, float] | None:
        """``(t_round, t_verify, t_longest)`` for a batch's step, whose time grows with the tokens
        drafted in all (``t_verify`` each) and with its longest chain (``t_longest`` a token: the
        attention of the longest row's queries, which the shorter rows' group pads to or splits
        off): least squares on both over recent rounds once they vary apart (four distinct pairs),
        else :meth:`round_costs` with ``t_longest = 0``; None before any round."""
        if not self._rounds:
            return None
        s, t, longest = self._samples()
        if len(set(zip(s.tolist(), longest.tolist()))) >= 4:
            x = np.stack([np.ones_like(s), s, longest], axis=1)
            coef, _, rank, _ = np.linalg.lstsq(x, t, rcond=None)
            if rank == 3 and coef[0] > 0 and coef[1] >= 0 and coef[2] >= 0:
                return float(coef[0]), float(coef[1]), float(coef[2])
        return (*self._fit_tokens(s, t), 0.0)

    def _samples(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The recent rounds' drafted tokens, seconds and longest chains, rounds over
        :data:`OUTLIER_RATIO` times the median left out (a cold shape's first run, a GC pause, the OS)."""
        rounds = np.array(self._rounds, dtype=np.float64)
        s, t, longest = rounds[:, 0], rounds[:, 1], rounds[:, 2]
        usual = t <= OUTLIER_RATIO * float(np.median(t))
        return s[usual], t[usual], longest[usual]

    def length(self, request: Hashable, allotted: int) -> int:
        """The length to draft for ``request`` this round, at most ``allotted``."""
        costs = self.round_costs()
        if costs is None or allotted <= 0:
            return allotted
        best = paying_draft_length(self.acceptance(request), allotted, self.draft_s_per_token, costs[0], costs[1])
        return self.probed(request, best)

    def probed(self, request: Hashable, length: int) -> int:
        """``length``, or 1 where the request has drafted nothing for its probe wait:
        ``probe_every`` rounds, doubled for each rejected probe in a row, at most
        ``max_probe_every``."""
        state = self._state(request)
        if length:
            state.idle_rounds = state.misses = 0
            return length
        state.idle_rounds += 1
        if state.idle_rounds >= probe_wait(state.misses, self.probe_every, self.max_probe_every):
            state.idle_rounds, state.probing, length = 0, True, 1
        return length

    def idle_run(self, request: Hashable) -> int:
        """After :meth:`length` gave ``request`` 0: how many rounds in a row, this one included,
        it drafts nothing before its probe is due; they are counted as idle now (a drafter that
        lets the verifier decode them by itself, ``decode_ahead``, drafts its probe right after).

        >>> p = PayingLength(probe_every=8)
        >>> [p.probed("r", 0) for _ in range(3)], p.idle_run("r"), p.probed("r", 0)
        ([0, 0, 0], 5, 1)
        """
        state = self._state(request)
        run = max(1, probe_wait(state.misses, self.probe_every, self.max_probe_every) - state.idle_rounds)
        state.idle_rounds += run - 1
        return run

    def observe_round(self, request: Hashable, drafted: int, accepted: int, round_s: float, longest: int | None = None) -> None:
        """A verdict: ``accepted`` of ``drafted`` tokens taken; ``round_s`` from sending the draft to
        the verdict. ``longest``: for a batch's step, its longest chain (default: ``drafted``, one
        chain)."""
        if drafted > 0:
            own = self._state(request)
            if own.probing:
                own.misses, own.probing = (own.misses + 1 if accepted == 0 else 0), False
            for state, decay in ((own, self.decay), (self._pooled, POOLED_DECAY)):
                state.accepted = decay * state.accepted + accepted
                state.rejected = decay * state.rejected + (accepted < drafted)
        if math.isfinite(round_s) and round_s > 0:
            self._rounds.append((drafted, round_s, drafted if longest is None else longest))

    def observe_drafting(self, seconds: float, steps: int) -> None:
        """A drafting call of ``steps`` sequential draft steps (its longest draft) took ``seconds``."""
        if steps > 0 and math.isfinite(seconds) and seconds >= 0:
            per = seconds / steps
            w = self.smoothing if self.draft_s_per_token else 1.0
            self.draft_s_per_token = w * per + (1 - w) * self.draft_s_per_token


@dataclass
class EvidenceAcceptance:
    """Acceptance of a lookup's drafts by the evidence behind each proposal: the length of the
    context it matched (:attr:`goodspeed.lm.decoding.proposals.ChainDraft.evidence`). A lookup
    proposing after one matched token is taken far less often than one after eight, on the same
    request (prompt lookup and suffix drafting alike), so one acceptance a request over-drafts weak
    matches and under-drafts strong ones. Each evidence class (match lengths above
    ``max_evidence`` share one) keeps counts pooled over every request (decayed by
    :data:`POOLED_DECAY` a verdict) and each request its own on top (decayed by ``decay``,
    starting from the pool's rate as :data:`PRIOR_WEIGHT` verdicts). A class proposed but drafted
    by no request gets a one-token probe after ``probe_every`` steps, the wait doubled by each
    rejected probe in a row (at most ``max_probe_every``), so a class that starts paying again
    is heard."""

    decay: float = 0.8
    max_evidence: int = 8
    probe_every: int = 8
    max_probe_every: int = 64
    _pools: dict = field(default_factory=dict)  # class -> _Acceptance over every request
    _requests: dict = field(default_factory=dict)  # request -> {class: _Acceptance}

    def __post_init__(self) -> None:
        if not (0 <= self.decay < 1 and self.max_evidence >= 0 and 1 <= self.probe_every <= self.max_probe_every):
            raise ValueError("EvidenceAcceptance needs decay in [0, 1), max_evidence >= 0 and "
                             "1 <= probe_every <= max_probe_every")

    def bucket(self, evidence: int) -> int:
        return max(0, min(int(evidence), self.max_evidence))

    def rate(self, request: Hashable, evidence: int) -> float:
        """The chance the target takes each drafted token of ``request``'s proposal backed by
        ``evidence``, given it took the ones before."""
        return self._state(request, self.bucket(evidence)).rate

    def _pool(self, b: int) -> _Acceptance:
        return self._pools.setdefault(b, _Acceptance())

    def _state(self, request: Hashable, b: int) -> _Acceptance:
        mine = self._requests.setdefault(request, {})
        state = mine.get(b)
        if state is None:
            rate = self._pool(b).rate
            state = mine[b] = _Acceptance(PRIOR_WEIGHT * rate, PRIOR_WEIGHT * (1.0 - rate))
        return state

    def due_probes(self, drafting, idle) -> set[int]:
        """One step's probes: ``drafting`` the evidence of the proposals drafted (their classes'
        waits reset), ``idle`` that of proposals given no tokens; returns the idle classes whose
        wait is over (each gets one probe token this step)."""
        drafting = {self.bucket(e) for e in drafting}
        due = set()
        for b in drafting:
            pool = self._pool(b)
            pool.idle_rounds = pool.misses = 0
        for b in {self.bucket(e) for e in idle} - drafting:
            pool = self._pool(b)
            pool.idle_rounds += 1
            if pool.idle_rounds >= probe_wait(pool.misses, self.probe_every, self.max_probe_every):
                pool.idle_rounds = 0
                due.add(b)
        return due

    def paths(self, proposals) -> list[list[float]]:
        """For each proposal ``(request, evidence, forced, length)``, the chance of each of its
        tokens being taken: 1 for the ``forced`` ones a grammar forces, then its evidence's
        :meth:`rate` to the power of each looked-up token's place."""
        return [[1.0] * forced + [self.rate(request, evidence) ** j for j in range(1, length - forced + 1)]
                for request, evidence, forced, length in proposals]

    def keep(self, proposals, step_s: float, verify_s_per_token: float, longest_s_per_token: float,
             credit=None, floor: float = 0.0) -> list[tuple[int, bool]]:
        """For each proposal ``(request, evidence, forced, length)`` (a lookup's draft of ``length``
        tokens, its first ``forced`` forced by a grammar): how many of its tokens to keep, and
        whether that is a probe. The kept prefixes are those with the most expected tokens a
        second (:func:`paying_lengths` over :meth:`paths`, with its ``credit`` and ``floor``; a
        step costs ``step_s``, ``verify_s_per_token`` a kept token and ``longest_s_per_token`` a
        token of the longest); a proposal that keeps none of its
        looked-up tokens keeps one where its class is due a probe (:meth:`due_probes`, one a class)."""
        chosen = paying_lengths(self.paths(proposals), step_s, verify_s_per_token, longest_s_per_token, credit, floor)
        looked = [(evidence, forced, length, n) for (_, evidence, forced, length), n in zip(proposals, chosen)]
        due = self.due_probes([e for e, f, _, n in looked if n > f],
                              [e for e, f, length, n in looked if n <= f < length])
        kept = []
        for evidence, forced, length, n in looked:
            probe = n <= forced < length and self.bucket(evidence) in due
            if probe:
                due.discard(self.bucket(evidence))
                n = forced + 1
            kept.append((n, probe))
        return kept

    def paying_from(self, request: Hashable, length: int, step_s: float, verify_s_per_token: float,
                    longest_s_per_token: float) -> int:
        """The shortest match (evidence, 1..``max_evidence``) from which a lookup of ``length``
        tokens backed by it, or by any longer match, would be drafted for ``request`` now by
        :meth:`keep` (probes aside), 0 where the longest class would not: what a node decoding
        ahead waits for (``decode_ahead_until_match``). For one proposal :func:`paying_lengths`
        keeps some tokens iff some ``s`` has ``(1 + sum_{j<=s} a^j) / (step_s + (verify_s_per_token
        + longest_s_per_token) s) > 1 / step_s``; that is checked for every class at once."""
        if length <= 0:
            return 0
        rates = np.array([self.rate(request, e) for e in range(1, self.max_evidence + 1)])[:, None]
        s = np.arange(1, length + 1)
        gains = np.cumsum(rates ** s, axis=1)  # [class, s]: expected tokens taken of the first s
        pays = ((1.0 + gains) / (step_s + (verify_s_per_token + longest_s_per_token) * s) > 1.0 / step_s).any(axis=1)
        if not pays[-1]:
            return 0
        first = len(pays)
        while first > 0 and pays[first - 1]:
            first -= 1
        return first + 1

    def observe(self, request: Hashable, evidence: int, drafted: int, accepted: int, probe: bool = False) -> None:
        """A verdict on ``drafted`` looked-up tokens backed by ``evidence`` (tokens a grammar forced
        before them aside): ``accepted`` of them taken. ``probe``: the draft was a probe."""
        if drafted <= 0:
            return
        b = self.bucket(evidence)
        own, pool = self._state(request, b), self._pool(b)
        if probe:
            pool.misses = pool.misses + 1 if accepted == 0 else 0
        for state, decay in ((own, self.decay), (pool, POOLED_DECAY)):
            state.accepted = decay * state.accepted + accepted
            state.rejected = decay * state.rejected + (accepted < drafted)

    def forget(self, request: Hashable) -> None:
        self._requests.pop(request, None)
