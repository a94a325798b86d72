import numpy as np
import pytest
import torch

from goodspeed.drafter.runner import DraftRunner, SlotDraftKV
from goodspeed.lm.runtime.batch_draft import BatchDraftModel
from goodspeed.lm.runtime.graphs import MAX_GRAPH_QUERIES
from goodspeed.lm.decoding.sampling import process_logits
from goodspeed.lm.decoding.params import SamplingParams
from graphkit import checking, fresh_dynamo, needs_cpp, static_drafter  # noqa: F401 (a fixture)
from modelkit import tiny_llama


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0, top_k=5)])
def test_rollback_equals_fresh_runner(sampling):
    model = tiny_llama(1)
    rng = np.random.default_rng(0)
    runner = DraftRunner(model)
    runner.start([1, 2, 3])
    for _ in range(12):
        s = int(rng.integers(0, 6))
        out = runner.draft(s, sampling, torch.Generator().manual_seed(int(rng.integers(1 << 30))))
        assert len(out.token_ids) == s and out.probs.shape == (s, 48)
        m = int(rng.integers(0, s + 1))
        # one correction/bonus token, or several (tokens the verifier decoded while the draft was
        # in transit): the runner keeps the drafts equal to the verdict's leading tokens
        emitted = out.token_ids[:m] + [int(t) for t in rng.integers(0, 48, size=int(rng.integers(1, 5)))]
        m = next((i for i, (x, y) in enumerate(zip(out.token_ids, emitted)) if x != y), min(s, len(emitted)))
        runner.apply(emitted, m)
        fresh = DraftRunner(model)
        fresh.start(runner.committed)
        seed = int(rng.integers(1 << 30))
        a = runner.draft(3, sampling, torch.Generator().manual_seed(seed))
        b = fresh.draft(3, sampling, torch.Generator().manual_seed(seed))
        assert a.token_ids == b.token_ids and torch.allclose(a.probs, b.probs, atol=1e-10)
        runner.apply(a.token_ids[:1] + [5], 1)  # keep going from a known state


def test_greedy_draft_probs_are_one_hot_and_sampled_are_truncated():
    runner = DraftRunner(tiny_llama(2))
    runner.start([4])
    greedy = runner.draft(2, SamplingParams(), torch.Generator())
    assert torch.all(greedy.probs.max(-1).values == 1.0)
    sampled = runner.draft(2, SamplingParams(temperature=1.0, top_k=3), torch.Generator().manual_seed(0))
    assert torch.all((sampled.probs > 0).sum(-1) == 3)


