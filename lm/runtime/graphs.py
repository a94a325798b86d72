"""CUDA graphs of the verification engine's steps: a step's target forward replayed in one launch
instead of dispatched op by op (``EngineConfig.cuda_graphs``, ``goodspeed verifier --cuda-graphs``),
and of a batched draft model's forwards (:class:`goodspeed.lm.runtime.batch_draft.BatchDraftModel`: local
serving's draft under the same flag, and an edge node's drafting, one request at a time through
:class:`goodspeed.drafter.runner.DraftRunner` or batched, under ``goodspeed drafter --cuda-graphs``).

Why. On a GPU a small target's forward is bound by launching kernels from eager PyTorch, not by
the GPU's arithmetic or memory: SmolLM2-135M's step dispatches about 1,100 aten ops and took
20-33 ms on an H100 and an H200 in fp32 (docs/MEASUREMENTS.md, *Local serving on a GPU* and *Tree
rows' KV moves*), for about a millisecond of GPU work. A CUDA graph records a step's kernels once
and replays them all in one launch, as vLLM and SGLang do for their decoding steps. It also takes
away what a tree step costs over a chain there (its mask, its gather and scatter): a replay costs
the same whatever ops it holds.

What a graph needs is fixed shapes and fixed addresses. A step is laid out as
:meth:`SlotKVCache.pack_static <goodspeed.lm.runtime.kv_slots.SlotKVCache.pack_static>` makes it: every row
padded to ``Q`` queries, pads in the model's input, one masked attention group (no gather, no
scatter), over the slot window ``[0, W)``, with ``K`` keys. ``W`` and ``Q`` are the step's rows and
longest row rounded up to powers of two (vLLM's batch-size buckets), ``K`` its longest slot after
the step rounded the same way (at most the pool's capacity), so a handful of graphs serve every
step, and attention reads at most twice the keys it needs. A draft model's padded forward is laid
out the same way by :meth:`SlotKVCache.prepare_static
<goodspeed.lm.runtime.kv_slots.SlotKVCache.prepare_static>` (``[W, Q]`` inputs, its beam search's scratch
entries included in ``K``). Per shape ``(W, Q, K)``, :class:`StepGraphs` keeps static input tensors
(token ids, positions, the additive mask, the rows and positions the KV is written at) and the
graph captured over them. A step copies its inputs in and replays; the graph writes the step's keys
and values into the pool in place and leaves the last hidden states in its output tensor. The LM
head runs after the replay, eagerly, on the rows' real tokens only (vLLM computes logits outside
its graphs too): a shape's graph then holds ``W x Q`` hidden states, not ``W x Q x V`` logits (311
MB at Qwen3's vocabulary of 151,936 in bf16 and 1,024 tokens), and the head's matmul, a small
model's largest, skips the pads. So a model takes graphs where its logits are its LM head over its
decoder's output (:func:`decoder_and_head`: Llama, Qwen2/3, Mistral and the demo models; not a
model that scales or caps its logits after the head). When the pool is reallocated (it grows, or
gives memory back: :attr:`SlotKVCache.generation`) the graphs, which hold its old addresses, are
dropped and captured again when their shapes come back.

A shape's first step runs eagerly, which warms it up, on the side stream its capture then uses.
The capture records the same forward without running it. The forward's first layer folds the mask
for grouped-query heads into a tensor the other layers reuse
(:func:`goodspeed.lm.runtime.attention.masked_attention`); that fold is cleared before every forward here,
so the graph records the fold itself, not the warm-up's folded mask.

Exact: a replay runs the eager forward's kernels on the same values, and that forward gives every
real query the same keys under the same mask as the packed one. Keys past a row's end and pads
are masked out, each adding exp(finfo.min - max) = 0, so the logits agree up to float rounding
(``tests/lm/runtime/test_graphs.py``). What would break a replay is a forward that syncs with the host, or
reads a tensor that is not a static input, a weight, the KV pool or its own result: the replay
would read the capture's stale values. The CPU tests run the forward under a dispatch mode that
fails on either.

The same fixed-shape steps can also run through the decoder compiled by ``torch.compile``
(``EngineConfig.torch_compile``, ``goodspeed verifier --torch-compile``; :func:`compiled`): inductor
fuses the layers' elementwise work (norms, rotary embeddings, activations, residuals) into a few
kernels, on any device. The fixed shapes keep the compiles few: a graph specialised to the first
shape, then one with the dimensions that changed symbolic. Dynamo specialises any size of 1 (its
0/1 specialisation), so a step of one row, over a pool of one slot, took graphs of their own whose
other sizes stayed fixed, and the first such step in serving stalled for a compile (local serving's
draft did, mid-trace). Compiled, rows are therefore padded to at least 2 (the pool then holds at
least 2 slots), and keys to at least :data:`~goodspeed.lm.runtime.attention.MASK_ALIGN`, so every static
mask is contiguous (a narrower one lies in wider rows, :func:`~goodspeed.lm.runtime.attention.aligned_mask`,
and dynamo guards the strides). Queries are not padded: one query a row (plain decoding, a chain's
draft step) takes a graph of its own, and padding it would double a compute-bound step's tokens.
The engine's warm-up (:meth:`~goodspeed.verifier.engine.VerificationEngine.warm_up_steps`) and the
draft model's (:meth:`~goodspeed.lm.runtime.batch_draft.BatchDraftModel.warm_up`) step both kinds as rows,
keys and the pool grow, which makes each size symbolic before serving, in a few graphs. With CUDA
graphs the capture records the compiled kernels. The logits agree with eager ones to float32
rounding, not exactly: transformers' Llama normalises and builds its rotary tables in float32
whatever the model's dtype, and fused kernels round those in another order
(``tests/lm/runtime/test_graphs.py``).

A step that does not fit runs eagerly, as without graphs: a prompt chunk (a row attended on its
own), a slot with KV buffers of its own, a slot without room for ``Q`` more entries at the pool's
capacity, more than :data:`MAX_GRAPH_TOKENS` tokens (``W x Q``) or :data:`MAX_GRAPH_QUERIES` queries a
row (a draft model's catch-up of a prompt), a step before the pool exists, a
step without logits (a whole prompt's prefill).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from goodspeed.lm.runtime.attention import MASK_ALIGN, PACKED, aligned_mask, with_cache
from goodspeed.lm.runtime.kv_slots import SlotKVCache
from goodspeed.lm.runtime.packing import AttentionGroup, PackedRows

# torch.compile: dynamo keeps this many compiled graphs of one forward before it runs new shapes
# uncompiled. Its default of 8 is shared by every model whose decoder has the same forward (a
# target and its draft); StepGraphs(torch_compile=True) raises it to this.
COMPILED_SHAPES = 64
MIN_GRAPH_MOVES = 8  # a step's KV moves are padded to a power of two at least this (StepGraphs.move)
MAX_GRAPH_TOKENS = 1024  # W x Q: larger steps run eagerly (their launches are a smaller share of their time)
# Q: a row of more queries is a prompt (a drafter's catch-up of a new or resynchronised request),
# run once at its size and compute-bound: eagerly, as vLLM runs prefills, not captured per length.
MAX_GRAPH_QUERIES = 64
# Config fields of causal LMs whose logits are more than the LM head's output (Gemma 2/3's soft
# cap, Cohere's scale, Granite's divisor): their graphs would have to hold the whole model.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def decoder_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``model``'s decoder (``model.model``, what a graph replays) and LM head (``model.lm_head``,
    run after it): a causal LM whose logits are ``lm_head(model(...).last_hidden_state)``. Raises
    ValueError, naming what is missing, for one that is not (or may not be)."""
    decoder, head = getattr(model, "model", None), getattr(model, "lm_head", None)
    name = type(model).__name__
    if not isinstance(decoder, torch.nn.Module) or not isinstance(head, torch.nn.Linear):
        raise ValueError(f"cuda_graphs needs a causal LM with a decoder (.model) and a linear LM head (.lm_head); "
                         f"{name} has {'no .model' if not isinstance(decoder, torch.nn.Module) else 'no linear .lm_head'}")
    transforms = [f for f in LOGIT_TRANSFORMS if getattr(model.config, f, None) is not None]
    if transforms:
        raise ValueError(f"cuda_graphs replays the decoder and runs the LM head after it; {name} transforms its logits "
                         f"after the head ({', '.join(transforms)})")
    return decoder, head


