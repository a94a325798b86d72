import numpy as np
import pytest

from goodspeed.scheduler.baselines import fixed_draft_lengths, random_draft_lengths


def test_fixed_equal_split_and_rotating_remainder():
    assert fixed_draft_lengths(4, 8).tolist() == [2, 2, 2, 2]
    assert fixed_draft_lengths(3, 7, offset=2).tolist() == [2, 2, 3]
    # Over N rounds every client gets the leftover equally often.
    total = sum(fixed_draft_lengths(3, 7, offset=r) for r in range(3))
    assert total.tolist() == [7, 7, 7]


def test_fixed_budget_below_clients_and_caps():
    assert fixed_draft_lengths(4, 2).tolist() == [1, 1, 0, 0]
    assert fixed_draft_lengths(3, 9, max_lengths=[1, 10, 10]).tolist() == [1, 4, 4]
    assert fixed_draft_lengths(2, 9, max_lengths=[1, 2]).tolist() == [1, 2]
    assert fixed_draft_lengths(0, 5).tolist() == []


def test_random_respects_budget_caps_and_is_reproducible():
    rng = np.random.default_rng(0)
    draws = np.array([random_draft_lengths(4, 12, rng, max_lengths=[3, 12, 12, 12]) for _ in range(2000)])
    assert np.all(draws.sum(axis=1) <= 12) and np.all(draws >= 0) and np.all(draws[:, 0] <= 3)
    # Uniform over compositions: symmetric clients have equal means (C / (N + 1) = 12 / 5).
    assert np.allclose(draws[:, 1:].mean(axis=0), 12 / 5, atol=0.25)
    again = [random_draft_lengths(4, 12, np.random.default_rng(5)) for _ in range(2)]
    np.testing.assert_array_equal(*again)


@pytest.mark.parametrize("call", [lambda: fixed_draft_lengths(2, -1), lambda: fixed_draft_lengths(2, 3, [1])])
def test_bad_input(call):
    with pytest.raises(ValueError):
        call()
