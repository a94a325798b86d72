"""A draft that adapts to the traffic it serves against one that does not: an edge node's
(``goodspeed drafter --adapt``) or local serving's (``goodspeed verifier --local-draft-adapt``).

    python -m bench.bench_adapt [--where edge|local] [--pair real|demo] [--requests 200] [--block 25]
                                [--max-tokens 64] [--adapt-every 16] [--dtype auto] [--json PATH] [--logs DIR]

``--where edge`` (the default): one verifier (``goodspeed verifier``, pinned to CPU 0, one torch
thread) and two edge nodes (``goodspeed drafter --serve``, pinned to CPU 1, one torch thread each): ``adapt`` with
``--adapt``, ``shipped`` without. The traffic is one domain the shipped draft was not built on:
chat requests of a cooking assistant (``COOKING``: templates over dishes, in an order fixed by
the seed). Both nodes get the same requests in the same order, in blocks of ``--block`` taken in
turn (shipped, adapt, shipped, ...); after each adapt block the bench waits until no fine-tune
runs (``goodspeed:drafter_adapting``), so the other node's block never shares CPU 1 with one.
Both draft ``--draft-length allotted`` (each round the verifier's ``S_i``), so acceptance is
measured on the same draft lengths.

``--where local``: two verifiers serving local requests, each drafting with the pair's draft
model and chain ``k = 4`` (``--local-policy chain``, its default), one request at a time: ``adapt``
with ``--local-draft-adapt`` (pinned to CPU 1), ``shipped`` without (CPU 0), one torch thread
each; blocks as above, the wait reading ``goodspeed:local_draft_adapting``. A fine-tune there
shares the adapting verifier's one core with its requests, as it would on a verifier of one core.

Per block and node: acceptance (accepted / drafted tokens, from the node's
``goodspeed:spec_decode_*`` counters) and request latency (median and mean wall seconds); per
fine-tune the guard's figures (the adapt node's log). Greedy: each reply of the adapt node must
equal the shipped node's (lossless; counted).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.bench_http import free_port, wait_http
from bench.bench_workloads import PAIRS, Servers, post, text_of
from goodspeed.lm.models.precision import resolve_dtype

TEMPLATES = ("Give me a simple recipe for {}.", "How long should I cook {}?", "What goes well with {}?",
             "List the ingredients I need for {}.", "How do I store leftover {}?", "Suggest a vegetarian version of {}.",
             "What is the most common mistake when making {}?", "How can I make {} healthier?")
DISHES = ("pancakes", "lasagna", "tomato soup", "fried rice", "banana bread", "chicken curry", "risotto", "guacamole",
          "beef stew", "apple pie", "pad thai", "omelette", "chili", "falafel", "mashed potatoes", "carrot cake",
          "ramen", "paella", "hummus", "meatballs", "pesto pasta", "lentil soup", "tacos", "quiche", "brownies")


def cooking(count: int, seed: int) -> list[dict]:
    """``count`` chat tasks of one domain (templates x dishes, shuffled by ``seed``)."""
    pool = [t.format(d) for t in TEMPLATES for d in DISHES]
    random.Random(seed).shuffle(pool)
    return [{"id": f"cook-{i}", "category": "cooking", "messages": [{"role": "user", "content": pool[i % len(pool)]}]}
            for i in range(count)]


def metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("goodspeed:"):
            name, _, value = line.rpartition(" ")
            out[name] = out.get(name, 0.0) + float(value)
    return out


def counter(m: dict[str, float], name: str) -> float:
    return sum(v for k, v in m.items() if k == f"goodspeed:{name}" or k.startswith(f"goodspeed:{name}{{"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--where", choices=("edge", "local"), default="edge",
                        help="an edge node's --adapt, or local serving's --local-draft-adapt")
    parser.add_argument("--pair", choices=tuple(PAIRS), default="real")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--block", type=int, default=25)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--adapt-every", type=int, default=16)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--logs", type=Path, help="where the processes' logs go (default: a new temporary directory)")
    args = parser.parse_args(argv)
    target, draft = PAIRS[args.pair]
    dtype = str(resolve_dtype(args.dtype, "cpu", target)).removeprefix("torch.")
    tasks = cooking(args.requests, args.seed)
    out = args.logs or Path(tempfile.mkdtemp(prefix="bench-adapt-"))  # the processes' logs
    out.mkdir(parents=True, exist_ok=True)
    print(f"adapt bench: the processes' logs are in {out}", file=sys.stderr, flush=True)
    gs = [sys.executable, "-m", "goodspeed.launch.cli"]
    grpc_port = free_port()
    ports = {"shipped": free_port(), "adapt": free_port()}
    rows, guard = [], []
    started = time.time()
    adapting, version = ("drafter_adapting", "drafter_draft_version") if args.where == "edge" else (
        "local_draft_adapting", "local_draft_version")
    with Servers(out) as servers:
        if args.where == "edge":
            servers.spawn(gs + ["verifier", "--target", target, "--port", str(grpc_port), "--dtype", dtype], "0", 1, "verifier")
        for cpu, (name, port) in enumerate(ports.items()):
            if args.where == "edge":
                extra = ["--adapt", "--adapt-every", str(args.adapt_every)] if name == "adapt" else []
                servers.spawn(gs + ["drafter", "--verifier", f"127.0.0.1:{grpc_port}", "--draft", draft, "--tokenizer", target,
                                    "--name", name, "--serve", f"127.0.0.1:{port}", "--dtype", dtype, "--no-proactive",
                                    "--max-concurrency", "1", "--draft-length", "allotted", *extra], "1", 1, f"node-{name}")
            else:
                extra = ["--local-draft-adapt", "--local-adapt-every", str(args.adapt_every)] if name == "adapt" else []
                servers.spawn(gs + ["verifier", "--target", target, "--port", str(free_port()), "--http-port", str(port),
                                    "--dtype", dtype, "--local-draft", draft, "--local-policy", "chain", "--local-k", "4",
                                    "--max-local-requests", "1", *extra], str(cpu), 1, f"local-{name}")
        for port in ports.values():
            wait_http(port, 900)
            post(port, tasks[0], 8)  # warm-up: one-off costs (the adapt node keeps its text: one more request of the domain)
        for b in range(0, len(tasks), args.block):
            block = tasks[b : b + args.block]
            for name, port in ports.items():
                for task in block:
                    before = metrics(port)
                    reply = post(port, task, args.max_tokens)
                    after = metrics(port)
                    rows.append({"node": name, "index": int(task["id"].split("-")[1]), "wall_s": reply["wall_s"],
                                 "tokens": reply["tokens"], "text": text_of(reply["output"]),
                                 "drafted": counter(after, "spec_decode_num_draft_tokens_total") - counter(before, "spec_decode_num_draft_tokens_total"),
                                 "accepted": counter(after, "spec_decode_num_accepted_tokens_total") - counter(before, "spec_decode_num_accepted_tokens_total"),
                                 "adapting": counter(after, adapting), "version": counter(after, version)})
                if name == "adapt":  # the other node's next block never shares CPU 1 with a fine-tune
                    while counter(metrics(port), adapting):
                        time.sleep(0.5)
            print(f"adapt bench: {min(b + args.block, len(tasks))}/{len(tasks)} requests on each node "
                  f"(adapt node's draft version {rows[-1]['version']:.0f})", file=sys.stderr, flush=True)
        log = (out / ("node-adapt.log" if args.where == "edge" else "local-adapt.log")).read_text(errors="replace")
    for line in log.splitlines():
        if m := re.search(r"adapt: (\w+) \(held-back greedy acceptance: live ([\d.]+), candidate ([\d.]+), shipped ([\d.]+)\) in ([\d.]+) s", line):
            guard.append({"outcome": m[1], "before": float(m[2]), "candidate": float(m[3]), "shipped": float(m[4]), "seconds": float(m[5])})
    result = summarize(rows, args.block)
    result |= {"where": args.where, "pair": args.pair, "dtype": dtype, "requests": args.requests, "block": args.block, "max_tokens": args.max_tokens,
               "adapt_every": args.adapt_every, "seed": args.seed, "guard": guard, "seconds": round(time.time() - started, 1),
               "date": time.strftime("%Y-%m-%d"), "rows": rows}
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


def summarize(rows: list[dict], block: int) -> dict:
    """Per block: each node's acceptance and latency; overall: the adapt node's last block against
    its first and against the shipped node's, latency ratios, and greedy equality."""
    blocks = []
    for b in sorted({r["index"] // block for r in rows}):
        entry = {"block": b, "requests": [b * block, (b + 1) * block - 1]}
        for node in ("shipped", "adapt"):
            mine = [r for r in rows if r["node"] == node and r["index"] // block == b]
            drafted = sum(r["drafted"] for r in mine)
            entry[node] = {"acceptance": round(sum(r["accepted"] for r in mine) / drafted, 4) if drafted else None,
                           "median_s": round(statistics.median(r["wall_s"] for r in mine), 3),
                           "mean_s": round(statistics.fmean(r["wall_s"] for r in mine), 3),
                           "tokens_per_s": round(sum(r["tokens"] for r in mine) / sum(r["wall_s"] for r in mine), 2)}
        entry["version_after"] = max(r["version"] for r in rows if r["node"] == "adapt" and r["index"] // block == b)
        blocks.append(entry)
    shipped = {r["index"]: r["text"] for r in rows if r["node"] == "shipped"}
    same = sum(r["text"] == shipped.get(r["index"]) for r in rows if r["node"] == "adapt")
    first, last = blocks[0], blocks[-1]
    mean = {node: statistics.fmean(r["wall_s"] for r in rows if r["node"] == node) for node in ("shipped", "adapt")}
    return {"blocks": blocks, "acceptance_gain_vs_first_block": round(last["adapt"]["acceptance"] - first["adapt"]["acceptance"], 4),
            "acceptance_gain_vs_shipped_last_block": round(last["adapt"]["acceptance"] - last["shipped"]["acceptance"], 4),
            "latency_ratio_mean": round(mean["adapt"] / mean["shipped"], 4),
            "greedy_equal": f"{same}/{sum(r['node'] == 'adapt' for r in rows)}"}


if __name__ == "__main__":
    sys.exit(main())
