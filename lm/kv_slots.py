"""A slotted KV cache: one slot (batch row) per session or request, each written at its own offset
(the verifier's target and every batched draft model use it).

DESIGN.md section 6: a round must cost O(new tokens), never O(prefix). Every layer keeps one
buffer ``[num_slots, kv_heads, capacity, head_dim]``; a forward over all slots writes row ``b``'s
new keys at ``lengths[b] ..`` and hands attention a view of the buffer (no copy), while an
additive 4-D mask and explicit position ids keep each row to its own prefix. Rolling back
rejected positions is setting a length; a token tree's accepted path is moved onto consecutive
positions (a copy of at most a few entries). Freeing a slot moves the last slot into the hole,
so the live slots are always ``0 .. num_slots - 1``.

Buffers are created under ``torch.inference_mode`` (the engine's forward), so every method that
moves entries runs in inference mode too. The object implements the two methods transformers' attention layers call on a cache
(``update`` and ``get_seq_length``), so any causal LM that accepts ``past_key_values`` works.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class SlotKVCache:
    """Per-session target KV in shared per-layer buffers, grown by doubling."""

    def __init__(self, num_layers: int, initial_capacity: int = 256) -> None:
        self.num_layers = num_layers
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.lengths: list[int] = []  # committed KV entries per slot
        self._initial_capacity = initial_capacity
        self._capacity = initial_capacity
        self._write_pos: torch.Tensor | None = None  # [window_slots, q_len] positions of this forward
        self._rows = slice(0, 0)
        self._kv_len = 0

    @property
    def capacity(self) -> int:
        """Positions every slot's buffers hold (the longest slot's need, doubled as it grows)."""
        return self._capacity

    @property
    def num_slots(self) -> int:
        return len(self.lengths)

    def add_slot(self) -> int:
        self.lengths.append(0)
        return self.num_slots - 1

    @torch.inference_mode()
    def free_slot(self, slot: int) -> int | None:
        """Drop ``slot``; returns the index of the slot moved into its place (or None)."""
        last = self.num_slots - 1
        moved = None
        if slot != last:
            for buf in (*self.keys, *self.values):
                if buf is not None and buf.shape[0] > last:
                    buf[slot, :, : self.lengths[last]] = buf[last, :, : self.lengths[last]]
            self.lengths[slot] = self.lengths[last]
            moved = last
        self.lengths.pop()
        self._release_unused()
        return moved

    def _release_unused(self) -> None:
        """Give memory back once the buffers are 4x longer than the slots left need (hysteresis,
        so a steady load never reallocates; rows are bounded by the session limit and kept): one
        long prompt must not hold its KV-sized buffers after its session has left."""
        need = self._initial_capacity
        while need < max(self.lengths, default=0):
            need *= 2
        rows = self.num_slots
        if self._capacity < 4 * need and (rows or self._capacity == self._initial_capacity):
            return
        for which in (self.keys, self.values):
            for i, buf in enumerate(which):
                if buf is not None:
                    which[i] = buf[:rows, :, :need].clone() if rows else None
        self._capacity = need

    def prepare(self, q_len: int, rows: slice, offset: int = 0) -> int:
        """Set up a forward over the slots ``rows`` (a contiguous window) that writes ``q_len``
        positions per slot at its committed length plus ``offset`` (scratch entries beyond the
        committed length, e.g. the draft's beam-search tree); returns the key length attention
        will see."""
        lengths = self.lengths[rows]
        self._rows = rows
        self._write_pos = torch.tensor(lengths, dtype=torch.long).unsqueeze(1) + offset + torch.arange(q_len)
        self._write_rows = torch.arange(rows.start, rows.stop).unsqueeze(1).expand_as(self._write_pos)
        self._kv_len = max(lengths) + offset + q_len
        while self._kv_len > self._capacity:
            self._capacity *= 2
        return self._kv_len

    def pack(self, tokens: list[list[int]], parents: list[list[int] | None], rows: slice, dtype: torch.dtype,
             device: torch.device | str = "cpu", solo: tuple[int, ...] = ()) -> PackedRows:
        """Set up a *packed* forward over the slots ``rows``: row ``r`` brings ``tokens[r]`` (any
        number, 0 for an idle slot inside the window), written at its committed length. The model
        sees only the real tokens (``[1, T]``, no padding); attention (:mod:`goodspeed.lm.attention`)
        runs per :class:`AttentionGroup`, gathering its rows' queries into a padded layout and
        scattering the outputs back.

        ``solo``: rows attended on their own (a prompt chunk: hundreds of tokens that would pad
        every short verification row to their length); the others share one group. Solo rows come
        first in the packed order, so the others' tokens are the last ``PackedRows.keep`` (the
        only ones whose logits anyone reads)."""
        lengths, sizes = self.lengths[rows], [len(t) for t in tokens]
        alone = sorted(set(solo))
        shared = [r for r in range(len(tokens)) if r not in alone]
        order = alone + shared
        starts, total = [0] * len(tokens), 0
        for r in order:
            starts[r], total = total, total + sizes[r]
        q_len = max((sizes[r] for r in shared), default=0)
        keep = sum(sizes[r] for r in shared)
        self._rows = rows
        self._write_rows = torch.tensor([rows.start + r for r in order for _ in range(sizes[r])], dtype=torch.long).unsqueeze(0)
        self._write_pos = torch.tensor([lengths[r] + i for r in order for i in range(sizes[r])], dtype=torch.long).unsqueeze(0)
        ids = torch.tensor([tok for r in order for tok in tokens[r]], dtype=torch.long).unsqueeze(0).to(device)
        positions = self._write_pos.clone()  # chains; tree rows get their depths below
        groups = []
        for r in alone:
            n, length = sizes[r], lengths[r]
            mask, pos = build_attention([length], [parents[r]], n, length + n, dtype, device)
            span = slice(starts[r], starts[r] + n)
            positions[0, span] = pos[0].cpu()
            groups.append(AttentionGroup(slice(r, r + 1), n, length + n, mask, span, None, None, span))
        if q_len:
            # Keys up to the longest row with tokens here: a solo or idle row's pads attend to what is
            # there (their outputs are dropped), so a long prompt's slot does not widen everyone's attention.
            kv_len = max(lengths[r] + q_len for r in shared if sizes[r])
            mask, pos = build_attention(lengths, [None if r in alone else parents[r] for r in range(len(tokens))],
                                        q_len, kv_len, dtype, device)
            real = torch.arange(q_len) < torch.tensor([0 if r in alone else sizes[r] for r in range(len(tokens))]).unsqueeze(1)
            span = slice(total - keep, total)
            if bool(real.all()):  # every row is q_len long: the packed order is the padded one
                positions[0, span] = pos.reshape(-1).cpu()
                groups.append(AttentionGroup(slice(0, len(tokens)), q_len, kv_len, mask, span, None, None, span))
            else:
                scatter = real.view(-1).nonzero().view(-1)  # padded index of each real token, in row order
                gather = torch.zeros(len(tokens) * q_len, dtype=torch.long)
                gather[scatter] = torch.arange(total - keep, total)  # packed index of each padded query (pads: token 0)
                positions[0, span] = pos.reshape(-1).cpu()[scatter]
                groups.append(AttentionGroup(slice(0, len(tokens)), q_len, kv_len, mask, None, gather.to(device),
                                             scatter.to(device), span))
        self._kv_len = max(g.kv_len for g in groups)
        while self._kv_len > self._capacity:
            self._capacity *= 2
        return PackedRows(ids, positions.to(device), tuple(groups), starts, sizes, q_len, keep)

    def _buffer(self, layer: int, like: torch.Tensor, which: list, slots: int) -> torch.Tensor:
        buf = which[layer]
        _, heads, _, dim = like.shape
        if buf is None or buf.shape[0] < slots or buf.shape[2] < self._capacity:
            have = buf.shape[0] if buf is not None else 0
            rows = have if slots <= have else max(slots, 2 * have)
            grown = like.new_zeros((rows, heads, self._capacity, dim))
            if buf is not None:
                grown[: buf.shape[0], :, : buf.shape[2]] = buf
            which[layer] = buf = grown
        return buf

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write ``[num_slots, heads, q_len, dim]`` new keys/values; return views of all keys/values
        ``[num_slots, heads, kv_len, dim]`` for attention."""
        if self._write_pos is None:
            raise RuntimeError("SlotKVCache.prepare() must run before a forward")
        start, stop = self._rows.start, self._rows.stop
        if self._write_pos.device != key_states.device:  # once per forward, not per layer
            self._write_pos, self._write_rows = self._write_pos.to(key_states.device), self._write_rows.to(key_states.device)
        out = []
        for states, which in ((key_states, self.keys), (value_states, self.values)):
            buf = self._buffer(layer_idx, states, which, stop)
            buf[self._write_rows, :, self._write_pos] = states.transpose(1, 2)
            out.append(buf[start:stop, :, : self._kv_len])
        return out[0], out[1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.lengths) if self.lengths else 0

    @torch.inference_mode()
    def commit(self, slot: int, base: int, kept: list[int]) -> None:
        """Keep, as committed entries ``base, base + 1, ...``, the entries this forward wrote at
        offsets ``kept`` (ascending, relative to ``base``) and drop the rest of the forward."""
        moves = [(dst, src) for dst, src in enumerate(kept) if dst != src]
        if moves:
            dst = torch.tensor([base + d for d, _ in moves])
            src = torch.tensor([base + s for _, s in moves])
            for buf in (*self.keys, *self.values):
                if buf is not None:
                    buf[slot, :, dst.to(buf.device)] = buf[slot, :, src.to(buf.device)]
        self.lengths[slot] = base + len(kept)

    def truncate(self, slot: int, length: int) -> None:
        """Roll ``slot`` back to its first ``length`` committed entries."""
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot truncate slot {slot} of length {self.lengths[slot]} to {length}")
        self.lengths[slot] = length


