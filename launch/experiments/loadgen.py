"""Load generation for local serving: Poisson arrivals with mixed TPOT-SLO classes.

The classes follow AdaServe's Table 2 (arXiv 2501.12162, Section 6.1): a strict class whose TPOT SLO is
the *baseline latency* (plain decoding's per-iteration latency, profiled at batch 8), a moderate
one and a relaxed one. AdaServe's absolute values for Llama-2-7B are 12.5 / 30 / 100 ms, so the
moderate and relaxed SLOs here are 2.4x and 8x the baseline, whatever this machine's baseline is.

The same trace runs against a verifier over gRPC (:func:`run_trace_grpc`, the ``goodspeed
loadgen`` command) or in-process on a :class:`~goodspeed.verifier.local.LocalServing`
(:func:`run_trace_local`, used by the benchmark), and :func:`summarize` reports throughput, mean
and p99 TPOT, SLO attainment per class, goodput of the SLO-meeting requests, and VSR.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from goodspeed.lm.decoding.params import SamplingParams

SLO_CLASSES = {"strict": 1.0, "moderate": 2.4, "relaxed": 8.0}  # TPOT SLO / baseline latency


@dataclass(frozen=True)
class TraceItem:
    request_id: str
    arrival_s: float  # since the trace started
    prompt_ids: list[int]
    slo_class: str
    tpot_slo_ms: float
    max_new_tokens: int


def make_trace(prompts: Sequence[Sequence[int]], num_requests: int, rate_per_s: float, baseline_tpot_ms: float,
               max_new_tokens: int, shares: dict[str, float] | None = None, seed: int = 0) -> list[TraceItem]:
    """``num_requests`` requests with exponential inter-arrival times (rate ``rate_per_s``); each
    draws a prompt and an SLO class (by ``shares``, default equal) independently."""
    if num_requests < 1 or rate_per_s <= 0 or baseline_tpot_ms <= 0 or max_new_tokens < 1 or not prompts:
        raise ValueError("need num_requests >= 1, rate > 0, baseline_tpot_ms > 0, max_new_tokens >= 1 and prompts")
    shares = shares or {c: 1.0 for c in SLO_CLASSES}
    unknown = set(shares) - set(SLO_CLASSES)
    if unknown or any(v < 0 for v in shares.values()) or sum(shares.values()) <= 0:
        raise ValueError(f"shares must be >= 0 over the classes {list(SLO_CLASSES)}")
    rng = np.random.default_rng(seed)
    names = list(shares)
    p = np.array([shares[n] for n in names], dtype=np.float64)
    arrivals = np.cumsum(rng.exponential(1.0 / rate_per_s, num_requests))
    arrivals -= arrivals[0]  # the first request opens the trace
    out = []
    for i, t in enumerate(arrivals):
        cls = names[int(rng.choice(len(names), p=p / p.sum()))]
        prompt = list(prompts[int(rng.integers(len(prompts)))])
        out.append(TraceItem(f"r{i}", float(t), prompt, cls, baseline_tpot_ms * SLO_CLASSES[cls], max_new_tokens))
    return out


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(records: list[dict]) -> dict:
    """``records``: one per request with ``slo_class``, ``tpot_slo_ms``, ``tpot_s``, ``new_tokens``,
    ``drafted``, ``accepted``, ``arrival`` and ``finished_at`` (seconds, one clock)."""
    done = [r for r in records if r.get("tpot_s") is not None]
    if not done:
        raise ValueError("no request produced tokens")
    start = min(r["arrival"] for r in records)
    makespan = max(r["finished_at"] for r in done) - start
    tokens = sum(r["new_tokens"] for r in done)
    tpots_ms = [r["tpot_s"] * 1000 for r in done]
    met = [r for r in done if r["tpot_s"] * 1000 <= r["tpot_slo_ms"]]
    per_class = {}
    for cls in SLO_CLASSES:
        mine = [r for r in records if r["slo_class"] == cls]
        if mine:
            ok = sum(1 for r in mine if r.get("tpot_s") is not None and r["tpot_s"] * 1000 <= r["tpot_slo_ms"])
            per_class[cls] = {"requests": len(mine), "tpot_slo_ms": mine[0]["tpot_slo_ms"], "attainment": ok / len(mine)}
    drafted = sum(r["drafted"] for r in done)
    return {
        "requests": len(records), "completed": len(done), "makespan_s": makespan, "tokens": tokens,
        "throughput_tok_s": tokens / makespan if makespan > 0 else None,
        "tpot_mean_ms": float(np.mean(tpots_ms)), "tpot_p99_ms": _percentile(tpots_ms, 99),
        "slo_attainment": len(met) / len(records), "per_class": per_class,
        "goodput_tok_s": sum(r["new_tokens"] for r in met) / makespan if makespan > 0 else None,
        "vsr": sum(r["accepted"] for r in done) / drafted if drafted else None,
    }


def run_trace_local(serving, trace: Sequence[TraceItem], sampling: SamplingParams = SamplingParams(), progress=None,
                    logprobs: int | None = None) -> list[dict]:
    """Replay ``trace`` on a :class:`LocalServing` under its own clock (real or simulated):
    requests are submitted when their arrival time comes, the batch steps in between.
    ``logprobs``: every request asks for its tokens' log-probabilities and that many top ones."""
    clock = serving.clock
    t0 = clock.now()
    pending = sorted(trace, key=lambda it: it.arrival_s)
    meta, i = {}, 0
    while i < len(pending) or serving.has_work:
        while i < len(pending) and pending[i].arrival_s <= clock.now() - t0:
            it = pending[i]
            rid = serving.submit(it.prompt_ids, sampling, it.max_new_tokens, tpot_slo_ms=it.tpot_slo_ms, request_id=it.request_id,
                                 logprobs=logprobs)
            meta[rid] = it
            i += 1
        if not serving.has_work:
            clock.wait_until(t0 + pending[i].arrival_s)
            continue
        serving.step()
        if progress is not None:
            progress(len(serving.finished), len(pending))
    out = []
    for req in serving.finished:
        it = meta[req.request_id]
        out.append({**req.summary(), "slo_class": it.slo_class, "tpot_slo_ms": it.tpot_slo_ms})
    return out


