"""Structured output (a grammar every text must match) stays lossless on every path: the engine's
edge chains (with and without decoding in transit) and local serving's policies (chains, TETRIS,
AdaServe's trees), greedy and sampled.

Greedy output must equal the target's own constrained greedy decoding (each step's logits with
every token the grammar refuses after the text at -inf, from a fresh matcher: ``statkit``), and
match the grammar; sampled output must follow the target's constrained distribution (the joint
distribution of the first two tokens, chi-square at p = 1e-5). Negative controls, in the default
tier: a verifier that masks every position by the committed text alone (forgetting the drafted
tokens before it), and one that gates a grammar-after-a-token by the committed text alone, must
fail the sampled test or commit a text the grammar refuses, which the request's own matcher
catches."""

import inspect
import json
import re

import pytest

from goodspeed.lm.models.demo import train_tokenizer
from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.lm.decoding.structured import Structure, StructureError
from goodspeed.verifier import verify_rows
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from goodspeed.verifier.errors import MalformedDraftError
from goodspeed.verifier.clocks import SimulatedClock
from goodspeed.verifier.local import LocalConfig, LocalServing
from modelkit import adjusted_greedy_reference, perturbed, tiny_llama
from pathkit import DRAFT_COST, PATHS, TARGET_COST, on_path, run_edge, run_local
from statkit import count_first_two, exact_first_two, fits

V = 300
EOS = 0  # the demo tokenizer's <|endoftext|>
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "string", "maxLength": 4}},
          "required": ["a", "b"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(inspect.getsource(json.decoder) * 3, vocab_size=V)


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(0, vocab=V)
    return target, perturbed(target, 0.05, 1)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.encode(t) for t in ("def scan(s, end):", "return", "    if self.", "x = 12")]


def structures(tokenizer):
    return {
        "choice": Structure("choice", json.dumps(["decoder", "scanner", "end", "JSONObject"])).bound(tokenizer),
        "regex": Structure("regex", r"[a-z_]{1,6}\((self|s), [0-9]{1,2}\)").bound(tokenizer),
        "json": Structure("json", json.dumps(SCHEMA), any_whitespace=False).bound(tokenizer),
    }


def matches(kind: str, text: str) -> bool:
    if kind == "choice":
        return text in ("decoder", "scanner", "end", "JSONObject")
    if kind == "regex":
        return re.fullmatch(r"[a-z_]{1,6}\((self|s), [0-9]{1,2}\)", text) is not None
    value = json.loads(text)
    return set(value) == {"a", "b"} and isinstance(value["a"], int) and 0 <= value["a"] <= 99 and isinstance(value["b"], str) and len(value["b"]) <= 4


@pytest.mark.parametrize("kind", ["choice", "regex", "json"])
@pytest.mark.parametrize("path", PATHS)
def test_greedy_output_is_the_targets_constrained_greedy_decoding(tokenizer, pair, prompts, kind, path):
    target, draft = pair
    sampling = SamplingParams(structured=structures(tokenizer)[kind])
    want = [adjusted_greedy_reference(target, p, sampling, 40, eos=EOS) for p in prompts]
    for out in want:
        assert out[-1] == EOS and matches(kind, tokenizer.decode(out[:-1])), tokenizer.decode(out)
    outputs, accepted = on_path(path, target, draft, sampling, prompts, 40, eos=(EOS,))
    assert outputs == want and (accepted > 0 or path == "local-none")


@pytest.mark.parametrize("path", PATHS)
def test_a_grammar_after_a_token_is_the_targets_greedy_decoding_gated_the_same_way(tokenizer, pair, prompts, path):
    """``after`` (a reasoning model's ``</think>``, here a token the tiny target writes often): the
    text is free until the first one, then held to the grammar; every path gives the target's own
    greedy decoding gated the same way (``statkit``'s reference)."""
    target, draft = pair
    free = [adjusted_greedy_reference(target, p, SamplingParams(), 40) for p in prompts]
    counts = {}
    for out in free:
        for t in set(out[1:8]):
            counts[t] = counts.get(t, 0) + 1
    gate = max(counts, key=lambda t: (counts[t], -t))  # written early in the most continuations
    structure = Structure("regex", r"[a-z_]{1,6}\((self|s), [0-9]{1,2}\)", after=gate).bound(tokenizer)
    sampling = SamplingParams(structured=structure)
    want = [adjusted_greedy_reference(target, p, sampling, 40, eos=EOS) for p in prompts]
    gated = [out for out in want if gate in out]
    assert any(out[-1] == EOS for out in gated), "no text reaches the gate and then completes its grammar"
    for out, plain in zip(want, free):
        k = out.index(gate) if gate in out else len(out)
        assert out[:k] == plain[:k]  # free text until the gate: the plain greedy decoding
        if gate in out and out[-1] == EOS:
            assert matches("regex", tokenizer.decode(out[k + 1:-1]))
    outputs, accepted = on_path(path, target, draft, sampling, prompts, 40, eos=(EOS,))
    assert outputs == want and (accepted > 0 or path == "local-none")


