"""Measurements of the distributed service (gRPC verifier + drafter processes) on the demo models.

    python -m bench.bench_service [--drafters 8] [--prompts 4] [--max-new-tokens 48] [--json]

* uplink bytes per drafted token: serialized DraftRequest size / S for greedy drafts (token ids
  only), top-k 20 sampling (sparse q) and untruncated sampling, its q whole (dense) and capped to
  the drafter's default proposal_top_k (sparse), from real drafts of the distilled demo draft;
* through the real service (``goodspeed launch`` with N drafter processes of the distilled draft,
  greedy): the verifier's non-forward share of its round work (verify + send), and server
  throughput — generated tokens per second of verifier time (prefill + rounds, from the JSON
  log) — against the same cluster with budget 0 (batched autoregressive decoding). The verifier
  is pinned to CPU 0 and every drafter to CPU 1 (one thread each), as separate edge devices would
  be; wall-clock figures still include the drafters sharing one core.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from goodspeed.drafter.runner import DraftRunner
from goodspeed.drafter.serde import draft_to_pb
from goodspeed.launch.cluster.local import launch_local
from goodspeed.launch.spec import DrafterSpec, LaunchSpec, VerifierSpec
from goodspeed.lm.models.demo import build_demo
from goodspeed.lm.models.loading import load_causal_lm
from goodspeed.lm.decoding.params import PROPOSAL_TOP_K, SamplingParams
from goodspeed.verifier.records import RoundRecord

MODES = {  # (sampling, the drafter's proposal_top_k)
    "greedy": (SamplingParams(), PROPOSAL_TOP_K),
    "top-k 20, T 0.8 (sparse q)": (SamplingParams(temperature=0.8, top_k=20), PROPOSAL_TOP_K),
    "T 1.0 (dense q: proposal_top_k 0)": (SamplingParams(temperature=1.0), 0),
    f"T 1.0 (capped q: proposal_top_k {PROPOSAL_TOP_K})": (SamplingParams(temperature=1.0), PROPOSAL_TOP_K),
}


def uplink_bytes(draft_len: int = 4, drafts: int = 20) -> dict:
    draft = load_causal_lm("demo:draft-distilled")
    prompt = draft.tokenizer("def main(argv):\n    parser = ")["input_ids"]
    out = {}
    for mode, (sampling, cap) in MODES.items():
        runner = DraftRunner(draft.model, cap)
        runner.start(prompt)
        gen = torch.Generator().manual_seed(0)
        sizes = []
        for r in range(drafts):
            d = runner.draft(draft_len, sampling, gen)
            sizes.append(draft_to_pb("code#0", r, d, sampling).ByteSize() / draft_len)
            runner.apply(d.token_ids[:2] + [d.token_ids[2]], 2)
        out[mode] = statistics.median(sizes)
    out["vocab_size"] = draft.model.config.vocab_size
    return out


def cluster_run(drafters: int, prompts: int, max_new: int, budget: int, out_dir: Path, target: str = "demo:target",
                draft: str = "demo:draft-distilled", prompt_set: str = "code", max_draft_len: int = 16, deadline_ms: float = 500) -> dict:
    spec = LaunchSpec(
        VerifierSpec(target=target, budget=budget, policy="goodspeed" if budget else "fixed", round_deadline_ms=deadline_ms, cpus=(0,),
                     max_draft_len=max_draft_len),
        (DrafterSpec(name="d", draft=draft, prompts=prompt_set, max_new_tokens=max_new, count=drafters, max_prompts=prompts, cpus=(1,)),),
    )
    summary = launch_local(spec, out_dir, log=lambda *a: None, live=False)
    events = [json.loads(line) for line in (out_dir / "verifier.log").read_text().splitlines() if line.startswith("{")]
    rounds = [r for r in (RoundRecord.from_event(e) for e in events if e["event"] == "round") if r.drafters]
    prefill_s = sum(e["prefill_s"] for e in events if e["event"] == "start")
    work = [r.verify_s + r.send_s for r in rounds]
    verifier_s = sum(work) + prefill_s
    return {
        "tokens": summary["tokens"],
        "rounds": len(rounds),
        "mean_batch": statistics.mean(r.batch for r in rounds),
        "verifier_s": verifier_s,
        "tok_per_verifier_s": summary["tokens"] / verifier_s,
        "wall_s": summary["wall_s"],
        "tok_per_wall_s": summary["tokens"] / summary["wall_s"],
        "non_forward_share": statistics.median(1 - r.forward_s / (r.verify_s + r.send_s) for r in rounds),
        "median_receive_s": statistics.median(r.receive_s for r in rounds),
        "median_round_work_s": statistics.median(work),
        "exit_codes": sorted({r["exit_code"] for r in summary["drafters"].values()}),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="distributed-service measurements on the demo models")
    parser.add_argument("--drafters", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    build_demo(log=lambda *a: None)
    report = {"uplink_bytes_per_drafted_token": uplink_bytes()}
    with tempfile.TemporaryDirectory() as tmp:
        for name, budget in (("speculative", 4 * args.drafters), ("autoregressive", 0)):
            report[name] = cluster_run(args.drafters, args.prompts, args.max_new_tokens, budget, Path(tmp) / name)
    report["speedup_per_verifier_s"] = report["speculative"]["tok_per_verifier_s"] / report["autoregressive"]["tok_per_verifier_s"]
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    up = report["uplink_bytes_per_drafted_token"]
    print(f"uplink bytes per drafted token (V = {up['vocab_size']}):")
    for mode in MODES:
        print(f"  {mode:<28} {up[mode]:>10.1f}")
    for name in ("speculative", "autoregressive"):
        r = report[name]
        print(f"{name:<15} tokens {r['tokens']}, rounds {r['rounds']}, mean batch {r['mean_batch']:.1f}, "
              f"{r['tok_per_verifier_s']:.1f} tok/s of verifier time, {r['tok_per_wall_s']:.1f} tok/s wall, "
              f"non-forward share {r['non_forward_share']:.1%}")
    print(f"speculative / autoregressive per verifier second: {report['speedup_per_verifier_s']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
