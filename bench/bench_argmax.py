"""The greedy argmax over a step's logits on a CPU: torch's own against the path
:func:`goodspeed.lm.decoding.sampling.argmax_last` takes (numpy, bfloat16 widened to float32 first).

    python -m bench.bench_argmax [--repeats 200] [--json PATH]

One torch thread; the median of ``--repeats`` calls per shape: a batch-8 and a batch-1 step of
the real target (49,152 bfloat16 logits a row) and a greedy round's verification on the demo
target (8 x 5 rows of 2,048 float32 logits).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from bench.bench_penalties import median_us
from goodspeed.lm.decoding.sampling import argmax_last

SHAPES = {"real step, batch 8 (bf16)": ((8, 49152), torch.bfloat16), "real step, batch 1 (bf16)": ((1, 49152), torch.bfloat16),
          "demo round, 8 x 5 rows (fp32)": ((8, 5, 2048), torch.float32)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for name, (shape, dtype) in SHAPES.items():
        x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
        assert torch.equal(argmax_last(x), x.argmax(dim=-1))
        rows.append({"shape": name, "torch_us": round(median_us(lambda: x.argmax(dim=-1), args.repeats), 1),
                     "argmax_last_us": round(median_us(lambda: argmax_last(x), args.repeats), 1)})
        print(f"{name}: torch {rows[-1]['torch_us']} us, argmax_last {rows[-1]['argmax_last_us']} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(["python -m bench.bench_argmax", *(argv if argv is not None else sys.argv[1:])]),
                       "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                       "machine": {"cpus": os.cpu_count(), "uname": " ".join(os.uname()), "torch": torch.__version__},
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