def test_the_grammar_changes_the_output(tokenizer, pair, prompts):
    """The greedy test shows something: unconstrained, the tiny target's text matches no grammar."""
    target, _ = pair
    plain = [adjusted_greedy_reference(target, p, SamplingParams(), 12) for p in prompts]
    assert all(not matches(kind, tokenizer.decode(out)) for out in plain for kind in ("choice", "regex"))


def test_the_engine_refuses_what_the_grammar_cannot_serve(tokenizer, pair):
    target, _ = pair
    engine = VerificationEngine(target, EngineConfig())
    sid = engine.join("d")
    bound = structures(tokenizer)["choice"]
    with pytest.raises(MalformedDraftError, match="compiled against"):
        engine.start_request(sid, [5, 6], SamplingParams(structured=Structure("regex", "a+")), 8, eos_token_ids=(EOS,))
    with pytest.raises(MalformedDraftError, match="not one of the request's ending tokens"):
        engine.start_request(sid, [5, 6], SamplingParams(structured=bound), 8, eos_token_ids=())
    decoder = tokenizer.encode("decoder")
    with pytest.raises(MalformedDraftError, match="resumed output"):
        engine.start_request(sid, [5, 6] + tokenizer.encode("xyz"), SamplingParams(structured=bound), 8, eos_token_ids=(EOS,),
                             generated=len(tokenizer.encode("xyz")))
    engine.start_request(sid, [5, 6] + decoder, SamplingParams(structured=bound), 8, eos_token_ids=(EOS,), generated=len(decoder))


def test_a_grammar_past_its_limits_ends_its_own_request_alone(tokenizer, pair, prompts, monkeypatch):
    """A grammar that passes its check but exceeds llguidance's per-step limits later (forced here
    with a tiny lexer budget) ends its request with an error at that step; the requests batched
    with it (edge and local) are untouched."""
    from goodspeed.lm.decoding import structured

    target, draft = pair
    monkeypatch.setattr(structured, "LIMITS", structured.llguidance.LLParserLimits(step_lexer_fuel=100, verbose_errors=False))
    json_object = Structure("json_object").bound(tokenizer)  # its first mask fits the budget
    plain = SamplingParams()
    engine = VerificationEngine(target, EngineConfig())
    serving = LocalServing(engine, draft, LocalConfig(policy="chain", k=2, budget=24, max_requests=8),
                           SimulatedClock(TARGET_COST, DRAFT_COST))
    shaped = serving.submit(prompts[0], SamplingParams(structured=json_object), max_new_tokens=20, eos_token_ids=(EOS,))
    others = [serving.submit(p, plain, max_new_tokens=12) for p in prompts[1:]]
    while serving.step() is not None:
        pass
    done = {r.request_id: r for r in serving.finished}
    assert done[shaped].finish_reason.startswith("error: the json_object constraint exceeded its limits")
    assert done[shaped].generated[-1] == EOS and len(done[shaped].generated) < 20
    for rid, p in zip(others, prompts[1:]):
        assert done[rid].finish_reason == "length" and done[rid].generated == adjusted_greedy_reference(target, p, plain, 12)


CHOICES = Structure("choice", json.dumps(["ab", "ba", "b", "aab", "bb"]))


@pytest.mark.parametrize("where", ["edge", "local-chain", "local-adaserve"])
def test_sampled_output_follows_the_targets_constrained_distribution(tokenizer, pair, where):
    target, draft = pair
    sampling = SamplingParams(temperature=1.0, structured=CHOICES.bound(tokenizer))
    prompt = tokenizer.encode("def scan(s, end):")
    if where == "edge":
        outputs, _ = run_edge(target, draft, sampling, [prompt] * 800, 3, drafters=8, eos=(EOS,))
    else:
        outputs, _ = run_local(target, draft, sampling, where.removeprefix("local-"), [prompt] * 600, 3, eos=(EOS,))
    assert all(matches_choice(tokenizer, out) for out in outputs)
    ok, msg = fits(count_first_two(outputs, V), exact_first_two(target, prompt, sampling))
    assert ok, msg


