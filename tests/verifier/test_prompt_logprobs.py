"""Prompt log-probabilities (``prompt_logprobs``; the OpenAI API's ``echo`` with ``logprobs``):
each prompt token's log-probability under the target, and the top ones at its position, read off
the prefill's own logits, equal the target's forward over the prompt, whatever the prefill's
shape (whole or chunked, packed or padded, next to other requests' verification rows); they
come with a request's first verdict only, and asking for them changes no output."""

import pytest
import torch

from goodspeed.lm.decoding.params import MAX_TOP_LOGPROBS, SamplingParams
from goodspeed.verifier import errors
from goodspeed.verifier import planner
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from goodspeed.verifier.model_runner import ModelRunner
from goodspeed.verifier.local import LocalConfig, LocalServing
from goodspeed.verifier.types import Draft
from modelkit import perturbed, reference_ranks, tiny_llama

V = 40
TOP = 3
EARLY = [[1, 2, 3, 4], [5, 6]]  # in progress when the scored prompts arrive
SCORED = [[7], [8, 9], list(range(3, 20)), [(5 * i) % 37 + 1 for i in range(30)]]


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(7, vocab=V, dtype=torch.float32)
    return target, perturbed(target, 0.3, 8)


def reference(target, prompt):
    """log_softmax of the target's logits over the prompt, at each position before a prompt token."""
    with torch.no_grad():
        logits = target(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def check(target, prompt, scores, top):
    assert [lp.token_id for lp in scores] == prompt[1:]
    if len(prompt) == 1:
        return
    rows = reference(target, prompt)
    expected = rows.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
    assert torch.allclose(torch.tensor([lp.logprob for lp in scores]), expected, atol=1e-4)
    for lp, row in zip(scores, rows):
        assert lp.rank in reference_ranks(row, lp.token_id)
        assert len(lp.top) == top
        if top:
            ids, values = zip(*lp.top)
            assert torch.allclose(torch.tensor(values), row.topk(top).values, atol=1e-4)
            assert torch.allclose(torch.tensor(values), row[list(ids)], atol=1e-4)


def serve(models, config: EngineConfig, prompt_logprobs: int | None):
    target, draft = models
    serving = LocalServing(VerificationEngine(target, config), draft, LocalConfig(policy="chain", k=3, budget=16, seed=3))
    events = {}

    def submit(name, prompt, scored):
        serving.submit(prompt, SamplingParams(temperature=0.0), max_new_tokens=8, request_id=name,
                       prompt_logprobs=prompt_logprobs if scored else None,
                       on_event=lambda e: events.setdefault(e.request_id, []).append(e))

    for i, prompt in enumerate(EARLY):
        submit(f"early{i}", prompt, False)
    for _ in range(3):  # the early ones are drafting when the scored prompts' chunks come
        serving.step()
    for i, prompt in enumerate(SCORED):
        submit(f"scored{i}", prompt, True)
    while serving.has_work:
        serving.step()
    return {r.request_id: r for r in serving.finished}, events


@pytest.mark.parametrize("config", [
    dict(), dict(prefill_chunk=4), dict(prefill_chunk=64), dict(packed=False), dict(packed=False, prefill_chunk=5),
    dict(prefill_chunk=7, pad_rows=True)], ids=str)
def test_prompt_logprobs_are_the_targets_own_whatever_the_prefill(models, config):
    engine_config = EngineConfig(budget=16, max_draft_len=4, seed=2, **config)
    finished, events = serve(models, engine_config, TOP)
    plain, _ = serve(models, engine_config, None)
    for i, prompt in enumerate(SCORED):
        req = finished[f"scored{i}"]
        assert req.generated == plain[f"scored{i}"].generated  # scoring the prompt changes no token
        check(models[0], prompt, req.prompt_token_logprobs, TOP)
        first, *rest = [e for e in events[f"scored{i}"] if not e.finished or e.token_ids]
        assert first.prompt_logprobs == req.prompt_token_logprobs  # with the first event only
        assert all(e.prompt_logprobs is None for e in rest) and rest
        assert req.token_logprobs == []  # the completion's are asked for apart (logprobs)
    for i in range(len(EARLY)):
        assert finished[f"early{i}"].prompt_token_logprobs is None
        assert all(e.prompt_logprobs is None for e in events[f"early{i}"])


@pytest.mark.parametrize("chunk", [None, 10])
def test_a_scored_prompt_is_prefilled_in_pieces_of_at_most_a_scoring_block(models, monkeypatch, chunk):
    """A scored prefill computes logits for every prompt token, so it runs in pieces of at most
    SCORE_BLOCK tokens, whole-prompt prefill too (a long prompt's [tokens, V] would not fit); the
    pieces' scores join up, and plain prompts keep their whole chunks."""
    monkeypatch.setattr(planner, "SCORE_BLOCK", 4)
    config = EngineConfig(budget=16, max_draft_len=4, seed=2, prefill_chunk=chunk)
    pieces, run = [], ModelRunner.run

    def watched(self, rows, chunks, request_at):
        pieces.extend((request_at(slot).prompt_logprobs is not None, len(c)) for slot, c in chunks)
        return run(self, rows, chunks, request_at)

    monkeypatch.setattr(ModelRunner, "run", watched)
    finished, _ = serve(models, config, 0)
    for i, prompt in enumerate(SCORED):
        check(models[0], prompt, finished[f"scored{i}"].prompt_token_logprobs, 0)
    assert max(n for scored, n in pieces if scored) == 4
    assert max(n for scored, n in pieces if not scored) == 3  # EARLY[0]'s whole prompt but its last token


def test_the_edge_path_prefill_steps_score_and_the_first_verdict_carries_them(models):
    """Edge sessions: the serving layer runs prefill-only steps (``prefill_step``) while no draft
    is ready; the first verdict of the round after carries the scores, later ones do not."""
    target, _ = models
    engine = VerificationEngine(target, EngineConfig(budget=8, max_draft_len=4, seed=4, prefill_chunk=6))
    prompt = SCORED[3]
    sid = engine.join("edge")
    assert engine.start_request(sid, prompt, SamplingParams(), 20, prompt_logprobs=2) is None
    while engine.has_prefill:
        engine.prefill_step()
    verdicts = []
    for _ in range(3):
        engine.set_allotment(sid, 2)
        engine.submit(sid, Draft(engine.next_round(sid), [1, 2]))
        verdicts.append(engine.run_round().verdicts[sid])
    check(target, prompt, verdicts[0].prompt_logprobs, 2)
    assert all(v.prompt_logprobs is None for v in verdicts[1:])
    other = engine.join("plain")
    engine.start_request(other, [3, 4, 5], SamplingParams(), 2)
    while engine.has_prefill:
        engine.prefill_step()
    engine.submit(other, Draft(engine.next_round(other), []))
    assert engine.run_round().verdicts[other].prompt_logprobs is None


def test_bad_counts_are_refused(models):
    target, draft = models
    engine = VerificationEngine(target, EngineConfig())
    serving = LocalServing(engine, draft, LocalConfig(policy="chain"))
    sid = engine.join("a")
    for bad in (-1, MAX_TOP_LOGPROBS + 1):
        with pytest.raises(errors.MalformedDraftError, match="prompt_logprobs must lie in"):
            serving.submit([1, 2], prompt_logprobs=bad)
        with pytest.raises(errors.MalformedDraftError, match="prompt_logprobs must lie in"):
            engine.start_request(sid, [1, 2], SamplingParams(), 4, prompt_logprobs=bad)
