"""Time-aware GoodSpeed: the log utility of each drafter's goodput in tokens per SECOND.

GoodSpeed's eq. (5) (seeds 003_e4f9b92fd7e1d2ba, Section III) maximises the gradient of
``sum_i log X_i`` — ``X_i`` tokens per *round* — over the rounds a budget ``C`` allows. That is
right for the paper's lockstep round, which lasts the same for everyone. When drafters run at
their own cadence (``--rounds async``, :mod:`goodspeed.verifier.round_loop`), a round of drafter
``i`` lasts its own period, and what a user sees is tokens per second.

**Model.** Drafter ``i``'s period — the seconds between two of its verdicts: its link's round
trip, its fixed overheads and the verification step, plus drafting ``S`` tokens — is affine in
its draft length, with a step at ``S = 0``::

    P_i(S) = a_i + c_i * [S > 0] + b_i * S

``c_i`` is what drafting at all costs beyond one token's share: a drafter that drafts runs its
model over the last verdict's tokens first, and one that drafts nothing runs no forward. In one
run of the demo drafters (docs/EXPERIMENTS.md, *Planned shares*), a 2 ms link's first drafted
token cost 4.8 ms and each further one about 2.2 ms; a plain line fitted through lengths 0 and 1,
where such a drafter was then kept, priced every token at the first one's cost.

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
(``b_i = c_i = 0``: then ``P_i(S) = Pbar_i`` and each term is ``xhat_i(S_i) / X_i``, eq. 5 exactly),
whatever each drafter's latency ``a_i``: log utility is scale-free per drafter, so a slow link
alone does not change anyone's share. What changes it is the *price of a drafted token in time*:
a drafter whose tokens take long to draft (large ``b_i`` relative to ``a_i``) loses more rate per
extra token than eq. 5 assumes, and the budget moves to drafters whose tokens are cheap.

**Solving it.** Each term ``f_i(S) = w_i g(S) / h(S)``, ``g = xhat_i`` and ``h = a_i + b_i S``
(``c_i = 0``), is separable but, unlike eq. 5's, not concave in ``S``: past its peak it falls like
``1/S``, a convex tail. It is concave wherever it rises, though. With ``h'' = 0``,
``f'' = (w g'' - 2 b_i f') / h``, and ``g'' <= 0`` (``xhat`` is concave), so ``f' >= 0`` gives
``f'' <= 0``; the same identity shows ``f'`` changes sign at most once, from + to -. Hence a unit
that pays (gain ``f(S+1) - f(S) > 0``) lies where ``f`` rises and gains no more than the unit
before it (``f(S+2) - f(S+1) <= f'(S+1) <= f(S+1) - f(S)``), and no unit past the peak pays. Units
are therefore granted to the largest positive marginal gains, which is exactly optimal. A step
``c_i > 0`` keeps that from ``S = 1`` on (``h`` is affine there) but can make the first unit gain
less than the second: a drafter may be worth 0 or several tokens and not 1. The drafters whose
paying units are out of order (a step, or rounding) go to a dynamic programme over the budget (one
``cap x C`` array step per such drafter); the others' greedy units are pooled into one concave
value of the units they get, and the budget is split between the two where the sum is best. That
is exact for any terms, and costs a dynamic programme only for the drafters that need one. Both
paths are tested against exhaustive search (``tests/scheduler/test_timing.py``).

**Estimating the period online** (:class:`PeriodEstimator`): exponentially weighted least squares
of observed periods on the draft length ``S`` and the step ``I = [S > 0]``, smoothed like eqs.
(3)-(4) (weight ``gamma`` on the newest observation), ``Pbar_i = mean(P)``:

* both ``b_i`` and ``c_i`` from the two-regressor normal equations when both are identified: ``I``
  varied (lengths 0 and > 0 both seen) and ``S`` varied beyond what ``I`` explains (two different
  positive lengths); a coefficient that comes out negative is set to 0 and the other refitted alone;
* only ``b_i`` when ``I`` did not vary (``c_i`` keeps its last value, initially 0);
* only ``c_i`` when ``S`` did not vary beyond ``I`` (lengths 0 and one other): ``b_i`` keeps its
  last value, initially 0, so a drafter seen only at lengths 0 and 1 has the jump priced as the cost
  of drafting at all, not of every token, and the allocation may try it longer, which identifies
  ``b_i``;
* ``a_i = mean(P) - b_i * mean(S) - c_i * mean(I)``.
The verifier measures the periods itself (:mod:`goodspeed.verifier.round_loop`): a client cannot
report a flattering one.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from goodspeed.scheduler.goodspeed import _validated_inputs, allocate_draft_lengths, expected_goodput

MIN_SLOPE_VARIANCE = 0.25  # tokens^2: below this the draft lengths did not vary enough to fit a slope
MIN_STEP_VARIANCE = 0.01  # var([S > 0]): below this lengths 0 and > 0 were not both seen enough to fit a step


@dataclass
class PeriodFit:
    """One drafter's period model ``P(S) = base + first * [S > 0] + per_token * S`` and its smoothed
    mean ``mean``."""

    base: float
    per_token: float
    mean: float
    observations: int
    first: float = 0.0


class PeriodArrays(NamedTuple):
    """Several drafters' :class:`PeriodFit` as arrays (seconds), as the policies read them."""

    base: np.ndarray
    per_token: np.ndarray
    mean: np.ndarray
    first: np.ndarray

    def depend_on_length(self) -> bool:
        """Whether any drafter's period depends on its draft length (else the allocation is eq. 5)."""
        return bool(np.any(self.per_token > 0) or np.any(self.first > 0))