@pytest.mark.parametrize("where", ["edge", "local-adaserve", "power"])
def test_sampled_output_with_a_grammar_after_a_token_follows_the_targets_gated_distribution(tokenizer, pair, where,
                                                                                           monkeypatch):
    """``after`` set to the target's likeliest first token: a text that opens with it is held to
    the grammar from its second token, any other is free; the joint distribution of the first two
    tokens is the target's gated the same way (``statkit``). Power check: gating each position by
    the committed text alone (a drafted gate left out) must fail, or commit a text the grammar
    refuses (which the request's own matcher catches)."""
    import torch

    from goodspeed.lm.decoding.structured import Constraint

    if where == "power":
        monkeypatch.setattr(Constraint, "_held", lambda self, path: list(path) if self.open else None)  # masks only
    target, draft = pair
    prompt = tokenizer.encode("def scan(s, end):")
    with torch.inference_mode():
        gate = int(torch.argmax(target(input_ids=torch.tensor([prompt])).logits[0, -1]))
    sampling = SamplingParams(temperature=1.0, structured=Structure(CHOICES.kind, CHOICES.spec, after=gate).bound(tokenizer))
    try:
        if where in ("edge", "power"):
            outputs, _ = run_edge(target, draft, sampling, [prompt] * 800, 3, drafters=8, eos=(EOS,))
        else:
            outputs, _ = run_local(target, draft, sampling, where.removeprefix("local-"), [prompt] * 600, 3, eos=(EOS,))
    except StructureError as exc:
        assert where == "power" and "does not match the choice constraint" in str(exc)
        return
    if where == "power":
        ok, _ = fits(count_first_two(outputs, V), exact_first_two(target, prompt, sampling, eos=EOS))
        assert not ok or not all(matches_choice(tokenizer, out[1:]) for out in outputs if out[0] == gate and out[1:])
        return
    opened = [out[1:] for out in outputs if out[0] == gate]
    assert len(opened) > 20 and all(matches_choice(tokenizer, out) for out in opened if out)
    ok, msg = fits(count_first_two(outputs, V), exact_first_two(target, prompt, sampling, eos=EOS))  # EOS is free first
    assert ok, msg


def matches_choice(tokenizer, out) -> bool:
    text = tokenizer.decode([t for t in out if t != EOS])
    return (text in ("ab", "ba", "b", "aab", "bb") if out[-1] == EOS else any(c.startswith(text) for c in ("ab", "ba", "b", "aab", "bb")))


def test_power_masks_by_the_committed_text_alone_fail(tokenizer, pair, monkeypatch):
    """Power check: each position masked by the committed text alone (the drafted tokens before
    it left out) must fail the same test, or commit a text the grammar refuses (which the
    request's own matcher catches)."""
    monkeypatch.setattr(verify_rows, "draft_paths", lambda tokens, parents: [[] for _ in range(len(tokens) + 1)])
    target, draft = pair
    sampling = SamplingParams(temperature=1.0, structured=CHOICES.bound(tokenizer))
    prompt = tokenizer.encode("def scan(s, end):")
    try:
        outputs, _ = run_edge(target, draft, sampling, [prompt] * 800, 3, drafters=8, eos=(EOS,))
    except StructureError as exc:
        assert "does not match the choice constraint" in str(exc)
        return
    ok, msg = fits(count_first_two(outputs, V), exact_first_two(target, prompt, sampling))
    assert not ok, msg


FORCED_FIRST = Structure("choice", json.dumps(["xa", "xb", "xc"]))  # "x" is the one token allowed first


@pytest.mark.parametrize("policy", ["chain", "tetris", "adaserve"])
def test_fast_forward_drafts_forced_tokens_and_greedy_stays_the_targets(tokenizer, pair, prompts, policy):
    """Local serving drafts the tokens a compact JSON schema forces (``{"a":`` and so on) as
    point masses before the draft model's own tokens (under AdaServe, as the trunk of its tree);
    the output is the target's constrained greedy decoding and every forced token was accepted."""
    target, draft = pair
    sampling = SamplingParams(structured=structures(tokenizer)["json"])
    want = [adjusted_greedy_reference(target, p, sampling, 40, eos=EOS) for p in prompts]
    outputs, serving = run_local(target, draft, sampling, policy, prompts, 40, eos=(EOS,))
    assert outputs == want
    assert serving.totals["forced"] >= 4 * len(prompts)  # {"a": at least, in every request
    assert serving.totals["accepted"] >= serving.totals["forced"]


@pytest.mark.parametrize("policy", ["chain", "adaserve"])
def test_sampled_output_after_a_forced_token_follows_the_target(tokenizer, pair, policy):
    """The first token forced (drafted as a point mass, p = 1 under the mask; under AdaServe the
    trunk of the tree), the second the target's masked choice among three: their joint
    distribution is the target's."""
    target, draft = pair
    sampling = SamplingParams(temperature=1.0, structured=FORCED_FIRST.bound(tokenizer))
    assert sampling.structured.constraint().forced(2) == tokenizer.encode("x")
    prompt = tokenizer.encode("def scan(s, end):")
    outputs, serving = run_local(target, draft, sampling, policy, [prompt] * 600, 3, eos=(EOS,))
    ok, msg = fits(count_first_two(outputs, V), exact_first_two(target, prompt, sampling, eos=EOS))
    assert ok, msg
    assert serving.totals["forced"] >= 600
