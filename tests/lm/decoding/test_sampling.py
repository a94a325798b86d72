import math

import pytest
import torch

from goodspeed.lm.decoding.sampling import cap_support, process_logits, sample_from
from goodspeed.lm.decoding.params import SamplingParams


def test_greedy_one_hot_lowest_index_on_ties():
    p = process_logits(torch.tensor([1.0, 3.0, 3.0, 0.0]), SamplingParams(temperature=0))
    assert p.tolist() == [0.0, 1.0, 0.0, 0.0]


def test_temperature_top_k_top_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert process_logits(logits, SamplingParams(temperature=1.0)).tolist() == pytest.approx([0.5, 0.3, 0.15, 0.05])
    assert process_logits(logits, SamplingParams(temperature=1.0, top_k=2)).tolist() == pytest.approx([0.625, 0.375, 0, 0])
    # top-p 0.8: smallest prefix with mass >= 0.8 is {0.5, 0.3}
    assert process_logits(logits, SamplingParams(temperature=1.0, top_p=0.8)).tolist() == pytest.approx([0.625, 0.375, 0, 0])
    hot = process_logits(logits, SamplingParams(temperature=0.5))
    squared = torch.tensor([0.5, 0.3, 0.15, 0.05]) ** 2  # temperature 1/2 squares the probabilities
    assert hot.tolist() == pytest.approx((squared / squared.sum()).tolist(), rel=1e-5)


def test_per_row_params_in_one_batch():
    logits = torch.randn(3, 5, 7)
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=0.7, top_p=0.9)]
    batch = process_logits(logits, params)
    for i, prm in enumerate(params):
        assert torch.allclose(batch[i], process_logits(logits[i], prm))
    assert torch.allclose(batch.sum(-1), torch.ones(3, 5))
    assert ((batch[1] > 0).sum(-1) == 3).all()


def test_sample_from_inverse_cdf():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75]] * 3)
    assert sample_from(probs, torch.tensor([0.0, 0.2499, 0.25])).tolist() == [1, 1, 3]
    assert sample_from(probs * 4, torch.tensor([0.999999, 0.5, 0.1])).tolist() == [3, 3, 1]


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(temperature=math.inf), dict(temperature=1e-45), dict(temperature=9e-6),
                                    dict(temperature=math.nan), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5), dict(top_p=math.nan)])
def test_bad_params(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


# ------------------------------------------------------------- float-level exactness (regressions)


def test_sample_from_never_returns_a_zero_probability_token():
    """A uniform just below 1 used to round up (float32) and run past the end, clamped onto the
    last token even when it lies outside the top-k."""
    probs = process_logits(torch.tensor([3.0, 1.0, 2.0, 0.5, -1.0]), SamplingParams(temperature=1.0, top_k=3))
    assert probs[-1] == 0 and probs[3] == 0
    for u in (1 - 2**-40, 1 - 2**-26, 1 - 2**-53):
        token = int(sample_from(probs, torch.tensor(u, dtype=torch.float64)))
        assert probs[token] > 0 and token == 2  # the last token with positive probability


def test_sample_from_uses_the_uniform_in_float64():
    probs = torch.tensor([0.75, 0.25])  # float32
    assert int(sample_from(probs, torch.tensor(0.75 - 2**-40, dtype=torch.float64))) == 0  # float32 rounds u to 0.75
    assert int(sample_from(probs, torch.tensor(0.75, dtype=torch.float64))) == 1


def test_a_rows_distribution_does_not_depend_on_its_batch():
    """Top-p = 1 rows used to go through the nucleus test whenever another row truncated, and a
    float32 cumulative sum reaching 1.0 dropped their tail tokens."""
    torch.manual_seed(0)
    logits = torch.randn(2, 50_000) * 3
    plain, nucleus = SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.5)
    alone = process_logits(logits[0], plain)
    batched = process_logits(logits, [plain, nucleus])
    assert torch.equal(batched[0], alone) and bool((alone > 0).all())
    assert torch.equal(batched[1], process_logits(logits[1], nucleus))
    assert int((batched[1] > 0).sum()) < 50_000


