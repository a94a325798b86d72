"""An edge drafter's own work a round, one request at a time: what its device spends between verdicts.

    python -m bench.bench_drafting [--draft real:smollm2-135m-draft | --random KEY=VALUE,...] [--prefixes 64 1024]
                                   [--kv growing slot [graphs] [compiled]] [--draft-len 4] [--rounds 40]
                                   [--threads 2] [--device cpu] [--json]

A round of :class:`goodspeed.drafter.runner.DraftRunner`, as ``goodspeed drafter`` runs it: apply
the last verdict (two of the ``S`` drafts accepted, then a correction token drawn from the
vocabulary), draft ``S`` tokens (the first forward feeds the correction), then pre-draft ``S`` more
after a guessed bonus token (proactive drafting; the next verdict misses it, so that KV is rolled
back): ``2 S + 1`` one-token forwards a round. The runner's draft KV (``--kv``):

* ``growing``: a transformers ``DynamicCache`` (:class:`~goodspeed.drafter.runner.GrowingDraftKV`,
  what a drafter runs without ``--cuda-graphs``);
* ``slot``: one slot of a batch draft model (:class:`~goodspeed.drafter.runner.SlotDraftKV`),
  forwards eager;
* ``graphs`` (CUDA only): the slot's forwards replayed as CUDA graphs (``--cuda-graphs``);
* ``compiled``: the slot's forwards through a decoder compiled by ``torch.compile``
  (``--torch-compile``).

``graphs`` and ``compiled`` first run the runner's warm-up (:meth:`DraftRunner.warm_up
<goodspeed.drafter.runner.DraftRunner.warm_up>`), as ``goodspeed drafter`` does before it joins.

Each variant has its own runner on the same model, prompt, verdicts and draws; their rounds
alternate (the order flipping every round), so a drift of the machine lands on all of them.
Reported per prefix (the prompt's length: the KV every forward reads) and sampling (greedy,
T = 0.8): the median wall time of a round over ``--rounds`` rounds after 3 discarded, and each
variant's median over the first's. ``--random``: a seeded random Llama of that shape
(:func:`bench.bench_tree_round.random_llama`), for a device without the real draft. The real
draft's shape: ``num_hidden_layers=4,hidden_size=128,intermediate_size=384,num_attention_heads=2,
num_key_value_heads=1,vocab_size=49152``; an edge draft of Qwen3-0.6B's layer shapes:
``num_hidden_layers=28,hidden_size=1024,intermediate_size=3072,num_attention_heads=16,
num_key_value_heads=8,vocab_size=151936``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from bench.bench_tree_round import random_llama
from goodspeed.drafter.runner import DraftRunner, SlotDraftKV
from goodspeed.lm.runtime.batch_draft import BatchDraftModel
from goodspeed.lm.models.loading import load_causal_lm
from goodspeed.lm.decoding.params import SamplingParams

ACCEPTED = 2  # drafts accepted a round (then one correction token)
WARMUP = 3
KVS = ("growing", "slot", "graphs", "compiled")


def runner_for(model: torch.nn.Module, kv: str) -> DraftRunner:
    if kv in ("graphs", "compiled"):  # warmed up as `goodspeed drafter` warms them up before it joins
        runner = DraftRunner(model, cuda_graphs=kv == "graphs", torch_compile=kv == "compiled")
        runner.warm_up()
        return runner
    runner = DraftRunner(model)
    if kv == "slot":
        runner.kv = SlotDraftKV(BatchDraftModel(model))
    return runner


def cell(model: torch.nn.Module, kvs: list[str], prefix: int, draft_len: int, n_rounds: int, sampling: SamplingParams,
         device: torch.device) -> dict[str, float]:
    """Median seconds of a round per variant: verdict applied, ``S`` drafted, ``S`` pre-drafted."""
    vocab = int(model.config.vocab_size)
    prompt = np.random.default_rng(prefix).integers(0, vocab, prefix).tolist()
    state = {}
    for kv in kvs:
        runner = runner_for(model, kv)
        runner.start(prompt)
        gen, verdicts = torch.Generator().manual_seed(0), np.random.default_rng(1)
        state[kv] = [runner, gen, verdicts, runner.draft(draft_len, sampling, gen)]
    times: dict[str, list[float]] = {kv: [] for kv in kvs}
    for i in range(WARMUP + n_rounds):
        for kv in (kvs if i % 2 else kvs[::-1]):
            runner, gen, verdicts, out = state[kv]
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            runner.apply(out.token_ids[:ACCEPTED] + [int(verdicts.integers(0, vocab))], ACCEPTED)
            out = runner.draft(draft_len, sampling, gen)
            runner.predraft(draft_len, draft_len, sampling, gen)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= WARMUP:
                times[kv].append(time.perf_counter() - started)
            state[kv][3] = out
    return {kv: statistics.median(t) for kv, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = ap.add_mutually_exclusive_group()
    source.add_argument("--draft", default="real:smollm2-135m-draft")
    source.add_argument("--random", help="a random Llama of this shape: KEY=VALUE,... (LlamaConfig fields)")
    ap.add_argument("--prefixes", type=int, nargs="+", default=[64, 1024])
    ap.add_argument("--kv", nargs="+", choices=KVS, default=["growing", "slot"])
    ap.add_argument("--draft-len", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if "graphs" in args.kv and not args.device.startswith("cuda"):
        ap.error(f"--kv graphs needs a CUDA device, not {args.device}")
    torch.set_num_threads(args.threads)
    model = random_llama(args.random, args.device) if args.random else load_causal_lm(args.draft, device=args.device).model
    device = torch.device(args.device)
    cells = []
    for prefix in args.prefixes:
        for label, sampling in (("greedy", SamplingParams()), ("T=0.8", SamplingParams(temperature=0.8))):
            medians = cell(model, args.kv, prefix, args.draft_len, args.rounds, sampling, device)
            first = medians[args.kv[0]]
            cells.append({"prefix": prefix, "sampling": label,
                          "round_ms": {kv: round(1e3 * t, 3) for kv, t in medians.items()},
                          "vs_first": {kv: round(t / first, 3) for kv, t in medians.items()}})
    result = {"draft": args.random or args.draft, "device": args.device, "threads": args.threads, "draft_len": args.draft_len,
              "rounds": args.rounds, "kv": args.kv, "cells": cells}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for c in cells:
            parts = "  ".join(f"{kv} {ms:7.2f} ms ({c['vs_first'][kv]:.3f})" for kv, ms in c["round_ms"].items())
            print(f"prefix {c['prefix']:5d} {c['sampling']:6s}  {parts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
