"""Packed vs padded target forwards on the Table I experiments' own round shapes.

    python -m bench.bench_packing [--specs table1-4drafters table1-8drafters] [--rounds 300]
                                  [--repeats 3] [--threads 1] [--attention-only] [--json]

Each shipped experiment spec's drafters (their demo drafts, prompt sets and sampling) run in one
process against one engine (:mod:`goodspeed.launch.cluster.inprocess`) for ``--rounds`` rounds under the
``goodspeed`` and ``fixed`` policies at the spec's budget ``C``, with the engine's target forward
packed (``EngineConfig.packed``: the model sees only the real tokens) and padded (every row padded
to the round's longest: the reference). Figure: the verifier's seconds per round (assembly,
forward, verification, scheduling — what the round log calls ``verify_s``) and each phase,
medians over ``--repeats`` interleaved runs of each run's mean (ABBA order), and GoodSpeed / Fixed-S
paired within each repeat, next to Fixed-S packed / padded (the same work: the noise floor); also
the mean longest row and the mean real tokens per round. First, an attention micro-benchmark (:func:`attention_cost`):
what attention still costs in the padded layout packed forwards keep.
Packed and padded runs of one policy see the same drafts, so their outputs are asserted equal.

Threads are pinned (``--threads``, default 1, like the experiments' verifier on one core).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from goodspeed.drafter.prompts import load_prompts
from goodspeed.drafter.runner import DraftRunner
from goodspeed.launch.experiments.experiment import load_experiment
from goodspeed.launch.cluster.inprocess import InProcessDrafter, run_inprocess
from goodspeed.launch.spec import spec_path
from goodspeed.lm.models.loading import load_causal_lm
from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.verifier.engine import EngineConfig, VerificationEngine

POLICIES = ("goodspeed", "fixed")
PHASES = ("assembly_s", "forward_s", "sampling_s", "scheduling_s")  # RoundTimings


def one_run(spec, models: dict, policy: str, packed: bool, rounds: int) -> dict:
    target = models[spec.verifier.target]
    engine = VerificationEngine(target.model, EngineConfig(budget=spec.verifier.budget, policy=policy, packed=packed, seed=0))
    drafters = []
    for d in spec.drafters:
        prompts = [p.prompt_ids for p in load_prompts(d.prompt_path(), target.tokenizer)][: d.max_prompts] * 20
        drafters.append(InProcessDrafter(d.name, DraftRunner(models[d.draft].model), prompts,
                                         SamplingParams(d.temperature, d.top_k, d.top_p), d.max_new_tokens, seed=7))
    eos = [target.tokenizer.eos_token_id] if target.tokenizer.eos_token_id is not None else []
    results = run_inprocess(engine, drafters, eos, max_rounds=rounds)
    rows = [[v.num_drafted + 1 for v in r.verdicts.values()] for r in results]
    return {
        "verify_s": [r.timings.total_s for r in results],
        **{phase: [getattr(r.timings, phase) for r in results] for phase in PHASES},
        "longest_row": statistics.mean(max(x) for x in rows),
        "tokens": statistics.mean(sum(x) for x in rows),
        "outputs": [o for d in drafters for o in d.outputs] + [d.runner.committed for d in drafters],
    }


def bench_spec(name: str, rounds: int, repeats: int) -> dict:
    _, spec = load_experiment(spec_path(name))
    models = {m: load_causal_lm(m) for m in {spec.verifier.target, *(d.draft for d in spec.drafters)}}
    runs: dict[tuple[str, bool], list[dict]] = {(p, k): [] for p in POLICIES for k in (True, False)}
    for repeat in range(repeats):
        # ABBA order: a drift in the machine's speed over a repeat pair hits both policies alike.
        for key in (list(runs) if repeat % 2 == 0 else list(runs)[::-1]):
            runs[key].append(one_run(spec, models, *key, rounds))
    out = {"budget": spec.verifier.budget, "drafters": len(spec.drafters), "rounds": rounds}
    for policy in POLICIES:
        same = runs[(policy, True)][0]["outputs"] == runs[(policy, False)][0]["outputs"]
        assert same, f"{name} {policy}: packed and padded outputs differ"
        for packed in (True, False):
            rs = runs[(policy, packed)]
            out[f"{policy}/{'packed' if packed else 'padded'}"] = {
                "verify_ms_per_round": statistics.median(statistics.mean(r["verify_s"]) for r in rs) * 1e3,
                **{f"{phase[:-2]}_ms_per_round": statistics.median(statistics.mean(r[phase]) for r in rs) * 1e3 for phase in PHASES},
                "longest_row": rs[0]["longest_row"],
                "tokens_per_round": rs[0]["tokens"],
            }
    for mode in ("packed", "padded"):
        packed = mode == "packed"
        out[f"goodspeed_over_fixed/{mode}"] = (out[f"goodspeed/{mode}"]["verify_ms_per_round"]
                                               / out[f"fixed/{mode}"]["verify_ms_per_round"])
        # Paired within each repeat (the two ran minutes apart, not an hour): the spread the
        # machine's drift leaves on the ratio itself.
        out[f"goodspeed_over_fixed_per_repeat/{mode}"] = [
            statistics.mean(g["verify_s"]) / statistics.mean(f["verify_s"])
            for g, f in zip(runs[("goodspeed", packed)], runs[("fixed", packed)])]
    # Fixed-S packed and padded do the same work (equal rows): their ratio is the noise floor.
    out["fixed_packed_over_padded_per_repeat"] = [
        statistics.mean(a["verify_s"]) / statistics.mean(b["verify_s"]) for a, b in zip(runs[("fixed", True)], runs[("fixed", False)])]
    return out


def attention_cost(repeats: int = 3000) -> dict:
    """What attention costs in the padded layout packed forwards keep (the demo target's shapes: 4
    query heads over 2 KV heads of 32, 120 keys): the engine's masked call per layer
    (``lm.runtime.attention.masked_attention``, its folded mask made once, as a forward makes it) for 4
    rows padded to 8 and to 12 queries, and the 5-D broadcast layout that would skip the padding
    (12 queries as 3 chunks of 4 sharing their row's keys). Median microseconds per call."""
    import torch.nn.functional as F

    from goodspeed.lm.runtime.attention import masked_attention

    def timed(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6

    gen = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(4, 2, 120, 32, generator=gen) for _ in range(2))
    out = {}
    for q_len in (8, 12):
        query, mask = torch.randn(4, 4, q_len, 32, generator=gen), torch.zeros(4, 1, q_len, 120)
        folds: dict = {}
        out[f"padded_4x{q_len}_us"] = timed(lambda: masked_attention(query, keys, values, mask, folds=folds))
    query, mask = torch.randn(4, 3, 4, 4, 32, generator=gen), torch.zeros(4, 3, 1, 4, 120)
    k5, v5 = keys.unsqueeze(1).expand(4, 3, 2, 120, 32), values.unsqueeze(1).expand(4, 3, 2, 120, 32)
    out["broadcast_4x3x4_us"] = timed(lambda: F.scaled_dot_product_attention(query, k5, v5, attn_mask=mask, enable_gqa=True))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="packed vs padded verification on the Table I specs' round shapes")
    parser.add_argument("--specs", nargs="+", default=["table1-4drafters", "table1-8drafters"])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--attention-only", action="store_true", help="only the attention micro-benchmark")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    attention = attention_cost()
    report = {} if args.attention_only else {name: bench_spec(name, args.rounds, args.repeats) for name in args.specs}
    if args.json:
        print(json.dumps({"attention": attention, **report}, indent=2))
        return 0
    print("attention per layer (us): " + ", ".join(f"{k[:-3]} {v:.1f}" for k, v in attention.items()))
    if not report:
        return 0
    print(f"{'spec':<18} {'policy':<10} {'mode':<7} {'verify ms/round':>15} {'assembly':>8} {'forward':>8} {'sampling':>8} "
          f"{'scheduling':>10} {'longest row':>11} {'tokens':>7}")
    for name, r in report.items():
        for policy in POLICIES:
            for mode in ("packed", "padded"):
                x = r[f"{policy}/{mode}"]
                print(f"{name:<18} {policy:<10} {mode:<7} {x['verify_ms_per_round']:>15.3f} {x['assembly_ms_per_round']:>8.3f} "
                      f"{x['forward_ms_per_round']:>8.3f} {x['sampling_ms_per_round']:>8.3f} {x['scheduling_ms_per_round']:>10.3f} "
                      f"{x['longest_row']:>11.2f} {x['tokens_per_round']:>7.2f}")
        print(f"{name}: goodspeed / fixed verification time: packed {r['goodspeed_over_fixed/packed']:.3f}, "
              f"padded {r['goodspeed_over_fixed/padded']:.3f} (goal <= 1)")
        for key in ("goodspeed_over_fixed_per_repeat/packed", "goodspeed_over_fixed_per_repeat/padded",
                    "fixed_packed_over_padded_per_repeat"):
            print(f"  {key} (each repeat): " + " ".join(f"{x:.3f}" for x in r[key]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
