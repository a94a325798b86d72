"""A slotted KV cache: one slot (batch row) per session or request, each written at its own offset
(the verifier's target and every batched draft model use it).

docs/DESIGN.md, *A round costs O(new tokens)*: a round must cost O(new tokens), never O(prefix). Every layer keeps one
*pool* buffer ``[num_slots, kv_heads, capacity, head_dim]``; a forward over all slots writes row
``b``'s new keys at ``lengths[b] ..`` and hands attention a view of the buffer (no copy), while
an additive 4-D mask and explicit position ids keep each row to its own prefix. Rolling back
rejected positions is setting a length; a token tree's accepted path is moved onto consecutive
positions (a copy of at most a few entries, every row's in one op per buffer:
:meth:`SlotKVCache.commit_many`). Freeing a slot moves the last slot into the hole, so the live
slots are always ``0 .. num_slots - 1``.

KV memory per slot (packed forwards, :mod:`goodspeed.lm.runtime.packing`): the pool holds every slot at one
capacity, so a single long prompt would make every slot reserve its length, and each doubling
would copy every slot's KV. The pool's capacity therefore doubles only while *most* of its slots
need more than it holds; a slot that outgrows it on its own moves to a buffer of its own
(``[1, kv_heads, own capacity, head_dim]``, doubled as that slot grows, copying only that slot),
attended in its own SDPA call (:class:`~goodspeed.lm.runtime.packing.AttentionGroup` ``own``). When the pool grows past such a
slot's need, the slot moves back. So the pool's capacity stays within 2x what at least half its
slots need, each slot of its own within 2x its own need, and a long prompt's growth never copies
the other slots. The padded forwards (:meth:`SlotKVCache.prepare`: the reference path and the
batched draft models) keep every slot in the pool.

Chains of a packed forward may attend through a varlen kernel (:attr:`SlotKVCache.varlen`, set by
the engine on CUDA): such a group carries no mask, and the kernel reads the pool or a slot's own
buffers flattened in place (:meth:`SlotKVCache.flat_kv`).

A packed forward may instead lay its rows out padded, pads in the model's input, where the step
allows it (``pack(pad=True)``, ``EngineConfig.pad_rows``): attention then gathers and scatters
nothing, two ops a layer a launch-bound device pays for, and the linear layers see the pads.
:meth:`SlotKVCache.pack_static` lays a step out the same way at fixed shapes (a window from slot 0,
queries and keys rounded up by the caller), which is what a CUDA graph replays
(:mod:`goodspeed.lm.runtime.graphs`); :attr:`SlotKVCache.generation` tells it when the pool has moved.

Buffers are created under ``torch.inference_mode`` (the engine's forward), so every method that
moves entries runs in inference mode too. The object implements the two methods transformers' attention layers call on a cache
(``update`` and ``get_seq_length``), so any causal LM that takes a cache works (``cache=``, or
``past_key_values=`` before transformers 5.24: :func:`goodspeed.lm.runtime.attention.with_cache`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from goodspeed.lm.runtime import packing
from goodspeed.lm.runtime.attention import VarlenKernel
from goodspeed.lm.runtime.packing import PackedRows, window_writes


def _doubled(capacity: int, need: int) -> int:
    while capacity < need:
        capacity *= 2
    return capacity


@dataclass
class _OwnBuffer:
    """A slot's KV outside the pool: per layer ``[1, kv_heads, capacity, head_dim]`` (None until
    a forward creates the layer's)."""

    capacity: int
    keys: list
    values: list