def test_the_smallest_temperature_still_gives_a_distribution():
    """1e-45 (a float32 subnormal) made every probability NaN; the smallest allowed one cannot."""
    logits = torch.tensor([30.0, -30.0, 0.0, 29.9])
    probs = process_logits(logits, SamplingParams(temperature=1e-5))
    assert torch.isfinite(probs).all() and float(probs.sum()) == pytest.approx(1.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_argmax_last_is_torchs_argmax_lowest_id_on_ties(dtype):
    from goodspeed.lm.decoding.sampling import argmax_last

    logits = torch.randint(0, 3, (4, 5, 7), generator=torch.Generator().manual_seed(0)).to(dtype)  # ties everywhere
    got = argmax_last(logits)
    assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(dim=-1))
    assert torch.equal(argmax_last(logits[:, 1:3]), logits[:, 1:3].argmax(dim=-1))  # a strided view


def test_cap_support_keeps_each_rows_k_likeliest_tokens_renormalised():
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.2, 0.15, 0.6, 0.05]], dtype=torch.float64)
    capped = cap_support(probs, 2)
    assert torch.allclose(capped, torch.tensor([[0, 4 / 7, 0, 3 / 7], [0.25, 0, 0.75, 0]], dtype=torch.float64))
    assert cap_support(probs, 0) is probs and cap_support(probs, 4) is probs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draft_step_is_each_rows_own_proposal_and_draw(dtype):
    """The batched drafting step gives every row what drafting it alone gives: the same q (one-hot,
    processed, capped), the token drawn from it with that row's uniform, and its confidence."""
    from goodspeed.lm.decoding.sampling import draft_proposal, draft_step

    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, 3_000, generator=gen) * 2).to(dtype)
    logits[1, 7] = logits[1, 9] = logits[1].max() + 1  # a greedy tie: the lowest id wins
    params = [SamplingParams(), SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=20),
              SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=0.5, top_k=50, top_p=0.9)]
    uniforms = torch.rand(6, generator=gen, dtype=torch.float64)
    for cap in (0, 64):
        q, tokens, confidence = draft_step(logits, params, cap, uniforms)
        assert q.dtype == torch.float32 and tokens[1] == 7
        for i, p in enumerate(params):
            alone = draft_proposal(logits[i], p, cap)
            assert torch.equal(q[i], alone), (cap, i)
            assert tokens[i] == int(sample_from(alone, uniforms[i]))
            want = torch.softmax(logits[i].double(), -1)[tokens[i]] if p.greedy else alone[tokens[i]]
            assert confidence[i] == pytest.approx(float(want), rel=1e-6), (cap, i)
    with pytest.raises(ValueError, match="one SamplingParams and one uniform per row"):
        draft_step(logits, params[:5], 0, uniforms)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draft_step_on_cuda_is_the_cpus(dtype):
    """Logits on the GPU (a CUDA draft): the indices, the uniforms and the draw follow them there,
    and every row gets what the same step on the host gives (float32 softmax and cumulative sums
    differ in the last bits between the two, hence the tolerance on q)."""
    from goodspeed.lm.decoding.sampling import draft_step

    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(6, 3_000, generator=gen) * 2).to(dtype)
    params = [SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(), SamplingParams(temperature=1.0, top_k=20),
              SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=0.5, top_k=50, top_p=0.9)]
    uniforms = torch.rand(6, generator=gen, dtype=torch.float64)  # on the host, as drafting draws them
    for cap in (0, 64):
        q, tokens, confidence = draft_step(logits.cuda(), params, cap, uniforms)
        want_q, want_tokens, want_confidence = draft_step(logits, params, cap, uniforms)
        assert q.device.type == "cuda" and q.dtype == torch.float32
        assert torch.allclose(q.cpu(), want_q, atol=1e-6), cap
        assert tokens == want_tokens, cap
        assert confidence == pytest.approx(want_confidence, rel=1e-5), cap


# ------------------------------------------------------------------ min-p, logit bias, penalties


