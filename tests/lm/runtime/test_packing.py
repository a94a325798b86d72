"""packing.split_rows: the attention groups a packed forward's shared rows are split into."""

import itertools
import random

import pytest

from goodspeed.lm.models.precision import cpu_flags
from goodspeed.lm.runtime.packing import EXTRA_QUERIES, split_rows


def _cost(segments, sizes, ends, overhead):
    total = 0.0
    for a, b in segments:
        real = [r for r in range(a, b) if sizes[r]]
        total += overhead + (b - a) * max(ends[r] for r in real) * (max(sizes[r] for r in real) + EXTRA_QUERIES)
    return total


def _brute_force(sizes, ends, overhead):
    """The cheapest cover over every choice of segments: each boundary between rows is a cut or
    not, and each piece drops the rows without tokens at its edges."""
    n, best = len(sizes), None
    for cuts in itertools.product((False, True), repeat=n - 1):
        pieces, start = [], 0
        for i, cut in enumerate(cuts, 1):
            if cut:
                pieces.append((start, i))
                start = i
        pieces.append((start, n))
        segments = []
        for a, b in pieces:
            real = [r for r in range(a, b) if sizes[r]]
            if real:
                segments.append((real[0], real[-1] + 1))
        cost = _cost(segments, sizes, ends, overhead)
        if best is None or cost < best - 1e-9:
            best = cost
    return best


@pytest.mark.parametrize("seed", range(200))
def test_split_rows_is_the_cheapest_cover_a_brute_force_finds(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 8)
    sizes = [rng.choice([0, 0, 1, 1, 1, 2, 3, 7]) for _ in range(n)]
    ends = [rng.randint(1, 900) + s for s in sizes]
    overhead = rng.choice([0.0, 50.0, 1000.0, 4000.0, 1e6])
    segments = split_rows(sizes, ends, overhead)
    covered = [r for a, b in segments for r in range(a, b)]
    assert covered == sorted(set(covered))  # disjoint, in row order
    assert {r for r, s in enumerate(sizes) if s} <= set(covered)
    assert all(sizes[a] and sizes[b - 1] for a, b in segments)  # no segment starts or ends on an empty row
    if not any(sizes):
        assert segments == []
    else:
        assert _cost(segments, sizes, ends, overhead) == pytest.approx(_brute_force(sizes, ends, overhead))


def test_split_rows_without_an_overhead_keeps_one_group_from_the_first_row_with_tokens_to_the_last():
    assert split_rows([0, 1, 0, 7, 1, 0], [5] * 6, None) == [(1, 5)]
    assert split_rows([0, 0], [5, 5], None) == []


def test_a_long_row_among_short_ones_gets_a_group_of_its_own_and_equal_rows_share_one():
    assert split_rows([1, 1, 1, 7, 1, 1, 1, 1], [800] * 8, 4000.0) == [(0, 3), (3, 4), (4, 8)]
    assert split_rows([2] * 8, [800] * 8, 4000.0) == [(0, 8)]


# ------------------------------------------------------------------- keys in whole runs


def _bf16_step(model, cache, tokens):
    """One packed bf16 forward over every slot of ``cache``, committed; logits ``[rows, q_len, V]``
    of the rows with tokens."""
    import torch

    from goodspeed.lm.runtime.attention import PACKED, with_cache

    layout = cache.pack(tokens, [None] * len(tokens), slice(0, len(tokens)), torch.bfloat16, "cpu")
    with torch.inference_mode():
        out = model(input_ids=layout.input_ids, attention_mask=layout.mask, position_ids=layout.position_ids,
                    **with_cache(model, cache), use_cache=True, **{PACKED: layout})
    for slot, t in enumerate(tokens):
        cache.commit(slot, cache.lengths[slot], list(range(len(t))))
    return layout.padded(out.logits, [r for r, t in enumerate(tokens) if t])


def _one_token_against_a_draft(model, lengths):
    """For each prefix length: the logits of the token after the prefix, in a one-token step
    alone and as the first of a 7-token chain beside another row (3 tokens after a prefix 37
    longer); whether they are equal bit for bit. Every forward holds at most 32 tokens but the
    prefills, which are the same in both (each prompt alone)."""
    import torch

    from goodspeed.lm.runtime.kv_slots import SlotKVCache

    g = torch.Generator().manual_seed(0)
    same = []
    for length in lengths:
        prompt, other, new = (torch.randint(0, 256, (n,), generator=g).tolist() for n in (length, length + 37, 7))
        alone = SlotKVCache(2)
        alone.add_slot()
        _bf16_step(model, alone, [prompt])
        one = _bf16_step(model, alone, [new[:1]])[0, 0]
        beside = SlotKVCache(2)
        beside.add_slot()
        beside.add_slot()
        _bf16_step(model, beside, [prompt, []])
        _bf16_step(model, beside, [[], other])
        chain = _bf16_step(model, beside, [new, other[:3]])[0, 0]
        same.append(torch.equal(one, chain))
    return same


@pytest.mark.skipif("amx_bf16" not in cpu_flags(), reason="bf16 exactness is measured on CPUs with AMX (amx_bf16) only")
def test_a_tokens_logits_in_bf16_do_not_depend_on_the_keys_its_step_reads():
    """A verification step reads keys up to its longest row's last token, so a query's call holds
    more keys than it sees; torch's CPU attention sums its softmax over what it is given, vectors
    then a remainder. With keys read in whole runs of KEY_ALIGN the token's logits are the same bit
    for bit in a one-token step and as the first of a draft's chain beside another row, at every
    prefix length tried; negative control: keys read as they come (KEY_ALIGN = 1) part in some.
    Measured on a CPU with AMX; elsewhere bf16 runs through other kernels, so it skips."""
    import torch

    from goodspeed.lm.runtime import packing
    from goodspeed.lm.runtime.attention import use_gqa_attention
    from modelkit import tiny_llama

    model = tiny_llama(3, vocab=256, hidden=192, heads=3, kv_heads=1, init=0.05, dtype=torch.bfloat16)  # heads of 64
    use_gqa_attention(model)
    lengths = range(20, 240, 9)
    assert all(_one_token_against_a_draft(model, lengths))
    aligned = packing.KEY_ALIGN
    try:
        packing.KEY_ALIGN = 1
        assert not all(_one_token_against_a_draft(model, lengths))
    finally:
        packing.KEY_ALIGN = aligned


def test_key_span_rounds_up_within_the_buffer():
    from goodspeed.lm.runtime.packing import KEY_ALIGN, key_span

    assert KEY_ALIGN == 16
    assert [key_span(n, 256) for n in (1, 16, 17, 250)] == [16, 16, 32, 256]
    assert key_span(250, 250) == 250 and key_span(17, 20) == 17  # no room: the keys as they are
