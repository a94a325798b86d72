"""Where a local-serving step's time goes, per draft source: plain decoding against each source
at batch 8, in one process, interleaved (every other repeat in the reverse order).

    python -m bench.bench_local_steps [--categories open-chat,multi-turn-chat] [--sources ngram,suffix,ngram/by-request]
                                      [--max-k 6[,12,...]] [--repeats 2] [--threads 2] [--dtype auto] [--json PATH]

For each category of the per-task benchmark (``bench/workloads/tasks.jsonl``), its tasks cycled
to 8 greedy requests of up to 96 tokens run through :class:`goodspeed.verifier.local.LocalServing`
(the goodput policy, ``k = max_k = 6``, or each ``--max-k`` in turn, a run then named
``SOURCE@K``; plain decoding: policy ``none``), every source in turn,
``--repeats`` times. Per run: wall time, tokens/s and its ratio to the same repeat's plain run,
steps, drafted and accepted tokens, and the time in planning and drafting, in the engine's
rounds, and in Python's cyclic garbage collector (``gc.callbacks``; collections counted per
generation), the rest being the steps' own bookkeeping, and the goodput policy's fitted step
costs at the end (ms: a step, a drafted token, a token of the longest chain:
:meth:`goodspeed.scheduler.PayingLength.batch_costs`); at the end, each source's median speedup
per category. A lookup named ``LOOKUP/by-request`` drafts as before the goodput policy kept
lookups' drafts by their evidence: lengths chosen from each request's one acceptance.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from bench.bench_workloads import in_turn, load_tasks
from goodspeed.drafter.prompts import chat_prompt_ids
from goodspeed.lm.decoding.draft_source import DraftSpec
from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.lm.models.loading import load_causal_lm
from goodspeed.lm.models.precision import resolve_dtype
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from goodspeed.verifier.local import LocalConfig, LocalServing



class GcClock:
    """Seconds Python's cyclic garbage collector has run, and its collections per generation."""

    def __init__(self) -> None:
        self.seconds, self.collections, self._start = 0.0, [0, 0, 0], 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start
            self.collections[info["generation"]] += 1

    def read(self) -> tuple[float, list[int]]:
        return self.seconds, list(self.collections)


@functools.lru_cache(maxsize=None)
def draft_model(name: str, dtype: str) -> torch.nn.Module:
    """A model source's draft, loaded once a run."""
    return load_causal_lm(name, dtype=dtype).model


def run(engine, prompts, source: str, eos: list[int], clock: GcClock, dtype: str = "auto", max_k: int = 6) -> dict:
    """``source``: ``plain``, a source's name (a model's or a hybrid's draft in ``dtype``), or
    ``LOOKUP/by-request``: the lookup's drafts cut by each request's one acceptance, as a model's
    are (its ``free_proposals`` off), not by evidence. ``max_k``: the longest draft a request may have."""
    if source == "plain":
        config, draft = LocalConfig(policy="none", max_requests=8), DraftSpec.parse("ngram").build(None, engine.vocab_size)
    else:
        config = LocalConfig(policy="goodput", k=max_k, max_k=max_k, budget=32, max_requests=8)
        name, _, variant = source.partition("/")
        if variant not in ("", "by-request"):
            raise ValueError(f"unknown variant {variant!r} of {name}: give by-request or none")
        spec = DraftSpec.parse(name)
        draft = spec.build(draft_model(spec.model, dtype) if spec.needs_model else None, engine.vocab_size)
        if variant:
            draft.free_proposals = False
    serving = LocalServing(engine, draft, config)
    for p in prompts:
        serving.submit(p, SamplingParams(temperature=0.0), max_new_tokens=96, eos_token_ids=eos)
    gc_s, gc_n = clock.read()
    t0 = time.perf_counter()
    while serving.step() is not None:
        pass
    wall = time.perf_counter() - t0
    gc_after, n_after = clock.read()
    totals = serving.totals
    tokens = sum(len(r.generated) for r in serving.finished)
    costs = serving.policy.costs.batch_costs() if hasattr(serving.policy, "costs") else None
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "steps": totals["steps"], "drafted": totals["drafted"],
            "accepted": totals["accepted"], "drafting_s": totals["drafting_s"], "round_s": totals["round_s"],
            "gc_s": gc_after - gc_s, "gc_collections": [a - b for a, b in zip(n_after, gc_n)],
            "step_costs_ms": None if costs is None else [round(1e3 * c, 3) for c in costs]}


