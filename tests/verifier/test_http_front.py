"""The verifier's OpenAI-compatible front (``--http-port``), called with the official client:
local serving's output through the API equals the target's own greedy decoding."""

import asyncio
import functools
import threading

import openai
import pytest
import torch

from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.verifier.auth import add_token
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from goodspeed.verifier.local import LocalConfig, LocalServing
from apikit import GREEDY, complete_concurrently, metric_samples
from grpckit import ServerThread
from modelkit import adjusted_greedy_reference, chat_pair, greedy_reference, reference_ranks

PROMPT = "def decode(self, s):"
MESSAGES = [{"role": "user", "content": "parse json"}]


@pytest.fixture(scope="module")
def models():
    return chat_pair()


def front(models, policy="chain", **config):
    target, draft, tokenizer = models
    engine = VerificationEngine(target, EngineConfig(budget=8, max_draft_len=6, seed=3))
    local = LocalServing(engine, draft, LocalConfig(policy=policy, k=3, budget=12))
    return ServerThread(engine, local=local, tokenizer=tokenizer, http_port=0, target_name="tiny", **config)


def client(server, api_key="unused"):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.server.http_port}/v1", api_key=api_key, max_retries=0)


def reference_text(models, prompt_ids, n):
    target, _, tokenizer = models
    ids = greedy_reference(target, prompt_ids, n)
    return ids, tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("policy", ["chain", "adaserve"])
def test_completions_streamed_and_not_equal_the_targets_greedy_decoding(models, policy):
    tokenizer = models[2]
    prompt_ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    ids, text = reference_text(models, prompt_ids, 20)
    with front(models, policy) as server:
        api = client(server)
        whole = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, **GREEDY)
        chunks = list(api.completions.create(model="tiny", prompt=prompt_ids, max_tokens=20, stream=True,
                                             stream_options={"include_usage": True}, **GREEDY))
        assert [m.id for m in api.models.list().data] == ["tiny"]
    assert whole.choices[0].text == text and whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(prompt_ids), 20)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20  # include_usage: the last chunk
    assert all(c.usage is None for c in chunks[:-1])


def test_continuous_usage_stats_give_every_chunk_the_tokens_so_far(models):
    """vLLM's ``stream_options.continuous_usage_stats`` (with ``include_usage``): every chunk's
    usage counts the prompt and the completion tokens consumed up to it; the last one the whole."""
    tokenizer = models[2]
    prompt_ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    options = {"include_usage": True, "continuous_usage_stats": True}
    with front(models) as server:
        events = post(server, "completions", {"model": "tiny", "prompt": prompt_ids, "max_tokens": 12, "temperature": 0,
                                              "ignore_eos": True, "stream": True, "stream_options": options,
                                              "return_token_ids": True})
        chat = post(server, "chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 5, "temperature": 0,
                                                 "ignore_eos": True, "stream": True, "stream_options": options})
    so_far = 0
    for event in events[:-1]:
        so_far += len(event["choices"][0]["token_ids"])
        assert event["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": so_far,
                                  "total_tokens": len(prompt_ids) + so_far}
    assert so_far == 12 and events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 12
    assert chat[0]["usage"]["completion_tokens"] == 0 and chat[-1]["usage"]["completion_tokens"] == 5
    counts = [e["usage"]["completion_tokens"] for e in chat]
    assert counts == sorted(counts) and all(e["usage"] is not None for e in chat)


def test_truncate_prompt_tokens_keeps_the_prompts_last_or_first_tokens(models):
    """vLLM's ``truncate_prompt_tokens``: a longer prompt keeps its last tokens (``truncation_side``
    "right": its first), as counted, generated from and echoed; -1 is the context; a text past what
    the context could hold is served when it is cut; 0 and -2 are 400s."""
    tokenizer = models[2]
    prompt_ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    base = {"model": "tiny", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with front(models) as server:
        last = post(server, "completions", {**base, "prompt": prompt_ids, "truncate_prompt_tokens": 4, "echo": True})
        first = post(server, "completions", {**base, "prompt": PROMPT, "truncate_prompt_tokens": 4, "truncation_side": "right"})
        whole = post(server, "completions", {**base, "prompt": PROMPT, "truncate_prompt_tokens": -1})
        huge = post(server, "completions", {**base, "prompt": "x = 1\n" * 40_000, "truncate_prompt_tokens": 8})
        chat = post(server, "chat/completions", {**base, "messages": MESSAGES, "truncate_prompt_tokens": 5})
        refusals = [refusal_of(server, "completions", {**base, "prompt": PROMPT, "truncate_prompt_tokens": k}) for k in (0, -2)]
    kept = prompt_ids[-4:]
    assert last["usage"]["prompt_tokens"] == 4
    assert last["choices"][0]["text"] == tokenizer.decode(kept) + reference_text(models, kept, 6)[1]
    assert first["usage"]["prompt_tokens"] == 4 and first["choices"][0]["text"] == reference_text(models, prompt_ids[:4], 6)[1]
    assert whole["usage"]["prompt_tokens"] == len(prompt_ids)
    assert huge["usage"]["prompt_tokens"] == 8 and chat["usage"]["prompt_tokens"] == 5
    assert [(status, body["param"]) for status, body in refusals] == [(400, "truncate_prompt_tokens")] * 2


def test_chat_completions_render_the_chat_template(models):
    tokenizer = models[2]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sort a list"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    _, text = reference_text(models, prompt_ids, 16)
    with front(models) as server:
        api = client(server)
        whole = api.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=16, **GREEDY)
        stream = api.chat.completions.create(model="tiny", messages=messages, max_tokens=16, stream=True, **GREEDY)
        deltas = [c.choices[0].delta for c in stream]
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content == text
    assert whole.usage.prompt_tokens == len(prompt_ids)
    assert deltas[0].role == "assistant" and "".join(d.content or "" for d in deltas) == text


def test_chat_echo_starts_the_reply_with_the_assistants_open_message(models):
    """vLLM's chat ``echo``: a reply that continues an open assistant message starts with that
    message's text (whole: every choice's content; streamed: an event after the role's), its
    log-probabilities and usage the completion's alone; a last message of another role than the
    reply's is not echoed."""
    tokenizer = models[2]
    messages = [{"role": "user", "content": "sort a list"}, {"role": "assistant", "content": "def sort"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True, add_generation_prompt=False)
    _, text = reference_text(models, tokenizer(rendered, add_special_tokens=False)["input_ids"], 8)
    base = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "add_generation_prompt": False, "continue_final_message": True, "echo": True}
    with front(models) as server:
        whole = post(server, "chat/completions", {**base, "n": 2, "logprobs": True, "prompt_logprobs": 0})
        events = post(server, "chat/completions", {**base, "stream": True})
        other = post(server, "chat/completions", {**base, "messages": messages[:1], "add_generation_prompt": True,
                                                  "continue_final_message": False})
    for choice in whole["choices"]:
        assert choice["message"]["content"] == "def sort" + text and len(choice["logprobs"]["content"]) == 8
    assert whole["usage"]["completion_tokens"] == 16 and whole["prompt_logprobs"][0] is None
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[1] == {"content": "def sort"}
    assert "".join(d.get("content", "") for d in deltas) == "def sort" + text
    assert not other["choices"][0]["message"]["content"].startswith("sort a list")


