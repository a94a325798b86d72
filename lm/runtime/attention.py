"""The attention function of batched forwards with slot KV caches (the verifier's target and the
batched draft models): SDPA with grouped-query attention and an additive mask.

With a 4-D mask, transformers' own SDPA path repeats every key/value head for grouped-query
attention (``repeat_kv``), copying the whole KV cache of each layer on every forward — O(prefix)
memory traffic per round, which is exactly what the slot cache exists to avoid. Every masked call
here goes through :func:`masked_attention` instead: the query heads that read one key head are
folded into the query dimension (``[rows, kv_heads, groups * q_len, dim]``), so SDPA sees as
many query heads as key heads, reads each key head once for all the query heads it serves, and
is asked for no ``enable_gqa``. That matters most on CUDA: flash takes no mask and the
memory-efficient kernel no grouped-query heads, so a masked ``enable_gqa`` call falls back to the
math kernel, which copies every key head once per query head and runs attention as separate ops
(torch's ``sdp_utils.cpp``; transformers' ``use_gqa_in_sdpa`` says the same). Folded, the call
is one the memory-efficient kernel takes, and its masks are laid out so that kernel does not pad
them again per layer (:data:`MASK_ALIGN`). Not yet timed on a GPU (docs/MEASUREMENTS.md).

On this project's CPU the folded call costs the engine's rounds 0.95-1.02x what a matmul form of
verification rows' attention does (two matmuls, heads folded the same way; rows of 2-32 queries),
which is faster than SDPA with ``enable_gqa`` (``bench/bench_engine.py``; per call,
``bench/bench_attention.py``), so one call serves every device.

Packed forwards (:meth:`goodspeed.lm.runtime.kv_slots.SlotKVCache.pack`, the verifier's target): the
model runs on ``[1, T]`` real tokens — every linear layer, norm and the LM head see exactly the
step's tokens, with no padding to the longest row — and the call carries the layout as the keyword
``PACKED`` (transformers passes a forward's extra keywords down to the attention function).
Attention alone works in the padded ``[rows, q_len]`` layout the slot cache's KV views have, one
SDPA call per :class:`~goodspeed.lm.runtime.packing.AttentionGroup`: the queries are gathered into it,
SDPA runs with the rows' masks, and the outputs are scattered back to the packed tokens. A prompt
chunk (chunked prefill) is a group of its own, so its hundreds of queries do not pad the
verification rows' few; on a CPU the other rows split into contiguous groups where one long draft
would pad many short rows (:func:`~goodspeed.lm.runtime.packing.split_rows`); so is a row whose slot keeps its KV in buffers of its own (a slot far
longer than the others), whose keys come from :meth:`~goodspeed.lm.runtime.kv_slots.SlotKVCache.own_view`
(the attention module's ``layer_idx`` names the layer). Exact: every real query sees the same keys under the same
mask as in the padded forward; only the padding's wasted compute in the rest of the model is gone.

On CUDA in fp16 / bf16, a group of chains (verification rows, a prompt chunk) attends through
**flash-attention's varlen kernel** instead (:class:`VarlenKernel`, :func:`flash_varlen_kernel`),
with no mask and no padded query, reading every key in place from the slot cache. vLLM's layout
(flat tokens, cumulative query lengths, per-sequence key starts and lengths) is applied per key
head: the pool buffer ``[slots, kv_heads, capacity, dim]`` is, flattened, one run of
``capacity`` keys per (slot, key head), so each (key head, row) pair is one varlen *sequence*
with one key head and the query heads it serves — its keys start at
``(slot * kv_heads + head) * capacity`` (``cu_seq_k``) and number the row's length after this
step (``seqused_k``); its queries are the row's new tokens for those heads (``cu_seq_q``, the
queries regrouped head-major: a copy of the step's queries, never of keys). Causal masking is the
kernel's bottom-right rule (query ``i`` of a sequence of ``n`` new tokens over ``k`` keys sees
keys ``<= k - n + i``), which is exactly the chain mask. A tree row (an ancestor mask) keeps its
group on the masked SDPA path. This needs only ``seqused_k``, which the flash op of torch 2.11
and 2.13 takes, not a block table (which torch 2.11, on the GPU machine this was measured on,
lacks). Where there is no such kernel, or on CPU, every group takes the masked path:
:func:`varlen_kernel_for` says which, and the engine logs it. :data:`REFERENCE_VARLEN` computes
the same call in plain torch, one sequence at a time: the tests run the whole packed path
through it on CPU, and compare the CUDA kernel with it. Measured on an H200
(``bench/bench_varlen.py``, docs/MEASUREMENTS.md *On a GPU*): a step then costs the same however
the allocation spreads its tokens (GoodSpeed / Fixed-S 0.958-1.024 in 9 of 10 cells, masked
SDPA's 1.018-1.120), though the call, with its query and output regrouping, costs 1.1-1.4x
masked SDPA's.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, LlamaForCausalLM
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "goodspeed_sdpa"
# What this transformers' causal LMs call their cache argument (renamed in 5.24).
_TRANSFORMERS_CACHE_KWARG = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"
PACKED = "goodspeed_packed"  # the forward keyword carrying a PackedRows layout
MASK_ALIGN = 16  # additive masks' rows start at multiples of this many elements (CUDA's memory-efficient kernel)


def aligned_mask(rows: int, heads: int, q_len: int, kv_len: int, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialised mask ``[rows, heads, q_len, kv_len]`` in storage whose rows start at
    multiples of ``MASK_ALIGN`` elements (wider than ``kv_len``), so CUDA's memory-efficient kernel
    takes it as it is instead of padding it again on every layer."""
    width = -(-kv_len // MASK_ALIGN) * MASK_ALIGN
    return torch.empty(rows, heads, q_len, width, dtype=dtype, device=device)[..., :kv_len]


def fold_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """The additive mask ``[rows, 1, q_len, kv_len]`` for queries whose ``groups`` query heads per
    key head are folded into the query dimension (:func:`masked_attention`): ``[rows, 1, groups *
    q_len, kv_len]``, folded query ``g * q_len + i`` under query ``i``'s row, in
    :func:`aligned_mask` storage."""
    rows, one, q_len, kv_len = mask.shape
    folded = aligned_mask(rows, one, groups * q_len, kv_len, mask.dtype, mask.device)
    folded.unflatten(2, (groups, q_len)).copy_(mask.unsqueeze(2))
    return folded


def masked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                     dropout: float = 0.0, scale: float | None = None, folds: dict | None = None) -> torch.Tensor:
    """SDPA of ``query`` ``[rows, heads, q_len, dim]`` over ``key`` / ``value`` ``[rows, kv_heads,
    kv_len, dim]`` (views of a cache are fine) under the additive ``mask`` ``[rows or 1, 1, q_len,
    kv_len]``; returns ``[rows, q_len, heads, dim]``, transformers' layout of attention outputs.

    With grouped-query heads, the query heads that read one key head are folded into the query
    dimension, so no key is copied and SDPA is asked for no ``enable_gqa`` (see the module
    docstring: on CUDA, the difference between a fused kernel and the math one). One query per
    row, or a mask row shared by every query, needs no new mask (it broadcasts over the folded
    heads); more take :func:`fold_mask`'s, made once per forward when ``folds`` (a dict kept with one mask) is
    given. Same maths as ``scaled_dot_product_attention(..., enable_gqa=True)``, float rounding
    apart (``tests/lm/runtime/test_attention.py``)."""
    rows, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    if groups == 1 or mask.shape[1] != 1:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scale,
                                             enable_gqa=groups > 1)
        return out.transpose(1, 2).contiguous()
    if mask.shape[2] > 1:  # one row per query (a row shared by every query broadcasts as it is)
        folded = None if folds is None else folds.get(groups)
        if folded is None:
            folded = fold_mask(mask, groups)
            if folds is not None:
                folds[groups] = folded
        mask = folded
    out = F.scaled_dot_product_attention(query.reshape(rows, kv_heads, groups * q_len, dim), key, value, attn_mask=mask,
                                         dropout_p=dropout, scale=scale)
    return out.unflatten(2, (groups, q_len)).permute(0, 3, 1, 2, 4).reshape(rows, q_len, heads, dim).contiguous()


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
            if group.varlen is not None:  # chains, keys read in place, one sequence per (key head, row)
                part = group.varlen.attend(flat, *packed.cache.flat_kv(module.layer_idx, group.own), scaling)
                if out is None:
                    return part.unsqueeze(0), None
                out[group.dest] = part
                continue
            if group.own is None:
                keys, values = key[group.rows, :, : group.kv_len], value[group.rows, :, : group.kv_len]
            else:  # a slot with KV buffers of its own
                keys, values = packed.cache.own_view(module.layer_idx, group.own, group.kv_len)
            queries = flat.reshape(heads, rows, group.q_len, dim).transpose(0, 1)
            part = masked_attention(queries, keys, values, group.mask, dropout, scaling, group.folds)
            part = part.reshape(rows * group.q_len, heads, dim)
            if group.scatter is not None:
                part = part.index_select(0, group.scatter)
            if out is None:  # one group answers for every token
                return part.unsqueeze(0), None
            out[group.dest] = part
        return out.unsqueeze(0), None
    if attention_mask is not None:
        return masked_attention(query, key, value, attention_mask, dropout, scaling), None
    # Like transformers' own SDPA path: no mask means the plain causal case (q_len == kv_len), which
    # flash takes with grouped-query heads.
    out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, scale=scaling, is_causal=query.shape[2] > 1,
                                         enable_gqa=groups > 1)
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


