"""What a step's log-probabilities cost the verifier (the OpenAI API's ``logprobs``).

    python -m bench.bench_logprobs [--rows 8] [--positions 3] [--vocab 2048 49152 151936] [--threads 2]
                                   [--device cpu] [--repeats 30] [--json]

Times :func:`goodspeed.verifier.verify_rows.committed_logprobs` on random logits ``[rows, positions
+ 1, V]``: ``rows`` requests asking, each with ``positions`` committed tokens this step (what a
step of drafts two-thirds accepted commits), for each vocabulary size (the demo's, SmolLM2's and
Qwen3's), with no top tokens and with the top 5, each without and with the tokens' ranks (which
only prompt scores compute: vLLM's ``prompt_logprobs``). Median of ``--repeats`` calls after two
discarded, the variants interleaved. This is the work a step adds when requests ask; the rest of
the step is unchanged.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from goodspeed.verifier.verify_rows import committed_logprobs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--positions", type=int, default=3)
    ap.add_argument("--vocab", type=int, nargs="+", default=[2048, 49152, 151936])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if min(args.rows, args.positions, args.repeats, *args.vocab) < 1:
        ap.error("--rows, --positions, --repeats and --vocab must be >= 1")
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    out = []
    for vocab in args.vocab:
        logits = torch.randn(args.rows, args.positions + 1, vocab, generator=generator).to(args.device)
        variants = [(top, ranks) for top in (0, 5) for ranks in (False, True)]
        asks = {top: [(r, list(range(args.positions)), [1] * args.positions, top) for r in range(args.rows)] for top in (0, 5)}
        times: dict[tuple[int, bool], list[float]] = {v: [] for v in variants}
        for i in range(args.repeats + 2):
            for top, ranks in variants:  # interleaved: a machine's drift falls on every variant alike
                wanted = asks[top]
                if args.device != "cpu":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                committed_logprobs(logits, wanted, ranks=ranks)  # ends with copies to the host: synchronous
                if i >= 2:
                    times[top, ranks].append(time.perf_counter() - start)
        for top, ranks in variants:
            out.append({"vocab": vocab, "top": top, "ranks": ranks, "tokens": args.rows * args.positions,
                        "ms": 1e3 * statistics.median(times[top, ranks])})
            if not args.json:
                print(f"V = {vocab:>6}, top {top}{', ranks' if ranks else ''}: {out[-1]['ms']:.3f} ms for {out[-1]['tokens']} tokens")
    if args.json:
        print(json.dumps({"device": args.device, "threads": args.threads, "results": out}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
