"""What a sampled draft weighs on the wire, with and without the proposal cap (``proposal_top_k``).

    python -m bench.bench_wire [--pair real|demo] [--temperature 0.8] [--draft-len 4] [--json]

A sampled draft carries its ``q`` (the residual needs all of it): dense, ``S x V`` floats, or
sparse, (id, prob) pairs of its support. With ``proposal_top_k = k`` the drafter samples from, and
sends, only q's ``k`` likeliest tokens a position (:func:`goodspeed.lm.decoding.sampling.cap_support`;
lossless, tests/verifier/test_lossless.py). For each ``k`` this drafts ``--draft-len`` tokens after
each of the shipped prompt sets' first prompts (the drafter's own runner and serialiser) and
reports the ``DraftRequest``'s bytes, the time they take on a 10 and a 100 Mbit/s link, and the
acceptance the capped q keeps: the mean of ``sum_v min(p(v), q'(v))`` (the chance a position's
token is accepted, ``p`` the target's distribution under the same sampling) over the positions of
the uncapped drafts, the same positions for every ``k``.

``--pair real`` (default; needs ``goodspeed models get smollm2-135m``) uses SmolLM2-135M-Instruct
(V = 49,152) and its distilled draft; ``--pair demo`` the demo target and ``draft-distilled``
(V = 2,048). One thread; about a minute on the real pair.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from goodspeed.drafter.runner import DraftRunner
from goodspeed.drafter.serde import draft_to_pb
from goodspeed.drafter.prompts import load_prompts
from goodspeed.launch.spec import prompt_set_path
from goodspeed.lm.models.loading import load_causal_lm
from goodspeed.lm.decoding.sampling import cap_support, process_logits
from goodspeed.lm.decoding.params import SamplingParams

PAIRS = {"real": ("real:smollm2-135m", "real:smollm2-135m-draft"), "demo": ("demo:target", "demo:draft-distilled")}
CAPS = (0, 1024, 256, 64)
SETS = ("code", "docstrings", "comments", "project", "chat")
PROMPTS_PER_SET = 4


def measure(pair: str, temperature: float, draft_len: int) -> list[dict]:
    target = load_causal_lm(PAIRS[pair][0])
    draft = load_causal_lm(PAIRS[pair][1])
    sampling = SamplingParams(temperature=temperature)
    prompts = [p.prompt_ids for name in SETS for p in load_prompts(prompt_set_path(name), target.tokenizer)[:PROMPTS_PER_SET]]
    # The positions: each prompt's uncapped draft; there p (target) and q (draft, whole) per position.
    pq = []
    for i, prompt in enumerate(prompts):
        runner = DraftRunner(draft.model, proposal_top_k=0)
        runner.start(prompt)
        out = runner.draft(draft_len, sampling, torch.Generator().manual_seed(i))
        with torch.inference_mode():
            logits = target.model(input_ids=torch.tensor([prompt + out.token_ids])).logits[0].double()
        pq.append((process_logits(logits[len(prompt) - 1 : len(prompt) - 1 + draft_len], sampling), out.probs.double()))
    rows = []
    for k in CAPS:
        sizes, kept = [], []
        for i, (prompt, (p, q)) in enumerate(zip(prompts, pq)):
            runner = DraftRunner(draft.model, proposal_top_k=k)
            runner.start(prompt)
            out = runner.draft(draft_len, sampling, torch.Generator().manual_seed(i))
            sizes.append(draft_to_pb("s" * 32, 1, out, sampling).ByteSize())
            kept += torch.minimum(p, cap_support(q, k)).sum(-1).tolist()  # the same positions for every k
        size = float(np.median(sizes))
        rows.append({"proposal_top_k": k, "bytes_median": size, "bytes_max": max(sizes),
                     "ms_at_10mbit": size * 8 / 10e6 * 1e3, "ms_at_100mbit": size * 8 / 100e6 * 1e3,
                     "acceptance": float(np.mean(kept)), "drafts": len(sizes), "vocab": int(out.probs.shape[-1])})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_wire", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", choices=sorted(PAIRS), default="real")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--draft-len", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = measure(args.pair, args.temperature, args.draft_len)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{args.pair} pair, V = {rows[0]['vocab']}, T = {args.temperature}, S = {args.draft_len}, {rows[0]['drafts']} drafts")
    print("| proposal_top_k | DraftRequest bytes (median / max) | at 10 Mbit/s | at 100 Mbit/s | acceptance kept |")
    print("|---|---|---|---|---|")
    for r in rows:
        k = "0 (whole q)" if r["proposal_top_k"] == 0 else r["proposal_top_k"]
        print(f"| {k} | {r['bytes_median']:,.0f} / {r['bytes_max']:,} | {r['ms_at_10mbit']:.2f} ms | {r['ms_at_100mbit']:.3f} ms "
              f"| {r['acceptance']:.4f} |")


if __name__ == "__main__":
    main()
