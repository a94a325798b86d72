"""Transit decoding (``EngineConfig.transit_tokens``): while a drafter's draft is on the way, the
steps that run decode its next tokens; the draft is then checked against them. Outputs stay the
target's: greedy token for token, sampled in distribution (chi-square, with a negative control)."""

import random

import numpy as np
import pytest

from goodspeed.drafter.runner import DraftRunner
from goodspeed.launch.cluster.inprocess import InProcessDrafter, run_inprocess
from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.verifier import apply
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from goodspeed.verifier.planner import after_decoded
from goodspeed.verifier.types import Draft, SparseProbs
from modelkit import greedy_reference, perturbed, tiny_llama
from statkit import Z_POWER, chi2_critical, chi2_stat, count_first_two, exact_first_two, fits

PROMPTS = [[1, 2, 3], [5], [7, 8, 9, 10, 11, 12, 13], [20, 21], [30, 31, 32, 33]]


def random_delays(seed: int, slow: set[str], most: int):
    """Drafters named in ``slow`` send each draft 0..``most`` steps late (a seeded link); the others at once."""
    rng = random.Random(seed)
    return lambda d: rng.randint(0, most) if d.name in slow else 0


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(0)
    return target, perturbed(target, 0.05, 1), perturbed(target, 0.3, 2)


def test_greedy_outputs_equal_the_target_s_with_drafts_in_transit(models):
    target, good, noisy = models
    engine = VerificationEngine(target, EngineConfig(budget=12, max_draft_len=6, seed=1, transit_tokens=3))
    drafters = [
        InProcessDrafter("near", DraftRunner(good), PROMPTS[:3], max_new_tokens=20, transit=True),
        InProcessDrafter("far", DraftRunner(good), PROMPTS[1:4], max_new_tokens=23, transit=True),
        InProcessDrafter("far-noisy", DraftRunner(noisy), PROMPTS[2:], max_new_tokens=17, transit=True),
        InProcessDrafter("far-old", DraftRunner(good), PROMPTS[3:], max_new_tokens=15),  # did not opt in
    ]
    results = run_inprocess(engine, drafters, delay=random_delays(0, {"far", "far-noisy", "far-old"}, 4))
    for d in drafters:
        assert len(d.outputs) == len(d.prompts)
        for prompt, out in zip(d.prompts, d.outputs):
            assert out == greedy_reference(target, prompt, d.max_new_tokens), (d.name, prompt)
    verdicts = [(v.session_id.split("#")[0], v) for r in results for v in r.verdicts.values()]
    transit = [v for _, v in verdicts if v.num_transit]
    assert transit and all(v.num_transit <= 3 for v in transit)
    assert all(v.num_transit == 0 for name, v in verdicts if name == "far-old")
    # Both ways a draft meets the decoded tokens: its tail verified after them, or dropped.
    assert any(v.num_accepted > v.num_transit for v in transit)
    assert any(v.num_accepted < min(v.num_transit, v.num_drafted) for v in transit)
    assert sum(r.transit_tokens for r in results) == sum(v.num_transit for v in transit)
    assert engine.cache.num_slots == 0


def test_transit_decoding_is_bounded_per_verdict_and_a_matching_draft_keeps_its_tail(models):
    target, good, _ = models
    engine = VerificationEngine(target, EngineConfig(budget=8, max_draft_len=4, seed=1, transit_tokens=2))
    silent = engine.join("silent", transit=True)
    other = engine.join("other")
    engine.start_request(silent, [1, 2, 3], SamplingParams(), 20)
    engine.start_request(other, [5], SamplingParams(), 20)
    committed = len(engine.committed(silent))
    steps = []
    for _ in range(4):  # "other" keeps the steps going; "silent" never sends its draft
        engine.submit(other, Draft(engine.next_round(other), []))
        steps.append(engine.run_round().transit_tokens)
    assert steps == [1, 1, 0, 0]  # at most transit_tokens between two verdicts
    assert len(engine.committed(silent)) == committed + 2
    reference = greedy_reference(target, [1, 2, 3], 20)
    assert engine.committed(silent) == [1, 2, 3] + reference[:2]  # the target's own next tokens
    # Its draft arrives, drafted from the prompt: a draft agreeing with the decoded tokens keeps its tail.
    engine.set_allotment(silent, 4)
    engine.submit(silent, Draft(engine.next_round(silent), reference[:4]))
    verdict = engine.run_round().verdicts[silent]
    assert verdict.num_transit == 2 and verdict.token_ids[:2] == reference[:2]
    assert verdict.num_accepted == 4 and verdict.token_ids == reference[:5]  # 2 decoded, 2 verified, the bonus
    assert engine.committed(silent) == [1, 2, 3] + reference[:5]


