"""Speculation per task: tokens/s of each draft source against plain decoding, by task category.

    python -m bench.bench_workloads [--pair real|demo] [--modes edge,local,fleet,capacity] [--sources model,ngram,suffix,hybrid]
                                    (a source may be model@MODEL or hybrid@MODEL: another draft than the pair's)
                                    [--draft-lengths goodput,allotted] [--dtype auto] [--max-tokens 96] [--batch 8]
                                    [--categories A,B] [--verifier-flags '--rounds async ...'] [--json PATH]
                                    [--local-load closed|steady] [--waves 3] [--local-control] [--device cuda]
                                    [--local-floors 0.97,0] [--capacity-phases local,edge,control]

The tasks are ``bench/workloads/tasks.jsonl``, written for this project: code completion, code
editing, summary and extraction from a given passage, question answering over a given context,
multi-turn chat, JSON extraction with a schema (``response_format``), tool calls (``tool_choice:
required``) and open-ended chat, three each, sent as chat completions (greedy).

* ``edge`` (batch 1 through an edge node over loopback): one verifier (``goodspeed verifier``,
  pinned to CPU 0, one torch thread) serves plain decoding on its own OpenAI front (``--local-policy
  none``) and the gRPC of one edge node per source and ``--draft-length`` rule (``goodspeed drafter
  --serve``, pinned to CPU 1, one torch thread). Each task goes to plain decoding and to each node, one request at a time,
  every other task in the reverse order (:func:`in_turn`): the ratios are measured interleaved, in one run, and a
  machine slowing or speeding up over a category weighs on plain decoding as on the nodes. ``--verifier-flags`` adds flags to that
  verifier (its round mode, transit decoding), so plain decoding and the nodes share them.
* ``local`` (local serving, ``--batch`` requests at once): one verifier process per source
  (``--local-draft SOURCE --local-policy goodput``, or ``chain``, or ``adaserve`` with its trees for
  the sources that draft them: ``model``, ``hybrid``) and one plain (``none``), all pinned to the
  same CPUs, served in turn batch by batch (interleaved, every other batch in the reverse order:
  :func:`in_turn`); only one works at a time. A batch is one
  category's tasks, cycled to ``--batch`` requests. The whole is run ``--repeats`` times, each on
  fresh servers (no suffix cache has seen the tasks before); a category's figure is over all its
  batches (one batch's time swings with the machine). With ``--local-load closed`` (the default) a
  batch's figure is its tokens over its wall time, the tail included (the last requests running
  on after the others ended: one long output sets it, and in bf16 a source's outputs may be
  longer or shorter than plain decoding's). With ``--local-load steady`` a batch is ``--waves``
  times ``--batch`` requests sent by ``--batch`` senders, each sending its next as its reply
  comes, so the server holds ``--batch`` requests until the queue runs dry; the figure is the
  tokens the server generated (its ``generation_tokens_total``) over the window from the first
  reply to the last request's sending, the tail left out. With ``--local-control`` a second
  plain-decoding server (``plain-2``) runs as the others do: two identical servers' figures part
  by several percent within a run (each process's own speed), which bounds what a source's
  ratio can say. ``--local-floors 0.97,0`` serves each source at each ``--local-floor``
  (configs ``SOURCE:floor=F``). Each cell also gives its slowest request's TPOT over plain
  decoding's for the same request (``tpot_over_plain_max``) and how many ran over 1/0.97 of it
  (``slower_than_097``), among the requests whose outputs have plain decoding's length.
* ``fleet`` (capacity): ``--nodes`` edge nodes drafting with ``--fleet-source`` send the tasks at
  once (each its share, one at a time), against the same verifier's batched plain decoding of the
  same tasks ``--nodes`` at a time; the figure is the verifier's CPU seconds per generated token
  (``/proc``), each phase ``--repeats`` times, interleaved.
* ``capacity`` (clients at a TPOT SLO): for each of ``--clients`` N, N clients at once (each
  ``--per-client`` tasks in turn) against centralised plain decoding, centralised speculation
  (local serving with ``--fleet-source``, goodput policy) and N edge nodes with
  ``--fleet-source``; per cell the share of requests whose wall time per token meets
  ``--tpot-slo-ms``, and per server the most clients up to which every cell has 90% attainment;
  with 1 among ``--clients``, the same at twice plain decoding's own TPOT at one client. Each cell
  keeps its requests' TPOTs (``by_request``, in the order sent) and each over plain decoding's for
  the same request (``tpot_over_plain``, None where the outputs differ in length);
  ``--local-floors`` runs centralised speculation at each floor, ``--capacity-phases`` leaves out
  the edge nodes or centralised speculation, or adds a second pass of plain decoding
  (``control``: ``plain-2``) to show how far a request's TPOT moves between two runs of the same
  server.

``--device`` puts every verifier on that device (``cuda``: a GPU; ``--verifier-flags=--cuda-graphs``
replays its steps as CUDA graphs); the edge nodes stay on the CPU they are pinned
to, as an edge device's drafter would be on a machine of its own. ``--verifier-flags`` reach every
verifier of every mode.

Per category and source: tokens/s and the speedup against plain decoding (its tokens/s in the
same run), accepted tokens per verified draft and the acceptance rate (the server's
``goodspeed:spec_decode_*`` counters), and how many outputs equal plain decoding's (greedy:
all of them in fp32; in bf16 a batch shape may tip a near tie, which is counted, not hidden).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import defaultdict
from pathlib import Path

from bench.bench_http import free_port, wait_http
from goodspeed.launch.experiments.sim_capacity import capacity_at_slo, nearest_rank
from goodspeed.lm.models.precision import resolve_dtype

TASKS = Path(__file__).resolve().parent / "workloads" / "tasks.jsonl"
PAIRS = {"real": ("real:smollm2-135m", "real:smollm2-135m-draft"), "demo": ("demo:target", "demo:draft-distilled")}
SOURCES = ("model", "ngram", "suffix", "hybrid")
COUNTERS = ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total")
ROUND_TRIPS = "drafter_round_trip_seconds_count"  # an edge node's drafts sent (each a round trip to the verifier)
EDGE_COUNTERS = COUNTERS + (ROUND_TRIPS,)  # what an edge node's task rows record


def load_tasks(path: Path = TASKS) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def source_name(source: str, draft: str) -> str:
    """What a node or a verifier is given for ``source``; ``model@SPEC`` and ``hybrid@SPEC`` draft
    with the model SPEC instead of the pair's (``model@real:smollm2-135m-draft-large``); a local
    config's ``:floor=F`` (:func:`floor_configs`) is the verifier's flag, not the source's."""
    source, _, other = source.partition(":floor=")[0].partition("@")
    draft = other or draft
    return {"model": draft, "ngram": "ngram", "suffix": "suffix", "hybrid": f"suffix+{draft}"}[source]


