"""The engine's attention function must not change what the model computes, in any calling mode."""

import pytest
import torch
import torch.nn.functional as F

from transformers import DynamicCache

from goodspeed.lm.runtime.attention import (MASK_ALIGN, REFERENCE_VARLEN, VarlenRows, flash_varlen_kernel, fold_mask, masked_attention,
                                    model_varlen_missing, use_gqa_attention, varlen_kernel_for, varlen_missing, with_cache)
from modelkit import tiny_llama


def test_gqa_attention_matches_default_sdpa_with_and_without_cache():
    reference, ours = tiny_llama(3), tiny_llama(3)
    use_gqa_attention(ours)
    ids = torch.tensor([[5, 9, 2, 7, 1, 3], [4, 4, 8, 0, 2, 6]])
    with torch.inference_mode():
        assert torch.allclose(reference(input_ids=ids).logits, ours(input_ids=ids).logits, atol=1e-10)
        # Incremental decoding with a cache and several new tokens at once (offset causal mask).
        r_cache, o_cache = DynamicCache(config=reference.config), DynamicCache(config=ours.config)
        reference(input_ids=ids[:, :4], use_cache=True, **with_cache(reference, r_cache))
        ours(input_ids=ids[:, :4], use_cache=True, **with_cache(ours, o_cache))
        r2 = reference(input_ids=ids[:, 4:], **with_cache(reference, r_cache)).logits
        o2 = ours(input_ids=ids[:, 4:], **with_cache(ours, o_cache)).logits
        assert torch.allclose(r2, o2, atol=1e-10)
        # Left padding through a 2-D mask.
        mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
        assert torch.allclose(reference(input_ids=ids, attention_mask=mask).logits[:, -1], ours(input_ids=ids, attention_mask=mask).logits[:, -1], atol=1e-10)


def _masked_case(rows, heads, kv_heads, q_len, dtype, mask_rows=None, device="cpu", seed=0):
    """Keys that are a view of a longer cache, non-contiguous queries and an additive mask that
    hides stretches of keys per query (one row shorter: its tail is padding)."""
    gen = torch.Generator().manual_seed(seed)
    kv_len, dim, capacity = 37, 8, 64
    key = torch.randn(rows, kv_heads, capacity, dim, generator=gen).to(dtype)[:, :, :kv_len]
    value = torch.randn(rows, kv_heads, capacity, dim, generator=gen).to(dtype)[:, :, :kv_len]
    query = torch.randn(heads, rows, q_len, dim, generator=gen).to(dtype).transpose(0, 1)
    allowed = torch.rand(mask_rows or rows, q_len, kv_len, generator=gen) < 0.6
    allowed[..., 0] = True
    allowed[-1, :, 20:] = False
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min).unsqueeze(1)
    return query.to(device), key.to(device), value.to(device), mask.to(device)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (9, 3), (6, 1), (4, 4)])
@pytest.mark.parametrize("q_len", [1, 3, 7])
@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_masked_attention_folds_grouped_heads_and_equals_sdpa(heads, kv_heads, q_len, dtype, atol):
    """Every masked SDPA call of the engine and the draft models: the query heads of each key head
    folded into the query dimension (so SDPA sees no grouped-query heads) give what SDPA with
    ``enable_gqa`` gives, for one query per row (whose mask broadcasts over the folded heads) and
    several (whose mask is folded), per-row and shared masks, float rounding apart; in
    transformers' ``[rows, q_len, heads, dim]`` layout."""
    for mask_rows in (None, 1):
        query, key, value, mask = _masked_case(3, heads, kv_heads, q_len, dtype, mask_rows, seed=heads + q_len)
        for scale in (None, 0.3):
            want = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                                  enable_gqa=heads > kv_heads).transpose(1, 2)
            folds: dict = {}
            for _ in range(2):  # the second call reads the fold the first one made
                got = masked_attention(query, key, value, mask, scale=scale, folds=folds)
                assert got.shape == want.shape == (3, q_len, heads, 8) and got.is_contiguous()
                assert torch.allclose(got, want, atol=atol, rtol=0)
            assert len(folds) == (1 if q_len > 1 and heads > kv_heads else 0)
    shared = mask[:, :, :1]  # one mask row for every query of a row: it broadcasts, folded or not
    want = F.scaled_dot_product_attention(query, key, value, attn_mask=shared, enable_gqa=heads > kv_heads).transpose(1, 2)
    assert torch.allclose(masked_attention(query, key, value, shared), want, atol=atol, rtol=0)


