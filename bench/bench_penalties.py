"""What penalties and a logit bias cost the verifier a step.

    python -m bench.bench_penalties [--rows 8] [--drafted 3] [--prompt 512] [--output 256]
                                    [--vocab 2048 49152 151936] [--threads 2] [--device cpu]
                                    [--repeats 30] [--json] [--numpy]

Times :meth:`goodspeed.verifier.verify_rows.RowVerifier.verify` on random logits ``[rows, drafted
+ 1, V]`` for ``rows`` chains of ``drafted`` tokens each, greedy and sampled (T = 0.8), three ways:
no adjustment (``plain``), every row penalised (repetition 1.2, presence 0.5, frequency 0.5) with a
text of ``prompt`` prompt tokens and ``output`` generated ones (random ids), and every row with a
logit bias on 10 tokens. The adjusted rows' verification pays for a copy of the step's logits and
for :func:`goodspeed.lm.decoding.adjust.adjust_logits`, whose work grows with the tokens the settings
name, not with the vocabulary. Median of ``--repeats`` calls after two discarded, per vocabulary
size (the demo's, SmolLM2's and Qwen3's).

``--numpy`` times instead the two numpy choices inside ``adjust_logits`` against the calls they
replaced: distinct keys by sorting (``sorted_unique``) against ``np.unique`` (which hashes
integers in numpy 2) on 5,600 keys, and filling a preallocated ``[6, n]`` array against
``np.stack`` of six arrays of mixed dtypes (n = 19,000: the entries of this harness's default
penalised step). Median of ``--repeats`` after two discarded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from goodspeed.lm.decoding.history import TokenHistory, sorted_unique
from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.verifier.types import Draft
from goodspeed.verifier.verify_rows import RowInput, RowVerifier

SETTINGS = {
    "plain": {},
    "penalties": dict(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5),
    "bias": dict(logit_bias=tuple((t, 2.0) for t in range(0, 1000, 100))),
}


def rows_for(setting: str, temperature: float, args, vocab: int, rng: np.random.Generator) -> list[RowInput]:
    sampling = SamplingParams(temperature=temperature, **SETTINGS[setting])
    rows = []
    for r in range(args.rows):
        tokens = rng.integers(0, vocab, args.drafted + 1).tolist()
        dense = None
        if temperature > 0:  # the drafts' q: one-hot at each drafted token (what it is does not change the work here)
            dense = np.zeros((args.drafted, vocab), dtype=np.float32)
            dense[np.arange(args.drafted), tokens[1:]] = 1.0
        history = TokenHistory(rng.integers(0, vocab, args.prompt).tolist(), rng.integers(0, vocab, args.output).tolist())
        rows.append(RowInput(f"r{r}", tokens, Draft(0, tokens[1:], dense_probs=dense), sampling,
                             history if sampling.adjusts_logits else None))
    return rows


def median_us(call, repeats: int) -> float:
    times = []
    for i in range(repeats + 2):
        start = time.perf_counter()
        call()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def numpy_choices(repeats: int) -> list[dict]:
    """The two numpy calls ``adjust_logits`` avoids, against what it does instead (microseconds)."""
    rng = np.random.default_rng(3)
    keys = rng.integers(0, 8 * 151936, 5600)
    n = 19000
    parts = [rng.integers(0, 8, n), rng.integers(0, 4, n), rng.integers(0, 151936, n)]  # int64
    floats = [rng.random(n), rng.random(n) > 0.5, rng.random(n).astype(np.float32)]  # float64, bool, float32

    def fill():
        out = np.empty((6, n), dtype=np.float64)
        for i, x in enumerate(parts + floats):
            out[i] = x
        return out

    return [{"what": "distinct keys (5,600)", "replaced": "np.unique", "replaced_us": median_us(lambda: np.unique(keys), repeats),
             "now": "sort (sorted_unique)", "now_us": median_us(lambda: sorted_unique(keys), repeats)},
            {"what": "six arrays of 19,000, mixed dtypes", "replaced": "np.stack",
             "replaced_us": median_us(lambda: np.stack(parts + floats), repeats),
             "now": "preallocated fill", "now_us": median_us(fill, repeats)}]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--drafted", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--vocab", type=int, nargs="+", default=[2048, 49152, 151936])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--numpy", action="store_true", help="time adjust_logits' two numpy choices instead")
    args = ap.parse_args()
    if min(args.rows, args.repeats, *args.vocab) < 1 or min(args.drafted, args.prompt, args.output) < 0:
        ap.error("--rows, --repeats and --vocab must be >= 1; --drafted, --prompt and --output >= 0")
    torch.set_num_threads(args.threads)
    if args.numpy:
        choices = numpy_choices(args.repeats)
        if args.json:
            print(json.dumps({"numpy": np.__version__, "repeats": args.repeats, "results": choices}, indent=2))
        for c in [] if args.json else choices:
            print(f"{c['what']}: {c['replaced']} {c['replaced_us']:.1f} us, {c['now']} {c['now_us']:.1f} us "
                  f"({c['replaced_us'] / c['now_us']:.1f}x)")
        return 0
    generator = torch.Generator().manual_seed(0)
    device = torch.device(args.device)
    out = []
    for vocab in args.vocab:
        logits = torch.randn(args.rows, args.drafted + 1, vocab, generator=generator).to(device)
        verifier = RowVerifier(vocab, device, torch.float32, torch.Generator().manual_seed(1))
        for temperature in (0.0, 0.8):
            for setting in SETTINGS:
                rows = rows_for(setting, temperature, args, vocab, np.random.default_rng(2))
                times = []
                for i in range(args.repeats + 2):
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    start = time.perf_counter()
                    verifier.verify(rows, logits, {})  # its verdicts come back to the host: synchronous
                    if i >= 2:
                        times.append(time.perf_counter() - start)
                out.append({"vocab": vocab, "temperature": temperature, "setting": setting, "ms": 1e3 * statistics.median(times)})
                if not args.json:
                    print(f"V = {vocab:>6}, T = {temperature}, {setting:>9}: {out[-1]['ms']:.3f} ms a step")
    if args.json:
        print(json.dumps({"device": args.device, "threads": args.threads, "rows": args.rows, "drafted": args.drafted,
                          "prompt": args.prompt, "output": args.output, "results": out}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