@dataclass
class _Moments:
    s: float = 0.0  # weighted means of S, I = [S > 0], P and their products
    i: float = 0.0
    p: float = 0.0
    ss: float = 0.0
    si: float = 0.0
    sp: float = 0.0
    ip: float = 0.0
    n: int = 0
    slope: float = 0.0
    first: float = 0.0


class PeriodEstimator:
    """Exponentially weighted least squares of each drafter's period on its draft length and on
    whether it drafted at all (module docstring)."""

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
        i = 1.0 if draft_length > 0 else 0.0
        # The first observation is taken whole (no prior period to shrink towards).
        g = 1.0 if m.n == 0 else max(self.gamma, 1.0 / (m.n + 1))
        m.s += g * (s - m.s)
        m.i += g * (i - m.i)
        m.p += g * (p - m.p)
        m.ss += g * (s * s - m.ss)
        m.si += g * (s * i - m.si)
        m.sp += g * (s * p - m.sp)
        m.ip += g * (i * p - m.ip)
        m.n += 1
        _refit(m)

    def fit(self, client_id: Hashable) -> PeriodFit | None:
        """The drafter's period model, or None before its first observation."""
        m = self._clients.get(client_id)
        if m is None or m.n == 0:
            return None
        base = max(m.p - m.slope * m.s - m.first * m.i, 1e-9)
        return PeriodFit(base, m.slope, m.p, m.n, m.first)


def _refit(m: _Moments) -> None:
    """The slope and the step from the moments, each only where the data identify it (module
    docstring); what is not identified keeps its last value."""
    var_s, var_i = m.ss - m.s * m.s, m.i - m.i * m.i
    cov_si, cov_sp, cov_ip = m.si - m.s * m.i, m.sp - m.s * m.p, m.ip - m.i * m.p
    step_seen = var_i >= MIN_STEP_VARIANCE
    # S's variance beyond what I explains (all of it when I is constant)
    slope_seen = (var_s - cov_si * cov_si / var_i if step_seen else var_s) >= MIN_SLOPE_VARIANCE
    if step_seen and slope_seen:
        det = var_s * var_i - cov_si * cov_si
        b, c = (var_i * cov_sp - cov_si * cov_ip) / det, (var_s * cov_ip - cov_si * cov_sp) / det
        if b < 0:
            b, c = 0.0, max(0.0, cov_ip / var_i)
        elif c < 0:
            b, c = max(0.0, cov_sp / var_s), 0.0
        m.slope, m.first = b, c
    elif slope_seen:  # I constant: its part is the intercept's
        m.slope = max(0.0, (cov_sp - m.first * cov_si) / var_s)
    elif step_seen:  # lengths 0 and one other: the jump is the step's, at the last slope
        m.first = max(0.0, (cov_ip - m.slope * cov_si) / var_i)