def test_folded_masks_repeat_each_query_s_row_per_head_in_aligned_storage():
    """fold_mask: folded query ``g * q_len + i`` is query ``i``'s row, in storage whose every row
    starts at a multiple of MASK_ALIGN elements (what CUDA's memory-efficient kernel takes without
    padding the mask again per layer); the engine's additive masks are laid out the same way."""
    from goodspeed.lm.runtime.packing import additive_mask

    allowed = torch.rand(2, 3, 37, generator=torch.Generator().manual_seed(1)) < 0.5
    mask = additive_mask(allowed, torch.float32, "cpu")
    assert mask.shape == (2, 1, 3, 37)
    assert torch.equal(mask == 0, allowed.unsqueeze(1))
    folded = fold_mask(mask, 4)
    assert folded.shape == (2, 1, 12, 37)
    for g in range(4):
        assert torch.equal(folded[:, :, g * 3 : (g + 1) * 3], mask)
    for m in (mask, folded):
        assert m.stride(-1) == 1 and all(stride % MASK_ALIGN == 0 for stride in m.stride()[:-1])


def test_packed_groups_fold_their_mask_once_per_forward_not_once_per_layer(monkeypatch):
    """A packed forward over 4 layers with one masked group of 3-token rows: its mask is folded by
    the first layer, and the other three reuse it."""
    import goodspeed.lm.runtime.attention as attention
    from goodspeed.lm.runtime.kv_slots import SlotKVCache

    folds = []
    monkeypatch.setattr(attention, "fold_mask", lambda mask, groups: folds.append(groups) or fold_mask(mask, groups))
    model = tiny_llama(2, layers=4)
    use_gqa_attention(model)
    cache = SlotKVCache(num_layers=4, initial_capacity=16)
    for _ in range(2):
        cache.add_slot()
    with torch.inference_mode():
        for tokens in ([[1, 2, 3], [4, 5]], [[6, 7, 8], [9, 10, 11]]):
            layout = cache.pack(tokens, [None, None], slice(0, 2), torch.float64)
            model(input_ids=layout.input_ids, attention_mask=layout.mask, position_ids=layout.position_ids,
                  **{attention.PACKED: layout}, **with_cache(model, cache), use_cache=True)
            for slot, t in enumerate(tokens):
                cache.commit(slot, cache.lengths[slot], list(range(len(t))))
    assert folds == [2, 2]  # one fold a forward, for 4 query heads over 2 key heads


def _pool_case(heads, kv_heads, dim, dtype, device, seed=0):
    """A slot pool ``[slots, kv_heads, capacity, dim]`` as the cache holds it, four chain rows of
    1-7 new tokens over prefixes of 0 to capacity - 7 (one a slot further on in the pool), and
    the group's packed queries ``[heads, T, dim]``: what attention hands :meth:`VarlenRows.attend`."""
    gen = torch.Generator().manual_seed(seed)
    slots, capacity = 6, 64
    keys = torch.randn(slots, kv_heads, capacity, dim, generator=gen).to(dtype).to(device)
    values = torch.randn(slots, kv_heads, capacity, dim, generator=gen).to(dtype).to(device)
    rows = [(4, 0, 7), (0, capacity - 7, 5), (2, 3, 1), (5, 40, 6)]  # (slot, prefix, new tokens)
    query = torch.randn(heads, sum(n for *_, n in rows), dim, generator=gen).to(dtype).to(device)
    return query, keys, values, rows