def keep_logits(model: torch.nn.Module, keep) -> dict:
    """The keyword that asks ``model`` for the logits of some positions only (``keep``: the last
    ``n``, or a 1-D tensor of positions), as transformers' causal LMs take it; ``{}`` for a forward
    without ``logits_to_keep``, which computes them all (slower, the same logits at those
    positions). Read from the forward's signature once per model."""
    takes = getattr(model, "_goodspeed_keeps_logits", None)
    if takes is None:
        takes = model._goodspeed_keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
    return {"logits_to_keep": keep} if takes else {}


def use_gqa_attention(model: torch.nn.Module) -> None:
    """Switch ``model`` to :func:`gqa_sdpa_attention` (registered once under ``NAME``, with the
    SDPA mask builder, so ordinary calls of the model without a 4-D mask stay correct)."""
    AttentionInterface.register(NAME, gqa_sdpa_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(NAME)
    else:  # transformers 4.x
        model.config._attn_implementation = NAME


# ----------------------------------------------------------------- varlen attention (CUDA)


@dataclass(frozen=True)
class VarlenKernel:
    """A varlen kernel with per-sequence key starts and lengths (flash's ``seqused_k``):
    ``call(query [Tq, heads, dim], key / value [Tk, 1, dim], cu_seq_q [B + 1], cu_seq_k [B + 1]
    (sequence b's keys start at cu_seq_k[b]), seqused_k [B] (and number seqused_k[b]), max_q,
    max_k, scale) -> [Tq, heads, dim]``, causal bottom-right per sequence, every query head over
    the one key head (int32 metadata)."""

    name: str
    call: Callable[..., torch.Tensor]


@dataclass(frozen=True)
class VarlenRows:
    """One packed group's chain rows for a :class:`VarlenKernel` (:meth:`SlotKVCache.pack
    <goodspeed.lm.runtime.kv_slots.SlotKVCache.pack>`): per row with tokens, in packed order, the slot
    whose keys it reads (0 for a buffer of its own), its committed length and new tokens. The
    per-(key head, row) metadata is made on the first layer and reused by the others."""

    kernel: VarlenKernel
    slots: tuple[int, ...]
    lengths: tuple[int, ...]
    sizes: tuple[int, ...]
    _meta: dict = field(default_factory=dict, compare=False)

    def metadata(self, kv_heads: int, capacity: int, device) -> tuple:
        """``cu_seq_q, cu_seq_k, seqused_k, max_q, max_k`` for sequences (head, row), head-major,
        over keys flattened from ``[slots, kv_heads, capacity, dim]``: one host -> device copy."""
        key = (kv_heads, capacity, str(device))
        if key not in self._meta:
            tokens, rows = sum(self.sizes), len(self.sizes)
            ends = np.cumsum(self.sizes)
            cu_q = [0, *(h * tokens + int(e) for h in range(kv_heads) for e in ends)]
            starts = [(slot * kv_heads + h) * capacity for h in range(kv_heads) for slot in self.slots]
            used = [length + n for length, n in zip(self.lengths, self.sizes)] * kv_heads
            meta = torch.tensor([*cu_q, *starts, 0, *used], dtype=torch.int32).to(device)
            b = kv_heads * rows
            self._meta[key] = (meta[: b + 1], meta[b + 1 : 2 * b + 2], meta[2 * b + 2 :], max(self.sizes),
                               max(used))
        return self._meta[key]

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kv_heads: int, capacity: int,
               scale: float | None) -> torch.Tensor:
        """``query`` ``[heads, T, dim]`` (the group's packed tokens), ``keys`` / ``values`` the
        flattened buffers ``[slots * kv_heads * capacity, 1, dim]`` -> ``[T, heads, dim]``."""
        heads, tokens, dim = query.shape
        groups = heads // kv_heads
        q = query.view(kv_heads, groups, tokens, dim).transpose(1, 2).reshape(kv_heads * tokens, groups, dim)
        cu_q, cu_k, used, max_q, max_k = self.metadata(kv_heads, capacity, query.device)
        out = self.kernel.call(q, keys, values, cu_q, cu_k, used, max_q, max_k, dim ** -0.5 if scale is None else scale)
        return out.view(kv_heads, tokens, groups, dim).transpose(0, 1).reshape(tokens, heads, dim)


