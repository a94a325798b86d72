"""What a verification step of token trees costs against one of chains: aten ops and time per step.

    python -m bench.bench_tree_round [--target real:smollm2-135m | --random KEY=VALUE,...]
                                     [--device cuda] [--rows 16] [--steps 30] [--temperature T] [--json]

On a GPU with eager PyTorch a step of a small model is bound by launching kernels, so what counts
is how many ops a step dispatches, not how many tokens it verifies. Each row's tokens are the
target's own greedy continuation of its prompt (found first by plain decoding), so every step
accepts a known path. Four shapes of draft, greedy, ``--rows`` requests each:

* ``plain``: no draft, one new token a row (plain decoding's step: one query per row);
* ``chain``: two tokens, both accepted (3 tokens a row, every row alike);
* ``tree-first``: the root's children (1, 2, 3 in turn by row, as AdaServe's trees at
  ``D_max = 1`` are ragged), the right token first: the accepted node is the first child, so its
  KV is already where it belongs;
* ``tree-moved``: the same children with the right token last: the accepted node's KV moves onto
  the position after the root (:meth:`goodspeed.lm.runtime.kv_slots.SlotKVCache.commit_many`) in every
  row with more than one child.

Each shape runs once per path (``--paths``, all six by default), on engines of its own whose steps
alternate:

* ``engine``: the engine as it is;
* ``row by row``: the KV commit as it ran before ``commit_many`` (one gather and scatter per layer
  for each row that moves, its indices copied to the device per layer);
* ``GQA SDPA``: masked attention as it ran before :func:`goodspeed.lm.runtime.attention.masked_attention`
  folded grouped-query heads into the query dimension: SDPA with ``enable_gqa`` over the rows'
  mask, which on CUDA only the math kernel takes (on a CPU, whose fused kernel takes both, the
  two paths dispatch the same ops);
* ``pad rows``: the engine with ``EngineConfig.pad_rows``: the rows laid out padded to the longest,
  pads in the model's input, so attention gathers and scatters nothing.
* ``graphs``: the engine with ``EngineConfig.cuda_graphs`` (:mod:`goodspeed.lm.runtime.graphs`): each step
  laid out at fixed shapes (rows, queries and keys rounded up to powers of two) and, on CUDA,
  replayed as the graph captured for its shape; its ops are then those the host dispatches around
  the replay. On a CPU the same static steps run eagerly (no capture).
* ``compiled``: ``graphs`` with ``EngineConfig.torch_compile`` too: the static steps through a
  decoder compiled by ``torch.compile`` (each shape compiled on its first step, before the timed
  ones), captured on CUDA, run compiled on a CPU.

Figures: aten ops a step dispatches (views aside; counted by a ``TorchDispatchMode`` over one
step), of them the KV commit's, and the median milliseconds of ``VerificationEngine.run_round``
(synchronised on a device).

``--temperature T`` (> 0): sampled requests instead, each drafted token sent with a sparse ``q``
(8 tokens). Tokens are random, so no path is known and no move is forced: ``tree-first`` and
``tree-moved`` are then the same shape. ``row by row`` also replays the sampled verification as it
ran before it was batched: each tree row's logits processed and copied to the host on their own,
and each rejecting chain row's correction ``q`` built on the device on its own.

``--random``: a Llama of that shape with random weights (seeded), for a device without the real
pair; SmolLM2-135M's is ``num_hidden_layers=30,hidden_size=576,intermediate_size=1536,
num_attention_heads=9,num_key_value_heads=3,vocab_size=49152``. A random model has a greedy
continuation too, so the shapes are the same.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.bench_attention import grouped_masked_attention, masked_attention_as
from goodspeed.lm.runtime.attention import masked_attention
from goodspeed.lm.runtime.graphs import StepGraphs
from goodspeed.lm.runtime.kv_slots import SlotKVCache
from goodspeed.lm.models.loading import load_causal_lm
from goodspeed.lm.decoding.sampling import process_logits
from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.verifier import verify_rows
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from goodspeed.verifier.types import Draft, SparseProbs

SHAPES = ("plain", "chain", "tree-first", "tree-moved")
BATCHED_Q_ROWS = verify_rows.q_rows_at  # the engine's; "row by row" swaps it out while its step runs
PATHS = ("engine", "row by row", "GQA SDPA", "pad rows", "graphs", "compiled")
PROMPT = 32


class OpCounter(TorchDispatchMode):
    """aten ops dispatched inside the block, views aside (on a GPU each other op is a kernel launch
    or a copy), by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def commit_row_by_row(cache: SlotKVCache, commits) -> None:
    """How the engine committed a step's KV before ``commit_many``: row after row, each moving row
    one gather and one scatter per layer's keys and values, its indices copied each time."""
    with torch.inference_mode():
        for slot, base, kept in commits:
            moves = [(dst, src) for dst, src in enumerate(kept) if dst != src]
            if moves:
                dst = torch.tensor([base + d for d, _ in moves])
                src = torch.tensor([base + s for _, s in moves])
                for buf in (*cache.keys, *cache.values):
                    if buf is not None:
                        buf[slot, :, dst.to(buf.device)] = buf[slot, :, src.to(buf.device)]
            cache.lengths[slot] = base + len(kept)


