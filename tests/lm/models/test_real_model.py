"""The real pair (SmolLM2-135M-Instruct and its distilled draft) on every path: greedy output is
the target's own greedy decoding, token for token. Marked ``real``: ``make test-real`` builds the
models (``goodspeed models get smollm2-135m``, ~10 min) and runs these; without them they skip."""

import json
import subprocess
import sys

import pytest
import torch

from goodspeed.drafter.prompts import chat_prompt_ids, load_prompts
from goodspeed.drafter.runner import DraftRunner
from goodspeed.launch.cluster.inprocess import InProcessDrafter, run_inprocess
from goodspeed.launch.spec import PROMPT_SETS, DrafterSpec, LaunchSpec, VerifierSpec
from goodspeed.lm.models import real
from goodspeed.lm.runtime.graphs import StepGraphs
from goodspeed.lm.models.loading import load_causal_lm
from goodspeed.lm.models.precision import cpu_flags
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from goodspeed.verifier.clocks import LatencyProfile, RealClock
from goodspeed.verifier.local import LocalConfig, LocalServing

pytestmark = [
    pytest.mark.real,
    pytest.mark.skipif(not (real.is_built("smollm2-135m") and real.is_built("smollm2-135m-draft")),
                       reason="real:smollm2-135m is not built: run `goodspeed models get smollm2-135m` (or `make test-real`)"),
]
NEW = 24


@pytest.fixture(scope="module")
def pair():
    torch.set_num_threads(2)
    return load_causal_lm("real:smollm2-135m"), load_causal_lm("real:smollm2-135m-draft")


@pytest.fixture(scope="module")
def prompts(pair):
    target, _ = pair
    chat = load_prompts(PROMPT_SETS / "chat.jsonl", target.tokenizer)[:2]
    code = load_prompts(PROMPT_SETS / "code.jsonl", target.tokenizer)[:2]
    return [p.prompt_ids for p in chat + code]


@pytest.fixture(scope="module")
def reference(pair, prompts):
    """The target's own greedy decoding (transformers' generate, one token per forward)."""
    target, _ = pair
    out = {}
    with torch.inference_mode():
        for p in prompts:
            gen = target.model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=NEW,
                                        do_sample=False, eos_token_id=None, pad_token_id=target.tokenizer.eos_token_id)
            out[tuple(p)] = gen[0, len(p):].tolist()
    return out


def test_the_pair_shares_a_tokenizer_and_a_chat_template(pair):
    target, draft = pair
    assert target.fingerprint == draft.fingerprint
    ids = chat_prompt_ids(target.tokenizer, [{"role": "user", "content": "hi"}])
    assert target.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    assert target.model.config.num_hidden_layers == 30 and target.model.config.vocab_size == 49152


def test_edge_drafters_through_the_engine_match_target_greedy(pair, prompts, reference):
    target, draft = pair
    engine = VerificationEngine(target.model, EngineConfig(budget=12, policy="goodspeed", max_draft_len=8, seed=0))
    drafters = [InProcessDrafter("chat", DraftRunner(draft.model), prompts[:2], max_new_tokens=NEW),
                InProcessDrafter("code", DraftRunner(draft.model), prompts[2:], max_new_tokens=NEW)]
    results = run_inprocess(engine, drafters)
    for d in drafters:
        for prompt, out in zip(d.prompts, d.outputs):
            assert out == reference[tuple(prompt)], (d.name, prompt)
    accepted = sum(v.num_accepted for r in results for v in r.verdicts.values())
    emitted = sum(len(o) for d in drafters for o in d.outputs)
    assert accepted > 0.15 * emitted  # the distilled draft really predicts the target (an unrelated one: ~0)


def serve_local(pair, prompts, policy, graphs=False):
    """Local serving of ``prompts`` under ``policy``: request id -> generated tokens, and the
    serving object. ``graphs``: the target's steps and the draft's forwards at the fixed shapes CUDA
    graphs replay (run eagerly on CPU)."""
    from goodspeed.scheduler import LatencyModel

    target, draft = pair
    # Roughly this machine's costs (goodspeed profile measures them); TurboSpec needs a model.
    profile = LatencyProfile(LatencyModel(0.0, 1e-3, 0.055), LatencyModel(0.0, 1e-4, 0.003))
    engine = VerificationEngine(target.model, EngineConfig(seed=0))
    serving = LocalServing(engine, draft.model, LocalConfig(policy=policy, max_requests=4, budget=12, k=4,
                                                           latency=profile if policy == "turbospec" else None), RealClock())
    if graphs:
        engine.runner.graphs = StepGraphs(engine.model, engine.cache, capture=False)
        serving.draft.graphs = StepGraphs(serving.draft.model, serving.draft.cache, capture=False)
    ids = [serving.submit(p, max_new_tokens=NEW) for p in prompts]
    for _ in range(10_000):
        if serving.step() is None:
            break
    by_id = {r.request_id: r.generated for r in serving.finished}
    return [by_id[rid] for rid in ids], serving


