"""``goodspeed profile``: measure forward times on this machine and fit TurboSpec's latency model.

TurboSpec (arXiv 2406.14066, Section 4.1.3, eq. 3) models one forward as
``T_fwd = alpha * N_context + gamma * N_batched + delta`` and fits it offline, once per model and
machine. The samples here go through the same path serving uses (a slot KV cache, an additive
4-D mask, the grouped-query SDPA function): ``b`` rows, each with ``c`` tokens of context, each
verifying or drafting ``q`` new tokens, so ``N_context = b * c`` and ``N_batched = b * q``. Every
point is the median of ``repeats`` timed forwards after a warm-up.

The profile also records the baseline per-token latency AdaServe's strict SLO class uses: plain
decoding (one token per request) at batch 8 with 32-token prompts (its Section 6.1), predicted
from the fitted target model.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from goodspeed.scheduler import LatencyModel, fit_latency_model
from goodspeed.lm.runtime.batch_draft import BatchDraftModel

BASELINE_BATCH, BASELINE_PROMPT = 8, 32


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_model(model: torch.nn.Module, batch_sizes=(1, 2, 4, 8), contexts=(32, 128), query_lens=(1, 2, 4, 8),
                  repeats: int = 5, progress: Callable[[str], None] | None = None,
                  cuda_graphs: bool = False, torch_compile: bool = False) -> tuple[list[dict], LatencyModel]:
    """Timed forwards over a grid; returns the samples and the fitted eq. (3). ``cuda_graphs``:
    the forwards replayed as CUDA graphs (:mod:`goodspeed.lm.runtime.graphs`; the warm-up captures each
    shape), so the model fits what serving with graphs costs; ``torch_compile``: through a
    compiled decoder at fixed shapes (the warm-up compiles each shape), likewise."""
    if repeats < 1 or not batch_sizes or not contexts or not query_lens:
        raise ValueError("need repeats >= 1 and non-empty grids")
    max_pos = int(getattr(model.config, "max_position_embeddings", 1 << 30))
    if max(contexts) + max(query_lens) > max_pos:
        raise ValueError(f"context {max(contexts)} + query {max(query_lens)} exceeds the model's {max_pos} positions")
    runner = BatchDraftModel(model, cuda_graphs=cuda_graphs, torch_compile=torch_compile)
    vocab = runner.vocab_size
    samples = []
    for b in batch_sizes:
        for c in contexts:
            keys = [f"p{b}-{c}-{i}" for i in range(b)]
            for key in keys:
                runner.add(key)
            gen = torch.Generator().manual_seed(b * 1000 + c)
            runner.catch_up({k: torch.randint(0, vocab, (c,), generator=gen).tolist() for k in keys})
            for q in query_lens:
                feed = {k: torch.randint(0, vocab, (q,), generator=gen).tolist() for k in keys}
                runner._forward(feed)  # warm-up; nothing is committed, so the context stays c
                times = []
                for _ in range(repeats):
                    _sync(runner.device)
                    t0 = time.perf_counter()
                    runner._forward(feed)
                    _sync(runner.device)
                    times.append(time.perf_counter() - t0)
                samples.append({"batch": b, "context": c, "query": q, "num_context_tokens": b * c,
                                "num_batched_tokens": b * q, "latency_s": statistics.median(times)})
                if progress is not None:
                    progress(f"b={b} ctx={c} q={q}: {samples[-1]['latency_s'] * 1000:.2f} ms")
            for key in keys:
                runner.remove(key)
    fitted = fit_latency_model([s["num_context_tokens"] for s in samples], [s["num_batched_tokens"] for s in samples],
                               [s["latency_s"] for s in samples])
    return samples, fitted


def baseline_tpot_s(target: LatencyModel) -> float:
    """Plain decoding's per-token latency at AdaServe's profiling point (batch 8, 32-token prompts)."""
    return float(target.predict_s(BASELINE_BATCH * BASELINE_PROMPT, BASELINE_BATCH))


def fit_error(samples: list[dict], model: LatencyModel) -> float:
    """Mean relative error of the fit over its samples."""
    errs = [abs(float(model.predict_s(s["num_context_tokens"], s["num_batched_tokens"])) - s["latency_s"]) / s["latency_s"] for s in samples]
    return sum(errs) / len(errs)
