"""Logit bias, penalties, min-p, min_tokens, bad_words and allowed_token_ids stay lossless on every path: the engine's chains (edge drafts,
delayed drafts decoded in transit) and trees, and local serving's policies, greedy and sampled.

Greedy output must equal the target's own greedy decoding with the same settings, each step's
logits adjusted by the text before it (``statkit.reference_adjust``, the definitions written out
densely); sampled output must follow the target's adjusted distribution (the joint distribution of
the first two tokens, chi-square at p = 1e-5, as ``test_lossless``). The drafts here adjust
nothing (edge runners) or adjust their own logits (local serving's chains): exactness holds for
either. A verifier that forgets the drafted tokens in the text a position follows must fail the
sampled test (power check)."""

import pytest
import torch

from goodspeed.lm.runtime.batch_draft import BatchDraftModel
from goodspeed.lm.decoding.adjust import adjust_logits
from goodspeed.lm.decoding.history import TokenHistory
from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.verifier import verify_rows
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from goodspeed.verifier.errors import InvalidTokenError, MalformedDraftError
from goodspeed.verifier.types import Draft
from modelkit import adjusted_greedy_reference, perturbed, tiny_llama
from pathkit import PATHS, on_path, run_edge, run_local
from statkit import Z_POWER, chi2_critical, chi2_stat, count_first_two, exact_first_two, fits, reference_adjust

V = 6
PROMPT = [1, 2, 3]
PENALTIES = SamplingParams(temperature=1.0, presence_penalty=0.6, frequency_penalty=0.9, repetition_penalty=1.6)
BIAS_MIN_P = SamplingParams(temperature=0.9, min_p=0.15, logit_bias=((0, 1.5), (4, -2.0)))
ALLOWED = SamplingParams(temperature=1.0, allowed_token_ids=(0, 2, 3, 5), presence_penalty=0.5)
GREEDY = {
    "repetition": SamplingParams(repetition_penalty=1.5),
    "presence-frequency": SamplingParams(presence_penalty=1.2, frequency_penalty=0.7),
    "bias": SamplingParams(logit_bias=((3, 2.5), (10, -100.0))),
}


@pytest.fixture(scope="module")
def small():
    target = tiny_llama(4, vocab=V, init=0.08)
    return target, perturbed(target, 1.0, 5)


@pytest.fixture(scope="module")
def wide():
    """A 48-token vocabulary: long greedy outputs repeat tokens, so the penalties change them."""
    target = tiny_llama(7, vocab=48)
    return target, perturbed(target, 0.3, 8)


# ------------------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("name", sorted(GREEDY))
def test_greedy_edge_chains_are_the_targets_adjusted_greedy_decoding(wide, name):
    target, draft = wide
    sampling = GREEDY[name]
    prompts = [[1, 2, 3, 1], [5, 5, 5], [7, 8], [9, 1, 9, 1, 9]]
    outputs, results = run_edge(target, draft, sampling, prompts, 24)
    want = [adjusted_greedy_reference(target, p, sampling, 24) for p in prompts]
    assert sorted(outputs) == sorted(want)
    assert sum(v.num_accepted for r in results for v in r.verdicts.values()) > 0
    plain = [adjusted_greedy_reference(target, p, SamplingParams(), 24) for p in prompts]
    assert want != plain, "the setting must change the output, or this test shows nothing"


def test_greedy_with_transit_decoding_is_exact(wide):
    target, draft = wide
    sampling = SamplingParams(repetition_penalty=1.4, frequency_penalty=0.5)
    prompts = [[1, 2, 3, 1], [5, 5, 5], [7, 8], [9, 1, 9, 1, 9]]
    outputs, results = run_edge(target, draft, sampling, prompts, 20, transit=True)
    assert sorted(outputs) == sorted(adjusted_greedy_reference(target, p, sampling, 20) for p in prompts)
    assert sum(r.transit_tokens for r in results) > 0


@pytest.mark.parametrize("policy", ["none", "chain", "tetris", "adaserve"])
def test_greedy_local_serving_is_exact_for_every_policy(wide, policy):
    target, draft = wide
    sampling = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, logit_bias=((4, 1.0),))
    prompts = [[1, 2, 3, 1], [5, 5, 5], [7, 8], [9, 1, 9, 1, 9], [11, 12, 13]]
    outputs, _ = run_local(target, draft, sampling, policy, prompts, 16)
    assert outputs == [adjusted_greedy_reference(target, p, sampling, 16) for p in prompts]


