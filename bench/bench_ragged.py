"""What ragged rows cost a packed forward on CPU: GoodSpeed-shaped rows (draft lengths that differ)
against Fixed-S rows with the same number of tokens.

    python -m bench.bench_ragged [--target real:smollm2-135m] [--prefix 100] [--repeats 60]
                                 [--threads 1] [--json]

Two tables, fp32, medians over ``--repeats`` timed calls alternating between the shapes:

* ``forward``: a whole packed target forward (:meth:`goodspeed.lm.runtime.kv_slots.SlotKVCache.pack`, the
  engine's path, logits of every verified position gathered as the engine does) over three slots
  with ``--prefix`` committed tokens each, new rows of 5, 5, 5 tokens against 8, 5, 2;
* ``attention``: one layer's call of :func:`goodspeed.lm.runtime.attention.masked_attention` (the
  engine's masked call, its folded mask made once, as a forward makes it) on the target's heads,
  for the same rows at 105 and 400 keys: the equal rows in one call, the ragged rows padded to the longest in one call (what the packed
  forward does), and the ragged rows one call per row (no pads, a call each).

Needs the target built or fetched (``goodspeed models get smollm2-135m``, or the demo's
``demo:target`` after ``goodspeed models build-demo``).
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.bench_attention import time_alternating
from goodspeed.lm.runtime.attention import PACKED, masked_attention, use_gqa_attention, with_cache
from goodspeed.lm.runtime.kv_slots import SlotKVCache
from goodspeed.lm.models.loading import load_causal_lm

SHAPES = {"equal": [5, 5, 5], "ragged": [8, 5, 2]}  # new tokens per row: 15 either way
KEYS = (105, 400)


def forward_table(model, prefix: int, repeats: int, gen: torch.Generator) -> dict:
    """Median ms of one packed forward per row shape, the slots holding ``prefix`` tokens each."""
    rows = len(SHAPES["equal"])
    cache = SlotKVCache(model.config.num_hidden_layers)
    vocab = model.config.vocab_size

    def forward(tokens: list[list[int]], keep: bool = True):
        layout = cache.pack(tokens, [None] * rows, slice(0, rows), torch.float32)
        with torch.inference_mode():
            out = model(input_ids=layout.input_ids, attention_mask=layout.mask, position_ids=layout.position_ids,
                        **with_cache(model, cache), use_cache=True, **{PACKED: layout},
                        logits_to_keep=max(layout.keep, 1))
            if keep:
                layout.padded(out.logits, list(range(rows)))

    for slot in range(rows):
        cache.add_slot()
    for slot in range(rows):  # each slot's prefix, committed
        tokens = [[] for _ in range(rows)]
        tokens[slot] = torch.randint(0, vocab, (prefix,), generator=gen).tolist()
        forward(tokens, keep=False)
        cache.commit(slot, 0, list(range(prefix)))
    drafts = {name: [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in sizes] for name, sizes in SHAPES.items()}
    times = time_alternating({name: (lambda t=t: forward(t)) for name, t in drafts.items()}, repeats)
    return {name: us / 1e3 for name, us in times.items()}


def attention_table(heads: int, kv_heads: int, dim: int, repeats: int, gen: torch.Generator) -> dict:
    """Median us of one layer's attention call per way of running the rows, at each of ``KEYS``."""
    out = {}
    rows = len(SHAPES["equal"])
    for kv_len in KEYS:
        capacity = 1 << (kv_len - 1).bit_length()  # keys are a view of a longer pool, as the slot cache hands them
        key = torch.randn(rows, kv_heads, capacity, dim, generator=gen)[:, :, :kv_len]
        value = torch.randn(rows, kv_heads, capacity, dim, generator=gen)[:, :, :kv_len]

        def query(n_rows: int, q_len: int) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.randn(n_rows, heads, q_len, dim, generator=gen), torch.zeros(n_rows, 1, q_len, kv_len)

        longest = max(SHAPES["ragged"])
        equal, padded = query(rows, SHAPES["equal"][0]), query(rows, longest)
        per_row = [query(1, n) for n in SHAPES["ragged"]]
        folds = [{} for _ in range(2 + len(per_row))]  # filled by the warm-up calls, reused as a forward's layers do
        calls = {
            "equal_one_call": lambda: masked_attention(equal[0], key, value, equal[1], folds=folds[0]),
            "ragged_padded_one_call": lambda: masked_attention(padded[0], key, value, padded[1], folds=folds[1]),
            "ragged_call_per_row": lambda: [masked_attention(q, key[r : r + 1], value[r : r + 1], m, folds=folds[2 + r])
                                            for r, (q, m) in enumerate(per_row)],
        }
        out[kv_len] = time_alternating(calls, repeats * 5)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="real:smollm2-135m")
    parser.add_argument("--prefix", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    model = load_causal_lm(args.target).model
    use_gqa_attention(model)
    cfg = model.config
    heads = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads)
    result = {"target": args.target, "prefix": args.prefix, "threads": args.threads, "rows": SHAPES,
              "forward_ms": forward_table(model, args.prefix, args.repeats, gen),
              "attention_us": attention_table(*heads, args.repeats, gen), "heads": heads}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    fw = result["forward_ms"]
    print(f"{args.target}, prefix {args.prefix}, {args.threads} thread(s)")
    print(f"forward: rows {SHAPES['equal']} {fw['equal']:.3f} ms, rows {SHAPES['ragged']} {fw['ragged']:.3f} ms "
          f"(ragged / equal {fw['ragged'] / fw['equal']:.4f})")
    print(f"attention per layer, heads {heads[0]} / {heads[1]} x {heads[2]} (us):")
    for kv_len, t in result["attention_us"].items():
        print(f"  {kv_len:>4} keys: " + ", ".join(f"{k} {v:.1f}" for k, v in t.items()))


if __name__ == "__main__":
    main()
