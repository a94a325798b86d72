"""Local serving: one trace, every local policy side by side, on the embedded demo models or the
real pair.

    python -m bench.bench_local [--requests 48] [--rate 40 [20 ...] | --load 0.4 [0.2 ...]] [--seed 0 [1 ...]] [--max-new-tokens 32]
                                [--draft draft-small] [--target demo:target] [--dtype float32]
                                [--device cpu] [--threads N] [--policies none,adaserve ...] [--variants gqa pad graphs] [--json]
                                [--repetition-penalty R] [--presence-penalty P] [--frequency-penalty F]

Needs the demo models (`goodspeed models build-demo`), or for ``--target real:smollm2-135m
--draft real:smollm2-135m-draft`` the real pair (`goodspeed models get smollm2-135m`). A bare
``--draft`` name is a demo draft. Steps:

1. profile the target and the draft on this machine (TurboSpec eq. 3, as `goodspeed profile`);
   the strict SLO class is the profiled baseline per-token latency (plain decoding at batch 8),
   moderate 2.4x and relaxed 8x (AdaServe Table 2's ratios);
2. build one Poisson trace of code-completion prompts with the three classes;
3. replay it in real time on a fresh engine and local server per policy (in-process: the numbers
   are the serving loop's, not gRPC's) and check every output equals the target's greedy decoding
   (the ``none`` policy's output);
4. report throughput, mean and p99 TPOT, SLO attainment per class, goodput of the SLO-meeting
   requests, VSR (accepted / drafted), and where an iteration's time goes: drafting (the
   policy's draft forwards and selection) and the target round (forward and verification).

``--load`` gives the arrival rate as a fraction of plain decoding's profiled capacity
(:func:`capacity_req_s`), so one load means the same on a slow CPU and a GPU. Several ``--rate``
(or ``--load``) and ``--seed`` values replay one trace per (rate, seed) cell with the same models
and profile (so the same SLOs); ``--json`` then prints ``{"cells": [...]}``, one object per cell,
each shaped as a single cell's output. ``--variants`` also replays each policy in the same cell
(the same trace, profile and SLOs) with ``gqa``: masked attention as it ran before 2026-11-26
(``bench.bench_attention.grouped_masked_attention``: SDPA with ``enable_gqa`` over the rows' own
mask, on CUDA the math kernel), named ``POLICY [GQA SDPA]``; ``pad``: the engine's rows padded
where a step allows it (``EngineConfig.pad_rows``), named ``POLICY [pad rows]``; ``graphs``: the
target's steps and the draft's forwards replayed as CUDA graphs (``EngineConfig.cuda_graphs``,
:mod:`goodspeed.lm.runtime.graphs`; on a CPU the same fixed-shape forwards run eagerly), named ``POLICY
[graphs]``; ``compile``: those steps and forwards through decoders compiled by
``torch.compile`` (``EngineConfig.torch_compile``; on CUDA captured as graphs too), named ``POLICY
[compiled]``, planning with the graphs' profile; ``logprobs``: every request asks for its tokens'
log-probabilities and the top 5 (the OpenAI API's ``logprobs``), named ``POLICY [logprobs 5]``;
``raw-draft``: with a penalty given (``--repetition-penalty``, ``--presence-penalty``,
``--frequency-penalty``: every request's, greedy), chains and trees are drafted without it while
the target applies it (what the draft's own adjustment buys in acceptance), named ``POLICY [raw
draft]``;
on CUDA the graphs variant's policies plan with a profile measured with graphs (``profile_graphs``
in the JSON), while the SLOs stay the eager profile's, as for every variant. ``--cuda-graphs`` makes
graphs the base run instead: every policy under its bare name replays CUDA graphs, and the profile
it plans with, the SLOs and ``--load``'s capacity are all measured with graphs (the eager profile
is kept in the JSON as ``profile_eager``): the goal measured on the configuration a GPU would serve. On an accelerator (``--device cuda``) a short replay of 4
requests per policy runs first and is discarded, so the first policy timed does not pay for
kernel selection and allocator growth. With ``compile`` every replay first runs the warm-ups a
server runs before it serves, off the clock: the engine's
(:meth:`~goodspeed.verifier.engine.VerificationEngine.warm_up_steps`) and local serving's draft's
(:meth:`~goodspeed.verifier.local.LocalServing.warm_up`); the summary's ``compiled_graphs`` counts
the graphs compiled during the trace itself (0: no request waited on a compile).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

from bench.bench_attention import grouped_masked_attention, masked_attention_as
from goodspeed.launch.experiments.loadgen import make_trace, run_trace_local, summarize
from goodspeed.lm.runtime.attention import masked_attention
from goodspeed.lm.models.corpus import load_corpus, prompt_snippets
from goodspeed.lm.runtime.graphs import StepGraphs
from goodspeed.lm.models.loading import ModelLoadError, load_causal_lm
from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from goodspeed.verifier.clocks import LatencyProfile
from goodspeed.verifier.local import LocalConfig, LocalServing
from goodspeed.verifier.profiling import baseline_tpot_s, fit_error, profile_model

POLICIES = [
    ("none", {}),
    ("chain k=2", {"policy": "chain", "k": 2}),
    ("chain k=4", {"policy": "chain", "k": 4}),
    ("tetris k=2+2", {"policy": "tetris", "k": 2, "extra": 2}),
    ("adaserve B=32", {"policy": "adaserve", "budget": 32}),
    ("adaserve B=32 D=1", {"policy": "adaserve", "budget": 32, "max_depth": 1}),
    ("turbospec", {"policy": "turbospec"}),
    ("nightjar", {"policy": "nightjar"}),
]
# Run only when --policies names them: AdaServe with the budget a full batch of 16 spends under
# chain k = 2 (16 roots + 32 drafts), at depth 1 and 2.
NAMED_ONLY = [
    ("adaserve B=48 D=1", {"policy": "adaserve", "budget": 48, "max_depth": 1}),
    ("adaserve B=48 D=2", {"policy": "adaserve", "budget": 48, "max_depth": 2}),
]


def load_pair(target_spec: str, draft_spec: str, dtype: str = "float32", device: str = "cpu"):
    """``(target, draft)``, or None after saying why (a model not built yet says how to build it).
    A spec without a ``kind:`` prefix names a demo model."""
    try:
        return tuple(load_causal_lm(s if ":" in s else f"demo:{s}", dtype=dtype, device=device) for s in (target_spec, draft_spec))
    except ModelLoadError as exc:
        print(exc, file=sys.stderr)
        return None


def code_prompts(tokenizer, count: int, seed: int) -> list[list[int]]:
    """``count`` held-out code snippets, the last 32 tokens of each."""
    snippets = prompt_snippets(load_corpus().heldout_text, count, 200, seed=seed)
    return [tokenizer(s, add_special_tokens=False)["input_ids"][-32:] for s in snippets]


VARIANTS = {"gqa": " [GQA SDPA]", "pad": " [pad rows]", "graphs": " [graphs]", "compile": " [compiled]",
            "logprobs": " [logprobs 5]", "raw-draft": " [raw draft]"}  # --variants: name -> suffix of the policy's name


class RawDraftServing(LocalServing):
    """Local serving whose chains and trees are drafted without the requests' penalties and logit
    bias (the ``raw-draft`` variant): the target still applies them, so the output is the same;
    what the draft's own adjustment buys is the acceptance this loses."""

    def draft_settings(self, reqs):
        return {r.request_id: dataclasses.replace(r.sampling, presence_penalty=0.0, frequency_penalty=0.0,
                                                  repetition_penalty=1.0, logit_bias=()) for r in reqs}, {}


