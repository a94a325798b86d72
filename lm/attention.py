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
Attention alone works in the padded ``[rows, q_len]`` layout the slot cache's KV views have, one
SDPA call per :class:`~goodspeed.lm.kv_slots.AttentionGroup`: the queries are gathered into it,
SDPA runs with the rows' masks, and the outputs are scattered back to the packed tokens. A prompt
chunk (chunked prefill) is a group of its own, so its hundreds of queries do not pad the
verification rows' few; so is a row whose slot keeps its KV in buffers of its own (a slot far
longer than the others), whose keys come from :meth:`~goodspeed.lm.kv_slots.SlotKVCache.own_view`
(the attention module's ``layer_idx`` names the layer). Exact: every real query sees the same keys under the same
mask as in the padded forward; only the padding's wasted compute in the rest of the model is gone.

On CPU, a group of verification rows (2 to ``MATMUL_MAX_Q`` queries per row) attends through
:func:`small_query_attention` instead of SDPA: two matmuls with the grouped-query heads folded into
the query dimension, so each key and value head is read once for all the query heads it serves.
Measured by ``bench/bench_attention.py`` on this project's 2-core CPU with 2 threads (2026-11-25,
fp32): 0.49-0.98x SDPA's time for rows of 2-32 queries over 69-4,000 keys, on the demo target's
heads (4 / 2 x 32) and SmolLM2's (9 / 3 x 64). SDPA stays faster for one query per row (up to
2.1x; its decoding kernel) and for prompt chunks (up to 2.6x at 512 queries), which keep it, as
do every other device and half-precision models (whose scores and softmax SDPA's kernel keeps in
fp32). Same maths, same
mask; the two differ by float rounding only (``tests/lm/test_attention.py``).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, LlamaForCausalLM
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "goodspeed_sdpa"
# What this transformers' causal LMs call their cache argument (renamed in 5.24).
_TRANSFORMERS_CACHE_KWARG = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"
PACKED = "goodspeed_packed"  # the forward keyword carrying a PackedRows layout
MATMUL_MAX_Q = 32  # on CPU, groups of 2..MATMUL_MAX_Q queries per row attend by small_query_attention
# ... in these dtypes only: in bf16 / fp16 its scores and softmax would round where SDPA's kernel keeps fp32
_MATMUL_DTYPES = (torch.float32, torch.float64)


def small_query_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                          scale: float | None = None) -> torch.Tensor:
    """Attention of a few queries per row, as two matmuls: ``query`` ``[rows, heads, q_len, dim]``,
    ``key`` / ``value`` ``[rows, kv_heads, kv_len, dim]`` (views of a cache are fine), ``mask`` the
    additive ``[rows, 1, q_len, kv_len]``. Query head ``h`` reads key head ``h // (heads // kv_heads)``
    (transformers' ``repeat_kv``), so the heads of one key head are folded into the query
    dimension and no key is copied. Returns ``[rows, heads, q_len, dim]``, as SDPA does."""
    rows, heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    q = (query * (dim ** -0.5 if scale is None else scale)).reshape(rows, kv_heads, groups * q_len, dim)
    scores = torch.matmul(q, key.transpose(-1, -2))  # [rows, kv_heads, groups * q_len, kv_len]
    scores.view(rows, kv_heads, groups, q_len, kv_len).add_(mask.unsqueeze(2))
    out = torch.matmul(torch.softmax(scores, dim=-1), value)
    return out.view(rows, kv_heads, groups, q_len, dim).reshape(rows, heads, q_len, dim)


def takes_small_query_attention(query: torch.Tensor, q_len: int, dropout: float = 0.0) -> bool:
    """Whether a packed group of ``q_len`` queries per row attends by :func:`small_query_attention`
    (CPU, fp32 / fp64, 2..``MATMUL_MAX_Q`` queries, no dropout) rather than SDPA."""
    return (query.device.type == "cpu" and query.dtype in _MATMUL_DTYPES and 2 <= q_len <= MATMUL_MAX_Q
            and not dropout)


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
    if packed is not None:  # [1, heads, T, dim]: per group, the padded [rows, heads, q_len, dim]
        heads, total, dim = query.shape[1], query.shape[2], query.shape[3]
        out = None if len(packed.groups) == 1 else query.new_empty(total, heads, dim)
        for group in packed.groups:
            rows = group.rows.stop - group.rows.start
            flat = query[0, :, group.tokens] if group.gather is None else query[0].index_select(1, group.gather)
            if group.own is None:
                keys, values = key[group.rows, :, : group.kv_len], value[group.rows, :, : group.kv_len]
            else:  # a slot with KV buffers of its own
                keys, values = packed.cache.own_view(module.layer_idx, group.own, group.kv_len)
            queries = flat.reshape(heads, rows, group.q_len, dim).transpose(0, 1)
            if takes_small_query_attention(query, group.q_len, dropout):
                part = small_query_attention(queries, keys, values, group.mask, scaling)
            else:
                part = F.scaled_dot_product_attention(queries, keys, values, attn_mask=group.mask,
                                                      dropout_p=dropout, scale=scaling, enable_gqa=groups > 1)
            part = part.transpose(1, 2).reshape(rows * group.q_len, heads, dim)
            if group.scatter is not None:
                part = part.index_select(0, group.scatter)
            if out is None:  # one group answers for every token
                return part.unsqueeze(0), None
            out[group.dest] = part
        return out.unsqueeze(0), None
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


def with_cache(model: torch.nn.Module, cache) -> dict:
    """The keyword that hands ``cache`` to ``model``'s forward: ``cache`` since transformers 5.24,
    ``past_key_values`` before (5.24 still takes the old name with a FutureWarning, and drops it in
    5.40). Read from the forward's signature once per model; a forward that names neither (a
    wrapper taking ``**kwargs``) gets the installed transformers' name."""
    name = getattr(model, "_goodspeed_cache_kwarg", None)
    if name is None:
        params = inspect.signature(model.forward).parameters
        name = model._goodspeed_cache_kwarg = next((n for n in ("cache", "past_key_values") if n in params),
                                                   _TRANSFORMERS_CACHE_KWARG)
    return {name: cache}


def use_gqa_attention(model: torch.nn.Module) -> None:
    """Switch ``model`` to :func:`gqa_sdpa_attention` (registered once under ``NAME``, with the
    SDPA mask builder, so ordinary calls of the model without a 4-D mask stay correct)."""
    AttentionInterface.register(NAME, gqa_sdpa_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(NAME)
    else:  # transformers 4.x
        model.config._attn_implementation = NAME
