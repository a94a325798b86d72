"""Memory of an edge node drafting with a lookup alone (no draft model loaded).

    python -m bench.bench_node_memory [--pair real|demo] [--draft suffix] [--requests 24] [--json PATH]

A verifier (``goodspeed verifier``) and an edge node (``goodspeed drafter --draft suffix
--tokenizer TARGET --serve``) run as separate processes; the node serves the per-task workload's
chat requests (``bench/workloads/tasks.jsonl``, cycled) one after another, so its suffix cache
fills with their outputs. Reported: the node's resident set size (``VmRSS``) after warm-up and
after each request and after them all, its peak (``VmHWM``), and those of a bare Python interpreter started the same
way (``python -c``): the runtime the goal is stated above; and whether the node has torch's
library mapped (a lookup alone should not load it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.bench_http import free_port, wait_http
from bench.bench_workloads import PAIRS, Servers, load_tasks, post


def status_kb(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


def loads_torch(pid: int) -> bool:
    """Whether the process has torch's library mapped (``/proc/PID/maps``)."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def bare_python_kb() -> dict[str, int]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(1.0)
        return status_kb(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", choices=sorted(PAIRS), default="real")
    parser.add_argument("--draft", default="suffix")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--json", default=None)
    parser.add_argument("--logs", default="goodspeed-runs/bench-node-memory")
    args = parser.parse_args(argv)
    target, _ = PAIRS[args.pair]
    from goodspeed.lm.models.loading import ensure_models

    ensure_models([target])
    out = Path(args.logs)
    out.mkdir(parents=True, exist_ok=True)
    tasks = load_tasks()
    gs = [sys.executable, "-m", "goodspeed.launch.cli"]
    grpc_port, http_port = free_port(), free_port()
    with Servers(out) as servers:
        servers.spawn(gs + ["verifier", "--target", target, "--port", str(grpc_port)], "0", 1, "verifier")
        servers.spawn(gs + ["drafter", "--verifier", f"127.0.0.1:{grpc_port}", "--draft", args.draft, "--tokenizer", target,
                            "--serve", f"127.0.0.1:{http_port}", "--no-proactive"], "1", 1, "node")
        wait_http(http_port, 600)
        node_pid = servers.procs[1].pid
        post(http_port, tasks[0], 8)
        warm = status_kb(node_pid)
        by_request = []  # the node's VmRSS after each request, with its category
        for i in range(args.requests):
            task = tasks[i % len(tasks)]
            post(http_port, task, args.max_tokens)
            by_request.append({"category": task["category"], "VmRSS_kb": status_kb(node_pid)["VmRSS"]})
        served = status_kb(node_pid)
        torch_loaded = loads_torch(node_pid)
    bare = bare_python_kb()
    report = {"command": " ".join(["python -m bench.bench_node_memory", *(argv if argv is not None else sys.argv[1:])]),
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": {"cpus": os.cpu_count(), "uname": " ".join(os.uname())},
              "target": target, "draft": args.draft, "requests": args.requests, "bare_python_kb": bare,
              "node_after_warm_up_kb": warm, "node_after_requests_kb": served, "torch_loaded": torch_loaded,
              "rss_by_request": by_request,
              "rss_above_python_mb": round((served["VmRSS"] - bare["VmRSS"]) / 1024, 1),
              "peak_above_python_mb": round((served["VmHWM"] - bare["VmRSS"]) / 1024, 1)}
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