def cpp_compiler_missing() -> str | None:
    """Why inductor cannot build C++ here (what ``torch.compile`` needs on a CPU), or None."""
    from torch._inductor import cpp_builder

    try:
        cpp_builder.get_cpp_compiler()
    except Exception as exc:  # inductor's InvalidCxxCompiler
        return str(exc)
    return None


def compiled(decoder: torch.nn.Module) -> torch.nn.Module:
    """``decoder`` compiled by ``torch.compile`` with dynamo's automatic dynamic shapes: the first
    shape is compiled specialised, and a dimension seen at a second size is recompiled symbolic,
    so rows, queries and keys take a handful of graphs in all rather than one a shape
    (``tests/lm/runtime/test_graphs.py::test_compiled_steps_over_many_shapes_take_few_graphs``). Each
    compile happens on the forward that needs it, tens of seconds on a CPU; dynamo is allowed
    :data:`COMPILED_SHAPES` graphs. On a CPU inductor builds C++, so a machine without a C++
    compiler is refused here, not at the first step."""
    import torch._dynamo

    if next(decoder.parameters()).device.type == "cpu" and (why := cpp_compiler_missing()) is not None:
        raise ValueError(f"torch_compile on a CPU needs a C++ compiler for inductor ({why}); install one "
                         "(Debian: apt-get install g++) or run without --torch-compile")

    for limit in ("recompile_limit", "cache_size_limit"):  # the name since torch 2.7, and before it
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), COMPILED_SHAPES))
            break
    return torch.compile(decoder)