class SlotKVCache:
    """Per-session target KV in shared per-layer buffers, grown by doubling; a slot far longer
    than the others in a buffer of its own (see the module docstring)."""

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
        self._own: dict[int, _OwnBuffer] = {}  # slot -> its buffers, for slots outside the pool
        self._pool_tokens: torch.Tensor | None = None  # packed tokens written to the pool (None: all of them)
        self._own_writes: list[tuple[int, slice, int]] = []  # (slot, packed tokens, first position) outside the pool
        # Packed forwards: the kernel groups of chains attend through, reading keys in place
        # (goodspeed.lm.runtime.attention.varlen_kernel_for; None: masked SDPA for every group).
        self.varlen: VarlenKernel | None = None
        # What one more attention group costs (goodspeed.lm.runtime.packing.split_rows; None: one
        # group for the shared rows), set by the model runner for its device.
        self.group_overhead: float | None = None
        # Bumped whenever a pool buffer is (re)allocated: what a captured step (goodspeed.lm.runtime.graphs)
        # read and wrote is then gone, and its graphs with it.
        self.generation = 0

    @property
    def capacity(self) -> int:
        """Positions the pool holds per slot (doubled while most of its slots need more)."""
        return self._capacity

    @property
    def own_slots(self) -> dict[int, int]:
        """Slots with buffers of their own -> the positions those hold."""
        return {slot: own.capacity for slot, own in self._own.items()}

    @property
    def reserved_positions(self) -> int:
        """KV positions allocated per layer (pool rows x capacity + every own buffer): the memory
        the cache holds, in units of one position's keys and values."""
        pool = next((buf for buf in list(self.keys) if buf is not None), None)
        rows = pool.shape[0] * pool.shape[2] if pool is not None else 0  # list(...): snapshots, read from any thread
        return rows + sum(own.capacity for own in list(self._own.values()) if any(b is not None for b in list(own.keys)))

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
        self._own.pop(slot, None)
        if slot != last:
            if last in self._own:  # its own buffers just change hands
                self._own[slot] = self._own.pop(last)
            else:
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
        while need < max((n for s, n in enumerate(self.lengths) if s not in self._own), default=0):
            need *= 2
        rows = self.num_slots
        if self._capacity < 4 * need and (rows or self._capacity == self._initial_capacity):
            return
        for which in (self.keys, self.values):
            for i, buf in enumerate(which):
                if buf is not None:
                    which[i] = buf[:rows, :, :need].clone() if rows else None
        self._capacity = need
        self.generation += 1

    def prepare(self, q_len: int, rows: slice, offset: int = 0) -> int:
        """Set up a forward over the slots ``rows`` (a contiguous window) that writes ``q_len``
        positions per slot at its committed length plus ``offset`` (scratch entries beyond the
        committed length, e.g. the draft's beam-search tree); returns the key length attention
        will see."""
        if self._own:
            raise RuntimeError("a padded forward cannot take slots with buffers of their own (those come from pack())")
        lengths = self.lengths[rows]
        self._rows = rows
        self._pool_tokens, self._own_writes = None, []
        self._write_rows, self._write_pos = window_writes(lengths, rows.start, q_len, offset)
        self._kv_len = max(lengths) + offset + q_len
        while self._kv_len > self._capacity:
            self._capacity *= 2
        return self._kv_len

    def pack(self, tokens: list[list[int]], parents: list[list[int] | None], rows: slice, dtype: torch.dtype,
             device: torch.device | str = "cpu", solo: tuple[int, ...] = (), pad: bool = False) -> PackedRows:
        """Set up a packed forward over the slots ``rows`` (:func:`goodspeed.lm.runtime.packing.pack`)."""
        return packing.pack(self, tokens, parents, rows, dtype, device, solo, pad)

    def pack_static(self, tokens: list[list[int]], parents: list[list[int] | None], rows: slice, dtype: torch.dtype,
                    device: torch.device | str, width: int, q_len: int, kv_len: int) -> PackedRows | None:
        """Set up a packed forward of fixed shapes (:func:`goodspeed.lm.runtime.packing.pack_static`)."""
        return packing.pack_static(self, tokens, parents, rows, dtype, device, width, q_len, kv_len)

    def prepare_static(self, q_len: int, width: int, offset: int, kv_len: int) -> bool:
        """:meth:`prepare` at fixed shapes, as a CUDA graph replays it (:mod:`goodspeed.lm.runtime.graphs`):
        a padded forward over the window ``[0, width)`` writing ``q_len`` positions per slot at its
        committed length plus ``offset``, attention reading ``kv_len`` keys. A window row past the
        last slot is a pool row no slot holds yet. False, with nothing set, where the forward does
        not fit: no pool yet (the first forward makes it), ``kv_len`` over the pool's capacity, or a
        slot whose entries and this forward's exceed ``kv_len``; the caller then runs
        :meth:`prepare` as usual."""
        if self._own:
            raise RuntimeError("a padded forward cannot take slots with buffers of their own (those come from pack())")
        if not self._static_room(width, offset + q_len, kv_len):
            return False
        self._rows = slice(0, width)
        self._pool_tokens, self._own_writes = None, []
        self._write_rows, self._write_pos = window_writes(self.window_lengths(width), 0, q_len, offset)
        self._kv_len = kv_len
        return True

    def window_lengths(self, width: int) -> list[int]:
        """Committed entries of the slots ``0 .. width - 1``, a row past the last slot counting as
        empty (the window of a step at fixed shapes)."""
        return self.lengths[:width] + [0] * max(0, width - self.num_slots)

    def _static_room(self, width: int, new: int, kv_len: int) -> bool:
        """Whether a forward at fixed shapes over ``[0, width)`` can write ``new`` entries past every
        slot's committed ones within ``kv_len`` keys of the pool as it is (made, ``kv_len`` within
        its capacity); if so, the pool is given ``width`` rows at its capacity (one reallocation
        at most, before any capture)."""
        bufs = (*self.keys, *self.values)
        if any(buf is None for buf in bufs) or kv_len > self._capacity or any(n + new > kv_len for n in self.lengths[:width]):
            return False
        if any(buf.shape[0] < width or buf.shape[2] < self._capacity for buf in bufs):
            self._resize_pool(width)
        return True

    def pending_writes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot rows and positions the next forward writes its new keys and values at (one
        each per token of its layout), as the last :meth:`pack` or :meth:`pack_static` set them."""
        return self._write_rows, self._write_pos

    def use_writes(self, write_rows: torch.Tensor, write_pos: torch.Tensor) -> None:
        """Make the next forward write its new keys and values through these index tensors (a
        captured step's static copies of those :meth:`pack_static` made: equal values, fixed
        addresses)."""
        self._write_rows, self._write_pos = write_rows, write_pos

    def flat_kv(self, layer: int, own: int | None = None) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """``layer``'s keys and values flattened to ``[positions, 1, head_dim]`` (views, no copy),
        with their key heads and capacity: the pool (slot ``s``'s head ``h`` holds positions from
        ``(s * kv_heads + h) * capacity``) or ``own``'s buffers (slot 0). What a
        :class:`~goodspeed.lm.runtime.attention.VarlenKernel` reads."""
        keys, values = (self.keys[layer], self.values[layer]) if own is None else (self._own[own].keys[layer],
                                                                                    self._own[own].values[layer])
        _, kv_heads, capacity, dim = keys.shape
        return keys.view(-1, 1, dim), values.view(-1, 1, dim), kv_heads, capacity

    # --------------------------------------------------------------- where each slot's KV lives

    def _place(self, needs: dict[int, int]) -> None:
        """Before a packed forward: size the pool and the own buffers for ``needs`` (slot ->
        positions it will hold after this forward). The pool doubles while most of its slots need
        more than it holds (a single slot: always); a slot that still does not fit gets a buffer of
        its own; own buffers double as their slot needs; the pool takes back slots it now fits."""
        def need(slot: int) -> int:
            return max(self.lengths[slot], needs.get(slot, 0))

        pooled = [s for s in range(self.num_slots) if s not in self._own]
        capacity = self._capacity
        while 2 * sum(need(s) > capacity for s in pooled) > len(pooled):
            capacity *= 2
        if capacity != self._capacity:
            self._capacity = capacity
            self._resize_pool(self.num_slots)
            for slot in [s for s in self._own if need(s) <= capacity]:
                self._rehome(slot)
        for slot in pooled:
            if need(slot) > capacity:
                self._own[slot] = _OwnBuffer(_doubled(capacity, need(slot)), [None] * self.num_layers, [None] * self.num_layers)
                self._fill_own(slot, self.keys, self.values, pool=True)
        for slot, own in self._own.items():
            if need(slot) > own.capacity:
                own.capacity = _doubled(own.capacity, need(slot))
                self._fill_own(slot, own.keys, own.values, pool=False)

    @torch.inference_mode()
    def _fill_own(self, slot: int, keys: list, values: list, pool: bool) -> None:
        """(Re)allocate ``slot``'s own buffers at its capacity, copying its committed entries from
        ``keys``/``values`` (the pool's rows, or its previous own buffers)."""
        own, length = self._own[slot], self.lengths[slot]
        for source, target in ((keys, own.keys), (values, own.values)):
            for layer, buf in enumerate(source):
                if buf is None:
                    continue
                grown = buf.new_zeros((1, buf.shape[1], own.capacity, buf.shape[3]))
                if length:  # a new slot (nothing committed yet) may have no pool row so far
                    grown[0, :, :length] = buf[slot, :, :length] if pool else buf[0, :, :length]
                target[layer] = grown

    @torch.inference_mode()
    def _rehome(self, slot: int) -> None:
        """Move ``slot``'s committed entries from its own buffers back into the pool."""
        own, length = self._own.pop(slot), self.lengths[slot]
        for source, pool in ((own.keys, self.keys), (own.values, self.values)):
            for layer, buf in enumerate(source):
                if buf is not None and pool[layer] is not None:
                    pool[layer][slot, :, :length] = buf[0, :, :length]

    @torch.inference_mode()
    def _resize_pool(self, slots: int) -> None:
        """Grow every existing pool buffer to ``slots`` rows (at least) and the pool's capacity now."""
        for which in (self.keys, self.values):
            for layer, buf in enumerate(which):
                if buf is not None:
                    which[layer] = self._grown(buf, slots)

    def _grown(self, buf: torch.Tensor, slots: int) -> torch.Tensor:
        self.generation += 1
        have = buf.shape[0]
        rows = have if slots <= have else max(slots, 2 * have)
        grown = buf.new_zeros((rows, buf.shape[1], self._capacity, buf.shape[3]))
        grown[:have, :, : buf.shape[2]] = buf  # scratch entries too (the draft models' beam trees read them)
        return grown

    def committed_kv(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``slot``'s committed keys and values ``[kv_heads, length, head_dim]``, wherever they live."""
        own, length = self._own.get(slot), self.lengths[slot]
        if own is not None:
            return own.keys[layer][0, :, :length], own.values[layer][0, :, :length]
        return self.keys[layer][slot, :, :length], self.values[layer][slot, :, :length]

    def own_view(self, layer: int, slot: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``slot``'s own keys and values ``[1, kv_heads, kv_len, head_dim]`` (what attention reads
        for a group whose ``own`` is that slot)."""
        own = self._own[slot]
        return own.keys[layer][:, :, :kv_len], own.values[layer][:, :, :kv_len]

    def _buffer(self, layer: int, like: torch.Tensor, which: list, slots: int) -> torch.Tensor:
        buf = which[layer]
        if buf is None:
            _, heads, _, dim = like.shape
            which[layer] = buf = like.new_zeros((slots, heads, self._capacity, dim))
            self.generation += 1
        elif buf.shape[0] < slots or buf.shape[2] < self._capacity:
            which[layer] = buf = self._grown(buf, slots)
        return buf

    def _own_buffer(self, layer: int, slot: int, like: torch.Tensor, which: str) -> torch.Tensor:
        own = self._own[slot]
        bufs = getattr(own, which)
        if bufs[layer] is None:  # the slot's first forward since the cache was made
            bufs[layer] = like.new_zeros((1, like.shape[1], own.capacity, like.shape[3]))
        return bufs[layer]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write ``[num_slots, heads, q_len, dim]`` new keys/values (packed: ``[1, heads, T, dim]``);
        return views of the pool's keys/values ``[num_slots, heads, kv_len, dim]`` for attention
        (own buffers are read through :meth:`own_view`)."""
        if self._write_pos is None:
            raise RuntimeError("SlotKVCache.prepare() must run before a forward")
        start, stop = self._rows.start, self._rows.stop
        if self._write_pos.device != key_states.device:  # once per forward, not per layer
            self._write_pos, self._write_rows = self._write_pos.to(key_states.device), self._write_rows.to(key_states.device)
            if self._pool_tokens is not None:
                self._pool_tokens = self._pool_tokens.to(key_states.device)
        out = []
        for states, which, name in ((key_states, self.keys, "keys"), (value_states, self.values, "values")):
            buf = self._buffer(layer_idx, states, which, stop)
            pooled = states if self._pool_tokens is None else states.index_select(2, self._pool_tokens)
            buf[self._write_rows, :, self._write_pos] = pooled.transpose(1, 2)
            for slot, span, first in self._own_writes:
                self._own_buffer(layer_idx, slot, states, name)[0, :, first : first + span.stop - span.start] = states[0, :, span]
            out.append(buf[start:stop, :, : self._kv_len])
        return out[0], out[1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.lengths) if self.lengths else 0

    def commit(self, slot: int, base: int, kept: list[int]) -> None:
        """Keep, as committed entries ``base, base + 1, ...``, the entries this forward wrote at
        offsets ``kept`` (ascending, relative to ``base``) and drop the rest of the forward."""
        self.commit_many([(slot, base, kept)])

    @torch.inference_mode()
    def commit_many(self, commits: list[tuple[int, int, list[int]]],
                    mover: Callable[[list[tuple[int, int, int]]], None] | None = None) -> None:
        """:meth:`commit` for several ``(slot, base, kept)`` at once: every pool slot's moves (a tree
        row whose accepted path is not its first nodes) go in one gather and one scatter per layer's
        keys and values, with one host -> device copy of their indices, whatever the number of rows.
        Row by row, a step of trees cost a few ops per layer per row that moved, which is what a
        launch-bound GPU pays for (docs/MEASUREMENTS.md, *Tree rows' KV moves*). A slot with buffers
        of its own moves in them, on its own. ``mover``: what makes the pool's moves, given as
        ``(slot, dst, src)`` positions (:meth:`goodspeed.lm.runtime.graphs.StepGraphs.move` replays them as
        a CUDA graph); default :meth:`move_pooled` on their indices."""
        pooled: list[tuple[int, int, int]] = []  # (slot, dst, src) positions
        for slot, base, kept in commits:
            moves = [(base + d, base + s) for d, s in enumerate(kept) if d != s]
            if moves and slot in self._own:
                own = self._own[slot]
                dst, src = torch.tensor([m[0] for m in moves]), torch.tensor([m[1] for m in moves])
                for buf in (*own.keys, *own.values):
                    if buf is not None:
                        buf[0, :, dst.to(buf.device)] = buf[0, :, src.to(buf.device)]
            else:
                pooled += [(slot, d, s) for d, s in moves]
        if pooled and self.keys[0] is not None:
            if mover is not None:
                mover(pooled)
            else:
                self.move_pooled(torch.tensor(pooled, dtype=torch.long).T.to(self.keys[0].device))
        for slot, base, kept in commits:
            self.lengths[slot] = base + len(kept)

    def move_pooled(self, index: torch.Tensor) -> None:
        """Copy every layer's pool entries ``(index[0], index[2])`` to ``(index[0], index[1])``
        (slots, destination and source positions; ``[3, N]`` on the pool's device): one gather and one
        scatter per layer's keys and values, every source read before any destination is written. A
        move listed twice writes the same entry twice (how :meth:`StepGraphs.move
        <goodspeed.lm.runtime.graphs.StepGraphs.move>` pads a list to a graph's size)."""
        for buf in (*self.keys, *self.values):
            if buf is not None:
                buf[index[0], :, index[1]] = buf[index[0], :, index[2]]

    def truncate(self, slot: int, length: int) -> None:
        """Roll ``slot`` back to its first ``length`` committed entries."""
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot truncate slot {slot} of length {self.lengths[slot]} to {length}")
        self.lengths[slot] = length


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
