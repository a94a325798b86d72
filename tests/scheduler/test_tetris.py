import itertools

import numpy as np
import pytest

from goodspeed.scheduler.tetris import presample_scores, select_by_scores, select_tokens, verification_success_rate


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


# ------------------------------------------------------------ sampled drafts: scores before the draw


def test_presample_scores_worked_example_and_monotone():
    scores = np.exp(presample_scores([np.array([0.5, 0.2, 0.9])], [np.array([0.6, 0.9, 0.95])])[0])
    # 0.6; min(0.6, 0.5 * 0.9); min(0.45, 0.5 * 0.2 * 0.95)
    assert scores.tolist() == pytest.approx([0.6, 0.45, 0.095])
    rising = np.exp(presample_scores([np.array([1.0, 1.0])], [np.array([0.2, 0.9])])[0])
    assert rising.tolist() == pytest.approx([0.2, 0.2])  # the running minimum keeps rows non-increasing


def test_deterministic_drafts_score_as_tetris():
    """Greedy drafts (nothing drawn: expectation = the token's own confidence) select as TETRIS."""
    rng = np.random.default_rng(4)
    for _ in range(200):
        probs = [rng.uniform(0, 1, int(rng.integers(0, 6))) for _ in range(int(rng.integers(1, 5)))]
        capacity = int(rng.integers(0, 12))
        np.testing.assert_array_equal(select_by_scores(presample_scores(probs, probs), capacity), select_tokens(probs, capacity))


def test_whether_a_position_is_verified_never_depends_on_its_own_draw():
    """The exactness condition: changing the value drawn at position j (q_j(s_j)) can change how
    many LATER positions are verified, never whether positions <= j are (a stopping time)."""
    rng = np.random.default_rng(11)
    for _ in range(300):
        n = int(rng.integers(1, 5))
        drawn = [rng.uniform(0, 1, int(rng.integers(1, 6))) for _ in range(n)]
        expected = [rng.uniform(0.05, 1, d.size) for d in drawn]
        capacity = int(rng.integers(0, 10))
        before = select_by_scores(presample_scores(drawn, expected), capacity)
        i = int(rng.integers(n))
        j = int(rng.integers(drawn[i].size))
        changed = [d.copy() for d in drawn]
        changed[i][j] = rng.uniform(0, 1)
        after = select_by_scores(presample_scores(changed, expected), capacity)
        assert min(before[i], j + 1) == min(after[i], j + 1)
        if before[i] <= j:  # position j was not verified: nothing that changed could be
            np.testing.assert_array_equal(before, after)


def test_select_by_scores_refuses_rising_or_nan_scores():
    with pytest.raises(ValueError):
        select_by_scores([np.log([0.2, 0.5])], 1)
    with pytest.raises(ValueError):
        select_by_scores([np.array([np.nan])], 1)
    with pytest.raises(ValueError):
        presample_scores([np.array([0.5])], [np.array([0.5, 0.5])])