@pytest.mark.skipif(not real.is_built("smollm2-135m-draft-large"),
                    reason="the large recipe's draft is not built: `goodspeed models get smollm2-135m --recipe large` (~80 min)")
@pytest.mark.parametrize("where", ["edge", "local-chain", "local-adaserve"])
def test_the_large_recipes_pruned_draft_matches_target_greedy(pair, prompts, reference, where):
    """``real:smollm2-135m-draft-large`` loads with its pruned head, and speculation with it (on
    chains and AdaServe's trees) is the target's own greedy decoding. (These references hold no
    token off its head; tokens off a pruned head: tests/lm/models/test_draft_head.py.)"""
    from goodspeed.lm.models.draft_head import head_tokens

    target, _ = pair
    large = load_causal_lm("real:smollm2-135m-draft-large")
    assert large.fingerprint == target.fingerprint and 8000 < head_tokens(large.model).numel() < 9000
    if where == "edge":
        engine = VerificationEngine(target.model, EngineConfig(budget=12, policy="goodspeed", max_draft_len=8, seed=0))
        drafters = [InProcessDrafter("all", DraftRunner(large.model), prompts, max_new_tokens=NEW)]
        run_inprocess(engine, drafters)
        outputs = drafters[0].outputs
    else:
        outputs, _ = serve_local((target, large), prompts, where.removeprefix("local-"))
    for out, prompt in zip(outputs, prompts):
        assert out == reference[tuple(prompt)], (where, prompt)


@pytest.mark.parametrize("policy", ["none", "chain", "tetris", "adaserve", "turbospec", "nightjar"])
def test_local_serving_every_policy_matches_target_greedy(pair, prompts, reference, policy):
    outputs, _ = serve_local(pair, prompts, policy)
    for out, prompt in zip(outputs, prompts):
        assert out == reference[tuple(prompt)], (policy, prompt)


@pytest.mark.parametrize("policy", ["chain", "adaserve"])
def test_local_serving_in_fixed_shape_steps_matches_target_greedy(pair, prompts, reference, policy):
    """SmolLM2 (tied embeddings, 9 / 3 heads) through the steps and draft forwards CUDA graphs
    replay (lm/runtime/graphs.py), run eagerly here: the target's greedy text, every step at fixed shapes."""
    outputs, serving = serve_local(pair, prompts, policy, graphs=True)
    for out, prompt in zip(outputs, prompts):
        assert out == reference[tuple(prompt)], (policy, prompt)
    assert serving.engine.graphs.steps == serving.totals["steps"] > 0


def test_processes_verifier_and_drafters(pair, prompts, reference, tmp_path):
    """`goodspeed launch` with real processes: the gRPC verifier and two edge drafters."""
    from goodspeed.launch.cluster.local import launch_local

    target, _ = pair
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
    drafters = tuple(DrafterSpec(name=n, draft="real:smollm2-135m-draft", prompts=str(prompt_file), max_new_tokens=NEW, max_prompts=2)
                     for n in ("a", "b"))
    spec = LaunchSpec(VerifierSpec(target="real:smollm2-135m", budget=12, max_draft_len=8, round_deadline_ms=5000,
                                   dtype="float32"), drafters)  # as the reference (auto: bf16 on a CPU with native bf16)
    summary = launch_local(spec, tmp_path / "run", live=False)
    assert all(r["exit_code"] == 0 for r in summary["drafters"].values())
    for name in ("a", "b"):
        records = [json.loads(line) for line in (tmp_path / "run" / f"{name}.jsonl").read_text().splitlines()]
        assert len(records) == 2
        for rec in records:
            assert rec["token_ids"] == reference[tuple(rec["prompt_ids"])][: len(rec["token_ids"])]
            assert len(rec["token_ids"]) == NEW or rec["token_ids"][-1] == target.tokenizer.eos_token_id