def _known_source(source: str) -> bool:
    """A source of :data:`SOURCES`, or ``model@MODEL`` / ``hybrid@MODEL`` (a lookup takes no model)."""
    base, _, model = source.partition("@")
    return base in SOURCES and (not model or base in ("model", "hybrid"))


def floor_configs(sources: list[str], floors: list[str]) -> list[str]:
    """Local serving's configs: each source at each of ``--local-floors`` (``SOURCE:floor=F``,
    served with ``--local-floor F``), or each source at the verifier's default floor.

    >>> floor_configs(["ngram"], ["0.97", "0"]), floor_configs(["ngram"], [])
    (['ngram:floor=0.97', 'ngram:floor=0'], ['ngram'])
    """
    return [f"{s}:floor={f}" for s in sources for f in floors] if floors else list(sources)


def _floor_flags(config: str) -> list[str]:
    """``--local-floor F`` for a ``SOURCE:floor=F`` config, nothing for the others."""
    _, found, floor = config.partition(":floor=")
    return ["--local-floor", floor] if found else []


def tpot_over_plain(replies: list[dict], plain: list[dict]) -> list[float | None]:
    """Each request's time per output token (wall time over tokens) over plain decoding's for the
    same request, in order: how much faster (< 1) or slower (> 1) speculation made each one.
    None where the two outputs differ in length (in bf16 a batch shape can tip a near tie: a
    shorter answer spreads its time to first token over fewer tokens, which is not the same
    request's pace) or plain decoding's took no time (hand-made rows).

    >>> tpot_over_plain([{"wall_s": 1.0, "tokens": 10}, {"wall_s": 3.0, "tokens": 10}, {"wall_s": 1.0, "tokens": 4}],
    ...                 [{"wall_s": 2.0, "tokens": 10}] * 3)
    [0.5, 1.5, None]
    """
    return [round((r["wall_s"] / r["tokens"]) / (p["wall_s"] / p["tokens"]), 4)
            if r["tokens"] == p["tokens"] and r["tokens"] > 0 and p["wall_s"] > 0 else None
            for r, p in zip(replies, plain)]


def in_turn(configs: list, i: int) -> list:
    """The order the configs serve their ``i``-th task or batch in: as given, reversed for odd ``i``,
    so a machine drifting over a run (these machines' speed moves by up to 2x between hours, and
    by half within minutes on some days) weighs on every config alike instead of on the last ones most.

    >>> in_turn(["plain", "ngram", "suffix"], 0), in_turn(["plain", "ngram", "suffix"], 1)
    (['plain', 'ngram', 'suffix'], ['suffix', 'ngram', 'plain'])
    """
    return list(configs) if i % 2 == 0 else list(reversed(configs))


def _label(config: str) -> str:
    """``config`` as a process and log name (letters, digits and dashes)."""
    return re.sub(r"[^A-Za-z0-9]+", "-", config).strip("-")


def verifier_flags(args) -> list[str]:
    """What every verifier of every mode is given besides its mode's own flags: ``--device`` and
    ``--verifier-flags``."""
    return ["--device", args.device, *shlex.split(args.verifier_flags)]


def start(cmd: list[str], cpus: str, threads: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    pin = ["taskset", "-c", cpus] if shutil.which("taskset") and (os.cpu_count() or 1) > 1 else []
    return subprocess.Popen(pin + cmd, stdout=subprocess.DEVNULL, stderr=open(log, "w"), env=env, start_new_session=True)


_MODELS: dict[int, str] = {}


def served_model(port: int) -> str:
    if port not in _MODELS:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as response:
            _MODELS[port] = json.loads(response.read())["data"][0]["id"]
    return _MODELS[port]


def post(port: int, task: dict, max_tokens: int) -> dict:
    body = {"model": served_model(port), "messages": task["messages"], "max_tokens": max_tokens, "temperature": 0}
    for key in ("response_format", "tools", "tool_choice"):
        if key in task:
            body[key] = task[key]
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            reply = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"task {task['id']} on port {port}: HTTP {exc.code}: {exc.read().decode()[:500]}") from None
    message = reply["choices"][0]["message"]
    return {"wall_s": time.perf_counter() - started, "tokens": reply["usage"]["completion_tokens"],
            "output": json.dumps({k: message.get(k) for k in ("content", "tool_calls")}, sort_keys=True)}


