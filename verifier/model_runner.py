"""The engine's third stage: run the target over a step's rows and prompt chunks, in ONE forward.

Packed (``EngineConfig.packed``, the default): the model's layers see only the real tokens and
attention alone works per row over its KV slot (:mod:`goodspeed.lm.runtime.attention`); chains attend
through flash's varlen kernel where there is one, trees (and chains without it) through masked SDPA
with ancestor masks. Otherwise every row is padded to the longest (the reference path).

CUDA graphs and compiled steps (``EngineConfig.cuda_graphs`` / ``torch_compile``): a step with
logits and no prompt chunk is laid out at fixed shapes and replayed as the graph captured for its
shape (:mod:`goodspeed.lm.runtime.graphs`); the LM head runs after the replay. Other steps run eagerly.

Prompt log-probabilities (``prompt_logprobs``) are read off a chunk's logits here, before the
chunk's KV is committed; no other logits of a prompt chunk are computed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from goodspeed.lm.runtime.attention import PACKED, flash_varlen_kernel, keep_logits, model_varlen_missing, use_gqa_attention, with_cache
from goodspeed.lm.runtime.graphs import StepGraphs
from goodspeed.lm.runtime.invariant import batch_invariance_missing, make_batch_invariant
from goodspeed.lm.runtime.kv_slots import SlotKVCache
from goodspeed.lm.runtime.packing import build_attention, group_overhead
from goodspeed.verifier.sessions import EngineConfig, Request, Row
from goodspeed.verifier.verify_rows import committed_logprobs


class ModelRunner:
    """The target model, its slot KV cache and how its forwards attend."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig) -> None:
        self.model = model.eval()
        use_gqa_attention(self.model)
        self.config = config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.cache = SlotKVCache(int(model.config.num_hidden_layers))
        if config.batch_invariant:
            if (missing := batch_invariance_missing(self.device, self.dtype)) is not None:
                raise ValueError(f"batch_invariant: {missing}")
            make_batch_invariant(self.model)
        # Packed forwards' chains attend through a varlen kernel where there is one (CUDA, fp16 /
        # bf16, a torch whose flash op takes per-sequence key lengths) unless the config says
        # "masked"; "varlen" insists on it (EngineConfig.attention).
        wants_varlen = config.packed and config.attention != "masked"
        missing = model_varlen_missing(self.model) if wants_varlen else None
        if config.attention == "varlen" and missing:
            raise ValueError(f"attention 'varlen' needs flash's varlen kernel, which needs {missing} "
                             f"(this model: {self.device}, {self.dtype}); use 'auto' or 'masked'")
        self.cache.varlen = flash_varlen_kernel() if wants_varlen and not missing else None
        # Masked groups split where a long row would pad the others (packing.split_rows), on a CPU
        self.cache.group_overhead = group_overhead(model.config, self.device)
        if config.cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs needs a CUDA device; this target is on {self.device}")
        # Steps at fixed shapes where they fit one, replayed as CUDA graphs and / or through a
        # compiled decoder; None: every step packed at its own shape.
        self.graphs = (StepGraphs(self.model, self.cache, capture=config.cuda_graphs, torch_compile=config.torch_compile)
                       if config.cuda_graphs or config.torch_compile else None)

    @property
    def attention(self) -> str:
        """How packed forwards attend: the varlen kernel's name for chains, or masked SDPA (and
        whether rows are padded where a step allows it: ``EngineConfig.pad_rows``; whether steps
        are replayed as CUDA graphs: ``EngineConfig.cuda_graphs``)."""
        padded = ", rows padded where a step allows" if self.config.pad_rows else ""
        if self.graphs is not None:
            others = f"{self.cache.varlen.name} for chains, masked SDPA for trees" if self.cache.varlen else "masked SDPA"
            return f"CUDA graphs of padded steps (masked SDPA) where a step fits one; other steps: {others}{padded}"
        if self.cache.varlen is None:
            return ("masked SDPA" + padded) if self.config.packed else "masked SDPA (padded forwards)"
        return f"{self.cache.varlen.name} for chains, masked SDPA for trees{padded}"

    def run(self, rows: list[Row], chunks: list[tuple[int, list[int]]], request_at: Callable[[int], Request]) -> torch.Tensor | None:
        """One forward over the slot window spanning the verification rows and the prompt chunks
        (``(slot, tokens)``); idle slots get padding. Logits ``[len(rows), q_len, V]`` of the rows
        (None without rows). A chunk's logits are computed only where its request
        (``request_at(slot)``) asked for prompt log-probabilities, which are scored here, before
        the chunk's KV is committed."""
        slots = [r.slot for r in rows] + [slot for slot, _ in chunks]
        first, last = min(slots), max(slots)
        tokens: list[list[int]] = [[] for _ in range(last - first + 1)]
        parents: list[list[int] | None] = [None] * len(tokens)
        for row in rows:
            tokens[row.slot - first], parents[row.slot - first] = row.tokens, row.parents
        for slot, chunk in chunks:
            tokens[slot - first] = chunk
        scored = [(slot, chunk) for slot, chunk in chunks if request_at(slot).prompt_logprobs is not None]
        logits, chunk_logits = self.forward(slice(first, last + 1), tokens, parents, [r.slot - first for r in rows],
                                            tuple(slot - first for slot, _ in chunks), [slot - first for slot, _ in scored])
        for (slot, chunk), logits_of_chunk in zip(scored, chunk_logits):
            self._score_prompt(request_at(slot), self.cache.lengths[slot], chunk, logits_of_chunk)
        return logits

    @staticmethod
    def _score_prompt(request: Request, done: int, chunk: list[int], logits: torch.Tensor) -> None:
        """Keep a chunk's prompt log-probabilities on its request, with their ranks (vLLM's
        ``prompt_logprobs`` shows them): the logits at a prompt token's position are those of the
        token after it (raw logits, as a verdict's ``logprobs``, which carry no ranks)."""
        wanted = [(0, range(len(chunk)), request.committed[done + 1 : done + 1 + len(chunk)], request.prompt_logprobs)]
        request.prompt_scores += committed_logprobs(logits.unsqueeze(0), wanted, ranks=True)[0]

    def forward(self, window: slice, tokens: list[list[int]], parents: list[list[int] | None],
                rows: list[int], solo: tuple[int, ...] = (), read: list[int] = ()) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """Logits ``[len(rows), q_len, V]`` of the window rows ``rows`` (None if there are none)
        for new tokens written at each slot's committed length, and ``[len(tokens[r]), V]`` of each
        window row ``r`` in ``read`` (prompt chunks whose request scores its prompt). Packed: the
        model sees only the real tokens, and the ``solo`` rows (prompt chunks) attend on their own,
        with no logits computed unless ``read`` lists one; otherwise every row is padded to the
        longest (the reference path)."""
        if self.config.packed:
            if self.graphs is not None and rows and not solo:  # a step of fixed shapes, replayed where it fits one
                layout = self.graphs.pack(tokens, parents, window, self.dtype, self.device)
                if layout is not None:  # its window is [0, W): rows are slots
                    return self.graphs.logits(layout, [window.start + r for r in rows]), []
            layout = self.cache.pack(tokens, parents, window, self.dtype, self.device, solo, pad=self.config.pad_rows)
            # Logits only for the tokens someone reads: a prompt chunk's only where its prompt is scored.
            extra = keep_logits(self.model, layout.input_ids.shape[1] if read else max(layout.keep, 1))
            with torch.inference_mode():
                out = self.model(input_ids=layout.input_ids, attention_mask=layout.mask, position_ids=layout.position_ids,
                                 **with_cache(self.model, self.cache), use_cache=True, **{PACKED: layout}, **extra)
            offset = layout.input_ids.shape[1] - out.logits.shape[1]
            chunks = [out.logits[0, layout.starts[r] - offset : layout.starts[r] - offset + len(tokens[r])] for r in read]
            return (layout.padded(out.logits, rows) if rows else None), chunks
        q_len = max(len(t) for t in tokens)
        ids = torch.zeros(len(tokens), q_len, dtype=torch.long)
        for i, t in enumerate(tokens):
            ids[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        kv_len = self.cache.prepare(q_len, window)
        mask, positions = build_attention(self.cache.lengths[window], parents, q_len, kv_len, self.dtype, self.device)
        with torch.inference_mode():
            out = self.model(input_ids=ids.to(self.device), attention_mask=mask, position_ids=positions,
                             **with_cache(self.model, self.cache), use_cache=True)
        return (out.logits[rows] if rows else None), [out.logits[r, : len(tokens[r])] for r in read]

    def commit(self, rows: list[Row], kept: list[list[int]]) -> None:
        """Keep each row's verified KV entries (``kept``: row positions), the rest rolled back;
        every row's at once, so a step of trees moves accepted paths in one op per layer."""
        self.cache.commit_many([(row.slot, self.cache.lengths[row.slot], k) for row, k in zip(rows, kept)],
                               mover=self.graphs.move if self.graphs is not None else None)
