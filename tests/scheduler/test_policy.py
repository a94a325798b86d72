import numpy as np
import pytest

from goodspeed.scheduler import AllocationInputs, allocate_draft_lengths, make_policy


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
    assert make_policy("goodspeed").allocate(inputs()).tolist() == allocate_draft_lengths([0.9, 0.5, 0.2], [3.0, 1.5, 1.1], 10).tolist()
    assert make_policy("fixed").allocate(inputs(1)).tolist() == [3, 4, 3]
    r = make_policy("random").allocate(inputs())
    assert r.sum() <= 10 and r.shape == (3,)
    assert make_policy("goodspeed", utility="throughput").allocate(inputs()).sum() == 10


def test_unknown_policy_and_bad_option():
    with pytest.raises(ValueError, match="known: fixed, goodspeed, random"):
        make_policy("tetrisx")
    with pytest.raises(ValueError):
        make_policy("goodspeed", utility="bogus")