def test_greedy_trees_through_the_engine_are_exact(wide):
    """Deterministic trees (the target's own adjusted greedy path among the nodes, plus decoys) on
    a penalised request: each position is adjusted by its own node's path. The decoys come first
    and are the path's next tokens, so a position adjusted by the nodes before it in the draft
    (as if the tree were a chain) would penalise the very token it should emit."""
    target, _ = wide
    sampling = SamplingParams(repetition_penalty=1.6, frequency_penalty=0.8)
    prompt = [3, 3, 4, 3]
    want = adjusted_greedy_reference(target, prompt, sampling, 12)
    engine = VerificationEngine(target, EngineConfig(budget=32, max_draft_len=8))
    sid = engine.join("tree")
    engine.start_request(sid, prompt, sampling, max_new_tokens=12)
    out = []
    while len(out) < 12:
        i = len(out)
        right = want[i:i + 3] + [(want[-1] + 1) % 48] * 2
        # nodes: 0 a decoy (right[1]) and 1 right[0] under the root; 2 a decoy (right[2]) and 3 right[1] under node 1
        tokens, parents = [right[1], right[0], right[2], right[1]], [-1, -1, 1, 1]
        n = min(len(tokens), 12 - i - 1)
        tokens, parents = tokens[:n], parents[:n]
        engine.set_allotment(sid, len(tokens))
        engine.submit(sid, Draft(engine.next_round(sid), tokens, parents=parents if tokens else None))
        verdict = engine.run_round().verdicts[sid]
        out += verdict.token_ids
        if verdict.finished:
            break
    assert out == want


def ended(tokens, eos):
    """``tokens`` up to and including the first ending token (where a request stops)."""
    cut = next((i for i, t in enumerate(tokens) if t in eos), len(tokens) - 1)
    return tokens[: cut + 1]


@pytest.mark.parametrize("path", PATHS)
def test_min_tokens_holds_the_ending_tokens_back_and_stays_exact(wide, path):
    """vLLM's min_tokens: two ending tokens the target's plain greedy decoding emits early (so those
    texts would end before 4 tokens) are held back until 4 tokens are out; each output is the
    target's greedy decoding with them held back, up to the first ending token after that. Two
    texts end at the very first position allowed, which a speculative position past it reaches only
    by its drafted path (a verifier that held back by the committed text alone would not end them).
    Edge drafts do not hold them back (the verifier rejects them); local drafts do."""
    target, draft = wide
    prompts = [[1, 2, 3, 1], [5, 5, 5], [7, 8], [9, 1, 9, 1, 9]]
    plain = [adjusted_greedy_reference(target, p, SamplingParams(), 16) for p in prompts]
    eos = tuple(sorted({plain[0][1], plain[2][3]}))
    sampling = SamplingParams(min_tokens=4)
    want = [ended(adjusted_greedy_reference(target, p, sampling.ending_with(eos), 16), eos) for p in prompts]
    assert any(len(ended(out, eos)) < 4 for out in plain), "the ending tokens must come early, or this test shows nothing"
    assert all(not set(out[:4]) & set(eos) for out in want) and want != [ended(out, eos) for out in plain]
    assert sum(len(out) == 5 for out in want) == 2  # ended by the 5th token, the first allowed
    assert on_path(path, target, draft, sampling, prompts, 16, eos=eos)[0] == want


@pytest.mark.parametrize("path", PATHS)
def test_allowed_token_ids_keep_the_text_to_them_and_stay_exact(wide, path):
    """vLLM's allowed_token_ids (with a penalty on top): every output token is an allowed one, and
    each output is the target's greedy decoding with the others at -inf. Edge drafts do not mask
    (the verifier rejects what they draft outside the set); local drafts do."""
    target, draft = wide
    prompts = [[1, 2, 3, 1], [5, 5, 5], [7, 8], [9, 1, 9, 1, 9]]
    sampling = SamplingParams(allowed_token_ids=tuple(range(0, 48, 3)) + (47,), frequency_penalty=0.4)
    want = [adjusted_greedy_reference(target, p, sampling, 16) for p in prompts]
    assert all(set(out) <= set(sampling.allowed_token_ids) for out in want)
    assert want != [adjusted_greedy_reference(target, p, SamplingParams(frequency_penalty=0.4), 16) for p in prompts]
    outputs, accepted = on_path(path, target, draft, sampling, prompts, 16)
    assert outputs == want and (accepted > 0 or path == "local-none")


