"""Speculation on the real pair: SmolLM2-135M-Instruct and the draft the project distils for it.

    python -m bench.bench_real [--only cost,single,local,service,rss] [--prompts 4] [--max-new-tokens 64] [--json]

Needs ``goodspeed models get smollm2-135m``. Sections (each a ratio within one run):

* ``cost``: one target forward with a 256-token cache vs tokens in the batch (1..64), fp32 and
  bf16, 1 and 2 threads (median of 5): where verifying more tokens stops being nearly free.
* ``single``: one drafter, greedy (T = 0) and sampled (T = 0.8): wall-clock tokens/s of
  speculation through the engine (drafting, then verifying, in one process: an edge round without
  its network time) at fixed draft lengths, against the target's own decoding (transformers'
  ``generate``, KV cache) of the same prompts, for fp32 and bf16 targets. Greedy outputs are
  checked equal to ``generate``'s.
* ``local``: the same prompts through local serving, one request at a time and 8 at once, per
  local policy (none, chain, tetris, adaserve, turbospec, nightjar): tokens/s and the mean tokens
  drafted per request per step: do TurboSpec and Nightjar speculate where it pays?
* ``service``: N = 1, 2, 4, 8 drafter processes against the gRPC verifier (the service
  benchmark's cluster, real pair): generated tokens per second of verifier time, against the same
  cluster with budget 0 (batched autoregressive decoding).
* ``rss``: peak resident memory of a verifier process with the real target and of a drafter
  process with its draft (each loads its model and runs a few forwards).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from goodspeed.drafter.prompts import load_prompts
from goodspeed.drafter.runner import DraftRunner
from goodspeed.launch.cluster.inprocess import InProcessDrafter, run_inprocess
from goodspeed.launch.spec import PROMPT_SETS
from goodspeed.lm.runtime.attention import with_cache
from goodspeed.lm.models.loading import ensure_models, load_causal_lm
from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from goodspeed.verifier.local import LOCAL_POLICIES

TARGET, DRAFT = "real:smollm2-135m", "real:smollm2-135m-draft"
SECTIONS = ("cost", "single", "local", "service", "rss")


def _prompts(tokenizer, n: int) -> list[list[int]]:
    """Half chat (the tokenizer's template), half raw code, from the shipped prompt sets."""
    chat = load_prompts(PROMPT_SETS / "chat.jsonl", tokenizer)
    code = load_prompts(PROMPT_SETS / "code.jsonl", tokenizer)
    return [p.prompt_ids for p in chat[: (n + 1) // 2] + code[: n // 2]]


@torch.inference_mode()
def cost_curve(target_spec: str, sizes=(1, 2, 4, 8, 16, 32, 64), context: int = 256, repeats: int = 5) -> dict:
    from transformers import DynamicCache

    out = {}
    for dtype in ("float32", "bfloat16"):
        # Loaded in each dtype, never cast in place: a bf16 round trip would change the fp32
        # target the later sections use.
        m = load_causal_lm(target_spec, dtype=dtype).model
        for threads in (1, 2):
            torch.set_num_threads(threads)
            cache = DynamicCache()
            m(input_ids=torch.randint(0, m.config.vocab_size, (1, context)), **with_cache(m, cache), use_cache=True)
            row = {}
            for n in sizes:
                x = torch.randint(0, m.config.vocab_size, (1, n))
                times = []
                for _ in range(repeats + 1):
                    t = time.perf_counter()
                    m(input_ids=x, **with_cache(m, cache), use_cache=True)
                    times.append(time.perf_counter() - t)
                    cache.crop(-n)
                row[n] = statistics.median(times[1:])
            out[f"{dtype}, {threads} thread{'s' if threads > 1 else ''}"] = {n: round(s * 1000, 2) for n, s in row.items()}
    torch.set_num_threads(2)
    return out


@torch.inference_mode()
def plain_decoding(model, prompts, max_new: int, sampling: SamplingParams) -> tuple[float, list[list[int]]]:
    outs, tokens, started = [], 0, time.perf_counter()
    for i, p in enumerate(prompts):
        kw = {"do_sample": False} if sampling.temperature == 0 else {"do_sample": True, "temperature": sampling.temperature, "top_k": 0}
        torch.manual_seed(i)
        gen = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=max_new,
                             min_new_tokens=max_new, pad_token_id=0, **kw)
        outs.append(gen[0, len(p):].tolist())
        tokens += len(outs[-1])
    return tokens / (time.perf_counter() - started), outs


def speculative(target, draft, prompts, max_new: int, sampling: SamplingParams, draft_len: int) -> dict:
    engine = VerificationEngine(target, EngineConfig(budget=draft_len, policy="fixed", max_draft_len=draft_len, seed=0))
    d = InProcessDrafter("one", DraftRunner(draft), prompts, sampling=sampling, max_new_tokens=max_new, seed=0)
    started = time.perf_counter()
    results = run_inprocess(engine, [d])
    wall = time.perf_counter() - started
    drafted = sum(sum(r.draft_lengths.values()) for r in results)
    accepted = sum(v.num_accepted for r in results for v in r.verdicts.values())
    tokens = sum(map(len, d.outputs))
    return {"tok_per_s": tokens / wall, "tokens_per_round": tokens / len(results), "acceptance": accepted / max(1, drafted),
            "outputs": d.outputs}


def single(target_spec: str, draft_model, prompts, max_new: int, lengths=(2, 3, 4, 6)) -> dict:
    out = {}
    for dtype in ("float32", "bfloat16"):
        target = load_causal_lm(target_spec, dtype=dtype).model
        for label, sampling in (("T=0", SamplingParams()), ("T=0.8", SamplingParams(temperature=0.8))):
            plain_tps, plain_out = plain_decoding(target, prompts, max_new, sampling)
            row = {"plain_tok_per_s": round(plain_tps, 2)}
            for s in lengths:
                r = speculative(target, draft_model, prompts, max_new, sampling, s)
                if sampling.temperature == 0 and dtype == "float32" and r["outputs"] != plain_out:
                    raise AssertionError(f"greedy speculation (S = {s}) differs from the target's own decoding")
                row[f"S={s}"] = {"tok_per_s": round(r["tok_per_s"], 2), "speedup": round(r["tok_per_s"] / plain_tps, 3),
                                 "tokens_per_round": round(r["tokens_per_round"], 3), "acceptance": round(r["acceptance"], 3)}
            out[f"{dtype}, {label}"] = row
    return out


def local(target_model, draft_model, prompts, max_new: int) -> dict:
    from goodspeed.verifier.clocks import LatencyProfile, RealClock
    from goodspeed.verifier.local import LocalConfig, LocalServing
    from goodspeed.verifier.profiling import profile_model

    profile = LatencyProfile(profile_model(target_model, repeats=2)[1], profile_model(draft_model, repeats=2)[1])
    out = {}
    for concurrency in (1, 8):
        work = [prompts[i % len(prompts)] for i in range(max(len(prompts), 2 * concurrency))]
        row = {}
        for policy in LOCAL_POLICIES:
            engine = VerificationEngine(target_model, EngineConfig(seed=0))
            serving = LocalServing(engine, draft_model, LocalConfig(policy=policy, max_requests=concurrency, k=4, budget=8 * concurrency,
                                                                    latency=profile), RealClock())
            for p in work:
                serving.submit(p, max_new_tokens=max_new)
            started, steps, drafted_per_req = time.perf_counter(), 0, []
            while (report := serving.step()) is not None:
                steps += 1
                drafted_per_req.append(report.drafted / max(1, report.requests))
            wall = time.perf_counter() - started
            stats = serving.stats()
            row[policy] = {"tok_per_s": round(stats["emitted"] / wall, 2), "mean_drafted_per_request_step": round(statistics.mean(drafted_per_req), 2),
                           "vsr": round(stats["vsr"], 3), "steps": steps}
        base = row["none"]["tok_per_s"]
        for policy in row:
            row[policy]["vs_none"] = round(row[policy]["tok_per_s"] / base, 3)
        out[f"{concurrency} at once"] = row
    return out


def service(max_new: int, prompts: int) -> dict:
    from bench.bench_service import cluster_run

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in (1, 2, 4, 8):
            spec_kw = dict(target=TARGET, draft=DRAFT, prompt_set="chat", max_draft_len=6, deadline_ms=5000)
            spec = cluster_run(n, prompts, max_new, 4 * n, Path(tmp) / f"spec{n}", **spec_kw)
            ar = cluster_run(n, prompts, max_new, 0, Path(tmp) / f"ar{n}", **spec_kw)
            out[n] = {"speculative_tok_per_verifier_s": round(spec["tok_per_verifier_s"], 2),
                      "autoregressive_tok_per_verifier_s": round(ar["tok_per_verifier_s"], 2),
                      "speedup": round(spec["tok_per_verifier_s"] / ar["tok_per_verifier_s"], 3),
                      "speculative_tok_per_wall_s": round(spec["tok_per_wall_s"], 2), "autoregressive_tok_per_wall_s": round(ar["tok_per_wall_s"], 2)}
    return out


# VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss across exec, so a child started by
# this (large) benchmark process would report the parent's peak.
RSS_SNIPPET = """
import sys, torch
from goodspeed.lm.models.loading import load_causal_lm
m = load_causal_lm(sys.argv[1]).model
with torch.inference_mode():
    for n in (1, 8, 64):
        m(input_ids=torch.zeros(1, 256 + n, dtype=torch.long))
print(next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")) / 1024)
"""


def rss() -> dict:
    out = {}
    for role, spec in (("verifier (target)", TARGET), ("drafter (draft)", DRAFT)):
        proc = subprocess.run([sys.executable, "-c", RSS_SNIPPET, spec], capture_output=True, text=True, check=True)
        out[role] = round(float(proc.stdout.strip().splitlines()[-1]), 1)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="speculation on the real pair (SmolLM2-135M-Instruct + distilled draft)")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections: {', '.join(SECTIONS)}")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    sections = [s for s in args.only.split(",") if s]
    if unknown := set(sections) - set(SECTIONS):
        parser.error(f"unknown sections: {', '.join(sorted(unknown))}")
    ensure_models([TARGET, DRAFT], log=lambda *a: print(*a, file=sys.stderr))  # stdout stays pure JSON with --json
    torch.set_num_threads(2)
    target, draft = load_causal_lm(TARGET), load_causal_lm(DRAFT)
    prompts = _prompts(target.tokenizer, args.prompts)
    report = {}
    for section in sections:
        started = time.perf_counter()
        if section == "cost":
            report[section] = cost_curve(TARGET)
        elif section == "single":
            report[section] = single(TARGET, draft.model, prompts, args.max_new_tokens)
        elif section == "local":
            report[section] = local(target.model, draft.model, prompts, args.max_new_tokens)
        elif section == "service":
            report[section] = service(args.max_new_tokens, args.prompts)
        else:
            report[section] = rss()
        print(f"[{section}: {time.perf_counter() - started:.0f} s]", file=sys.stderr)
        if not args.json:
            print(f"== {section}\n{json.dumps(report[section], indent=1)}", flush=True)
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
