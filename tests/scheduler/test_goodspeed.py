import heapq
import itertools

import numpy as np
import pytest

from goodspeed.scheduler.goodspeed import (
    GoodputEstimator,
    SmoothingConfig,
    allocate_draft_lengths,
    allocation_objective,
    expected_goodput,
)


def exhaustive_best(a, x, budget, caps, utility):
    best = -np.inf
    for s in itertools.product(*(range(c + 1) for c in caps)):
        if sum(s) <= budget:
            best = max(best, allocation_objective(a, x, np.array(s), utility))
    return best


def greedy_heap(a, x, budget, caps, f):
    """The textbook O(C log N) greedy: one unit at a time to the largest marginal gain."""
    w = x ** -f
    s = np.zeros(len(a), dtype=np.int64)
    heap = [(-(w[i] * a[i]), i) for i in range(len(a)) if caps[i] > 0 and a[i] > 0]
    heapq.heapify(heap)
    for _ in range(budget):
        if not heap:
            break
        _, i = heapq.heappop(heap)
        s[i] += 1
        if s[i] < caps[i]:
            heapq.heappush(heap, (-(w[i] * a[i] ** (s[i] + 1)), i))
    return s


def test_expected_goodput_closed_form_and_limits():
    assert expected_goodput(0.5, 2) == pytest.approx(1.75)
    assert expected_goodput(1.0, 4) == 5.0
    assert expected_goodput(0.0, 4) == 1.0
    assert np.allclose(expected_goodput(np.array([0.3, 0.999999]), 3), [1 + 0.3 + 0.09 + 0.027, 4.0], atol=1e-5)


# allocate_draft_lengths' three exact paths: (HEAP_UNITS, SORT_UNITS) forcing each one.
PATHS = {"heap": (10**9, 0), "sort": (-1, 10**9), "threshold": (-1, 0)}


@pytest.fixture(params=sorted(PATHS))
def path(request, monkeypatch):
    from goodspeed.scheduler import goodspeed

    heap_units, sort_units = PATHS[request.param]
    monkeypatch.setattr(goodspeed, "HEAP_UNITS", heap_units)
    monkeypatch.setattr(goodspeed, "SORT_UNITS", sort_units)
    return request.param


@pytest.mark.parametrize("utility", ["log", "throughput", 2.0])
def test_allocation_equals_exhaustive_search(path, utility):
    rng = np.random.default_rng(12345)
    for _ in range(500):
        n = int(rng.integers(1, 5))
        budget = int(rng.integers(0, 13))
        a = rng.choice([0.0, 1.0, 0.5, *rng.uniform(0, 1, 4)], size=n)
        x = rng.uniform(0.05, 6.0, size=n)
        caps = rng.integers(0, 9, size=n)
        s = allocate_draft_lengths(a, x, budget, caps, utility)
        assert s.sum() <= budget and np.all(s >= 0) and np.all(s <= caps)
        got = allocation_objective(a, x, s, utility)
        assert got == pytest.approx(exhaustive_best(a, x, budget, caps, utility), abs=1e-9, rel=1e-12)


def test_every_path_equals_the_textbook_greedy_exactly(path):
    rng = np.random.default_rng(7)
    for _ in range(200):
        n = int(rng.integers(1, 200))
        budget = int(rng.integers(0, 4 * n))
        a = rng.uniform(0, 1, n)
        a[rng.random(n) < 0.1] = 1.0
        x = rng.uniform(0.1, 10, n)
        caps = rng.integers(0, 12, n)
        np.testing.assert_array_equal(allocate_draft_lengths(a, x, budget, caps), greedy_heap(a, x, budget, caps, 1.0))


def test_ties_go_to_lower_index_deterministically(path):
    s = allocate_draft_lengths([0.5, 0.5, 0.5], [1.0, 1.0, 1.0], 4)
    assert s.tolist() == [2, 1, 1]


def test_budget_below_number_of_clients(path):
    # gains: 0.6 then 0.36 for client 0, 0.1 for client 1, 0.5 for client 2
    s = allocate_draft_lengths([0.6, 0.1, 0.5], [1.0, 1.0, 1.0], 2)
    assert s.tolist() == [1, 0, 1]


@pytest.mark.parametrize("budget", [0])
def test_zero_budget_and_no_clients(budget):
    assert allocate_draft_lengths([0.5, 0.7], [1, 2], budget).tolist() == [0, 0]
    assert allocate_draft_lengths([], [], 10).tolist() == []


def test_acceptance_one_is_linear_and_zero_gets_nothing(path):
    # a = 1 gains w per unit forever; a = 0 never gains: it drafts nothing and budget stays unused.
    assert allocate_draft_lengths([1.0, 0.0], [1.0, 1.0], 5).tolist() == [5, 0]
    assert allocate_draft_lengths([0.0, 0.0], [1.0, 1.0], 5).tolist() == [0, 0]


def test_binding_caps_move_units_to_others():
    assert allocate_draft_lengths([0.9, 0.3], [1.0, 1.0], 6, max_lengths=[2, 10]).tolist() == [2, 4]