def bucket(n: int) -> int:
    """The power of two at or above ``n`` (1 for ``n <= 1``): the rows and queries a step is padded to."""
    return 1 << max(0, n - 1).bit_length()


@dataclass
class _Shape:
    """One shape's static inputs (the forward's, and the KV write indices) and its graph."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    mask: torch.Tensor  # [W, 1, Q, K] additive
    write_rows: torch.Tensor
    write_pos: torch.Tensor
    layout: PackedRows | None  # the engine's packed layout over these tensors; None: a batch forward
    graph: object = None  # torch.cuda.CUDAGraph once captured
    hidden: torch.Tensor | None = None  # the graph's output: last hidden states


@dataclass
class _Moves:
    """One size of a step's KV moves: their static ``[3, N]`` indices (slots, destinations,
    sources) and the graph of :meth:`SlotKVCache.move_pooled` over them."""

    index: torch.Tensor
    graph: object = None


class StepGraphs:
    """A model's forwards at fixed shapes as CUDA graphs, one per shape (see the module
    docstring): the engine's packed steps (:meth:`pack`, :meth:`logits`) and a draft model's
    batch forwards (:meth:`run` with ``[W, Q]`` inputs after :meth:`SlotKVCache.prepare_static
    <goodspeed.lm.runtime.kv_slots.SlotKVCache.prepare_static>`).

    ``capture=False`` runs each step eagerly over the same static inputs: the layout, the copies
    and the forward a graph would replay, with no graph. That is how the CPU tests check all of
    it but the capture; the engine and the draft model capture on CUDA only."""

    def __init__(self, model: torch.nn.Module, cache: SlotKVCache, capture: bool = True,
                 max_tokens: int = MAX_GRAPH_TOKENS, max_queries: int = MAX_GRAPH_QUERIES,
                 torch_compile: bool = False) -> None:
        """``capture``: record each shape as a CUDA graph (CUDA only; False: the static steps run
        eagerly). ``torch_compile``: the decoder compiled by ``torch.compile`` (inductor: fused
        kernels, a handful of graphs for every shape; :func:`compiled`), on any device; with ``capture`` the
        compiled kernels are what the graphs record (see the module docstring)."""
        self.decoder, self.head = decoder_and_head(model)
        self.torch_compile = torch_compile
        if torch_compile:
            self.decoder = compiled(self.decoder)
        self.cache, self.capture, self.max_tokens, self.max_queries = cache, capture, max_tokens, max_queries
        self._shapes: dict[tuple, _Shape] = {}
        self._moves: dict[int, _Moves] = {}  # moves a step (padded) -> their static indices and graph
        self._generation = cache.generation
        self._stream = self._pool = None
        self.steps = self.replays = self.captures = 0  # counters: steps run through here, replayed, captured

    @property
    def shapes(self) -> list[tuple[int, int, int]]:
        """The ``(W, Q, K)`` shapes with static inputs now (captured ones, on CUDA)."""
        return [shape for shape, _ in self._shapes]

    def shape_for(self, last_slot: int, q_len: int, offset: int = 0) -> tuple[int, int, int] | None:
        """The shape ``(W, Q, K)`` of a forward whose rows end at slot ``last_slot``, writing ``q_len``
        tokens a row at each slot's committed length plus ``offset``: rows, queries and the keys
        the longest slot then holds rounded up to powers of two, the keys at most the pool's
        capacity; with ``torch_compile`` rows at least 2 and keys at least
        :data:`~goodspeed.lm.runtime.attention.MASK_ALIGN` (the module docstring). None over
        :attr:`max_tokens` (``W x Q``) or :attr:`max_queries` (``Q``)."""
        least, least_keys = (2, MASK_ALIGN) if self.torch_compile else (1, 1)
        width, q_pad = max(bucket(last_slot + 1), least), bucket(q_len)
        if width * q_pad > self.max_tokens or q_pad > self.max_queries:
            return None
        keys = max(bucket(max(self.cache.lengths[:width]) + offset + q_pad), least_keys)
        return width, q_pad, min(keys, self.cache.capacity)

    def pack(self, tokens: list[list[int]], parents: list[list[int] | None], rows: slice, dtype: torch.dtype,
             device: torch.device | str) -> PackedRows | None:
        """The engine's step laid out at fixed shapes (:meth:`shape_for`); None where it does not
        fit one (the caller then packs it as usual)."""
        shape = self.shape_for(rows.stop - 1, max(len(t) for t in tokens))
        return None if shape is None else self.cache.pack_static(tokens, parents, rows, dtype, device, *shape)

    @torch.inference_mode()
    def logits(self, layout: PackedRows, rows: list[int]) -> torch.Tensor:
        """Logits ``[len(rows), q_len, V]`` of the window rows ``rows`` (slots) of a step
        :meth:`pack` laid out, as :meth:`PackedRows.padded` gives them (a row's pad positions repeat
        its last token's): the step replayed (or run), then the LM head on those rows' tokens."""
        group = layout.groups[0]
        hidden = self.run(layout.input_ids, layout.position_ids, group.mask, layout)
        return self.head(layout.padded(hidden, rows))

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
            layout: PackedRows | None = None) -> torch.Tensor:
        """Last hidden states of a forward at fixed shapes (on CUDA the graph's output tensor: read
        it before the next step): the engine's packed ``[1, W x Q]`` step (``layout``, from
        :meth:`pack`) or a batch ``[W, Q]`` forward under ``mask`` ``[W, 1, Q, K]``, its KV writes
        set by :meth:`SlotKVCache.prepare_static <goodspeed.lm.runtime.kv_slots.SlotKVCache.prepare_static>`."""
        self._current()
        rows, _, q_len, kv_len = mask.shape
        key = ((rows, q_len, kv_len), layout is None)
        self.steps += 1
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._static(input_ids, position_ids, mask, layout)
            try:
                hidden = self._first(shape)
            except RuntimeError as exc:  # never a shape left half-made, to run eagerly unannounced later
                raise RuntimeError(f"CUDA graph of shape {key[0]} (rows, queries, keys) failed: {exc}; "
                                   "run without cuda_graphs (--cuda-graphs) to serve eagerly") from exc
            self._shapes[key] = shape
            return hidden
        # The step's inputs into the shape's (its KV rows, arange(W) repeated Q times, are the shape's own)
        for static, value in ((shape.input_ids, input_ids), (shape.position_ids, position_ids), (shape.mask, mask),
                              (shape.write_pos, self.cache.pending_writes()[1])):
            static.copy_(value, non_blocking=True)
        if shape.graph is None:
            return self._forward(shape)
        shape.graph.replay()
        self.replays += 1
        return shape.hidden

    def _current(self) -> None:
        """Drop every graph if the pool was reallocated since they were captured: they point at freed memory."""
        if self.cache.generation != self._generation:
            self._shapes.clear()
            self._moves.clear()
            self._generation = self.cache.generation

    @torch.inference_mode()
    def move(self, moves: list[tuple[int, int, int]]) -> None:
        """A step's KV moves ``(slot, dst, src)`` in the pool (tree rows whose accepted path is not
        their first nodes; the ``mover`` of :meth:`SlotKVCache.commit_many
        <goodspeed.lm.runtime.kv_slots.SlotKVCache.commit_many>`), replayed as one graph of
        :meth:`SlotKVCache.move_pooled <goodspeed.lm.runtime.kv_slots.SlotKVCache.move_pooled>`. Eagerly
        that is one gather and one scatter for each layer's keys and values, 121 ops a step on
        SmolLM2-135M's 30 layers, which cost a tree step on the H200 as much as its replayed
        forward's other ops together (docs/MEASUREMENTS.md, *CUDA graphs on the H200*). The list is
        padded to a power of two (at least :data:`MIN_GRAPH_MOVES`) by repeating its last move,
        which writes the same entry again with the same value, so a few graphs serve every step."""
        self._current()
        size = max(bucket(len(moves)), MIN_GRAPH_MOVES)
        index = torch.tensor(moves + moves[-1:] * (size - len(moves)), dtype=torch.long).T
        entry = self._moves.get(size)
        if entry is None:
            entry = _Moves(index.to(self.cache.keys[0].device))
            self._first_moves(entry)
            self._moves[size] = entry
            return
        entry.index.copy_(index, non_blocking=True)
        if entry.graph is None:
            self.cache.move_pooled(entry.index)
        else:
            entry.graph.replay()
            self.replays += 1

    def _first_moves(self, entry: "_Moves") -> None:
        """A move size's first step: eagerly, then, on CUDA, captured for the next (as :meth:`_first`)."""
        if not self.capture:
            self.cache.move_pooled(entry.index)
            return
        try:
            _, entry.graph, _ = self._captured(entry.index.device, lambda: self.cache.move_pooled(entry.index))
        except RuntimeError as exc:
            raise RuntimeError(f"CUDA graph of {entry.index.shape[1]} KV moves failed: {exc}; "
                               "run without cuda_graphs (--cuda-graphs) to serve eagerly") from exc

    def _static(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
                layout: PackedRows | None) -> _Shape:
        """Static copies of a step's inputs on its device (and, for the engine's, the layout over
        them: one group, as pack_static's)."""
        device = input_ids.device
        rows, _, q_len, kv_len = mask.shape
        static_mask = aligned_mask(rows, 1, q_len, kv_len, mask.dtype, device).copy_(mask)
        ids, positions = input_ids.clone(), position_ids.to(device, copy=True)
        if layout is not None:
            group = layout.groups[0]
            layout = PackedRows(ids, positions, (AttentionGroup(group.rows, group.q_len, group.kv_len, static_mask,
                                                                group.tokens, None, None, group.dest),),
                                layout.starts, layout.sizes, layout.q_len, layout.keep, self.cache)
        write_rows, write_pos = self.cache.pending_writes()
        return _Shape(ids, positions, static_mask, write_rows.to(device, copy=True), write_pos.to(device, copy=True), layout)

    def _forward(self, shape: _Shape) -> torch.Tensor:
        """The step's forward over the static inputs, eagerly (or under capture)."""
        self.cache.use_writes(shape.write_rows, shape.write_pos)
        extra = {}
        if shape.layout is not None:
            shape.layout.groups[0].folds.clear()  # the fold is the forward's own work, recorded with it
            extra[PACKED] = shape.layout
        out = self.decoder(input_ids=shape.input_ids, attention_mask=shape.mask, position_ids=shape.position_ids,
                           **with_cache(self.decoder, self.cache), use_cache=True, **extra)
        return out.last_hidden_state

    def _first(self, shape: _Shape) -> torch.Tensor:
        """A shape's first step: eagerly (the step's hidden states), then, on CUDA, captured for the next."""
        if not self.capture:
            return self._forward(shape)
        hidden, shape.graph, shape.hidden = self._captured(shape.input_ids.device, lambda: self._forward(shape))
        return hidden

    def _captured(self, device: torch.device, run):
        """``run()`` once eagerly on the side stream the capture uses (a warm-up that does the
        work), then recorded as a CUDA graph over a memory pool shared by this object's graphs:
        ``(the eager run's result, the graph, the captured run's result)``."""
        with torch.cuda.device(device):  # the model's GPU, whichever is current
            if self._stream is None:
                self._stream, self._pool = torch.cuda.Stream(), torch.cuda.graph_pool_handle()
            current = torch.cuda.current_stream()
            self._stream.wait_stream(current)
            with torch.cuda.stream(self._stream):  # warm-up on the stream the capture runs on
                out = run()
            current.wait_stream(self._stream)
            if out is not None:
                out.record_stream(current)  # read on the current stream after this
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"):
                captured = run()
        self.captures += 1
        return out, graph, captured
