"""Time-aware GoodSpeed (scheduler.timing) against exhaustive search, and its reduction to eq. 5."""

import itertools

import numpy as np
import pytest

from goodspeed.scheduler.goodspeed import allocate_draft_lengths, allocation_objective
from goodspeed.scheduler.policy import AllocationInputs, make_policy
from goodspeed.scheduler.timing import PeriodEstimator, _dynamic, _values, allocate_time_aware, time_aware_objective


def brute_force(a, x, base, per_token, mean, budget, caps, lo=None):
    lo = [0] * len(a) if lo is None else lo
    best, best_s = -np.inf, None
    for s in itertools.product(*[range(l, c + 1) for l, c in zip(lo, caps)]):
        if sum(s) <= budget:
            v = time_aware_objective(a, x, base, per_token, mean, s)
            if v > best + 1e-12:
                best, best_s = v, s
    return best, best_s


def random_case(rng, n):
    a = rng.uniform(0.0, 1.0, n)
    a[rng.random(n) < 0.15] = 1.0
    x = rng.uniform(0.5, 6.0, n)
    base = rng.uniform(0.002, 0.3, n)
    per_token = rng.uniform(0.0, 0.08, n) * (rng.random(n) < 0.8)
    mean = base + per_token * rng.uniform(0, 6, n)
    caps = rng.integers(0, 7, n)
    return a, x, base, per_token, mean, caps


@pytest.mark.parametrize("seed", range(40))
def test_matches_exhaustive_search(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 5))
    a, x, base, per_token, mean, caps = random_case(rng, n)
    budget = int(rng.integers(0, 12))
    lo = None
    if seed % 3 == 0:  # lower bounds (the exploration floor)
        lo = [int(v) for v in (rng.random(n) < 0.4) & (caps > 0)]
        if sum(lo) > budget:
            lo = None
    got = allocate_time_aware(a, x, base, per_token, mean, budget, caps, lo)
    assert got.sum() <= budget and np.all(got <= caps) and np.all(got >= (0 if lo is None else np.asarray(lo)))
    best, _ = brute_force(a, x, base, per_token, mean, budget, list(caps), lo)
    assert time_aware_objective(a, x, base, per_token, mean, got) == pytest.approx(best, rel=1e-12, abs=1e-12)


def test_terms_with_growing_marginal_gains_are_allotted_exactly():
    # a = 1 and b > a0: f(S) = (S+1)/(a0 + b S) falls and is convex, so its marginal gains grow
    # (towards 0 from below) and no unit of it pays.
    a, x = np.array([1.0, 0.6, 0.95]), np.array([2.0, 1.5, 3.0])
    base, per_token = np.array([0.01, 0.05, 0.02]), np.array([0.03, 0.001, 0.04])
    mean = base + 2 * per_token
    for budget in range(0, 10):
        got = allocate_time_aware(a, x, base, per_token, mean, budget, [4, 4, 4])
        best, _ = brute_force(a, x, base, per_token, mean, budget, [4, 4, 4])
        assert time_aware_objective(a, x, base, per_token, mean, got) == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("seed", range(20))
def test_the_dynamic_programme_alone_matches_exhaustive_search(seed):
    """The fallback for gains that rounding leaves out of order, called directly: the greedy
    takes every case the other tests draw."""
    rng = np.random.default_rng(500 + seed)
    n = int(rng.integers(1, 5))
    a, x, base, per_token, mean, caps = random_case(rng, n)
    budget = int(rng.integers(0, 12))
    lo = np.array([int(v) for v in (rng.random(n) < 0.3) & (caps > 0)], dtype=np.int64)
    if lo.sum() > budget:
        lo[:] = 0
    got = _dynamic(_values(a, x, base, per_token, mean, caps), lo, caps, budget)
    assert got.sum() <= budget and np.all(got <= caps) and np.all(got >= lo)
    best, _ = brute_force(a, x, base, per_token, mean, budget, list(caps), list(lo))
    assert time_aware_objective(a, x, base, per_token, mean, got) == pytest.approx(best, rel=1e-12, abs=1e-12)


def test_terms_past_their_peak_take_the_greedy(monkeypatch):
    """Drafts whose rate peaks inside the cap and then falls (a convex tail: gains grow towards 0
    from below) are not concave, yet the greedy over paying units is exact (module docstring)."""
    from goodspeed.scheduler import timing

    a, x = np.array([0.7, 0.85, 0.5, 0.9]), np.array([2.0, 3.0, 1.5, 2.5])
    base, per_token = np.array([0.02, 0.08, 0.01, 0.05]), np.array([0.004, 0.003, 0.004, 0.002])
    mean, caps = base + 4 * per_token, np.array([12, 12, 12, 12])
    gains = np.diff(_values(a, x, base, per_token, mean, caps), axis=1)
    assert np.any(np.diff(gains, axis=1) > 0)  # not concave: the strict test would not take the greedy

    def refuse(*args):
        raise AssertionError("the dynamic programme ran")

    monkeypatch.setattr(timing, "_dynamic", refuse)
    for budget in (4, 10, 20):
        got = allocate_time_aware(a, x, base, per_token, mean, budget, caps)
        best, _ = brute_force(a, x, base, per_token, mean, budget, list(caps))
        assert time_aware_objective(a, x, base, per_token, mean, got) == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("seed", range(10))