def test_min_p_keeps_tokens_at_least_min_p_times_the_most_probable():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.log(probs)
    # min_p 0.25: keep p >= 0.125 -> {0.5, 0.3, 0.15}
    kept = process_logits(logits, SamplingParams(temperature=1.0, min_p=0.25))
    assert kept.tolist() == pytest.approx((torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95).tolist())
    # applied on the temperature-scaled distribution, before top-k and top-p (vLLM's order):
    # T = 0.5 squares the probabilities, 0.25 / 0.09 / 0.0225 / 0.0025; min_p 0.1 keeps the first two
    hot = process_logits(logits, SamplingParams(temperature=0.5, min_p=0.1))
    assert (hot > 0).tolist() == [True, True, False, False]
    # top-p on what min-p kept: {0.5, 0.3, 0.15} renormalised, 0.5 / 0.95 < 0.6 so two tokens stay
    both = process_logits(logits, SamplingParams(temperature=1.0, min_p=0.25, top_p=0.6))
    assert both.tolist() == pytest.approx([0.625, 0.375, 0, 0])
    # greedy ignores it; min_p 0 changes nothing
    assert process_logits(logits, SamplingParams(min_p=0.9)).tolist() == [1.0, 0, 0, 0]
    assert torch.equal(process_logits(logits, SamplingParams(temperature=1.0, min_p=0.0)),
                       process_logits(logits, SamplingParams(temperature=1.0)))


def test_min_p_rows_in_one_batch_are_each_their_own():
    logits = torch.randn(4, 3, 50, dtype=torch.float64)
    params = [SamplingParams(temperature=1.0, min_p=0.3), SamplingParams(temperature=0.8),
              SamplingParams(temperature=1.2, min_p=0.05, top_k=10), SamplingParams()]
    batch = process_logits(logits, params)
    for i, prm in enumerate(params):
        assert torch.equal(batch[i], process_logits(logits[i], prm))
    row = logits[0, 0]
    assert ((batch[0, 0] > 0) == (torch.softmax(row, -1) >= 0.3 * torch.softmax(row, -1).max())).all()


