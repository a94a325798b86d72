"""What a draft token costs on this CPU, by the draft's width, depth and output head: the drafting
side of the large recipe's choice (acceptance per unit of drafting cost).

    python -m bench.bench_draft_cost [--hidden 128,256,384] [--layers 4,6] [--heads 0,8192]
                                     [--dtype bfloat16] [--threads 1] [--context 256] [--json]

Each cell is a random-weight draft of the recipe's shape on the real target's vocabulary (49,152;
no model needs to be built): one token at a time with a KV cache after a ``--context``-token
prompt, as an edge node drafts (one torch thread, as the benchmarks pin a node). ``--heads 0`` is
the full-vocabulary head; ``8192`` a pruned head over that many tokens
(:mod:`goodspeed.lm.models.draft_head`). Median over 64 decode steps of 3 passes, the passes
interleaved across cells so drift touches every cell alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

import torch

from goodspeed.lm.models import distill
from goodspeed.lm.models.draft_head import prune_head
from goodspeed.lm.runtime.attention import with_cache
from goodspeed.lm.models.precision import cpu_has_native_bf16

VOCAB = 49_152  # SmolLM2's


def _target_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, max_position_embeddings=8192, rope_theta=100000.0, bos_token_id=1, eos_token_id=2)


def draft(hidden: int, layers: int, head: int, dtype: torch.dtype):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    recipe = dataclasses.replace(distill.DRAFT_RECIPE, hidden=hidden, layers=layers)
    model = LlamaForCausalLM(distill.draft_config(recipe, _target_config())).to(dtype).eval()
    if head:
        prune_head(model, torch.randperm(VOCAB)[:head])
    return model


@torch.inference_mode()
def decode_ms(model, context: int, steps: int = 64) -> float:
    from transformers import DynamicCache

    cache = DynamicCache()
    out = model(input_ids=torch.randint(0, VOCAB, (1, context)), **with_cache(model, cache), use_cache=True)
    token = out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        out = model(input_ids=token, **with_cache(model, cache), use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", default="128,256,384")
    ap.add_argument("--layers", default="4,6")
    ap.add_argument("--heads", default="0,8192", help="0: the full head; N: a pruned head over N tokens")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    cells = [(h, n, k) for h in map(int, args.hidden.split(",")) for n in map(int, args.layers.split(","))
             for k in map(int, args.heads.split(","))]
    models = {c: draft(*c, dtype) for c in cells}
    runs = {c: [] for c in cells}
    for _ in range(args.passes):
        for c in cells:
            runs[c].append(decode_ms(models[c], args.context))
    rows = [{"hidden": h, "layers": n, "head": k or VOCAB, "params": sum(p.numel() for p in models[(h, n, k)].parameters()),
             "ms_per_token": round(statistics.median(runs[(h, n, k)]), 3), "passes": [round(x, 3) for x in runs[(h, n, k)]]}
            for h, n, k in cells]
    report = {"command": " ".join(["python -m bench.bench_draft_cost", *(argv if argv is not None else sys.argv[1:])]), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": platform.processor() or platform.machine(), "native_bf16": cpu_has_native_bf16(), "dtype": args.dtype,
              "threads": args.threads, "context": args.context, "rows": rows}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{'hidden':>6} {'layers':>6} {'head':>6} {'params':>11} {'ms/token':>9}")
        for r in rows:
            print(f"{r['hidden']:>6} {r['layers']:>6} {r['head']:>6} {r['params']:>11,} {r['ms_per_token']:>9.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