def test_profile_fits_the_real_pair(tmp_path):
    out = tmp_path / "profile.json"
    result = subprocess.run([sys.executable, "-m", "goodspeed.launch.cli", "profile", "--target", "real:smollm2-135m",
                             "--draft", "real:smollm2-135m-draft", "--repeats", "1", "--out", str(out), "--quiet"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    profile = json.loads(out.read_text())
    assert profile["target"]["delta_s"] > profile["draft"]["delta_s"] > 0


def test_the_openai_api_of_an_edge_node_and_of_the_verifier_serves_the_targets_greedy_text(pair, prompts, reference):
    """The official client, chat completions, through an edge node (drafting with the real draft)
    and through the verifier's HTTP front (local serving): the target's greedy text."""
    import openai

    from grpckit import NodeThread, ServerThread

    target, draft = pair
    messages = [{"role": "user", "content": json.loads((PROMPT_SETS / "chat.jsonl").read_text().splitlines()[0])["messages"][0]["content"]}]
    prompt = chat_prompt_ids(target.tokenizer, messages)
    expected = target.tokenizer.decode(reference[tuple(prompt)], skip_special_tokens=True)
    engine = VerificationEngine(target.model, EngineConfig(budget=8, seed=0), target.fingerprint)
    local = LocalServing(engine, draft.model, LocalConfig(policy="chain", k=3))
    with ServerThread(engine, local=local, tokenizer=target.tokenizer, http_port=0, target_name="real:smollm2-135m") as server, \
            NodeThread(server.address, draft.model, draft.tokenizer, fingerprint=draft.fingerprint) as edge:
        texts = []
        for base in (edge.base_url, f"http://127.0.0.1:{server.server.http_port}/v1"):
            api = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
            chunks = api.chat.completions.create(model="real:smollm2-135m", messages=messages, max_tokens=NEW, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
            texts.append("".join(c.choices[0].delta.content or "" for c in chunks))
    assert texts == [expected, expected]


@pytest.mark.parametrize("policy", ["chain", "adaserve"])
def test_logprobs_on_the_real_pair_are_the_targets(pair, prompts, policy):
    """Each generated token's log-probability (and the top 5), greedy and sampled, read off the
    verifying steps: the target's own forward over the finished text gives them within float32's
    rounding over 30 layers (measured up to 5e-4 and 1.3e-3 on 2026-11-27)."""
    from goodspeed.lm.decoding.params import SamplingParams

    target, draft = pair
    engine = VerificationEngine(target.model, EngineConfig(seed=0), target.fingerprint)
    local = LocalServing(engine, draft.model, LocalConfig(policy=policy, k=3, max_depth=2))
    for i, temperature in enumerate((0.0, 1.0)):
        local.submit(prompts[0], SamplingParams(temperature=temperature), NEW, request_id=f"r{i}", logprobs=5, seed=3)
    while local.has_work:
        local.step()
    for req in local.finished:
        with torch.no_grad():
            logits = target.model(torch.tensor([prompts[0] + req.generated])).logits[0].float()
        rows = torch.log_softmax(logits, dim=-1)[len(prompts[0]) - 1 : len(prompts[0]) - 1 + len(req.generated)]
        expected = rows.gather(1, torch.tensor(req.generated).unsqueeze(1)).squeeze(1)
        got = torch.tensor([lp.logprob for lp in req.token_logprobs])
        top = torch.tensor([[v for _, v in lp.top] for lp in req.token_logprobs])
        assert len(req.token_logprobs) == len(req.generated) == NEW
        assert torch.allclose(got, expected, atol=5e-3) and torch.allclose(top, rows.topk(5).values, atol=5e-3)


def test_prompt_logprobs_on_the_real_pair_are_the_targets(pair, prompts):
    """``echo`` with ``logprobs``: each prompt token's log-probability (and the top 5), read off
    the prefill in chunks next to another request's verification rows, equals the target's own
    forward over the prompt within float32's rounding, as the generated tokens' do."""
    from goodspeed.lm.decoding.params import SamplingParams

    target, draft = pair
    engine = VerificationEngine(target.model, EngineConfig(seed=0, prefill_chunk=16), target.fingerprint)
    local = LocalServing(engine, draft.model, LocalConfig(policy="chain", k=3))
    local.submit(prompts[1], SamplingParams(temperature=0.0), NEW, request_id="busy")
    local.step()
    local.step()
    local.submit(prompts[0], SamplingParams(temperature=0.0), 4, request_id="scored", prompt_logprobs=5)
    while local.has_work:
        local.step()
    req = next(r for r in local.finished if r.request_id == "scored")
    prompt = prompts[0]
    with torch.no_grad():
        rows = torch.log_softmax(target.model(torch.tensor([prompt])).logits[0].float(), dim=-1)[:-1]
    expected = rows.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
    scores = req.prompt_token_logprobs
    assert [lp.token_id for lp in scores] == prompt[1:] and len(prompt) > 16  # more than one chunk
    assert torch.allclose(torch.tensor([lp.logprob for lp in scores]), expected, atol=5e-3)
    assert torch.allclose(torch.tensor([[v for _, v in lp.top] for lp in scores]), rows.topk(5).values, atol=5e-3)


@pytest.mark.parametrize("policy", ["chain", "adaserve"])
def test_structured_output_on_the_real_pair_is_the_targets_constrained_greedy_decoding(pair, policy):
    """A JSON schema on SmolLM2's chat: local serving's output is the target's own greedy decoding
    with every token the grammar refuses at -inf (a fresh matcher each step), ending at EOS, and is
    JSON of the schema; the draft, masked the same way, drafts inside the grammar."""
    from goodspeed.lm.decoding.params import SamplingParams
    from goodspeed.lm.decoding.structured import Structure
    from modelkit import adjusted_greedy_reference

    target, draft = pair
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0}},
              "required": ["city", "population"], "additionalProperties": False}
    sampling = SamplingParams(structured=Structure("json", json.dumps(schema), any_whitespace=False).bound(target.tokenizer))
    eos = target.tokenizer.eos_token_id
    asks = ["What is the largest city in France? Answer in JSON.", "Give one city in Japan and its population as JSON."]
    prompts = [chat_prompt_ids(target.tokenizer, [{"role": "user", "content": a}]) for a in asks]
    engine = VerificationEngine(target.model, EngineConfig(seed=0))
    serving = LocalServing(engine, draft.model, LocalConfig(policy=policy, max_requests=4, budget=12, k=4))
    ids = [serving.submit(p, sampling, max_new_tokens=40, eos_token_ids=(eos,)) for p in prompts]
    while serving.step() is not None:
        pass
    by_id = {r.request_id: r.generated for r in serving.finished}
    for rid, prompt in zip(ids, prompts):
        want = adjusted_greedy_reference(target.model, prompt, sampling, 40, eos=eos)
        assert by_id[rid] == want and want[-1] == eos
        value = json.loads(target.tokenizer.decode(want[:-1]))
        assert set(value) == {"city", "population"} and isinstance(value["population"], int)
    # The distilled draft predicts these short chat replies poorly, constrained or not (2026-11-28:
    # chain 19 of 108 drafted accepted with the schema, 14 of 143 without; docs/MEASUREMENTS.md)
    assert serving.stats()["accepted"] > 0