def varlen_reference(query, keys, values, cu_seq_q, cu_seq_k, seqused_k, max_q, max_k, scale) -> torch.Tensor:
    """What a :class:`VarlenKernel` computes, one sequence at a time in plain torch (SDPA with an
    explicit bottom-right causal mask): the CPU tests' kernel and the yardstick of the CUDA one."""
    out = query.new_empty(query.shape)
    cu_q, starts, used = cu_seq_q.tolist(), cu_seq_k.tolist(), seqused_k.tolist()
    for b, k_len in enumerate(used):
        q0, q1, k0 = cu_q[b], cu_q[b + 1], starts[b]
        n = q1 - q0
        allowed = torch.arange(k_len, device=query.device) <= (k_len - n + torch.arange(n, device=query.device)).unsqueeze(1)
        q = query[q0:q1].transpose(0, 1).unsqueeze(0)  # [1, heads, n, dim] over one key head
        part = F.scaled_dot_product_attention(q, keys[k0 : k0 + k_len].transpose(0, 1).unsqueeze(0),
                                              values[k0 : k0 + k_len].transpose(0, 1).unsqueeze(0), attn_mask=allowed,
                                              scale=scale, enable_gqa=q.shape[1] > 1)
        out[q0:q1] = part[0].transpose(0, 1)
    return out


