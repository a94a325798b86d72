"""Greedy speculative output in bf16 against plain decoding's, token for token, and what batch
invariance costs (``EngineConfig.batch_invariant``, :mod:`goodspeed.lm.runtime.invariant`).

    python -m bench.bench_invariance [--target real:smollm2-135m] [--configs plain@8,ngram@1,ngram@8,suffix@8]
                                     [--modes as-is,invariant] [--categories A,B] [--max-tokens 64] [--threads 2]
                                     [--shapes 1,8,...] [--json PATH]

In one process, each task of the per-task benchmark (``bench/workloads/tasks.jsonl``, greedy, its
chat prompt) is decoded by local serving (:class:`goodspeed.verifier.local.LocalServing`) on the
target in bf16: by plain decoding one request at a time (the reference), then by each config
``SOURCE@BATCH`` (``plain``: plain decoding; a lookup source under the goodput policy, ``k = 6``),
the category's tasks cycled to ``BATCH`` requests at once. All of it once per ``--modes``, each on
a copy of the target of its own, each category in the modes' order and the reverse in turn:
``as-is`` (the engine as shipped: linear layers as torch runs them), ``invariant``
(``batch_invariant``), ``unaligned`` (the engine as before attention read keys in whole runs:
``packing.KEY_ALIGN = 1`` while that mode runs). Per config and mode: how many outputs equal the same mode's reference token
for token (the cycled copies of a task compared too), where the first differing token of each
other one is, and tokens/s (wall time of the whole batch, first token included; the cost of the
invariant layers is the ratio of the two modes' tokens/s of the same config). Plain decoding's
prefill of each prompt is timed on its own, both modes. Last, ``--shapes``: the median time of one
forward of that many new tokens after a 200-token cache (the model's own attention), both modes
interleaved: what the invariant linear layers cost by the tokens a forward holds.
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
from goodspeed.lm.runtime import packing
from goodspeed.lm.runtime.attention import with_cache
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from goodspeed.verifier.local import LocalConfig, LocalServing

ALIGNED = packing.KEY_ALIGN
MODES = ("unaligned", "as-is", "invariant")
DEFAULT_MODES = "as-is,invariant"


def parse_configs(text: str) -> list[tuple[str, str, int]]:
    """``plain@8,ngram@1`` -> ``[(label, source, batch), ...]``.

    >>> parse_configs("plain@8,ngram@1")
    [('plain@8', 'plain', 8), ('ngram@1', 'ngram', 1)]
    """
    out = []
    for label in (c.strip() for c in text.split(",") if c.strip()):
        source, _, batch = label.partition("@")
        if source not in ("plain", "ngram", "suffix") or not batch.isdigit() or int(batch) < 1:
            raise ValueError(f"config {label!r}: give SOURCE@BATCH, SOURCE plain, ngram or suffix, BATCH >= 1")
        out.append((label, source, int(batch)))
    return out


def serve(engine: VerificationEngine, prompts: list[list[int]], source: str, batch: int, eos: list[int],
          max_tokens: int) -> tuple[list[list[int]], float]:
    """``prompts`` served ``batch`` at a time by ``source``; the outputs in order and the wall time."""
    if source == "plain":
        config, draft = LocalConfig(policy="none", max_requests=batch), DraftSpec.parse("ngram").build(None, engine.vocab_size)
    else:
        config = LocalConfig(policy="goodput", k=6, max_k=6, budget=32, max_requests=batch)
        draft = DraftSpec.parse(source).build(None, engine.vocab_size)
    serving = LocalServing(engine, draft, config)
    ids = [serving.submit(p, SamplingParams(temperature=0.0), max_new_tokens=max_tokens, eos_token_ids=eos) for p in prompts]
    start = time.perf_counter()
    while serving.step() is not None:
        pass
    wall = time.perf_counter() - start
    done = {r.request_id: list(r.generated) for r in serving.finished}
    return [done[i] for i in ids], wall


def prefill_seconds(engine: VerificationEngine, prompt: list[int]) -> float:
    """One prompt's prefill (a request of one token: its prompt's forward and one step)."""
    serving = LocalServing(engine, DraftSpec.parse("ngram").build(None, engine.vocab_size), LocalConfig(policy="none", max_requests=1))
    serving.submit(prompt, SamplingParams(temperature=0.0), max_new_tokens=1)
    start = time.perf_counter()
    while serving.step() is not None:
        pass
    return time.perf_counter() - start


def forward_costs(models: dict, shapes: list[int], prefix: int = 200, repeats: int = 15) -> dict:
    """Median seconds of one forward of ``n`` new tokens after a ``prefix``-token cache, per mode
    and ``n`` in ``shapes``: the two modes' forwards interleaved, the same tokens for both."""
    from transformers import DynamicCache

    vocab = next(iter(models.values())).config.vocab_size
    ids = torch.randint(0, vocab, (1, prefix + max(shapes)), generator=torch.Generator().manual_seed(0))
    times = {mode: {n: [] for n in shapes} for mode in models}
    with torch.inference_mode():
        caches = {}
        for mode, model in models.items():
            caches[mode] = DynamicCache()
            model(input_ids=ids[:, :prefix], **with_cache(model, caches[mode]), use_cache=True)
        for r in range(repeats):
            for n in shapes:
                for mode in (list(models) if r % 2 == 0 else list(models)[::-1]):
                    start = time.perf_counter()
                    models[mode](input_ids=ids[:, prefix : prefix + n], **with_cache(models[mode], caches[mode]), use_cache=True)
                    times[mode][n].append(time.perf_counter() - start)
                    caches[mode].crop(-n)  # drop the n new tokens (transformers 5 takes n <= 0)
    return {mode: {n: statistics.median(v) for n, v in per.items()} for mode, per in times.items()}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (the shorter's length if one is a prefix of the other)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="bf16 speculative output against plain decoding's, and batch invariance's cost")
    parser.add_argument("--target", default="real:smollm2-135m")
    parser.add_argument("--configs", default="plain@8,ngram@1,ngram@8,suffix@8")
    parser.add_argument("--categories", default=None, help="comma-separated; default: every category")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--modes", default=DEFAULT_MODES,
                        help="any of unaligned (the engine before keys were read in whole runs: KEY_ALIGN = 1), "
                             "as-is, invariant")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shapes", default="1,8,16,32,33,48,56,64,128,300",
                        help="tokens a forward: each timed as-is and invariant (empty: skip)")
    parser.add_argument("--shape-repeats", type=int, default=15, help="forwards timed a shape and mode (the median kept)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    try:
        configs = parse_configs(args.configs)
    except ValueError as e:
        parser.error(str(e))
    modes = tuple(m for m in MODES if m in args.modes.split(","))
    if not modes or set(args.modes.split(",")) - set(MODES):
        parser.error(f"--modes {args.modes!r}: give some of {', '.join(MODES)}")
    tasks = load_tasks()
    categories = list(dict.fromkeys(t["category"] for t in tasks))
    if args.categories:
        wanted = args.categories.split(",")
        if unknown := [c for c in wanted if c not in categories]:
            parser.error(f"unknown categories {unknown}; known: {categories}")
        categories = wanted
    torch.set_num_threads(args.threads)
    engines = {}
    for mode in modes:
        target = load_causal_lm(args.target, dtype="bfloat16")
        options = {"batch_invariant": True} if mode == "invariant" else {}
        engines[mode] = VerificationEngine(target.model, EngineConfig(seed=0, **options))
    tok = target.tokenizer
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    rows, prefill = [], {mode: [] for mode in modes}
    serve(engines[modes[0]], [chat_prompt_ids(tok, tasks[0]["messages"])], "plain", 1, eos, 4)  # warm-up
    for index, category in enumerate(categories):
        mine = [t for t in tasks if t["category"] == category]
        prompts = [chat_prompt_ids(tok, t["messages"]) for t in mine]
        for mode in (modes if index % 2 == 0 else modes[::-1]):  # a drifting machine weighs on both alike
            engine = engines[mode]
            packing.KEY_ALIGN = 1 if mode == "unaligned" else ALIGNED
            prefill[mode] += [prefill_seconds(engine, p) for p in prompts]
            reference, ref_wall = [], 0.0
            for p in prompts:
                out, wall = serve(engine, [p], "plain", 1, eos, args.max_tokens)
                reference += out
                ref_wall += wall
            rows.append({"category": category, "mode": mode, "config": "plain@1", "tokens": sum(map(len, reference)),
                         "wall_s": ref_wall, "equal": len(reference), "requests": len(reference), "first_differences": []})
            for label, source, batch in configs:
                cycled = [i % len(prompts) for i in range(max(batch, len(prompts)))] if batch > 1 else list(range(len(prompts)))
                outputs, wall = [], 0.0
                for start in range(0, len(cycled), batch):
                    part = cycled[start : start + batch]
                    out, w = serve(engine, [prompts[i] for i in part], source, batch, eos, args.max_tokens)
                    outputs += out
                    wall += w
                diffs = [first_difference(reference[i], o) for i, o in zip(cycled, outputs)]
                rows.append({"category": category, "mode": mode, "config": label, "tokens": sum(map(len, outputs)),
                             "wall_s": wall, "equal": sum(d is None for d in diffs), "requests": len(outputs),
                             "first_differences": [d for d in diffs if d is not None]})
            print(f"{category:18s} {mode:9s} " + "  ".join(
                f"{r['config']} {r['equal']}/{r['requests']} {r['tokens'] / r['wall_s']:.1f} tok/s"
                for r in rows if r["category"] == category and r["mode"] == mode), flush=True)
    summary = {}
    for label in ["plain@1"] + [c[0] for c in configs]:
        for mode in modes:
            mine = [r for r in rows if r["config"] == label and r["mode"] == mode]
            summary[f"{label} {mode}"] = {"equal": sum(r["equal"] for r in mine), "requests": sum(r["requests"] for r in mine),
                                          "tok_s": sum(r["tokens"] for r in mine) / sum(r["wall_s"] for r in mine)}
        if {"as-is", "invariant"} <= set(modes):
            summary[f"{label} invariant/as-is tok/s"] = summary[f"{label} invariant"]["tok_s"] / summary[f"{label} as-is"]["tok_s"]
    costs = None
    if args.shapes and {"as-is", "invariant"} <= set(modes):
        shapes = [int(n) for n in args.shapes.split(",")]
        costs = forward_costs({mode: engines[mode].model for mode in ("as-is", "invariant")}, shapes,
                              repeats=args.shape_repeats)
        summary["forward invariant/as-is"] = {n: costs["invariant"][n] / costs["as-is"][n] for n in shapes}
        summary["forward ms as-is"] = {n: 1e3 * costs["as-is"][n] for n in shapes}
    summary["prefill_s median"] = {mode: statistics.median(prefill[mode]) for mode in modes}
    if {"as-is", "invariant"} <= set(modes):
        summary["prefill invariant/as-is"] = sum(prefill["invariant"]) / sum(prefill["as-is"])
    print(json.dumps(summary, indent=1))
    if args.json:
        report = {"command": " ".join(["python -m bench.bench_invariance", *(argv if argv is not None else sys.argv[1:])]),
                  "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                  "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
                  "target": args.target, "dtype": "bfloat16", "threads": args.threads, "max_tokens": args.max_tokens,
                  "summary": summary, "rows": rows, "prefill_s": prefill, "forward_s": costs}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
