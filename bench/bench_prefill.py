"""Chunked prefill: what one long prompt arriving mid-run costs the other drafters' rounds.

    python -m bench.bench_prefill [--prompt 2048] [--chunks 128,256,512] [--drafters 8] [--json]

Needs the demo models (`goodspeed models build-demo`). ``--drafters`` sessions (prefix 256, 4
random draft tokens each, ``fixed`` policy) run rounds back to back on the demo target, as a
saturated verifier does; after 10 rounds a new session starts a ``--prompt``-token request. A
drafter's round, as it sees it, is the interval between two of its verdicts: the round itself
plus any prefill the engine ran in between. Reported per mode (whole-prompt prefill at
StartRequest, then each chunk size): the longest interval before the prompt arrived (baseline)
and after it (until its prefill completed), the increase, and the cost of one chunk alone
(a prefill-only step of that many tokens at the prompt's deepest context, median of 5); the
goal is increase <= one chunk's cost. A step where the slot cache's pool doubles its capacity
copies every pooled slot's KV: the increase is also reported without those steps (``steady``),
with their count (0 since per-slot KV sizing: the prompt's slot moves to buffers of its own
instead, :mod:`goodspeed.lm.runtime.kv_slots`). Also: the steps the prompt took to prefill, its time to
its first round, and the KV positions the cache reserves once it is in (``KV held``) against
what a cache holding every slot at the longest slot's capacity would (``pool only``). torch runs
on ``--threads`` threads (default 2) so runs compare.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from goodspeed.lm.models.loading import load_causal_lm
from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from goodspeed.verifier.types import Draft

S, PREFIX, WARM_ROUNDS, AFTER_ROUNDS = 4, 256, 10, 6


def _engine(target, drafters: int, chunk: int | None, prompt: int, rounds: int, rng) -> tuple[VerificationEngine, list[str]]:
    engine = VerificationEngine(target, EngineConfig(budget=drafters * S, policy="fixed", max_draft_len=S, seed=0,
                                                     prefill_chunk=chunk, max_seq_len=max(prompt, PREFIX) + 8 * rounds + 64))
    sessions = []
    for i in range(drafters):
        sid = engine.join(f"d{i}")
        engine.start_request(sid, rng.integers(0, engine.vocab_size, PREFIX).tolist(), SamplingParams(), 8 * rounds)
        while engine.prefilling(sid):
            engine.prefill_step()
        sessions.append(sid)
    return engine, sessions


def _round(engine: VerificationEngine, sessions: list[str], rng) -> None:
    for sid in sessions:
        engine.set_allotment(sid, S)
        engine.submit(sid, Draft(engine.next_round(sid), rng.integers(0, engine.vocab_size, S).tolist()))
    engine.run_round()


def one_mode(target, drafters: int, chunk: int | None, prompt: int) -> dict:
    rng = np.random.default_rng(0)
    max_rounds = WARM_ROUNDS + AFTER_ROUNDS + prompt + 8
    engine, sessions = _engine(target, drafters, chunk, prompt, max_rounds, rng)
    _round(engine, sessions, rng)  # warm-up
    intervals, last = [], time.perf_counter()
    for _ in range(WARM_ROUNDS):
        _round(engine, sessions, rng)
        now = time.perf_counter()
        intervals.append(now - last)
        last = now
    newcomer = engine.join("long")
    arrived = time.perf_counter()
    engine.start_request(newcomer, rng.integers(0, engine.vocab_size, prompt).tolist(), SamplingParams(), 8)
    during, steady, steps = [], [], 0
    while True:
        prefilling, capacity = engine.prefilling(newcomer), engine.cache.capacity
        _round(engine, sessions, rng)
        now = time.perf_counter()
        if prefilling or not during:
            during.append(now - last)
            if engine.cache.capacity == capacity:
                steady.append(now - last)
        steps += prefilling
        last = now
        if not prefilling:
            break
    first_round_s = time.perf_counter() - arrived
    longest = max(engine.cache.lengths)
    pool_only = engine.cache.num_slots * 2 ** max(8, (longest - 1).bit_length())  # from 256, doubled to fit the longest
    return {"baseline_max_ms": max(intervals) * 1e3, "baseline_median_ms": statistics.median(intervals) * 1e3,
            "during_max_ms": max(during) * 1e3, "increase_ms": (max(during) - max(intervals)) * 1e3,
            "steady_increase_ms": (max(steady, default=0.0) - max(intervals)) * 1e3, "growth_steps": len(during) - len(steady),
            "prefill_steps": steps, "time_to_first_round_ms": first_round_s * 1e3,
            "kv_positions": engine.cache.reserved_positions, "kv_positions_pool_only": pool_only}


def chunk_cost(target, chunk: int, prompt: int) -> float:
    """Seconds of a prefill-only step of ``chunk`` tokens at the prompt's deepest context."""
    rng = np.random.default_rng(1)
    times = []
    for _ in range(5):
        engine = VerificationEngine(target, EngineConfig(budget=0, policy="fixed", prefill_chunk=chunk, max_seq_len=prompt + 64))
        sid = engine.join("long")
        engine.start_request(sid, rng.integers(0, engine.vocab_size, prompt).tolist(), SamplingParams(), 8)
        while not (step := engine.prefill_step()).started:
            pass
        times.append(step.seconds)  # the last chunk: at the deepest context
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="chunked prefill: a long prompt's cost to the others' rounds")
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--chunks", default="128,256,512")
    parser.add_argument("--drafters", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load_causal_lm("demo:target").model
    report = {"whole": one_mode(target, args.drafters, None, args.prompt)}
    for chunk in (int(c) for c in args.chunks.split(",")):
        row = one_mode(target, args.drafters, chunk, args.prompt)
        row["chunk_cost_ms"] = chunk_cost(target, chunk, args.prompt) * 1e3
        report[f"chunk {chunk}"] = row
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{args.drafters} drafters x S={S}, prefix {PREFIX}; a {args.prompt}-token prompt arrives after {WARM_ROUNDS} rounds")
    print(f"{'mode':<10} {'base max':>8} {'during max':>10} {'increase':>8} {'steady':>7} {'growths':>7} {'1 chunk':>7} "
          f"{'steps':>5} {'to 1st round':>12}  (ms)  {'KV held':>8} {'pool only':>9}  (positions per layer)")
    for mode, r in report.items():
        cost = f"{r['chunk_cost_ms']:.1f}" if "chunk_cost_ms" in r else "-"
        print(f"{mode:<10} {r['baseline_max_ms']:>8.1f} {r['during_max_ms']:>10.1f} {r['increase_ms']:>8.1f} "
              f"{r['steady_increase_ms']:>7.1f} {r['growth_steps']:>7} {cost:>7} {r['prefill_steps']:>5} {r['time_to_first_round_ms']:>12.1f}        "
              f"{r['kv_positions']:>8} {r['kv_positions_pool_only']:>9}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
