"""What scoring a prompt costs its prefill (completions' ``echo`` with ``logprobs``).

    python -m bench.bench_prompt_scoring [--model demo:target] [--prompts 128,512,2048]
                                         [--chunks 0,256] [--tops 0,5] [--threads 2] [--repeats 5] [--json]

For each prompt length and prefill chunk (0: the whole prompt in one forward at ``StartRequest``),
times a request's prefill, from ``start_request`` to the step that completes it (every
prefill-only step in between), on an engine with no other work: plain, then with
``prompt_logprobs`` set to each ``--tops`` value (the logits of every prompt token, their
log-softmax and top-k, read to the host). Median of ``--repeats`` after one discarded; random
prompt ids (seed 0). torch runs on ``--threads`` threads so runs compare.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from goodspeed.lm.models.loading import load_causal_lm
from goodspeed.lm.decoding.params import MAX_TOP_LOGPROBS, SamplingParams
from goodspeed.verifier.engine import EngineConfig, VerificationEngine


def prefill_seconds(target, prompt: list[int], chunk: int | None, top: int | None) -> float:
    engine = VerificationEngine(target, EngineConfig(budget=0, policy="fixed", prefill_chunk=chunk, max_seq_len=len(prompt) + 8))
    sid = engine.join("scored")
    start = time.perf_counter()
    if engine.start_request(sid, prompt, SamplingParams(), 4, prompt_logprobs=top) is None:
        while not engine.prefill_step().started:
            pass
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="what scoring a prompt (echo with logprobs) costs its prefill")
    parser.add_argument("--model", default="demo:target")
    parser.add_argument("--prompts", default="128,512,2048")
    parser.add_argument("--chunks", default="0,256")
    parser.add_argument("--tops", default="0,5")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.prompts.split(",")]
    chunks = [int(x) for x in args.chunks.split(",")]
    tops = [int(x) for x in args.tops.split(",")]
    if min(lengths) < 2 or min(chunks) < 0 or args.repeats < 1 or not all(0 <= t <= MAX_TOP_LOGPROBS for t in tops):
        parser.error(f"--prompts >= 2, --chunks >= 0, --repeats >= 1, --tops in 0..{MAX_TOP_LOGPROBS}")
    torch.set_num_threads(args.threads)
    target = load_causal_lm(args.model).model
    vocab = target.get_output_embeddings().weight.shape[0]
    rng = np.random.default_rng(0)
    rows = []
    for length in lengths:
        prompt = rng.integers(0, vocab, length).tolist()
        for chunk in chunks:
            row = {"prompt": length, "chunk": chunk or None}
            for top in [None, *tops]:
                times = [prefill_seconds(target, prompt, chunk or None, top) for _ in range(args.repeats + 1)][1:]
                row["plain_ms" if top is None else f"top{top}_ms"] = 1e3 * statistics.median(times)
            rows.append(row)
            if not args.json:
                scored = "  ".join(f"top {t}: {row[f'top{t}_ms']:.1f} ms ({row[f'top{t}_ms'] / row['plain_ms']:.2f}x)" for t in tops)
                print(f"prompt {length:>5}, chunk {chunk or 'whole':>5}: plain {row['plain_ms']:.1f} ms  {scored}")
    if args.json:
        print(json.dumps({"model": args.model, "vocab": vocab, "threads": args.threads, "repeats": args.repeats, "results": rows},
                         indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