def _row_attention(query, keys, values, rows, scale):
    """Each row's causal attention spelled out: query ``i`` of a row of ``n`` over prefix ``length``
    sees the prefix and new tokens up to itself; query head ``h`` reads key head ``h // groups``."""
    heads, kv_heads, dim = query.shape[0], keys.shape[1], query.shape[2]
    out, start = torch.zeros(query.shape[1], heads, dim, dtype=torch.float64), 0
    for slot, length, n in rows:
        for i in range(n):
            for h in range(heads):
                seen = length + i + 1
                k = keys[slot, h // (heads // kv_heads), :seen].double()
                weights = torch.softmax(k @ query[h, start + i].double() * scale, dim=0)
                out[start + i, h] = weights @ values[slot, h // (heads // kv_heads), :seen].double()
        start += n
    return out


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)])
def test_varlen_rows_attend_each_row_causally_over_its_own_slot(heads, kv_heads):
    """The varlen call's meaning (flash's, with per-sequence key starts and lengths): one sequence
    per (key head, row) over the flattened pool, bottom-right causal. Through the plain-torch
    kernel, VarlenRows.attend equals each row's attention spelled out (float64, 1e-12)."""
    query, keys, values, rows = _pool_case(heads, kv_heads, 16, torch.float64, "cpu")
    group = VarlenRows(REFERENCE_VARLEN, *(tuple(r[i] for r in rows) for i in range(3)))
    got = group.attend(query, keys.view(-1, 1, 16), values.view(-1, 1, 16), kv_heads, 64, None)
    assert torch.allclose(got, _row_attention(query, keys, values, rows, 16 ** -0.5), atol=1e-12, rtol=0)


def test_no_varlen_kernel_on_cpu_or_in_full_precision():
    """The flash kernel is a CUDA, fp16 / bf16 path: CPU models and fp32 ones attend masked."""
    assert varlen_kernel_for(tiny_llama(1)) is None
    assert varlen_kernel_for(tiny_llama(1, dtype=torch.bfloat16)) is None
    # What is missing, in the words the daemon and the engine refuse `attention = "varlen"` with.
    assert model_varlen_missing(tiny_llama(1, dtype=torch.bfloat16)) == "a CUDA device"
    assert varlen_missing("cuda:1", torch.float32) == "bfloat16 or float16"
    assert varlen_missing("cuda", torch.bfloat16, 12) == "a head dim that is a multiple of 8 up to 256 (this model's is 12)"
    assert varlen_missing("cuda", torch.float16, 512).startswith("a head dim")


CUDA_FLASH = pytest.mark.skipif(not torch.cuda.is_available() or flash_varlen_kernel() is None,
                                reason="needs CUDA and a torch whose flash varlen op takes per-sequence key lengths")


@CUDA_FLASH
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 64), (40, 8, 128), (4, 4, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_varlen_kernel_equals_each_row_s_attention_on_the_pool(heads, kv_heads, dim, dtype):
    """GPU: flash's varlen kernel through VarlenRows.attend on a pool of half-precision keys equals
    each row's attention computed in float64 from the same inputs, within half-precision rounding
    of outputs of size ~1 (2e-2 for bf16, 4e-3 for fp16)."""
    query, keys, values, rows = _pool_case(heads, kv_heads, dim, dtype, "cuda")
    group = VarlenRows(flash_varlen_kernel(), *(tuple(r[i] for r in rows) for i in range(3)))
    got = group.attend(query, keys.view(-1, 1, dim), values.view(-1, 1, dim), kv_heads, 64, None)
    want = _row_attention(query.cpu(), keys.cpu(), values.cpu(), rows, dim ** -0.5)
    assert got.shape == want.shape and got.dtype == dtype
    assert (got.double().cpu() - want).abs().max().item() < (2e-2 if dtype == torch.bfloat16 else 4e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_len", [1, 4])
def test_cuda_masked_attention_is_eligible_for_the_memory_efficient_kernel(dtype, q_len):
    """GPU: the folded call (no grouped-query heads left, an aligned mask) is one the memory-efficient
    kernel takes, where the same masked call with ``enable_gqa`` is not: that one runs on the math
    kernel, which copies every key head per query head."""
    from torch.backends.cuda import SDPAParams, can_use_efficient_attention

    query, key, value, mask = _masked_case(3, 9, 3, q_len, dtype, device="cuda")
    mask = fold_mask(mask, 3) if q_len > 1 else mask
    folded_query = query.reshape(3, 3, 3 * q_len, 8)
    assert can_use_efficient_attention(SDPAParams(folded_query, key, value, mask, 0.0, False, False), True)
    grouped_mask = _masked_case(3, 9, 3, q_len, dtype, device="cuda")[3]
    assert not can_use_efficient_attention(SDPAParams(query, key, value, grouped_mask, 0.0, False, True), False)