def test_stop_strings_end_the_text_and_free_the_request(models):
    tokenizer = models[2]
    prompt_ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    _, text = reference_text(models, prompt_ids, 200)
    stop = text[5:8]  # some text the greedy output does contain, early in 200 tokens
    assert stop and stop in text
    with front(models) as server:
        api = client(server)
        whole = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=200, stop=[stop], **GREEDY)
        streamed = list(api.completions.create(model="tiny", prompt=PROMPT, max_tokens=200, stop=stop, stream=True, **GREEDY))
        local = server.server.service.local
        server.run(_settle(local))
        for _ in range(200):  # bounded: until both cancellations are logged (after the engine ran them)
            if len(server.events("cancelled")) == 2:
                break
            server.run(asyncio.sleep(0.01))
        cancelled = server.events("cancelled")
        leftover = server.server.engine.session_ids
        metrics = metric_samples(server.server.http_port)
    expected = text[: text.index(stop)]
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens < 200
    assert "".join(c.choices[0].text for c in streamed) == expected and streamed[-1].choices[0].finish_reason == "stop"
    # vLLM's stop_reason: the stop string, with the finish_reason (whole and in the stream's last event only)
    assert whole.choices[0].model_extra["stop_reason"] == stop == streamed[-1].choices[0].model_extra["stop_reason"]
    assert all("stop_reason" not in c.choices[0].model_extra for c in streamed[:-1])
    assert [e["freed"] for e in cancelled] == [True, True]  # both ended on the verifier when their stop string came
    assert not local.has_work and leftover == []
    # counted as finished by their stop string, not as abandoned by their client
    assert metrics["goodspeed:request_success_total[('finished_reason', 'stop')]"] == 2
    assert metrics.get("goodspeed:request_success_total[('finished_reason', 'abort')]", 0) == 0


async def _settle(local):
    """Wait (bounded) until local serving holds no request."""
    for _ in range(200):
        if not local.has_work:
            return
        await asyncio.sleep(0.01)


def test_a_seed_makes_a_sampled_request_reproducible(models):
    with front(models) as server:
        api = client(server)

        def sample(seed):
            return api.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=1.0, seed=seed,
                                          extra_body={"ignore_eos": True}).choices[0].text

        first, again, other = sample(7), sample(7), sample(8)
    assert first == again
    assert first != other  # 24 tokens sampled at T = 1 from a 300-token vocabulary


def test_a_batch_of_prompts_with_n_choices_each_comes_back_in_openais_order(models):
    """Choice ``i * n + j`` is prompt ``i``'s ``j``-th; each is the target's greedy decoding, whole
    and streamed (events interleave across choices, each naming its index)."""
    tokenizer = models[2]
    prompts = ["import os", "class A:", "def f(x):"]
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    expected = [reference_text(models, i, 10)[1] for i in ids for _ in range(2)]
    messages = [{"role": "user", "content": "sort a list"}]
    with front(models) as server:
        api = client(server)
        whole = api.completions.create(model="tiny", prompt=prompts, n=2, max_tokens=10, **GREEDY)
        by_ids = api.completions.create(model="tiny", prompt=ids, n=2, max_tokens=10, **GREEDY)
        chunks = list(api.completions.create(model="tiny", prompt=prompts, n=2, max_tokens=10, stream=True,
                                             stream_options={"include_usage": True}, **GREEDY))
        chat = api.chat.completions.create(model="tiny", messages=messages, n=2, max_tokens=8, **GREEDY)
        chat_chunks = list(api.chat.completions.create(model="tiny", messages=messages, n=2, max_tokens=8, stream=True, **GREEDY))
        leftover = server.server.engine.session_ids
    for out in (whole, by_ids):
        assert [c.index for c in out.choices] == list(range(6)) and [c.text for c in out.choices] == expected
        assert {c.finish_reason for c in out.choices} == {"length"}
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (sum(map(len, ids)), 60)  # each prompt counted once
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(6)]
    assert streamed == expected and len({c.id for c in chunks}) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 60
    assert sum(c.choices[0].finish_reason == "length" for c in chunks if c.choices) == 6
    assert chat.choices[0].message.content == chat.choices[1].message.content
    assert [c.choices[0].delta.role for c in chat_chunks[:2]] == ["assistant", "assistant"]
    assert ["".join(c.choices[0].delta.content or "" for c in chat_chunks if c.choices[0].index == i) for i in range(2)] == \
        [chat.choices[0].message.content] * 2
    assert leftover == []


def test_n_sampled_choices_are_distinct_and_a_seed_reproduces_them(models):
    with front(models) as server:
        api = client(server)

        def sample(**kwargs):
            out = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=1.0,
                                         extra_body={"ignore_eos": True}, **kwargs)
            return [c.text for c in out.choices]

        seeded, again, alone = sample(n=3, seed=7), sample(n=3, seed=7), sample(seed=7)
    assert seeded == again
    assert len(set(seeded)) == 3  # 24 tokens sampled at T = 1 from a 300-token vocabulary
    # choice 0 is the seed's own request: chain k = 3 gives three requests their drafts within the
    # budget of 12, so each runs the schedule it runs alone
    assert seeded[0] == alone[0]


def target_logprobs(models, prompt_ids, generated):
    """The target's log-probabilities of ``generated`` after ``prompt_ids``, and its log-softmax rows."""
    with torch.no_grad():
        logits = models[0](torch.tensor([prompt_ids + generated])).logits[0].float()
    rows = torch.log_softmax(logits, dim=-1)[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(generated)]
    return rows.gather(1, torch.tensor(generated).unsqueeze(1)).squeeze(1).tolist(), rows