REFERENCE_VARLEN = VarlenKernel("reference (plain torch, one sequence at a time)", varlen_reference)


def flash_varlen_kernel() -> VarlenKernel | None:
    """torch's flash-attention varlen op with per-sequence key lengths (``seqused_k``), where this
    torch build has it: ``aten::_flash_attention_forward``, the op under the public
    ``torch.nn.attention.varlen.varlen_attn`` (which takes ``seqused_k`` itself only from torch
    2.13; the op takes it in 2.11 already). Run on an H200 with torch 2.11 (docs/MEASUREMENTS.md)."""
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    if op is None or "seqused_k" not in {a.name for a in op.default._schema.arguments}:
        return None

    def call(query, keys, values, cu_seq_q, cu_seq_k, seqused_k, max_q, max_k, scale):
        return op(query, keys, values, cu_seq_q, cu_seq_k, max_q, max_k, 0.0, True, False, scale=scale,
                  seqused_k=seqused_k)[0]
    return VarlenKernel("flash varlen (aten::_flash_attention_forward)", call)


def varlen_missing(device: torch.device | str, dtype: torch.dtype, head_dim: int | None = None) -> str | None:
    """What flash's varlen kernel needs that a model on ``device`` in ``dtype`` (with ``head_dim``,
    when known) lacks, in words, or None when it can take the model's chains: a CUDA device, fp16 /
    bf16, a head dim that is a multiple of 8 up to 256, and a torch whose flash op has it. The
    daemon asks before loading a model (no head dim yet); :func:`varlen_kernel_for` after."""
    if torch.device(device).type != "cuda":
        return "a CUDA device"
    if dtype not in (torch.float16, torch.bfloat16):
        return "bfloat16 or float16"
    if head_dim is not None and (head_dim % 8 or head_dim > 256):
        return f"a head dim that is a multiple of 8 up to 256 (this model's is {head_dim})"
    if flash_varlen_kernel() is None:
        return "a torch whose flash op takes per-sequence key lengths (this one's does not)"
    return None


def model_varlen_missing(model: torch.nn.Module) -> str | None:
    """:func:`varlen_missing` for ``model`` as it is loaded."""
    param = next(model.parameters())
    config = model.config
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return varlen_missing(param.device, param.dtype, dim)


def varlen_kernel_for(model: torch.nn.Module) -> VarlenKernel | None:
    """The varlen kernel ``model``'s packed forwards take for chains, or None (masked SDPA):
    flash's, where :func:`model_varlen_missing` finds nothing missing."""
    return None if model_varlen_missing(model) else flash_varlen_kernel()
