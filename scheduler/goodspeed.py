"""GoodSpeed: smoothed per-drafter estimates and the gradient allocation of draft lengths.

Implements GoodSpeed (Tran et al., "GoodSpeed: fair goodput with adaptive speculative decoding in
distributed edge inference", INFOCOM 2026, arXiv 2512.09963; Section III, Algorithm 1):

* eq. (3), acceptance smoothing, for a drafter that drafted ``S > 0`` tokens::

      alpha_hat <- (1 - eta) * alpha_hat + eta * mean_j min(1, p_j(s_j) / q_j(s_j))

* eq. (4), goodput smoothing, every round the drafter took part in::

      X <- (1 - beta) * X + beta * x,     x = accepted + 1

* eq. (5), the allocation of next round's draft lengths::

      maximize  sum_i U'(X_i) * xhat_i(S_i),  xhat(S) = (1 - a^(S+1)) / (1 - a)
      s.t.      sum_i S_i <= C,  0 <= S_i <= max_i,  S_i integer

Raising ``S_i`` by one adds ``w_i * a_i^(S_i+1)`` (``w_i = U'(X_i)``), a gain that never grows
with ``S_i``. The objective is therefore separable concave, and granting the ``C`` units one at a
time to the largest marginal gain is exactly optimal. :func:`allocate_draft_lengths` computes that
greedy result without the ``O(C log N)`` loop: it bisects on a log-gain threshold (each client's
unit gains form an arithmetic sequence in log space, so counting units above a threshold is one
vectorised expression) and hands the few units at the threshold out in the greedy's tie order.
With at most ``SORT_UNITS`` candidate units (tens of drafters) it sorts them all instead: one
vectorised sort is cheaper than the search's iterations there (measured in ``bench/bench_scheduler``);
with at most ``HEAP_UNITS`` units to hand out (a round's budget for a few drafters) it runs the
greedy itself on Python floats, cheaper still than any array work at that size.

Utilities are the alpha-fair family ``U(x) = x^(1-f) / (1-f)`` (``U = log x`` at ``f = 1``), so
``w_i = X_i^(-f)``: ``f = 1`` ("log") is proportional fairness as in the paper, ``f = 0``
("throughput") maximises expected tokens, and large ``f`` approaches max-min fairness.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

UTILITY_FAIRNESS = {"log": 1.0, "throughput": 0.0, "maxmin": 16.0}


def expected_goodput(acceptance: np.ndarray | float, draft_lengths: np.ndarray | int) -> np.ndarray:
    """``xhat(S) = (1 - a^(S+1)) / (1 - a)``, with its limit ``S + 1`` at ``a = 1``.

    >>> float(expected_goodput(0.5, 2))  # 1 + 0.5 + 0.25
    1.75
    """
    a = np.asarray(acceptance, dtype=np.float64)
    s = np.asarray(draft_lengths, dtype=np.float64)
    # sum_{k=0..S} a^k written without the 0/0 at a = 1.
    with np.errstate(divide="ignore", invalid="ignore"):
        closed = (1.0 - a ** (s + 1.0)) / (1.0 - a)
    return np.where(a >= 1.0, s + 1.0, closed)


def fairness_exponent(utility: str | float) -> float:
    """Map a utility name or alpha-fair exponent ``f >= 0`` to ``f``."""
    if isinstance(utility, str):
        if utility not in UTILITY_FAIRNESS:
            raise ValueError(f"unknown utility {utility!r}; use one of {sorted(UTILITY_FAIRNESS)} or a number >= 0")
        return UTILITY_FAIRNESS[utility]
    f = float(utility)
    if not math.isfinite(f) or f < 0:
        raise ValueError(f"alpha-fair exponent must be a finite number >= 0, got {utility!r}")
    return f


def _validated_inputs(acceptance, goodput, budget, max_lengths):
    a = np.asarray(acceptance, dtype=np.float64).reshape(-1)
    x = np.asarray(goodput, dtype=np.float64).reshape(-1)
    if a.shape != x.shape:
        raise ValueError(f"acceptance has {a.size} entries but goodput has {x.size}")
    lo, hi = _extremes(a)
    if not (lo >= 0.0 and hi <= 1.0):  # a NaN fails every comparison
        raise ValueError("acceptance rates must lie in [0, 1]")
    lo, hi = _extremes(x)
    if not (lo > 0.0 and hi < math.inf):
        raise ValueError("smoothed goodput must be finite and > 0")
    if isinstance(budget, bool) or int(budget) != budget or budget < 0:
        raise ValueError(f"budget must be an integer >= 0, got {budget!r}")
    if max_lengths is None:
        caps = np.full(a.shape, int(budget), dtype=np.int64)
    else:
        caps = np.asarray(max_lengths).reshape(-1)
        if caps.shape != a.shape or not _extremes(caps)[0] >= 0 or (caps.dtype.kind not in "iub" and np.any(caps != np.floor(caps))):
            raise ValueError("max_lengths must hold one integer >= 0 per client")
        caps = np.minimum(caps.astype(np.int64), int(budget))
    return a, x, int(budget), caps


def _extremes(v: np.ndarray) -> tuple[float, float]:
    """``(min, max)`` of ``v``, NaN if it holds one, ``(1, 1)`` if empty (inside every bound
    checked here). A round allocates for a handful of drafters, where a NumPy reduction's call
    overhead (~3 us each here) outweighs the work: small arrays go through Python's own."""
    if v.size == 0:
        return 1.0, 1.0
    if v.size > 64:
        return float(v.min()), float(v.max())
    values = v.tolist()
    if any(value != value for value in values):
        return math.nan, math.nan
    return min(values), max(values)


