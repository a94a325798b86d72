"""An edge node serving the OpenAI API (goodspeed.drafter.node), called with the official client:
its output equals the target's greedy decoding; several requests share one device's sessions;
a client that goes away frees the verifier at once; a dropped session is repaired."""

import asyncio
import json
import re
import time
import urllib.error
import urllib.request

import openai
import pytest
import torch

from goodspeed.serving.generation import GenerationRequest
from goodspeed.drafter import node_requests
from goodspeed.lm.runtime.batch_draft import BatchDraftModel
from goodspeed.lm.runtime.graphs import StepGraphs
from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from apikit import GREEDY, complete_concurrently, metric_samples
from grpckit import NodeThread, ServerThread, older_verifier
from modelkit import adjusted_greedy_reference, chat_pair, greedy_reference, reference_ranks

@pytest.fixture(scope="module")
def models():
    return chat_pair()


def verifier(models, **engine):
    config = dict(budget=8, max_draft_len=6, seed=5) | engine
    return ServerThread(VerificationEngine(models[0], EngineConfig(**config)), round_deadline_ms=500, target_name="tiny")


def node(server, models, **config):
    return NodeThread(server.address, models[1], models[2], **config)


def api_of(edge, api_key="unused"):
    return openai.OpenAI(base_url=edge.base_url, api_key=api_key, max_retries=0)


def reference(models, prompt, n):
    tokenizer = models[2]
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"] if isinstance(prompt, str) else prompt
    return tokenizer.decode(greedy_reference(models[0], ids, n), skip_special_tokens=True)


def test_completions_and_chat_through_a_node_equal_the_targets_greedy_decoding(models):
    tokenizer = models[2]
    messages = [{"role": "user", "content": "parse json"}]
    chat_ids = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"]
    with verifier(models) as server, node(server, models) as edge:
        api = api_of(edge)
        assert [m.id for m in api.models.list().data] == ["tiny"]  # the verifier's target, as the verifier names it
        whole = api.completions.create(model="tiny", prompt="def f(x):", max_tokens=20, **GREEDY)
        streamed = list(api.completions.create(model="tiny", prompt="def f(x):", max_tokens=20, stream=True, **GREEDY))
        chat = api.chat.completions.create(model="tiny", messages=messages, max_tokens=16, **GREEDY)
        chat_stream = list(api.chat.completions.create(model="tiny", messages=messages, max_tokens=16, stream=True,
                                                       stream_options={"include_usage": True}, **GREEDY))
        metrics = metric_samples(edge.port)
    assert whole.choices[0].text == reference(models, "def f(x):", 20) == "".join(c.choices[0].text for c in streamed)
    assert chat.choices[0].message.content == reference(models, chat_ids, 16)
    assert "".join(c.choices[0].delta.content or "" for c in chat_stream if c.choices) == chat.choices[0].message.content
    assert chat_stream[-1].usage.completion_tokens == 16 and chat_stream[-1].usage.prompt_tokens == len(chat_ids)
    # the node's own view: its drafting, its round trips, its acceptance, its requests
    assert metrics["goodspeed:drafter_draft_seconds_count[]"] > 0 and metrics["goodspeed:drafter_round_trip_seconds_count[]"] > 0
    assert metrics["goodspeed:spec_decode_num_draft_tokens_total[]"] >= metrics["goodspeed:spec_decode_num_accepted_tokens_total[]"]
    assert metrics["goodspeed:generation_tokens_total[]"] == 20 + 20 + 16 + 16
    assert metrics["goodspeed:request_success_total[('finished_reason', 'length')]"] == 4
    assert metrics["goodspeed:time_to_first_token_seconds_count[]"] == 4


def test_the_responses_api_through_a_node_is_the_targets_greedy_decoding(models):
    """``/v1/responses`` on a node: the instructions and input rendered as chat completions render
    them, drafted on the device and verified remotely; whole and streamed, the output text is the
    target's greedy decoding (up to EOS or max_output_tokens), and a stored response continues."""
    target, _, tokenizer = models
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "parse json"}]
    chat_ids = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"]
    want = adjusted_greedy_reference(target, chat_ids, SamplingParams(), 16, eos=tokenizer.eos_token_id)
    with verifier(models) as server, node(server, models) as edge:
        api = api_of(edge)
        whole = api.responses.create(model="tiny", instructions="Be brief.", input="parse json", max_output_tokens=16,
                                     temperature=0)
        events = list(api.responses.create(model="tiny", instructions="Be brief.", input="parse json", max_output_tokens=16,
                                           temperature=0, stream=True))
        follow = api.responses.create(model="tiny", previous_response_id=whole.id, input="more", max_output_tokens=4,
                                      temperature=0)
    text = tokenizer.decode([t for t in want if t != tokenizer.eos_token_id], skip_special_tokens=True)
    assert whole.output_text == text and whole.usage.output_tokens == len(want)
    assert whole.usage.input_tokens == len(chat_ids)
    assert whole.status == ("incomplete" if len(want) == 16 and want[-1] != tokenizer.eos_token_id else "completed")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert events[-1].response.output_text == text
    assert follow.status in ("completed", "incomplete") and follow.usage.input_tokens > len(chat_ids)


def test_logprobs_through_a_node_are_the_verifiers(models):
    """The verifier sends each token's log-probabilities with its verdicts; the node's API gives
    them as the verifier's own front does: the target's."""
    tokenizer = models[2]
    prompt_ids = tokenizer("def f(x):", add_special_tokens=False)["input_ids"]
    generated = greedy_reference(models[0], prompt_ids, 20)
    with torch.no_grad():
        logits = models[0](torch.tensor([prompt_ids + generated])).logits[0].float()
    rows = torch.log_softmax(logits, dim=-1)[len(prompt_ids) - 1 : -1]
    expected = rows.gather(1, torch.tensor(generated).unsqueeze(1)).squeeze(1).tolist()
    with verifier(models) as server, node(server, models) as edge:
        api = api_of(edge)
        whole = api.completions.create(model="tiny", prompt="def f(x):", max_tokens=20, logprobs=1, **GREEDY)
        chunks = list(api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                                  logprobs=True, stream=True, **GREEDY))
    lp = whole.choices[0].logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in generated]
    assert lp.token_logprobs == pytest.approx(expected, abs=1e-4)
    assert all(max(top.values()) == pytest.approx(row.max().item(), abs=1e-4) for top, row in zip(lp.top_logprobs, rows))
    content = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(content) == 6 and all(e.top_logprobs == [] for e in content)