def test_reduces_to_eq5_when_periods_do_not_depend_on_draft_length(seed):
    """b_i = 0: the paper's rule exactly, whatever each drafter's latency (log utility is scale-free)."""
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(1, 7))
    a, x = rng.uniform(0.05, 0.99, n), rng.uniform(0.5, 6.0, n)
    latency = rng.uniform(0.002, 0.2, n)
    caps, budget = rng.integers(0, 9, n), int(rng.integers(0, 20))
    eq5 = allocate_draft_lengths(a, x, budget, caps)
    got = allocate_time_aware(a, x, latency, np.zeros(n), latency, budget, caps)
    np.testing.assert_array_equal(got, eq5)
    # and the general solver (forced by a vanishing slope) reaches eq. 5's objective
    tiny = allocate_time_aware(a, x, latency, np.full(n, 1e-15), latency, budget, caps)
    assert allocation_objective(a, x, tiny) == pytest.approx(allocation_objective(a, x, eq5), rel=1e-9)


def test_expensive_drafting_moves_budget_to_cheap_drafters():
    a, x = np.array([0.8, 0.8]), np.array([2.0, 2.0])
    base = np.array([0.02, 0.02])
    same = allocate_time_aware(a, x, base, np.zeros(2), base, 8, [8, 8])
    assert same.tolist() == [4, 4]  # equal drafters, eq. 5 splits evenly
    slow = allocate_time_aware(a, x, base, np.array([0.0, 0.02]), base + np.array([0.0, 0.08]), 8, [8, 8])
    assert slow[0] > slow[1]


def test_rejects_bad_periods():
    with pytest.raises(ValueError, match="periods"):
        allocate_time_aware([0.5], [1.0], [0.0], [0.0], [1.0], 4)
    with pytest.raises(ValueError, match="periods"):
        allocate_time_aware([0.5], [1.0], [0.1], [-1.0], [1.0], 4)
    with pytest.raises(ValueError, match="one entry"):
        allocate_time_aware([0.5, 0.5], [1.0, 1.0], [0.1], [0.0], [1.0], 4)
    with pytest.raises(ValueError, match="min_lengths"):
        allocate_time_aware([0.5, 0.5], [1.0, 1.0], [0.1] * 2, [0.1] * 2, [1.0] * 2, 1, None, [1, 1])


def test_period_estimator_recovers_an_affine_period():
    est = PeriodEstimator(gamma=0.1)
    rng = np.random.default_rng(0)
    assert est.fit("d") is None
    for _ in range(400):
        s = int(rng.integers(0, 9))
        est.observe("d", s, 0.05 + 0.01 * s + rng.normal(0, 0.001))
    fit = est.fit("d")
    assert fit.base == pytest.approx(0.05, abs=0.004) and fit.per_token == pytest.approx(0.01, abs=0.001)
    assert fit.observations == 400


def test_period_estimator_keeps_slope_zero_until_lengths_vary():
    est = PeriodEstimator()
    for p in (0.1, 0.12, 0.11):
        est.observe("d", 4, p)
    fit = est.fit("d")
    assert fit.per_token == 0.0 and fit.base == pytest.approx(fit.mean)
    with pytest.raises(ValueError):
        est.observe("d", 2, 0.0)


def test_policy_without_timing_is_the_default():
    rng = np.random.default_rng(3)
    a, x = rng.uniform(0.2, 0.9, 5), rng.uniform(1, 4, 5)
    stale = np.array([0, 6, 0, 0, 9])
    inputs = AllocationInputs([str(i) for i in range(5)], a, x, 12, np.full(5, 8), 7, rng, np.ones(5, dtype=np.int64), stale)
    np.testing.assert_array_equal(make_policy("goodspeed-time").allocate(inputs), make_policy("goodspeed").allocate(inputs))


def test_policy_keeps_the_exploration_floor_with_timing():
    a = np.array([0.9, 0.9, 0.05])
    x = np.array([3.0, 3.0, 1.0])
    periods = (np.full(3, 0.02), np.full(3, 0.01), np.full(3, 0.05))
    inputs = AllocationInputs(["a", "b", "c"], a, x, 6, np.full(3, 6), 0, np.random.default_rng(0),
                              np.ones(3, dtype=np.int64), np.array([0, 0, 9]), periods)
    got = make_policy("goodspeed-time").allocate(inputs)
    assert got[2] >= 1 and got.sum() <= 6
