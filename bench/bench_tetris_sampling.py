"""What keeping TETRIS exact under sampling costs: three selections on one workload, one run.

    python -m bench.bench_tetris_sampling [--requests 64] [--max-new-tokens 48] [--draft draft-distilled] [--json]

Needs the demo models (`goodspeed models build-demo`). Every variant serves the same sampled
(temperature 1) code-completion requests with local TETRIS (``k + extra`` drafted per request,
``capacity = k x requests`` verified per iteration), closed loop (all requests queued at once,
``--max-requests`` decoded together), on a fresh engine with the same root seed:

* ``value-ranked`` — the previous behaviour: sampled positions ranked by ``prod_{t<=j} q_t(s_t)``,
  their own drawn values. Measurably biased (tests/verifier/test_local_lossless.py) — shown only
  as the baseline the fix is measured against;
* ``point-mass`` — the same value-ranked selection, verified as point masses (``q = 1`` on the
  drafted token: accept with ``p(s)``): exact for any selection, but accepts less;
* ``pre-draw`` (shipped) — positions ranked by ``prod_{t<j} q_t(s_t) * E[q_j]``, what was known
  before each token was drawn (goodspeed.scheduler.tetris.presample_scores), verified with
  ``min(1, p/q)``.

Reported: VSR (accepted / verified draft tokens), tokens per target forward, iterations, and
wall-clock throughput (torch pinned to the threads given).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

from bench.bench_local import code_prompts, load_pair
from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from goodspeed.verifier.local import LocalConfig, LocalServing
from goodspeed.verifier.local_policies import Plan
from goodspeed.verifier.local_policies.tetris import TetrisSelection


class ValueRanked(TetrisSelection):
    """The previous (biased) ranking: each position's own drawn probability."""

    @staticmethod
    def scores(drafts):
        return [np.cumsum(np.log(np.array(d.token_probs))) for d in drafts]


class PointMass(ValueRanked):
    """Value-ranked selection, verified as point masses: q is the one-hot of each drafted token."""

    def plan(self, reqs):
        plans, k = super().plan(reqs)
        out = {}
        for rid, plan in plans.items():
            q = None
            if plan.token_ids:
                q = torch.zeros(len(plan.token_ids), self.serving.engine.vocab_size)
                q[torch.arange(len(plan.token_ids)), torch.tensor(plan.token_ids)] = 1.0
            out[rid] = Plan(plan.token_ids, None, q)
        return out, k


VARIANTS = {"value-ranked (previous, biased)": ValueRanked, "point-mass (exact)": PointMass, "pre-draw (exact, shipped)": TetrisSelection}


def run_variant(cls, target, draft, prompts, args) -> dict:
    engine = VerificationEngine(target.model, EngineConfig(seed=args.seed))
    config = LocalConfig(policy="tetris", k=args.k, extra=args.extra, max_requests=args.max_requests, seed=args.seed)
    serving = LocalServing(engine, draft.model, config)
    serving.policy = cls(serving)
    sampling = SamplingParams(temperature=args.temperature)
    started = time.perf_counter()
    for p in prompts:
        serving.submit(p, sampling, args.max_new_tokens)
    while serving.step() is not None:
        pass
    wall = time.perf_counter() - started
    t = serving.totals
    return {"vsr": t["accepted"] / t["drafted"], "iterations": t["steps"], "tokens": t["emitted"],
            "tokens_per_forward": t["emitted"] / t["steps"], "throughput_tok_s": t["emitted"] / wall, "wall_s": wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--max-requests", type=int, default=16)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--extra", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--draft", default="draft-distilled", help="demo draft model name")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="runs per variant, alternating (median wall time)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    pair = load_pair("target", args.draft)
    if pair is None:
        return 1
    torch.set_num_threads(args.threads)
    target, draft = pair
    prompts = code_prompts(target.tokenizer, args.requests, args.seed)
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for _ in range(args.repeats):
        for name, cls in VARIANTS.items():
            runs[name].append(run_variant(cls, target, draft, prompts, args))
            r = runs[name][-1]
            print(f"{name}: VSR {r['vsr']:.3f}, {r['tokens_per_forward']:.2f} tok/forward, {r['throughput_tok_s']:.0f} tok/s", file=sys.stderr)
    results = {}
    for name, rs in runs.items():
        best = sorted(rs, key=lambda r: r["wall_s"])[len(rs) // 2]
        results[name] = {**best, "throughput_tok_s": float(np.median([r["throughput_tok_s"] for r in rs]))}
    out = {"settings": vars(args), "results": results}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print("| selection | VSR | tokens / target forward | iterations | throughput tok/s (median) |\n|---|---|---|---|---|")
        for name, r in results.items():
            print(f"| {name} | {r['vsr']:.3f} | {r['tokens_per_forward']:.2f} | {r['iterations']} | {r['throughput_tok_s']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