def _check_periods(base, per_token, mean, first, n: int) -> tuple[np.ndarray, ...]:
    b0, b1, pm = (np.asarray(v, dtype=np.float64).reshape(-1) for v in (base, per_token, mean))
    c = np.zeros(n) if first is None else np.asarray(first, dtype=np.float64).reshape(-1)
    if not (b0.shape == b1.shape == pm.shape == c.shape == (n,)):
        raise ValueError("base, per_token, mean and first need one entry per drafter")
    if (np.any(~np.isfinite(b0) | (b0 <= 0)) or np.any(~np.isfinite(b1) | (b1 < 0)) or np.any(~np.isfinite(pm) | (pm <= 0))
            or np.any(~np.isfinite(c) | (c < 0))):
        raise ValueError("periods must be finite: base > 0, per_token >= 0, first >= 0, mean > 0")
    return b0, b1, pm, c


def _period(base, per_token, first, s) -> np.ndarray:
    """``P(S) = base + first * [S > 0] + per_token * S`` (broadcasting)."""
    return base + first * (s > 0) + per_token * s


def _values(acceptance, goodput, base, per_token, mean, caps, first) -> np.ndarray:
    """``f_i(S) = (Pbar_i / X_i) * xhat_i(S) / P_i(S)`` for ``S = 0..max cap`` (``[N, cap+1]``)."""
    s = np.arange(int(caps.max(initial=0)) + 1, dtype=np.float64)
    xhat = expected_goodput(acceptance[:, None], s[None, :])
    return (mean / goodput)[:, None] * xhat / _period(base[:, None], per_token[:, None], first[:, None], s[None, :])


def time_aware_objective(acceptance, goodput, base, per_token, mean, draft_lengths, first=None) -> float:
    """The quantity :func:`allocate_time_aware` maximises, for given draft lengths."""
    a, x = np.asarray(acceptance, dtype=np.float64), np.asarray(goodput, dtype=np.float64)
    s = np.asarray(draft_lengths, dtype=np.float64)
    b0, b1, pm, c = _check_periods(base, per_token, mean, first, a.size)
    return float(np.sum((pm / x) * expected_goodput(a, s) / _period(b0, b1, c, s)))


def allocate_time_aware(acceptance, goodput, base, per_token, mean, budget: int, max_lengths=None,
                        min_lengths=None, first=None) -> np.ndarray:
    """The time-aware allocation (module docstring): exact, ``min_lengths[i] <= S_i <= cap_i``.

    ``base``, ``per_token``, ``mean``, ``first``: each drafter's :class:`PeriodFit` (seconds;
    ``first`` None: no step). With every ``per_token == first == 0`` and no lower bounds this is
    :func:`allocate_draft_lengths` (eq. 5) itself.
    """
    a, x, budget, caps = _validated_inputs(acceptance, goodput, budget, max_lengths)
    b0, b1, pm, c = _check_periods(base, per_token, mean, first, a.size)
    lo = np.zeros(a.shape, dtype=np.int64) if min_lengths is None else np.minimum(np.asarray(min_lengths, dtype=np.int64), caps)
    if np.any(lo < 0) or int(lo.sum()) > budget:
        raise ValueError("min_lengths must be >= 0 and fit the budget together")
    if a.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.any(b1 > 0) and not np.any(c > 0) and not np.any(lo > 0):
        return allocate_draft_lengths(a, x, budget, caps)
    values = _values(a, x, b0, b1, pm, caps, c)
    gains = np.diff(values, axis=1)  # gains[i, s]: unit s + 1
    s_idx = np.arange(gains.shape[1])
    usable = (s_idx[None, :] < caps[:, None])
    in_order = _paying_units_in_order(gains, usable)
    if in_order.all():
        return _greedy(gains, usable, lo, budget)
    return _mixed(values, gains, usable, lo, caps, budget, in_order)


