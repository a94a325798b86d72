"""The engine's attention function must not change what the model computes, in any calling mode."""

import pytest
import torch
import torch.nn.functional as F

from transformers import DynamicCache

from goodspeed.lm.attention import (MATMUL_MAX_Q, REFERENCE_VARLEN, VarlenRows, flash_varlen_kernel,
                                    model_varlen_missing, small_query_attention, takes_small_query_attention,
                                    use_gqa_attention, varlen_kernel_for, varlen_missing, with_cache)
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


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (9, 3), (4, 4)])
@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_small_query_attention_equals_sdpa_on_cache_views_under_any_mask(heads, kv_heads, dtype, atol):
    """The CPU path of verification rows: the same outputs as SDPA with grouped-query heads, on keys
    that are a view of a longer cache (as the slot pool hands them) and a mask that hides whole
    stretches of keys per query (trees, padding) — float rounding apart."""
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    rows, q_len, kv_len, dim, capacity = 3, 5, 37, 8, 64
    key = torch.randn(rows, kv_heads, capacity, dim, generator=gen, dtype=dtype)[:, :, :kv_len]
    value = torch.randn(rows, kv_heads, capacity, dim, generator=gen, dtype=dtype)[:, :, :kv_len]
    query = torch.randn(heads, rows, q_len, dim, generator=gen, dtype=dtype).transpose(0, 1)  # non-contiguous
    allowed = torch.rand(rows, q_len, kv_len, generator=gen) < 0.6
    allowed[..., 0] = True
    allowed[1, :, 20:] = False  # a shorter row: its tail is padding
    mask = torch.zeros(rows, q_len, kv_len, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min).unsqueeze(1)
    for scale in (None, 0.3):
        ours = small_query_attention(query, key, value, mask, scale)
        sdpa = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=heads > kv_heads)
        assert ours.shape == sdpa.shape == (rows, heads, q_len, dim)
        assert torch.allclose(ours, sdpa, atol=atol, rtol=0)


def test_small_query_attention_is_taken_only_where_it_was_measured_faster_and_exact():
    """CPU, fp32 / fp64, verification rows of 2..MATMUL_MAX_Q queries: the matmul form. One query
    per row, prompt chunks, half precision (whose softmax SDPA keeps in fp32) and dropout: SDPA."""
    q32 = torch.zeros(1, 4, 8, 8)
    q64, bf16 = q32.double(), q32.bfloat16()
    assert takes_small_query_attention(q32, 2) and takes_small_query_attention(q32, 5)
    assert takes_small_query_attention(q64, MATMUL_MAX_Q)
    assert not takes_small_query_attention(q32, 1)
    assert not takes_small_query_attention(q32, MATMUL_MAX_Q + 1)
    assert not takes_small_query_attention(bf16, 5)
    assert not takes_small_query_attention(q32.half(), 5)
    assert not takes_small_query_attention(q32, 5, dropout=0.1)


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