class _Tail(torch.nn.Module):
    """Wraps a model so token 0's probability is ~1e-60: a float64 q below float32's range."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model, self.config = model, model.config

    def forward(self, **kw):
        out = self.model(**kw)
        out.logits[..., 0] = out.logits[..., 1:].max(-1).values - 140.0
        return out


def test_q_travels_as_sampled_in_float32_and_never_holds_an_unsendable_token():
    runner = DraftRunner(_Tail(tiny_llama(2)))
    runner.start([4])
    out = runner.draft(4, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    assert out.probs.dtype == torch.float32  # what was sampled from is exactly what is sent
    assert float(out.probs[:, 0].max()) == 0.0  # underflows in float32: it cannot be drafted
    assert all(float(out.probs[j, tok]) > 0 for j, tok in enumerate(out.token_ids))


def fresh_draft(model, committed, n, sampling, seed):
    fresh = DraftRunner(model)
    fresh.start(committed)
    return fresh.draft(n, sampling, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0, top_k=5)])
def test_proactive_hit_sends_the_predrafted_tokens_with_their_exact_q(sampling):
    """A verdict that accepts the draft and whose bonus is the guess: the pre-drafted tokens are
    the next draft, with the q a fresh runner computes on the committed text (lossless)."""
    model = tiny_llama(1)
    runner = DraftRunner(model)
    runner.start([1, 2, 3])
    gen = torch.Generator().manual_seed(7)
    out = runner.draft(3, sampling, gen)
    made = runner.predraft(3, 4, sampling, gen)
    assert made == 4 and len(runner.ahead) == 3 + 1 + 4  # bounded: S + guess + K
    guess, predrafted = runner.ahead[3], runner.ahead[4:]
    assert runner.apply(out.token_ids + [guess], 3) is True
    assert runner.ahead == predrafted
    nxt = runner.draft(2, sampling, torch.Generator().manual_seed(1))  # fewer than pre-drafted
    assert nxt.token_ids == predrafted[:2]
    with torch.inference_mode():  # q of each sent token given the committed text and the tokens before it
        logits = model(input_ids=torch.tensor([runner.committed + nxt.token_ids])).logits[0]
    q_ref = [process_logits(logits[len(runner.committed) - 1 + j].double(), sampling).float() for j in range(2)]
    assert torch.allclose(nxt.probs, torch.stack(q_ref), atol=1e-6)
    if sampling.greedy:  # greedy: exactly what drafting after the verdict gives
        assert nxt.token_ids == fresh_draft(model, runner.committed, 2, sampling, 0).token_ids
    # more than pre-drafted: the rest is drafted after them, from a consistent cache
    runner.apply(nxt.token_ids + [9], 2)
    again = runner.draft(3, sampling, torch.Generator().manual_seed(5))
    assert again.token_ids == fresh_draft(model, runner.committed, 3, sampling, 5).token_ids


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0, top_k=5)])
def test_proactive_miss_rolls_back_to_a_fresh_runners_state(sampling):
    model = tiny_llama(1)
    runner = DraftRunner(model)
    runner.start([4, 5])
    gen = torch.Generator().manual_seed(3)
    out = runner.draft(4, sampling, gen)
    runner.predraft(4, 4, sampling, gen)
    wrong = (runner.ahead[4] + 1) % 48
    assert runner.apply(out.token_ids + [wrong], 4) is False  # all accepted, another bonus
    assert runner.ahead == []
    a = runner.draft(3, sampling, torch.Generator().manual_seed(11))
    assert a.token_ids == fresh_draft(model, runner.committed, 3, sampling, 11).token_ids
    runner.predraft(3, 2, sampling, gen)
    assert runner.apply(a.token_ids[:1] + [wrong], 1) is False  # a rejection mid-draft
    b = runner.draft(2, sampling, torch.Generator().manual_seed(12))
    assert b.token_ids == fresh_draft(model, runner.committed, 2, sampling, 12).token_ids


def test_predraft_stops_when_the_verdict_arrives():
    runner = DraftRunner(tiny_llama(1))
    runner.start([1, 2])
    runner.draft(2, SamplingParams(), torch.Generator())
    calls = iter([False, False, True])
    assert runner.predraft(2, 10, SamplingParams(), torch.Generator(), stop=lambda: next(calls)) == 1
    assert runner.predraft(2, 10, SamplingParams(), torch.Generator(), stop=lambda: True) == 0
    assert runner.ahead[:2] and len(runner.ahead) == 2


def test_a_capped_proposal_is_sampled_from_and_sent_as_its_sparse_support():
    """``proposal_top_k``: each sampled token comes from q's k likeliest tokens, and q travels as
    exactly that support (k ids and probs a position); uncapped T = 1 travels dense, greedy not at all."""
    model = tiny_llama(1)
    sampling = SamplingParams(temperature=1.0)
    runner = DraftRunner(model, proposal_top_k=4)
    runner.start([1, 2, 3])
    out = runner.draft(5, sampling, torch.Generator().manual_seed(3))
    kind, rows = out.q_to_send(sampling)
    assert kind == "sparse" and len(rows) == 5
    for token, row, (ids, probs) in zip(out.token_ids, out.probs, rows):
        assert len(ids) == 4 and token in ids and sum(probs) == pytest.approx(1.0, abs=1e-6)
        assert row[ids].tolist() == probs
    whole = DraftRunner(model, proposal_top_k=0)
    whole.start([1, 2, 3])
    kind, dense = whole.draft(5, sampling, torch.Generator().manual_seed(3)).q_to_send(sampling)
    assert kind == "dense" and dense.shape == (5, 48) and bool((dense > 0).all())
    # the first position (the same text before it): the capped q is the whole q's top 4, renormalised
    top = torch.topk(dense[0], 4).indices
    assert rows[0][0] == sorted(top.tolist())
    torch.testing.assert_close(out.probs[0][top], dense[0][top] / dense[0][top].sum(), atol=1e-6, rtol=0)
    assert whole.draft(2, SamplingParams(), torch.Generator()).q_to_send(SamplingParams()) == ("none", None)
    with pytest.raises(ValueError, match="proposal_top_k"):
        DraftRunner(model, proposal_top_k=-1)


def same_rounds(runners, sampling, rounds, seed=2, atol=1e-10, prompt=(1, 2, 3)):
    """Rounds of drafts, proactive drafting and verdicts (hits and misses) into every runner alike,
    from ``prompt``; each must draft the same tokens and q, pre-draft the same continuation and
    agree on hits."""
    rng = np.random.default_rng(seed)
    for runner in runners:
        runner.start(list(prompt))
    first = runners[0]
    for round_index in range(rounds):
        s, k, draw = int(rng.integers(0, 6)), int(rng.integers(0, 4)), int(rng.integers(1 << 30))
        outs = [r.draft(s, sampling, torch.Generator().manual_seed(draw)) for r in runners]
        made = [r.predraft(s, k, sampling, torch.Generator().manual_seed(draw + 1)) for r in runners]
        for out, runner, n in zip(outs[1:], runners[1:], made[1:]):
            assert out.token_ids == outs[0].token_ids, round_index
            torch.testing.assert_close(out.probs.cpu(), outs[0].probs.cpu(), rtol=0, atol=atol)
            assert (n, runner.ahead) == (made[0], first.ahead), round_index
        m = int(rng.integers(0, s + 1))
        if m == s and made[0] and rng.random() < 0.5:  # all accepted, the bonus guessed: a hit
            emitted = first.ahead[: s + 1]
        else:
            emitted = outs[0].token_ids[:m] + [int(rng.integers(0, 48))]
        hits = [r.apply(emitted, m) for r in runners]
        assert len(set(hits)) == 1 and all(r.committed == first.committed for r in runners), round_index


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0, top_k=5)])
def test_fixed_shape_forwards_draft_what_eager_ones_do(sampling):
    """One request at a time through StepGraphs (``capture=False``: the slot KV, the layout, the
    copies and the forward a CUDA graph records): the same tokens, q, pre-drafts and hits as eager
    forwards over a growing cache, every forward after the first (which makes the KV pool) at a
    fixed shape, and nothing read that a replay would hold stale."""
    model = tiny_llama(1)
    eager, graphed = DraftRunner(model), DraftRunner(model)  # eager: a growing DynamicCache
    drafter = static_drafter(graphed)
    seen = []
    checking(drafter, seen)
    same_rounds([eager, graphed], sampling, rounds=16)
    assert drafter.graphs.steps == drafter.forwards - 1 > 20
    assert len(drafter.graphs.shapes) >= 2 and seen and all(p == [] for p in seen), seen


@needs_cpp
@pytest.mark.slow  # compiles each shape (about 24 s cold here); test_graphs' compiled engine test is in the default suite
def test_compiled_forwards_draft_what_eager_ones_do():
    """DraftRunner(torch_compile=True): the slot's fixed-shape forwards through a decoder compiled
    by torch.compile draft the same tokens, pre-drafts and hits as eager forwards over a growing
    cache, q to float32 rounding (transformers' Llama norms in float32, which fused kernels round
    in another order), every forward after the first at a fixed shape."""
    model = tiny_llama(1)
    eager, compiled = DraftRunner(model), DraftRunner(model, torch_compile=True)
    same_rounds([eager, compiled], SamplingParams(temperature=1.0, top_k=5), rounds=6, atol=1e-5)
    drafter = compiled.kv.drafter
    assert drafter.graphs.steps == drafter.forwards - 1 > 10


def test_the_warm_up_leaves_the_runners_request_as_it_was():
    """DraftRunner.warm_up with fixed-shape forwards drafts synthetic chains through them (what an
    edge drafter runs before its first request) and leaves the request in progress as it was: the
    runner then drafts what a runner that never warmed up does. Over a growing cache it does
    nothing."""
    model = tiny_llama(1)
    assert DraftRunner(model).warm_up() == 0
    eager, graphed = DraftRunner(model), DraftRunner(model)
    drafter = static_drafter(graphed)
    for runner in (eager, graphed):
        runner.start([1, 2, 3, 4, 5])
        runner.draft(3, SamplingParams(), torch.Generator())
    length = graphed.cached_len
    assert graphed.warm_up() == sum(what == "chain" for _, what in BatchDraftModel.WARM_UP_PLAN)
    assert graphed.cached_len == length and drafter.slots.keys == [SlotDraftKV.KEY] and drafter.graphs.steps > 0
    outs = [r.draft(4, SamplingParams(), torch.Generator()).token_ids for r in (eager, graphed)]
    assert outs[0] == outs[1]
    same_rounds([eager, graphed], SamplingParams(temperature=1.0, top_k=5), rounds=6)


@needs_cpp
@pytest.mark.slow  # compiles the warm-up's graphs (about 30 s cold here)
def test_after_its_warm_up_a_compiled_runner_compiles_nothing_more(fresh_dynamo):
    """DraftRunner(torch_compile=True).warm_up, as an edge drafter runs it before it joins: the
    rounds of drafts, pre-drafts and verdicts after it, over prompts of 3 and 40 tokens, compile no
    graph more and draft what eager forwards draft."""
    from torch._dynamo.utils import counters

    model = tiny_llama(1)
    eager, compiled = DraftRunner(model), DraftRunner(model, torch_compile=True)
    assert compiled.warm_up() > 0
    before = counters["stats"]["unique_graphs"]
    same_rounds([eager, compiled], SamplingParams(temperature=1.0, top_k=5), rounds=12, atol=1e-5)
    same_rounds([eager, compiled], SamplingParams(), rounds=6, atol=1e-5, prompt=[int(t) % 48 for t in range(40)])
    assert counters["stats"]["unique_graphs"] == before


def test_a_prompts_catch_up_runs_eagerly_and_draft_steps_at_fixed_shapes():
    """A resynchronised request's prompt (more than MAX_GRAPH_QUERIES tokens in one row) is fed in
    an eager forward, not captured at its length; the draft steps after it take fixed shapes, and
    draft what the growing cache drafts."""
    model = tiny_llama(1)
    eager, graphed = DraftRunner(model), DraftRunner(model)
    drafter = static_drafter(graphed)
    prompts = [[1, 2, 3], [int(t) % 48 for t in range(5, 111)]]  # the second: 106 tokens, 128 queries padded
    for prompt in prompts:
        before = (drafter.forwards, drafter.graphs.steps)
        outs = []
        for runner in (eager, graphed):
            runner.start(prompt)
            outs.append(runner.draft(3, SamplingParams(), torch.Generator()).token_ids)
        assert outs[0] == outs[1]
        assert (drafter.forwards - before[0], drafter.graphs.steps - before[1]) == (3, 2)  # the feed eager, two steps static
    assert all(q <= MAX_GRAPH_QUERIES for _, q, _ in drafter.graphs.shapes)


def test_a_runner_with_cuda_graphs_is_refused_off_cuda():
    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device; this draft model is on cpu"):
        DraftRunner(tiny_llama(0), cuda_graphs=True)


def test_drafting_before_a_prompt_is_refused():
    runner = DraftRunner(tiny_llama(0))
    with pytest.raises(ValueError, match=r"start\(\) the request with its prompt first"):
        runner.draft(2, SamplingParams(), torch.Generator())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0, top_k=5)])
def test_a_cuda_runner_with_graphs_drafts_what_eager_fixed_shapes_draft(sampling):
    """On CUDA: one-request drafting captured and replayed drafts what the same fixed-shape forwards
    run eagerly draft (fp32: a capture may pick other cuBLAS kernels than eager runs)."""
    model = tiny_llama(1, hidden=256, heads=4, kv_heads=2, dtype=torch.float32).cuda()
    eager, graphed = DraftRunner(model), DraftRunner(model, cuda_graphs=True)
    static_drafter(eager)
    same_rounds([eager, graphed], sampling, rounds=16, atol=1e-5)
    graphs = graphed.kv.drafter.graphs
    assert graphs.captures >= 2 and graphs.replays >= 20


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=0.8)])
def test_a_cuda_runner_drafts_what_the_host_drafts(sampling):
    """An edge drafter on a GPU: its uniforms come from the host's generator, its q stays on the
    device until it is put on the wire, and rounds of drafting, verdicts and proactive drafting
    give the host runner's tokens and q."""
    import copy

    model = tiny_llama(1)
    host, device = DraftRunner(model), DraftRunner(copy.deepcopy(model).cuda())
    for runner in (host, device):
        runner.start([1, 2, 3])
    for round_, s in enumerate([3, 0, 4, 2]):
        a = host.draft(s, sampling, torch.Generator().manual_seed(round_))
        b = device.draft(s, sampling, torch.Generator().manual_seed(round_))
        assert b.token_ids == a.token_ids, round_
        assert torch.allclose(b.probs.cpu(), a.probs, atol=1e-5), round_
        kind, q = b.q_to_send(sampling)
        assert kind == a.q_to_send(sampling)[0]
        if kind == "dense":
            assert q.float().reshape(-1).tolist() == pytest.approx(a.probs.reshape(-1).tolist(), abs=1e-5)
        emitted = a.token_ids[:1] + [7]
        for runner in (host, device):
            runner.predraft(len(a.token_ids), 2, sampling, torch.Generator().manual_seed(9))
            runner.apply(emitted, min(1, len(a.token_ids)))
        assert device.committed == host.committed