def test_logprobs_are_the_targets_whole_streamed_and_in_chat(models):
    """Completions' ``logprobs: 2`` and chat's ``logprobs`` / ``top_logprobs``: one entry per
    generated token, each the target's log-probability of it (and its top ones); the stream's
    chunks carry the same entries, with text offsets that continue across chunks."""
    tokenizer = models[2]
    prompt_ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    ids, text = reference_text(models, prompt_ids, 16)
    expected, rows = target_logprobs(models, prompt_ids, ids)
    messages = [{"role": "user", "content": "sort a list"}]
    chat_ids = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"]
    with front(models) as server:
        api = client(server)
        whole = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, logprobs=2, **GREEDY)
        chunks = list(api.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, logprobs=2, stream=True, **GREEDY))
        chat = api.chat.completions.create(model="tiny", messages=messages, max_tokens=8, logprobs=True, top_logprobs=2, **GREEDY)
        plain = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, **GREEDY)
    lp = whole.choices[0].logprobs
    assert whole.choices[0].text == text and plain.choices[0].logprobs is None
    assert plain.choices[0].finish_reason == "length" and plain.choices[0].model_extra["stop_reason"] is None
    assert chat.choices[0].model_extra["stop_reason"] is None
    assert lp.tokens == [tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs == pytest.approx(expected, abs=1e-4)
    for top, row, token, logprob in zip(lp.top_logprobs, rows, lp.tokens, lp.token_logprobs):
        # the two most probable and the chosen one, keyed by text (two ids with one text share a key)
        assert top[token] == logprob and len(top) <= 3
        assert max(top.values()) == pytest.approx(row.max().item(), abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(len(lp.tokens))]
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [v for s in streamed for v in s.token_logprobs] == lp.token_logprobs
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    content = chat.choices[0].logprobs.content
    chat_generated, _ = reference_text(models, chat_ids, 8)
    assert len(content) == chat.usage.completion_tokens == 8
    assert [e.logprob for e in content] == pytest.approx(target_logprobs(models, chat_ids, chat_generated)[0], abs=1e-4)
    assert all(len(e.top_logprobs) == 2 and e.bytes == list(e.token.encode()) for e in content)


def test_echo_opens_each_choice_with_its_prompt_scored_by_the_target(models):
    """Completions' ``echo``: the text is the prompt then the completion; with ``logprobs`` the
    prompt's tokens come first (the first one null: it follows nothing), each the target's
    log-probability of it, as scoring clients (lm-evaluation-harness's loglikelihood) read them;
    streamed, a choice's first event is its prompt. Usage and stop strings count the completion."""
    tokenizer = models[2]
    prompt_ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    ids, text = reference_text(models, prompt_ids, 8)
    expected, rows = target_logprobs(models, prompt_ids[:1], prompt_ids[1:] + ids)
    other = "import os"
    other_ids = tokenizer(other, add_special_tokens=False)["input_ids"]
    with front(models) as server:
        api = client(server)
        whole = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, echo=True, logprobs=2, **GREEDY)
        chunks = list(api.completions.create(model="tiny", prompt=prompt_ids, max_tokens=8, echo=True, logprobs=2,
                                             stream=True, **GREEDY))
        plain = api.completions.create(model="tiny", prompt=[PROMPT, other], max_tokens=8, echo=True, n=2, **GREEDY)
    choice = whole.choices[0]
    assert choice.text == PROMPT + text and whole.usage.completion_tokens == 8
    lp = choice.logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in prompt_ids + ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    for top, row, token, logprob in zip(lp.top_logprobs[1:], rows, lp.tokens[1:], lp.token_logprobs[1:]):
        # the two most probable and the chosen one, keyed by text (byte pieces that share a text share a key)
        allowed = row.topk(2).values.tolist() + [logprob]
        assert top[token] == logprob and len(top) <= 3
        assert all(min(abs(v - a) for a in allowed) < 1e-4 for v in top.values())
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(len(lp.tokens))]
    first = chunks[0].choices[0]
    assert first.text == tokenizer.decode(prompt_ids) and first.logprobs.tokens == lp.tokens[: len(prompt_ids)]
    assert "".join(c.choices[0].text for c in chunks) == tokenizer.decode(prompt_ids) + text
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert [v for s in streamed for v in s.token_logprobs] == lp.token_logprobs
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    other_text = reference_text(models, other_ids, 8)[1]
    assert [c.text for c in sorted(plain.choices, key=lambda c: c.index)] == [PROMPT + text] * 2 + [other + other_text] * 2
    assert all(c.logprobs is None for c in plain.choices)


def test_a_scoring_clients_loglikelihood_request_reads_the_targets(models):
    """lm-evaluation-harness's ``local-completions`` loglikelihood: a batch of token-id prompts
    (context + continuation) with ``echo``, ``logprobs: 1``, ``max_tokens: 1``, ``temperature: 0``;
    it sums ``token_logprobs[ctxlen:-1]`` and calls the continuation greedy when each of those is
    its ``top_logprobs`` entry's maximum. Both must be the target's."""
    import json
    import urllib.request

    target, _, tokenizer = models
    pairs = [("def decode(self, s):", "\n    return"), ("import os", "\nimport sys"), ("x = 1", " + 2")]
    prompts, ctxlens = [], []
    for context, continuation in pairs:
        ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
        prompts.append(ctx + tokenizer(continuation, add_special_tokens=False)["input_ids"])
        ctxlens.append(len(ctx))
    payload = {"model": "tiny", "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
               "echo": True}
    with front(models) as server:
        request = urllib.request.Request(f"http://127.0.0.1:{server.server.http_port}/v1/completions",
                                         data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            body = json.loads(response.read())
    choices = sorted(body["choices"], key=lambda c: c["index"])
    assert len(choices) == len(prompts)
    for choice, ids, ctxlen in zip(choices, prompts, ctxlens):
        with torch.no_grad():
            rows = torch.log_softmax(target(torch.tensor([ids])).logits[0].float(), dim=-1)
        continuation = ids[ctxlen:]
        expected = rows[ctxlen - 1 : -1].gather(1, torch.tensor(continuation).unsqueeze(1)).squeeze(1)
        greedy = bool((rows[ctxlen - 1 : -1].argmax(-1) == torch.tensor(continuation)).all())
        lps = choice["logprobs"]
        assert len(lps["token_logprobs"]) == len(ids) + 1  # the prompt's, then the one generated token's
        assert sum(lps["token_logprobs"][ctxlen:-1]) == pytest.approx(expected.sum().item(), abs=1e-3)
        assert all(tok == max(top.values()) for tok, top in zip(lps["token_logprobs"][ctxlen:-1], lps["top_logprobs"][ctxlen:-1])) == greedy


def test_max_tokens_zero_with_echo_scores_the_prompt_alone(models):
    """OpenAI's legacy scoring call (``max_tokens: 0``, ``echo``, ``logprobs``): the prompt's text
    and its tokens' log-probabilities under the target, no completion token, ``length``; whole and
    streamed, for every choice; the one-token request behind each has ended on the verifier."""
    tokenizer = models[2]
    prompt_ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    expected, _ = target_logprobs(models, prompt_ids[:1], prompt_ids[1:])
    with front(models) as server:
        api = client(server)
        whole = api.completions.create(model="tiny", prompt=[PROMPT, PROMPT], max_tokens=0, echo=True, logprobs=1, **GREEDY)
        chunks = list(api.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, stream=True,
                                             stream_options={"include_usage": True}, **GREEDY))
        text_only = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, **GREEDY)
        local = server.server.local
        reasons = [r.finish_reason for r in local.finished]
        metrics = metric_samples(server.server.http_port)
    assert whole.usage.completion_tokens == 0 and whole.usage.prompt_tokens == 2 * len(prompt_ids)
    for choice in whole.choices:
        assert choice.text == PROMPT and choice.finish_reason == "length"
        assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in prompt_ids]
        assert choice.logprobs.token_logprobs[0] is None
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    streamed = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in streamed) == PROMPT and streamed[-1].choices[0].finish_reason == "length"
    assert [v for c in streamed if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs] == \
        whole.choices[0].logprobs.token_logprobs
    assert chunks[-1].usage.completion_tokens == 0
    assert text_only.choices[0].text == PROMPT and text_only.choices[0].logprobs is None
    assert reasons == ["length"] * 4 and not local.has_work  # its first verdict was its last
    assert metrics["goodspeed:request_success_total[('finished_reason', 'length')]"] == 4  # ended, not aborted
    assert metrics.get("goodspeed:request_success_total[('finished_reason', 'abort')]", 0) == 0


