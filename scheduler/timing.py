"""Time-aware GoodSpeed: the log utility of each drafter's goodput in tokens per SECOND.

GoodSpeed's eq. (5) (arXiv 2512.09963, Section III) maximises the gradient of
``sum_i log X_i`` — ``X_i`` tokens per *round* — over the rounds a budget ``C`` allows. That is
right for the paper's lockstep round, which lasts the same for everyone. When drafters run at
their own cadence (``--rounds async``, :mod:`goodspeed.verifier.round_loop`), a round of drafter
``i`` lasts its own period, and what a user sees is tokens per second.

**Model.** Drafter ``i``'s period — the seconds between two of its verdicts: its link's round
trip, its fixed overheads and the verification step, plus drafting ``S`` tokens — is affine in
its draft length::

    P_i(S) = a_i + b_i * S

and its expected tokens per round are eq. (5)'s ``xhat_i(S) = (1 - alpha_i^(S+1)) / (1 - alpha_i)``,
so its rate is ``r_i(S) = xhat_i(S) / P_i(S)`` tokens per second.

**Allocation (the gradient-scheduling argument of the paper, Section III-B, in rates).** The
utility is ``U = sum_i log R_i``, ``R_i`` the drafter's smoothed tokens per second. Gradient
scheduling picks, each time, the achievable rate vector with the largest projection on
``grad U``, ``dU/dR_i = 1/R_i``. The achievable rates are those of draft lengths the verifier
accepts: ``sum_i S_i <= C`` (the budget bounds the draft tokens outstanding, hence every
verification step) and ``0 <= S_i <= cap_i``. So::

    maximize  sum_i r_i(S_i) / R_i  =  sum_i  (Pbar_i / X_i) * xhat_i(S_i) / P_i(S_i)
    s.t.      sum_i S_i <= C,  0 <= S_i <= cap_i,  S_i integer

with ``R_i = X_i / Pbar_i`` (eq. 4's tokens per round over the smoothed period ``Pbar_i``).

**It reduces to the paper's rule** when no drafter's period depends on its draft length
(``b_i = 0``: then ``P_i(S) = Pbar_i`` and each term is ``xhat_i(S_i) / X_i``, eq. 5 exactly),
whatever each drafter's latency ``a_i``: log utility is scale-free per drafter, so a slow link
alone does not change anyone's share. What changes it is the *price of a drafted token in time*:
a drafter whose tokens take long to draft (large ``b_i`` relative to ``a_i``) loses more rate per
extra token than eq. 5 assumes, and the budget moves to drafters whose tokens are cheap.

**Solving it.** Each term ``f_i(S) = w_i g(S) / h(S)``, ``g = xhat_i`` and ``h = a_i + b_i S``, is
separable but, unlike eq. 5's, not concave in ``S``: past its peak it falls like ``1/S``, a convex
tail. It is concave wherever it rises, though. With ``h'' = 0``,
``f'' = (w g'' - 2 b_i f') / h``, and ``g'' <= 0`` (``xhat`` is concave), so ``f' >= 0`` gives
``f'' <= 0``; the same identity shows ``f'`` changes sign at most once, from + to -. Hence a unit
that pays (gain ``f(S+1) - f(S) > 0``) lies where ``f`` rises and gains no more than the unit
before it (``f(S+2) - f(S+1) <= f'(S+1) <= f(S+1) - f(S)``), and no unit past the peak pays. Units
are therefore granted to the largest positive marginal gains, which is exactly optimal. When
rounding leaves two paying units of a term out of order, a dynamic programme over the budget
(one ``cap x C`` array step per drafter) solves the computed values exactly instead.
Both are tested against exhaustive search (``tests/scheduler/test_timing.py``).

**Estimating the period online** (:class:`PeriodEstimator`): exponentially weighted least squares
of observed periods on draft lengths, smoothed like eqs. (3)-(4) (weight ``gamma`` on the newest
observation): ``b_i = max(0, cov(S, P) / var(S))`` once the draft lengths varied (else the last
slope, initially 0, which is eq. 5), ``a_i = mean(P) - b_i * mean(S)``, ``Pbar_i = mean(P)``.
The verifier measures the periods itself (:mod:`goodspeed.verifier.round_loop`): a client cannot
report a flattering one.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from goodspeed.scheduler.goodspeed import _validated_inputs, allocate_draft_lengths, expected_goodput

MIN_SLOPE_VARIANCE = 0.25  # tokens^2: below this the draft lengths did not vary enough to fit a slope


@dataclass
class PeriodFit:
    """One drafter's period model ``P(S) = base + per_token * S`` and its smoothed mean ``mean``."""

    base: float
    per_token: float
    mean: float
    observations: int


