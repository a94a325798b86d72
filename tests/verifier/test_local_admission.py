"""SLO admission in local serving (goodspeed.scheduler.admission behind --local-admission slo): a
trace in simulated time where count admission puts every request in one batch too slow for the
SLOs and SLO admission keeps the batch within them (outputs still the target's)."""

from goodspeed.scheduler import LatencyModel
from goodspeed.verifier.clocks import SimulatedClock
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from goodspeed.verifier.local import LocalConfig, LocalServing
from modelkit import greedy_reference, perturbed, tiny_llama

TARGET_COST = LatencyModel(0.0, 2e-3, 0.010)  # a step grows 2 ms a batched token over 10 ms
DRAFT_COST = LatencyModel(0.0, 1e-5, 0.001)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10], [11, 12, 13, 14], [3, 3, 3, 3, 3, 3, 3, 3], [20, 21]]


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
