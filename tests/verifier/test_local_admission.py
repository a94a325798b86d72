"""SLO-aware admission for local serving (goodspeed.verifier.local_admission): the step-time fit,
the rule, and a trace in simulated time where count admission puts every request in one batch too
slow for the SLOs and SLO admission keeps the batch within them (outputs still the target's)."""

import pytest

from goodspeed.scheduler import LatencyModel
from goodspeed.verifier.clocks import SimulatedClock
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from goodspeed.verifier.local import LocalConfig, LocalServing
from goodspeed.verifier.local_admission import SloAdmission, StepTimeModel
from modelkit import greedy_reference, perturbed, tiny_llama

TARGET_COST = LatencyModel(0.0, 2e-3, 0.010)  # a step grows 2 ms a batched token over 10 ms
DRAFT_COST = LatencyModel(0.0, 1e-5, 0.001)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10], [11, 12, 13, 14], [3, 3, 3, 3, 3, 3, 3, 3], [20, 21]]


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


def run(policy_admission, models, slo_ms):
    target, draft = models
    clock = SimulatedClock(TARGET_COST, DRAFT_COST)
    serving = LocalServing(VerificationEngine(target, EngineConfig(seed=3)), draft,
                           LocalConfig(policy="chain", k=2, max_requests=16, admission=policy_admission), clock)
    widest = 0
    for i in range(24):
        serving.submit(PROMPTS[i % 6], max_new_tokens=24, tpot_slo_ms=slo_ms)
    while serving.step() is not None:
        widest = max(widest, serving.num_active)
    return serving, widest


def test_slo_admission_keeps_the_batch_within_its_slos_where_count_admission_breaks_them():
    target = tiny_llama(1)
    models = (target, perturbed(target, 0.3, 2))
    slo_ms = 45.0  # met by a batch of a few requests, not by 16 (each step of 16 chains is ~100 ms)
    by_count, count_widest = run("count", models, slo_ms)
    by_slo, slo_widest = run("slo", models, slo_ms)
    met = {name: sum(r.slo_met for r in s.finished) / len(s.finished) for name, s in (("count", by_count), ("slo", by_slo))}
    assert count_widest == 16 and 1 < slo_widest < 16, (count_widest, slo_widest)
    assert met["count"] <= 0.25 and met["slo"] >= 0.9, met
    for s in (by_count, by_slo):
        assert all(r.generated == greedy_reference(target, r.prompt_ids, 24) for r in s.finished)