def test_echo_through_a_node_scores_the_prompt_as_the_verifier_does(models):
    """The verifier scores the prompt while prefilling it (in chunks here) and sends the scores
    with the first verdict; the node's API opens the text and its log-probabilities with them
    (with max_tokens = 0, they are the whole answer)."""
    tokenizer = models[2]
    prompt_ids = tokenizer("def f(x):", add_special_tokens=False)["input_ids"]
    generated = greedy_reference(models[0], prompt_ids, 10)
    with torch.no_grad():
        logits = models[0](torch.tensor([prompt_ids + generated])).logits[0].float()
    rows = torch.log_softmax(logits, dim=-1)[:-1]
    expected = rows.gather(1, torch.tensor(prompt_ids[1:] + generated).unsqueeze(1)).squeeze(1).tolist()
    with verifier(models, prefill_chunk=3) as server, node(server, models) as edge:
        api = api_of(edge)
        whole = api.completions.create(model="tiny", prompt="def f(x):", max_tokens=10, echo=True, logprobs=1, **GREEDY)
        chunks = list(api.completions.create(model="tiny", prompt="def f(x):", max_tokens=10, echo=True, stream=True, **GREEDY))
        scored = api.completions.create(model="tiny", prompt="def f(x):", max_tokens=0, echo=True, logprobs=1, **GREEDY)
        running = sum(d.in_request for d in server.server.service.drafters.by_session.values())
    lp = whole.choices[0].logprobs
    assert whole.choices[0].text == "def f(x):" + reference(models, "def f(x):", 10)
    assert lp.tokens == [tokenizer.decode([t]) for t in prompt_ids + generated]
    assert lp.token_logprobs[0] is None and lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert chunks[0].choices[0].text == "def f(x):" and "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    # max_tokens = 0: the prompt alone, scored
    assert scored.choices[0].text == "def f(x):" and scored.usage.completion_tokens == 0 and running == 0
    assert scored.choices[0].logprobs.token_logprobs == lp.token_logprobs[: len(prompt_ids)]


def test_prompt_logprobs_through_a_node_carry_the_verifiers_ranks(models, monkeypatch):
    """vLLM's ``prompt_logprobs`` on a chat through a node: each prompt token's log-probability and
    rank under the target, with the first verdict. A verifier older than ``TokenLogprob.rank``
    sends scores without ranks: a 502 that says so, not a response with blank ranks."""
    import goodspeed.verifier.round_loop as round_loop
    from goodspeed.verifier.serde import verdict_to_pb

    tokenizer = models[2]
    messages = [{"role": "user", "content": "hi"}]
    chat_ids = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        rows = torch.log_softmax(models[0](torch.tensor([chat_ids])).logits[0].float(), dim=-1)[:-1]
    with verifier(models, prefill_chunk=3) as server, node(server, models) as edge:
        chat = api_of(edge).chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0,
                                                    extra_body={"prompt_logprobs": 1})
    entries = chat.model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(chat_ids)
    for entry, row, token in zip(entries[1:], rows, chat_ids[1:]):
        assert entry[str(token)]["logprob"] == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[str(token)]["rank"] in reference_ranks(row, token)
        assert min(v["rank"] for v in entry.values()) == 1

    def old_verdict(verdict):
        message = verdict_to_pb(verdict)
        for lp in message.prompt_logprobs:
            lp.ClearField("rank")
        return message

    monkeypatch.setattr(round_loop, "verdict_to_pb", old_verdict)
    with verifier(models) as server, node(server, models) as edge:
        with pytest.raises(openai.APIStatusError, match="without their ranks") as refused:
            api_of(edge).completions.create(model="tiny", prompt="def f(x):", max_tokens=4, temperature=0,
                                            extra_body={"prompt_logprobs": 0})
        running = sum(d.in_request for d in server.server.service.drafters.by_session.values())
    assert refused.value.status_code == 502 and running == 0


def test_a_verifier_that_does_not_score_prompts_is_a_502_for_echo_with_logprobs(models, monkeypatch):
    """A verifier older than StartRequestRequest.prompt_logprobs leaves the reply's flag false;
    echo without logprobs needs nothing of it."""
    older_verifier(monkeypatch, "prompt_logprobs")
    with verifier(models) as server, node(server, models) as edge:
        api = api_of(edge)
        with pytest.raises(openai.APIStatusError, match="does not score prompts") as refused:
            api.completions.create(model="tiny", prompt="def f(x):", max_tokens=8, echo=True, logprobs=0, **GREEDY)
        echoed = api.completions.create(model="tiny", prompt="def f(x):", max_tokens=8, echo=True, **GREEDY)
        running = sum(d.in_request for d in server.server.service.drafters.by_session.values())
    assert refused.value.status_code == 502 and running == 0
    assert echoed.choices[0].text == "def f(x):" + reference(models, "def f(x):", 8)


def test_a_verifier_that_sends_no_logprobs_is_a_502_not_a_silent_gap(models, monkeypatch):
    """A verifier older than StartRequestRequest.logprobs ignores it; the node says so."""
    import goodspeed.verifier.round_loop as round_loop
    from goodspeed.verifier.serde import verdict_to_pb

    def old_verdict(verdict):
        message = verdict_to_pb(verdict)
        del message.logprobs[:]
        return message

    monkeypatch.setattr(round_loop, "verdict_to_pb", old_verdict)
    with verifier(models) as server, node(server, models) as edge:
        api = api_of(edge)
        with pytest.raises(openai.APIStatusError, match="without the log-probabilities") as refused:
            api.completions.create(model="tiny", prompt="def f(x):", max_tokens=8, logprobs=0, **GREEDY)
        plain = api.completions.create(model="tiny", prompt="def f(x):", max_tokens=8, **GREEDY)
    assert refused.value.status_code == 502
    assert plain.choices[0].text == reference(models, "def f(x):", 8)


def test_a_batch_of_prompts_through_a_node_waits_for_sessions_and_equals_the_targets_greedy_decoding(models):
    """Four choices on a node of two sessions: two wait for a session, none is lost."""
    prompts = ["import os", "class A:"]
    with verifier(models) as server, node(server, models, max_concurrency=2) as edge:
        out = api_of(edge).completions.create(model="tiny", prompt=prompts, n=2, max_tokens=12, **GREEDY)
    assert [c.text for c in out.choices] == [reference(models, p, 12) for p in prompts for _ in range(2)]
    assert out.usage.completion_tokens == 48


def test_a_batch_the_node_cannot_queue_is_refused_whole_and_leaves_nothing_behind(models):
    """One session, one waiting place, three choices: 429, and the two admitted are cancelled."""
    with verifier(models) as server, node(server, models, max_concurrency=1, max_waiting=1) as edge:
        api = api_of(edge)
        with pytest.raises(openai.RateLimitError, match="already waiting") as refused:
            api.completions.create(model="tiny", prompt="import os", n=3, max_tokens=200, **GREEDY)
        after = api.completions.create(model="tiny", prompt="import os", max_tokens=12, **GREEDY)
        metrics = metric_samples(edge.port)
        busy = [s for s in server.server.engine.sessions.by_id.values() if s.request is not None]
    assert after.choices[0].text == reference(models, "import os", 12)
    assert metrics["goodspeed:num_requests_running[]"] == 0 and metrics["goodspeed:num_requests_waiting[]"] == 0
    assert metrics["goodspeed:request_success_total[('finished_reason', 'length')]"] == 1  # only the one after
    assert busy == []  # the admitted choice's KV slot is free again (the request after it ran on the same session)
    assert int(refused.value.response.headers["retry-after"]) >= 1  # when to retry, as OpenAI's clients read it


