"""Verification steps on CUDA: chains through flash's varlen kernel against masked SDPA, for
GoodSpeed-shaped rows (ragged draft lengths) and Fixed-S rows at the same budget C.

    python -m bench.bench_varlen [--layers 8] [--repeats 30] [--replicas 1] [--json]
    python -m bench.bench_varlen --smoke     # CPU, tiny shapes, the plain-torch kernel: checks the harness

Needs CUDA and a torch whose flash varlen op takes per-sequence key lengths (:func:`goodspeed.lm.runtime.attention.flash_varlen_kernel`).
Two tables, bf16, medians over ``--repeats`` timed calls (CUDA-synchronised, after warm-up), the
paths' calls alternating:

* ``attention``: one layer's attention call (:func:`goodspeed.lm.runtime.attention.gqa_sdpa_attention` on a
  packed layout from :meth:`goodspeed.lm.runtime.kv_slots.SlotKVCache.pack`), Qwen3-14B's heads
  (40 / 8 x 128), 8 rows at prefixes just under ``--prefixes`` (default 1,024 and 4,096), and
  flash's kernel alone on queries already regrouped (``kernel_only``: what the wrapper costs);
* ``forward``: the whole packed target forward of a randomly initialised model with Qwen3-14B's
  layer shapes (hidden 5,120, MLP 17,408, vocab 151,936) and ``--layers`` layers (the real model
  has 40; weights are random: only time is measured), the same rows, and the padded forward
  (every row padded to the longest: the engine's reference path) beside them.

Rows: budget C = 40 over 8 drafters: Fixed-S drafts S = 5 each (8 rows of 6 tokens with the bonus
position), GoodSpeed's allocation S = 1, 2, 3, 4, 5, 6, 8, 11 (the same 48 tokens, longest row 12).
``--replicas k`` repeats those 8 rows k times (8k drafters, C = 40k): a heavier step, where
attention weighs more in the forward.
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.bench_attention import time_alternating
from goodspeed.lm.runtime.attention import (PACKED, REFERENCE_VARLEN, flash_varlen_kernel, gqa_sdpa_attention, use_gqa_attention,
                                    with_cache)
from goodspeed.lm.runtime.kv_slots import SlotKVCache
from goodspeed.lm.runtime.packing import build_attention

HEADS, KV_HEADS, DIM = 40, 8, 128  # Qwen3-14B
MODEL = {"vocab_size": 151936, "hidden_size": 5120, "intermediate_size": 17408}
SHAPES = {"fixed": [5] * 8, "goodspeed": [1, 2, 3, 4, 5, 6, 8, 11]}  # draft lengths S at C = 40
PREFIXES = (1024, 4096)
DEVICE, DTYPE = "cuda", torch.bfloat16
ROWS = 8  # 8 x --replicas


def _smoke() -> None:
    """Tiny shapes on CPU in fp32 through the plain-torch kernel: the harness runs end to end."""
    global HEADS, KV_HEADS, DIM, MODEL, DEVICE, DTYPE
    HEADS, KV_HEADS, DIM, DEVICE, DTYPE = 4, 2, 16, "cpu", torch.float32
    MODEL = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 128}


def _prefixes(base: int) -> list[int]:
    step = min(37, base // 28)  # ragged below base (the pool's capacity), as sessions are
    return [base - 16 - step * (i % 8) for i in range(ROWS)]


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _timed(calls: dict, repeats: int) -> dict:
    """Median milliseconds per call of each path, their calls alternating (CUDA-synchronised)."""
    return {name: us / 1e3 for name, us in time_alternating(calls, repeats, _sync).items()}


class _Layer(torch.nn.Module):
    layer_idx = 0


def attention_table(repeats: int, kernel) -> list[dict]:
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    rows = []
    for prefix in PREFIXES:
        for shape, drafts in SHAPES.items():
            calls = {}
            for path in ("varlen", "masked"):
                cache = SlotKVCache(num_layers=1)
                cache.varlen = kernel if path == "varlen" else None
                for length in _prefixes(prefix):
                    cache.lengths.append(length)
                tokens = [[1] * (s + 1) for s in drafts * (ROWS // 8)]
                layout = cache.pack(tokens, [None] * ROWS, slice(0, ROWS), DTYPE, DEVICE)
                total = layout.input_ids.shape[1]
                new_k = torch.randn(1, KV_HEADS, total, DIM, device=DEVICE, generator=gen).to(DTYPE)
                with torch.inference_mode():
                    key, value = cache.update(new_k, new_k.clone(), 0)
                query = torch.randn(1, HEADS, total, DIM, device=DEVICE, generator=gen).to(DTYPE)
                calls[path] = (lambda q=query, k=key, v=value, lay=layout:
                               gqa_sdpa_attention(_Layer(), q, k, v, lay.mask, scaling=DIM ** -0.5, **{PACKED: lay}))
                if path == "varlen":  # the kernel alone, its queries already regrouped: what the wrapper adds
                    group = layout.groups[-1].varlen
                    flat_k, flat_v, kv_heads, capacity = cache.flat_kv(0)
                    meta = group.metadata(kv_heads, capacity, query.device)
                    regrouped = (query[0].view(kv_heads, HEADS // kv_heads, total, DIM).transpose(1, 2)
                                 .reshape(kv_heads * total, HEADS // kv_heads, DIM))
                    calls["kernel_only"] = lambda q=regrouped, k=flat_k, v=flat_v, m=meta: kernel.call(q, k, v, *m, DIM ** -0.5)
            ms = _timed(calls, repeats)
            rows.append({"prefix": prefix, "shape": shape, **ms, "varlen/masked": ms["varlen"] / ms["masked"]})
    return rows


def _model(layers: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**MODEL, num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         head_dim=DIM, max_position_embeddings=8192, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = Qwen3ForCausalLM(config).to(DTYPE).eval()
    use_gqa_attention(model)
    return model


def forward_table(layers: int, repeats: int, kernel) -> list[dict]:
    model = _model(layers)
    rows = []
    for prefix in PREFIXES:
        lengths = _prefixes(prefix)
        caches = {}
        for path in ("varlen", "masked", "padded"):
            cache = SlotKVCache(num_layers=layers)
            for length in lengths:
                cache.add_slot()
            # Fill every slot's prefix once (one padded forward of its prefix), then time steps at it.
            with torch.inference_mode():
                kv_len = cache.prepare(max(lengths), slice(0, ROWS))
                ids = torch.ones(ROWS, max(lengths), dtype=torch.long, device=DEVICE)
                mask, positions = build_attention([0] * ROWS, [None] * ROWS, max(lengths), kv_len, DTYPE, DEVICE)
                model(input_ids=ids, attention_mask=mask, position_ids=positions, **with_cache(model, cache),
                      use_cache=True, logits_to_keep=1)
            cache.lengths[:] = lengths
            cache.varlen = kernel if path == "varlen" else None
            caches[path] = cache
        for shape, drafts in SHAPES.items():
            tokens = [[1] * (s + 1) for s in drafts * (ROWS // 8)]

            def packed(cache=None, tokens=tokens):
                layout = cache.pack(tokens, [None] * ROWS, slice(0, ROWS), DTYPE, DEVICE)
                with torch.inference_mode():
                    return model(input_ids=layout.input_ids, attention_mask=layout.mask, position_ids=layout.position_ids,
                                 **with_cache(model, cache), use_cache=True, logits_to_keep=layout.keep, **{PACKED: layout})

            def padded(cache=caches["padded"], tokens=tokens):
                q_len = max(map(len, tokens))
                ids = torch.ones(ROWS, q_len, dtype=torch.long, device=DEVICE)
                kv_len = cache.prepare(q_len, slice(0, ROWS))
                mask, positions = build_attention(cache.lengths, [None] * ROWS, q_len, kv_len, DTYPE, DEVICE)
                with torch.inference_mode():
                    return model(input_ids=ids, attention_mask=mask, position_ids=positions, **with_cache(model, cache),
                                 use_cache=True)

            calls = {"varlen": lambda: packed(caches["varlen"]), "masked": lambda: packed(caches["masked"]), "padded": padded}
            if not rows:  # a fresh model's first cell runs slow for more than the 5 warm-up calls: discard a round
                _timed(calls, repeats)
            ms = _timed(calls, repeats)
            rows.append({"prefix": prefix, "shape": shape, **ms, "varlen/masked": ms["varlen"] / ms["masked"]})
    return rows


def main(argv: list[str] | None = None) -> int:
    global ROWS, PREFIXES
    parser = argparse.ArgumentParser(description="chains through flash's varlen kernel vs masked SDPA (CUDA)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--replicas", type=int, default=1, help="the 8 rows, this many times over")
    parser.add_argument("--prefixes", type=int, nargs="+", default=list(PREFIXES),
                        help="the pool capacities the rows' prefixes sit just under (powers of 2, >= 64)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, the plain-torch kernel (checks the harness)")
    args = parser.parse_args(argv)
    ROWS = 8 * args.replicas
    PREFIXES = tuple(args.prefixes)
    if args.smoke:
        _smoke()
        kernel, device = REFERENCE_VARLEN, "cpu (smoke)"
    else:
        kernel = flash_varlen_kernel()
        if not torch.cuda.is_available() or kernel is None:
            parser.error("needs CUDA and a torch whose flash varlen op takes per-sequence key lengths (or --smoke)")
        device = torch.cuda.get_device_name()
    report = {"device": device, "torch": torch.__version__, "kernel": kernel.name,
              "attention": attention_table(args.repeats, kernel),
              "forward": forward_table(args.layers, args.repeats, kernel), "layers": args.layers, "rows": ROWS}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{report['device']}, torch {report['torch']}, {report['kernel']}, {DTYPE}, ms per call (median of {args.repeats})")
    print(f"one layer's attention, {ROWS} rows, {HEADS} / {KV_HEADS} x {DIM} heads:")
    for r in report["attention"]:
        print(f"  prefix ~{r['prefix']:>4} {r['shape']:<9}: varlen {r['varlen']:.3f} (kernel alone {r['kernel_only']:.3f})  "
              f"masked {r['masked']:.3f}  varlen/masked {r['varlen/masked']:.2f}")
    print(f"whole packed forward, {args.layers} layers of hidden {MODEL['hidden_size']}:")
    for r in report["forward"]:
        print(f"  prefix ~{r['prefix']:>4} {r['shape']:<9}: varlen {r['varlen']:.2f}  masked {r['masked']:.2f}  "
              f"padded {r['padded']:.2f}  varlen/masked {r['varlen/masked']:.2f}")
    for prefix in PREFIXES:
        if prefix != PREFIXES[0]:
            by = {(r["shape"], r["prefix"]): r["varlen"] for r in report["forward"]}
            print(f"  prefix ~{prefix} / ~{PREFIXES[0]}, varlen forward: fixed {by['fixed', prefix] / by['fixed', PREFIXES[0]]:.3f}  "
                  f"goodspeed {by['goodspeed', prefix] / by['goodspeed', PREFIXES[0]]:.3f}")
        by = {(r["shape"], p): r[p] for r in report["forward"] if r["prefix"] == prefix for p in ("varlen", "masked", "padded")}
        print(f"  prefix ~{prefix}: goodspeed / fixed  varlen {by['goodspeed', 'varlen'] / by['fixed', 'varlen']:.3f}  "
              f"masked {by['goodspeed', 'masked'] / by['fixed', 'masked']:.3f}  padded {by['goodspeed', 'padded'] / by['fixed', 'padded']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