@dataclass
class _Moments:
    s: float = 0.0
    p: float = 0.0
    ss: float = 0.0
    sp: float = 0.0
    n: int = 0
    slope: float = 0.0


class PeriodEstimator:
    """Exponentially weighted least squares of each drafter's period on its draft length."""

    def __init__(self, gamma: float = 0.1) -> None:
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"gamma must lie in (0, 1], got {gamma}")
        self.gamma = gamma
        self._clients: dict[Hashable, _Moments] = {}

    def leave(self, client_id: Hashable) -> None:
        self._clients.pop(client_id, None)

    def observe(self, client_id: Hashable, draft_length: int, period_s: float) -> None:
        if draft_length < 0 or not np.isfinite(period_s) or period_s <= 0:
            raise ValueError(f"need draft_length >= 0 and a finite period > 0, got {draft_length}, {period_s}")
        m = self._clients.setdefault(client_id, _Moments())
        s, p = float(draft_length), float(period_s)
        # The first observation is taken whole (no prior period to shrink towards).
        g = 1.0 if m.n == 0 else max(self.gamma, 1.0 / (m.n + 1))
        m.s += g * (s - m.s)
        m.p += g * (p - m.p)
        m.ss += g * (s * s - m.ss)
        m.sp += g * (s * p - m.sp)
        m.n += 1
        var = m.ss - m.s * m.s
        if var >= MIN_SLOPE_VARIANCE:
            m.slope = max(0.0, (m.sp - m.s * m.p) / var)

    def fit(self, client_id: Hashable) -> PeriodFit | None:
        """The drafter's period model, or None before its first observation."""
        m = self._clients.get(client_id)
        if m is None or m.n == 0:
            return None
        base = max(m.p - m.slope * m.s, 1e-9)
        return PeriodFit(base, m.slope, m.p, m.n)


def _values(acceptance, goodput, base, per_token, mean, caps) -> np.ndarray:
    """``f_i(S) = (Pbar_i / X_i) * xhat_i(S) / (a_i + b_i S)`` for ``S = 0..max cap`` (``[N, cap+1]``)."""
    s = np.arange(int(caps.max(initial=0)) + 1, dtype=np.float64)
    xhat = expected_goodput(acceptance[:, None], s[None, :])
    return (mean / goodput)[:, None] * xhat / (base[:, None] + per_token[:, None] * s[None, :])


def time_aware_objective(acceptance, goodput, base, per_token, mean, draft_lengths) -> float:
    """The quantity :func:`allocate_time_aware` maximises, for given draft lengths."""
    a, x = np.asarray(acceptance, dtype=np.float64), np.asarray(goodput, dtype=np.float64)
    s = np.asarray(draft_lengths, dtype=np.float64)
    b0, b1, pm = (np.asarray(v, dtype=np.float64) for v in (base, per_token, mean))
    return float(np.sum((pm / x) * expected_goodput(a, s) / (b0 + b1 * s)))