def test_allowed_token_ids_that_min_tokens_holds_back_entirely_or_past_the_vocabulary_are_refused(wide):
    engine = VerificationEngine(wide[0], EngineConfig())
    sid = engine.join("d")
    with pytest.raises(InvalidTokenError):
        engine.start_request(sid, [1, 2], SamplingParams(allowed_token_ids=(3, 48)), max_new_tokens=4)
    with pytest.raises(MalformedDraftError, match="hold back every one"):
        engine.start_request(sid, [1, 2], SamplingParams(min_tokens=2, allowed_token_ids=(3, 5)), max_new_tokens=4,
                             eos_token_ids=(3, 5, 9))
    engine.start_request(sid, [1, 2], SamplingParams(min_tokens=2, allowed_token_ids=(3, 5)), max_new_tokens=4,
                         eos_token_ids=(3,))


def test_a_resumed_request_counts_its_output_as_output(wide):
    """A request resumed from its verified text (an edge node's repair) says how many of its prompt
    tokens are output (``generated``): presence and frequency penalties count them, so it goes on
    as the uninterrupted request would. Counted as prompt instead, the output differs."""
    target, _ = wide
    sampling = SamplingParams(presence_penalty=1.5, frequency_penalty=1.0)
    prompt = [2, 5, 2]
    whole = adjusted_greedy_reference(target, prompt, sampling, 20)
    engine = VerificationEngine(target, EngineConfig(budget=8))

    def continuation(generated):
        sid = engine.join(f"resume-{generated}")
        engine.start_request(sid, prompt + whole[:8], sampling, max_new_tokens=12, generated=generated)
        out = []
        while True:
            engine.set_allotment(sid, 0)
            engine.submit(sid, Draft(engine.next_round(sid), []))
            verdict = engine.run_round().verdicts[sid]
            out += verdict.token_ids
            if verdict.finished:
                engine.leave(sid)
                return out

    assert continuation(8) == whole[8:]
    assert continuation(0) != whole[8:]
    sid = engine.join("bad")
    with pytest.raises(MalformedDraftError):
        engine.start_request(sid, prompt, sampling, max_new_tokens=4, generated=4)
    with pytest.raises(InvalidTokenError):
        engine.start_request(sid, prompt, SamplingParams(logit_bias=((48, 1.0),)), max_new_tokens=4)
    with pytest.raises(InvalidTokenError):  # an ending token min_tokens would index the logits with
        engine.start_request(sid, prompt, SamplingParams(min_tokens=2), max_new_tokens=4, eos_token_ids=(48,))
    engine.start_request(sid, prompt, SamplingParams(), max_new_tokens=4, eos_token_ids=(48,))  # read by nothing else


# ------------------------------------------------------------------------------------- sampled


# Penalties by default; the other two (about 10 s each) with -m slow.
@pytest.mark.parametrize("sampling", [PENALTIES, pytest.param(BIAS_MIN_P, marks=pytest.mark.slow), pytest.param(ALLOWED, marks=pytest.mark.slow)],
                         ids=["penalties", "bias-min-p", "allowed"])
def test_sampled_edge_chains_follow_the_adjusted_target(small, sampling):
    target, draft = small
    outputs, results = run_edge(target, draft, sampling, [PROMPT] * 800, 3, drafters=8)
    ok, msg = fits(count_first_two(outputs, V), exact_first_two(target, PROMPT, sampling))
    assert ok, msg
    verdicts = [v for r in results for v in r.verdicts.values()]
    # speculation really happened, rejections included (about 1,300 accepted and 300 rejecting verdicts; default seeds)
    assert sum(v.num_accepted for v in verdicts) > 600 and sum(v.num_accepted < v.num_drafted for v in verdicts) > 100


def test_a_verifier_that_forgets_the_drafted_text_is_caught(small, monkeypatch):
    """Power check: every position adjusted by the committed text alone (the drafted tokens before
    it left out) must fail the same test at p < 1e-6 (chi2 283 and 367 in two runs, against 81)."""
    monkeypatch.setattr(verify_rows, "draft_paths", lambda tokens, parents: [[] for _ in range(len(tokens) + 1)])
    target, draft = small
    outputs, _ = run_edge(target, draft, PENALTIES, [PROMPT] * 800, 3, drafters=8)
    stat, dof = chi2_stat(count_first_two(outputs, V), exact_first_two(target, PROMPT, PENALTIES))
    assert stat > chi2_critical(dof, z=Z_POWER), f"chi2 {stat:.1f}: the test lacks power at p = 1e-6"


