"""Packed forwards over a :class:`~goodspeed.lm.runtime.kv_slots.SlotKVCache`'s slots: the model sees only
the real tokens (``[1, T]``), and attention runs per :class:`AttentionGroup` (its rows' own masks
and depths; the varlen kernel's chains; one shared masked group). :func:`pack` lays a step out,
:func:`pack_static` at fixed shapes for a CUDA graph; each also sets the cache's write plan for the
forward it lays out (where each new token's keys go), which the cache's ``update`` follows. The
masks are additive 4-D (0 / finfo.min): a bool 4-D mask is silently wrong under eager attention.

**Keys in whole runs** (:data:`KEY_ALIGN`, :func:`key_span`): a masked group reads its keys up to
a multiple of ``KEY_ALIGN`` positions (masked past each row's own), as far as the buffer holds
them. Torch's CPU attention kernel sums a row's softmax over the keys it is given in vectors, with
a remainder loop for the last few; given a number of keys that depends on the other queries of the
call (a draft's length, another row's prefix), the same query's output could differ in its last
bit between a one-token step and a verification step. Padded to whole runs of 16, the masked keys
add exact zeros in whole vectors: measured on this project's CPUs, a query's output is then the
same bit for bit whatever else its call holds, one query alone or a draft's, other rows beside it,
a prompt chunk of a thousand (``tests/lm/runtime/test_packing.py``). That makes greedy speculative
output in bf16 equal plain decoding's one request at a time; at a batch it takes linear layers
that are batch invariant too (:mod:`goodspeed.lm.runtime.invariant`; docs/DESIGN.md, *Lossless in
bf16*).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from goodspeed.lm.runtime.attention import VarlenRows, aligned_mask

if TYPE_CHECKING:
    from goodspeed.lm.runtime.kv_slots import SlotKVCache

KEY_ALIGN = 16  # a masked group's keys, in whole runs of this many positions (the module docstring)


def key_span(kv_len: int, room: int) -> int:
    """The keys a masked group reads for ``kv_len`` real ones: rounded up to a multiple of
    :data:`KEY_ALIGN` where its buffer has ``room`` for them (the positions past ``kv_len`` hold
    zeros or rolled-back entries, finite either way, and the mask hides them), else ``kv_len``.

    >>> key_span(80, 256), key_span(96, 256), key_span(250, 256), key_span(250, 250)
    (80, 96, 256, 250)
    """
    aligned = -(-kv_len // KEY_ALIGN) * KEY_ALIGN
    return aligned if aligned <= room else kv_len


@dataclass(frozen=True)
class AttentionGroup:
    """Window rows whose queries attend in one call: SDPA under the group's mask, padded to its
    longest row, or (``varlen``) the varlen kernel over the packed queries as they are."""

    rows: slice  # window rows: their KV views are the keys
    q_len: int
    kv_len: int
    mask: torch.Tensor | None  # [rows, 1, q_len, kv_len] additive (None: varlen)
    tokens: slice | None  # no pads: the packed tokens, already in the padded order
    gather: torch.Tensor | None  # [rows * q_len]: the packed token of each padded query (pads: token 0)
    scatter: torch.Tensor | None  # the padded query of each real token (None: no pads)
    dest: slice  # the packed tokens the group's real queries answer for, in row order
    own: int | None = None  # the slot whose own buffers hold the keys (None: the pool's rows)
    varlen: VarlenRows | None = None  # chains through the varlen kernel (then no mask, no padding)
    # ``mask`` folded for grouped-query heads (goodspeed.lm.runtime.attention.masked_attention), made by the
    # forward's first layer and reused by the others
    folds: dict = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class PackedRows:
    """One packed forward over a window of slots (:meth:`SlotKVCache.pack`): ``T`` real tokens."""

    input_ids: torch.Tensor  # [1, T]: solo rows, then the others, row after row
    position_ids: torch.Tensor  # [1, T]
    groups: tuple[AttentionGroup, ...]
    starts: list[int]  # row r's tokens are input_ids[0, starts[r] : starts[r] + sizes[r]]
    sizes: list[int]
    q_len: int  # the longest row with logits
    keep: int  # the tokens with logits (every row but the solo ones): the last ``keep`` of the forward
    cache: "SlotKVCache | None" = None  # where a group with ``own`` reads its keys (SlotKVCache.own_view)

    @property
    def mask(self) -> torch.Tensor:
        """What a caller passes as ``attention_mask``: a 4-D tensor, so transformers builds no mask
        of its own (attention reads the groups, never this). The shared group's mask, or an empty
        one when that group has none (the varlen kernel's)."""
        mask = self.groups[-1].mask if self.groups else None
        return mask if mask is not None else torch.zeros(1, 1, 0, 0, device=self.input_ids.device)

    def padded(self, packed: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """``[1, T', ...]`` per-token values (e.g. logits) of the last ``T'`` tokens (all of them,
        or the ``keep`` ones with logits) -> ``[len(rows), q_len, ...]`` for the window rows
        ``rows`` (not solo ones); pad positions repeat the row's last token."""
        offset = self.input_ids.shape[1] - packed.shape[1]
        first = torch.tensor([self.starts[r] - offset for r in rows]).unsqueeze(1)
        last = torch.tensor([self.starts[r] + self.sizes[r] - 1 - offset for r in rows]).unsqueeze(1)
        return packed[0, torch.minimum(first + torch.arange(self.q_len), last).to(packed.device)]


def pack(cache: SlotKVCache, tokens: list[list[int]], parents: list[list[int] | None], rows: slice, dtype: torch.dtype,
         device: torch.device | str = "cpu", solo: tuple[int, ...] = (), pad: bool = False) -> PackedRows:
    """Set up a *packed* forward over the slots ``rows``: row ``r`` brings ``tokens[r]`` (any
    number, 0 for an idle slot inside the window), written at its committed length. The model
    sees only the real tokens (``[1, T]``, no padding); attention (:mod:`goodspeed.lm.runtime.attention`)
    runs per :class:`AttentionGroup`, gathering its rows' queries into a padded layout and
    scattering the outputs back.

    ``solo``: rows attended on their own whose logits nobody reads (a prompt chunk: hundreds of
    tokens that would pad every short verification row to their length). A row whose slot has
    a buffer of its own (see the module docstring; decided here, from what this forward writes)
    is attended on its own too, with logits. The others share one group, or on a CPU (the
    cache's ``group_overhead``) the contiguous groups :func:`split_rows` cuts them into, so one
    long draft does not pad every short row. The packed order is solo rows, own-buffer rows,
    then the shared rows in row order, so the rows with logits are the last
    ``PackedRows.keep`` tokens.

    ``pad``: where the step allows it, lay the rows out padded instead (:func:`_pack_padded`):
    the model then sees pad tokens too, and attention needs no gather or scatter."""
    sizes = [len(t) for t in tokens]
    cache._place({rows.start + r: cache.lengths[rows.start + r] + n for r, n in enumerate(sizes) if n})
    if pad and _can_pad(cache, sizes, parents, rows, solo):
        return _pack_padded(cache, tokens, sizes, parents, rows, dtype, device)
    lengths = cache.lengths[rows]
    alone = sorted(set(solo))
    own = [r for r in range(len(tokens)) if sizes[r] and r not in alone and rows.start + r in cache._own]
    shared = [r for r in range(len(tokens)) if r not in alone and r not in own]
    order = alone + own + shared
    starts, total = [0] * len(tokens), 0
    for r in order:
        starts[r], total = total, total + sizes[r]
    keep = sum(sizes[r] for r in own + shared)
    in_pool = [r for r in order if sizes[r] and rows.start + r not in cache._own]
    cache._rows = rows
    cache._write_rows = torch.tensor([rows.start + r for r in in_pool for _ in range(sizes[r])], dtype=torch.long).unsqueeze(0)
    cache._write_pos = torch.tensor([lengths[r] + i for r in in_pool for i in range(sizes[r])], dtype=torch.long).unsqueeze(0)
    cache._own_writes = [(rows.start + r, slice(starts[r], starts[r] + sizes[r]), lengths[r])
                        for r in order if sizes[r] and rows.start + r in cache._own]
    cache._pool_tokens = None if not cache._own_writes else torch.tensor(
        [starts[r] + i for r in in_pool for i in range(sizes[r])], dtype=torch.long)
    ids = torch.tensor([tok for r in order for tok in tokens[r]], dtype=torch.long).unsqueeze(0).to(device)
    positions = torch.tensor([lengths[r] + i for r in order for i in range(sizes[r])], dtype=torch.long).unsqueeze(0)
    groups = []
    for r in alone + own:  # chains and trees alike: the row's own mask and depths
        n, length = sizes[r], lengths[r]
        span = slice(starts[r], starts[r] + n)
        slot = rows.start + r
        home = slot if slot in cache._own else None
        if cache.varlen is not None and parents[r] is None:  # a chain: the kernel's causal rule, no mask
            groups.append(AttentionGroup(slice(r, r + 1), n, length + n, None, span, None, None, span, home,
                                         VarlenRows(cache.varlen, (0 if home is not None else slot,), (length,), (n,))))
            continue
        kv_len = key_span(length + n, cache._capacity if home is None else cache._own[home].capacity)
        mask, pos = build_attention([length], [parents[r]], n, kv_len, dtype, device)
        positions[0, span] = pos[0].cpu()
        groups.append(AttentionGroup(slice(r, r + 1), n, kv_len, mask, span, None, None, span, home))
    q_len = max((sizes[r] for r in shared), default=0)
    if q_len and cache.varlen is not None and all(parents[r] is None for r in shared if sizes[r]):
        count = sum(sizes[r] for r in shared)
        span = slice(total - count, total)  # shared rows in row order, idle ones taking no tokens
        real = [r for r in shared if sizes[r]]
        groups.append(AttentionGroup(slice(0, len(tokens)), q_len, max(lengths[r] + sizes[r] for r in real), None, span,
                                     None, None, span, None,
                                     VarlenRows(cache.varlen, tuple(rows.start + r for r in real),
                                                tuple(lengths[r] for r in real), tuple(sizes[r] for r in real))))
    elif q_len:
        # One group per segment of the window (split_rows): a long draft pads only its own
        # segment's rows to its length. Keys up to the segment's longest row's last new token: a
        # real query never sees past it, and a pad (a short, solo, own or idle row's) attends to
        # what is there (its output is dropped), so a long prompt's slot does not widen everyone's
        # attention.
        own_sizes = [sizes[r] if r in shared else 0 for r in range(len(tokens))]
        ends = [lengths[r] + sizes[r] for r in range(len(tokens))]
        offset = total - sum(own_sizes)  # the shared rows' tokens, in row order, end the forward
        for a, b in split_rows(own_sizes, ends, cache.group_overhead):
            seg = range(a, b)
            q_seg = max(own_sizes[a:b])
            kv_len = key_span(max(ends[r] for r in seg if own_sizes[r]), cache._capacity)
            mask, pos = build_attention(lengths[a:b], [parents[r] if r in shared else None for r in seg], q_seg, kv_len,
                                        dtype, device)
            real = torch.arange(q_seg) < torch.tensor(own_sizes[a:b]).unsqueeze(1)
            count = sum(own_sizes[a:b])
            span = slice(offset, offset + count)
            offset += count
            if bool(real.all()):  # every row is q_seg long: the packed order is the padded one
                positions[0, span] = pos.reshape(-1).cpu()
                groups.append(AttentionGroup(slice(a, b), q_seg, kv_len, mask, span, None, None, span))
            else:
                scatter = real.view(-1).nonzero().view(-1)  # padded index of each real token, in row order
                gather = torch.zeros((b - a) * q_seg, dtype=torch.long)
                gather[scatter] = torch.arange(span.start, span.stop)  # packed index of each padded query (pads: token 0)
                positions[0, span] = pos.reshape(-1).cpu()[scatter]
                groups.append(AttentionGroup(slice(a, b), q_seg, kv_len, mask, None, gather.to(device),
                                             scatter.to(device), span))
    cache._kv_len = max((g.kv_len for g in groups if g.own is None), default=0)  # the pool view attention reads
    logit_rows = max((sizes[r] for r in own + shared), default=0)
    return PackedRows(ids, positions.to(device), tuple(groups), starts, sizes, logit_rows, keep, cache)


# What one more masked attention group costs on a CPU, in multiply-adds of attention (a row's
# query against a key, over one head's width, for each query head). SDPA over the shapes of
# verification steps (SmolLM2-135M's 9 heads of 64, bf16, two threads) costs about 22-29 us a
# call plus 0.014-0.017 us per row, key and query, with about 2 queries' worth more per row and
# key (bench/bench_groups.py fits it); with a group's gather, scatter and mask on top, a group
# costs about 4,000 (row, key) pairs at that width (docs/MEASUREMENTS.md, *Attention groups*).
# group_overhead() turns it into a model's pairs.
CPU_GROUP_OVERHEAD_MACS = 4000.0 * 9 * 64
EXTRA_QUERIES = 2.4  # the per-(row, key) cost of a call that scores one query, in queries' worth


def group_overhead(model_config, device: torch.device) -> float | None:
    """:func:`split_rows`'s ``overhead`` for a model on ``device``: :data:`CPU_GROUP_OVERHEAD_MACS`
    in (row, key) pairs of its query heads' width on a CPU; None (one group) elsewhere, where a
    call's launch, not its arithmetic, is what a group costs (not measured here)."""
    if device.type != "cpu":
        return None
    heads = int(model_config.num_attention_heads)
    head_dim = int(getattr(model_config, "head_dim", None) or model_config.hidden_size // heads)
    return CPU_GROUP_OVERHEAD_MACS / (heads * head_dim)


def split_rows(sizes: list[int], ends: list[int], overhead: float | None) -> list[tuple[int, int]]:
    """Contiguous segments ``[a, b)`` of the window's rows, one attention group each, covering every
    row with tokens (``sizes[r] > 0``); ``ends[r]``: row ``r``'s keys after this step. A group
    pads its rows to its longest and reads keys up to its farthest end, so it costs about
    ``overhead + rows * kv_len * (q_len + EXTRA_QUERIES)``; the segments minimise the sum (a
    dynamic programme over the row boundaries; rows without tokens between groups cost
    nothing). ``overhead`` None: one group over every row from the first with tokens to the last
    (where a call's launch, not its arithmetic, is the cost, as on a GPU, unmeasured here).
    O(rows^2) in Python, once per forward.

    >>> split_rows([1, 1, 1, 7, 1, 1, 1, 1], [800] * 8, 4000.0)  # one long draft among 8 rows
    [(0, 3), (3, 4), (4, 8)]
    >>> split_rows([1, 1, 2, 1], [50, 50, 50, 50], 4000.0)
    [(0, 4)]
    """
    real = [r for r, n in enumerate(sizes) if n]
    if not real:
        return []
    if overhead is None:
        return [(real[0], real[-1] + 1)]
    n = len(sizes)
    best = [0.0] + [math.inf] * n  # best[j]: the cheapest cover of the rows with tokens among [0, j)
    cut = [0] * (n + 1)  # where the last segment of that cover starts (-1: row j - 1 has no tokens, uncovered)
    for j in range(1, n + 1):
        if not sizes[j - 1]:  # segments end at a row with tokens
            best[j], cut[j] = best[j - 1], -1
            continue
        q_len = kv_len = 0
        for i in range(j - 1, -1, -1):  # the segment [i, j), widened one row at a time
            if sizes[i]:
                q_len, kv_len = max(q_len, sizes[i]), max(kv_len, ends[i])
            cost = best[i] + overhead + (j - i) * kv_len * (q_len + EXTRA_QUERIES)
            if cost < best[j]:
                best[j], cut[j] = cost, i
    segments, j = [], n
    while j > 0:
        if cut[j] < 0:
            j -= 1
        else:
            segments.append((cut[j], j))
            j = cut[j]
    return segments[::-1]


def _can_pad(cache: SlotKVCache, sizes: list[int], parents: list[list[int] | None], rows: slice, solo: tuple[int, ...]) -> bool:
    """Whether :func:`_pack_padded` can take this step, its real tokens placed: no solo rows (a
    prompt chunk's KV would share positions with its row's pads), a masked shared group
    (chains through the varlen kernel need no gather anyway), and every slot of the window in
    the pool with room for its pads at its current capacity: pads never grow memory."""
    if solo or not any(sizes) or (cache.varlen is not None and all(p is None for p in parents)):
        return False
    q_len = max(sizes)
    return all(slot not in cache._own and cache.lengths[slot] + q_len <= cache._capacity
               for slot in range(rows.start, rows.stop))

def _pack_padded(cache: SlotKVCache, tokens: list[list[int]], sizes: list[int], parents: list[list[int] | None], rows: slice,
                 dtype: torch.dtype, device: torch.device | str, lengths: list[int] | None = None,
                 q_len: int | None = None, kv_len: int | None = None) -> PackedRows:
    """:func:`pack` with every window row padded to the longest: row ``r``'s ``q_len`` tokens
    are its own, then pads (its last token repeated; 0 in an idle row), all written at its
    committed length on, so the pads' entries lie past it and no commit keeps them. One
    attention group whose queries are the forward's tokens as they are: no gather, no
    scatter, which a launch-bound device pays per layer; the linear layers see the pads,
    which a compute-bound one pays. The padded reference forward (:meth:`SlotKVCache.prepare`) on a
    ``[1, rows x q_len]`` layout: the same keys under the same mask for every real query.
    :func:`pack_static` sets ``lengths`` (slots past the last one count as empty), ``q_len``
    and ``kv_len`` itself."""
    lengths = cache.lengths[rows] if lengths is None else lengths
    q_len = max(sizes) if q_len is None else q_len
    width = len(tokens)
    # Keys up to the longest row's last real token, as in pack(): no query is masked whole (a
    # pad sees its row's prefix, or, in a row with none, its own position, below q_len <= kv_len)
    if kv_len is None:
        kv_len = key_span(max(lengths[r] + sizes[r] for r in range(width) if sizes[r]), cache._capacity)
    mask, positions = build_attention(lengths, parents, q_len, kv_len, dtype, device)
    ids = [t + [t[-1] if t else 0] * (q_len - len(t)) for t in tokens]
    cache._rows = rows
    cache._pool_tokens, cache._own_writes = None, []
    cache._write_rows, cache._write_pos = (t.view(1, -1) for t in window_writes(lengths, rows.start, q_len))
    cache._kv_len = kv_len
    total = width * q_len
    group = AttentionGroup(slice(0, width), q_len, kv_len, mask, slice(0, total), None, None, slice(0, total))
    return PackedRows(torch.tensor(ids, dtype=torch.long).view(1, -1).to(device), positions.reshape(1, -1),
                      (group,), [r * q_len for r in range(width)], sizes, max(sizes), total, cache)

def pack_static(cache: SlotKVCache, tokens: list[list[int]], parents: list[list[int] | None], rows: slice, dtype: torch.dtype,
                device: torch.device | str, width: int, q_len: int, kv_len: int) -> PackedRows | None:
    """:func:`pack` for a step of fixed shapes, as a CUDA graph replays it
    (:mod:`goodspeed.lm.runtime.graphs`): :func:`_pack_padded`'s layout over the window ``[0, width)``
    (``rows`` inside it, every other slot idle), ``q_len`` queries a row and ``kv_len`` keys, so
    the forward's shapes are ``(width, q_len, kv_len)`` whatever its rows bring. Pads are
    written past each slot's committed length, as in :func:`_pack_padded`; a window row past
    the last slot is a pool row no slot holds yet.

    None, with the pool sized for the step, where the step does not fit: a slot of the window
    with KV buffers of its own, one whose committed entries and ``q_len`` more exceed
    ``kv_len``, a ``kv_len`` over the pool's capacity, or no pool yet (the first forward makes
    it). No prompt chunks: callers pack those with :func:`pack`."""
    sizes = [len(t) for t in tokens]
    if rows.stop > width or not any(sizes) or max(sizes) > q_len:
        raise ValueError(f"a static step of {width} rows x {q_len} queries cannot take rows {rows.start}..{rows.stop - 1} "
                         f"of up to {max(sizes, default=0)} tokens")
    cache._place({rows.start + r: cache.lengths[rows.start + r] + n for r, n in enumerate(sizes) if n})
    if any(slot in cache._own for slot in range(min(width, cache.num_slots))) or not cache._static_room(width, q_len, kv_len):
        return None
    full: list[list[int]] = [[] for _ in range(width)]
    tree: list[list[int] | None] = [None] * width
    full[rows], tree[rows] = tokens, parents
    return _pack_padded(cache, full, [len(t) for t in full], tree, slice(0, width), dtype, device,
                             cache.window_lengths(width), q_len, kv_len)


def window_writes(lengths: list[int], first: int, q_len: int, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a padded forward over the window of slots ``first, first + 1, ...`` (committed
    ``lengths``) writes its ``q_len`` entries a row: slots and positions ``[rows, q_len]``, each row's
    at its committed length plus ``offset`` (in numpy, handed to torch without a copy: no torch op
    dispatched for host-side indices)."""
    pos = np.asarray(lengths, dtype=np.int64)[:, None] + (offset + np.arange(q_len, dtype=np.int64))
    slots = np.repeat(np.arange(first, first + len(lengths), dtype=np.int64)[:, None], q_len, axis=1)
    return torch.from_numpy(slots), torch.from_numpy(pos)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``[rows, q_len, kv_len]`` bool -> the additive ``[rows, 1, q_len, kv_len]`` mask (0 / finfo.min)
    attention takes: a bool 4-D mask is silently wrong under eager attention. Built on ``device``
    (``allowed``, a quarter of its bytes, is what is copied there), in
    :func:`~goodspeed.lm.runtime.attention.aligned_mask` storage."""
    mask = aligned_mask(allowed.shape[0], 1, allowed.shape[1], allowed.shape[2], dtype, device).zero_()
    mask.masked_fill_(~allowed.to(device).unsqueeze(1), torch.finfo(dtype).min)
    return mask


def ancestor_matrices(trees: list[list[int]], size: int) -> np.ndarray:
    """``[len(trees), size, size]`` bool: ``anc[t, j, i]`` when tree ``t``'s new token ``i`` is
    ``j`` or one of its ancestors.

    ``trees[t][j]`` indexes the row's new tokens (-1: the committed prefix); rows past
    ``len(trees[t])`` (padding) see only themselves. Built in numpy: per-node updates on arrays this
    small cost a microsecond there and several as torch ops.
    """
    anc = np.zeros((len(trees), size, size), dtype=bool)
    diag = np.arange(size)
    anc[:, diag, diag] = True
    for t, parents in enumerate(trees):
        for j, parent in enumerate(parents):
            if parent >= 0:
                anc[t, j] |= anc[t, parent]
    return anc


def build_attention(
    lengths: list[int],
    parents: list[list[int] | None],
    q_len: int,
    kv_len: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Additive mask ``[num_slots, 1, q_len, kv_len]`` and position ids ``[num_slots, q_len]``.

    A row with ``parents=None`` is a chain (causal over its new tokens); otherwise its new tokens
    form a tree: each sees the committed prefix and its own ancestors, at position
    ``length + depth``. Padding queries are causal too; their outputs are ignored and the
    entries they write lie beyond the committed length.
    """
    base = torch.tensor(lengths, dtype=torch.long).view(-1, 1, 1).to(device)  # the only host -> device copy for chains
    key = torch.arange(kv_len, device=device).view(1, 1, -1)
    query = torch.arange(q_len, device=device).view(1, -1, 1)
    allowed = key <= base + query  # chains: causal with a per-row offset, built on the device
    positions = base.view(-1, 1) + torch.arange(q_len, device=device)
    trees = [row for row, tree in enumerate(parents) if tree is not None]
    if trees:  # built on the host (a few small array ops per tree), then one copy per tensor
        anc = ancestor_matrices([parents[row] for row in trees], q_len)  # [trees, q_len, q_len]
        starts = np.array([lengths[row] for row in trees])
        seen = np.broadcast_to(np.arange(kv_len) < starts[:, None, None], (len(trees), q_len, kv_len)).copy()
        for t, length in enumerate(starts.tolist()):
            width = min(q_len, kv_len - length)  # keys may stop at the row's last real token (packed groups)
            seen[t, :, length : length + width] |= anc[t, :, :width]
        index = torch.tensor(trees, device=device)
        allowed[index] = torch.from_numpy(seen).to(device)
        positions[index] = torch.from_numpy(starts[:, None] + anc.sum(axis=2) - 1).to(device)  # depth = number of ancestors
    return additive_mask(allowed, dtype, device), positions