@pytest.mark.parametrize("generated", [0, 3])
def test_drafts_apply_the_requests_bias_and_penalties_by_the_text_so_far(generated):
    """The draft's logits get the request's logit bias and penalties as the target's do, by the
    committed text (its last ``generated`` tokens counted as output) plus the tokens drafted before:
    a greedy draft is the draft model's own adjusted greedy decoding, across verdicts too."""
    from modelkit import adjusted_greedy_reference

    model = tiny_llama(0)
    sampling = SamplingParams(temperature=0.0, repetition_penalty=1.6, presence_penalty=1.5, frequency_penalty=0.7,
                              logit_bias=((9, 2.0),))
    prompt = [1, 2, 3, 45, 9, 43]  # the split matters by the 7th token: 43 as a prompt token, 15 as an output one
    assert adjusted_greedy_reference(model, prompt, sampling, 7, generated=3) != adjusted_greedy_reference(model, prompt, sampling, 7)
    runner = DraftRunner(model)
    runner.start(prompt, generated=generated)
    generator = torch.Generator().manual_seed(0)
    first = runner.draft(5, sampling, generator)
    reference = adjusted_greedy_reference(model, prompt, sampling, 9, generated=generated)
    assert first.token_ids == reference[:5]
    runner.apply(reference[:3], 2)  # a verdict: two drafts accepted, then a correction (here the same)
    assert runner.draft(4, sampling, generator).token_ids == reference[3:7]
    plain = DraftRunner(model)
    plain.start(prompt)
    assert plain.draft(5, SamplingParams(temperature=0.0), generator).token_ids != first.token_ids  # the settings matter here