def sampled_row_by_row(verifier: verify_rows.RowVerifier) -> None:
    """Make ``verifier`` process sampled tree rows as before they were batched: each row's logits
    processed and copied to the host on their own (its chains: :func:`q_rows_one_by_one`)."""
    def trees(rows, logits, given):
        return [verifier._tree(row, process_logits(logits[b, : row.draft.num_tokens + 1].to(verifier.work_dtype).cpu(),
                                                   row.sampling), given) for b, row in enumerate(rows)]
    verifier._sampled_trees = trees


def q_rows_one_by_one(qs, at, vocab_size, dtype, device):
    """``q_rows_at`` as it ran before it was batched: each rejecting row's ``q`` built on the
    device on its own, then copied into the rows."""
    out = torch.zeros(len(qs), vocab_size, dtype=dtype, device=device)
    for b, (q, j) in enumerate(zip(qs, at)):
        if j < q.draft.num_tokens:
            out[b] = BATCHED_Q_ROWS([q], [j], vocab_size, dtype, device)[0]
    return out


def sampled_draft(tokens: list[int], vocab: int, rng: np.random.Generator) -> list[SparseProbs]:
    """A sparse ``q`` of 8 tokens for each drafted token (the token among them)."""
    out = []
    for token in tokens:
        others = [t for t in rng.choice(vocab, 8, replace=False).tolist() if t != token][:7]
        out.append(SparseProbs([token, *others], rng.dirichlet(np.ones(8)).tolist()))
    return out


def random_llama(spec: str, device: str):
    """A seeded random Llama of the shape ``KEY=VALUE,...`` (LlamaConfig fields)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = dict(item.split("=", 1) for item in spec.split(","))
    torch.manual_seed(0)
    config = LlamaConfig(**{k: int(v) for k, v in fields.items()}, tie_word_embeddings=True)
    return LlamaForCausalLM(config).to(device).eval()


def continuations(model, prompts: list[list[int]], length: int) -> list[list[int]]:
    """Each prompt's greedy continuation of ``length`` tokens, by plain decoding on the engine."""
    engine = VerificationEngine(model, EngineConfig(budget=len(prompts), policy="fixed", max_draft_len=0, seed=0))
    sessions = [engine.join(f"p{i}") for i in range(len(prompts))]
    for sid, prompt in zip(sessions, prompts):
        engine.start_request(sid, prompt, SamplingParams(), length)
    out: list[list[int]] = [[] for _ in prompts]
    while len(out[0]) < length:
        for sid in sessions:
            engine.submit(sid, Draft(engine.next_round(sid), []))
        verdicts = engine.run_round().verdicts
        for i, sid in enumerate(sessions):
            out[i] += list(verdicts[sid].token_ids)
    return out