def test_a_request_that_ends_in_transit_is_told_with_the_next_verdict(models):
    target, _, _ = models
    engine = VerificationEngine(target, EngineConfig(budget=8, max_draft_len=4, seed=1, transit_tokens=5))
    silent, other = engine.join("silent", transit=True), engine.join("other")
    engine.start_request(silent, [1, 2, 3], SamplingParams(), 2)  # two tokens: both decoded in transit
    engine.start_request(other, [5], SamplingParams(), 50)
    for _ in range(3):
        engine.submit(other, Draft(engine.next_round(other), []))
        engine.run_round()
    reference = greedy_reference(target, [1, 2, 3], 2)
    assert engine.committed(silent) == [1, 2, 3] + reference  # no more than its max_new_tokens
    engine.submit(silent, Draft(engine.next_round(silent), [reference[0]]))  # drafted before: depth 1 was allowed
    result = engine.run_round()
    verdict = result.verdicts[silent]
    assert verdict.finished and verdict.finish_reason == "length" and verdict.token_ids == reference
    assert verdict.num_transit == 2 and verdict.num_accepted == 1 and verdict.next_draft_length == 0
    assert result.verified_tokens == 0  # nothing of the settled draft went through the forward


def test_after_decoded_keeps_the_tail_with_its_q_only_when_the_head_matches():
    sparse = [SparseProbs([t], [1.0]) for t in (4, 5, 6)]
    dense = np.eye(8)[[4, 5, 6]]
    for draft in (Draft(3, [4, 5, 6], sparse_probs=sparse), Draft(3, [4, 5, 6], dense_probs=dense)):
        tail = after_decoded(draft, [4])
        assert list(tail.token_ids) == [5, 6] and tail.round_index == 3
        q = tail.sparse_probs if tail.sparse_probs is not None else tail.dense_probs
        assert [int(np.argmax(r)) for r in q] == [5, 6] if tail.dense_probs is not None else [r.token_ids for r in q] == [[5], [6]]
        assert after_decoded(draft, []) is draft
        assert after_decoded(draft, [5]).token_ids == []  # the head differs
        assert after_decoded(draft, [4, 5, 6]).token_ids == []  # nothing left after the decoded tokens
    assert after_decoded(Draft(0, [4, 5], parents=[-1, 0]), [4]).token_ids == []  # trees: nothing


V = 6
PROMPT = [1, 2, 3]


def run_sampled(target, draft, sampling, per_drafter: int, drafters: int = 8, all_slow: bool = False):
    """``drafters`` sampled drafters, all but the first (``all_slow``: all) behind seeded delays."""
    engine = VerificationEngine(target, EngineConfig(budget=6 * drafters, max_draft_len=3, transit_tokens=2))
    ds = [InProcessDrafter(f"d{i}", DraftRunner(draft), [PROMPT] * per_drafter, sampling, max_new_tokens=3, transit=True)
          for i in range(drafters)]
    results = run_inprocess(engine, ds, delay=random_delays(None, {d.name for d in ds[0 if all_slow else 1:]}, 3))
    return [o for d in ds for o in d.outputs], results


@pytest.fixture(scope="module")
def sampled_models():
    target = tiny_llama(4, vocab=V, init=0.08)
    return target, perturbed(target, 1.0, 5)


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=1.0),
                                      pytest.param(SamplingParams(temperature=1.0, top_k=3), marks=pytest.mark.slow)],
                         ids=["T1", "topk3"])
def test_sampled_outputs_follow_the_target_with_drafts_in_transit(sampled_models, sampling):
    """Drafts in transit, sampled: the first two tokens follow the target (chi-square). The default
    suite runs T = 1; top-k's processing is the same code on every path (test_lossless runs it)."""
    target, draft = sampled_models
    outputs, results = run_sampled(target, draft, sampling, per_drafter=200)
    ok, msg = fits(count_first_two(outputs, V), exact_first_two(target, PROMPT, sampling))
    assert ok, msg
    verdicts = [v for r in results for v in r.verdicts.values()]
    assert sum(v.num_transit > 0 for v in verdicts) > 200 and sum(v.num_accepted > v.num_transit > 0 for v in verdicts) > 20