def replay(target, draft, profile: LatencyProfile, trace, policy: dict, max_requests: int, seed: int,
           variant: str | None = None, sampling: SamplingParams = SamplingParams()) -> tuple[dict, dict]:
    """One policy over ``trace`` on a fresh engine and local server: (its summary, its outputs).
    ``variant``: one of ``VARIANTS`` (see the module docstring). ``profile`` is the latency the
    policy plans with (the trace's SLOs were set from the eager profile, for every variant alike).
    ``sampling``: every request's settings."""
    cuda = next(target.model.parameters()).device.type == "cuda"
    engine = VerificationEngine(target.model, EngineConfig(seed=seed, pad_rows=variant == "pad",
                                                           cuda_graphs=variant in ("graphs", "compile") and cuda,
                                                           torch_compile=variant == "compile"))
    if variant == "graphs" and not cuda:  # the same fixed-shape steps, eagerly
        engine.graphs = StepGraphs(engine.model, engine.cache, capture=False)
    config = LocalConfig(**{"policy": "none", **policy}, latency=profile, max_requests=max_requests, seed=seed)
    serving = (RawDraftServing if variant == "raw-draft" else LocalServing)(engine, draft.model, config)
    if variant == "graphs" and not cuda:
        serving.draft.graphs = StepGraphs(serving.draft.model, serving.draft.cache, capture=False)
    compiled = None
    if variant == "compile":  # as a server warms up before it serves, off the clock
        from torch._dynamo.utils import counters

        engine.warm_up_steps()
        serving.warm_up()
        compiled = counters["stats"]["unique_graphs"]
    with masked_attention_as(grouped_masked_attention if variant == "gqa" else masked_attention):
        summary = summarize(run_trace_local(serving, trace, sampling, logprobs=5 if variant == "logprobs" else None))
    if compiled is not None:
        summary["compiled_graphs"] = counters["stats"]["unique_graphs"] - compiled
    t = serving.totals
    summary.update(steps=t["steps"], drafting_ms_per_step=1000 * t["drafting_s"] / max(t["steps"], 1),
                   round_ms_per_step=1000 * t["round_s"] / max(t["steps"], 1))
    return summary, {r.request_id: r.generated for r in serving.finished}