def test_a_refusal_says_when_the_request_nearest_its_end_will_end():
    """The node's retry hint: each request in flight ends after its tokens left at its own pace so
    far (seconds since it arrived per token made); the soonest wins; one second with no pace yet."""
    from types import SimpleNamespace

    from goodspeed.drafter.node import EdgeNode

    def in_flight(arrived_s_ago, made, max_tokens, resumed_at=0):
        return SimpleNamespace(generated=resumed_at + made, timer=SimpleNamespace(arrival=100.0 - arrived_s_ago),
                               request=SimpleNamespace(generated=resumed_at, max_tokens=max_tokens))

    def hint(*requests):
        return EdgeNode.retry_after_s(SimpleNamespace(_in_flight=list(requests)), now=100.0)

    slow_long = in_flight(10.0, 100, 200)  # 0.1 s a token, 100 left: 10 s
    quick_short = in_flight(2.0, 10, 20, resumed_at=5)  # 0.2 s a token, 10 left of its own: 2 s
    assert hint(slow_long) == pytest.approx(10.0) and hint(slow_long, quick_short) == pytest.approx(2.0)
    assert hint() == hint(in_flight(3.0, 0, 50)) == 1.0  # nothing in flight, or no token yet


@pytest.mark.parametrize("graphs", [False, True])
def test_concurrent_requests_share_one_devices_sessions(models, graphs):
    """Also with the node's batched draft forwards at the fixed shapes CUDA graphs replay (run
    eagerly on CPU), which the node warms up before it joins."""
    prompts = ["import os", "class A:", "def f(x):", "return None", "while True:"]
    warmed = []
    with verifier(models) as server:
        phone = node(server, models, name="phone", max_concurrency=2)
        drafter = phone.node.drafter
        if graphs:
            drafter.graphs = StepGraphs(drafter.model, drafter.cache, capture=False)
        warm_up = drafter.warm_up

        def counted_warm_up(*args):  # the node's warm-up, its drafting steps noted
            warmed.append(warm_up(*args))
            return warmed[-1]

        drafter.warm_up = counted_warm_up
        with phone as edge:
            texts = complete_concurrently(api_of(edge), "tiny", prompts, 14)
            engine = server.server.engine
            devices = {engine.allotments.device_of(sid) for sid in engine.session_ids}
            joins = server.events("join")
    assert texts == {p: reference(models, p, 14) for p in prompts}
    assert len(joins) == 2  # max_concurrency sessions, reused by the five requests
    assert devices == {"anonymous/phone"}  # one device: one utility term
    assert (drafter.graphs is not None and drafter.graphs.steps > 0) == graphs
    assert warmed == ([sum(what == "chain" for _, what in BatchDraftModel.WARM_UP_PLAN)] if graphs else [])


def test_a_node_drafting_by_suffix_with_no_model_serves_the_targets_greedy_decoding(models):
    """``--draft suffix``: no draft model at all. Greedy output is the target's; the lookup's
    drafts are accepted; a finished request's output is kept for the next, which then drafts
    from it (the same prompt again: its whole output comes from the node's cache)."""
    from goodspeed.lm.decoding.lookup import SuffixDraft

    source = SuffixDraft(models[0].config.vocab_size)
    prompt = "def f(x): return x\ndef f(x):"
    with verifier(models) as server, NodeThread(server.address, source, models[2], draft_length="allotted") as edge:
        api = api_of(edge)
        first = api.completions.create(model="tiny", prompt=prompt, max_tokens=40, **GREEDY)
        after_first = metric_samples(edge.port)["goodspeed:spec_decode_num_accepted_tokens_total[]"]
        second = api.completions.create(model="tiny", prompt=prompt, max_tokens=40, **GREEDY)
        metrics = metric_samples(edge.port)
    assert first.choices[0].text == second.choices[0].text == reference(models, prompt, 40)
    assert len(source._cached) == 2 and source.slots == {}
    accepted_second = metrics["goodspeed:spec_decode_num_accepted_tokens_total[]"] - after_first
    assert accepted_second > after_first and accepted_second >= 30  # nearly all of it drafted from the first's output


@pytest.mark.parametrize("by_evidence", [True, False])
def test_a_node_keeps_a_lookups_drafts_by_their_evidence(models, monkeypatch, by_evidence):
    """A lookup proposing the target's own text after a long match (evidence 6) and wrong tokens
    after a one-token match (evidence 1), in turn within one request: by evidence the node keeps
    the first whole and drafts little of the second, so most drafted tokens are taken; by the
    request's one acceptance (negative control: the lookup's ``free_proposals`` off) most are
    not. The round costs are fixed (30 ms, 3 ms a drafted token) so the choices follow the verdicts."""
    from goodspeed.lm.decoding.lookup import PromptLookup
    from goodspeed.scheduler.paying import PayingLength

    monkeypatch.setattr(PayingLength, "round_costs", lambda self: (0.030, 0.003))
    target, _, tokenizer = models
    prompt = "def f(x):"
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    text = ids + greedy_reference(target, ids, 60)
    vocab = target.config.vocab_size

    class Oracle(PromptLookup):
        def _propose(self, state, max_tokens):
            done = len(state.tokens)
            if state.tokens != text[:done]:
                return [], 0
            right = text[done : done + max_tokens]
            return (right, 6) if done % 2 == 0 else ([(t + 1) % vocab for t in right], 1)

    source = Oracle(vocab)
    source.free_proposals = by_evidence
    with verifier(models) as server, NodeThread(server.address, source, tokenizer, draft_length="goodput") as edge:
        out = api_of(edge).completions.create(model="tiny", prompt=prompt, max_tokens=60, **GREEDY)
        metrics = metric_samples(edge.port)
    assert out.choices[0].text == reference(models, prompt, 60)
    drafted = metrics["goodspeed:spec_decode_num_draft_tokens_total[]"]
    accepted = metrics["goodspeed:spec_decode_num_accepted_tokens_total[]"]
    if by_evidence:
        assert accepted >= 0.8 * drafted and accepted >= 20, (drafted, accepted)
    else:
        assert accepted < 0.7 * drafted, (drafted, accepted)


def test_a_node_drafts_less_where_its_drafts_are_rejected_and_its_output_stays_the_targets(models, monkeypatch):
    """The goodput rule (goodspeed.scheduler.paying): with drafts the target always rejects, a node
    drafting by the rule sends a fraction of the tokens one drafting every allotment sends (its
    probes), for the same greedy output. The round costs are fixed (a 30 ms round, 3 ms a drafted
    token), so the rule's choices follow the verdicts alone, not this machine's timings."""
    from goodspeed.lm.decoding.lookup import PromptLookup
    from goodspeed.scheduler.paying import PayingLength

    monkeypatch.setattr(PayingLength, "round_costs", lambda self: (0.030, 0.003))

    target, _, tokenizer = models
    prompt = "def f(x):"
    wrong = min(set(range(10, 100)) - set(greedy_reference(target, tokenizer.encode(prompt), 40)))

    class AlwaysWrong(PromptLookup):  # a source that proposes a token the target's greedy text never holds
        def _propose(self, state, max_tokens):
            return [wrong] * max_tokens, 1

    drafted = {}
    for rule in ("allotted", "goodput"):
        with verifier(models) as server, NodeThread(server.address, AlwaysWrong(target.config.vocab_size), tokenizer,
                                                    draft_length=rule) as edge:
            out = api_of(edge).completions.create(model="tiny", prompt=prompt, max_tokens=40, **GREEDY)
            metrics = metric_samples(edge.port)
        assert out.choices[0].text == reference(models, prompt, 40)
        drafted[rule] = (metrics["goodspeed:spec_decode_num_draft_tokens_total[]"],
                         metrics["goodspeed:spec_decode_num_accepted_tokens_total[]"])
    assert drafted["allotted"][1] == drafted["goodput"][1] == 0 and drafted["allotted"][0] >= 40
    assert drafted["goodput"][0] < drafted["allotted"][0] / 3


