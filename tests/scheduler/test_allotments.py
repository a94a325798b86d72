"""DraftAllotments: the budget bookkeeping the verifier and the simulator share."""

import numpy as np
import pytest

from goodspeed.scheduler import DraftAllotments, OwnerSizedAllotments


def book(budget=12, policy="goodspeed", max_draft_len=16):
    return DraftAllotments(budget, policy, max_draft_len=max_draft_len, rng=np.random.default_rng(0))


def test_newcomers_share_the_budget_but_only_what_is_free():
    b = book(12)
    for sid in "abc":
        b.join(sid)
    assert b.start("a", 100) == 12  # alone: the whole budget
    assert b.start("b", 100) == 0  # a holds all 12 this round
    b.schedule(["a", "b"], [b.cap(100)] * 2, 0)
    assert b.allotted("a") + b.allotted("b") <= 12
    b.set("a", 4)
    b.set("b", 4)
    assert b.start("c", 100) == 4  # equal share 12 // 3, and 4 are free


def test_caps_bound_first_and_scheduled_allotments():
    b = book(12, max_draft_len=5)
    b.join("a")
    assert b.cap(3) == 2 and b.cap(1) == 0 and b.cap(100) == 5
    assert b.start("a", 3) == 2  # the last token of a request always comes from the target
    lengths = b.schedule(["a"], [b.cap(100)], 1)
    assert lengths.tolist() == [5]


def test_non_participants_keep_their_allotment_off_the_budget():
    b = book(10, policy="fixed")
    for sid in "abc":
        b.join(sid)
        b.start(sid, 100)
    b.set("c", 6)
    lengths = b.schedule(["a", "b"], [16, 16], 0)
    assert lengths.sum() == 4 and b.allotted("c") == 6


def test_ending_a_request_frees_its_allotment():
    b = book(10)
    b.join("a")
    b.join("b")
    b.start("a", 100)
    b.end("a")
    assert b.allotted("a") == 0 and b.active() == []
    assert b.start("b", 100) == 10


def test_an_owner_sized_book_has_no_budget_and_keeps_its_owners_sizes():
    b = OwnerSizedAllotments()
    b.join("local")
    assert b.start("local", 100) == 0 and b.max_allotment is None and not b.full
    b.set("local", 40)  # any size: the owner's rule (TETRIS, AdaServe, ...) chose it
    b.observe("local", [1.0, 0.5], 2)
    assert list(b.schedule(["local"], [b.cap(100)], 0)) == [40] and b.allotted("local") == 40
    assert b.estimator.get("local").acceptance > 0


def test_a_book_holds_at_most_max_sessions_and_sizes_within_its_budget():
    b = DraftAllotments(10, max_sessions=2)
    b.join("a")
    b.join("b")
    assert b.full
    with pytest.raises(ValueError, match="max_sessions"):
        b.join("c")
    b.start("a", 100)
    with pytest.raises(ValueError, match=r"outside \[0, 10\]"):
        b.set("a", 11)
    b.leave("b")
    assert not b.full


def test_sessions_of_one_device_share_a_utility_term():
    b = book(10)
    for sid in ("d1-r1", "d1-r2"):
        b.join(sid, device="d1")
        b.start(sid, 100)
    b.join("d2")
    b.start("d2", 100)
    for sid, accepted in (("d1-r1", 2), ("d1-r2", 1), ("d2", 3)):
        b.observe(sid, [1.0] * accepted, accepted)
    _, goodput = b.estimator.arrays(["d1-r1", "d1-r2", "d2"])
    device = b.device_goodput(["d1-r1", "d1-r2", "d2"], goodput)
    assert device[0] == device[1] == pytest.approx(goodput[0] + goodput[1])
    assert device[2] == goodput[2]


def test_joining_twice_is_refused():
    b = book()
    b.join("a")
    with pytest.raises(ValueError):
        b.join("a")
    with pytest.raises(ValueError):
        DraftAllotments(-1)


def test_a_policy_object_can_stand_in_for_a_name():
    from goodspeed.scheduler import make_policy

    b = DraftAllotments(10, make_policy("goodspeed", patience=1), rng=np.random.default_rng(0))
    assert b.policy.patience == 1