def test_a_required_tool_call_on_the_real_pair_is_the_targets_constrained_greedy_decoding(pair):
    """tool_choice "required" through the verifier's OpenAI API on SmolLM2's chat (its template
    renders no tools: the call's schema reaches the model through the grammar alone): the reply is
    the target's greedy decoding under vLLM's array-of-calls schema, read into tool_calls."""
    import openai

    from goodspeed.api.tools import Tool, forced_schema
    from goodspeed.lm.decoding.params import SamplingParams
    from goodspeed.lm.decoding.structured import Structure
    from grpckit import ServerThread
    from modelkit import adjusted_greedy_reference

    target, draft = pair
    tool = {"type": "function", "function": {"name": "weather", "description": "the weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"],
        "additionalProperties": False}}}
    engine = VerificationEngine(target.model, EngineConfig(budget=8, seed=0), target.fingerprint)
    local = LocalServing(engine, draft.model, LocalConfig(policy="chain", k=3))
    with ServerThread(engine, local=local, tokenizer=target.tokenizer, http_port=0, target_name="real") as server:
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{server.server.http_port}/v1", api_key="-", max_retries=0)
        out = api.chat.completions.create(model="real", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                                          tools=[tool], tool_choice="required", max_tokens=60, temperature=0,
                                          extra_body={"return_token_ids": True})
    schema = forced_schema([Tool.model_validate(tool)], "required")
    sampling = SamplingParams(structured=Structure("json", json.dumps(schema)).bound(target.tokenizer))
    eos = target.tokenizer.eos_token_id
    want = adjusted_greedy_reference(target.model, out.model_extra["prompt_token_ids"], sampling, 60, eos=eos)
    choice = out.choices[0]
    assert choice.model_extra["token_ids"] == want and want[-1] == eos and choice.finish_reason == "tool_calls"
    calls = [{"name": c.function.name, "parameters": json.loads(c.function.arguments)} for c in choice.message.tool_calls]
    assert calls == json.loads(target.tokenizer.decode(want[:-1])) and calls[0]["name"] == "weather"


