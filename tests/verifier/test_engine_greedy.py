"""Greedy generation through the engine equals the target's own greedy decoding, token for token."""

import pytest

from goodspeed.drafter.runner import DraftRunner
from goodspeed.launch.cluster.inprocess import InProcessDrafter, run_inprocess
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from modelkit import greedy_reference, perturbed, tiny_llama

PROMPTS = [[1, 2, 3], [5], [7, 8, 9, 10, 11, 12, 13], [20, 21], [30, 31, 32, 33]]


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(0)
    drafts = [perturbed(target, 0.05, 1), perturbed(target, 0.3, 2), tiny_llama(3, layers=1)]
    return target, drafts


@pytest.mark.parametrize("policy", ["goodspeed", "fixed", "random"])
def test_every_policy_matches_target_greedy_with_joins_and_leaves(models, policy):
    target, drafts = models
    engine = VerificationEngine(target, EngineConfig(budget=9, policy=policy, max_draft_len=6, seed=1))
    drafters = [
        InProcessDrafter("good", DraftRunner(drafts[0]), PROMPTS[:3], max_new_tokens=20),
        InProcessDrafter("noisy", DraftRunner(drafts[1]), PROMPTS[2:], max_new_tokens=13, join_round=3),
        InProcessDrafter("weak", DraftRunner(drafts[2]), PROMPTS[1:3], max_new_tokens=17, join_round=1),
        InProcessDrafter("quitter", DraftRunner(drafts[0]), PROMPTS[:1] * 4, max_new_tokens=25, leave_round=6),
    ]
    results = run_inprocess(engine, drafters)
    for d in drafters[:3]:
        assert len(d.outputs) == len(d.prompts)
        for prompt, out in zip(d.prompts, d.outputs):
            assert out == greedy_reference(target, prompt, d.max_new_tokens), (d.name, prompt)
    assert drafters[3].outputs == [] and engine.cache.num_slots == 0  # left mid-request: freed
    assert all(sum(r.draft_lengths.values()) <= 9 for r in results)
    accepted = sum(v.num_accepted for r in results for v in r.verdicts.values())
    assert accepted > 0


def test_eos_stops_a_request_early(models):
    target, drafts = models
    prompt = PROMPTS[0]
    reference = greedy_reference(target, prompt, 30)
    eos = reference[5]
    cut = reference.index(eos) + 1
    engine = VerificationEngine(target, EngineConfig(budget=4))
    d = InProcessDrafter("a", DraftRunner(drafts[0]), [prompt], max_new_tokens=30)
    run_inprocess(engine, [d], eos_token_ids=[eos])
    assert d.outputs == [reference[:cut]]
