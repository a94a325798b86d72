"""The engine's attention function must not change what the model computes, in any calling mode."""

import pytest
import torch
import torch.nn.functional as F

from transformers import DynamicCache

from goodspeed.lm.attention import (MATMUL_MAX_Q, small_query_attention, takes_small_query_attention, use_gqa_attention,
                                    with_cache)
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
