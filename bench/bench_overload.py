"""Past capacity: what local serving, or an edge node, does at 0.5x to 4x the load it can carry.

    python -m bench.bench_overload [--pair demo|real] [--through local|edge] [--policy goodput]
                                   [--loads 0.5,1,2,4] [--window-s 30] [--max-new-tokens 32]
                                   [--max-local-requests 8] [--max-local-waiting 8]
                                   [--admissions count,slo] [--dtype auto] [--json PATH]

One verifier (``goodspeed verifier --local-draft DRAFT``, both CPUs, two torch threads) serves
Generate requests, once for each ``--local-admission`` in ``--admissions`` (one after the other); this process is the load generator (``goodspeed loadgen``'s trace and client:
Poisson arrivals, strict / moderate / relaxed TPOT SLOs).

1. **Baseline and capacity.** ``--max-local-requests`` requests at once (the queue must hold them:
   ``--max-local-waiting`` at least as many): their mean TPOT is the baseline the SLO classes scale
   (AdaServe's baseline is plain decoding's at batch 8; here the served policy's at the batch
   cap), and the requests per second of their makespan is the capacity.
2. **Each load.** Poisson arrivals at ``load x capacity`` for ``--window-s`` seconds. Per load:
   goodput (tokens/s of the requests that met their SLO, over the makespan), throughput, the SLO
   attainment of the admitted (completed) requests, TPOT p99, time to first token (p50, p99; it
   holds the queueing), and refusals (RESOURCE_EXHAUSTED: the wait queue was full) with the
   time they took to be refused (median, slowest, and how many took over 50 ms).

``--through edge``: the same through one edge node instead (``goodspeed drafter --draft suffix
--serve --admission RULE``, pinned to CPU 1, in front of a verifier pinned to CPU 0, one torch
thread each), ``--max-local-requests`` and ``--max-local-waiting`` being the node's
``--max-concurrency`` and ``--max-waiting``; the requests are streamed completions over its HTTP
API (prompt token ids, ``ignore_eos``, ``tpot_slo_ms``), a 429 is a refusal, and a request's TPOT
is its client's: from its first token to its last, over the tokens after the first.

The capacity from a burst understates what steady arrivals sustain (the batch drains as the
burst's requests end together), so the loads are multiples of it and the peak is the highest
goodput over the loads (``goodput_vs_peak``). The goals it reports against (issue: *Under load*):
at 2x and 4x, goodput >= 90% of the peak, admitted requests' attainment >= 90%, every refusal
within 50 ms. The refusal time is the client's: this process sends the load on the same two
cores, so at high rates its own scheduling is part of it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.bench_http import free_port, wait_http
from bench.bench_workloads import PAIRS, Servers
from goodspeed.launch.experiments.loadgen import make_trace, run_trace_grpc
from goodspeed.lm.models.precision import resolve_dtype


def wait_serving(address: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                if health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise RuntimeError(f"no verifier serving at {address} after {timeout_s:g} s")


def prompts_of(target: str, count: int = 16) -> list[list[int]]:
    from goodspeed.launch.commands import _prompt_ids
    from goodspeed.launch.spec import prompt_set_path

    return _prompt_ids(prompt_set_path("chat", "bench"), target)[:count]


def run(address: str, prompts, count: int, rate: float, baseline_ms: float, max_new: int, seed: int, send_slo: bool = True) -> list[dict]:
    trace = make_trace(prompts, count, rate, baseline_ms, max_new, seed=seed)
    if address.startswith("http://"):
        return asyncio.run(run_trace_http(address, trace, send_slo))
    return asyncio.run(run_trace_grpc(address, trace))


async def run_trace_http(url: str, trace, send_slo: bool = True) -> list[dict]:
    """``trace`` replayed in real time against an OpenAI front's streamed completions, one
    connection a request; records as :func:`~goodspeed.launch.experiments.loadgen.run_trace_grpc`'s
    (a 429 is ``error: RESOURCE_EXHAUSTED``), the TPOT the client's. ``send_slo``: each request
    carries its ``tpot_slo_ms`` (a node admitting by count refuses one; its attainment is still
    counted against it here)."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as http:
        async with http.get(f"{url}/v1/models") as reply:
            model = (await reply.json())["data"][0]["id"]
        t0 = time.perf_counter()

        async def one(it) -> dict:
            await asyncio.sleep(max(0.0, t0 + it.arrival_s - time.perf_counter()))
            arrival = time.perf_counter()
            rec = {"request_id": it.request_id, "slo_class": it.slo_class, "tpot_slo_ms": it.tpot_slo_ms, "arrival": arrival - t0,
                   "new_tokens": 0, "tpot_s": None, "ttft_s": None, "drafted": 0, "accepted": 0, "finish_reason": None}
            body = {"model": model, "prompt": it.prompt_ids, "max_tokens": it.max_new_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            if send_slo:
                body["tpot_slo_ms"] = it.tpot_slo_ms
            first = last = None
            try:
                async with http.post(f"{url}/v1/completions", json=body) as reply:
                    if reply.status != 200:
                        text = await reply.text()
                        kind = "RESOURCE_EXHAUSTED" if reply.status == 429 else f"HTTP {reply.status}"
                        rec["finish_reason"] = f"error: {kind}: {text[:200]}"
                    else:
                        async for raw in reply.content:
                            line = raw.decode().strip()
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            chunk = json.loads(line[6:])
                            if chunk.get("choices") and chunk["choices"][0].get("text"):
                                last = time.perf_counter()
                                first = first or last
                            if chunk.get("usage"):
                                rec["new_tokens"] = chunk["usage"]["completion_tokens"]
                            if chunk.get("choices") and chunk["choices"][0].get("finish_reason"):
                                rec["finish_reason"] = chunk["choices"][0]["finish_reason"]
            except aiohttp.ClientError as exc:
                rec["finish_reason"] = f"error: {type(exc).__name__}: {exc}"
            if first is not None and rec["new_tokens"] > 1 and not (rec["finish_reason"] or "").startswith("error"):
                rec["ttft_s"] = first - arrival
                rec["tpot_s"] = (last - first) / (rec["new_tokens"] - 1)
            rec["finished_at"] = time.perf_counter() - t0
            return rec

        return list(await asyncio.gather(*(one(it) for it in trace)))


def level(records: list[dict], load: float, rate: float) -> dict:
    """One load's figures (module docstring)."""
    done = [r for r in records if r["tpot_s"] is not None]
    refused = [r for r in records if (r["finish_reason"] or "").startswith("error: RESOURCE_EXHAUSTED")]
    failed = [r for r in records if r["tpot_s"] is None and r not in refused]
    start = min(r["arrival"] for r in records)
    makespan = max(r["finished_at"] for r in records) - start
    met = [r for r in done if r["tpot_s"] * 1000 <= r["tpot_slo_ms"]]

    def pct(values, q):
        return round(float(np.percentile(values, q)), 4) if values else None

    refusal_ms = [(r["finished_at"] - r["arrival"]) * 1000 for r in refused]
    ttft = [r["ttft_s"] for r in done if r["ttft_s"] is not None]
    return {"load": load, "offered_req_s": round(rate, 4), "served_req_s": round(len(done) / makespan, 4),
            "requests": len(records), "completed": len(done),
            "refused": len(refused), "failed": len(failed), "makespan_s": round(makespan, 2),
            "goodput_tok_s": round(sum(r["new_tokens"] for r in met) / makespan, 2),
            "throughput_tok_s": round(sum(r["new_tokens"] for r in done) / makespan, 2),
            "admitted_attainment": round(len(met) / len(done), 4) if done else None,
            "tpot_p99_ms": pct([r["tpot_s"] * 1000 for r in done], 99),
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "refusal_ms_p50": pct(refusal_ms, 50), "refusal_ms_max": round(max(refusal_ms), 2) if refusal_ms else None,
            "refusals_over_50ms": sum(ms > 50 for ms in refusal_ms)}


def one_run(args, admission: str, target: str, draft: str, dtype: str, loads, logs: Path, prompts, say) -> dict:
    """Start a verifier with ``--local-admission admission`` (or a verifier and an edge node with
    ``--admission admission``), measure its baseline and capacity, then each load."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    gs = [sys.executable, "-m", "goodspeed.launch.cli"]
    cores = ",".join(str(c) for c in range(min(2, os.cpu_count() or 1)))
    with Servers(logs) as servers:
        if args.through == "edge":
            http_port = free_port()
            servers.spawn(gs + ["verifier", "--target", target, "--port", str(port), "--dtype", dtype], "0", 1,
                          f"verifier-edge-{admission}")
            servers.spawn(gs + ["drafter", "--verifier", address, "--draft", "suffix", "--tokenizer", target, "--serve",
                                f"127.0.0.1:{http_port}", "--max-concurrency", str(args.max_local_requests), "--max-waiting",
                                str(args.max_local_waiting), "--admission", admission, "--connect-timeout-s", "900"],
                          "1" if (os.cpu_count() or 1) > 1 else "0", 1, f"node-{admission}")
            address = f"http://127.0.0.1:{http_port}"
            wait_http(http_port, 900)
        else:
            servers.spawn(gs + ["verifier", "--target", target, "--port", str(port), "--local-draft", draft, "--local-policy",
                                args.policy, "--max-local-requests", str(args.max_local_requests), "--max-local-waiting",
                                str(args.max_local_waiting), "--local-admission", admission, "--dtype", dtype], cores, 2,
                          f"verifier-{admission}")
            wait_serving(address, 900)
        send_slo = args.through == "local" or admission == "slo"
        run(address, prompts, 2, 1e6, 1000.0, 8, args.seed, send_slo)  # warm-up
        at_once = run(address, prompts, args.max_local_requests, 1e6, 1e6, args.max_new_tokens, args.seed, send_slo)
        if any(r["tpot_s"] is None for r in at_once):
            raise RuntimeError(f"a request failed at the batch cap: {[r['finish_reason'] for r in at_once]}")
        baseline_ms = float(np.mean([r["tpot_s"] for r in at_once])) * 1000
        capacity = len(at_once) / (max(r["finished_at"] for r in at_once) - min(r["arrival"] for r in at_once))
        say(f"{admission}: baseline TPOT {baseline_ms:.1f} ms and capacity {capacity:.3f} requests/s at {args.max_local_requests} requests")
        levels = []
        for i, load in enumerate(loads):
            rate = load * capacity
            count = max(2, round(rate * args.window_s))
            levels.append(level(run(address, prompts, count, rate, baseline_ms, args.max_new_tokens, args.seed + 10 + i, send_slo),
                                load, rate))
            say(f"{admission}: {json.dumps(levels[-1])}")
    peak = max(lv["goodput_tok_s"] for lv in levels)
    return {"baseline_tpot_ms": round(baseline_ms, 3), "capacity_req_s": round(capacity, 4), "levels": levels,
            "goodput_vs_peak": {str(lv["load"]): round(lv["goodput_tok_s"] / peak, 4) for lv in levels} if peak else None}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", choices=tuple(PAIRS), default="demo")
    parser.add_argument("--through", choices=("local", "edge"), default="local",
                        help="local serving on the verifier, or one edge node (--draft suffix) in front of it")
    parser.add_argument("--policy", default="goodput")
    parser.add_argument("--loads", default="0.5,1,2,4")
    parser.add_argument("--window-s", type=float, default=30.0)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--max-local-requests", type=int, default=8)
    parser.add_argument("--max-local-waiting", type=int, default=8)
    parser.add_argument("--admissions", default="count,slo", help="--local-admission (or the node's --admission) rules to run, "
                        "one server each")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.max_local_waiting < args.max_local_requests:
        parser.error("--max-local-waiting must hold --max-local-requests requests (they are sent at once to measure capacity)")
    target, draft = PAIRS[args.pair]
    dtype = str(resolve_dtype(args.dtype, "cpu", target)).removeprefix("torch.")
    loads = [float(x) for x in args.loads.split(",") if x]
    logs = Path(tempfile.mkdtemp(prefix="bench-overload-"))
    prompts = prompts_of(target)
    say = lambda message: print(f"overload bench: {message}", file=sys.stderr, flush=True)  # noqa: E731
    started = time.time()
    runs = {}
    for admission in [a for a in args.admissions.split(",") if a]:
        runs[admission] = one_run(args, admission, target, draft, dtype, loads, logs, prompts, say)
    result = {"pair": args.pair, "through": args.through, "policy": args.policy if args.through == "local" else "suffix node", "dtype": dtype, "max_new_tokens": args.max_new_tokens,
              "max_local_requests": args.max_local_requests, "max_local_waiting": args.max_local_waiting,
              "window_s": args.window_s, "runs": runs, "seconds": round(time.time() - started, 1),
              "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
