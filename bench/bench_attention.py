"""The attention of verification rows on CPU, per layer call: the engine's call (``folded``:
``lm.runtime.attention.masked_attention``, SDPA with the grouped-query heads folded into the query
dimension, its folded mask made beforehand, as a forward makes it once for all its layers) against
SDPA with ``enable_gqa`` over the rows' own mask (``sdpa``, what the engine called before
2026-11-26) and the matmul form (``matmul``: :func:`matmul_attention`, what the engine ran for rows
of 2-32 queries on CPU from 2026-11-25 to 11-26). Each returns transformers' layout of the output.

    python -m bench.bench_attention [--threads 2] [--repeats 100] [--json]

Two tables, fp32, medians over ``--repeats`` calls, the two kernels' calls alternating:

* ``warm``: one layer's shapes on the same keys every call (they stay in the CPU's caches), for
  the demo target's heads (4 / 2 x 32) and SmolLM2's (9 / 3 x 64), rows x queries x keys from one
  query per row through verification rows to prompt chunks;
* ``cold``: 8 rows x 5 queries over 1,029 keys with every call on the next of 4 layers' own keys
  and values (as a forward reads them, 17 MB for the demo target's heads): what the
  engine sees at prefix 1024, and the memory traffic that bounds it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from goodspeed.lm.runtime import attention
from goodspeed.lm.runtime.attention import masked_attention

HEADS = {"demo": (4, 2, 32), "smollm2": (9, 3, 64)}  # query heads, key heads, head dim
WARM = [(8, 1, 69), (8, 2, 300), (8, 5, 69), (8, 5, 1029), (8, 8, 1029), (8, 16, 300), (8, 32, 300),
        (4, 5, 4000), (1, 128, 1200), (1, 512, 2048)]  # rows, queries per row, keys


def matmul_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """The matmul form the engine ran for rows of 2-32 queries on CPU (2026-11-25 to 11-26): two
    matmuls with the query heads of each key head folded into the query dimension, ``query``
    ``[rows, heads, q_len, dim]`` -> ``[rows, heads, q_len, dim]``."""
    rows, heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    q = (query * (dim ** -0.5 if scale is None else scale)).reshape(rows, kv_heads, groups * q_len, dim)
    scores = torch.matmul(q, key.transpose(-1, -2))  # [rows, kv_heads, groups * q_len, kv_len]
    scores.view(rows, kv_heads, groups, q_len, kv_len).add_(mask.unsqueeze(2))
    out = torch.matmul(torch.softmax(scores, dim=-1), value)
    return out.view(rows, kv_heads, groups, q_len, dim).reshape(rows, heads, q_len, dim)


def grouped_masked_attention(query, key, value, mask, dropout=0.0, scale=None, folds=None):
    """``lm.runtime.attention.masked_attention`` as it ran before 2026-11-26, before it folded grouped-query
    heads: SDPA with ``enable_gqa`` over the rows' own mask (on CUDA, the math kernel). The benches
    swap it in (:func:`masked_attention_as`) to replay that path."""
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scale,
                                         enable_gqa=query.shape[1] > key.shape[1])
    return out.transpose(1, 2).contiguous()


@contextmanager
def masked_attention_as(fn):
    """Every masked attention call (the engine's and the draft models') made by ``fn`` inside the
    block: the attention function reads ``goodspeed.lm.runtime.attention.masked_attention`` per call."""
    before = attention.masked_attention
    attention.masked_attention = fn
    try:
        yield
    finally:
        attention.masked_attention = before


def _inputs(rows: int, q_len: int, kv_len: int, heads: int, kv_heads: int, dim: int, gen: torch.Generator):
    capacity = 1 << (kv_len - 1).bit_length()  # keys are a view of a longer pool, as the slot cache hands them
    key = torch.randn(rows, kv_heads, capacity, dim, generator=gen)[:, :, :kv_len]
    value = torch.randn(rows, kv_heads, capacity, dim, generator=gen)[:, :, :kv_len]
    query = torch.randn(heads, rows, q_len, dim, generator=gen).transpose(0, 1)
    allowed = torch.rand(rows, q_len, kv_len, generator=gen) < 0.9
    allowed[..., 0] = True
    mask = torch.zeros(rows, q_len, kv_len).masked_fill_(~allowed, torch.finfo(torch.float32).min).unsqueeze(1)
    return query, key, value, mask


def time_alternating(calls: dict, repeats: int, sync=lambda: None) -> dict:
    """Median microseconds per call of each kernel, their calls alternating after 5 warm-up calls
    each; ``sync`` runs before and after every timed call (a device's synchronisation)."""
    for fn in calls.values():
        for _ in range(5):
            fn()
    times: dict[str, list] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def _kernels(layers: list):
    """The three kernels over ``layers`` (one input tuple each), each call on the next layer's inputs."""
    state = {"matmul": 0, "sdpa": 0, "folded": 0}
    folds = [{} for _ in layers]  # filled by the warm-up calls, reused as a forward's layers do

    def call(name):
        def run():
            i = state[name] % len(layers)
            query, key, value, mask = layers[i]
            state[name] += 1
            if name == "folded":
                return masked_attention(query, key, value, mask, folds=folds[i])
            if name == "matmul":
                out = matmul_attention(query, key, value, mask)
            else:
                out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=query.shape[1] > key.shape[1])
            return out.transpose(1, 2).contiguous()  # each in transformers' layout, as masked_attention returns it
        return run
    return {name: call(name) for name in state}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="verification rows' CPU attention: folded SDPA vs SDPA with enable_gqa vs the matmul form")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    report: dict = {"threads": args.threads, "warm": [], "cold": []}
    for model, (heads, kv_heads, dim) in HEADS.items():
        for rows, q_len, kv_len in WARM:
            us = time_alternating(_kernels([_inputs(rows, q_len, kv_len, heads, kv_heads, dim, gen)]), args.repeats)
            report["warm"].append({"heads": model, "rows": rows, "q_len": q_len, "kv_len": kv_len, **us})
        layers = [_inputs(8, 5, 1029, heads, kv_heads, dim, gen) for _ in range(4)]
        us = time_alternating(_kernels(layers), args.repeats)
        kv_bytes = 2 * 8 * kv_heads * 1029 * dim * 4  # one layer's keys and values
        report["cold"].append({"heads": model, "rows": 8, "q_len": 5, "kv_len": 1029, "layers": 4, "kv_mb_per_layer": kv_bytes / 1e6,
                               **us, "matmul_gb_per_s": kv_bytes / (us["matmul"] * 1e-6) / 1e9,
                               "sdpa_gb_per_s": kv_bytes / (us["sdpa"] * 1e-6) / 1e9})
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"warm (same keys each call), {args.threads} threads, us per call:")
    for r in report["warm"]:
        print(f"  {r['heads']:<8} {r['rows']:>2} rows x {r['q_len']:>3} queries x {r['kv_len']:>4} keys: "
              f"matmul {r['matmul']:8.0f}  sdpa {r['sdpa']:8.0f}  folded {r['folded']:8.0f}  "
              f"matmul/sdpa {r['matmul'] / r['sdpa']:.2f}  folded/sdpa {r['folded'] / r['sdpa']:.2f}")
    print("cold (each call on the next of 4 layers' keys and values), us per call:")
    for r in report["cold"]:
        print(f"  {r['heads']:<8} 8 x 5 x 1029, {r['kv_mb_per_layer']:.1f} MB of KV per layer: matmul {r['matmul']:.0f} "
              f"({r['matmul_gb_per_s']:.1f} GB/s)  sdpa {r['sdpa']:.0f} ({r['sdpa_gb_per_s']:.1f} GB/s)  "
              f"folded {r['folded']:.0f}  matmul/sdpa {r['matmul'] / r['sdpa']:.2f}  folded/sdpa {r['folded'] / r['sdpa']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