def check_prompt_logprobs(models, entries, prompt_ids, top):
    """vLLM's ``prompt_logprobs`` of a prompt, as JSON: null first, then per later prompt token a
    map (ids as strings) holding it, with its rank, and the ``top`` most probable tokens ranked 1
    to ``top``, each with the target's log-probability and its own decode."""
    tokenizer = models[2]
    _, rows = target_logprobs(models, prompt_ids[:1], prompt_ids[1:])
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for entry, row, token in zip(entries[1:], rows, prompt_ids[1:]):
        best = row.topk(top)
        assert str(token) in entry and len(entry) in (top, top + 1)
        assert entry[str(token)]["rank"] in reference_ranks(row, token)
        ranked = sorted((v["rank"], v["logprob"]) for k, v in entry.items() if k != str(token) or v["rank"] <= top)
        assert [r for r, _ in ranked] == list(range(1, top + 1))
        assert [x for _, x in ranked] == pytest.approx(best.values.tolist(), abs=1e-4)
        for key, value in entry.items():
            assert value["logprob"] == pytest.approx(row[int(key)].item(), abs=1e-4)
            assert value["decoded_token"] == tokenizer.decode([int(key)])


def test_prompt_logprobs_score_the_prompt_with_ranks_as_vllm(models):
    """vLLM's ``prompt_logprobs``: each prompt token's log-probability under the target, its rank
    and the top ones, in a completion choice (every choice of a batch) and once in a chat
    response; without ``echo`` the completion's ``logprobs`` stay the generated tokens'; with
    ``echo`` and ``logprobs`` each keeps its own count of top ones; no output changes."""
    tokenizer = models[2]
    prompt_ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    other_ids = tokenizer("import os", add_special_tokens=False)["input_ids"]
    ids, text = reference_text(models, prompt_ids, 6)
    chat_ids = tokenizer(tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"]
    base = {"model": "tiny", "temperature": 0, "max_tokens": 6}
    with front(models) as server:
        batch = post(server, "completions", {**base, "prompt": [PROMPT, "import os"], "n": 2, "prompt_logprobs": 2, "logprobs": 1})
        echoed = post(server, "completions", {**base, "prompt": prompt_ids, "echo": True, "logprobs": 1, "prompt_logprobs": 3})
        chat = post(server, "chat/completions", {**base, "messages": MESSAGES, "prompt_logprobs": 0})
        plain = post(server, "completions", {**base, "prompt": PROMPT})
    choices = sorted(batch["choices"], key=lambda c: c["index"])
    for choice, prompt in zip(choices, [prompt_ids] * 2 + [other_ids] * 2):
        check_prompt_logprobs(models, choice["prompt_logprobs"], prompt, 2)
        assert len(choice["logprobs"]["tokens"]) == 6  # the generated tokens' alone
    assert choices[0]["text"] == text == plain["choices"][0]["text"] and "prompt_logprobs" not in plain["choices"][0]
    check_prompt_logprobs(models, echoed["choices"][0]["prompt_logprobs"], prompt_ids, 3)
    legacy = echoed["choices"][0]["logprobs"]
    assert len(legacy["tokens"]) == len(prompt_ids) + 6 and legacy["top_logprobs"][0] is None
    assert all(len(top) <= 2 for top in legacy["top_logprobs"][1:])  # logprobs = 1: one top token and the chosen one
    check_prompt_logprobs(models, chat["prompt_logprobs"], chat_ids, 0)
    assert "prompt_logprobs" not in chat["choices"][0] and chat["choices"][0]["message"]["content"]


def post(server, path, payload):
    """The response's JSON, or a stream's events (the ``data:`` objects before ``[DONE]``)."""
    import json
    import urllib.request

    request = urllib.request.Request(f"http://127.0.0.1:{server.server.http_port}/v1/{path}", data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        body = response.read().decode()
    if not payload.get("stream"):
        return json.loads(body)
    events = [line[len("data: "):] for line in body.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def refusal_of(server, path, payload) -> tuple[int, dict]:
    """An HTTP error's status and OpenAI error object."""
    import json
    import urllib.error

    try:
        post(server, path, payload)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())["error"]
    raise AssertionError("the request was not refused")


def test_return_token_ids_gives_the_prompts_and_the_completions_ids_as_vllm(models):
    """vLLM's ``return_token_ids``: a completion choice's ``prompt_token_ids`` and ``token_ids``
    (the tokens consumed: at a stop string, up to the one that completed it), chat's prompt once
    in the response; streamed, each event's own ids and the prompt's in a choice's first event
    (chat: the first event's envelope). ``return_tokens_as_token_ids`` names the logprobs' tokens
    ``token_id:<id>``. Without them the response has none of these fields."""
    tokenizer = models[2]
    prompt_ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    ids, text = reference_text(models, prompt_ids, 40)
    stop = text[12:15]
    upto = next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k]))  # the token that completes it
    chat_ids = tokenizer(tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"]
    chat_generated, _ = reference_text(models, chat_ids, 6)
    base = {"model": "tiny", "temperature": 0, "return_token_ids": True}
    with front(models) as server:
        whole = post(server, "completions", {**base, "prompt": PROMPT, "max_tokens": 40, "stop": [stop], "n": 2})
        events = post(server, "completions", {**base, "prompt": PROMPT, "max_tokens": 40, "stop": [stop], "stream": True,
                                              "logprobs": 0, "return_tokens_as_token_ids": True})
        chat = post(server, "chat/completions", {**base, "messages": MESSAGES, "max_tokens": 6})
        chat_events = post(server, "chat/completions", {**base, "messages": MESSAGES, "max_tokens": 6, "stream": True})
        plain = post(server, "completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    for choice in whole["choices"]:
        assert choice["prompt_token_ids"] == prompt_ids and choice["token_ids"] == ids[:upto]
        assert choice["finish_reason"] == "stop" and tokenizer.decode(ids[:upto]).startswith(choice["text"])
    assert events[0]["choices"][0]["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in e["choices"][0] for e in events[1:])
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == ids[:upto]
    assert [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]] == [f"token_id:{t}" for t in ids[:upto]]
    assert chat["prompt_token_ids"] == chat_ids and chat["choices"][0]["token_ids"] == chat_generated
    assert chat_events[0]["prompt_token_ids"] == chat_ids and all("prompt_token_ids" not in e for e in chat_events[1:])
    assert [t for e in chat_events for t in e["choices"][0]["token_ids"]] == chat_generated
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


def test_logprobs_stop_with_the_text_at_a_stop_string(models):
    tokenizer = models[2]
    prompt_ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    _, text = reference_text(models, prompt_ids, 200)
    stop = text[5:8]
    with front(models) as server:
        out = client(server).completions.create(model="tiny", prompt=PROMPT, max_tokens=200, stop=[stop], logprobs=0, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == out.usage.completion_tokens < 200  # the tokens consumed up to the stop string
    assert all(len(top) == 1 for top in lp.top_logprobs)  # logprobs = 0: the chosen token's alone


def test_stop_token_ids_end_the_text_like_eos(models):
    """vLLM's ``stop_token_ids``: the first of them ends the text, finish_reason stop; the token is
    counted and returned with the ids, its text is left out, unless ``include_stop_str_in_output``
    (as vLLM's detokenizer); with that, a stop string is in the text too."""
    tokenizer = models[2]
    prompt_ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    ids, _ = reference_text(models, prompt_ids, 40)
    stop_id = ids[len(ids) // 2]
    end = ids.index(stop_id) + 1  # its first occurrence
    with front(models) as server:
        api = client(server)
        out = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True, "stop_token_ids": [stop_id], "return_token_ids": True})
        kept = list(api.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True, "stop_token_ids": [stop_id],
                                                       "include_stop_str_in_output": True}))
        stop = tokenizer.decode(ids[3:5])
        with_stop = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop],
                                           extra_body={"include_stop_str_in_output": True})
        with pytest.raises(openai.BadRequestError) as refused:
            api.completions.create(model="tiny", prompt=PROMPT, extra_body={"stop_token_ids": [-1]})
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == end
    assert out.choices[0].model_extra["stop_reason"] == stop_id == kept[-1].choices[0].model_extra["stop_reason"]
    assert with_stop.choices[0].model_extra["stop_reason"] == stop
    assert out.choices[0].text == tokenizer.decode(ids[: end - 1], skip_special_tokens=True)
    assert out.choices[0].model_extra["token_ids"] == ids[:end]
    assert "".join(c.choices[0].text for c in kept) == tokenizer.decode(ids[:end], skip_special_tokens=True)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert with_stop.choices[0].text == full[: full.index(stop) + len(stop)] and with_stop.choices[0].finish_reason == "stop"
    assert refused.value.body["param"].startswith("stop_token_ids")


