import numpy as np
import pytest

from goodspeed.scheduler import AllocationInputs, SmoothingConfig, allocate_draft_lengths, default_eta, make_policy, smoothing_of


def inputs(round_index=0):
    return AllocationInputs(
        drafter_ids=["a", "b", "c"],
        acceptance=np.array([0.9, 0.5, 0.2]),
        goodput=np.array([3.0, 1.5, 1.1]),
        budget=10,
        max_lengths=None,
        round_index=round_index,
        rng=np.random.default_rng(0),
    )


def test_policies_by_name():
    expected = allocate_draft_lengths([0.9, 0.5, 0.2], [3.0, 1.5, 1.1], 10).tolist()
    assert make_policy("goodspeed-paper").allocate(inputs()).tolist() == expected
    assert make_policy("goodspeed").allocate(inputs()).tolist() == expected  # no evidence given: no floor
    assert make_policy("fixed").allocate(inputs(1)).tolist() == [3, 4, 3]
    r = make_policy("random").allocate(inputs())
    assert r.sum() <= 10 and r.shape == (3,)
    assert make_policy("goodspeed-paper", utility="throughput").allocate(inputs()).sum() == 10


def test_each_policy_names_the_smoothing_it_was_chosen_with():
    assert default_eta("goodspeed") == 0.1 and default_eta("goodspeed-paper") == 0.2
    assert smoothing_of("goodspeed").eta == 0.1 and smoothing_of("goodspeed", eta=0.3, beta=0.4) == SmoothingConfig(0.3, 0.4)
    with pytest.raises(ValueError, match="unknown policy"):
        default_eta("nope")


def test_unknown_policy_and_bad_option():
    with pytest.raises(ValueError, match="known: fixed, goodspeed, goodspeed-paper, goodspeed-time, goodspeed-ucb, random"):
        make_policy("tetrisx")
    with pytest.raises(ValueError):
        make_policy("goodspeed", utility="bogus")


def with_evidence(acceptance, goodput, budget, caps, measured, stale):
    return AllocationInputs(["d%d" % i for i in range(len(acceptance))], np.array(acceptance, dtype=float),
                            np.array(goodput, dtype=float), budget, None if caps is None else np.array(caps),
                            0, np.random.default_rng(0), np.array(measured), np.array(stale))


def test_the_exploration_floor_is_the_exact_optimum_under_the_floor():
    """Exhaustively on small cases: stale drafters get >= 1, the rest maximises eq. (5)'s objective."""
    import itertools

    from goodspeed.scheduler.goodspeed import allocation_objective

    rng = np.random.default_rng(7)
    policy = make_policy("goodspeed", patience=3)
    for _ in range(150):
        n = int(rng.integers(2, 5))
        a = rng.uniform(0.0, 1.0, n).round(2)
        x = rng.uniform(1.0, 4.0, n)
        caps = rng.integers(0, 5, n)
        budget = int(rng.integers(0, 9))
        stale = rng.integers(0, 8, n)
        got = policy.allocate(with_evidence(a, x, budget, caps, [5] * n, stale))
        floored = (stale > 3) & (caps > 0)
        if floored.sum() > budget:
            continue  # then only the stalest are floored (checked below)
        feasible = [s for s in itertools.product(*(range(c + 1) for c in caps))
                    if sum(s) <= budget and all(s[i] >= 1 for i in np.flatnonzero(floored))]
        best = max(allocation_objective(a, x, np.array(s)) for s in feasible)
        assert got.sum() <= budget and np.all(got <= caps) and np.all(got[floored] >= 1)
        assert allocation_objective(a, x, got) >= best - 1e-9


def test_without_stale_drafters_exploration_is_the_papers_rule():
    a, x = [0.9, 0.5, 0.2], [3.0, 1.5, 1.1]
    got = make_policy("goodspeed").allocate(with_evidence(a, x, 10, None, [9, 9, 9], [0, 2, 8]))
    assert got.tolist() == allocate_draft_lengths(a, x, 10).tolist()


def test_the_stalest_are_floored_first_when_the_budget_is_short():
    got = make_policy("goodspeed", patience=1).allocate(with_evidence([0.9, 0.1, 0.1, 0.1], [1, 1, 1, 1], 2, None,
                                                                                [9, 1, 1, 1], [0, 5, 9, 7]))
    assert got.tolist() == [0, 0, 1, 1]


def test_optimism_shrinks_with_evidence():
    policy = make_policy("goodspeed-ucb")
    a, x = [0.6, 0.3], [2.0, 2.0]
    little = policy.allocate(with_evidence(a, x, 6, None, [100, 1], [0, 0]))  # the weak one barely measured
    much = policy.allocate(with_evidence(a, x, 6, None, [100, 100], [0, 0]))
    assert little[1] > much[1]
    assert make_policy("goodspeed-ucb", bonus=0.0).allocate(with_evidence(a, x, 6, None, [1, 1], [0, 0])).tolist() == \
        allocate_draft_lengths(a, x, 6).tolist()  # no bonus: the paper's rule


def test_remedy_options_are_checked():
    with pytest.raises(ValueError, match="exponent > 0"):
        make_policy("goodspeed", utility="throughput")
    with pytest.raises(ValueError):
        make_policy("goodspeed", patience=-1)
    with pytest.raises(ValueError):
        make_policy("goodspeed-ucb", bonus=-1.0)