@pytest.mark.parametrize("kwargs", [
    dict(min_p=-0.1), dict(min_p=1.5), dict(presence_penalty=2.5), dict(frequency_penalty=-3.0),
    dict(repetition_penalty=0.0), dict(repetition_penalty=float("inf")), dict(presence_penalty=float("nan")),
    dict(logit_bias=((3, 101.0),)), dict(logit_bias=((-1, 1.0),)), dict(logit_bias=((4, 1.0), (2, 1.0))),
    dict(logit_bias=((2, 1.0), (2, 2.0))), dict(logit_bias=tuple((i, 1.0) for i in range(2000))),
    dict(min_tokens=-1), dict(min_tokens=1.5), dict(min_tokens=True), dict(eos_token_ids=(-2,)),
    dict(allowed_token_ids=(-1,)), dict(allowed_token_ids=(4, 2)), dict(allowed_token_ids=(2, 2)),
    dict(bad_words=((),)), dict(bad_words=((1, -2),)), dict(bad_words=tuple((i,) for i in range(129))),
    dict(bad_words=(tuple(range(33)),)),
])
def test_bad_adjustments(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_adjusts_logits_only_when_something_is_on():
    assert not SamplingParams(temperature=1.0, min_p=0.2).adjusts_logits
    assert SamplingParams(logit_bias=((1, 0.5),)).adjusts_logits and not SamplingParams(logit_bias=((1, 0.5),)).penalized
    for kwargs in (dict(presence_penalty=0.1), dict(frequency_penalty=-0.1), dict(repetition_penalty=1.1)):
        assert SamplingParams(**kwargs).penalized and SamplingParams(**kwargs).adjusts_logits
    # min_tokens adjusts logits once it knows the request's ending tokens (StartRequestReply.min_tokens, not extended)
    held = SamplingParams(min_tokens=3)
    assert not held.adjusts_logits and not held.extended and not held.penalized
    assert held.ending_with([9, 2, 9]).eos_token_ids == (2, 9) and held.ending_with([2]).adjusts_logits
    assert SamplingParams().ending_with([2]) == SamplingParams()  # nothing reads them without min_tokens
    allowed = SamplingParams(allowed_token_ids=(2, 5))
    assert allowed.adjusts_logits and not allowed.extended and not allowed.penalized  # a flag of its own too
    # min_tokens holding back every allowed token leaves nothing to sample: requests refuse it
    assert SamplingParams(min_tokens=2, allowed_token_ids=(2, 5)).ending_with([2, 5, 7]).nothing_allowed
    assert not SamplingParams(min_tokens=2, allowed_token_ids=(2, 5)).ending_with([2]).nothing_allowed
    assert not SamplingParams(allowed_token_ids=(2,)).ending_with([2]).nothing_allowed
    # so do one-token bad words banning every allowed token (a longer one bans only after its head)
    assert SamplingParams(allowed_token_ids=(2, 5), bad_words=((2,), (5,))).nothing_allowed
    assert not SamplingParams(allowed_token_ids=(2, 5), bad_words=((2,), (3, 5))).nothing_allowed
    assert SamplingParams(bad_words=((2,),)).adjusts_logits and SamplingParams(bad_words=((2, 2), (2, 2))).bad_words == ((2, 2),)


ADJUSTING = [
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(temperature=1.0, presence_penalty=0.7, frequency_penalty=0.4),
    SamplingParams(temperature=0.8, repetition_penalty=0.8, frequency_penalty=-0.5, logit_bias=((0, 3.0), (7, -2.5))),
    SamplingParams(logit_bias=((5, 100.0),)),
    SamplingParams(temperature=1.0, min_tokens=6, eos_token_ids=(4, 6)),  # 4 generated: held back at 0 and 1
    SamplingParams(repetition_penalty=1.2, logit_bias=((3, 50.0),), min_tokens=6, eos_token_ids=(3,)),  # a tree's
    SamplingParams(temperature=1.0, allowed_token_ids=(0, 4, 6, 11)),
    SamplingParams(frequency_penalty=0.5, logit_bias=((8, 9.0),), min_tokens=6, eos_token_ids=(3,),
                   allowed_token_ids=(3, 5, 8)),  # on a tree: 3 held back where the text is short
    SamplingParams(presence_penalty=0.2, bad_words=((11, 4), (3,), (3, 11, 7))),  # the output ends 3, 11
    SamplingParams(temperature=1.0, bad_words=((11, 3, 8), (8, 3))),  # on a tree: 8 after 11, 3; 3 after 8
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_adjust_logits_is_the_dense_definition_at_every_position_of_chains_and_trees(dtype):
    """Each adjusted row and position against the dense reference (tests/statkit.py) with the text
    that position follows: the history, then a chain's first ``j`` drafted tokens or a tree node's
    path (min_tokens: the output's length counts its path). Rows that adjust nothing and positions
    past the paths are left alone."""
    from goodspeed.lm.decoding.adjust import adjust_logits
    from goodspeed.lm.decoding.history import TokenHistory
    from goodspeed.verifier.verify_rows import draft_paths
    from statkit import reference_adjust

    g = torch.Generator().manual_seed(3)
    vocab, q = 12, 5
    logits = torch.randn(len(ADJUSTING) + 1, q, vocab, generator=g, dtype=dtype) * 3
    prompt, output = [1, 2, 2, 9], [4, 4, 3, 11]
    drafts = {0: ([4, 6, 6, 1], None), 1: ([3, 8, 3, 4], [-1, 0, -1, 2]), 2: ([7, 7], None), 3: ([], None),
              4: ([4, 6, 6, 1], None), 5: ([3, 8, 3, 4], [-1, 0, -1, 2]), 6: ([0, 6, 4], None),
              7: ([3, 8, 3, 4], [-1, 0, -1, 2]), 8: ([4, 6, 6, 1], None), 9: ([3, 8, 3, 4], [-1, 0, -1, 2])}
    rows = list(range(len(ADJUSTING)))
    histories = [TokenHistory(prompt, output) for _ in rows]
    histories[3] = None  # a request that only biases needs no text
    paths = [draft_paths(*drafts[r]) for r in rows]
    adjusted = adjust_logits(logits.clone(), rows, ADJUSTING, histories, paths)
    for r in rows:
        for j in range(q):
            if j < len(paths[r]):
                text = ([], []) if histories[r] is None else (prompt, output + paths[r][j])
                want = reference_adjust(logits[r, j], ADJUSTING[r], *text)
                assert torch.allclose(adjusted[r, j], want, rtol=1e-6, atol=1e-6), (r, j)
            else:
                assert torch.equal(adjusted[r, j], logits[r, j])
    assert torch.equal(adjusted[len(rows)], logits[len(rows)])
    held = adjusted[4, :, [4, 6]].isinf().all(dim=-1).tolist()
    assert held == [True, True, False, False, False]  # 4 + j < 6
    assert adjusted[5, :, 3].isinf().tolist() == [True, True, False, True, False]  # the tree: 4 + path length < 6
    assert draft_paths([3, 8, 3, 4], [-1, 0, -1, 2]) == [[], [3], [3, 8], [3], [3, 4]]
    assert adjusted[6, :4].isfinite().sum(dim=-1).tolist() == [4] * 4  # the allowed ones alone
    assert adjusted[7, :, 3].isinf().tolist() == [True, True, False, True, False]
    assert adjusted[7, :].isfinite().sum(dim=-1).tolist() == [2, 2, 3, 2, 3]
    assert adjusted[8, :, 3].isinf().all() and adjusted[8, :, 4].isinf().tolist() == [True, False, False, False, False]
    assert adjusted[8, :, 7].isinf().tolist() == [True, False, False, False, False]
    assert adjusted[9, :, 8].isinf().tolist() == [False, True, False, True, False]  # paths [3] after the output's 11
    assert adjusted[9, :, 3].isinf().tolist() == [False, False, True, False, False]  # path [3, 8]


def test_allowed_token_ids_past_a_drafts_vocabulary_are_left_out():
    """A draft whose vocabulary is smaller than the target's cannot draft the allowed ids past it:
    they are left out of its mask, and a row none of whose ids fits is left as it is."""
    from goodspeed.lm.decoding.adjust import adjust_logits

    logits = torch.randn(2, 1, 6, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(allowed_token_ids=(2, 7)), SamplingParams(allowed_token_ids=(6, 9))]
    out = adjust_logits(logits.clone(), [0, 1], params, [None, None], [[[]], [[]]])
    assert out[0, 0].isfinite().tolist() == [False, False, True, False, False, False]
    assert torch.equal(out[1], logits[1])


def test_adjusted_greedy_is_the_adjusted_argmax():
    from goodspeed.lm.decoding.adjust import adjust_logits
    from goodspeed.lm.decoding.history import TokenHistory

    logits = torch.tensor([[[2.0, 1.9, 0.5, -1.0]]])
    sampling = SamplingParams(repetition_penalty=1.2)
    out = adjust_logits(logits.clone(), [0], [sampling], [TokenHistory([0])], [[[]]])
    assert out[0, 0].tolist() == pytest.approx([2.0 / 1.2, 1.9, 0.5, -1.0])
    assert process_logits(out[0, 0], sampling).tolist() == [0.0, 1.0, 0.0, 0.0]
    biased = SamplingParams(logit_bias=((3, 5.0),))
    assert process_logits(adjust_logits(logits.clone(), [0], [biased], [None], [[[]]])[0, 0], biased).tolist() == [0, 0, 0, 1.0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_adjust_logits_on_cuda_is_the_cpus():
    from goodspeed.lm.decoding.adjust import adjust_logits
    from goodspeed.lm.decoding.history import TokenHistory
    from goodspeed.verifier.verify_rows import draft_paths

    logits = torch.randn(len(ADJUSTING), 4, 300, generator=torch.Generator().manual_seed(5)) * 3
    histories = [TokenHistory([1, 2, 2, 9], [4, 4, 3, 11]) for _ in ADJUSTING]
    paths = [draft_paths([4, 6, 1], None), draft_paths([3, 8, 4], [-1, 0, 0]), draft_paths([7, 7, 7], None), draft_paths([], None),
             draft_paths([4, 6, 1], None), draft_paths([3, 8, 4], [-1, 0, 0]), draft_paths([0, 6, 4], None),
             draft_paths([3, 8, 4], [-1, 0, 0])]
    rows = list(range(len(ADJUSTING)))
    on_cpu = adjust_logits(logits.clone(), rows, ADJUSTING, histories, paths)
    on_gpu = adjust_logits(logits.cuda(), rows, ADJUSTING, histories, paths)
    assert torch.allclose(on_gpu.cpu(), on_cpu, rtol=1e-6, atol=1e-6)