def _paying_units_in_order(gains: np.ndarray, usable: np.ndarray) -> np.ndarray:
    """Per drafter: every unit that pays gains no more than the unit before it, so the greedy is
    exact for it (module docstring). True in exact arithmetic without a step; a step, or rounding,
    can break it, and those drafters go to the dynamic programme."""
    if gains.shape[1] < 2:
        return np.ones(gains.shape[0], dtype=bool)
    later = gains[:, 1:]
    checked = usable[:, 1:] & usable[:, :-1] & (later > 0)
    return np.all(~checked | (later <= gains[:, :-1] + 1e-15), axis=1)


def _greedy(gains: np.ndarray, usable: np.ndarray, lo: np.ndarray, budget: int) -> np.ndarray:
    """Concave terms: the lower bounds, then the largest positive marginal gains (stable order)."""
    return lo + _best_units(gains, usable, lo)[: budget - int(lo.sum())]


def _best_units(gains: np.ndarray, usable: np.ndarray, lo: np.ndarray):
    """The paying units above the lower bounds, best first (stable order), as a lazy allotment:
    ``result[:m]`` is the bincount of the best ``m`` per drafter; ``result.gains`` their gains."""
    s_idx = np.arange(gains.shape[1])
    free = usable & (s_idx[None, :] >= lo[:, None]) & (gains > 0)
    client, unit = np.nonzero(free)
    order = np.argsort(-gains[client, unit], kind="stable")
    return _Units(client[order], gains[client, unit][order], lo.size)


class _Units:
    def __init__(self, clients: np.ndarray, gains: np.ndarray, n: int) -> None:
        self.clients, self.gains, self.n = clients, gains, n

    def __getitem__(self, part: slice) -> np.ndarray:
        return np.bincount(self.clients[part], minlength=self.n).astype(np.int64)


def _mixed(values, gains, usable, lo, caps, budget: int, in_order: np.ndarray) -> np.ndarray:
    """Exact for any terms: the drafters whose paying units are in order (the greedy's) pooled into
    one concave value of the units they get, the others by the dynamic programme, and the budget
    split between the two where their sum is best. The dynamic programme's cost then grows with
    the drafters that need it (those with a step that makes one token worth less than two), not
    with every drafter."""
    out = np.zeros(lo.size, dtype=np.int64)
    greedy, dynamic = np.flatnonzero(in_order), np.flatnonzero(~in_order)
    g_lo = int(lo[greedy].sum())
    units = _best_units(gains[greedy], usable[greedy], lo[greedy])
    # pooled[u]: the greedy drafters' best objective with u units (-inf below their lower bounds;
    # flat once no unit pays)
    pooled = np.full(budget + 1, -np.inf)
    if g_lo <= budget:
        top = np.concatenate([[0.0], np.cumsum(units.gains)])
        extra = np.minimum(np.arange(budget + 1 - g_lo), top.size - 1)
        pooled[g_lo:] = float(values[greedy, lo[greedy]].sum()) + top[extra]
    best, choice = _dp_table(values[dynamic], lo[dynamic], caps[dynamic], budget)
    total = best + pooled[::-1]  # the dynamic drafters' c units, the greedy ones' budget - c
    c = int(np.argmax(total))  # the first maximum: the fewest units for the dynamic drafters
    out[dynamic] = _dp_lengths(choice, c)
    out[greedy] = lo[greedy] + units[: min(budget - c - g_lo, units.clients.size)]
    return out


def _dynamic(values: np.ndarray, lo: np.ndarray, caps: np.ndarray, budget: int) -> np.ndarray:
    """Any terms, all by the dynamic programme (:func:`_dp_table`)."""
    best, choice = _dp_table(values, lo, caps, budget)
    return _dp_lengths(choice, int(np.argmax(best)))


def _dp_table(values: np.ndarray, lo: np.ndarray, caps: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """``best[c]`` = the best objective of the drafters using exactly ``c`` units, one array step per
    drafter over all its lengths at once, and each drafter's length in it (``choice``); equal
    objectives keep the shorter draft."""
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
    return best, choice


def _dp_lengths(choice: np.ndarray, c: int) -> np.ndarray:
    out = np.zeros(choice.shape[0], dtype=np.int64)
    for i in range(choice.shape[0] - 1, -1, -1):
        out[i] = choice[i, c]
        c -= out[i]
    return out