def _unit_log_gains(a: np.ndarray, x: np.ndarray, f: float) -> tuple[np.ndarray, np.ndarray]:
    """Per client: log w_i and log a_i. Unit ``s`` (0-based) has log gain ``lw + (s + 1) * la``."""
    log_w = -f * np.log(x)
    with np.errstate(divide="ignore"):
        log_a = np.log(a)  # -inf where a == 0: those units gain nothing
    return log_w, log_a


class _UnitCounter:
    """Counts, per client, the units whose log gain ``lw + (s + 1) * la`` is >= a threshold.

    The counts are exact on the gains themselves (the numbers the greedy compares): a division
    estimates them and one comparison each way settles the float boundary.
    """

    def __init__(self, log_w: np.ndarray, log_a: np.ndarray, caps: np.ndarray) -> None:
        self.log_w, self.log_a, self.caps = log_w, log_a, caps.astype(np.float64)
        flat = log_a == 0.0  # a = 1: every unit gains w, counted directly
        self.flat = np.flatnonzero(flat)
        self.inv_slope = np.where(flat, 0.0, 1.0 / np.where(flat, -1.0, -log_a))

    def __call__(self, threshold: float) -> np.ndarray:
        lw, la, caps = self.log_w, self.log_a, self.caps
        n = lw - threshold
        n *= self.inv_slope
        np.floor(n, out=n)
        np.clip(n, 0.0, caps, out=n)
        n += (n < caps) & (lw + (n + 1.0) * la >= threshold)
        n -= (n > 0) & (lw + n * la < threshold)
        if self.flat.size:
            n[self.flat] = np.where(lw[self.flat] >= threshold, caps[self.flat], 0.0)
        return n


SORT_UNITS = 2048  # up to this many candidate units, one sort beats the threshold search's iterations
HEAP_UNITS = 64  # up to this many units to hand out, the greedy itself on Python floats beats any array work