async def run_trace_grpc(address: str, trace: Sequence[TraceItem], sampling: SamplingParams = SamplingParams(),
                         ignore_eos: bool = True, progress=None, token: str | None = None, tls=None) -> list[dict]:
    """Replay ``trace`` against a verifier's Generate RPC in real time (one stream per request)."""
    import grpc

    from goodspeed.serving.aio import within
    from goodspeed.drafter.credentials import bearer_metadata, open_aio_channel
    from goodspeed.launch import generate
    from goodspeed.proto.goodspeed.v1 import goodspeed_pb2_grpc as pb_grpc

    done = 0

    async with open_aio_channel(address, tls) as channel:
        try:  # as `goodspeed generate` waits: said after a moment, then an error, never a silent stall
            try:
                await within(channel.channel_ready(), generate.SAY_WAITING_AFTER_S)
            except asyncio.TimeoutError:
                print(f"goodspeed loadgen: waiting for a verifier at {address} (up to {generate.CONNECT_TIMEOUT_S:.0f} s)",
                      file=sys.stderr)
                await within(channel.channel_ready(), generate.CONNECT_TIMEOUT_S - generate.SAY_WAITING_AFTER_S)
        except asyncio.TimeoutError:
            raise ConnectionError(f"no verifier answers at {address}") from None
        stub = pb_grpc.VerifierStub(channel)
        t0 = time.perf_counter()

        async def one(it: TraceItem) -> dict:
            nonlocal done
            await asyncio.sleep(max(0.0, t0 + it.arrival_s - time.perf_counter()))
            req = generate.generate_request(prompt_ids=it.prompt_ids, max_new_tokens=it.max_new_tokens, temperature=sampling.temperature,
                                   top_k=sampling.top_k, top_p=sampling.top_p, tpot_slo_ms=it.tpot_slo_ms, ignore_eos=ignore_eos,
                                   request_id=it.request_id)
            arrival = time.perf_counter()
            rec = {"request_id": it.request_id, "slo_class": it.slo_class, "tpot_slo_ms": it.tpot_slo_ms, "arrival": arrival - t0,
                   "new_tokens": 0, "tpot_s": None, "ttft_s": None, "drafted": 0, "accepted": 0, "finish_reason": None}
            try:
                async for chunk in stub.Generate(req, metadata=bearer_metadata(token)):
                    if chunk.token_ids and rec["ttft_s"] is None:
                        rec["ttft_s"] = time.perf_counter() - arrival
                    rec["new_tokens"] += len(chunk.token_ids)
                    if chunk.finished:
                        rec.update(tpot_s=chunk.tpot_s or None, drafted=chunk.num_drafted, accepted=chunk.num_accepted,
                                   finish_reason=chunk.finish_reason)
            except grpc.aio.AioRpcError as exc:
                rec["finish_reason"] = f"error: {exc.code().name}: {exc.details()}"
            rec["finished_at"] = time.perf_counter() - t0
            done += 1
            if progress is not None:
                progress(done, len(trace))
            return rec

        return list(await asyncio.gather(*(one(it) for it in trace)))