def test_min_tokens_holds_back_the_stop_tokens_and_stop_strings(models):
    """vLLM's min_tokens: a stop token the greedy text emits early is held back until min_tokens
    tokens are out (the target's greedy decoding with it held back), and a stop string is not
    matched within them; more than max_tokens is a 400, as vLLM's."""
    target, _, tokenizer = models
    prompt_ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    ids, _ = reference_text(models, prompt_ids, 40)
    stop_id = ids[1]
    held = adjusted_greedy_reference(target, prompt_ids, SamplingParams(min_tokens=8, eos_token_ids=(stop_id,)), 40)
    end = held.index(stop_id, 8) + 1 if stop_id in held[8:] else 40
    full = tokenizer.decode(ids, skip_special_tokens=True)
    stop = "1"  # the tiny model's text holds it within its first 4 tokens' text and again later
    within = len(tokenizer.decode(ids[:4]))
    with front(models) as server:
        api = client(server)
        out = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True, "stop_token_ids": [stop_id], "min_tokens": 8,
                                                 "return_token_ids": True})
        strings = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, stop=[stop], stream=True, temperature=0,
                                         extra_body={"min_tokens": 4, "ignore_eos": True})
        with pytest.raises(openai.BadRequestError) as refused:
            api.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, extra_body={"min_tokens": 5})
    assert stop_id not in out.choices[0].model_extra["token_ids"][:8] and out.choices[0].model_extra["token_ids"] == held[:end]
    assert full.index(stop) < within <= full.index(stop, within)  # else the stop string tests nothing
    assert "".join(c.choices[0].text for c in strings) == full[: full.index(stop, within)]
    assert refused.value.body["param"] == "min_tokens"


def test_logit_bias_and_penalties_reach_local_serving(models):
    """A bias of 100 on one token makes it the greedy output at every position; penalties give the
    target's own adjusted greedy decoding (every path of it: test_adjusted_sampling)."""
    target, _, tokenizer = models
    prompt_ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    sampling = SamplingParams(presence_penalty=2.0, repetition_penalty=1.2)
    want = tokenizer.decode(adjusted_greedy_reference(target, prompt_ids, sampling, 12), skip_special_tokens=True)
    assert want != reference_text(models, prompt_ids, 12)[1]
    with front(models) as server:
        api = client(server)
        biased = api.completions.create(model="tiny", prompt=prompt_ids, max_tokens=8, logit_bias={"42": 100}, logprobs=0,
                                        **GREEDY)
        penalised = api.completions.create(model="tiny", prompt=prompt_ids, max_tokens=12, presence_penalty=2.0,
                                           extra_body={"ignore_eos": True, "repetition_penalty": 1.2}, temperature=0)
    assert biased.choices[0].logprobs.tokens == [tokenizer.decode([42])] * 8
    assert penalised.choices[0].text == want