@pytest.mark.slow  # 35 s; transit rows' sampled test within drafters' steps (T1) runs by default
def test_sampled_outputs_follow_the_target_through_steps_for_transit_rows_alone(sampled_models):
    """Every drafter behind a link: many steps verify no draft and only decode in transit (what the
    round loop runs with ``transit_alone``). The output distribution is still the target's."""
    target, draft = sampled_models
    sampling = SamplingParams(temperature=1.0)
    outputs, results = run_sampled(target, draft, sampling, per_drafter=800, drafters=2, all_slow=True)
    ok, msg = fits(count_first_two(outputs, V), exact_first_two(target, PROMPT, sampling))
    assert ok, msg
    alone = sum(not r.verdicts and r.transit_tokens > 0 for r in results)
    assert alone > 300, alone


def test_a_transit_step_that_looks_at_its_token_is_caught(sampled_models, monkeypatch):
    """Power check: a transit row that throws away token 0 (and draws again next step) biases the
    text; the same test must fail at p < 1e-6 (at twice the honest test's samples: chi2 204 and
    249 in two runs, against 90.5; at its samples 110-117, too close to 88.9)."""
    target, draft = sampled_models
    apply_transit = apply.apply_transit

    def picky(row, outcome, logprobs):
        if outcome.emitted[0] != 0:  # token 0: as if the row never ran (its KV entry is not kept either)
            apply_transit(row, outcome, logprobs)

    monkeypatch.setattr(apply, "apply_transit", picky)
    sampling = SamplingParams(temperature=1.0)
    outputs, _ = run_sampled(target, draft, sampling, per_drafter=200)
    stat, dof = chi2_stat(count_first_two(outputs, V), exact_first_two(target, PROMPT, sampling))
    assert stat > chi2_critical(dof, z=Z_POWER), f"chi2 {stat:.1f}: the test lacks power at p = 1e-6"


def test_transit_rows_only_fill_what_the_drafts_leave_of_the_budget(models):
    target, _, _ = models
    engine = VerificationEngine(target, EngineConfig(budget=3, policy="fixed", max_draft_len=3, seed=1, transit_tokens=4))
    silent = [engine.join(f"silent{i}", transit=True) for i in range(3)]
    other = engine.join("other")
    for sid in silent:
        engine.start_request(sid, [1, 2, 3], SamplingParams(), 20)
    engine.start_request(other, [5], SamplingParams(), 40)
    reference = greedy_reference(target, [5], 40)

    def step(draft_tokens: int) -> int:
        done = len(engine.committed(other)) - 1
        engine.set_allotment(other, draft_tokens)
        engine.submit(other, Draft(engine.next_round(other), reference[done : done + draft_tokens]))
        return engine.run_round().transit_tokens

    assert step(3) == 0  # the draft takes all of C

    def decoded() -> list[int]:
        return [len(engine.committed(sid)) - 3 for sid in silent]

    # What the draft leaves of C, to the sessions with the fewest tokens decoded (ties: slot order).
    assert step(2) == 1 and decoded() == [1, 0, 0]
    assert step(2) == 1 and decoded() == [1, 1, 0]
    assert step(1) == 2 and decoded() == [2, 1, 1]
    assert step(0) == 3 and decoded() == [3, 2, 2]


def test_a_resync_makes_the_tokens_decoded_so_far_the_base_of_the_next_draft(models):
    target, _, _ = models
    engine = VerificationEngine(target, EngineConfig(budget=8, max_draft_len=4, seed=1, transit_tokens=3))
    silent, other = engine.join("silent", transit=True), engine.join("other")
    engine.start_request(silent, [1, 2, 3], SamplingParams(), 20)
    engine.start_request(other, [5], SamplingParams(), 20)
    for _ in range(2):
        engine.submit(other, Draft(engine.next_round(other), []))
        engine.run_round()
    reference = greedy_reference(target, [1, 2, 3], 20)
    engine.set_allotment(silent, 3)
    committed, round_index, length = engine.resync(silent)
    assert committed == [1, 2, 3] + reference[:2] and (round_index, length) == (0, 3)
    engine.submit(silent, Draft(round_index, reference[2:5]))  # drafted from the resynced text
    verdict = engine.run_round().verdicts[silent]
    assert verdict.num_transit == 0 and verdict.num_accepted == 3 and verdict.token_ids == reference[2:6]
