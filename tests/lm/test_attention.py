"""The engine's attention function must not change what the model computes, in any calling mode."""

import torch

from transformers import DynamicCache

from goodspeed.lm.attention import use_gqa_attention, with_cache
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