def allocate_time_aware(acceptance, goodput, base, per_token, mean, budget: int, max_lengths=None,
                        min_lengths=None) -> np.ndarray:
    """The time-aware allocation (module docstring): exact, ``min_lengths[i] <= S_i <= cap_i``.

    ``base``, ``per_token``, ``mean``: each drafter's :class:`PeriodFit` (seconds). With every
    ``per_token == 0`` and no lower bounds this is :func:`allocate_draft_lengths` (eq. 5) itself.
    """
    a, x, budget, caps = _validated_inputs(acceptance, goodput, budget, max_lengths)
    b0, b1, pm = (np.asarray(v, dtype=np.float64).reshape(-1) for v in (base, per_token, mean))
    if not (b0.shape == b1.shape == pm.shape == a.shape):
        raise ValueError("base, per_token and mean need one entry per drafter")
    if np.any(~np.isfinite(b0) | (b0 <= 0)) or np.any(~np.isfinite(b1) | (b1 < 0)) or np.any(~np.isfinite(pm) | (pm <= 0)):
        raise ValueError("periods must be finite: base > 0, per_token >= 0, mean > 0")
    lo = np.zeros(a.shape, dtype=np.int64) if min_lengths is None else np.minimum(np.asarray(min_lengths, dtype=np.int64), caps)
    if np.any(lo < 0) or int(lo.sum()) > budget:
        raise ValueError("min_lengths must be >= 0 and fit the budget together")
    if a.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.any(b1 > 0) and not np.any(lo > 0):
        return allocate_draft_lengths(a, x, budget, caps)
    values = _values(a, x, b0, b1, pm, caps)
    gains = np.diff(values, axis=1)  # gains[i, s]: unit s + 1
    s_idx = np.arange(gains.shape[1])
    usable = (s_idx[None, :] < caps[:, None])
    if _paying_units_in_order(gains, usable):
        return _greedy(gains, usable, lo, budget)
    return _dynamic(values, lo, caps, budget)


def _paying_units_in_order(gains: np.ndarray, usable: np.ndarray) -> bool:
    """Every unit that pays gains no more than the unit before it: the greedy is exact (module
    docstring). True in exact arithmetic; rounding can break it, and then the caller runs the
    dynamic programme."""
    if gains.shape[1] < 2:
        return True
    later = gains[:, 1:]
    checked = usable[:, 1:] & usable[:, :-1] & (later > 0)
    return bool(np.all(~checked | (later <= gains[:, :-1] + 1e-15)))


def _greedy(gains: np.ndarray, usable: np.ndarray, lo: np.ndarray, budget: int) -> np.ndarray:
    """Concave terms: the lower bounds, then the largest positive marginal gains (stable order)."""
    s_idx = np.arange(gains.shape[1])
    free = usable & (s_idx[None, :] >= lo[:, None]) & (gains > 0)
    client, unit = np.nonzero(free)
    order = np.argsort(-gains[client, unit], kind="stable")[: budget - int(lo.sum())]
    return lo + np.bincount(client[order], minlength=lo.size).astype(np.int64)


def _dynamic(values: np.ndarray, lo: np.ndarray, caps: np.ndarray, budget: int) -> np.ndarray:
    """Any terms: ``best[c]`` = the best objective of the drafters so far using ``c`` units, one
    array step per drafter over all its lengths at once; equal objectives keep the shorter draft."""
    n = values.shape[0]
    units = np.arange(budget + 1)
    best = np.full(budget + 1, -np.inf)
    best[0] = 0.0
    choice = np.zeros((n, budget + 1), dtype=np.int64)
    for i in range(n):
        lengths = np.arange(int(lo[i]), int(caps[i]) + 1)
        before = units[None, :] - lengths[:, None]  # [lengths, budget + 1]: units left for the others
        cand = np.where(before >= 0, best[np.maximum(before, 0)] + values[i, lengths][:, None], -np.inf)
        pick = np.argmax(cand, axis=0)  # the first maximum: the shortest draft among equals
        best = cand[pick, units]
        choice[i] = lengths[pick]
    c = int(np.argmax(best))
    out = np.zeros(n, dtype=np.int64)
    for i in range(n - 1, -1, -1):
        out[i] = choice[i, c]
        c -= out[i]
    return out