def text_of(output: str) -> str:
    """A reply's text and calls without the calls' ids (random per reply): what greedy decoding
    decides, for comparing a speculative reply with plain decoding's."""
    message = json.loads(output)
    calls = [c["function"] for c in message.get("tool_calls") or []]
    return json.dumps({"content": message.get("content"), "calls": calls}, sort_keys=True)


def counters(port: int, names=COUNTERS) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("goodspeed:") and name.split(":", 1)[1] in out:
            out[name.split(":", 1)[1]] += float(value)
    return out


def run_batch(port: int, tasks: list[dict], max_tokens: int, width: int | None = None) -> tuple[float, list[dict]]:
    """``tasks`` sent at once (``width``: that many at a time, each sender taking the next); the
    batch's wall time and each reply."""
    replies: list[dict | None] = [None] * len(tasks)
    width = width or len(tasks)

    def one(i: int) -> None:
        for k in range(i, len(tasks), width):
            replies[k] = post(port, tasks[k], max_tokens)

    started = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(min(width, len(tasks)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - started, replies


def run_steady(port: int, tasks: list[dict], max_tokens: int, width: int) -> tuple[float, list[dict], tuple[float, float]]:
    """``tasks`` through ``width`` senders, each sending the next as its reply comes (the server
    holds ``width`` requests until the queue runs dry): the wall time, each reply, and the steady
    window, from the first reply to the last task's sending: the tokens the server generated in
    it (its ``generation_tokens_total``) and its seconds."""
    if len(tasks) < 2 * width:
        raise ValueError(f"a steady window needs at least two waves of {width} requests, got {len(tasks)}")
    replies: list[dict | None] = [None] * len(tasks)
    lock, taken, marks = threading.Lock(), [0], {}

    def mark(name: str) -> None:
        marks[name] = (time.perf_counter(), counters(port, ("generation_tokens_total",))["generation_tokens_total"])

    def sender() -> None:
        while True:
            with lock:
                k, taken[0] = taken[0], taken[0] + 1
                if k == len(tasks) - 1:
                    mark("end")
            if k >= len(tasks):
                return
            replies[k] = post(port, tasks[k], max_tokens)
            with lock:
                if "start" not in marks:
                    mark("start")

    started = time.perf_counter()
    threads = [threading.Thread(target=sender) for _ in range(width)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (t0, n0), (t1, n1) = marks["start"], marks["end"]
    if t1 <= t0:
        raise RuntimeError("the queue ran dry before the first reply: no steady window (send more waves)")
    return time.perf_counter() - started, replies, (n1 - n0, t1 - t0)


def keep_partial(args, mode: str, configs: list[str], rows: list[dict]) -> None:
    """With ``--json PATH``: the rows of the mode running now in ``PATH.partial``, replaced as rows
    come (``PATH`` holds the modes done): a run cut short keeps them, and ``--summarize
    PATH.partial`` makes their tables."""
    if args.json:
        partial = Path(args.json + ".partial")
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps({"command": " ".join(["python -m bench.bench_workloads", *sys.argv[1:]]), "partial": True,
                                       mode: {"geomean_speedup": dict.fromkeys(configs), "rows": rows}}) + "\n")


class Servers:
    """The processes of one mode; stopped (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, out: Path) -> None:
        self.out, self.procs, self.logs = out, [], []

    def __enter__(self) -> "Servers":
        return self

    def spawn(self, cmd: list[str], cpus: str, threads: int, name: str) -> None:
        self.logs.append(self.out / f"{name}.log")
        self.procs.append(start(cmd, cpus, threads, self.logs[-1]))

    def wait_http(self, port: int, timeout_s: float) -> None:
        """Until ``port`` answers its health check; a server of these that exits first fails the
        wait at once, with the end of its log (a missing package, a bad flag), rather than after
        ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            for proc, log in zip(self.procs, self.logs):
                if proc.poll() is not None:
                    tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
                    raise RuntimeError(f"{log.stem} exited with {proc.returncode} before port {port} served; "
                                       f"the end of {log}:\n{tail}")
            try:
                wait_http(port, min(2.0, max(0.1, deadline - time.monotonic())))
                return
            except RuntimeError:
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"nothing serves on port {port} after {timeout_s} s") from None

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def edge_mode(args, tasks, target, draft, dtype, out: Path) -> dict:
    gs = [sys.executable, "-m", "goodspeed.launch.cli"]
    grpc_port, plain_port = free_port(), free_port()
    ports = {"plain": plain_port}
    with Servers(out) as servers:
        servers.spawn(gs + ["verifier", "--target", target, "--port", str(grpc_port), "--http-port", str(plain_port),
                            "--local-draft", "ngram", "--local-policy", "none", "--dtype", dtype,
                            "--max-draft-len", str(args.max_draft_len), "--budget", str(args.budget),
                            *verifier_flags(args)], "0", 1, "verifier")
        servers.wait_http(plain_port, 600)
        for source in args.sources:
            for rule in args.draft_lengths:
                config = source if rule == args.draft_lengths[0] else f"{source}/{rule}"
                ports[config] = free_port()
                servers.spawn(gs + ["drafter", "--verifier", f"127.0.0.1:{grpc_port}", "--draft", source_name(source, draft),
                                    "--tokenizer", target, "--name", f"edge-{_label(config)}", "--serve",
                                    f"127.0.0.1:{ports[config]}", "--dtype", dtype, "--no-proactive", "--max-concurrency", "1",
                                    "--draft-length", rule], "1", 1, f"node-{_label(config)}")
        for port in ports.values():
            servers.wait_http(port, 600)
        for port in ports.values():  # warm-up: the first request of each pays one-off costs
            post(port, tasks[0], 8)
        rows = []
        for i, task in enumerate(tasks):
            for config in in_turn(list(ports), i):
                port = ports[config]
                before = counters(port, EDGE_COUNTERS)
                reply = post(port, task, args.max_tokens)
                after = counters(port, EDGE_COUNTERS)
                rows.append({"config": config, "category": task["category"], "id": task["id"], **reply,
                             **{k: after[k] - before[k] for k in EDGE_COUNTERS}})
            keep_partial(args, "edge", list(ports), rows)
            print(f"edge: {i + 1}/{len(tasks)} tasks", file=sys.stderr, flush=True)
    return summarize(rows, list(ports))


def local_flags(args, config: str, draft: str) -> list[str]:
    """A local-serving verifier's flags for ``config``: plain decoding (``plain``, and its control
    ``plain-2``) or a source under ``--local-policy``."""
    if config in ("plain", "plain-2"):
        return ["--local-draft", "ngram", "--local-policy", "none"]
    return ["--local-draft", source_name(config, draft), "--local-policy", args.local_policy, "--local-k", str(args.local_k),
            "--local-max-k", str(args.local_k), "--local-budget", str(args.budget), *_floor_flags(config)]


def local_mode(args, tasks, target, draft, dtype, out: Path) -> dict:
    gs = [sys.executable, "-m", "goodspeed.launch.cli"]
    rows = []
    categories = sorted({t["category"] for t in tasks}, key=[t["category"] for t in tasks].index)
    configs = ["plain", *(["plain-2"] if args.local_control else []), *floor_configs(args.sources, args.local_floors)]
    for repeat in range(args.repeats):  # fresh servers each time: no suffix cache has seen the tasks before
        ports = {}
        with Servers(out) as servers:
            for config in configs:
                ports[config] = free_port()
                servers.spawn(gs + ["verifier", "--target", target, "--port", str(free_port()), "--http-port", str(ports[config]),
                                    "--dtype", dtype, "--max-local-requests", str(args.batch), *local_flags(args, config, draft),
                                    *verifier_flags(args)], "0-1", 2, f"local-{_label(config)}-{repeat}")
            for port in ports.values():
                servers.wait_http(port, 900)
            for port in ports.values():
                post(port, tasks[0], 8)
            waves = args.waves if args.local_load == "steady" else 1
            for c, category in enumerate(categories):  # one batch a category: its tasks cycled to --batch requests (a wave)
                mine = [t for t in tasks if t["category"] == category]
                batch = [{**mine[i % len(mine)], "id": f"{mine[i % len(mine)]['id']}#{i}" + (f"@{repeat}" if repeat else "")}
                         for i in range(args.batch * waves)]
                b = repeat * len(categories) + c
                for config in in_turn(list(ports), repeat + c):  # a category's batches alternate orders over the repeats
                    port = ports[config]
                    before = counters(port)
                    window = {}
                    if args.local_load == "steady":
                        wall, replies, (tokens, seconds) = run_steady(port, batch, args.max_tokens, args.batch)
                        window = {"window_tokens": tokens, "window_s": seconds}
                    else:
                        wall, replies = run_batch(port, batch, args.max_tokens)
                    after = counters(port)
                    for task, reply in zip(batch, replies):  # the batch's time shared by its tokens
                        rows.append({"config": config, "category": task["category"], "id": task["id"], **reply,
                                     "batch_wall_s": wall, "batch": b, **window,
                                     **{k: (after[k] - before[k]) / len(batch) for k in COUNTERS}})
                keep_partial(args, "local", configs, rows)
                print(f"local: repeat {repeat + 1}/{args.repeats}, {c + 1}/{len(categories)} batches", file=sys.stderr, flush=True)
    return summarize(rows, configs, batched=True)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def fleet_mode(args, tasks, target, draft, dtype, out: Path) -> dict:
    """N edge nodes at once against batched plain decoding: the verifier's CPU seconds per
    generated token (its capacity), both phases on one verifier, interleaved ``--repeats`` times."""
    gs = [sys.executable, "-m", "goodspeed.launch.cli"]
    grpc_port, plain_port = free_port(), free_port()
    node_ports = []
    with Servers(out) as servers:
        servers.spawn(gs + ["verifier", "--target", target, "--port", str(grpc_port), "--http-port", str(plain_port),
                            "--local-draft", "ngram", "--local-policy", "none", "--dtype", dtype, "--max-local-requests",
                            str(args.nodes), "--max-drafters", str(4 * args.nodes), "--budget", str(args.budget),
                            "--max-draft-len", str(args.max_draft_len), *verifier_flags(args)], "0", 1, "verifier")
        servers.wait_http(plain_port, 600)
        verifier_pid = servers.procs[0].pid
        for i in range(args.nodes):
            node_ports.append(free_port())
            servers.spawn(gs + ["drafter", "--verifier", f"127.0.0.1:{grpc_port}", "--draft", source_name(args.fleet_source, draft),
                                "--tokenizer", target, "--name", f"edge-{i}", "--serve", f"127.0.0.1:{node_ports[-1]}",
                                "--dtype", dtype, "--no-proactive", "--max-concurrency", "1"], "1", 1, f"fleet-node-{i}")
        for port in [plain_port, *node_ports]:
            servers.wait_http(port, 600)
            post(port, tasks[0], 8)
        phases = []
        for repeat in range(args.repeats):
            for phase in ("plain", "fleet"):
                before, started = cpu_seconds(verifier_pid), time.perf_counter()
                if phase == "plain":
                    tokens = sum(r["tokens"] for r in run_batch(plain_port, tasks, args.max_tokens, width=args.nodes)[1])
                else:
                    tokens = run_fleet(node_ports, tasks, args.max_tokens)
                phases.append({"phase": phase, "repeat": repeat, "tokens": tokens, "wall_s": time.perf_counter() - started,
                               "verifier_cpu_s": cpu_seconds(verifier_pid) - before})
                print(f"fleet: repeat {repeat + 1}/{args.repeats} {phase} done", file=sys.stderr, flush=True)
    per_token = {phase: sum(p["verifier_cpu_s"] for p in phases if p["phase"] == phase)
                 / sum(p["tokens"] for p in phases if p["phase"] == phase) for phase in ("plain", "fleet")}
    return {"phases": phases, "verifier_cpu_s_per_token": per_token,
            "fleet_over_plain": round(per_token["fleet"] / per_token["plain"], 3), "nodes": args.nodes,
            "source": args.fleet_source}


def run_fleet(ports: list[int], tasks: list[dict], max_tokens: int) -> int:
    """Each node takes every ``len(ports)``-th task, one at a time, all nodes at once; tokens made."""
    made = [0] * len(ports)

    def node(i: int) -> None:
        for task in tasks[i :: len(ports)]:
            made[i] += post(ports[i], task, max_tokens)["tokens"]

    threads = [threading.Thread(target=node, args=(i,)) for i in range(len(ports))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(made)


def capacity_mode(args, tasks, target, draft, dtype, out: Path) -> dict:
    """How many clients one verifier serves at a TPOT SLO (``--tpot-slo-ms``) with 90% of requests
    meeting it, for each of ``--clients`` N: N clients at once, each sending ``--per-client``
    tasks one after another (the mixed categories, in turn), to (1) centralised plain decoding on
    the verifier's own front, (2) centralised speculation (a second verifier serving locally with
    ``--fleet-source`` under the goodput policy) and (3) N edge nodes drafting with
    ``--fleet-source`` against the first verifier, one client each. A request's TPOT is its wall
    time over its tokens (time to first token included: an upper estimate). The speculating
    servers and nodes start fresh for each N, so no suffix cache has seen the tasks before; the
    verifiers are pinned to CPU 0 and run one at a time, the nodes to CPU 1. ``--local-floors``:
    one centralised server a floor (``local-spec:floor=F``); ``--capacity-phases``: which of (2)
    and (3) run, and ``control``: (1) again after them (``plain-2``), whose ``tpot_over_plain``
    is how far the same request moves between two runs of the same server."""
    gs = [sys.executable, "-m", "goodspeed.launch.cli"]
    clients = [int(n) for n in args.clients.split(",")]
    source = source_name(args.fleet_source, draft)
    grpc_port, plain_port = free_port(), free_port()
    cells = []
    with Servers(out) as servers:
        servers.spawn(gs + ["verifier", "--target", target, "--port", str(grpc_port), "--http-port", str(plain_port),
                            "--local-draft", "ngram", "--local-policy", "none", "--dtype", dtype, "--max-local-requests",
                            str(max(clients)), "--max-drafters", str(4 * max(clients)), "--budget", str(args.budget),
                            "--max-draft-len", str(args.max_draft_len), *verifier_flags(args)], "0", 1, "capacity-verifier")
        servers.wait_http(plain_port, 600)
        post(plain_port, tasks[0], 8)
        for n in clients:
            work = [[tasks[(i + n * c) % len(tasks)] for c in range(args.per_client)] for i in range(n)]
            with Servers(out) as fresh:
                phases = [("plain", [plain_port] * n)]
                for config in floor_configs(["local-spec"], args.local_floors) if "local" in args.capacity_phases else []:
                    spec_port = free_port()
                    fresh.spawn(gs + ["verifier", "--target", target, "--port", str(free_port()), "--http-port", str(spec_port),
                                      "--local-draft", source, "--local-policy", "goodput", "--local-k", str(args.local_k),
                                      "--local-max-k", str(args.local_k), "--dtype", dtype, "--max-local-requests", str(n),
                                      *_floor_flags(config), *verifier_flags(args)], "0", 1, f"capacity-{_label(config)}-{n}")
                    phases.append((config, [spec_port] * n))
                if "edge" in args.capacity_phases:
                    node_ports = [free_port() for _ in range(n)]
                    for i, port in enumerate(node_ports):
                        fresh.spawn(gs + ["drafter", "--verifier", f"127.0.0.1:{grpc_port}", "--draft", source, "--tokenizer", target,
                                          "--name", f"edge-{i}", "--serve", f"127.0.0.1:{port}", "--dtype", dtype, "--no-proactive",
                                          "--max-concurrency", "1"], "1", 1, f"capacity-node-{n}-{i}")
                    phases.append(("edge", node_ports))
                if "control" in args.capacity_phases:  # plain decoding again, last: how far a request moves between two runs
                    phases.append(("plain-2", [plain_port] * n))
                for _, ports in phases[1:]:
                    for port in dict.fromkeys(ports):
                        fresh.wait_http(port, 600)
                plain = []
                for phase, ports in phases:
                    replies = run_clients(ports, work, args.max_tokens)
                    if phase == "plain":  # the phases after it are timed against it, request by request
                        plain = replies
                    tpot = [1000 * r["wall_s"] / max(1, r["tokens"]) for r in replies]
                    cells.append({"clients": n, "phase": phase, "requests": len(tpot), "tokens": sum(r["tokens"] for r in replies),
                                  "tpot_ms_p50": round(statistics.median(tpot), 2),
                                  "tpot_ms_p90": round(nearest_rank(tpot, 0.9), 2),
                                  "attainment": round(sum(t <= args.tpot_slo_ms for t in tpot) / len(tpot), 3),
                                  "tpot_ms": sorted(round(t, 2) for t in tpot),
                                  "by_request": [[task["id"], r["tokens"], round(t, 2)]  # run_clients' order: work's
                                                 for task, r, t in zip((t for mine in work for t in mine), replies, tpot)],
                                  "tpot_over_plain": tpot_over_plain(replies, plain)})  # by_request's order
                    print(f"capacity: {n} clients, {phase}: attainment {cells[-1]['attainment']}, "
                          f"TPOT p50 {cells[-1]['tpot_ms_p50']} ms", file=sys.stderr, flush=True)
    report = {"cells": cells, "tpot_slo_ms": args.tpot_slo_ms, "capacity_at_slo": capacity_at_slo(cells),
              "source": args.fleet_source, "per_client": args.per_client}
    report.update(relative_capacity(cells))
    return report


def relative_capacity(cells: list[dict], factor: float = 2.0) -> dict:
    """Capacity at an SLO of ``factor`` times plain decoding's own TPOT p50 at one client in the
    same run (how the fixed 60 ms was first chosen, on mixed tasks): a fixed SLO means more or
    less room for batching as the machine's speed and the tasks' prompts move, this one scales
    with them. Empty when the run has no one-client plain cell."""
    alone = [c for c in cells if c["clients"] == 1 and c["phase"] == "plain"]
    if not alone:
        return {}
    slo = round(factor * alone[0]["tpot_ms_p50"], 2)
    at = [{**c, "attainment": sum(t <= slo for t in c["tpot_ms"]) / len(c["tpot_ms"])} for c in cells]
    return {"relative_tpot_slo_ms": slo, "relative_slo_factor": factor, "capacity_at_relative_slo": capacity_at_slo(at)}


def run_clients(ports: list[int], work: list[list[dict]], max_tokens: int) -> list[dict]:
    """Client ``i`` sends ``work[i]`` to ``ports[i]`` one after another, all clients at once."""
    replies: list[list[dict]] = [[] for _ in ports]

    def client(i: int) -> None:
        for task in work[i]:
            replies[i].append(post(ports[i], task, max_tokens))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(ports))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for mine in replies for r in mine]


