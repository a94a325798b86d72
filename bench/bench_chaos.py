"""Chaos at scale: edge nodes behind emulated links, faults injected under load, every request
accounted for.

    python -m bench.bench_chaos [--nodes 32] [--partition-s 30] [--max-tokens 40]
                                [--target demo:target] [--json PATH]

Needs root (network namespaces, veth pairs, tc) and the demo models (``goodspeed models
build-demo``), or another ``--target``. One verifier (``goodspeed verifier``: the target in
float32, so that every output can be compared with the target's greedy decoding token for token;
mutual TLS and a token per node; pinned to CPU 0, one thread) and ``--nodes`` edge nodes (``goodspeed drafter --draft
suffix --serve``: no draft model), each in its own network namespace behind an emulated link
(:mod:`goodspeed.launch.cluster.links`: round trips of 10-120 ms with jitter, 5-50 Mbit/s, 0-1%
loss, drawn per node from ``--seed``). One client a node (threads here) sends it completions one
after another, greedy, streamed and not in turn, from a fixed set of prompts whose greedy text the
verifier's own front (plain decoding) gave before the run. Under that load, in order:

1. **rotate**: every certificate renewed under the same CA (the verifier's and each node's:
   :func:`~goodspeed.launch.cluster.certs.renew_certs`); the verifier serves its new one from the
   next handshake on (the seconds until its HTTPS front does are reported), connections already
   open keep theirs;
2. **verifier kill -9**, started again on the same port: every node reconnects (handshaking
   against the renewed certificate) and resumes its requests from their verified text;
3. **partition**: one node's link to the verifier cut for ``--partition-s`` seconds, then healed;
4. **node kill -9**: another node killed while it has requests in flight, then started again
   (with its renewed certificate).

The load stops ``--tail-s`` seconds after the last fault; each client's request then in flight
runs to its end. Each request's outcome: ``exact`` (its
text is the target's greedy text), ``wrong`` (a reply whose text differs), ``failed`` (an error
its client saw: an HTTP status with its message, a refused or reset connection, a stream cut
before its ``[DONE]``) or ``lost`` (no answer within ``--request-timeout-s``). Then, polled for
up to 60 s after the load has stopped, the leak checks: no KV slot held on the verifier (``goodspeed:kv_slots_used``), its
sessions (``goodspeed:active_drafters``) exactly those the live nodes hold
(``goodspeed:drafter_sessions``), no request running anywhere, and every process's resident
memory within 10% of what it was under load before the first fault (the verifier's new process
against the first one's).

Passes (exit 0) when no request is wrong or lost and every check holds within the 60 s.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench.bench_http import free_port
from bench.bench_soak import rss_mb
from goodspeed.launch.cluster.certs import init_certs, renew_certs
from goodspeed.launch.cluster.links import EdgeNetwork, LinkError, LinkSpec, check_support
from goodspeed.launch.cluster.local import _pinned
from goodspeed.verifier.auth import add_token

CLI = [sys.executable, "-m", "goodspeed.launch.cli"]
NODE_PORT = 8000
PROMPTS = ["def parse(self, text):\n", "import os\nimport sys\n", "class Reader:\n    def __init__(self", "for i in range(",
           "    return json.loads(", "if __name__ == '__main__':\n", "def scan(s, idx):\n    ", "raise ValueError("]
SETTLE_S = 60.0



def gauges(url: str, headers: dict | None = None) -> dict[str, float]:
    """The ``goodspeed:`` gauges and counters of ``url``/metrics (no labels)."""
    with get(f"{url}/metrics", headers) as reply:
        out = {}
        for line in reply.read().decode().splitlines():
            name, _, value = line.partition(" ")
            if name.startswith("goodspeed:") and "{" not in name:
                out[name.split(":", 1)[1]] = float(value)
        return out


_CA: dict[str, ssl.SSLContext] = {}  # "context": what verifies the verifier's HTTPS front (its gRPC certificate)


def urlopen(request: urllib.request.Request | str, timeout_s: float):
    url = request.full_url if isinstance(request, urllib.request.Request) else request
    return urllib.request.urlopen(request, timeout=timeout_s, context=_CA.get("context") if url.startswith("https:") else None)


def get(url: str, headers: dict | None = None, timeout_s: float = 10):
    return urlopen(urllib.request.Request(url, headers=headers or {}), timeout_s)


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen | None = None, log: Path | None = None,
              headers: dict | None = None) -> None:
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited ({proc.returncode}): {log.read_text()[-2000:] if log else ''}")
        try:
            with get(f"{url}/v1/models", headers, 5):
                return
        except urllib.error.HTTPError as exc:
            if exc.code in (401, 403):  # waiting would not help
                raise RuntimeError(f"{url}/v1/models: HTTP {exc.code}: {exc.read()[:300]!r}") from None
            last = exc
            time.sleep(0.5)
        except OSError as exc:
            last = exc
            time.sleep(0.5)
    raise RuntimeError(f"{url} did not serve within {timeout_s:.0f} s ({last}): {log.read_text()[-2000:] if log else ''}")


_MODELS: dict[str, str] = {}


def model_of(url: str, headers: dict | None = None) -> str:
    if url not in _MODELS:
        with get(f"{url}/v1/models", headers) as reply:
            _MODELS[url] = json.loads(reply.read())["data"][0]["id"]
    return _MODELS[url]


def complete(url: str, prompt: str, max_tokens: int, stream: bool, timeout_s: float, headers: dict | None = None) -> dict:
    """One greedy completion: ``{"outcome": "ok", "text": ...}``, or ``failed`` with what its
    client saw, or ``lost`` (no answer within ``timeout_s``)."""
    try:
        body = {"model": model_of(url, headers), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
        request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json", **(headers or {})})
        with urlopen(request, timeout_s) as reply:
            if not stream:
                return {"outcome": "ok", "text": json.loads(reply.read())["choices"][0]["text"]}
            text = ""
            for raw in reply:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return {"outcome": "ok", "text": text}
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"outcome": "failed", "detail": f"stream error: {chunk['error'].get('message')}"}
                text += chunk["choices"][0].get("text") or ""
            return {"outcome": "failed", "detail": "stream cut before [DONE]"}
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError, OSError):
            message = "(no JSON error body)"
        return {"outcome": "failed", "detail": f"HTTP {exc.code}: {message}"}
    except (TimeoutError, socket.timeout):
        return {"outcome": "lost", "detail": f"no answer within {timeout_s:.0f} s"}
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, (TimeoutError, socket.timeout)):
            return {"outcome": "lost", "detail": f"no answer within {timeout_s:.0f} s"}
        return {"outcome": "failed", "detail": f"connection: {exc.reason}"}
    except (OSError, ValueError) as exc:  # reset, broken pipe, a chunk cut mid-way
        return {"outcome": "failed", "detail": f"{type(exc).__name__}: {exc}"}


class Chaos:
    def __init__(self, args, work: Path) -> None:
        self.args, self.work = args, work
        self.names = [f"n{i}" for i in range(args.nodes)]
        self.grpc_port, self.http_port = free_port(), free_port()
        self.verifier_url = f"https://127.0.0.1:{self.http_port}"  # the front serves the gRPC certificate
        self.verifier: subprocess.Popen | None = None
        self.verifier_starts = 0
        self.nodes: dict[str, subprocess.Popen] = {}
        self.node_starts: dict[str, int] = {}
        self.records: list[dict] = []
        self.faults: list[dict] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.t0 = time.monotonic()
        self.operator: dict = {}  # the bearer token the verifier's front wants from this harness (set in run)
        self.users: dict = {}  # the API key the nodes' fronts want from their clients (set in run)

    def at(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    def say(self, what: str) -> None:
        print(f"chaos {self.at():7.1f} s  {what}", file=sys.stderr, flush=True)

    # ----------------------------------------------------------------------- processes

    def start_verifier(self) -> None:
        certs = self.work / "certs"
        cmd = CLI + ["verifier", "--target", self.args.target, "--dtype", "float32", "--port", str(self.grpc_port),
                     "--http-port", str(self.http_port), "--local-draft", "ngram", "--local-policy", "none",
                     "--budget", "64", "--max-draft-len", "6", "--max-drafters", str(4 * self.args.nodes + 8), "--seed", "0",
                     "--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key"),
                     "--tls-client-ca", str(certs / "ca.pem"), "--auth-tokens", str(self.work / "tokens.json")]
        cmd, keywords = _pinned(cmd, (0,))
        self.verifier_starts += 1
        log = self.work / f"verifier-{self.verifier_starts}.log"
        self.verifier = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log, "w"), **keywords)
        wait_http(self.verifier_url, 300, self.verifier, log, self.operator)

    def node_url(self, name: str) -> str:
        return f"http://{self.net[name].drafter_ip}:{NODE_PORT}"

    def start_node(self, name: str, wait: bool = True) -> None:
        edge, certs = self.net[name], self.work / "certs"
        cmd = CLI + ["drafter", "--name", name, "--verifier", edge.verifier_address, "--draft", "suffix", "--tokenizer", self.args.target,
                     "--serve", f"{edge.drafter_ip}:{NODE_PORT}", "--max-concurrency", "2", "--seed", str(self.names.index(name)),
                     "--tls-ca", str(certs / "ca.pem"), "--tls-cert", str(certs / f"{name}.pem"), "--tls-key", str(certs / f"{name}.key"),
                     "--tls-server-name", "localhost", "--token-file", str(self.work / f"{name}.token"),
                     "--api-key-file", str(self.work / "api-key"),
                     "--connect-timeout-s", str(self.args.request_timeout_s)]
        cmd, keywords = _pinned(edge.wrap(cmd), (1,) if (os.cpu_count() or 1) > 1 else None)
        self.node_starts[name] = self.node_starts.get(name, 0) + 1
        log = self.work / f"{name}-{self.node_starts[name]}.log"
        self.nodes[name] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log, "w"), **keywords)
        if wait:
            wait_http(self.node_url(name), 600, self.nodes[name], log, self.users)

    # ----------------------------------------------------------------------- load

    def client(self, name: str, references: dict[str, str]) -> None:
        rng = random.Random(f"{self.args.seed}-{name}")
        count = 0
        while not self.stop.is_set():
            prompt = rng.choice(PROMPTS)
            stream = count % 2 == 1
            started = self.at()
            reply = complete(self.node_url(name), prompt, self.args.max_tokens, stream, self.args.request_timeout_s, self.users)
            if reply["outcome"] == "ok":
                reply = {"outcome": "exact"} if reply["text"] == references[prompt] else {
                    "outcome": "wrong", "detail": f"got {reply['text'][:120]!r}, want {references[prompt][:120]!r}"}
            with self.lock:
                self.records.append({"node": name, "prompt": PROMPTS.index(prompt), "stream": stream, "start_s": started,
                                     "end_s": self.at(), **reply})
            count += 1
            if reply["outcome"] != "exact":
                time.sleep(1.0)  # a client whose request failed retries after a pause, as a real one would

    def snapshot(self) -> dict:
        """The verifier's and every live node's gauges and resident memory."""
        out = {"at_s": self.at(), "verifier": {**self._gauges(self.verifier_url, self.operator), "rss_mb": rss_mb(self.verifier.pid)},
               "nodes": {}}
        for name, proc in self.nodes.items():
            if proc.poll() is None:
                out["nodes"][name] = {**self._gauges(self.node_url(name), self.users), "rss_mb": rss_mb(proc.pid)}
        return out

    @staticmethod
    def _gauges(url: str, headers: dict | None = None) -> dict[str, float]:
        keep = ("active_drafters", "kv_slots_used", "kv_reserved_positions", "num_requests_running", "num_requests_waiting",
                "drafter_sessions")
        try:
            values = gauges(url, headers)
        except OSError as exc:
            return {"error": str(exc)}
        return {k: values[k] for k in keep if k in values}

    def fault(self, what: str, **detail) -> None:
        self.faults.append({"fault": what, "at_s": self.at(), **detail})
        self.say(f"{what} {detail or ''}")

    # ----------------------------------------------------------------------- the run

    def run(self) -> dict:
        args = self.args
        init_certs(self.work / "certs", names=tuple(self.names))
        _CA["context"] = ssl.create_default_context(cafile=str(self.work / "certs" / "ca.pem"))
        for name in self.names:
            (self.work / f"{name}.token").write_text(add_token(self.work / "tokens.json", name) + "\n")
        self.operator = {"Authorization": f"Bearer {add_token(self.work / 'tokens.json', 'chaos-operator')}"}
        api_key = secrets.token_urlsafe(24)
        (self.work / "api-key").write_text(api_key + "\n")
        self.users = {"Authorization": f"Bearer {api_key}"}
        rng = random.Random(args.seed)
        links = {}
        for name in self.names:
            rtt = rng.uniform(10, 120)
            links[name] = LinkSpec(rtt_ms=rtt, jitter_ms=rtt / 8, mbit=rng.choice((5, 10, 20, 50)), loss=rng.choice((0.0, 0.0, 0.005, 0.01)))
        self.say(f"starting the verifier and {args.nodes} nodes behind emulated links")
        self.start_verifier()
        references = {p: complete(self.verifier_url, p, args.max_tokens, False, 120, self.operator)["text"] for p in PROMPTS}
        with EdgeNetwork(links, upstream=("127.0.0.1", self.grpc_port), seed=args.seed) as net:
            self.net = net
            for name in self.names:  # started together, waited for together: the starts overlap
                self.start_node(name, wait=False)
            for name in self.names:
                wait_http(self.node_url(name), 900, self.nodes[name], self.work / f"{name}-1.log", self.users)
            self.say("all nodes serving; load on")
            clients = [threading.Thread(target=self.client, args=(n, references), daemon=True) for n in self.names]
            for t in clients:
                t.start()
            try:
                report = self._faults(clients)
            finally:
                self.stop.set()
                for proc in self.nodes.values():
                    if proc.poll() is None:
                        proc.kill()
                if self.verifier is not None and self.verifier.poll() is None:
                    self.verifier.kill()
                for proc in (*self.nodes.values(), self.verifier):
                    if proc is not None:
                        proc.wait(30)
        return {"links": {n: vars(spec) for n, spec in links.items()}, "references": references, **report}

    def _faults(self, clients: list[threading.Thread]) -> dict:
        args = self.args
        time.sleep(args.warm_up_s)
        baseline = self.snapshot()
        partitioned, killed = self.names[0], self.names[1 % len(self.names)]

        renewed = renew_certs(self.work / "certs")
        self.fault("rotate", renewed=len(renewed), https_serving_it_after_s=self._served_renewal(renewed["server"].cert))
        time.sleep(args.gap_s)

        in_flight = self._gauges(self.verifier_url, self.operator).get("num_requests_running")
        self.verifier.send_signal(signal.SIGKILL)
        self.verifier.wait(30)
        self.fault("verifier_kill", requests_running=in_flight)
        self.start_verifier()
        self.fault("verifier_restarted")
        time.sleep(args.gap_s)

        self.net.partition(partitioned)
        self.fault("partition", node=partitioned, seconds=args.partition_s)
        time.sleep(args.partition_s)
        self.net.heal(partitioned)
        self.fault("heal", node=partitioned)
        time.sleep(args.gap_s)

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self._gauges(self.node_url(killed), self.users).get("num_requests_running", 0) < 1:
            time.sleep(0.05)
        running = self._gauges(self.node_url(killed), self.users).get("num_requests_running")
        self.nodes[killed].send_signal(signal.SIGKILL)
        self.nodes[killed].wait(30)
        self.fault("node_kill", node=killed, requests_running=running)
        self.start_node(killed)
        self.fault("node_restarted", node=killed)
        time.sleep(args.tail_s)

        self.stop.set()
        self.say("load off; waiting for the clients' last requests")
        for t in clients:
            t.join(args.request_timeout_s + 30)
        load_end = self.at()
        settled, deadline = None, time.monotonic() + SETTLE_S
        while True:  # polled until nothing is left behind, for SETTLE_S at most
            after = self.snapshot()
            if not self._leaks(baseline, after):
                settled = round(after["at_s"] - load_end, 1)
                break
            if time.monotonic() > deadline:
                break
            time.sleep(2)
        problems = self._leaks(baseline, after)
        outcomes = {k: sum(r["outcome"] == k for r in self.records) for k in ("exact", "wrong", "failed", "lost")}
        failed = {}
        for r in self.records:
            if r["outcome"] != "exact":
                failed.setdefault(r["detail"], 0)
                failed[r["detail"]] += 1
        return {"faults": self.faults, "load_end_s": load_end, "requests": len(self.records), "outcomes": outcomes,
                "not_exact": failed, "baseline": baseline, "after": after, "leaks": problems,
                "settled_s_after_load": settled, "passed": outcomes["wrong"] == 0 and outcomes["lost"] == 0 and not problems,
                "records": self.records}

    def _served_renewal(self, cert: Path, timeout_s: float = 30.0) -> float | None:
        """Seconds until the verifier's HTTPS front serves ``cert`` (renewed on disk), or None."""
        want, started = cert.read_bytes(), time.monotonic()
        host, port = self.verifier_url.removeprefix("https://").split(":")
        while time.monotonic() - started < timeout_s:
            served = ssl.get_server_certificate((host, int(port)), ca_certs=str(self.work / "certs" / "ca.pem"), timeout=10)
            if ssl.PEM_cert_to_DER_cert(served) == ssl.PEM_cert_to_DER_cert(want.decode()):
                return round(time.monotonic() - started, 2)
            time.sleep(0.2)
        return None

    def _leaks(self, baseline: dict, after: dict) -> list[str]:
        """What the run left behind, against ``baseline`` (under load, before the first fault)."""
        out = []
        v = after["verifier"]
        if "error" in v:
            return [f"verifier metrics: {v['error']}"]
        if v.get("kv_slots_used", 0) != 0:
            out.append(f"verifier holds {v['kv_slots_used']:g} KV slots")
        if v.get("num_requests_running", 0) != 0:
            out.append(f"verifier has {v['num_requests_running']:g} requests running")
        held = sum(n.get("drafter_sessions", 0) for n in after["nodes"].values())
        if v.get("active_drafters") != held:
            out.append(f"verifier has {v.get('active_drafters')} sessions, the live nodes hold {held:g}")
        if v["rss_mb"] > 1.1 * baseline["verifier"]["rss_mb"]:
            out.append(f"verifier RSS {v['rss_mb']:.0f} MB > 1.1 x {baseline['verifier']['rss_mb']:.0f} MB")
        for name in self.names:
            n, b = after["nodes"].get(name), baseline["nodes"].get(name)
            if n is None or "error" in n:
                out.append(f"node {name} not serving: {n}")
                continue
            if n.get("num_requests_running", 0) != 0:
                out.append(f"node {name} has {n['num_requests_running']:g} requests running")
            if b is not None and n["rss_mb"] > 1.1 * b["rss_mb"]:
                out.append(f"node {name} RSS {n['rss_mb']:.0f} MB > 1.1 x {b['rss_mb']:.0f} MB")
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=32)
    ap.add_argument("--partition-s", type=float, default=30.0)
    ap.add_argument("--warm-up-s", type=float, default=20.0, help="load before the first fault (the baseline is taken then)")
    ap.add_argument("--gap-s", type=float, default=10.0, help="load between two faults")
    ap.add_argument("--tail-s", type=float, default=15.0, help="load after the last fault")
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--request-timeout-s", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", default="demo:target", help="the target (and the nodes' tokenizer): demo:<name>, real:<name> or a directory")
    ap.add_argument("--json", default=None, help="write the report here")
    args = ap.parse_args(argv)
    if args.nodes < 2:
        ap.error("--nodes must be >= 2 (one is partitioned, another killed)")
    try:
        check_support()
    except LinkError as exc:
        print(f"bench_chaos: {exc}", file=sys.stderr)
        return 2
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    with tempfile.TemporaryDirectory(prefix="goodspeed-chaos-") as tmp:
        report = Chaos(args, Path(tmp)).run()
    report = {"command": "python -m bench.bench_chaos " + " ".join(sys.argv[1:] if argv is None else argv), "date": started,
              "machine": {"cpus": os.cpu_count(), "uname": " ".join(os.uname())}, "args": vars(args), **report}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    summary = {k: report[k] for k in ("requests", "outcomes", "not_exact", "leaks", "settled_s_after_load", "passed")}
    print(json.dumps({**summary, "faults": report["faults"]}, indent=1))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
