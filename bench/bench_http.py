"""Streaming overhead of the OpenAI API on an edge node: what the application sees vs the node.

    python -m bench.bench_http [--requests 24] [--max-tokens 64] [--target T --draft D] [--json]

A verifier (the demo target by default, pinned to CPU 0) and an edge node (``goodspeed drafter
--serve`` with the distilled demo draft, pinned to CPU 1) run as separate processes, one torch thread each. The
official ``openai`` client streams greedy completions of the shipped code prompts one after
another, recording when each server-sent event arrives. The node's own figures come from its
``/metrics`` (``goodspeed:time_to_first_token_seconds`` and ``..._inter_token_latency_seconds``,
measured from the moment the request is admitted until its verdicts arrive). The ratios say what
the HTTP path (the client library, the loopback socket, parsing, tokenizing, detokenizing, SSE
framing) adds. The same requests then go through a minimal client (``http.client``), which
separates the openai library's own time from the server's.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch
from prometheus_client.parser import text_string_to_metric_families

from goodspeed.lm.models.demo import build_demo

PROMPTS = Path(__file__).resolve().parent.parent / "launch" / "prompts" / "code.jsonl"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(cmd: list[str], cpu: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    pin = ["taskset", "-c", str(cpu)] if shutil.which("taskset") and os.cpu_count() and os.cpu_count() > 1 else []
    return subprocess.Popen(pin + cmd, stdout=subprocess.DEVNULL, stderr=open(log, "w"), env=env)


def wait_http(port: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"nothing serves on port {port} after {timeout_s} s")


def node_totals(port: int) -> dict[str, float]:
    """The node's latency histograms so far: ``{"ttft": (sum, count), "itl": (sum, count)}``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}
    return {key: (values[f"goodspeed:{name}_sum"], values[f"goodspeed:{name}_count"])
            for key, name in (("ttft", "time_to_first_token_seconds"), ("itl", "inter_token_latency_seconds"))}


def mean_between(before: dict, after: dict, key: str) -> float:
    """The node's mean over the observations made between two scrapes."""
    return (after[key][0] - before[key][0]) / (after[key][1] - before[key][1])


def raw_client(port: int, model: str, prompts: list[str], requests: int, max_tokens: int) -> tuple[list[float], list[float]]:
    """The same requests through a minimal client (http.client, one kept-alive connection, SSE
    lines read as they come): what the server path costs without the openai library's own time."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    ttfts, gaps = [], []
    for i in range(requests):
        body = json.dumps({"model": model, "prompt": prompts[i % len(prompts)], "max_tokens": max_tokens, "temperature": 0,
                           "stream": True, "ignore_eos": True})
        sent = time.perf_counter()
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response, times = connection.getresponse(), []
        while (line := response.readline()) and not line.startswith(b"data: [DONE]"):
            if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0]["text"]:
                times.append(time.perf_counter())
        response.read()
        ttfts.append(times[0] - sent)
        gaps += [b - a for a, b in zip(times, times[1:])]
    connection.close()
    return ttfts, gaps


def run(requests: int, max_tokens: int, target: str = "demo:target", draft: str = "demo:draft-distilled") -> dict:
    import openai

    from goodspeed.lm.models.loading import ensure_models

    build_demo(progress=False, log=lambda *a: None)
    ensure_models([target, draft], log=lambda *a: print(*a, file=sys.stderr))  # stdout stays pure JSON with --json
    torch.set_num_threads(1)
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()]
    grpc_port, http_port = free_port(), free_port()
    cli = [sys.executable, "-m", "goodspeed.launch.cli"]
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    verifier = start(cli + ["verifier", "--target", target, "--port", str(grpc_port), "--seed", "0"], 0, logs / "bench_http_verifier.log")
    node = start(cli + ["drafter", "--verifier", f"127.0.0.1:{grpc_port}", "--draft", draft, "--name", "bench",
                        "--serve", f"127.0.0.1:{http_port}", "--seed", "0"], 1, logs / "bench_http_node.log")
    try:
        wait_http(http_port)
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", max_retries=0)
        model = api.models.list().data[0].id
        api.completions.create(model=model, prompt=prompts[0], max_tokens=8, temperature=0)  # warm-up, not measured
        base = node_totals(http_port)
        ttfts, gaps, chunks, tokens = [], [], 0, 0
        for i in range(requests):
            sent = time.perf_counter()
            times = []
            stream = api.completions.create(model=model, prompt=prompts[i % len(prompts)], max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    times.append(time.perf_counter())
                if chunk.usage is not None:
                    tokens += chunk.usage.completion_tokens
            ttfts.append(times[0] - sent)
            gaps += [b - a for a, b in zip(times, times[1:])]
            chunks += len(times)
        after = node_totals(http_port)
        raw_ttfts, raw_gaps = raw_client(http_port, model, prompts, requests, max_tokens)
        after_raw = node_totals(http_port)
    finally:
        for proc in (node, verifier):
            proc.send_signal(signal.SIGTERM)
        for proc in (node, verifier):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    # the node's means over the measured requests only (its counters include the warm-up)
    node_ttft, node_itl = mean_between(base, after, "ttft"), mean_between(base, after, "itl")
    raw_node_ttft, raw_node_itl = mean_between(after, after_raw, "ttft"), mean_between(after, after_raw, "itl")
    client_ttft, client_itl = statistics.fmean(ttfts), statistics.fmean(gaps)
    raw_ttft, raw_itl = statistics.fmean(raw_ttfts), statistics.fmean(raw_gaps)
    return {
        "target": target, "draft": draft, "requests": requests, "max_tokens": max_tokens, "tokens": tokens, "chunks": chunks,
        "node_steps": int(sum(after[k][1] - base[k][1] for k in ("ttft", "itl"))),
        "client_ttft_ms": round(client_ttft * 1e3, 3), "node_ttft_ms": round(node_ttft * 1e3, 3),
        "ttft_ratio": round(client_ttft / node_ttft, 4),
        "client_itl_ms": round(client_itl * 1e3, 3), "node_itl_ms": round(node_itl * 1e3, 3),
        "itl_ratio": round(client_itl / node_itl, 4),
        "raw_ttft_ms": round(raw_ttft * 1e3, 3), "raw_node_ttft_ms": round(raw_node_ttft * 1e3, 3),
        "raw_ttft_ratio": round(raw_ttft / raw_node_ttft, 4),
        "raw_itl_ms": round(raw_itl * 1e3, 3), "raw_node_itl_ms": round(raw_node_itl * 1e3, 3),
        "raw_itl_ratio": round(raw_itl / raw_node_itl, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--target", default="demo:target")
    parser.add_argument("--draft", default="demo:draft-distilled")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = run(args.requests, args.max_tokens, args.target, args.draft)
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['requests']} streamed requests, {result['tokens']} tokens in {result['chunks']} chunks "
          f"({result['node_steps']} node steps)")
    print(f"time to first token : client {result['client_ttft_ms']:.2f} ms, node {result['node_ttft_ms']:.2f} ms, "
          f"ratio {result['ttft_ratio']:.3f}")
    print(f"inter-token latency : client {result['client_itl_ms']:.2f} ms, node {result['node_itl_ms']:.2f} ms, "
          f"ratio {result['itl_ratio']:.3f}")
    print(f"minimal client      : time to first token ratio {result['raw_ttft_ratio']:.3f} "
          f"({result['raw_ttft_ms']:.2f} vs {result['raw_node_ttft_ms']:.2f} ms), inter-token {result['raw_itl_ratio']:.3f}")


if __name__ == "__main__":
    main()