def test_a_node_whose_drafts_do_not_pay_lets_the_verifier_decode_ahead(models, monkeypatch):
    """A model draft whose drafts never pay (the goodput rule held at 0 but for its probes): the
    node sends one empty draft with ``decode_ahead`` up to its next probe and the verifier decodes
    those rounds by itself, so round trips are a fraction of the rounds; against a verifier that
    does not list the feature (negative control) every round is a round trip. Greedy text is the
    target's, and a seeded sampled request's text is the same token for token either way (the
    rounds draw the same uniforms)."""
    from goodspeed.scheduler.paying import PayingLength

    monkeypatch.setattr(PayingLength, "length", lambda self, request, allotted: self.probed(request, 0))
    prompt, seen = "def f(x):", {}
    for decodes_ahead in (True, False):
        if not decodes_ahead:
            older_verifier(monkeypatch, "decode_ahead")
        with verifier(models) as server, node(server, models, draft_length="goodput") as edge:
            api = api_of(edge)
            out = api.completions.create(model="tiny", prompt=prompt, max_tokens=40, **GREEDY)
            metrics = metric_samples(edge.port)
            sampled = api.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=1.0, seed=7,
                                             extra_body={"ignore_eos": True})
        assert out.choices[0].text == reference(models, prompt, 40)
        seen[decodes_ahead] = (metrics["goodspeed:drafter_round_trip_seconds_count[]"],
                               metrics["goodspeed:spec_decode_num_drafts_total[]"], sampled.choices[0].text)
    (trips, probes, text), (old_trips, old_probes, old_text) = seen[True], seen[False]
    assert probes >= 2 and trips <= 2 * probes + 1 and trips < 40 / 3, seen
    assert old_trips >= 40 - old_probes and text == old_text, seen


def test_a_lookup_whose_proposals_do_not_pay_lets_the_verifier_decode_until_a_match(models, monkeypatch):
    """A lookup whose proposals the target always rejects (a one-token match, never paying under
    fixed round costs): the node sends an empty draft with ``decode_ahead`` and, as
    ``decode_ahead_until_match``, the shortest match from which every longer one would pay
    (:meth:`~goodspeed.scheduler.EvidenceAcceptance.paying_from`); the verifier decodes until one
    may, so round trips are a fraction of the tokens. A lookup that also reads other requests'
    text, and a verifier without the feature (negative controls): every round is a round trip.
    Greedy text is the target's in each (a sampled request's text depends on when the probes
    fall, which the windows move: the rounds decoded ahead are empty rounds, whose sampling
    tests/verifier/test_engine_decode_ahead.py checks)."""
    from goodspeed.lm.decoding.lookup import PromptLookup
    from goodspeed.scheduler.paying import EvidenceAcceptance, PayingLength

    monkeypatch.setattr(PayingLength, "round_costs", lambda self: (0.030, 0.003))
    target, _, tokenizer = models
    prompt = "def f(x):"
    wrong = min(set(range(10, 100)) - set(greedy_reference(target, tokenizer.encode(prompt), 40)))

    class AlwaysWrong(PromptLookup):
        def _propose(self, state, max_tokens):
            return [wrong] * max_tokens, 1

    asked = []
    paying_from = EvidenceAcceptance.paying_from
    monkeypatch.setattr(EvidenceAcceptance, "paying_from", lambda self, *a: asked.append(paying_from(self, *a)) or asked[-1])
    seen = {}
    for case in ("own text", "other requests' text", "older verifier"):
        if case == "older verifier":
            older_verifier(monkeypatch, "decode_ahead_until_match")
        source = AlwaysWrong(target.config.vocab_size)
        source.own_text_only = case != "other requests' text"  # as suffix: matches the verifier cannot see
        with verifier(models) as server, NodeThread(server.address, source, tokenizer, draft_length="goodput") as edge:
            out = api_of(edge).completions.create(model="tiny", prompt=prompt, max_tokens=40, **GREEDY)
            metrics = metric_samples(edge.port)
        assert out.choices[0].text == reference(models, prompt, 40)
        seen[case] = (metrics["goodspeed:drafter_round_trip_seconds_count[]"],
                      metrics["goodspeed:spec_decode_num_drafts_total[]"], len(asked))
    (trips, _, windows), (other_trips, other_probes, other_windows), (old_trips, old_probes, old_windows) = seen.values()
    assert windows >= 2 and other_windows == old_windows == windows and all(0 < n <= 8 for n in asked), (seen, asked)
    assert trips < 40 / 2 and min(other_trips + other_probes, old_trips + old_probes) >= 40, seen


@pytest.mark.parametrize("n", [1, 3])
def test_a_client_that_goes_away_frees_the_request_on_the_verifier(models, n):
    """Every choice's request, when the response had several."""
    with verifier(models) as server, node(server, models) as edge:
        api = api_of(edge)
        stream = api.completions.create(model="tiny", prompt="def f(x):", max_tokens=400, n=n, stream=True, **GREEDY)
        first = next(iter(stream))
        stream.close()  # the application disconnects mid-stream
        for _ in range(500):  # bounded: until the node has told the verifier
            if len(server.events("finish")) == n:
                break
            time.sleep(0.01)
        finish = server.events("finish")
        metrics = metric_samples(edge.port)
        busy = [s for s in server.server.engine.sessions.by_id.values() if s.request is not None]
    assert first.choices[0].text is not None
    assert len(finish) == n and all(f["committed_tokens"] < 3 + 400 for f in finish)  # ended early, by FinishRequest
    assert busy == []  # their KV slots are free
    assert metrics["goodspeed:request_success_total[('finished_reason', 'abort')]"] == n
    assert metrics["goodspeed:num_requests_running[]"] == 0


def test_a_request_cancelled_again_while_it_is_cancelled_still_frees_the_verifier(models):
    """The application's stream is cancelled, and cancelled again while the node tells the
    verifier (a server that cancels a handler twice; the choices of one response, each closed):
    the request still ends on the verifier, and its KV slot and session are free."""
    prompt_ids = models[2]("def f(x):", add_special_tokens=False)["input_ids"]
    with verifier(models) as server, node(server, models) as edge:

        async def cancel_twice():
            deltas = await edge.node.open(GenerationRequest("twice", prompt_ids, 400, SamplingParams(), ()))
            first = asyncio.Event()

            async def consume():
                async for _ in deltas:
                    first.set()

            consumer = asyncio.ensure_future(consume())
            await first.wait()
            consumer.cancel()
            for _ in range(5):  # its cleanup is under way: FinishRequest is in flight
                await asyncio.sleep(0)
            consumer.cancel()
            await asyncio.gather(consumer, return_exceptions=True)

        edge.run(cancel_twice())
        for _ in range(500):  # bounded: until the node's FinishRequest has arrived and its session is back
            if server.events("finish") and edge.node._free:
                break
            time.sleep(0.01)
        finish = server.events("finish")
        busy = [s for s in server.server.engine.sessions.by_id.values() if s.request is not None]
        free = len(edge.node._free)
    assert len(finish) == 1 and finish[0]["committed_tokens"] < len(prompt_ids) + 400
    assert busy == [] and free == 1  # the verifier's KV slot, and the node's session back in its pool