def test_tiny_goodput_takes_priority_without_overflow():
    s = allocate_draft_lengths([0.2, 0.9], [1e-300, 5.0], 3, utility=8.0)
    assert s.tolist() == [3, 0]


def test_log_utility_is_fairer_than_throughput():
    a, x = [0.9, 0.3], [5.0, 1.0]
    fair = allocate_draft_lengths(a, x, 6, utility="log")
    greedy = allocate_draft_lengths(a, x, 6, utility="throughput")
    assert fair[1] > greedy[1]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(acceptance=[1.5], goodput=[1.0], budget=1),
        dict(acceptance=[np.nan], goodput=[1.0], budget=1),
        dict(acceptance=[0.5], goodput=[0.0], budget=1),
        dict(acceptance=[0.5], goodput=[1.0], budget=-1),
        dict(acceptance=[0.5], goodput=[1.0], budget=2.5),
        dict(acceptance=[0.5, 0.5], goodput=[1.0], budget=1),
        dict(acceptance=[0.5], goodput=[1.0], budget=1, max_lengths=[-1]),
        dict(acceptance=[0.5], goodput=[1.0], budget=1, utility="nope"),
        dict(acceptance=[0.5], goodput=[1.0], budget=1, utility=-1.0),
    ],
)
def test_bad_input_raises_value_error(kwargs):
    with pytest.raises(ValueError):
        allocate_draft_lengths(**kwargs)


def test_smoothing_hand_computed_three_rounds():
    est = GoodputEstimator(SmoothingConfig(eta=0.5, beta=0.25, initial_acceptance=0.5, initial_goodput=1.0))
    est.join("a")
    est.observe("a", [1.0, 1.0, 0.5, 0.0], num_accepted=2)  # mean 0.625
    assert est.get("a").acceptance == pytest.approx(0.5 * 0.5 + 0.5 * 0.625)  # 0.5625
    assert est.get("a").goodput == pytest.approx(0.75 * 1.0 + 0.25 * 3)  # 1.5
    est.observe("a", [], num_accepted=0)  # drafted nothing: acceptance untouched, x = 1
    assert est.get("a").acceptance == pytest.approx(0.5625)
    assert est.get("a").goodput == pytest.approx(0.75 * 1.5 + 0.25 * 1)  # 1.375
    est.observe("a", [1.0, 1.0], num_accepted=2)
    assert est.get("a").acceptance == pytest.approx(0.5 * 0.5625 + 0.5 * 1.0)  # 0.78125
    assert est.get("a").goodput == pytest.approx(0.75 * 1.375 + 0.25 * 3)  # 1.78125
    assert est.get("a").rounds == 3


def test_clients_join_and_leave():
    est = GoodputEstimator()
    est.join("a")
    est.join("b")
    with pytest.raises(ValueError):
        est.join("a")
    est.observe("b", [1.0], 1)
    est.leave("a")
    assert "a" not in est and len(est) == 1
    with pytest.raises(KeyError):
        est.observe("a", [1.0], 1)
    acc, good = est.arrays(["b"])
    assert acc.tolist() == [pytest.approx(0.5 * 0.8 + 0.2)] and good.tolist() == [1.5]


@pytest.mark.parametrize("ratios,accepted", [([1.2], 1), ([np.nan], 0), ([1.0], 2), ([1.0], -1)])
def test_observe_rejects_bad_input(ratios, accepted):
    est = GoodputEstimator()
    est.join("a")
    with pytest.raises(ValueError):
        est.observe("a", ratios, accepted)


@pytest.mark.parametrize("kwargs", [dict(eta=0.0), dict(beta=1.5), dict(initial_acceptance=2.0), dict(initial_goodput=0.0)])
def test_config_validation(kwargs):
    with pytest.raises(ValueError):
        SmoothingConfig(**kwargs)


def test_the_estimator_counts_the_evidence_behind_each_estimate():
    from goodspeed.scheduler import GoodputEstimator

    est = GoodputEstimator()
    est.join("a"), est.join("b")
    est.observe("a", [1.0, 0.0], 1)
    for _ in range(3):
        est.observe("b", [], 0)  # S = 0: nothing measured
    est.observe("a", [], 0)
    measured, stale = est.evidence(["a", "b"])
    assert measured.tolist() == [1, 0] and stale.tolist() == [1, 3]
    est.observe("b", [1.0], 1)
    assert est.evidence(["b"])[1].tolist() == [0]


def test_warm_start_replaces_the_prior_with_the_first_measurement():
    est = GoodputEstimator(SmoothingConfig(eta=0.2, warm_start=True))
    est.join("a")
    est.observe("a", [], 0)  # S = 0 measures nothing: the prior stays
    assert est.get("a").acceptance == 0.5
    est.observe("a", [1.0, 0.0, 0.0, 0.0], 1)
    assert est.get("a").acceptance == 0.25
    est.observe("a", [1.0], 1)
    assert est.get("a").acceptance == pytest.approx(0.8 * 0.25 + 0.2)  # then eq. 3 as usual