def likeliest_pair(target) -> tuple[int, int]:
    """The target's most probable first token, and its most probable second after that one."""
    free = exact_first_two(target, PROMPT, SamplingParams(temperature=1.0))
    first = int(free.sum(axis=1).argmax())
    return first, int(free[first, :V].argmax())


@pytest.mark.parametrize("where", [pytest.param("edge", marks=pytest.mark.slow), "local-adaserve"])  # edge: 10 s, slow
def test_sampled_bad_words_follow_the_target_that_may_not_say_them(small, where):
    """vLLM's bad_words with the target's likeliest first two tokens as the banned pair: no output
    starts with it, and the first two tokens follow the target's distribution with the pair's
    second token banned after its first."""
    target, draft = small
    sampling = SamplingParams(temperature=1.0, bad_words=(likeliest_pair(target),))
    if where == "edge":
        outputs, _ = run_edge(target, draft, sampling, [PROMPT] * 800, 3, drafters=8)
    else:
        outputs, _ = run_local(target, draft, sampling, "adaserve", [PROMPT] * 600, 3)
    assert not any(tuple(out[:2]) == sampling.bad_words[0] for out in outputs)
    ok, msg = fits(count_first_two(outputs, V), exact_first_two(target, PROMPT, sampling))
    assert ok, msg


@pytest.mark.slow  # power check (11 s); the drafted-text one above runs by default
def test_a_verifier_that_bans_by_the_committed_text_alone_lets_a_bad_pair_through(small, monkeypatch):
    """Power check for the test above: each position banned by the committed text alone lets the
    drafted first token's banned successor through."""
    monkeypatch.setattr(verify_rows, "draft_paths", lambda tokens, parents: [[] for _ in range(len(tokens) + 1)])
    target, draft = small
    pair = likeliest_pair(target)
    outputs, _ = run_edge(target, draft, SamplingParams(temperature=1.0, bad_words=(pair,)), [PROMPT] * 800, 3, drafters=8)
    assert sum(tuple(out[:2]) == pair for out in outputs) > 20


@pytest.mark.parametrize("path", PATHS)
def test_bad_words_are_never_generated_and_stay_exact(wide, path):
    """vLLM's bad_words: a two-token sequence and a token the plain greedy text emits are never
    generated (the pair's second token is banned after its first, drafted or committed); each
    output is the target's greedy decoding with them banned."""
    target, draft = wide
    prompts = [[1, 2, 3, 1], [5, 5, 5], [7, 8], [9, 1, 9, 1, 9]]
    plain = [adjusted_greedy_reference(target, p, SamplingParams(), 16) for p in prompts]
    pair, single = tuple(plain[0][2:4]), plain[1][0]
    sampling = SamplingParams(bad_words=(pair, (single,)))
    want = [adjusted_greedy_reference(target, p, sampling, 16) for p in prompts]
    assert want != plain and all(single not in out and pair not in zip(out, out[1:]) for out in want)
    outputs, accepted = on_path(path, target, draft, sampling, prompts, 16)
    assert outputs == want and (accepted > 0 or path == "local-none")


@pytest.mark.parametrize("where", [pytest.param("edge", marks=pytest.mark.slow), "local-adaserve"])  # edge: 12 s, slow
def test_sampled_min_tokens_follows_the_target_that_may_not_end_yet(small, where):
    """min_tokens = 2 with the target's most probable first token as the ending token: neither of
    the first two tokens is it, and they follow the target's distribution with it held back."""
    target, draft = small
    free = exact_first_two(target, PROMPT, SamplingParams(temperature=1.0))
    eos = (int(free.sum(axis=1).argmax()),)
    sampling = SamplingParams(temperature=1.0, min_tokens=2)
    if where == "edge":
        outputs, _ = run_edge(target, draft, sampling, [PROMPT] * 800, 3, drafters=8, eos=eos)
    else:
        outputs, _ = run_local(target, draft, sampling, "adaserve", [PROMPT] * 600, 3, eos=eos)
    assert not any(out[0] in eos or out[1] in eos for out in outputs)
    ok, msg = fits(count_first_two(outputs, V), exact_first_two(target, PROMPT, sampling.ending_with(eos), eos=eos[0]))
    assert ok, msg


