"""SLO-aware admission (goodspeed.scheduler.admission): the step-time fit and the rule, for local
serving's shared steps and an edge node's rounds apart. The local-serving trace is
tests/verifier/test_local_admission.py."""

import pytest

from goodspeed.scheduler.admission import SloAdmission, StepTimeModel


def test_the_step_time_fit_is_exact_on_a_line_and_silent_before_two_batch_sizes():
    model = StepTimeModel()
    for _ in range(3):
        model.observe(4, 0.05)
    assert model.predict(6) is None  # one batch size: no slope yet
    for n in (1, 2, 8):
        model.observe(n, 0.01 + 0.01 * n)
    model.observe(4, 0.05)
    assert model.predict(6) == pytest.approx(0.07) and model.predict(1) == pytest.approx(0.02)


def test_the_rule_admits_alone_without_slos_and_within_the_tightest():
    rule = SloAdmission()
    for n in range(1, 9):
        rule.observe(n, n, 0.01 + 0.01 * n)  # one token a request a step: TPOT(n) = 0.01 + 0.01 n, measured to n = 8
    assert rule.tpot_s(3) == pytest.approx(0.04)
    assert rule.admits([], 0.001)  # alone: best effort
    assert rule.admits([None, None], None)  # no SLO anywhere
    # TPOT(3) = 0.04 must be within 90% of the tightest SLO: 0.045 admits, 0.044 does not
    assert rule.admits([0.045, None], None) and not rule.admits([0.044, None], None)  # a decoding request's SLO binds
    assert not rule.admits([None, None], 0.044) and rule.admits([None, None], 0.045)  # so does the head's own
    assert not rule.admits([None] * 9, 0.2, admitted_now=1) and rule.admits([None] * 9, 0.2)  # n = 10, past 8 + 1: one a step
    fresh = SloAdmission()  # nothing measured yet: one request joins a step where an SLO is at stake
    assert fresh.admits([0.001], 0.001) and not fresh.admits([0.001], 0.001, admitted_now=1)
    assert fresh.admits([None], None, admitted_now=3)


def test_an_edge_nodes_rounds_fit_the_time_per_token_itself():
    """Rounds observed one request at a time: TPOT(n) is fitted on each round's seconds per token
    (a request gaining fewer tokens a round with more in flight counts), and the rule is the same."""
    from goodspeed.scheduler.admission import RoundAdmission

    rule = RoundAdmission()
    assert rule.tpot_s(2) is None and rule.admits([0.05], 0.05) and not rule.admits([0.05], 0.05, admitted_now=1)
    for n in range(1, 5):  # rounds of 36 ms giving 12 / n tokens: TPOT(n) = 3 n ms
        for _ in range(3):
            rule.observe_round(n, 0.036, 12 // n)
    rule.observe_round(3, 0.0, 2)  # nothing to learn from: ignored
    rule.observe_round(3, 0.036, 0)
    assert rule.tpot_s(4) == pytest.approx(0.012) and rule.tpot_s(2) == pytest.approx(0.006)
    slo = rule.tpot_s(3) / 0.9
    assert rule.admits([slo * 1.01, None], None) and not rule.admits([slo * 0.95, None], None)  # n = 3 against 90% of the tightest