@dataclass(frozen=True)
class AttentionGroup:
    """Window rows whose queries attend in one SDPA call, padded to the group's longest row."""

    rows: slice  # window rows: their KV views are the keys
    q_len: int
    kv_len: int
    mask: torch.Tensor  # [rows, 1, q_len, kv_len] additive
    tokens: slice | None  # no pads: the packed tokens, already in the padded order
    gather: torch.Tensor | None  # [rows * q_len]: the packed token of each padded query (pads: token 0)
    scatter: torch.Tensor | None  # the padded query of each real token (None: no pads)
    dest: slice  # the packed tokens the group's real queries answer for, in row order


@dataclass(frozen=True)
class PackedRows:
    """One packed forward over a window of slots (:meth:`SlotKVCache.pack`): ``T`` real tokens."""

    input_ids: torch.Tensor  # [1, T]: solo rows, then the others, row after row
    position_ids: torch.Tensor  # [1, T]
    groups: tuple[AttentionGroup, ...]
    starts: list[int]  # row r's tokens are input_ids[0, starts[r] : starts[r] + sizes[r]]
    sizes: list[int]
    q_len: int  # the longest non-solo row
    keep: int  # the non-solo rows' tokens: the last ``keep`` of the forward, the ones with logits

    @property
    def mask(self) -> torch.Tensor:
        """The non-solo rows' mask (what a caller passes as ``attention_mask``; attention reads the groups)."""
        return self.groups[-1].mask

    def padded(self, packed: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """``[1, T', ...]`` per-token values (e.g. logits) of the last ``T'`` tokens (all of them,
        or the ``keep`` non-solo ones) -> ``[len(rows), q_len, ...]`` for the non-solo window rows
        ``rows``; pad positions repeat the row's last token."""
        offset = self.input_ids.shape[1] - packed.shape[1]
        first = torch.tensor([self.starts[r] - offset for r in rows]).unsqueeze(1)
        last = torch.tensor([self.starts[r] + self.sizes[r] - 1 - offset for r in rows]).unsqueeze(1)
        return packed[0, torch.minimum(first + torch.arange(self.q_len), last).to(packed.device)]


class SlotTable:
    """Keys (session or request ids) over a :class:`SlotKVCache`'s slots. Freeing a slot moves the
    last one into the hole, so ``keys`` (in slot order) and ``slot(key)`` follow that move."""

    def __init__(self, cache: SlotKVCache) -> None:
        self.cache = cache
        self._slot_of: dict[str, int] = {}
        self.keys: list[str] = []  # keys[slot]

    def __contains__(self, key: str) -> bool:
        return key in self._slot_of

    def slot(self, key: str) -> int:
        return self._slot_of[key]

    def add(self, key: str) -> int:
        if key in self._slot_of:
            raise ValueError(f"{key!r} already has a slot")
        self._slot_of[key] = slot = self.cache.add_slot()
        self.keys.append(key)
        return slot

    def remove(self, key: str) -> None:
        slot = self._slot_of.pop(key)
        moved = self.cache.free_slot(slot)
        if moved is not None:
            self.keys[slot] = self.keys[moved]
            self._slot_of[self.keys[slot]] = slot
        self.keys.pop()


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``[rows, q_len, kv_len]`` bool -> the additive ``[rows, 1, q_len, kv_len]`` mask (0 / finfo.min)
    attention takes: a bool 4-D mask is silently wrong under eager attention. Built where
    ``allowed`` lives, then moved (a no-op when it is already on ``device``)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.unsqueeze(1).to(device)


def ancestor_matrix(parents: list[int], size: int) -> torch.Tensor:
    """``[size, size]`` bool: ``anc[j, i]`` when new token ``i`` is ``j`` or one of its ancestors.

    ``parents[j]`` indexes the row's new tokens (-1: the committed prefix); rows past
    ``len(parents)`` (padding) see only themselves.
    """
    anc = torch.eye(size, dtype=torch.bool)
    for j, parent in enumerate(parents):
        if parent >= 0:
            anc[j] |= anc[parent]
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
    for row, tree in enumerate(parents):
        if tree is None:
            continue
        anc = ancestor_matrix(tree, q_len).to(device)  # [q_len, q_len]
        length = lengths[row]
        allowed[row] = key[0] < length
        allowed[row, :, length : length + q_len] |= anc
        positions[row] = length + anc.sum(dim=1) - 1  # depth = number of ancestors
    return additive_mask(allowed, dtype, device), positions