def capacity_req_s(profile: LatencyProfile, batch: int, new_tokens: int, prompt: int = 32) -> float:
    """Requests per second plain decoding serves at a full batch by the profiled target: ``batch``
    requests of ``new_tokens`` tokens each, one token each a step, at the mean context they hold
    (the prompt and half the new tokens). ``--load`` scales this, so that one load means the same
    on a slow CPU and a GPU; prefill and host work are not in it, so load 1 is past saturation."""
    step_s = float(profile.target.predict_s(batch * (prompt + new_tokens / 2), batch))
    return batch / (new_tokens * step_s)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=48)
    arrivals = ap.add_mutually_exclusive_group()
    arrivals.add_argument("--rate", type=float, nargs="+", default=None,
                          help="mean arrivals per second (several: one cell each; default 40)")
    arrivals.add_argument("--load", type=float, nargs="+", default=None,
                          help="mean arrivals as a fraction of plain decoding's profiled capacity (see capacity_req_s)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--draft", default="draft-small", help="draft model: a demo draft's name or a spec (real:smollm2-135m-draft)")
    ap.add_argument("--target", default="demo:target", help="target model spec (demo:target, real:smollm2-135m)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="both models' dtype")
    ap.add_argument("--device", default="cpu", help="both models' device (cpu, cuda, cuda:1)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--policies", default=None, help="comma-separated subset of: " + ", ".join(n for n, _ in POLICIES + NAMED_ONLY))
    ap.add_argument("--max-requests", type=int, default=16)
    ap.add_argument("--seed", type=int, nargs="+", default=[0], help="trace and engine seeds (several: one cell each)")
    ap.add_argument("--variants", nargs="+", default=[], choices=sorted(VARIANTS),
                    help="also run each policy with: gqa, masked attention as before 2026-11-26 (SDPA with enable_gqa); "
                         "pad, the engine's rows padded (EngineConfig.pad_rows); graphs, the target's steps as CUDA "
                         "graphs (EngineConfig.cuda_graphs; eagerly on a CPU); compile, those steps through a decoder "
                         "compiled by torch.compile (EngineConfig.torch_compile; captured on CUDA); logprobs, every "
                         "request asking for its tokens' log-probabilities and the top 5 (what the OpenAI API's "
                         "logprobs costs); raw-draft, drafts made without the requests' penalties (the target "
                         "applies them)")
    ap.add_argument("--repetition-penalty", type=float, default=1.0, help="every request's (greedy; 1: off)")
    ap.add_argument("--presence-penalty", type=float, default=0.0, help="every request's (greedy; 0: off)")
    ap.add_argument("--frequency-penalty", type=float, default=0.0, help="every request's (greedy; 0: off)")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="every policy replays its steps as CUDA graphs (the graphs variant as the base run), and the "
                         "profile it plans with, the SLOs and --load's capacity are measured with graphs (on CUDA)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.rate is None and args.load is None:
        args.rate = [40.0]
    if min(args.rate or args.load) <= 0 or args.requests < 1 or args.max_new_tokens < 1 or args.max_requests < 1:
        ap.error("--rate and --load must be > 0; --requests, --max-new-tokens and --max-requests >= 1")
    policies = POLICIES
    if args.policies:
        wanted = [p.strip() for p in args.policies.split(",") if p.strip()]
        unknown = sorted(set(wanted) - {n for n, _ in POLICIES + NAMED_ONLY})
        if unknown or "none" not in wanted:
            ap.error(f"--policies: unknown {unknown}" if unknown else "--policies must include none (the lossless reference)")
        policies = [(n, kw) for n, kw in POLICIES + NAMED_ONLY if n in wanted]
    try:
        sampling = SamplingParams(repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                                  frequency_penalty=args.frequency_penalty)
    except ValueError as exc:
        ap.error(str(exc))
    if "raw-draft" in args.variants and not sampling.adjusts_logits:
        ap.error("--variants raw-draft needs a penalty (--repetition-penalty, --presence-penalty or --frequency-penalty)")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    pair = load_pair(args.target, args.draft, args.dtype, args.device)
    if pair is None:
        return 1
    torch.manual_seed(0)
    target, draft = pair
    fits = {}
    for role, m in (("target", target.model), ("draft", draft.model)):
        samples, fits[role] = profile_model(m, repeats=3)
        print(f"profile {role}: delta {fits[role].delta_s * 1000:.2f} ms, gamma {fits[role].gamma_s_per_batched_token * 1e6:.1f} us/token, "
              f"alpha {fits[role].alpha_s_per_context_token * 1e9:.0f} ns/ctx token (fit error {fit_error(samples, fits[role]):.1%})", file=sys.stderr)
    profile = LatencyProfile(fits["target"], fits["draft"])
    # The graphs variant plans with what graphed forwards cost (profiled with them, on CUDA); the
    # SLOs stay the eager profile's, the same for every variant of a cell.
    base = "graphs" if args.cuda_graphs else None  # what a policy's own run (its bare name) replays with
    variants = [v for v in args.variants if v != base]
    profiles = {variant: profile for variant in (None, *variants)}
    if {"graphs", "compile"} & {base, *variants} and target.model.device.type == "cuda":
        graphed = {role: profile_model(m, repeats=3, cuda_graphs=True)[1] for role, m in (("target", target.model),
                                                                                          ("draft", draft.model))}
        profiles["graphs"] = LatencyProfile(graphed["target"], graphed["draft"])
        print(f"profile with CUDA graphs: target delta {graphed['target'].delta_s * 1000:.2f} ms, "
              f"draft delta {graphed['draft'].delta_s * 1000:.2f} ms", file=sys.stderr)
    if "compile" in variants:  # plans as the graphs do (its own profile would compile every shape of the grid)
        profiles["compile"] = profiles.get("graphs", profile)
    eager = profile
    if base:  # the base runs, their SLOs and the load plan with the graphed profile
        profile = profiles[None] = profiles.pop("graphs", profile)
    baseline_ms = baseline_tpot_s(profile.target) * 1000
    capacity = capacity_req_s(profile, args.max_requests, args.max_new_tokens)
    print(f"plain decoding's profiled capacity: {capacity:.2f} requests/s", file=sys.stderr)
    rates = args.rate or [load * capacity for load in args.load]
    # Kernel selection and allocator growth on an accelerator: off the clock, as a server's
    # warm-up would have them (compiling is each compile replay's own warm-up).
    if target.model.device.type != "cpu":
        warm = make_trace(code_prompts(target.tokenizer, 4, 0), 4, 1000.0, baseline_ms, args.max_new_tokens, seed=0)
        for _, kw in policies:
            for variant in (None, *variants):
                replay(target, draft, profiles[variant], warm, kw, args.max_requests, 0, variant or base, sampling)
    cells = []
    for rate in rates:
        for seed in args.seed:
            prompts = code_prompts(target.tokenizer, 64, seed)
            trace = make_trace(prompts, args.requests, rate, baseline_ms, args.max_new_tokens, seed=seed)
            print(f"trace: {args.requests} requests, Poisson {rate:.2f}/s (load {rate / capacity:.2f}), seed {seed}, "
                  f"{args.max_new_tokens} new tokens each, SLO classes strict {baseline_ms:.2f} / moderate {2.4 * baseline_ms:.2f} / relaxed {8 * baseline_ms:.2f} ms", file=sys.stderr)
            results, reference = {}, None
            runs = [(name, kw, variant) for name, kw in policies for variant in (None, *variants)]
            for name, kw, variant in runs:
                name += VARIANTS[variant] if variant else ""
                summary, outputs = replay(target, draft, profiles[variant], trace, kw, args.max_requests, seed, variant or base,
                                          sampling)
                if reference is None:
                    reference = outputs
                summary["lossless"] = outputs == reference
                results[name] = summary
                strict = summary["per_class"].get("strict", {}).get("attainment")
                print(f"{name}: {summary['throughput_tok_s']:.0f} tok/s, TPOT {summary['tpot_mean_ms']:.2f} ms, "
                      f"SLO {summary['slo_attainment']:.2f} (strict {'-' if strict is None else f'{strict:.2f}'}), "
                      f"ms per iteration {summary['drafting_ms_per_step']:.2f} drafting / {summary['round_ms_per_step']:.2f} round, "
                      f"lossless {summary['lossless']}"
                      + (f", graphs compiled mid-trace {summary['compiled_graphs']}" if "compiled_graphs" in summary else ""),
                      file=sys.stderr)
            cells.append({"baseline_tpot_ms": baseline_ms, "profile": profile.to_dict(), "cuda_graphs": args.cuda_graphs,
                          **({"profile_graphs": profiles["graphs"].to_dict()} if profiles.get("graphs", profile) is not profile else {}),
                          **({"profile_eager": eager.to_dict()} if eager is not profile else {}),
                          "target": args.target, "draft": args.draft,
                          "dtype": args.dtype, "device": str(target.model.device), "threads": torch.get_num_threads(),
                          "sampling": dataclasses.asdict(sampling),
                          "requests": args.requests, "rate": rate, "load": rate / capacity, "capacity_req_s": capacity, "seed": seed, "max_new_tokens": args.max_new_tokens,
                          "results": results})
            if not args.json:
                print(f"rate {rate:.2f}/s (load {rate / capacity:.2f}), seed {seed}:\n{table(cells[-1])}")
    if args.json:
        print(json.dumps(cells[0] if len(cells) == 1 else {"cells": cells}, indent=2))
    return 0 if all(r["lossless"] for c in cells for r in c["results"].values()) else 1


def table(out: dict) -> str:
    lines = ["| policy | throughput tok/s | TPOT mean ms | TPOT p99 ms | SLO strict | SLO moderate | SLO relaxed | goodput (SLO-met) tok/s | VSR | iterations "
             "| ms per iteration: drafting / target round |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in out["results"].items():
        pc = r["per_class"]
        cls = [f"{pc[c]['attainment']:.2f}" if c in pc else "-" for c in ("strict", "moderate", "relaxed")]
        vsr = f"{r['vsr']:.2f}" if r["vsr"] is not None else "-"
        lines.append(f"| {name} | {r['throughput_tok_s']:.0f} | {r['tpot_mean_ms']:.2f} | {r['tpot_p99_ms']:.2f} | {' | '.join(cls)} | "
                     f"{r['goodput_tok_s']:.0f} | {vsr} | {r['steps']} | {r['drafting_ms_per_step']:.2f} / {r['round_ms_per_step']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