def runs_of(sources: list[str], max_k: str) -> dict[str, tuple[str, int]]:
    """Each run's label and ``(source, longest draft)``: every source at every length of
    ``max_k`` (comma-separated, each >= 1), labelled ``SOURCE@K`` where there are several.

    >>> runs_of(["ngram", "suffix"], "6")
    {'ngram': ('ngram', 6), 'suffix': ('suffix', 6)}
    >>> runs_of(["ngram"], "6,12")
    {'ngram@6': ('ngram', 6), 'ngram@12': ('ngram', 12)}
    """
    lengths = [k.strip() for k in max_k.split(",")]
    if not all(k.isdigit() and int(k) >= 1 for k in lengths):
        raise ValueError(f"--max-k {max_k!r}: give whole numbers >= 1, comma-separated")
    several = len(lengths) > 1
    return {f"{source}@{k}" if several else source: (source, int(k)) for source in sources for k in lengths}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="local serving at batch 8: where a step's time goes, per source")
    parser.add_argument("--target", default="real:smollm2-135m")
    parser.add_argument("--categories", default="open-chat,multi-turn-chat")
    parser.add_argument("--sources", default="ngram,suffix")
    parser.add_argument("--max-k", default="6", help="the goodput policy's longest draft; several (6,12): each source at each")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    try:
        variants = runs_of(args.sources.split(","), args.max_k)
    except ValueError as e:  # before the target loads
        parser.error(str(e))
    torch.set_num_threads(args.threads)
    target = load_causal_lm(args.target, dtype=args.dtype)
    tok = target.tokenizer
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    tasks = load_tasks()
    clock = GcClock()
    engine = VerificationEngine(target.model, EngineConfig(seed=0))
    results = []
    for category in args.categories.split(","):
        mine = [t for t in tasks if t["category"] == category]
        if not mine:
            parser.error(f"no tasks of category {category!r}")
        prompts = [chat_prompt_ids(tok, mine[i % len(mine)]["messages"]) for i in range(8)]
        run(engine, prompts[:2], "plain", eos, clock)  # warm-up
        for repeat in range(args.repeats):
            runs = {}
            for label in in_turn(["plain", *variants], repeat):  # a drifting machine weighs on each run alike
                source, max_k = variants.get(label, ("plain", 0))
                runs[label] = run(engine, prompts, source, eos, clock, args.dtype, max_k)
            runs = {label: runs[label] for label in ["plain", *variants]}
            for source, r in runs.items():
                r.update(category=category, repeat=repeat, source=source, speedup=r["tok_s"] / runs["plain"]["tok_s"])
                results.append(r)
                print(f"{category:18s} {repeat} {source:7s} {r['tok_s']:7.1f} tok/s  x{r['speedup']:.3f}  steps {r['steps']:3d}  "
                      f"drafted {r['drafted']:4d} accepted {r['accepted']:4d}  drafting {1e3 * r['drafting_s'] / r['steps']:.2f} "
                      f"ms/step  round {1e3 * r['round_s'] / r['steps']:.2f} ms/step  gc {1e3 * r['gc_s']:.1f} ms "
                      f"{r['gc_collections']}  step costs {r['step_costs_ms']} ms", flush=True)
    print("\nmedian speedup over the repeats")
    for category in args.categories.split(","):
        cells = {source: statistics.median(r["speedup"] for r in results if r["category"] == category and r["source"] == source)
                 for source in variants}
        print(f"{category:18s} " + "  ".join(f"{source} {value:.3f}" for source, value in cells.items()))
    if args.json:
        report = {"command": " ".join(["python -m bench.bench_local_steps", *(argv if argv is not None else sys.argv[1:])]),
                  "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                  "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
                  "target": args.target, "dtype": resolve_dtype(args.dtype, "cpu", args.target), "threads": args.threads, "runs": results}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
