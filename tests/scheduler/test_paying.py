"""The drafter's own length rule (goodspeed.scheduler.paying): the paying length against brute
force, and the estimator on scripted rounds: drafting falls to zero where it does not pay, probes,
and recovers when the text turns repetitive again; the round-cost fit's guards against one odd
round; a lookup's acceptance by its evidence (match length) and its probes."""

import itertools

import numpy as np

import pytest

from goodspeed.scheduler.goodspeed import expected_goodput
from goodspeed.scheduler.paying import (EvidenceAcceptance, PayingLength, paying_batch_lengths, paying_draft_length, paying_lengths,
                                        plain_steps)


@pytest.mark.parametrize("a, draft, rnd, verify", list(itertools.product(
    [0.0, 0.1, 0.35, 0.6, 0.9, 1.0], [0.0, 0.002, 0.02], [0.01, 0.05], [0.0, 0.0005, 0.01])))
def test_the_paying_length_has_the_most_tokens_per_second(a, draft, rnd, verify):
    rates = [float(expected_goodput(a, s)) / (s * (draft + verify) + rnd) for s in range(9)]
    best = paying_draft_length(a, 8, draft, rnd, verify)
    assert rates[best] == max(rates) and best == rates.index(max(rates))  # ties: the smaller length


def test_a_draft_that_costs_nothing_and_is_often_right_takes_its_allotment_and_one_that_is_rarely_right_none():
    assert paying_draft_length(0.9, 6, 0.0, 0.03, 0.0005) == 6
    assert paying_draft_length(0.05, 6, 0.004, 0.03, 0.001) == 0
    with pytest.raises(ValueError):
        paying_draft_length(1.5, 4, 0.0, 0.03, 0.0)


def scripted(rule: PayingLength, key: str, rounds: int, accept_all: bool, allotted: int = 8, round_s=lambda s: 0.03 + 0.004 * s):
    """``rounds`` rounds of a scripted verifier: each drafted token accepted (or none), the round
    costing ``round_s(S)``; the draft model costs 10 ms a token. Returns the lengths drafted."""
    lengths = []
    for _ in range(rounds):
        s = rule.length(key, allotted)
        rule.observe_drafting(0.010 * s, s)
        rule.observe_round(key, s, s if accept_all else 0, round_s(s))
        lengths.append(s)
    return lengths


def test_drafting_falls_to_zero_where_it_does_not_pay_probes_and_recovers():
    rule = PayingLength(probe_every=4)
    first = scripted(rule, "r", 1, accept_all=False)
    assert first == [8]  # nothing measured yet: the allotment
    idle = scripted(rule, "r", 12, accept_all=False)
    assert idle.count(0) >= 9 and set(idle) <= {0, 1}
    assert all(s == 1 for s in idle[idle.index(0):] if s)  # only probes of one token
    again = scripted(rule, "r", 12, accept_all=True)  # the text turned repetitive: every probe accepted
    assert again[-1] >= 4 and again[-1] > max(idle)


def test_rejected_probes_double_the_wait_before_the_next_and_an_accepted_one_resets_it():
    rule = PayingLength(probe_every=4, max_probe_every=16)
    scripted(rule, "r", 1, accept_all=False)
    idle = scripted(rule, "r", 80, accept_all=False)
    probes = [i for i, s in enumerate(idle) if s and i > idle.index(0)]  # after the rule's own lengths fell to 0
    assert set(idle[idle.index(0):]) == {0, 1}
    gaps = np.diff([idle.index(0) - 1] + probes).tolist()
    assert gaps[:3] == [4, 8, 16] and set(gaps[3:]) == {16}, gaps  # probe_every, doubled, then the cap
    again = scripted(rule, "r", 40, accept_all=True)  # the next probe is accepted: the rule drafts again
    first, second = [i for i, s in enumerate(again) if s][:2]
    assert first < 16 and second - first <= 4  # accepted: the wait is probe_every again
    assert max(again) >= 4
    assert PayingLength(probe_every=8).max_probe_every == 64
    with pytest.raises(ValueError):
        PayingLength(probe_every=8, max_probe_every=4)