def test_a_request_cancelled_as_its_verdict_arrives_still_ends_on_the_verifier(models, monkeypatch):
    """A request's task is cancelled in the very loop iteration its streamed verdict arrives in
    (its client went away just then): the cancellation stands, and FinishRequest ends the request
    at once. asyncio.wait_for (Python < 3.12) lost it: the request was drafted on to max_tokens for
    no one (the CI flake of test_a_client_that_goes_away_frees_the_request_on_the_verifier[3])."""
    prompt_ids = models[2]("def f(x):", add_special_tokens=False)["input_ids"]
    fired, holder = [], {}

    class CancelOnVerdict(asyncio.Queue):
        def put_nowait(self, item):
            waited_for = bool(self._getters)  # a request is waiting for this session's next verdict
            super().put_nowait(item)
            if item is not None and waited_for and not fired:
                fired.extend(holder["node"]._tasks)  # the requests' tasks, one of them waiting for it
                for task in fired:
                    task.cancel()

    session_init = node_requests.PooledSession.__init__

    def init(self, session_id, stream):
        session_init(self, session_id, stream)
        self.verdicts = CancelOnVerdict()

    monkeypatch.setattr(node_requests.PooledSession, "__init__", init)
    with verifier(models) as server, node(server, models, max_concurrency=2) as edge:
        holder["node"] = edge.node

        async def two_requests():
            streams = [await edge.node.open(GenerationRequest(f"r{i}", prompt_ids, 400, SamplingParams(), ())) for i in range(2)]

            async def consume(deltas):
                async for _ in deltas:
                    pass

            consumers = [asyncio.ensure_future(consume(deltas)) for deltas in streams]
            for _ in range(1000):  # bounded: until a verdict came to a request waiting for it
                if fired:
                    break
                await asyncio.sleep(0.01)
            # Those tasks end, cancelled once (a consumer's cancellation would cancel its task again);
            # a task that lost its cancellation ends at max_tokens (bounded), its consumer with it.
            await asyncio.wait(fired, timeout=50)
            for consumer in consumers:
                consumer.cancel()
            await asyncio.gather(*consumers, return_exceptions=True)

        edge.run(two_requests())
        for _ in range(500):  # bounded: until both FinishRequests have arrived
            if len(server.events("finish")) == 2:
                break
            time.sleep(0.01)
        finish = server.events("finish")
        metrics = metric_samples(edge.port)
    assert fired
    assert len(finish) == 2 and all(f["committed_tokens"] < len(prompt_ids) + 400 for f in finish)
    assert metrics["goodspeed:request_success_total[('finished_reason', 'abort')]"] == 2


def test_a_stop_string_ends_the_request_on_the_verifier_as_finished_not_abandoned(models):
    text = reference(models, "def f(x):", 200)
    stop = text[5:8]
    with verifier(models) as server, node(server, models) as edge:
        out = api_of(edge).completions.create(model="tiny", prompt="def f(x):", max_tokens=200, stop=[stop], **GREEDY)
        for _ in range(500):  # bounded: until the node has ended the request on the verifier
            if server.events("finish") and edge.node._free:
                break
            time.sleep(0.01)
        metrics = metric_samples(edge.port)
        busy = [s for s in server.server.engine.sessions.by_id.values() if s.request is not None]
    assert out.choices[0].text == text[: text.index(stop)] and out.choices[0].finish_reason == "stop"
    assert busy == [] and metrics["goodspeed:request_success_total[('finished_reason', 'stop')]"] == 1
    assert metrics.get("goodspeed:request_success_total[('finished_reason', 'abort')]", 0) == 0


@pytest.mark.parametrize("stream", [True, False])
def test_a_stop_strings_response_ends_without_waiting_for_the_verifier_to_hear_of_it(models, stream):
    """The request a stop string cuts short is cancelled on the verifier (FinishRequest, a round
    trip on an edge link); the client's response (a stream, [DONE] included, or the whole one) does
    not wait for it. Here the node's FinishRequest is held until the response has come; once held,
    it is let go after 30 s at the latest, so that a response that waits for it fails the test
    rather than hangs (by then the text is known: all that is left is sending it)."""
    text = reference(models, "def f(x):", 200)
    stop = text[5:8]
    with verifier(models) as server, node(server, models) as edge:
        gate, held = asyncio.Event(), []
        finish = edge.node.stub.FinishRequest

        async def held_finish(*args, **kwargs):
            held.append(gate.is_set())
            asyncio.get_running_loop().call_later(30, gate.set)
            await gate.wait()
            return await finish(*args, **kwargs)

        edge.node.stub.FinishRequest = held_finish
        out = api_of(edge).completions.create(model="tiny", prompt="def f(x):", max_tokens=200, stop=[stop], stream=stream,
                                              **GREEDY)
        choices = [c.choices[0] for c in out] if stream else out.choices
        ended_while_held = not gate.is_set()
        edge.loop.call_soon_threadsafe(gate.set)
        for _ in range(500):  # bounded: until the held FinishRequest has reached the verifier
            if server.events("finish") and edge.node._free:
                break
            time.sleep(0.01)
        finish_events = server.events("finish")
    assert "".join(c.text for c in choices) == text[: text.index(stop)]
    assert choices[-1].finish_reason == "stop"
    # the response came while no FinishRequest had been let through (held, or not yet made: the
    # cleanup runs after the response); the one FinishRequest was made, and reached the verifier
    assert ended_while_held and len(held) == 1
    assert len(finish_events) == 1


def test_penalties_through_a_node_are_the_targets_adjusted_greedy_decoding_across_a_repair(models):
    """Penalties and a logit bias travel to the verifier, which verifies against the adjusted
    target; when the verifier drops the session mid-request, the node resumes it and says how much
    of its new prompt is output, so the penalties go on counting it: the text is the target's own
    adjusted greedy decoding throughout."""
    tokenizer, target = models[2], models[0]
    prompt_ids = tokenizer("def f(x):", add_special_tokens=False)["input_ids"]
    settings = dict(presence_penalty=1.0, frequency_penalty=0.6, logit_bias={"17": 2.0},
                    extra_body={"repetition_penalty": 1.3, "ignore_eos": True})
    sampling = SamplingParams(presence_penalty=1.0, frequency_penalty=0.6, repetition_penalty=1.3, logit_bias=((17, 2.0),))
    want = tokenizer.decode(adjusted_greedy_reference(target, prompt_ids, sampling, 40), skip_special_tokens=True)
    assert want != reference(models, prompt_ids, 40)
    with verifier(models) as server, node(server, models) as edge:
        api = api_of(edge)
        stream = api.completions.create(model="tiny", prompt=prompt_ids, max_tokens=40, stream=True, temperature=0, **settings)
        chunks = iter(stream)
        pieces = [next(chunks).choices[0].text]
        session = next(s for s, d in server.server.service.drafters.by_session.items() if d.in_request)
        server.run(server.server.service.rounds.drop(session, "dropped by the test"))
        pieces += [c.choices[0].text for c in chunks]
        joins = server.events("join")
    assert "".join(pieces) == want
    assert len(joins) == 2


