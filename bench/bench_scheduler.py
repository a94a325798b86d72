"""Time the scheduler's policy decisions at the sizes named in the scheduler issue.

    python -m bench.bench_scheduler [--repeats 200] [--json]

Each figure is the median wall time of one call over ``--repeats`` calls on fresh random inputs
(drawn before timing), measured with ``time.perf_counter``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np

from goodspeed.scheduler import goodspeed, timing

from goodspeed.scheduler import (
    CandidateTree,
    NightjarBandit,
    allocate_draft_lengths,
    select_tokens,
    select_tree_nodes,
    speculation_shape,
)


def median_s(make_args: Callable[[np.random.Generator], tuple], fn: Callable, repeats: int, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    cases = [make_args(rng) for _ in range(repeats)]
    fn(*cases[0])  # warm-up
    times = []
    for args in cases:
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def goodspeed_case(rng):
    n = 1024
    return rng.uniform(0.05, 0.95, n), rng.uniform(1.0, 6.0, n), 8192


def goodspeed_small_case(rng):
    """A Table I-sized round: 8 drafters, C = 20, max draft length 16 (128 candidate units)."""
    n = 8
    return rng.uniform(0.05, 0.95, n), rng.uniform(1.0, 6.0, n), 20, [16] * n


def small_case_by(path: str, repeats: int) -> float:
    """The N = 8 case forced down another of the allocation's exact paths: ``sort`` (every unit's
    gain sorted once) or ``threshold`` (the regula-falsi search larger N takes)."""
    saved = goodspeed.HEAP_UNITS, goodspeed.SORT_UNITS
    goodspeed.HEAP_UNITS, goodspeed.SORT_UNITS = -1, (goodspeed.SORT_UNITS if path == "sort" else 0)
    try:
        return median_s(goodspeed_small_case, allocate_draft_lengths, repeats)
    finally:
        goodspeed.HEAP_UNITS, goodspeed.SORT_UNITS = saved


def time_aware_case(rng):
    """The same round for time-aware GoodSpeed: periods of 10-100 ms plus 1-5 ms per drafted
    token (each drafter's mean period at 4 tokens)."""
    acceptance, goodput, budget, caps = goodspeed_small_case(rng)
    base, per_token = rng.uniform(0.01, 0.1, len(caps)), rng.uniform(0.001, 0.005, len(caps))
    return acceptance, goodput, base, per_token, base + 4 * per_token, budget, caps


def time_aware_by_dynamic(repeats: int) -> float:
    """The time-aware case forced down the dynamic programme (the fallback for gains that
    rounding leaves out of order)."""
    saved = timing._paying_units_in_order
    timing._paying_units_in_order = lambda gains, usable: False
    try:
        return median_s(time_aware_case, timing.allocate_time_aware, repeats)
    finally:
        timing._paying_units_in_order = saved


def tetris_case(rng, num_drafted: int = 8):
    return [rng.uniform(0.05, 1.0, num_drafted) for _ in range(256)], 2048


def tetris_extra_case(rng):
    """k = 8 plus 4 extra drafted tokens per request, so the capacity actually binds."""
    return tetris_case(rng, 12)


def beam_tree(rng, depth: int, width: int) -> CandidateTree:
    """A beam-search-shaped candidate tree: ``width`` nodes per level, parents from the level above."""
    parents, probs, prev = [], [], [-1]
    for _ in range(depth):
        level = []
        for _ in range(width):
            p = int(rng.choice(prev))
            parents.append(p)
            probs.append(rng.uniform(0.1, 1.0) * (1.0 if p < 0 else probs[p]))
            level.append(len(parents) - 1)
        prev = level
    return CandidateTree(np.array(parents), np.array(probs))


def adaserve_case(rng):
    n, budget = 64, 512
    depth, width = speculation_shape(budget, n, max_depth=8, max_width=4)
    trees = [beam_tree(rng, depth, width) for _ in range(n)]
    return trees, rng.uniform(0.5, 4.0, n), budget, 6


def nightjar_setup(repeats: int):
    bandit = NightjarBandit(max_length=6)
    rng = np.random.default_rng(0)
    for t in range(2000):  # warm the bandit into its long exploitation blocks
        arm = bandit.choose_arm(8, rng)
        bandit.observe(8, arm, 10.0 + arm)
    return bandit, rng


def nightjar_decision_s(repeats: int) -> float:
    bandit, rng = nightjar_setup(repeats)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        bandit.choose_arm(8, rng, 0.01)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = [
        ("goodspeed allocate N=1024 C=8192", median_s(goodspeed_case, allocate_draft_lengths, args.repeats), 1e-3),
        ("goodspeed allocate N=8 C=20", median_s(goodspeed_small_case, allocate_draft_lengths, args.repeats), 100e-6),
        ("  same, by sorting every unit", small_case_by("sort", args.repeats), 100e-6),
        ("  same, by the threshold search", small_case_by("threshold", args.repeats), 100e-6),
        ("time-aware allocate N=8 C=20", median_s(time_aware_case, timing.allocate_time_aware, args.repeats), 100e-6),
        ("  same, by the dynamic programme", time_aware_by_dynamic(args.repeats), 100e-6),
        ("tetris select 256x8 C=2048", median_s(tetris_case, select_tokens, args.repeats), 1e-3),
        ("tetris select 256x12 C=2048 (binding)", median_s(tetris_extra_case, select_tokens, args.repeats), 1e-3),
        ("adaserve select n=64 B=512", median_s(adaserve_case, select_tree_nodes, args.repeats), 2e-3),
        ("nightjar decision", nightjar_decision_s(args.repeats * 50), 10e-6),
    ]
    if args.json:
        print(json.dumps([{"case": c, "median_s": t, "goal_s": g} for c, t, g in rows]))
        return 0
    print(f"python {platform.python_version()}, numpy {np.__version__}, {platform.processor() or platform.machine()}")
    print(f"{'case':<36} {'median':>12} {'goal':>10}  met")
    for case, t, goal in rows:
        print(f"{case:<36} {t * 1e6:>9.1f} us {goal * 1e6:>7.0f} us  {'yes' if t <= goal else 'NO'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