def test_the_round_cost_is_fitted_from_rounds_of_different_lengths():
    rule = PayingLength()
    for s in (0, 2, 4, 6, 8) * 3:
        rule.observe_round("r", s, s // 2, 0.030 + 0.002 * s)
    base, per_token = rule.round_costs()
    assert base == pytest.approx(0.030) and per_token == pytest.approx(0.002)
    flat = PayingLength(default_verify_ratio=0.05)
    for _ in range(5):
        flat.observe_round("r", 4, 2, 0.036)
    base, per_token = flat.round_costs()  # one length only: the default ratio, consistent with the mean
    assert base * (1 + 0.05 * 4) == pytest.approx(0.036) and per_token == pytest.approx(0.05 * base)


def test_a_requests_acceptance_follows_its_verdicts_and_a_new_one_starts_from_the_pooled_rate():
    rule = PayingLength(decay=0.5)
    assert rule.acceptance("r") == 0.5  # nothing heard yet: the pooled prior
    rule.observe_round("r", 4, 4, 0.03)
    rule.observe_round("r", 4, 4, 0.03)
    assert rule.acceptance("r") > 0.85
    pooled = rule._pooled.rate
    assert 0.5 < pooled < rule.acceptance("r")
    rule.forget("r")
    assert rule.acceptance("r") == pytest.approx(pooled) and rule.acceptance("new") == pytest.approx(pooled)


@pytest.mark.parametrize("seed", range(20))
def test_the_batch_lengths_have_the_most_tokens_per_second(seed):
    rng = np.random.default_rng(seed)
    a = rng.choice([0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0], size=3)
    step, verify, draft = rng.choice([0.01, 0.05]), rng.choice([0.0, 0.001, 0.01]), rng.choice([0.0, 0.002, 0.02])

    def rate(lengths):
        tokens = sum(float(expected_goodput(x, s)) for x, s in zip(a, lengths))
        return tokens / (step + verify * sum(lengths) + draft * max(lengths))

    best = max(rate(s) for s in itertools.product(range(4), repeat=3))
    got = paying_batch_lengths(a, 3, step, verify, draft)
    assert rate(got) == pytest.approx(best) and all(0 <= s <= 3 for s in got)


def test_a_batch_drafts_for_the_requests_that_pay_and_nothing_where_none_does():
    assert paying_batch_lengths([0.9, 0.05, 0.9], 4, 0.03, 0.002, 0.001) == [4, 0, 4]
    assert paying_batch_lengths([0.05] * 8, 6, 0.2, 0.004, 0.003) == [0] * 8


def random_batch(rng, most_forced: int = 2):
    """Three requests' paths (up to ``most_forced`` forced tokens at 1, then a lookup's falling
    probabilities, up to three) and a step's costs, drawn from ``rng``."""
    paths = []
    for _ in range(3):
        forced = int(rng.integers(0, most_forced + 1))
        a = float(rng.choice([0.0, 0.2, 0.5, 0.8, 1.0]))
        paths.append([1.0] * forced + [a ** j for j in range(1, int(rng.integers(0, 4)) + 1)])
    step, verify, draft = rng.choice([0.01, 0.05]), rng.choice([0.0, 0.001, 0.01]), rng.choice([0.0, 0.002, 0.02])

    def rate(lengths):
        tokens = sum(1 + sum(path[:s]) for path, s in zip(paths, lengths))
        return tokens / (step + verify * sum(lengths) + draft * max(lengths))

    return paths, (step, verify, draft), rate


@pytest.mark.parametrize("seed", range(20))
def test_lengths_over_per_position_paths_have_the_most_tokens_per_second(seed):
    """Each request's own non-increasing path (forced tokens at 1, then a lookup's falling
    probabilities), capped by its length, against every combination."""
    paths, (step, verify, draft), rate = random_batch(np.random.default_rng(seed))

    best = max(rate(s) for s in itertools.product(*(range(len(p) + 1) for p in paths)))
    got = paying_lengths(paths, step, verify, draft)
    assert rate(got) == pytest.approx(best) and all(0 <= s <= len(p) for s, p in zip(got, paths))


def test_a_request_with_no_credit_and_nothing_to_draft_holds_the_others_drafts():
    """Under a floor, a request that drafts nothing may be slowed by the others' drafts only by
    its credit: none, then the floor's slack, then two tokens' worth. Negative control: without
    a floor the batch's most tokens a second drafts the paying request's whole path."""
    paths, costs = [[0.9] * 4, []], (0.03, 0.003, 0.0)
    assert paying_lengths(paths, *costs) == [4, 0]
    assert paying_lengths(paths, *costs, credit=[0.0, 0.0], floor=1.0) == [0, 0]
    assert paying_lengths(paths, *costs, credit=[0.0, 0.0], floor=0.9) == [1, 0]  # 1 >= 0.9 * 1.1
    assert paying_lengths(paths, *costs, credit=[0.0, 0.2], floor=1.0) == [2, 0]  # 1.2 >= 1.2
    assert paying_lengths(paths, *costs, credit=[0.0, 5.0], floor=1.0) == [4, 0]


@pytest.mark.parametrize("seed", range(40))
def test_lengths_under_a_floor_keep_every_request_ahead_and_are_the_best_where_the_floor_does_not_bind(seed):
    """Against every combination: the lengths chosen under a floor leave every request's expected
    credit non-negative (or draft nothing), and where the best lengths of all do so too, they are
    chosen; a floor of 0 changes nothing."""
    rng = np.random.default_rng(seed)
    paths, (step, verify, draft), rate = random_batch(rng, most_forced=1)
    credit, floor = list(rng.choice([0.0, 0.05, 0.2, 1.0], size=3)), float(rng.choice([0.9, 0.97, 1.0]))

    def ahead(lengths):
        cost = plain_steps(lengths, step, verify, draft)
        return all(c + 1 + sum(path[:s]) >= floor * cost - 1e-9 for c, path, s in zip(credit, paths, lengths))

    every = list(itertools.product(*(range(len(p) + 1) for p in paths)))
    best = max(every, key=rate)
    got = paying_lengths(paths, step, verify, draft, credit, floor)
    assert ahead(got) or got == [0, 0, 0]
    if ahead(best):
        assert rate(got) == pytest.approx(rate(best))
    assert paying_lengths(paths, step, verify, draft, credit, 0.0) == paying_lengths(paths, step, verify, draft)


@pytest.mark.parametrize("seed", range(20))
def test_lengths_under_a_floor_are_the_best_where_only_a_request_that_cannot_draft_holds_them(seed):
    """A request with nothing to draft and little credit bounds the step's cost, the others'
    credit ample: against every combination, the lengths chosen are the best of those it allows."""
    rng = np.random.default_rng(seed)
    paths = [[a ** j for j in range(1, int(rng.integers(1, 4)) + 1)] for a in rng.choice([0.2, 0.5, 0.8, 1.0], size=2)] + [[]]
    step, verify, draft = rng.choice([0.01, 0.05]), rng.choice([0.0, 0.001, 0.01]), rng.choice([0.0, 0.002, 0.02])
    credit, floor = [100.0, 100.0, float(rng.choice([0.0, 0.05, 0.2, 0.5]))], float(rng.choice([0.9, 0.97, 1.0]))

    def rate(lengths):
        return sum(1 + sum(path[:s]) for path, s in zip(paths, lengths)) / (step + verify * sum(lengths) + draft * max(lengths))

    allowed = [lengths for lengths in itertools.product(*(range(len(p) + 1) for p in paths))
               if credit[2] + 1 >= floor * plain_steps(lengths, step, verify, draft) - 1e-9]
    got = paying_lengths(paths, step, verify, draft, credit, floor)
    assert tuple(got) in allowed and rate(got) == pytest.approx(max(map(rate, allowed)))


def test_a_floor_is_a_fraction_and_credit_one_number_a_request():
    for floor, credit in ((1.5, None), (-0.1, None), (0.9, [0.0]), (0.9, [0.0, float("nan")])):
        with pytest.raises(ValueError):
            paying_lengths([[0.5], [0.5]], 0.03, 0.001, 0.0, credit, floor)


def test_paths_must_be_probabilities_that_do_not_rise():
    for bad in ([[0.5, 0.6]], [[1.2]], [[-0.1]]):
        with pytest.raises(ValueError):
            paying_lengths(bad, 0.03, 0.001, 0.0)
    assert paying_lengths([[], []], 0.03, 0.001, 0.0) == [0, 0]


def test_one_odd_round_does_not_set_the_fitted_cost_of_a_drafted_token():
    """A new batch shape's first forward (here 16x the usual time) among rounds of two lengths: the
    fit leaves it out and, with fewer than three lengths, keeps the default ratio."""
    rule = PayingLength(default_verify_ratio=0.03)
    rule.observe_round("batch", 48, 0, 0.47)
    for s in (0, 0, 5, 0, 0, 0, 5, 0):
        rule.observe_round("batch", s, 0, 0.026 + 0.0007 * s)
    base, per_token = rule.round_costs()
    assert per_token == pytest.approx(0.03 * base) and base == pytest.approx(0.0266, rel=0.05)
    for s in (2, 3, 2, 3):  # more lengths: fitted, and still without the odd round
        rule.observe_round("batch", s, 0, 0.026 + 0.0007 * s)
    base, per_token = rule.round_costs()
    assert base == pytest.approx(0.026) and per_token == pytest.approx(0.0007)


def test_a_lookups_acceptance_is_kept_by_its_evidence_pooled_and_per_request():
    rule = EvidenceAcceptance(decay=0.5, max_evidence=4)
    assert rule.rate("r", 1) == rule.rate("r", 4) == 0.5  # nothing heard: the prior
    for i in range(10):  # short matches rejected at once, long ones taken whole, over many requests
        rule.observe(f"q{i}", 1, 3, 0)
        rule.observe(f"q{i}", 7, 4, 4)
    assert rule.rate("new", 1) < 0.2 and rule.rate("new", 9) > 0.9  # a new request starts from the pools
    assert rule.rate("new", 6) == rule.rate("new", 4)  # matches past max_evidence share one class
    for _ in range(4):  # this request's own short matches are taken: its rate rises, the pool's less
        rule.observe("mine", 1, 2, 2)
    assert rule.rate("mine", 1) > 0.7 > rule.rate("other", 1)
    rule.forget("mine")
    assert rule.rate("mine", 1) == pytest.approx(rule.rate("other", 1))
    rule.observe("r", 1, 0, 0)  # nothing drafted: nothing heard
    with pytest.raises(ValueError):
        EvidenceAcceptance(probe_every=8, max_probe_every=4)


def test_a_class_no_request_drafts_is_probed_and_rejected_probes_double_the_wait():
    rule = EvidenceAcceptance(probe_every=4, max_probe_every=16)
    due_at = []
    for step in range(60):
        due = rule.due_probes(drafting=[5], idle=[1, 5])  # class 5 drafts every step: never idle, never probed
        assert 5 not in due
        if 1 in due:
            due_at.append(step)
            rule.observe("r", 1, 1, 0, probe=True)  # rejected
    gaps = [b - a for a, b in zip([-1] + due_at, due_at)]
    assert gaps[:3] == [4, 8, 16] and set(gaps[3:]) == {16}, gaps
    rule.observe("r", 1, 1, 1, probe=True)  # an accepted probe: the wait is probe_every again
    assert [s for s in range(8) if 1 in rule.due_probes([], [1])] == [3, 7]
    rule.due_probes(drafting=[1], idle=[])  # drafted with a paying length: the wait starts over
    assert [s for s in range(4) if 1 in rule.due_probes([], [1])] == [3]


def test_a_batchs_step_cost_is_fitted_on_its_drafted_tokens_and_its_longest_chain():
    """A step's time grows with the tokens drafted in all and, apart from them, with the longest
    chain: both slopes recovered once the rounds vary them apart; where they never do (one chain a
    round, as on an edge node) the fit is the tokens' alone."""
    batch = PayingLength()
    for drafted, longest in ((0, 0), (1, 1), (6, 1), (6, 6), (8, 1), (12, 6), (3, 2), (48, 6)) * 2:
        batch.observe_round("batch", drafted, 0, 0.027 + 0.0005 * drafted + 0.0012 * longest, longest=longest)
    assert batch.batch_costs() == pytest.approx((0.027, 0.0005, 0.0012))
    chain = PayingLength()
    for drafted in (0, 2, 4, 6, 8) * 3:
        chain.observe_round("r", drafted, 0, 0.030 + 0.002 * drafted)
    assert chain.batch_costs() == pytest.approx((0.030, 0.002, 0.0))
    assert PayingLength().batch_costs() is None
    rising = PayingLength()  # a longer chain that costs less would be a negative slope: not taken
    for drafted, longest in ((0, 0), (4, 1), (4, 4), (8, 2), (8, 8)) * 2:
        rising.observe_round("batch", drafted, 0, 0.030 + 0.002 * drafted - 0.001 * longest, longest=longest)
    assert rising.batch_costs()[2] == 0.0


def test_each_lookup_keeps_what_pays_by_its_evidence_and_one_idle_class_is_probed():
    """keep(): a strong class's proposal kept whole, a weak one's cut to its forced tokens (those
    always kept); when the weak class's wait is over, the first of its proposals keeps one
    looked-up token as a probe, the others none."""
    rule = EvidenceAcceptance(probe_every=2)
    for i in range(10):
        rule.observe(f"q{i}", 1, 3, 0)
        rule.observe(f"q{i}", 8, 4, 4)
    proposals = [("a", 8, 0, 4), ("b", 1, 2, 5), ("c", 1, 0, 3)]
    assert rule.keep(proposals, 0.03, 0.002, 0.0) == [(4, False), (2, False), (0, False)]
    assert rule.keep(proposals, 0.03, 0.002, 0.0) == [(4, False), (3, True), (0, False)]


def test_paying_from_is_the_shortest_match_from_which_every_longer_one_keep_would_draft():
    """paying_from(): the shortest evidence from which every class up to ``max_evidence`` keep()
    would draft a token of (brute force over the classes, probes aside: keep() is called with each
    class's wait far off), 0 where the longest would not; it changes no probe wait."""
    rule = EvidenceAcceptance(max_evidence=6, probe_every=64)
    for i in range(10):  # class 1 half taken, 2 rejected, 3 half taken, 5+ taken whole, 4 untouched (the prior)
        rule.observe(f"q{i}", 1, 2, 1)
        rule.observe(f"q{i}", 2, 3, 0)
        rule.observe(f"q{i}", 3, 2, 1)
        rule.observe(f"q{i}", 5, 4, 4)
    all_costs = ((0.03, 0.002, 0.0), (0.03, 0.01, 0.004), (0.001, 0.05, 0.01))
    got = [rule.paying_from("r", 4, *costs) for costs in all_costs]
    assert got[0] == 3 and got[2] == 0, got  # class 1 pays but 2 does not; the last: no class pays
    assert [s for s in range(64) if 1 in rule.due_probes([], [1])] == [63]  # the waits were not touched
    assert rule.paying_from("r", 0, *all_costs[0]) == 0
    for costs, first in zip(all_costs, got):  # keep() counts waits, far from due here
        pays = [rule.keep([("r", e, 0, 4)], *costs)[0][0] > 0 for e in range(1, 7)]
        last_not_paying = max((e for e in range(1, 7) if not pays[e - 1]), default=0)
        assert first == (0 if not pays[-1] else last_not_paying + 1), (costs, pays)