def test_the_responses_and_messages_apis_on_the_real_pair_are_the_targets_greedy_decoding(pair):
    """OpenAI's Responses API and Anthropic's Messages API through their official clients, on
    SmolLM2's own chat template and tokenizer: each reply is the target's greedy decoding of the
    conversation as chat completions render it (instructions / system as the system message)."""
    import anthropic
    import openai

    from goodspeed.lm.decoding.params import SamplingParams
    from grpckit import ServerThread
    from modelkit import adjusted_greedy_reference

    target, draft = pair
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = chat_prompt_ids(target.tokenizer, [{"role": "system", "content": "Answer briefly."}] + messages)
    eos = target.tokenizer.eos_token_id
    engine = VerificationEngine(target.model, EngineConfig(budget=8, seed=0), target.fingerprint)
    local = LocalServing(engine, draft.model, LocalConfig(policy="chain", k=3))
    with ServerThread(engine, local=local, tokenizer=target.tokenizer, http_port=0, target_name="real") as server:
        base = f"http://127.0.0.1:{server.server.http_port}"
        api = openai.OpenAI(base_url=f"{base}/v1", api_key="-", max_retries=0)
        response = api.responses.create(model="real", instructions="Answer briefly.", input=messages, max_output_tokens=24,
                                        temperature=0)
        claude = anthropic.Anthropic(base_url=base, api_key="-", max_retries=0)
        message = claude.messages.create(model="real", system="Answer briefly.", messages=messages, max_tokens=24,
                                         extra_body={"temperature": 0})
    want = adjusted_greedy_reference(target.model, ids, SamplingParams(), 24, eos=eos)
    text = target.tokenizer.decode([t for t in want if t != eos], skip_special_tokens=True)
    assert response.output_text == text == message.content[0].text
    assert response.usage.input_tokens == message.usage.input_tokens == len(ids)
    assert response.usage.output_tokens == message.usage.output_tokens == len(want)


@pytest.fixture(scope="module")
def bf16_targets():
    """The target in bf16 twice: as torch runs it, and batch invariant (the option changes the
    model's linear layers in place)."""
    return load_causal_lm("real:smollm2-135m", dtype="bfloat16"), load_causal_lm("real:smollm2-135m", dtype="bfloat16")


@pytest.mark.skipif("amx_bf16" not in cpu_flags(), reason="bf16 exactness is measured on CPUs with AMX (amx_bf16) only")
def test_bf16_speculative_output_is_plain_decodings_token_for_token(bf16_targets):
    """In bf16 a position's logits are the same bit for bit in any step shape (keys read in whole
    runs; with batch_invariant, linear layers in runs of 32 rows), so greedy speculative output
    equals plain decoding's one request at a time: lookups at batch 1 (no forward over 32 tokens)
    as torch runs the layers, and at batch 8 batch invariant; plain decoding at batch 8 too. Sixteen
    tasks of the per-task benchmark, 48 tokens each. (The negative controls are the logits-level
    tests': tests/lm/runtime/test_packing.py, test_invariant.py.)"""
    from bench.bench_invariance import serve  # the benchmark's own serving: lookups under the goodput policy
    from bench.bench_workloads import load_tasks

    as_is, invariant = bf16_targets
    tok = as_is.tokenizer
    prompts = [chat_prompt_ids(tok, t["messages"]) for t in load_tasks()[::3][:16]]
    eos = [tok.eos_token_id]

    def greedy(engine, source, batch):
        """The outputs of ``prompts`` served ``batch`` at a time (one request alone: one at a time)."""
        if batch == 1:
            return [serve(engine, [p], source, 1, eos, 48)[0][0] for p in prompts]
        return serve(engine, prompts, source, batch, eos, 48)[0]

    engine = VerificationEngine(as_is.model, EngineConfig(seed=0))
    reference = greedy(engine, "plain", 1)
    assert greedy(engine, "ngram", 1) == reference
    assert greedy(engine, "plain", 8) == reference
    exact = VerificationEngine(invariant.model, EngineConfig(seed=0, batch_invariant=True))
    exact_reference = greedy(exact, "plain", 1)
    for source in ("ngram", "suffix"):
        assert greedy(exact, source, 8) == exact_reference
