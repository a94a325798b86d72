"""Chunked prefill (``EngineConfig.prefill_chunk``): prompts are prefilled inside the steps, at
most one chunk per step, packed next to the verification rows; outputs stay the target's own."""

import functools

import pytest
import torch

from goodspeed.drafter.runner import DraftRunner
from goodspeed.launch.cluster.inprocess import InProcessDrafter, run_inprocess
from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.verifier import errors
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from goodspeed.verifier.types import Draft
from modelkit import greedy_reference, perturbed, tiny_llama

PROMPTS = [[5], [1, 2, 3], list(range(3, 20)), [7, 8, 9, 10, 11, 12, 13], list(range(40, 8, -1))]


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(0)
    return target, perturbed(target, 0.05, 1)


@pytest.mark.parametrize("chunk", [1, 5, 64])
@pytest.mark.parametrize("packed", [True, False])
def test_greedy_output_is_the_targets_whatever_the_chunk(models, chunk, packed):
    """Drafters join mid-run, so prompt chunks share forwards with other drafters' verification."""
    target, draft = models
    engine = VerificationEngine(target, EngineConfig(budget=9, max_draft_len=5, seed=1, prefill_chunk=chunk, packed=packed))
    drafters = [
        InProcessDrafter("a", DraftRunner(draft), PROMPTS[:3], max_new_tokens=12),
        InProcessDrafter("b", DraftRunner(draft), PROMPTS[2:], max_new_tokens=9, join_round=2),
        InProcessDrafter("c", DraftRunner(draft), PROMPTS[::-1], max_new_tokens=7, join_round=5),
    ]
    results = run_inprocess(engine, drafters)
    for d in drafters:
        assert [len(o) for o in d.outputs] == [d.max_new_tokens] * len(d.prompts)
        for prompt, out in zip(d.prompts, d.outputs):
            assert out == greedy_reference(target, prompt, d.max_new_tokens), (d.name, prompt)
    assert all(r.prefill_tokens <= chunk for r in results)
    mixed = [r for r in results if r.prefill_tokens and r.verdicts]
    assert mixed, "no step packed a chunk next to verification rows"
    assert sum(r.prefill_tokens for r in results) == sum(len(p) - 1 for d in drafters for p in d.prompts)
    assert engine.cache.num_slots == 0


def test_a_long_prompt_among_short_ones_gets_kv_of_its_own_and_outputs_stay_the_targets(models):
    """Per-slot KV sizing through the engine: a 300-token prompt, prefilled in chunks next to two
    short drafters' rounds, outgrows the slot cache's pool alone, so its slot moves to buffers of
    its own (the pool stays at 256); every output is still the target's greedy decoding."""
    target, draft = models
    engine = VerificationEngine(target, EngineConfig(budget=9, max_draft_len=4, seed=2, prefill_chunk=64))
    long_prompt = [(7 * i) % 47 + 1 for i in range(300)]
    drafters = [
        InProcessDrafter("a", DraftRunner(draft), PROMPTS[:2], max_new_tokens=30),
        InProcessDrafter("b", DraftRunner(draft), PROMPTS[2:4], max_new_tokens=30),
        InProcessDrafter("long", DraftRunner(draft), [long_prompt], max_new_tokens=20, join_round=2),
    ]
    seen, run_round = [], engine.run_round

    def watched(*args, **kwargs):
        result = run_round(*args, **kwargs)
        seen.append((dict(engine.cache.own_slots), engine.cache.capacity))
        return result

    engine.run_round = watched
    run_inprocess(engine, drafters)
    for d in drafters:
        for prompt, out in zip(d.prompts, d.outputs):
            assert out == greedy_reference(target, prompt, d.max_new_tokens), (d.name, len(prompt))
    assert any(own for own, _ in seen), "the long prompt's slot never left the pool"
    assert {capacity for _, capacity in seen} == {256}


def _engine(models, chunk=4):
    target, _ = models
    return VerificationEngine(target, EngineConfig(budget=6, max_draft_len=3, seed=0, prefill_chunk=chunk))


