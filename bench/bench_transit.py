"""What a transit row costs a verification step (transit decoding, ``EngineConfig.transit_tokens``).

    python -m bench.bench_transit [--rounds 60] [--repeats 3] [--prefix 64] [--json]

Needs the demo models (`goodspeed models build-demo`). One engine on the demo target holds 4
drafters that submit 4 random tokens every step and K sessions whose drafts never arrive, so
every step decodes one token for each of them in transit. K = 0, 2, 4, 8 run in interleaved
blocks of 5 steps (``--repeats`` passes over the list), all sessions with a prompt of
``--prefix`` tokens; the figure is the median step time (assembly, forward, verification and
scheduling: ``RoundTimings.total_s``) per K, and the extra per transit row against K = 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np
import torch

from goodspeed.lm.models.demo import list_models
from goodspeed.lm.models.loading import load_causal_lm
from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from goodspeed.verifier.types import Draft

DRAFTERS, S, BLOCK = 4, 4, 5
LEVELS = (0, 2, 4, 8)


def build(target, prefix: int, silent: int, rounds: int, rng: np.random.Generator) -> tuple[VerificationEngine, list[str]]:
    """An engine with the drafters (returned) and ``silent`` transit sessions, prompts prefilled."""
    budget = DRAFTERS * S + silent  # room for every transit row beside the drafts
    engine = VerificationEngine(target, EngineConfig(budget=budget, policy="fixed", max_draft_len=S, seed=0,
                                                     transit_tokens=rounds + 1, max_seq_len=prefix + rounds * (S + 1) + 8))
    drafters = [engine.join(f"d{i}") for i in range(DRAFTERS)]
    for sid in drafters + [engine.join(f"silent{i}", transit=True) for i in range(silent)]:
        engine.start_request(sid, rng.integers(0, engine.vocab_size, prefix).tolist(), SamplingParams(), rounds * (S + 1) + 4)
    return engine, drafters


def step(engine: VerificationEngine, drafters: list[str], rng: np.random.Generator) -> tuple[float, int]:
    for sid in drafters:
        engine.set_allotment(sid, S)
        engine.submit(sid, Draft(engine.next_round(sid), rng.integers(0, engine.vocab_size, S).tolist()))
    result = engine.run_round()
    return result.timings.total_s, result.transit_tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=60, help="steps per K and pass")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prefix", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not list_models():
        print("no demo models; run `goodspeed models build-demo`", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    target = load_causal_lm("demo:target").model
    rng = np.random.default_rng(0)
    times: dict[int, list[float]] = {k: [] for k in LEVELS}
    for rep in range(args.repeats):
        engines = {k: build(target, args.prefix, k, args.rounds, rng) for k in LEVELS}
        for k in LEVELS:  # warm-up step each
            step(*engines[k], rng)
        for block in range(args.rounds // BLOCK):
            for k in (LEVELS if block % 2 == 0 else LEVELS[::-1]):
                for _ in range(BLOCK):
                    seconds, transit = step(*engines[k], rng)
                    if transit != k:
                        raise RuntimeError(f"K = {k}: the step decoded {transit} tokens in transit")
                    times[k].append(seconds)
        print(f"pass {rep + 1}/{args.repeats}: " + ", ".join(f"K={k} {1000 * statistics.median(times[k]):.3f} ms" for k in LEVELS),
              file=sys.stderr)
    base = statistics.median(times[0])
    out = {"prefix": args.prefix, "drafters": DRAFTERS, "draft_tokens": S, "steps_per_level": len(times[0]),
           "median_step_ms": {k: 1000 * statistics.median(times[k]) for k in LEVELS},
           "extra_ms_per_transit_row": {k: 1000 * (statistics.median(times[k]) - base) / k for k in LEVELS if k}}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print("| transit rows K | median step ms | extra ms per transit row |\n|---|---|---|")
        for k in LEVELS:
            extra = f"{out['extra_ms_per_transit_row'][k]:.3f}" if k else "-"
            print(f"| {k} | {out['median_step_ms'][k]:.3f} | {extra} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