def test_a_verifier_that_ignores_penalties_is_a_502_not_a_silent_change(models, monkeypatch):
    """A verifier older than the penalties leaves StartRequestReply.extended_sampling false."""
    older_verifier(monkeypatch, "extended_sampling")
    with verifier(models) as server, node(server, models) as edge:
        api = api_of(edge)
        with pytest.raises(openai.APIStatusError, match="min_p, penalties or logit_bias") as refused:
            api.completions.create(model="tiny", prompt="def f(x):", max_tokens=8, presence_penalty=0.5, **GREEDY)
        plain = api.completions.create(model="tiny", prompt="def f(x):", max_tokens=8, **GREEDY)
        running = sum(d.in_request for d in server.server.service.drafters.by_session.values())
    assert refused.value.status_code == 502 and running == 0
    assert plain.choices[0].text == reference(models, "def f(x):", 8)


def test_a_verifier_that_ignores_min_tokens_is_a_502_not_a_silent_change(models, monkeypatch):
    """A verifier older than SamplingParams.min_tokens leaves StartRequestReply.min_tokens false."""
    older_verifier(monkeypatch, "min_tokens")
    with verifier(models) as server, node(server, models) as edge:
        api = api_of(edge)
        with pytest.raises(openai.APIStatusError, match="does not apply min_tokens") as refused:
            api.completions.create(model="tiny", prompt="def f(x):", max_tokens=8, extra_body={"min_tokens": 4}, temperature=0)
        running = sum(d.in_request for d in server.server.service.drafters.by_session.values())
    assert refused.value.status_code == 502 and running == 0


def test_a_verifier_that_ignores_allowed_token_ids_is_a_502_not_a_silent_change(models, monkeypatch):
    """A verifier older than SamplingParams.allowed_token_ids leaves its reply flag false."""
    older_verifier(monkeypatch, "allowed_token_ids")
    with verifier(models) as server, node(server, models) as edge:
        api = api_of(edge)
        with pytest.raises(openai.APIStatusError, match="does not apply allowed_token_ids") as refused:
            api.completions.create(model="tiny", prompt="def f(x):", max_tokens=8, extra_body={"allowed_token_ids": [3, 4]},
                                   temperature=0)
        running = sum(d.in_request for d in server.server.service.drafters.by_session.values())
    assert refused.value.status_code == 502 and running == 0


def test_allowed_token_ids_through_a_node_are_the_verifiers(models):
    """allowed_token_ids reach the verifier (and the node's batched drafts) through a node: the
    output is the target's greedy decoding over the allowed tokens."""
    target, _, tokenizer = models
    prompt_ids = tokenizer("def f(x):", add_special_tokens=False)["input_ids"]
    allowed = tuple(sorted(set(greedy_reference(target, prompt_ids, 12)[::2]) | {5, 9}))
    want = adjusted_greedy_reference(target, prompt_ids, SamplingParams(allowed_token_ids=allowed), 12)
    with verifier(models) as server, node(server, models) as edge:
        out = api_of(edge).completions.create(model="tiny", prompt=prompt_ids, max_tokens=12, temperature=0,
                                              extra_body={"allowed_token_ids": list(allowed), "ignore_eos": True,
                                                          "return_token_ids": True})
    assert out.choices[0].model_extra["token_ids"] == want and set(want) <= set(allowed)


def test_structured_output_through_a_node_is_the_verifiers(models, monkeypatch):
    """A grammar reaches the verifier through a node, which compiles it against its own tokenizer
    (the node's drafts against the node's): the output is the target's constrained greedy
    decoding, ending at EOS. A verifier without a tokenizer refuses it (400); one older than the
    field would ignore it (502)."""
    from goodspeed.lm.decoding.structured import Structure

    target, _, tokenizer = models
    prompt_ids = tokenizer("def f(x):", add_special_tokens=False)["input_ids"]
    regex = r"[a-z]{1,6}\((self|s)\)"
    sampling = SamplingParams(structured=Structure("regex", regex).bound(tokenizer))
    want = adjusted_greedy_reference(target, prompt_ids, sampling, 30, eos=tokenizer.eos_token_id)
    body = dict(model="tiny", prompt=prompt_ids, max_tokens=30, temperature=0,
                extra_body={"structured_outputs": {"regex": regex}, "return_token_ids": True})
    engine = VerificationEngine(target, EngineConfig(budget=8, max_draft_len=6, seed=5))
    with ServerThread(engine, tokenizer=tokenizer, target_name="tiny") as server, node(server, models) as edge:
        out = api_of(edge).completions.create(**body)
    assert out.choices[0].model_extra["token_ids"] == want and want[-1] == tokenizer.eos_token_id
    assert re.fullmatch(regex, out.choices[0].text) and out.choices[0].finish_reason == "stop"
    with verifier(models) as server, node(server, models) as edge:
        with pytest.raises(openai.BadRequestError, match="no tokenizer"):
            api_of(edge).completions.create(**body)
    older_verifier(monkeypatch, "structured_output")
    with ServerThread(VerificationEngine(target, EngineConfig(budget=8)), tokenizer=tokenizer, target_name="tiny") as server, \
            node(server, models) as edge:
        with pytest.raises(openai.APIStatusError, match="does not apply structured output") as refused:
            api_of(edge).completions.create(**body)
    assert refused.value.status_code == 502


def test_a_json_schema_through_a_node_fast_forwards_its_forced_tokens(models):
    """A compact JSON schema through a node: its forced tokens (``{"name":"`` ...) are drafted as
    point masses before the draft model's (the node's forced-token counter), and the output is
    still the target's constrained greedy decoding."""
    import json

    from goodspeed.lm.decoding.structured import Structure

    target, _, tokenizer = models
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"],
              "additionalProperties": False}
    prompt_ids = tokenizer("def f(x):", add_special_tokens=False)["input_ids"]
    sampling = SamplingParams(structured=Structure("json", json.dumps(schema)).bound(tokenizer))
    want = adjusted_greedy_reference(target, prompt_ids, sampling, 30, eos=tokenizer.eos_token_id)
    engine = VerificationEngine(target, EngineConfig(budget=8, max_draft_len=6, seed=5))
    with ServerThread(engine, tokenizer=tokenizer, target_name="tiny") as server, node(server, models, draft_length="allotted") as edge:
        out = api_of(edge).completions.create(model="tiny", prompt=prompt_ids, max_tokens=30, temperature=0, extra_body={
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}, "return_token_ids": True})
        forced = metric_samples(edge.port)["goodspeed:drafter_forced_tokens_total[]"]
    assert out.choices[0].model_extra["token_ids"] == want and json.loads(out.choices[0].text).keys() == {"name"}
    assert forced >= 6  # a whole round's S (max_draft_len) of the nine tokens {"name":" forces


