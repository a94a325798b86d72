"""What splitting a step's attention into groups buys: whole engine steps at batch 8 with draft
rows of uneven lengths, the shared rows in one masked group (every row padded to the longest)
against split where it pays (:func:`goodspeed.lm.runtime.packing.split_rows`, the default on a CPU).

    python -m bench.bench_groups [--target real:smollm2-135m] [--dtype auto] [--threads 2]
                                 [--repeats 12] [--json PATH]

Eight requests from the per-task benchmark's prompts (``bench/workloads/tasks.jsonl``) run through
local serving's engine; each step verifies one fixed shape of draft lengths (rejected tokens, so
every request advances one token a step and the contexts grow slowly), each shape timed with one
group and with split groups in turn, ``--repeats`` times. Figure: the median step time of each
(shape, mode), relative to the step with no drafts in one group, and split / one group per shape.

First, the fit the split's cost model rests on (:func:`sdpa_fit`): the engine's masked call
(:func:`goodspeed.lm.runtime.attention.masked_attention`) timed on the target's heads over 1-8
rows, 1-7 queries and 100-1,600 keys, fitted by least squares as ``c0 + a * rows * keys + b *
rows * keys * queries`` microseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from bench.bench_workloads import load_tasks
from goodspeed.drafter.prompts import chat_prompt_ids
from goodspeed.lm.decoding.draft_source import DraftSpec
from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.lm.models.loading import load_causal_lm
from goodspeed.lm.models.precision import resolve_dtype
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from goodspeed.verifier.local import LocalConfig, LocalServing
from goodspeed.verifier.local_policies.base import Plan

SHAPES = {  # draft lengths of the 8 rows
    "no drafts": [0] * 8,
    "one row of 1": [1] + [0] * 7,
    "one row of 2": [2] + [0] * 7,
    "one row of 6": [6] + [0] * 7,
    "one row of 6, mid-window": [0, 0, 0, 6, 0, 0, 0, 0],
    "two rows of 6": [6, 0, 0, 0, 0, 0, 0, 6],
    "goodput-like 6,0,3,0,1,0,0,2": [6, 0, 3, 0, 1, 0, 0, 2],
    "every row 1": [1] * 8,
    "every row 6": [6] * 8,
}


def sdpa_fit(config, dtype: torch.dtype, repeats: int = 60) -> dict:
    """Microseconds of one masked attention call against its shape, and the least-squares fit."""
    import numpy as np

    from goodspeed.lm.runtime.attention import masked_attention
    from goodspeed.lm.runtime.packing import build_attention

    heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
    dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    shapes, times = [], []
    for keys in (100, 400, 800, 1600):
        for rows, queries in ((1, 1), (1, 3), (1, 7), (2, 1), (2, 4), (4, 1), (4, 7), (8, 1), (8, 2), (8, 4), (8, 7)):
            q = torch.randn(rows, heads, queries, dim, dtype=dtype)
            k, v = (torch.randn(rows, kv_heads, keys, dim, dtype=dtype) for _ in range(2))
            mask, _ = build_attention([keys - queries] * rows, [None] * rows, queries, keys, dtype)
            folds: dict = {}
            for _ in range(5):
                masked_attention(q, k, v, mask, 0.0, dim ** -0.5, folds)
            t0 = time.perf_counter()
            for _ in range(repeats):
                masked_attention(q, k, v, mask, 0.0, dim ** -0.5, folds)
            shapes.append((rows, queries, keys))
            times.append((time.perf_counter() - t0) / repeats * 1e6)
    x = np.array([[1.0, r * k, r * k * q] for r, q, k in shapes])
    (c0, a, b), *_ = np.linalg.lstsq(x, np.array(times), rcond=None)
    return {"call_us": float(c0), "per_row_key_us": float(a), "per_row_key_query_us": float(b),
            "extra_queries": float(a / b), "call_in_row_key_pairs": float(c0 / b),
            "timings_us": [{"rows": r, "queries": q, "keys": k, "us": t} for (r, q, k), t in zip(shapes, times)]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="attention groups: one against split, on uneven draft rows")
    parser.add_argument("--target", default="real:smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load_causal_lm(args.target, dtype=args.dtype)
    tok = target.tokenizer
    tasks = load_tasks()
    prompts = [chat_prompt_ids(tok, task["messages"]) for task in tasks[:: max(1, len(tasks) // 8)][:8]]
    fit = sdpa_fit(target.model.config, next(target.model.parameters()).dtype)
    print(f"masked attention: {fit['call_us']:.1f} us a call + {fit['per_row_key_query_us']:.4f} us per row, key and query "
          f"(+ {fit['extra_queries']:.2f} queries' worth per row and key): a call = {fit['call_in_row_key_pairs']:.0f} "
          "(row, key) pairs at one query", flush=True)
    engine = VerificationEngine(target.model, EngineConfig(seed=0))
    serving = LocalServing(engine, DraftSpec.parse("ngram").build(None, engine.vocab_size),
                           LocalConfig(policy="goodput", k=6, max_k=6, max_requests=8))
    steps = len(SHAPES) * 2 * args.repeats + 64
    for p in prompts:
        serving.submit(p, SamplingParams(temperature=0.0), max_new_tokens=steps, eos_token_ids=[])
    lengths = [0] * 8

    def plan(reqs):  # each row drafts its last token repeated: rejected, timed all the same
        return {r.request_id: Plan([int(r.committed[-1])] * lengths[i]) for i, r in enumerate(reqs)}, None

    serving.policy.plan = plan
    for _ in range(4):  # prefill and warm-up
        serving.step()
    cache = engine.runner.cache
    split = cache.group_overhead
    if split is None:
        parser.error("this device keeps one group (packing.group_overhead): nothing to compare")
    times: dict[tuple[str, str], list[float]] = {(s, m): [] for s in SHAPES for m in ("one", "split")}
    for repeat in range(args.repeats):
        for shape, rows in SHAPES.items():
            for mode in (("one", "split") if repeat % 2 == 0 else ("split", "one")):
                cache.group_overhead = None if mode == "one" else split
                lengths[:] = rows
                t0 = time.perf_counter()
                serving.step()
                times[(shape, mode)].append(time.perf_counter() - t0)
    cache.group_overhead = split
    base = statistics.median(times[("no drafts", "one")])
    results = {}
    for shape in SHAPES:
        one, many = statistics.median(times[(shape, "one")]), statistics.median(times[(shape, "split")])
        results[shape] = {"lengths": SHAPES[shape], "one_group_ms": one * 1e3, "split_ms": many * 1e3,
                          "one_group_rel": one / base, "split_rel": many / base, "split_over_one": many / one}
        print(f"{shape:30s} one group {one * 1e3:7.2f} ms ({one / base:.3f})  split {many * 1e3:7.2f} ms "
              f"({many / base:.3f})  split / one {many / one:.3f}", flush=True)
    if args.json:
        report = {"command": " ".join(["python -m bench.bench_groups", *(argv if argv is not None else sys.argv[1:])]),
                  "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                  "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
                  "target": args.target, "dtype": resolve_dtype(args.dtype, "cpu", args.target), "threads": args.threads,
                  "repeats": args.repeats, "group_overhead_pairs": split, "sdpa_fit": fit,
                  "contexts_at_end": [len(r.committed) for r in serving._active.values()], "shapes": results}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
