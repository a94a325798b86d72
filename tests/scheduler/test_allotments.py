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


# ----------------------------------------------------------- planned shares (asynchronous rounds)


def started(budget, policy, names, plan=True, max_draft_len=16):
    b = book(budget, policy, max_draft_len)
    b.plan_shares = plan
    for sid in names:
        b.join(sid)
        b.start(sid, 100)
    return b


@pytest.mark.parametrize("plan, expected", [(False, 8), (True, 4)])
def test_a_lone_participant_takes_its_planned_share_not_all_that_is_free(plan, expected):
    """Fixed-S with C = 12 over three drafters is 4 each. Without the plan a drafter verified alone
    while the others hold 2 each is given the 8 they leave free, whatever the policy says."""
    b = started(12, "fixed", "abc", plan)
    b.set("b", 2)
    b.set("c", 2)
    assert b.schedule(["a"], [16], 0).tolist() == [expected]
    assert b.allotted("b") == b.allotted("c") == 2


def test_planned_shares_yield_to_what_the_others_still_hold():
    b = started(12, "fixed", "abc")
    b.set("b", 7)
    b.set("c", 3)
    assert b.schedule(["a"], [16], 0).tolist() == [2]  # planned 4, but only 2 are free
    b.set("c", 8)
    b.set("a", 0)
    b.set("b", 0)
    lengths = b.schedule(["a", "b"], [16, 16], 0)  # planned 4 + 4, 4 free: split by the policy, each <= 4
    assert lengths.tolist() == [2, 2]


def test_the_plan_is_the_policys_split_of_C_among_every_active_drafter():
    """Eq. (5) over all three drafters, each within its cap, the absent one with the cap its request
    had when it was last sized; the lone participant gets its entry of that split."""
    from goodspeed.scheduler.goodspeed import allocate_draft_lengths

    b = started(12, "goodspeed", "abc")
    for sid, ratios in (("a", [1.0, 1.0, 1.0, 0.0]), ("b", [1.0, 0.0, 0.0, 0.0]), ("c", [1.0, 1.0, 0.0, 0.0])):
        b.observe(sid, ratios, ratios.index(0.0))
    b.schedule(["c"], [3], 0)  # c is sized with a cap of 3
    for sid in "abc":
        b.set(sid, 0)
    acceptance, goodput = b.estimator.arrays(["a", "b", "c"])
    plan = allocate_draft_lengths(acceptance, goodput, 12, [16, 16, 3])
    assert plan.sum() == 12 and plan[0] not in (0, 12)
    assert b.schedule(["a"], [16], 1).tolist() == [plan[0]]


@pytest.mark.parametrize("policy", ["goodspeed", "goodspeed-time", "fixed", "random"])
def test_with_every_active_drafter_taking_part_the_plan_changes_nothing(policy):
    books = [started(10, policy, "abcd", plan) for plan in (False, True)]
    rng = np.random.default_rng(1)
    for step in range(30):
        ratios = {sid: rng.integers(0, 2, size=3).astype(float).tolist() for sid in "abcd"}
        for b in books:
            for sid in "abcd":
                b.observe(sid, ratios[sid], 0)
                b.observe_period(sid, step % 4, 0.01 * (1 + "abcd".index(sid)) + 0.002 * (step % 4))
        lengths = [b.schedule(list("abcd"), [16, 16, 5, 16], step) for b in books]
        assert lengths[0].tolist() == lengths[1].tolist()


@pytest.mark.parametrize("policy", ["goodspeed", "goodspeed-time", "fixed", "random"])
def test_planned_steps_never_hold_more_than_C_nor_exceed_a_cap(policy):
    """Random steps of random subsets, requests ending and starting: the allotments outstanding
    never sum to more than C, and no participant is given more than its cap."""
    b = started(20, policy, [f"d{i}" for i in range(8)])
    rng = np.random.default_rng(2)
    names = [f"d{i}" for i in range(8)]
    for step in range(400):
        active = b.active()
        part = [s for s in active if rng.random() < 0.3] or active[:1]
        for sid in part:
            drafted = b.allotted(sid)
            b.observe(sid, [1.0] * drafted, drafted)
            b.observe_period(sid, drafted, 0.005 + 0.03 * names.index(sid) + 0.001 * drafted)
        caps = rng.integers(0, 17, size=len(part)).tolist()
        lengths = b.schedule(part, caps, step)
        assert all(0 <= n <= cap for n, cap in zip(lengths.tolist(), caps))
        assert sum(b.allotted(s) for s in b.active()) <= 20
        if rng.random() < 0.05:
            b.end(part[0])
        for sid in names:
            if sid not in b.active() and rng.random() < 0.5:
                b.start(sid, int(rng.integers(1, 100)))
        assert sum(b.allotted(s) for s in b.active()) <= 20