def test_allowed_token_ids_keep_the_output_to_them(models):
    """vLLM's allowed_token_ids: the output is the target's greedy decoding over those tokens alone;
    an id past the vocabulary, an empty list, and a min_tokens that holds back every allowed token
    (each one ends the text) are 400s."""
    target, _, tokenizer = models
    prompt_ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    allowed = sorted(set(reference_text(models, prompt_ids, 12)[0][1::2]) | {7, 42})
    sampling = SamplingParams(allowed_token_ids=tuple(allowed))
    want = adjusted_greedy_reference(target, prompt_ids, sampling, 12)
    assert set(want) <= set(allowed) and want != reference_text(models, prompt_ids, 12)[0]
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    base = {"model": "tiny", "prompt": prompt_ids, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    with front(models) as server:
        out = post(server, "completions", {**base, "allowed_token_ids": allowed, "return_token_ids": True})
        refusals = [refusal_of(server, "completions", {**base, **extra}) for extra in (
            {"allowed_token_ids": [3, vocab]}, {"allowed_token_ids": []},
            {"allowed_token_ids": [eos], "ignore_eos": False, "min_tokens": 2})]
    assert out["choices"][0]["token_ids"] == want
    assert [status for status, _ in refusals] == [400] * 3
    assert [body["param"] for _, body in refusals[1:]] == ["allowed_token_ids"] * 2


def test_bad_words_are_never_generated(models):
    """vLLM's bad_words: each word tokenized as it stands and after a space (where that gives
    another first token and as many tokens), and those sequences never generated: the output is
    the target's greedy decoding with them banned. A word with no token is a 400."""
    from goodspeed.api.completions import bad_word_ids

    target, _, tokenizer = models
    prompt_ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    plain = reference_text(models, prompt_ids, 16)[0]
    words = ["1", "\x11&"]
    banned = bad_word_ids(tokenizer, words)
    encode = functools.partial(tokenizer.encode, add_special_tokens=False)
    assert banned[:1] == (tuple(encode("1")),) and tuple(encode("\x11&")) in banned
    assert all(any(b in (tuple(encode(w)), tuple(encode(" " + w))) for w in words) for b in banned)
    want = adjusted_greedy_reference(target, prompt_ids, SamplingParams(bad_words=banned), 16)
    assert want != plain and not any(tuple(want[k:k + len(b)]) == b for b in banned for k in range(len(want)))
    base = {"model": "tiny", "prompt": prompt_ids, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    with front(models) as server:
        out = post(server, "completions", {**base, "bad_words": words})
        status, body = refusal_of(server, "completions", {**base, "bad_words": ["  "]})
    assert out["choices"][0]["token_ids"] == want
    assert status == 400 and body["param"] == "bad_words"


def test_structured_output_constrains_the_text_to_the_grammar(models):
    """vLLM's structured_outputs (and its older guided_* fields), OpenAI's response_format: each
    text is the target's greedy decoding with every token the grammar refuses at -inf, ending at
    EOS when the grammar is complete; chat's json_schema and json_object too. A grammar that
    does not compile, two constraints, and one with ignore_eos are 400s."""
    import json
    import re

    from goodspeed.lm.decoding.structured import Structure

    target, _, tokenizer = models
    eos = tokenizer.eos_token_id
    prompt_ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
              "additionalProperties": False}
    cases = {
        "regex": ({"structured_outputs": {"regex": r"[a-z]{1,5}\(s\)"}}, Structure("regex", r"[a-z]{1,5}\(s\)")),
        "choice": ({"guided_choice": ["decoder", "end"]}, Structure("choice", json.dumps(["decoder", "end"]))),
        "json": ({"structured_outputs": {"json": schema, "disable_any_whitespace": True}},
                 Structure("json", json.dumps(schema), any_whitespace=False)),
    }
    base = {"model": "tiny", "prompt": prompt_ids, "max_tokens": 40, "temperature": 0, "return_token_ids": True}
    chat = {"model": "tiny", "messages": MESSAGES, "max_tokens": 60, "temperature": 0, "return_token_ids": True}
    with front(models, policy="adaserve") as server:
        outs = {name: post(server, "completions", {**base, **extra}) for name, (extra, _) in cases.items()}
        streamed = post(server, "completions", {**base, **cases["regex"][0], "stream": True})
        replies = [post(server, "chat/completions", {**chat, "response_format": fmt}) for fmt in (
            {"type": "json_schema", "json_schema": {"name": "digit", "schema": schema}}, {"type": "json_object"})]
        refusals = [refusal_of(server, "completions", {**base, **extra}) for extra in (
            {"guided_regex": "[[["}, {"guided_regex": "a+", "guided_choice": ["a"]}, {"guided_choice": ["a"], "ignore_eos": True},
            {"structured_outputs": {}}, {"structured_outputs": {"json": "{not json"}}, {"guided_choice": ["a"], "min_tokens": 1})]
    for name, (_, structure) in cases.items():
        sampling = SamplingParams(structured=structure.bound(tokenizer))
        want = adjusted_greedy_reference(target, prompt_ids, sampling, 40, eos=eos)
        assert outs[name]["choices"][0]["token_ids"] == want and want[-1] == eos
        assert outs[name]["choices"][0]["finish_reason"] == "stop"
        assert outs[name]["choices"][0]["text"] == tokenizer.decode(want[:-1])
    assert re.fullmatch(r"[a-z]{1,5}\(s\)", outs["regex"]["choices"][0]["text"])
    assert outs["choice"]["choices"][0]["text"] in ("decoder", "end")
    assert set(json.loads(outs["json"]["choices"][0]["text"])) == {"n"}
    assert "".join(e["choices"][0]["text"] for e in streamed if e["choices"]) == outs["regex"]["choices"][0]["text"]
    # chat's formats allow any whitespace (as OpenAI's): the tiny target spends its tokens on it
    for reply, structure in zip(replies, (Structure("json", json.dumps(schema)), Structure("json_object"))):
        sampling = SamplingParams(structured=structure.bound(tokenizer))
        want = adjusted_greedy_reference(target, reply["prompt_token_ids"], sampling, 60, eos=eos)
        assert reply["choices"][0]["token_ids"] == want and reply["choices"][0]["message"]["content"].startswith("{")
    assert [status for status, _ in refusals] == [400] * 6
    assert [body["param"] for _, body in refusals] == ["guided_regex", "guided_choice", "ignore_eos", "structured_outputs",
                                                       "structured_outputs", "min_tokens"]


WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"day": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["day"],
    "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "clock"}}


def test_forced_tool_calls_are_the_targets_greedy_decoding_under_their_schema(models):
    """A named function and "required": the reply is the target's greedy decoding held to the call's
    schema (vLLM's), read into tool_calls (OpenAI's finish reasons: "stop" for a named call,
    "tool_calls" for required), streamed the same; a conversation holding calls and a tool's
    answer renders; "auto" without a --tool-call-parser, and on a template that does not render
    tools, are 400s."""
    import json

    from goodspeed.api.tools import forced_schema, NamedToolChoice, Tool
    from goodspeed.lm.decoding.structured import Structure

    target, _, tokenizer = models
    eos = tokenizer.eos_token_id
    tools = [WEATHER, CLOCK]
    named = {"type": "function", "function": {"name": "weather"}}
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "clock", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "noon"}]
    # JSON may hold any whitespace (as vLLM's): the tiny target would spend its tokens on it, so a
    # logit_bias holds its whitespace tokens back (the reference applies it too)
    blank = {str(i): -100.0 for i in range(len(tokenizer)) if not tokenizer.decode([i]).strip()}
    base = {"model": "tiny", "messages": history, "tools": tools, "max_tokens": 60, "temperature": 0, "return_token_ids": True,
            "logit_bias": blank}
    with front(models, policy="adaserve") as server:
        replies = {name: post(server, "chat/completions", {**base, "tool_choice": choice, "parallel_tool_calls": name != "one"})
                   for name, choice in (("named", named), ("required", "required"), ("one", "required"))}
        streamed = post(server, "chat/completions", {**base, "tool_choice": "required", "stream": True})
        auto = refusal_of(server, "chat/completions", {**base})
        none = post(server, "chat/completions", {**base, "tool_choice": "none", "max_tokens": 4})
    for name, choice in (("named", named), ("required", "required"), ("one", "required")):
        reply = replies[name]
        mode = NamedToolChoice.model_validate(choice) if isinstance(choice, dict) else choice
        schema = forced_schema([Tool.model_validate(t) for t in tools], mode, parallel=name != "one")
        sampling = SamplingParams(structured=Structure("json", json.dumps(schema)).bound(tokenizer),
                                  logit_bias=tuple(sorted((int(k), v) for k, v in blank.items())))
        want = adjusted_greedy_reference(target, reply["prompt_token_ids"], sampling, 60, eos=eos)
        assert want[-1] == eos, name  # the call is complete
        choice_out = reply["choices"][0]
        assert choice_out["token_ids"] == want, name
        message = choice_out["message"]
        assert message["content"] is None and message["tool_calls"], name
        assert choice_out["finish_reason"] == ("stop" if name == "named" else "tool_calls")
        text = tokenizer.decode(want[:-1])
        if name == "named":
            assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [("weather", text)]
        else:
            assert [{"name": c["function"]["name"], "parameters": json.loads(c["function"]["arguments"])}
                    for c in message["tool_calls"]] == json.loads(text)
    assert len(replies["one"]["choices"][0]["message"]["tool_calls"]) == 1
    calls: dict[int, dict] = {}
    for event in streamed:
        for delta in (c["delta"].get("tool_calls") or [] for c in event["choices"]):
            for d in delta:
                calls.setdefault(d["index"], {"name": d["function"].get("name"), "arguments": ""})["arguments"] += d["function"]["arguments"]
    want_calls = replies["required"]["choices"][0]["message"]["tool_calls"]
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in want_calls]
    assert streamed[-1]["choices"][0]["finish_reason"] == replies["required"]["choices"][0]["finish_reason"]
    assert auto[0] == 400 and auto[1]["param"] == "tool_choice"
    assert "tool_calls" not in none["choices"][0]["message"] and none["choices"][0]["finish_reason"] == "length"
    prompt = tokenizer.decode(none["prompt_token_ids"])
    assert "# tool:\nnoon" in prompt  # the tool's answer, through the demo template
    with front(models, tool_call_parser="hermes") as server:
        status, body = refusal_of(server, "chat/completions", {**base})
    assert status == 400 and body["param"] == "tools"  # the demo template does not render tools