def summarize(rows: list[dict], configs: list[str], batched: bool = False) -> dict:
    """Per category and config: tokens, seconds, tokens/s, speedup against plain, acceptance."""
    plain = {r["id"]: text_of(r["output"]) for r in rows if r["config"] == "plain"}
    plain_rows = {r["id"]: r for r in rows if r["config"] == "plain"}
    table: dict = defaultdict(dict)
    categories = sorted({r["category"] for r in rows}, key=[r["category"] for r in rows].index)
    for category in categories + ["all"]:
        for config in configs:
            mine = [r for r in rows if r["config"] == config and category in (r["category"], "all")]
            tokens = sum(r["tokens"] for r in mine)
            if batched and mine and all("window_s" in r for r in mine):  # steady load: each batch's window
                windows = {r["batch"]: (r["window_tokens"], r["window_s"]) for r in mine}
                tokens, seconds = sum(n for n, _ in windows.values()), sum(s for _, s in windows.values())
            elif batched:  # a batch's wall time, shared among its requests by their tokens
                seconds = sum(r["batch_wall_s"] * r["tokens"] / max(1, sum(x["tokens"] for x in rows if x["config"] == config
                                                                          and x["batch"] == r["batch"])) for r in mine)
            else:
                seconds = sum(r["wall_s"] for r in mine)
            drafts, drafted, accepted = (sum(r[k] for r in mine) for k in COUNTERS)
            table[category][config] = {
                "requests": len(mine), "tokens": tokens, "seconds": round(seconds, 4),
                "tok_s": round(tokens / seconds, 3) if seconds else None,
                "accepted_per_draft": round(accepted / drafts, 3) if drafts else None,
                "acceptance": round(accepted / drafted, 3) if drafted else None,
                "equal_to_plain": sum(text_of(r["output"]) == plain[r["id"]] for r in mine),
            }
            if trips := sum(r.get(ROUND_TRIPS, 0) for r in mine):  # an edge node's: what decoding ahead saves
                table[category][config]["round_trips_per_token"] = round(trips / tokens, 3)
            if batched:  # each request's TPOT over plain decoding's of the same request: the slowest, and how many lost 3%
                ratios = [x for x in tpot_over_plain(mine, [plain_rows[r["id"]] for r in mine]) if x is not None]
                table[category][config].update(tpot_over_plain_max=max(ratios, default=None),
                                               slower_than_097=sum(x > 1 / 0.97 for x in ratios))
        base = table[category]["plain"]["tok_s"]
        for config in configs:
            cell = table[category][config]
            cell["speedup"] = round(cell["tok_s"] / base, 3) if base and cell["tok_s"] else None
    geomean = {c: round(math.exp(sum(math.log(table[k][c]["speedup"]) for k in categories) / len(categories)), 3)
               for c in configs}
    return {"by_category": dict(table), "geomean_speedup": geomean, "rows": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", choices=sorted(PAIRS), default="real")
    parser.add_argument("--modes", default="edge,local")
    parser.add_argument("--sources", default=",".join(SOURCES))
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="cpu", help="the verifiers' device (cpu, cuda, cuda:N); edge nodes stay on the CPU")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--max-draft-len", type=int, default=8)
    parser.add_argument("--budget", type=int, default=32, help="the verifier's budget C; local adaserve: its tree budget B")
    parser.add_argument("--draft-lengths", default="goodput", help="edge: the nodes' --draft-length rules, each a node per "
                        "source (the first unnamed; others as SOURCE/RULE)")
    parser.add_argument("--local-k", type=int, default=6, help="local: chain's k, goodput's longest length")
    parser.add_argument("--local-policy", choices=("chain", "goodput", "adaserve"), default="goodput")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--local-control", action="store_true",
                        help="local: a second plain-decoding server (plain-2), run as the others: how far two "
                             "identical servers part within the run")
    parser.add_argument("--local-load", choices=("closed", "steady"), default="closed",
                        help="local: one batch of --batch requests (closed), or --waves of them through --batch senders (steady)")
    parser.add_argument("--waves", type=int, default=3, help="local, steady load: requests per category, in --batch's")
    parser.add_argument("--tasks", type=Path, default=TASKS)
    parser.add_argument("--categories", default=None, help="only these task categories (comma-separated; default: all)")
    parser.add_argument("--verifier-flags", default="", help="more flags for every verifier, e.g. "
                                                              "'--rounds async --transit-tokens 2 --transit-alone', or --verifier-flags=--cuda-graphs "
                                                              "(one flag alone needs the '=')")
    parser.add_argument("--nodes", type=int, default=8, help="fleet: edge nodes at once")
    parser.add_argument("--fleet-source", choices=SOURCES, default="suffix", help="fleet: the nodes' draft source")
    parser.add_argument("--repeats", type=int, default=2, help="fleet: interleaved repeats of both phases; local: "
                        "runs of every category's batch, each on fresh servers")
    parser.add_argument("--clients", default="1,2,4,8", help="capacity: numbers of clients at once")
    parser.add_argument("--per-client", type=int, default=3, help="capacity: tasks each client sends, one after another")
    parser.add_argument("--tpot-slo-ms", type=float, default=60.0, help="capacity: the TPOT SLO")
    parser.add_argument("--capacity-phases", default="local,edge", help="capacity: besides plain decoding, centralised "
                        "speculation (local), edge nodes (edge) and plain decoding once more, last (control: plain-2)")
    parser.add_argument("--local-floors", default="", help="local and capacity's centralised speculation: serve each source "
                        "at each of these --local-floor values (comma-separated; default: the verifier's own)")
    parser.add_argument("--json", default=None, help="write the report here")
    parser.add_argument("--summarize", default=None, metavar="REPORT",
                        help="recompute a written report's tables from its raw rows (no run) and write it back")
    parser.add_argument("--logs", default="goodspeed-runs/bench-workloads", help="the servers' logs")
    args = parser.parse_args(argv)
    if args.summarize:
        return resummarize(Path(args.summarize))
    args.sources = [s for s in args.sources.split(",") if s]
    args.draft_lengths = [r for r in args.draft_lengths.split(",") if r]
    args.local_floors = [f for f in args.local_floors.split(",") if f]
    args.capacity_phases = [p for p in args.capacity_phases.split(",") if p]
    if unknown := [p for p in args.capacity_phases if p not in ("local", "edge", "control")]:
        parser.error(f"--capacity-phases: unknown {unknown}; known: local, edge, control")
    try:
        if any(not 0 <= float(f) <= 1 for f in args.local_floors):
            parser.error("--local-floors: each a fraction in [0, 1]")
    except ValueError:
        parser.error(f"--local-floors: not numbers: {args.local_floors}")
    if unknown := [r for r in args.draft_lengths if r not in ("goodput", "allotted")]:
        parser.error(f"--draft-lengths: unknown {unknown}; known: goodput, allotted")
    if args.local_load == "steady" and args.waves < 2:
        parser.error("--local-load steady needs --waves >= 2 (its window runs from the first reply to the last sending)")
    if unknown := [s for s in args.sources if not _known_source(s)]:
        parser.error(f"--sources: unknown {unknown}; known: {', '.join(SOURCES)}, and model@MODEL or hybrid@MODEL for another draft")
    if args.local_policy == "adaserve" and "local" in args.modes and (chains := [s for s in args.sources if s in ("ngram", "suffix")]):
        parser.error(f"--local-policy adaserve drafts trees, which {', '.join(chains)} cannot: give --sources model,hybrid")
    modes = [m for m in args.modes.split(",") if m]
    if unknown := [m for m in modes if m not in MODES]:
        parser.error(f"--modes: unknown {unknown}; known: {', '.join(MODES)}")
    target, draft = PAIRS[args.pair]
    from goodspeed.lm.models.loading import ensure_models

    ensure_models([target, draft])
    out = Path(args.logs)
    out.mkdir(parents=True, exist_ok=True)
    tasks = load_tasks(args.tasks)
    if args.categories:
        wanted = args.categories.split(",")
        if unknown := sorted(set(wanted) - {t["category"] for t in tasks}):
            parser.error(f"--categories: no tasks of {', '.join(unknown)}")
        tasks = [t for t in tasks if t["category"] in wanted]
    report = {"command": " ".join(["python -m bench.bench_workloads", *(argv if argv is not None else sys.argv[1:])]),
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine(args.device),
              "pair": {"target": target, "draft": draft}, "dtype": args.dtype, "device": args.device,
              "resolved_dtype": resolve_dtype(args.dtype, args.device, target), "node_resolved_dtype": resolve_dtype(args.dtype, "cpu", draft),
              "max_tokens": args.max_tokens, "max_draft_len": args.max_draft_len, "tasks": len(tasks)}
    for mode in modes:
        report[mode] = MODES[mode](args, tasks, target, draft, args.dtype, out)
        if mode in ("edge", "local"):
            report[mode]["settings"] = ({"batch": 1, "draft_lengths": args.draft_lengths, "verifier_flags": args.verifier_flags}
                                        if mode == "edge"
                                        else {"batch": args.batch, "local_k": args.local_k, "local_policy": args.local_policy,
                                              "local_load": args.local_load, "waves": args.waves if args.local_load == "steady" else 1,
                                              "verifier_flags": args.verifier_flags})
        write_report(args, report)
        if mode == "fleet":
            print(f"\nfleet: verifier CPU s per token {report[mode]['verifier_cpu_s_per_token']}, "
                  f"fleet / plain {report[mode]['fleet_over_plain']}")
        elif mode == "capacity":
            print(f"\ncapacity: clients served at TPOT <= {args.tpot_slo_ms:g} ms with 90% attainment: "
                  f"{report[mode]['capacity_at_slo']}")
            if "relative_tpot_slo_ms" in report[mode]:
                print(f"capacity at {report[mode]['relative_tpot_slo_ms']:g} ms (twice plain decoding's alone): "
                      f"{report[mode]['capacity_at_relative_slo']}")
        else:
            print_table(mode, report[mode])
    return 0