@pytest.mark.parametrize("policy, sampling", [("chain", PENALTIES), ("adaserve", PENALTIES),
                                              pytest.param("adaserve", ALLOWED, marks=pytest.mark.slow)],
                         ids=["chain", "adaserve", "adaserve-allowed"])
def test_sampled_local_serving_follows_the_adjusted_target(small, policy, sampling):
    target, draft = small
    outputs, _ = run_local(target, draft, sampling, policy, [PROMPT] * 600, 4)
    ok, msg = fits(count_first_two(outputs, V), exact_first_two(target, PROMPT, sampling))
    assert ok, msg
    if sampling.allowed_token_ids:
        assert all(set(out) <= set(sampling.allowed_token_ids) for out in outputs)


# ------------------------------------------------------------------------------------- drafting


def test_chain_drafts_adjust_the_drafts_logits_by_their_own_text(wide):
    """Local serving's and an edge node's chains: each drafted token is the draft's adjusted argmax
    after the committed text and the tokens drafted before it (greedy), so the draft proposes what
    the adjusted target would; a request without a history biases only."""
    _, draft = wide
    sampling = SamplingParams(repetition_penalty=2.0, presence_penalty=1.0, logit_bias=((6, 3.0),))
    prompt, output = [4, 4, 9], [9, 12]
    batch = BatchDraftModel(draft)
    batch.add("a")
    chains = batch.draft_chains({"a": prompt + output}, {"a": 6}, {"a": sampling}, torch.Generator().manual_seed(0),
                                {"a": TokenHistory(prompt, output)})
    seq = prompt + output
    with torch.inference_mode():
        for token in chains["a"].token_ids:
            logits = reference_adjust(draft(input_ids=torch.tensor([seq])).logits[0, -1], sampling, prompt, seq[len(prompt):])
            assert token == int(torch.argmax(logits))
            seq.append(token)
    plain = BatchDraftModel(draft)
    plain.add("a")
    unadjusted = plain.draft_chains({"a": prompt + output}, {"a": 6}, {"a": SamplingParams()}, torch.Generator().manual_seed(0))
    assert chains["a"].token_ids != unadjusted["a"].token_ids


def test_beam_trees_rank_each_beams_candidates_by_its_own_adjusted_text(wide):
    """AdaServe's beam trees: every node's path probability is its parent's times the draft's
    adjusted probability of its token after the committed text and the beam's path (the ranking
    of a greedy request is the draft's softmax); a request that adjusts nothing drafts as before."""
    _, draft = wide
    sampling = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.8)
    prompt, output = [4, 4, 9], [9, 12]
    batch = BatchDraftModel(draft)
    for key in ("a", "b"):
        batch.add(key)
    committed = {"a": prompt + output, "b": [5, 6, 7]}
    trees = batch.draft_trees(committed, 3, 3, {"a": sampling, "b": SamplingParams()}, None,
                              {"a": TokenHistory(prompt, output), "b": None})
    tree = trees["a"]
    assert len(tree.token_ids) > 3 and max(tree.depths) == 3
    with torch.inference_mode():
        for node, (token, parent) in enumerate(zip(tree.token_ids, tree.parents)):
            path, p = [], parent
            while p >= 0:
                path.insert(0, tree.token_ids[p])
                p = tree.parents[p]
            seq = committed["a"] + path
            logits = reference_adjust(draft(input_ids=torch.tensor([seq])).logits[0, -1].double(), sampling, prompt,
                                      output + path)
            before = 1.0 if parent < 0 else tree.path_probs[parent]
            assert tree.path_probs[node] == pytest.approx(before * torch.softmax(logits, -1)[token].item(), rel=1e-5)
    alone = BatchDraftModel(draft)
    alone.add("b")
    assert alone.draft_trees({"b": [5, 6, 7]}, 3, 3, {"b": SamplingParams()})["b"].token_ids == trees["b"].token_ids


def test_adjust_logits_leaves_rows_that_adjust_nothing_alone():
    logits = torch.randn(2, 3, 10)
    out = adjust_logits(logits.clone(), [0, 1], [SamplingParams(temperature=1.0, min_p=0.3), SamplingParams()],
                        [None, None], [[[]] * 3, [[]] * 3])
    assert torch.equal(out, logits)