def allocate_draft_lengths(
    acceptance: Sequence[float] | np.ndarray,
    goodput: Sequence[float] | np.ndarray,
    budget: int,
    max_lengths: Sequence[int] | np.ndarray | None = None,
    utility: str | float = "log",
) -> np.ndarray:
    """Exact solution of GoodSpeed-sched (eq. 5); returns ``S`` as an int64 array ``[num_clients]``.

    Units go to the largest marginal gain ``X_i^(-f) * a_i^(S_i+1)``; equal gains go to the lower
    client index first. Units whose gain is zero (``a_i = 0``: a draft can never be accepted) are
    not handed out, so ``sum(S)`` may stay below ``C``. ``C < N`` leaves some clients at 0.

    Worked example: two clients with ``a = (0.9, 0.5)``, ``X = (2, 1)``, ``C = 3``. Under log
    utility the gains are 0.45, 0.405, 0.36... for client 0 and 0.5, 0.25... for client 1, so the
    units go to client 1, client 0, client 0: ``S = (2, 1)``.

    >>> allocate_draft_lengths([0.9, 0.5], [2.0, 1.0], 3).tolist()
    [2, 1]
    """
    f = fairness_exponent(utility)
    a, x, c, caps = _validated_inputs(acceptance, goodput, budget, max_lengths)
    if a.size == 0 or c == 0:
        return np.zeros(a.shape, dtype=np.int64)
    if c <= HEAP_UNITS:  # a round's budget for a few drafters: one heap pop per unit
        return _greedy_heap(*_unit_log_gain_lists(a, x, f), caps.tolist(), c)
    log_w, log_a = _unit_log_gains(a, x, f)
    caps = np.where(np.isneginf(log_a), 0, caps)
    if int(caps.sum()) <= c:
        return caps.copy()
    if int(caps.sum()) <= SORT_UNITS:  # few units (tens of drafters): sort them all, the greedy's order
        return _fill_at_threshold(log_w, log_a, caps, np.zeros(caps.size, dtype=np.int64), c)
    live = caps > 0
    count = _UnitCounter(log_w, log_a, caps)
    # Invariant: count(lo) > C >= count(hi). Regula falsi (Illinois variant) on the count, which is
    # close to linear in the threshold, with bisection whenever interpolation stalls.
    hi = float(np.max(log_w[live] + log_a[live])) + 1.0  # above every unit: count 0
    lo = float(np.min(log_w[live] + caps[live] * log_a[live]))  # lowest unit: count = all units
    n_lo, n_hi = float(caps.sum()), 0.0
    taken_hi = np.zeros(caps.size)
    side = 0
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        for step in range(200):
            w_lo, w_hi = n_lo - c, c - n_hi
            mid = lo + (hi - lo) * (w_lo / (w_lo + w_hi)) if step % 4 != 3 else 0.5 * (lo + hi)
            if not lo < mid < hi:
                mid = 0.5 * (lo + hi)
                if not lo < mid < hi:
                    break
            taken = count(mid)
            total = float(taken.sum())
            if total == c:
                return taken.astype(np.int64)
            if total > c:
                lo, n_lo = mid, total
                if side == -1:
                    n_hi = c - 0.5 * (c - n_hi)  # Illinois: halve the stale end's weight
                side = -1
            else:
                hi, n_hi, taken_hi = mid, total, taken
                if side == 1:
                    n_lo = c + 0.5 * (n_lo - c)
                side = 1
    taken_hi = taken_hi.astype(np.int64)
    return _fill_at_threshold(log_w, log_a, caps, taken_hi, c - int(taken_hi.sum()))


def _unit_log_gain_lists(a: np.ndarray, x: np.ndarray, f: float) -> tuple[list[float], list[float]]:
    """:func:`_unit_log_gains` on Python floats, for a round's handful of clients: after a target
    forward every NumPy call runs cold, and the array form cost several times its warm figure
    there (bench_packing's scheduling phase, docs/MEASUREMENTS.md). ``math.log`` and ``np.log`` may
    differ in the last bit, so an exact tie can break differently here than on the array paths;
    each path is exact up to float rounding, and one input always takes the same path."""
    log_a = [math.log(ai) if ai > 0.0 else -math.inf for ai in a.tolist()]
    return [-f * math.log(xi) for xi in x.tolist()], log_a


