"""The attention function of batched forwards with slot KV caches (the verifier's target and the
batched draft models): SDPA with grouped-query attention and an additive mask.

With a 4-D mask, transformers' own SDPA path repeats every key/value head for grouped-query
attention (``repeat_kv``), copying the whole KV cache of each layer on every forward — O(prefix)
memory traffic per round, which is exactly what the slot cache exists to avoid. This function
hands the KV view straight to ``scaled_dot_product_attention(enable_gqa=True)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "goodspeed_sdpa"


def gqa_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, heads, q_len, head_dim]
    key: torch.Tensor,  # [B, kv_heads, kv_len, head_dim]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,  # [B, 1, q_len, kv_len] additive
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    groups = query.shape[1] // key.shape[1]
    # Like transformers' own SDPA path: no mask means the plain causal case (q_len == kv_len).
    is_causal = attention_mask is None and query.shape[2] > 1
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=is_causal,
        enable_gqa=groups > 1,
    )
    return out.transpose(1, 2).contiguous(), None  # [B, q_len, heads, head_dim]


def use_gqa_attention(model: torch.nn.Module) -> None:
    """Switch ``model`` to :func:`gqa_sdpa_attention` (registered once under ``NAME``, with the
    SDPA mask builder, so ordinary calls of the model without a 4-D mask stay correct)."""
    AttentionInterface.register(NAME, gqa_sdpa_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(NAME)
    else:  # transformers 4.x
        model.config._attn_implementation = NAME
