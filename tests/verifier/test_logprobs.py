"""Verdicts' log-probabilities (``logprobs``, the OpenAI API's field): each committed token's
log-probability under the target, and the top ones at its position, equal what the target's own
forward over the finished text gives, whatever drafted it (chains and trees, greedy and sampled,
several requests in one batch); and asking for them changes no output."""

import pytest
import torch

from goodspeed.lm.decoding.params import MAX_TOP_LOGPROBS, SamplingParams
from goodspeed.verifier import errors
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from goodspeed.verifier.local import LocalConfig, LocalServing
from goodspeed.verifier.types import Draft
from modelkit import perturbed, tiny_llama

V = 40
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
TOP = 3


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(7, vocab=V, dtype=torch.float32)
    return target, perturbed(target, 0.3, 8)


def serve(models, policy: str, sampling: SamplingParams, logprobs: int | None):
    target, draft = models
    engine = VerificationEngine(target, EngineConfig(seed=11))
    serving = LocalServing(engine, draft, LocalConfig(policy=policy, k=3, budget=16, max_depth=3, seed=11))
    events = {}
    for i, prompt in enumerate(PROMPTS):
        serving.submit(prompt, sampling, max_new_tokens=12, request_id=f"r{i}", seed=100 + i, logprobs=logprobs,
                       on_event=lambda e: events.setdefault(e.request_id, []).append(e))
    while serving.has_work:
        serving.step()
    return {r.request_id: r for r in serving.finished}, events


def reference(target, prompt, generated):
    """log_softmax of the target's logits over the whole text, at the positions before each generated token."""
    with torch.no_grad():
        logits = target(torch.tensor([prompt + generated])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : len(prompt) - 1 + len(generated)]


@pytest.mark.parametrize("policy", ["chain", "adaserve"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_each_tokens_logprob_is_the_targets_own(models, policy, temperature):
    sampling = SamplingParams(temperature=temperature)
    finished, events = serve(models, policy, sampling, TOP)
    plain, _ = serve(models, policy, sampling, None)
    for i, prompt in enumerate(PROMPTS):
        req = finished[f"r{i}"]
        assert req.generated == plain[f"r{i}"].generated  # asking for logprobs changes no token
        assert [lp.token_id for lp in req.token_logprobs] == req.generated
        expected = reference(models[0], prompt, req.generated)
        got = torch.tensor([lp.logprob for lp in req.token_logprobs])
        assert torch.allclose(got, expected.gather(1, torch.tensor(req.generated).unsqueeze(1)).squeeze(1), atol=1e-4)
        for lp, row in zip(req.token_logprobs, expected):
            assert lp.rank is None  # ranks come with prompt scores alone (test_prompt_logprobs)
            ids, values = zip(*lp.top)
            assert len(ids) == TOP and list(values) == sorted(values, reverse=True)
            assert torch.allclose(torch.tensor(values), row.topk(TOP).values, atol=1e-4)
            assert torch.allclose(torch.tensor(values), row[list(ids)], atol=1e-4)
        # the events carry them too, one per token, in order
        streamed = [lp for e in events[f"r{i}"] if e.logprobs is not None for lp in e.logprobs]
        assert streamed == req.token_logprobs
        assert plain[f"r{i}"].token_logprobs == []


def test_zero_top_gives_the_chosen_tokens_alone_and_bad_counts_are_refused(models):
    finished, _ = serve(models, "chain", SamplingParams(), 0)
    assert all(lp.top == () for r in finished.values() for lp in r.token_logprobs)
    target, draft = models
    engine = VerificationEngine(target, EngineConfig())
    serving = LocalServing(engine, draft, LocalConfig(policy="chain"))
    for bad in (-1, MAX_TOP_LOGPROBS + 1):
        with pytest.raises(errors.MalformedDraftError, match="logprobs must lie in"):
            serving.submit([1, 2], logprobs=bad)
        sid = engine.join("edge")
        with pytest.raises(errors.MalformedDraftError, match="logprobs must lie in"):
            engine.start_request(sid, [1, 2], SamplingParams(), 4, logprobs=bad)


def test_tokens_decoded_in_transit_carry_theirs_too(models):
    """An edge session whose draft is on the wire: the steps decode its next tokens, and the
    verdict that answers the draft carries those tokens' log-probabilities before the rest."""
    target, _ = models
    engine = VerificationEngine(target, EngineConfig(budget=8, max_draft_len=4, seed=1, transit_tokens=2))
    silent = engine.join("silent", transit=True)
    other = engine.join("other")
    prompt = [1, 2, 3]
    engine.start_request(silent, prompt, SamplingParams(), 20, logprobs=TOP)
    engine.start_request(other, [5], SamplingParams(), 20)
    for _ in range(3):  # "other" keeps the steps going while "silent"'s draft is in transit
        engine.submit(other, Draft(engine.next_round(other), []))
        assert engine.run_round().verdicts[other].logprobs is None  # it did not ask
    decoded = engine.committed(silent)[len(prompt):]
    engine.set_allotment(silent, 4)
    engine.submit(silent, Draft(engine.next_round(silent), [0, 0, 0, 0]))
    verdict = engine.run_round().verdicts[silent]
    assert verdict.num_transit == 2 and verdict.token_ids[:2] == decoded
    generated = engine.committed(silent)[len(prompt):]
    expected = reference(target, prompt, generated)
    assert [lp.token_id for lp in verdict.logprobs] == verdict.token_ids == generated
    assert torch.allclose(torch.tensor([lp.logprob for lp in verdict.logprobs]),
                          expected.gather(1, torch.tensor(generated).unsqueeze(1)).squeeze(1), atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graphs", [False, True])
def test_cuda_logprobs_are_the_targets_also_from_replayed_steps(models, graphs):
    """On the device, the steps eager or replayed as CUDA graphs (their logits are the graph's
    output buffer, read before the next replay): the same log-probabilities as the CPU target's."""
    import copy

    target, draft = models
    engine = VerificationEngine(copy.deepcopy(target).cuda(), EngineConfig(seed=11, cuda_graphs=graphs))
    serving = LocalServing(engine, copy.deepcopy(draft).cuda(), LocalConfig(policy="chain", k=3, seed=11))
    for i, prompt in enumerate(PROMPTS):
        serving.submit(prompt, SamplingParams(temperature=1.0), max_new_tokens=12, request_id=f"r{i}", logprobs=TOP)
    while serving.has_work:
        serving.step()
    for req in serving.finished:
        expected = reference(target, req.prompt_ids, req.generated)
        got = torch.tensor([lp.logprob for lp in req.token_logprobs])
        assert torch.allclose(got, expected.gather(1, torch.tensor(req.generated).unsqueeze(1)).squeeze(1), atol=1e-3)