def _greedy_heap(log_w: list[float], log_a: list[float], caps: list[int], c: int) -> np.ndarray:
    """The greedy itself: ``c`` units, one at a time, each to the largest log gain ``lw + (s + 1)
    * la`` (the vectorised paths' expression, on :func:`_unit_log_gain_lists`' logs), equal gains to
    the lower client index. A client's gains never grow with ``s``, so a heap of each client's next unit yields
    the units in exactly the order :func:`_fill_at_threshold` sorts them."""
    caps = [0 if la == -math.inf else cap for la, cap in zip(log_a, caps)]  # a = 0: nothing to gain
    if sum(caps) <= c:
        return np.array(caps, dtype=np.int64)
    taken = [0] * len(caps)
    heap = [(-(lw + la), i) for i, (lw, la, cap) in enumerate(zip(log_w, log_a, caps)) if cap > 0]
    heapq.heapify(heap)
    for _ in range(c):
        if not heap:
            break
        _, i = heap[0]
        s = taken[i] = taken[i] + 1
        if s < caps[i]:
            heapq.heapreplace(heap, (-(log_w[i] + (s + 1) * log_a[i]), i))
        else:
            heapq.heappop(heap)
    return np.array(taken, dtype=np.int64)


def _fill_at_threshold(log_w, log_a, caps, taken, remaining: int) -> np.ndarray:
    """Hand out the last ``remaining`` units, all within float resolution of the threshold, in the
    greedy's order: larger gain first, then lower client index, then earlier unit."""
    room = np.minimum(caps - taken, remaining)
    client = np.repeat(np.arange(caps.size), room)
    offset = np.arange(client.size) - np.repeat(np.cumsum(room) - room, room)
    unit = taken[client] + offset
    gain = log_w[client] + (unit + 1) * log_a[client]
    order = np.lexsort((unit, client, -gain))[:remaining]
    return taken + np.bincount(client[order], minlength=caps.size)


def allocation_objective(acceptance, goodput, draft_lengths, utility: str | float = "log") -> float:
    """``sum_i X_i^(-f) * xhat_i(S_i)``, the quantity eq. (5) maximises."""
    w = np.asarray(goodput, dtype=np.float64) ** -fairness_exponent(utility)
    return float(np.sum(w * expected_goodput(acceptance, draft_lengths)))


@dataclass(frozen=True)
class SmoothingConfig:
    """Smoothing of eqs. (3)-(4) and the values a newly joined drafter starts from.

    ``initial_acceptance`` is the prior for a drafter nobody has measured yet (0.5: no evidence
    either way). ``initial_goodput`` = 1 token per round is what plain decoding yields, so a new
    drafter's weight ``1/X`` starts high and it is measured quickly. ``warm_start`` replaces the
    prior with the first measurement (eq. 3 with ``eta = 1`` once); evaluated as a remedy for
    starved estimates and rejected — a weak drafter's first, pessimistic measurement locks it out
    sooner (docs/EXPERIMENT-LOG.md) — so it is off by default.
    """

    eta: float = 0.2
    beta: float = 0.5
    initial_acceptance: float = 0.5
    initial_goodput: float = 1.0
    warm_start: bool = False

    def __post_init__(self) -> None:
        for name in ("eta", "beta"):
            v = getattr(self, name)
            if not 0.0 < v <= 1.0:
                raise ValueError(f"{name} must lie in (0, 1], got {v}")
        if not 0.0 <= self.initial_acceptance <= 1.0:
            raise ValueError("initial_acceptance must lie in [0, 1]")
        if not self.initial_goodput > 0.0:
            raise ValueError("initial_goodput must be > 0")