def test_a_queued_prompt_is_prefilled_one_chunk_per_step_and_cannot_draft_before():
    engine = _engine((tiny_llama(0), None))
    a, b = engine.join("a"), engine.join("b")
    assert engine.start_request(a, [1], SamplingParams(), 8) is not None  # one token: nothing to prefill
    assert engine.start_request(b, list(range(1, 12)), SamplingParams(), 8) is None  # 10 tokens to prefill: queued
    assert engine.has_prefill and engine.prefilling(b) and not engine.prefilling(a)
    with pytest.raises(errors.NoActiveRequestError, match="prefilled"):
        engine.submit(b, Draft(0, []))
    with pytest.raises(errors.NoActiveRequestError, match="prefilled"):
        engine.set_allotment(b, 1)
    engine.submit(a, Draft(0, [3]))
    first = engine.run_round()
    assert first.prefill_tokens == 4 and set(first.verdicts) == {a} and not first.started
    engine.submit(a, Draft(1, []))
    only = engine.prefill_step()  # a prefill-only step leaves the queued draft alone
    assert only.tokens == 4 and not only.started and engine.cache.lengths[engine.slots.slot(b)] == 8
    last = engine.run_round(prefill=False)  # a round that waited behind a chunk carries none
    assert last.prefill_tokens == 0 and set(last.verdicts) == {a}
    done = engine.prefill_step()
    assert done.tokens == 2 and set(done.started) == {b} and done.started[b] >= 0 and not engine.has_prefill
    assert engine.cache.lengths[engine.slots.slot(b)] == 10
    engine.submit(b, Draft(0, []))  # drafting now
    assert set(engine.run_round().verdicts) == {b}


def test_a_request_that_ends_while_prefilling_leaves_no_work():
    engine = _engine((tiny_llama(0), None), chunk=2)
    a, b = engine.join("a"), engine.join("b")
    engine.start_request(a, list(range(1, 9)), SamplingParams(), 4)
    engine.start_request(b, list(range(1, 9)), SamplingParams(), 4)
    engine.prefill_step()
    assert engine.finish_request(a) == list(range(1, 9))
    engine.leave(b)
    assert not engine.has_prefill and engine.cache.num_slots == 0
    assert engine.prefill_step().tokens == 0


def test_prompt_chunks_compute_no_logits(models, monkeypatch):
    """The LM head sees only the verification rows' tokens: ``logits_to_keep`` drops the chunk's."""
    target, _ = models
    engine = VerificationEngine(target, EngineConfig(budget=6, max_draft_len=3, prefill_chunk=16))
    seen = []
    forward = target.forward

    @functools.wraps(forward)  # the engine reads the forward's signature (logits_to_keep, the cache's keyword)
    def spy(*args, **kwargs):
        out = forward(*args, **kwargs)
        seen.append((kwargs["input_ids"].shape[1], out.logits.shape[1]))
        return out

    monkeypatch.setattr(target, "forward", spy)
    a, b = engine.join("a"), engine.join("b")
    engine.start_request(a, [1, 2], SamplingParams(), 6)
    engine.prefill_step()
    engine.start_request(b, list(range(1, 15)), SamplingParams(), 6)
    engine.submit(a, Draft(0, [3, 4]))
    result = engine.run_round()
    assert result.prefill_tokens == 13 and set(result.started) == {b}
    assert seen[-1] == (13 + 3, 3)  # 16 tokens through the layers, logits for a's 3


def test_a_chunk_packed_with_verification_rows_gives_the_same_logits_as_alone(models):
    """The verification rows' logits do not depend on a prompt chunk sharing their forward."""
    target, _ = models
    outs = []
    for with_chunk in (False, True):
        engine = VerificationEngine(target, EngineConfig(budget=6, max_draft_len=3, prefill_chunk=32, seed=3))
        a = engine.join("a")
        engine.start_request(a, [1, 2, 3, 4], SamplingParams(), 6)
        engine.prefill_step()
        if with_chunk:
            b = engine.join("b")
            engine.start_request(b, list(range(5, 30)), SamplingParams(), 6)
        engine.submit(a, Draft(0, [9, 10, 11]))
        rows, _ = engine.planner.rows()
        chunks = engine.planner.chunks()
        assert len(chunks) == int(with_chunk)
        outs.append(engine.runner.run(rows, chunks, engine.sessions.request_at))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-9, rtol=0)