def test_a_forced_tool_call_through_a_node_is_the_verifiers(models):
    """tool_choice naming a function, through a node: the call's arguments are the target's greedy
    decoding held to the function's schema (the verifier compiles it), read into tool_calls."""
    import json

    from goodspeed.lm.decoding.structured import Structure

    target, _, tokenizer = models
    parameters = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
                  "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "pick", "parameters": parameters}}
    blank = {str(i): -100.0 for i in range(len(tokenizer)) if not tokenizer.decode([i]).strip()}  # as test_http_front's
    engine = VerificationEngine(target, EngineConfig(budget=8, max_draft_len=6, seed=5))
    with ServerThread(engine, tokenizer=tokenizer, target_name="tiny") as server, node(server, models) as edge:
        out = api_of(edge).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "pick"}], tools=[tool], max_tokens=40, temperature=0,
            logit_bias=blank, tool_choice={"type": "function", "function": {"name": "pick"}},
            extra_body={"return_token_ids": True})
    sampling = SamplingParams(structured=Structure("json", json.dumps(parameters)).bound(tokenizer),
                              logit_bias=tuple(sorted((int(k), v) for k, v in blank.items())))
    want = adjusted_greedy_reference(target, out.model_extra["prompt_token_ids"], sampling, 40, eos=tokenizer.eos_token_id)
    choice = out.choices[0]
    assert choice.model_extra["token_ids"] == want and want[-1] == tokenizer.eos_token_id
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [("pick", tokenizer.decode(want[:-1]))]
    assert set(json.loads(choice.message.tool_calls[0].function.arguments)) == {"n"} and choice.finish_reason == "stop"


def test_a_grammar_waiting_for_the_reasoning_through_a_node_is_the_verifiers(models, monkeypatch):
    """A node with a reasoning parser on a prompt that leaves the reasoning open sends its grammar
    with ``after_token`` (here a token the tiny target writes, standing for ``</think>``): the
    output is the target's greedy decoding gated the same way; a verifier older than the field
    would hold the reasoning to the grammar (502)."""
    from goodspeed.api import completions as api_completions
    from goodspeed.lm.decoding.structured import Structure

    target, _, tokenizer = models
    messages = [{"role": "user", "content": "scan"}]
    prompt_ids = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                           add_special_tokens=False)["input_ids"]
    free = adjusted_greedy_reference(target, prompt_ids, SamplingParams(), 12)
    gate = free[2]  # the third token the target writes unconstrained
    monkeypatch.setattr(api_completions, "reasoning_end", lambda tokenizer: gate)
    regex = r"[a-z]{1,6}\((self|s)\)"
    sampling = SamplingParams(structured=Structure("regex", regex, after=gate).bound(tokenizer))
    want = adjusted_greedy_reference(target, prompt_ids, sampling, 40, eos=tokenizer.eos_token_id)
    assert want[:3] == free[:3] and want[-1] == tokenizer.eos_token_id
    body = dict(model="tiny", messages=messages, max_tokens=40, temperature=0,
                extra_body={"structured_outputs": {"regex": regex}, "return_token_ids": True})
    engine = VerificationEngine(target, EngineConfig(budget=8, max_draft_len=6, seed=5))
    http = {"reasoning_parser": "qwen3"}
    with ServerThread(engine, tokenizer=tokenizer, target_name="tiny") as server, node(server, models, http=http) as edge:
        out = api_of(edge).chat.completions.create(**body)
    assert out.choices[0].model_extra["token_ids"] == want
    assert re.fullmatch(regex, tokenizer.decode(want[3:-1]))
    older_verifier(monkeypatch, "structured_after")
    engine = VerificationEngine(target, EngineConfig(budget=8, max_draft_len=6, seed=5))
    with ServerThread(engine, tokenizer=tokenizer, target_name="tiny") as server, node(server, models, http=http) as edge:
        with pytest.raises(openai.APIStatusError, match="structured output after the reasoning") as refused:
            api_of(edge).chat.completions.create(**body)
    assert refused.value.status_code == 502


def test_bad_words_through_a_node_are_the_verifiers(models, monkeypatch):
    """bad_words reach the verifier (and the node's batched drafts) through a node, tokenized by
    the node: the output is the target's greedy decoding with them banned; a verifier older than
    the field would ignore them (502)."""
    from goodspeed.api.completions import bad_word_ids

    target, _, tokenizer = models
    prompt_ids = tokenizer("def f(x):", add_special_tokens=False)["input_ids"]
    plain = greedy_reference(target, prompt_ids, 12)
    words = [tokenizer.decode(plain[1:2]), tokenizer.decode(plain[4:6])]
    want = adjusted_greedy_reference(target, prompt_ids, SamplingParams(bad_words=bad_word_ids(tokenizer, words)), 12)
    assert want != plain
    body = dict(model="tiny", prompt=prompt_ids, max_tokens=12, temperature=0,
                extra_body={"bad_words": words, "ignore_eos": True, "return_token_ids": True})
    with verifier(models) as server, node(server, models) as edge:
        out = api_of(edge).completions.create(**body)
    assert out.choices[0].model_extra["token_ids"] == want
    older_verifier(monkeypatch, "bad_words")
    with verifier(models) as server, node(server, models) as edge:
        with pytest.raises(openai.APIStatusError, match="does not apply bad_words") as refused:
            api_of(edge).completions.create(**body)
    assert refused.value.status_code == 502


def test_min_tokens_through_a_node_holds_back_the_stop_token(models):
    """min_tokens reaches the verifier through a node: the output is the target's greedy decoding
    with the stop token (which the plain text emits second) held back until 6 tokens are out."""
    target, _, tokenizer = models
    prompt_ids = tokenizer("def f(x):", add_special_tokens=False)["input_ids"]
    plain = greedy_reference(target, prompt_ids, 30)
    stop_id = plain[1]
    held = adjusted_greedy_reference(target, prompt_ids, SamplingParams(min_tokens=6, eos_token_ids=(stop_id,)), 30)
    end = held.index(stop_id, 6) + 1 if stop_id in held[6:] else 30
    with verifier(models) as server, node(server, models) as edge:
        out = api_of(edge).completions.create(model="tiny", prompt="def f(x):", max_tokens=30, temperature=0, extra_body={
            "ignore_eos": True, "stop_token_ids": [stop_id], "min_tokens": 6, "return_token_ids": True})
    assert out.choices[0].model_extra["token_ids"] == held[:end] and held[:end] != plain[:2]


def test_a_session_the_verifier_drops_mid_request_is_repaired_losslessly(models):
    with verifier(models) as server, node(server, models) as edge:
        api = api_of(edge)
        stream = api.completions.create(model="tiny", prompt="def f(x):", max_tokens=60, stream=True, **GREEDY)
        chunks = iter(stream)
        pieces = [next(chunks).choices[0].text]
        session = next(s for s, d in server.server.service.drafters.by_session.items() if d.in_request)
        server.run(server.server.service.rounds.drop(session, "dropped by the test"))
        pieces += [c.choices[0].text for c in chunks]
        joins = server.events("join")
    assert "".join(pieces) == reference(models, "def f(x):", 60)
    assert len(joins) == 2  # the node joined again and resumed from the verified text


def test_the_verifiers_refusal_reaches_the_application_as_its_http_status(models):
    with verifier(models, max_drafters=1) as server, node(server, models, max_concurrency=2) as edge:
        api = api_of(edge)
        stream = api.completions.create(model="tiny", prompt="def f(x):", max_tokens=300, stream=True, **GREEDY)
        next(iter(stream))  # holds the node's one session
        with pytest.raises(openai.RateLimitError) as refused:  # a second session would pass max_drafters
            api.completions.create(model="tiny", prompt="x", max_tokens=4, **GREEDY)
        stream.close()
        with pytest.raises(openai.BadRequestError) as slo:  # a node admitting by count has no use for an SLO
            api.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body={"tpot_slo_ms": 50})
    assert "RESOURCE_EXHAUSTED" in refused.value.body["message"]
    assert slo.value.body["param"] == "tpot_slo_ms" and "--admission slo" in slo.value.body["message"]