def write_report(args, report: dict) -> None:
    """``--json PATH``: the modes done so far (rewritten after each), and no more partial rows."""
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        Path(args.json + ".partial").unlink(missing_ok=True)


def machine(device: str) -> dict:
    """Where the run ran: CPUs, kernel, CPU model, torch and transformers, and the GPU's name for a
    CUDA ``device``."""
    import torch
    import transformers

    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), None) if Path("/proc/cpuinfo").exists() else None
    out = {"cpus": os.cpu_count(), "uname": " ".join(os.uname()), "cpu_model": model, "torch": torch.__version__,
           "transformers": transformers.__version__}
    if device.startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return out


def resummarize(path: Path) -> int:
    report = json.loads(path.read_text())
    for mode in ("edge", "local"):
        if mode in report:
            configs = list(report[mode]["geomean_speedup"])
            report[mode] = {**report[mode], **summarize(report[mode]["rows"], configs, batched=mode == "local")}
            print_table(mode, report[mode])
    path.write_text(json.dumps(report, indent=1) + "\n")
    return 0


def print_table(mode: str, result: dict) -> None:
    configs = list(result["geomean_speedup"])
    print(f"\n{mode}: speedup against plain decoding (tok/s; acceptance)")
    print(f"{'category':<20}" + "".join(f"{c:>22}" for c in configs))
    for category, cells in result["by_category"].items():
        print(f"{category:<20}" + "".join(
            f"{cells[c]['speedup'] or 0:>7.2f}x {cells[c]['tok_s'] or 0:>6.1f} {cells[c]['acceptance'] or 0:>5.2f}" for c in configs))
    print(f"{'geomean':<20}" + "".join(f"{result['geomean_speedup'][c]:>21.2f}x" for c in configs))


MODES = {"edge": edge_mode, "local": local_mode, "fleet": fleet_mode, "capacity": capacity_mode}

if __name__ == "__main__":
    raise SystemExit(main())