def test_the_responses_api_is_the_targets_greedy_decoding_and_its_formats_hold(models):
    """``/v1/responses`` on the verifier's front (local serving, AdaServe's trees): the output text is
    the target's greedy decoding of the chat-rendered input; ``text.format`` json_schema holds it
    to the schema, exactly as the target decodes under that grammar; a schema that does not
    compile and a context overflow are 400s naming the Responses fields."""
    import json

    from goodspeed.lm.decoding.structured import Structure

    target, _, tokenizer = models
    eos = tokenizer.eos_token_id
    chat_ids = tokenizer(tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    with front(models, policy="adaserve") as server:
        api = client(server)
        plain = api.responses.create(model="tiny", input=MESSAGES, max_output_tokens=12, temperature=0)
        shaped = post(server, "responses", {"model": "tiny", "input": MESSAGES, "max_output_tokens": 30, "temperature": 0,
                                            "text": {"format": {"type": "json_schema", "name": "r", "schema": schema}}})
        bad = refusal_of(server, "responses", {"model": "tiny", "input": "x", "text": {"format": {
            "type": "json_schema", "name": "r", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}})
        long = refusal_of(server, "responses", {"model": "tiny", "input": "x", "max_output_tokens": 10**6})
    want = adjusted_greedy_reference(target, chat_ids, SamplingParams(), 12, eos=eos)
    assert plain.output_text == tokenizer.decode([t for t in want if t != eos], skip_special_tokens=True)
    structured = SamplingParams(structured=Structure("json", json.dumps(schema)).bound(tokenizer))
    grammar_want = adjusted_greedy_reference(target, chat_ids, structured, 30, eos=eos)
    text = shaped["output"][0]["content"][0]["text"]
    assert text == tokenizer.decode([t for t in grammar_want if t != eos], skip_special_tokens=True)
    if grammar_want[-1] == eos:
        assert json.loads(text).keys() == {"ok"} and shaped["status"] == "completed"
    assert bad[0] == 400 and bad[1]["param"] == "text.format"
    assert long[0] == 400 and long[1]["code"] == "context_length_exceeded" and long[1]["param"] == "input"


def test_the_messages_api_is_the_targets_greedy_decoding(models):
    """Anthropic's ``/v1/messages`` on the verifier's front, called with Anthropic's client: the
    reply's text, whole and streamed, is the target's greedy decoding of the chat-rendered
    conversation; a forced tool (``tool_choice`` of type tool) is its greedy decoding under the
    tool's schema, read into a tool_use block."""
    import json

    import anthropic

    from goodspeed.lm.decoding.structured import Structure

    target, _, tokenizer = models
    eos = tokenizer.eos_token_id
    system = [{"role": "system", "content": "Be brief."}]
    chat_ids = tokenizer(tokenizer.apply_chat_template(system + MESSAGES, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"]
    tool = {"name": "ok", "input_schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                           "additionalProperties": False}}
    with front(models, policy="chain") as server:
        api = anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.server.http_port}", api_key="-", max_retries=0)
        greedy = {"extra_body": {"temperature": 0}}  # Anthropic's current SDK has no temperature argument
        whole = api.messages.create(model="tiny", max_tokens=12, system="Be brief.", messages=MESSAGES, **greedy)
        with api.messages.stream(model="tiny", max_tokens=12, system="Be brief.", messages=MESSAGES, **greedy) as stream:
            streamed = "".join(stream.text_stream)
        forced = api.messages.create(model="tiny", max_tokens=30, system="Be brief.", messages=MESSAGES,
                                     tools=[tool], tool_choice={"type": "tool", "name": "ok"}, **greedy)
        shaped = api.messages.create(model="tiny", max_tokens=30, system="Be brief.", messages=MESSAGES,
                                     output_config={"format": {"type": "json_schema", "schema": tool["input_schema"]}}, **greedy)
    want = adjusted_greedy_reference(target, chat_ids, SamplingParams(), 12, eos=eos)
    text = tokenizer.decode([t for t in want if t != eos], skip_special_tokens=True)
    assert whole.content[0].text == text == streamed and whole.usage.input_tokens == len(chat_ids)
    assert whole.stop_reason == ("end_turn" if want[-1] == eos else "max_tokens")
    assert forced.usage.input_tokens == len(chat_ids)  # the demo's template renders no tools: the grammar holds the call
    structured = SamplingParams(structured=Structure("json", json.dumps(tool["input_schema"])).bound(tokenizer))
    forced_want = adjusted_greedy_reference(target, chat_ids, structured, 30, eos=eos)
    arguments = tokenizer.decode([t for t in forced_want if t != eos], skip_special_tokens=True)
    if forced_want[-1] == eos:
        assert [(b.type, b.name, b.input) for b in forced.content] == [("tool_use", "ok", json.loads(arguments))]
    else:
        assert [(b.type, b.text) for b in forced.content] == [("text", arguments)]
    assert [(b.type, b.text) for b in shaped.content] == [("text", arguments)]  # output_config.format: the same grammar


def test_concurrent_requests_share_the_batch_and_metrics_count_them(models):
    tokenizer = models[2]
    prompts = ["import os", "class A:", "def f(x):", "return None"]
    with front(models) as server:
        texts = complete_concurrently(client(server), "tiny", prompts, 12)
        samples = metric_samples(server.server.http_port)
    for p in prompts:
        ids = tokenizer(p, add_special_tokens=False)["input_ids"]
        assert texts[p] == reference_text(models, ids, 12)[1]
    assert samples["goodspeed:generation_tokens_total[]"] == 4 * 12
    assert samples["goodspeed:e2e_request_latency_seconds_count[]"] == 4
    assert samples["goodspeed:request_success_total[('finished_reason', 'length')]"] == 4
    assert samples["goodspeed:num_requests_running[]"] == 0
    assert samples["goodspeed:spec_decode_num_draft_tokens_total[]"] >= samples["goodspeed:spec_decode_num_accepted_tokens_total[]"] > 0
    assert samples["goodspeed:spec_decode_num_accepted_tokens_per_pos_total[('position', '0')]"] > 0


def test_with_a_token_file_the_api_key_is_the_bearer_token(models, tmp_path):
    tokens = tmp_path / "tokens.json"
    token = add_token(tokens, "app")
    with front(models, auth_tokens=str(tokens)) as server:
        with pytest.raises(openai.AuthenticationError) as refused:
            client(server, api_key="wrong").completions.create(model="tiny", prompt="x", max_tokens=2)
        ok = client(server, api_key=token).completions.create(model="tiny", prompt="x", max_tokens=2, **GREEDY)
    assert refused.value.status_code == 401 and refused.value.body["code"] == "invalid_api_key"
    assert ok.usage.completion_tokens == 2


def test_the_running_gauge_follows_requests_in_and_out(models):
    with front(models) as server:
        api = client(server)
        stream = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=400, stream=True, **GREEDY)
        next(iter(stream))
        during = metric_samples(server.server.http_port)
        stream.close()
        for _ in range(500):  # bounded: until the front has cancelled the request (logged last)
            if server.events("cancelled"):
                break
            server.run(asyncio.sleep(0.01))
        after = metric_samples(server.server.http_port)
    assert during["goodspeed:num_requests_running[]"] == 1
    assert after["goodspeed:num_requests_running[]"] == 0
    assert after["goodspeed:request_success_total[('finished_reason', 'abort')]"] == 1


def test_an_http_port_in_use_stops_what_had_started(models):
    """The HTTP front cannot have its port: the daemon's start fails naming it, after stopping
    the gRPC server and the round loop it had already started (nothing half-serving)."""
    import socket

    from goodspeed.launch.daemons.serve import make_http_front
    from goodspeed.verifier.errors import ListenError
    from goodspeed.verifier.daemon import make_server
    from goodspeed.verifier.server import ServerConfig

    target, draft, tokenizer = models
    engine = VerificationEngine(target, EngineConfig(budget=8, max_draft_len=6, seed=3))
    local = LocalServing(engine, draft, LocalConfig(policy="chain", k=3))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = make_server(engine, ServerConfig(port=0, http_port=port, warmup=False), local=local, tokenizer=tokenizer,
                             http_front=make_http_front)

        async def start():
            with pytest.raises(ListenError, match=f"cannot serve HTTP on 127.0.0.1:{port}"):
                await server.start()
            await asyncio.sleep(0)  # let the cancelled round loop finish

        asyncio.run(start())
    assert server.http is None and server._rounds.cancelled()


def test_a_full_wait_queue_is_a_429_with_retry_after(models):
    """One request decoding, one waiting (max_requests 1, max_waiting 1): a third is a 429 whose
    Retry-After header says when to retry (whole seconds, at least 1), as OpenAI's clients read it."""
    target, draft, tokenizer = models
    engine = VerificationEngine(target, EngineConfig(budget=8, max_draft_len=6, seed=3))
    local = LocalServing(engine, draft, LocalConfig(policy="chain", k=3, max_requests=1, max_waiting=1))
    with ServerThread(engine, local=local, tokenizer=tokenizer, http_port=0, target_name="tiny") as server:
        api = client(server)
        first = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=400, stream=True, **GREEDY)
        next(iter(first))  # decoding
        waiting = threading.Thread(target=lambda: api.completions.create(model="tiny", prompt="x", max_tokens=2, **GREEDY),
                                   daemon=True)
        waiting.start()
        assert server.wait_for(lambda: local.num_waiting == 1)  # the second request is queued
        with pytest.raises(openai.RateLimitError) as refused:
            api.completions.create(model="tiny", prompt="y", max_tokens=2, **GREEDY)
        first.close()
        waiting.join(60)
    assert refused.value.status_code == 429 and int(refused.value.response.headers["retry-after"]) >= 1