@pytest.mark.parametrize("admission", ["slo", "count"])
def test_slo_admission_holds_requests_the_nodes_time_per_token_cannot_carry(models, monkeypatch, admission):
    """A node admitting by SLO whose fitted time per token is 10 ms a request in flight (set, so
    the test does not hang on this machine's speed): six requests with a 25 ms TPOT SLO sent at
    once run at most two at a time (3 x 10 ms would pass 90% of 25), in the order they came, and
    every output is the target's greedy decoding. The control, by count: all six at once. Past
    max_waiting a request is refused with 429 and when to retry."""
    from goodspeed.drafter import node as node_module

    fitted = node_module.RoundAdmission()
    for n in (1, 2, 3):
        fitted.steps.observe(n, 0.01 * n)
    monkeypatch.setattr(node_module.RoundAdmission, "observe_round", lambda self, *a: None)  # keep the fit as set
    monkeypatch.setattr(node_module, "RoundAdmission", lambda: fitted)
    tokenizer = models[2]
    prompts = ["def f(x):", "class A:", "import os", "for i in", "return {", "if x:"]
    widest, order = [0], []
    with verifier(models, max_drafters=16) as server, node(server, models, max_concurrency=8, max_waiting=5,
                                                            admission=admission) as edge:
        original = edge.node._admit_by_slo

        async def watched(request):
            await original(request)
            order.append(request.prompt_ids)
            widest[0] = max(widest[0], len(edge.node._in_flight) + 1)

        monkeypatch.setattr(edge.node, "_admit_by_slo", watched)

        async def six():
            async def one(prompt):
                ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
                request = GenerationRequest(prompt, ids, 12, SamplingParams(), (), tpot_slo_ms=25.0 if admission == "slo" else None)
                text = []
                async for delta in await edge.node.open(request):
                    text += delta.token_ids
                return text

            return await asyncio.gather(*(one(p) for p in prompts))

        outputs = edge.run(six())
        if admission == "slo":
            flooding = [GenerationRequest(f"w{i}", [5, 6], 200, SamplingParams(), (), tpot_slo_ms=25.0) for i in range(8)]

            async def flood():  # two run, five wait, the last are refused; then the clients go away
                opened = await asyncio.gather(*(edge.node.open(r) for r in flooding), return_exceptions=True)
                for deltas in opened:
                    if not isinstance(deltas, Exception):
                        await deltas.aclose()
                return opened

            results = edge.run(flood())
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    assert outputs == [greedy_reference(models[0], i, 12) for i in ids]
    if admission == "slo":
        assert widest[0] == 2 and order[:6] == ids
        refused = [r for r in results if isinstance(r, Exception)]
        assert refused and all(getattr(r, "kind", None) == "overloaded" and r.retry_after_s > 0 for r in refused)
    else:
        assert widest[0] == 6


@pytest.mark.parametrize("code, status", [("UNAVAILABLE", 503), ("CANCELLED", 503), ("RESOURCE_EXHAUSTED", 429),
                                          ("INVALID_ARGUMENT", 400), ("DEADLINE_EXCEEDED", 504), ("INTERNAL", 502)])
def test_each_verifier_status_is_the_http_status_an_application_retries_on(code, status):
    """A verifier that stopped with the node's call in flight answers CANCELLED or UNAVAILABLE
    (a race inside gRPC): both must say 503, so an application retries either the same way."""
    import grpc

    from goodspeed.api.errors import ApiError
    from goodspeed.drafter.serde import refusal

    error = refusal("a round", grpc.aio.AioRpcError(getattr(grpc.StatusCode, code), grpc.aio.Metadata(), grpc.aio.Metadata(), "gone"))
    assert ApiError.of(error).status == status and f"{code}: gone" in error.message  # the node's kind, as the API says it


def test_an_api_key_guards_the_node(models):
    with verifier(models) as server, node(server, models, api_key="sesame") as edge:
        with pytest.raises(openai.AuthenticationError):
            api_of(edge, "wrong").models.list()
        assert api_of(edge, "sesame").models.list().data[0].id == "tiny"


def test_the_nodes_health_follows_its_verifier(models):
    def health(edge):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{edge.port}/health", timeout=5) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            return exc.code

    server = verifier(models).__enter__()
    with node(server, models) as edge:
        assert health(edge) == 200
        server.__exit__(None, None, None)  # the verifier goes away
        for _ in range(100):  # bounded: the node checks every HEALTH_EVERY_S
            if health(edge) == 503:
                break
            time.sleep(0.1)
        assert health(edge) == 503
        with pytest.raises(openai.InternalServerError) as refused:  # new requests: 503 at once
            api_of(edge).completions.create(model="tiny", prompt="x", max_tokens=2)
    assert refused.value.status_code == 503


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graphs", [False, True])
def test_a_cuda_node_and_verifier_serve_the_targets_greedy_decoding(models, graphs):
    """An edge node with its draft on a GPU (batched drafting of concurrent requests on the device)
    against a CUDA verifier, called through the OpenAI client: each completion is the target's own;
    also with both sides' forwards replayed as CUDA graphs (``cuda_graphs``)."""
    import copy

    target, draft, tokenizer = models
    prompts = ["import os", "class A:", "def f(x):", "return None", "while True:"]
    engine = VerificationEngine(copy.deepcopy(target).cuda(), EngineConfig(budget=8, max_draft_len=6, seed=5, cuda_graphs=graphs))
    with ServerThread(engine, round_deadline_ms=500, target_name="tiny") as server, \
            NodeThread(server.address, copy.deepcopy(draft).cuda(), tokenizer, name="gpu", max_concurrency=3,
                       cuda_graphs=graphs) as edge:
        texts = complete_concurrently(api_of(edge), "tiny", prompts, 14)
        if graphs:
            assert engine.graphs.replays > 0 and edge.node.drafter.graphs.replays > 0
    assert texts == {p: reference(models, p, 14) for p in prompts}


def test_hostile_nesting_through_a_node_is_a_400_that_names_the_limit(models):
    """The edge node's front: a body nested 20,000 levels deep, and a schema sent as text nested
    1,000 levels deep, are each a 400 naming the limit; the node keeps serving."""
    from goodspeed.lm.decoding.structured import MAX_JSON_DEPTH

    deep = '{"type": "object", "properties": {"a": ' * 1000 + '{"type": "string"}' + "}}" * 1000
    with verifier(models) as server, node(server, models) as edge:
        def honest() -> str:
            return api_of(edge).completions.create(model="tiny", prompt="def f(x):", max_tokens=4, temperature=0).choices[0].text

        before = honest()
        for body in (b"[" * 20_000 + b"]" * 20_000,
                     json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 4, "guided_json": deep}).encode()):
            request = urllib.request.Request(edge.base_url + "/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=30)
            assert refused.value.code == 400
            assert f"nested deeper than {MAX_JSON_DEPTH} levels" in json.loads(refused.value.read())["error"]["message"]
        assert honest() == before  # still serving, the same text
