"""The attention function of batched forwards with slot KV caches (the verifier's target and the
batched draft models): SDPA with grouped-query attention and an additive mask.

With a 4-D mask, transformers' own SDPA path repeats every key/value head for grouped-query
attention (``repeat_kv``), copying the whole KV cache of each layer on every forward — O(prefix)
memory traffic per round, which is exactly what the slot cache exists to avoid. This function
hands the KV view straight to ``scaled_dot_product_attention(enable_gqa=True)``.

Packed forwards (:meth:`goodspeed.lm.kv_slots.SlotKVCache.pack`, the verifier's target): the
model runs on ``[1, T]`` real tokens — every linear layer, norm and the LM head see exactly the
step's tokens, with no padding to the longest row — and the call carries the layout as the keyword
``PACKED`` (transformers passes a forward's extra keywords down to the attention function).
Attention alone works in the padded ``[rows, q_len]`` layout the slot cache's KV views have: the
queries are gathered into it, one SDPA call runs with the rows' masks, and the outputs are
scattered back to the packed tokens. Exact: every real query sees the same keys under the same
mask as in the padded forward; only the padding's wasted compute in the rest of the model is gone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "goodspeed_sdpa"
PACKED = "goodspeed_packed"  # the forward keyword carrying a PackedRows layout


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
    packed = kwargs.get(PACKED)
    if packed is not None:  # [1, heads, T, dim] -> the padded [rows, heads, q_len, dim]
        rows, q_len = packed.mask.shape[0], packed.mask.shape[2]
        heads, dim = query.shape[1], query.shape[3]
        flat = query[0] if packed.gather is None else query[0].index_select(1, packed.gather)  # no padding: rows are already equal
        out = F.scaled_dot_product_attention(flat.view(heads, rows, q_len, dim).transpose(0, 1), key, value,
                                             attn_mask=packed.mask, dropout_p=dropout, scale=scaling, enable_gqa=groups > 1)
        out = out.transpose(1, 2).reshape(rows * q_len, heads, dim)
        return (out if packed.scatter is None else out.index_select(0, packed.scatter)).unsqueeze(0), None
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