@dataclass
class ClientEstimate:
    """One drafter's smoothed acceptance ``alpha_hat`` (eq. 3) and goodput ``X`` (eq. 4)."""

    acceptance: float
    goodput: float
    rounds: int = 0
    measured: int = 0  # rounds with S > 0: the ones that updated ``acceptance``
    stale: int = 0  # rounds since ``acceptance`` was last updated (S = 0 rounds in a row)


class GoodputEstimator:
    """Per-drafter smoothing state; drafters join and leave between rounds."""

    def __init__(self, config: SmoothingConfig | None = None) -> None:
        self.config = config or SmoothingConfig()
        self._clients: dict[Hashable, ClientEstimate] = {}

    def join(self, client_id: Hashable) -> ClientEstimate:
        if client_id in self._clients:
            raise ValueError(f"client {client_id!r} already joined")
        est = ClientEstimate(self.config.initial_acceptance, self.config.initial_goodput)
        self._clients[client_id] = est
        return est

    def leave(self, client_id: Hashable) -> None:
        if self._clients.pop(client_id, None) is None:
            raise KeyError(f"unknown client {client_id!r}")

    def __contains__(self, client_id: Hashable) -> bool:
        return client_id in self._clients

    def __len__(self) -> int:
        return len(self._clients)

    def get(self, client_id: Hashable) -> ClientEstimate:
        try:
            return self._clients[client_id]
        except KeyError:
            raise KeyError(f"unknown client {client_id!r}") from None

    def observe(self, client_id: Hashable, acceptance_ratios: Sequence[float] | np.ndarray, num_accepted: int) -> None:
        """Apply eqs. (3)-(4) for one verified round.

        ``acceptance_ratios[j] = min(1, p_j(s_j) / q_j(s_j))`` for each of the ``S`` drafted
        positions (1 or 0 under greedy); ``num_accepted = m``. ``S = 0`` leaves ``alpha_hat``
        alone (nothing was measured) but still records ``x = 1``.
        """
        est = self.get(client_id)
        # Plain Python: a round has a handful of ratios, where numpy's call overhead dominates.
        ratios = acceptance_ratios.tolist() if isinstance(acceptance_ratios, np.ndarray) else list(acceptance_ratios)
        if not all(0.0 <= r <= 1.0 for r in ratios):  # also False for NaN
            raise ValueError("acceptance ratios must lie in [0, 1]")
        if not 0 <= num_accepted <= len(ratios):
            raise ValueError(f"num_accepted={num_accepted} outside [0, {len(ratios)}]")
        eta, beta = self.config.eta, self.config.beta
        if ratios:
            if est.measured == 0 and self.config.warm_start:
                eta = 1.0
            est.acceptance = (1.0 - eta) * est.acceptance + eta * (math.fsum(ratios) / len(ratios))
            est.measured, est.stale = est.measured + 1, 0
        else:
            est.stale += 1
        est.goodput = (1.0 - beta) * est.goodput + beta * (num_accepted + 1)
        est.rounds += 1

    def evidence(self, client_ids: Iterable[Hashable]) -> tuple[np.ndarray, np.ndarray]:
        """``(measured, stale)`` as int64 arrays: rounds that measured each client's acceptance,
        and rounds since the last one (what exploration and optimism look at)."""
        ests = [self.get(c) for c in client_ids]
        return (np.array([e.measured for e in ests], dtype=np.int64), np.array([e.stale for e in ests], dtype=np.int64))

    def arrays(self, client_ids: Iterable[Hashable]) -> tuple[np.ndarray, np.ndarray]:
        """``(acceptance, goodput)`` as float64 arrays in the order of ``client_ids``."""
        ests = [self.get(c) for c in client_ids]
        return (
            np.array([e.acceptance for e in ests], dtype=np.float64),
            np.array([e.goodput for e in ests], dtype=np.float64),
        )
