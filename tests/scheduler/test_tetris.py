import itertools

import numpy as np
import pytest

from goodspeed.scheduler.tetris import select_tokens, verification_success_rate


def objective(draft_probs, lengths):
    return sum(float(np.cumprod(p)[:k].sum()) for p, k in zip(draft_probs, lengths))


def exhaustive(draft_probs, capacity):
    best = -1.0
    for lengths in itertools.product(*(range(len(p) + 1) for p in draft_probs)):
        if sum(lengths) <= capacity:
            best = max(best, objective(draft_probs, lengths))
    return best


def test_equals_exhaustive_search_on_random_instances():
    rng = np.random.default_rng(3)
    for _ in range(400):
        n = int(rng.integers(1, 5))
        probs = [rng.uniform(0, 1, int(rng.integers(0, 5))) ** rng.uniform(0.2, 3) for _ in range(n)]
        capacity = int(rng.integers(0, 12))
        lengths = select_tokens(probs, capacity)
        assert lengths.sum() == min(capacity, sum(len(p) for p in probs))
        assert all(0 <= k <= len(p) for p, k in zip(probs, lengths))
        assert objective(probs, lengths) == pytest.approx(exhaustive(probs, capacity), abs=1e-12)


def test_heap_order_on_ties_and_zeros():
    assert select_tokens([np.array([0.5, 1.0]), np.array([0.5, 1.0])], 3).tolist() == [2, 1]
    assert select_tokens([np.array([0.0, 0.0]), np.array([0.0])], 2).tolist() == [2, 0]


def test_capacity_covers_all_and_empty_batch():
    assert select_tokens([np.array([0.1] * 3), np.array([])], 10).tolist() == [3, 0]
    assert select_tokens([], 4).tolist() == []


@pytest.mark.parametrize("probs,cap", [([np.array([1.1])], 1), ([np.array([np.nan])], 1), ([np.array([0.5])], -1)])
def test_bad_input(probs, cap):
    with pytest.raises(ValueError):
        select_tokens(probs, cap)


def test_vsr():
    assert verification_success_rate(3, 4) == 0.75
    assert verification_success_rate(0, 0) == 0.0
    with pytest.raises(ValueError):
        verification_success_rate(5, 4)


def test_matrix_input_equals_list_input():
    rng = np.random.default_rng(9)
    probs = rng.uniform(0, 1, (20, 6))
    for cap in (0, 7, 50, 200):
        np.testing.assert_array_equal(select_tokens(probs, cap), select_tokens(list(probs), cap))