def draft_for(shape: str, row: int, future: list[int], vocab: int) -> tuple[list[int], list[int] | None]:
    """Tokens (and parents) of ``shape``'s draft for a row whose next tokens are ``future``."""
    if shape == "plain":
        return [], None
    if shape == "chain":
        return future[:2], None
    wrong = [(future[0] + 1 + k) % vocab for k in range(row % 3)]
    children = [future[0], *wrong] if shape == "tree-first" else [*wrong, future[0]]
    return children, [-1] * len(children)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = ap.add_mutually_exclusive_group()
    source.add_argument("--target", default="demo:target")
    source.add_argument("--random", help="a random Llama of this shape: KEY=VALUE,... (LlamaConfig fields)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--steps", type=int, default=30, help="timed steps per engine")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled requests with sparse q (see above)")
    ap.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS), metavar="PATH",
                    help=f"which engines to run ({', '.join(PATHS)})")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = random_llama(args.random, args.device) if args.random else load_causal_lm(args.target, device=args.device).model
    vocab = model.config.vocab_size
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (PROMPT,), generator=gen).tolist() for _ in range(args.rows)]
    warmup = 3
    length = 3 * (args.steps + warmup + 2) + 2  # a chain step takes 3 tokens, a tree step 2, a plain one 1
    sampled = args.temperature > 0
    sampling = SamplingParams(temperature=args.temperature) if sampled else SamplingParams()
    shapes = SHAPES[:3] if sampled else SHAPES  # sampled: random tokens, no move forced
    future = None
    if not sampled:
        t0 = time.perf_counter()
        future = continuations(model, prompts, length)
        print(f"continuations: {args.rows} x {length} tokens in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)

    engines = {}
    for s_index, shape in enumerate(shapes):
        for path in args.paths:
            cuda = args.device.startswith("cuda")
            engine = VerificationEngine(model, EngineConfig(budget=4 * args.rows, policy="fixed", max_draft_len=3, seed=0,
                                                            pad_rows=path == "pad rows",
                                                            cuda_graphs=path in ("graphs", "compiled") and cuda,
                                                            torch_compile=path == "compiled"))
            if path == "graphs" and not cuda:  # the same static steps, eagerly
                engine.graphs = StepGraphs(engine.model, engine.cache, capture=False)
            sessions = [engine.join(f"r{i}") for i in range(args.rows)]
            for sid, prompt in zip(sessions, prompts):
                engine.start_request(sid, prompt, sampling, length)
            if path == "row by row":
                cache = engine.cache
                cache.commit_many = lambda commits, mover=None, cache=cache: commit_row_by_row(cache, commits)
                sampled_row_by_row(engine.row_verifier)
            # the same drafts for every path: one stream per shape
            engines[shape, path] = (engine, sessions, [0] * args.rows, np.random.default_rng(s_index))

    def step(key) -> float:
        engine, sessions, done, rng = engines[key]
        for row, sid in enumerate(sessions):
            upcoming = future[row][done[row]:] if future else [int(rng.integers(vocab))]
            tokens, parents = draft_for(key[0], row, upcoming, vocab)
            if sampled and key[0] == "chain":
                tokens = rng.integers(vocab, size=2).tolist()
            engine.set_allotment(sid, len(tokens))
            engine.submit(sid, Draft(engine.next_round(sid), tokens, parents,
                                     sparse_probs=sampled_draft(tokens, vocab, rng) if sampled else None))
        if sampled and key[1] == "row by row":  # the engine's sampled chains read verify_rows.q_rows_at
            verify_rows.q_rows_at = q_rows_one_by_one
        try:
            with masked_attention_as(grouped_masked_attention if key[1] == "GQA SDPA" else masked_attention):
                sync()
                start = time.perf_counter()
                result = engine.run_round()
                sync()
                elapsed = time.perf_counter() - start
        finally:
            verify_rows.q_rows_at = BATCHED_Q_ROWS
        for row, sid in enumerate(sessions):
            emitted = list(result.verdicts[sid].token_ids)
            if not sampled:
                want = future[row][done[row]: done[row] + len(emitted)]
                if emitted != want:
                    raise AssertionError(f"{key}: row {row} emitted {emitted}, the target's greedy continuation is {want}")
            elif not emitted:
                raise AssertionError(f"{key}: row {row} emitted nothing")
            done[row] += len(emitted)
        return elapsed

    def commit_ops(key) -> Counter:
        engine = engines[key][0]
        inner = engine.cache.commit_many
        counted: Counter = Counter()

        def counting(commits, **kw):
            with OpCounter() as counter:
                inner(commits, **kw)
            counted.update(counter.ops)
        engine.cache.commit_many = counting
        return counted

    times = {key: [] for key in engines}
    for i in range(warmup + args.steps):
        for key in engines:
            elapsed = step(key)
            if i >= warmup:
                times[key].append(elapsed)
    rows = []
    for key in engines:
        committed = commit_ops(key)
        with OpCounter() as counter:
            step(key)
        graphs = engines[key][0].graphs
        rows.append({"shape": key[0], "path": key[1], "ops": sum(counter.ops.values()),
                     "commit_ops": sum(committed.values()), "ms": 1000 * statistics.median(times[key]),
                     **({} if graphs is None else {"graph_steps": graphs.steps, "replays": graphs.replays,
                                                   "captures": graphs.captures, "graph_shapes": graphs.shapes})})
    result = {"target": args.random or args.target, "device": args.device, "rows": args.rows, "steps": args.steps,
              "temperature": args.temperature,
              "torch": torch.__version__,
              "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "cells": rows}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"{result['target']} on {result['device_name']}, {args.rows} rows, median of {args.steps} steps")
        print("| shape | path | aten ops a step | of them the commit's | ms a step |\n|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['shape']} | {r['path']} | {r['ops']} | {r['commit_ops']} | {r['ms']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
