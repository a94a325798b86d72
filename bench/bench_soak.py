"""Soak: many drafters against one verifier for minutes, with mutual TLS and tokens.

    python -m bench.bench_soak [--drafters 32] [--minutes 10] [--plain-minutes 2] [--json]

Needs the demo models (`goodspeed models build-demo`). The verifier runs as its own process
(`goodspeed verifier`, demo:target, pinned to CPU 0, one thread) with a throwaway CA, server and
client certificates and one token per drafter; the drafters are DrafterClient threads in this
process (demo:draft-tiny, pinned to the other CPUs), each generating code prompts until the time
is up. Reported:

* the verifier's RSS every 5 s (VmRSS from /proc), and its spread after the first minute
  (warm-up): flat means within 5%;
* errors: drafter exceptions (each named), and requests that produced no token;
* rounds, tokens, and the mean verifier-side round phases (receive / verify / send, from its
  JSON round log) — then the same workload for ``--plain-minutes`` without TLS or tokens, so
  the TLS cost per round is a ratio within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from bench.bench_local import code_prompts, load_pair
from goodspeed.drafter.client import DrafterClient, DrafterConfig
from goodspeed.drafter.credentials import ClientTLS
from goodspeed.drafter.runner import DraftRunner
from goodspeed.launch.cluster.certs import init_certs
from goodspeed.launch.cluster.local import _pinned
from goodspeed.verifier.auth import add_token

CLI = [sys.executable, "-m", "goodspeed.launch.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def start_verifier(port: int, log_path: Path, secure: dict | None) -> subprocess.Popen:
    cmd = CLI + ["verifier", "--target", "demo:target", "--port", str(port), "--budget", "32", "--max-draft-len", "4",
                 "--round-deadline-ms", "500", "--idle-timeout-s", "120", "--seed", "0"]
    if secure:
        cmd += ["--tls-cert", secure["cert"], "--tls-key", secure["key"], "--tls-client-ca", secure["ca"], "--auth-tokens", secure["tokens"]]
    cmd, keywords = _pinned(cmd, (0,))  # CPU 0, one thread; no preexec_fn (see launch.local)
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log_path, "w"), **keywords)


def wait_serving(log_path: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if log_path.exists() and '"event": "serving"' in log_path.read_text():
            return
        time.sleep(0.2)
    raise RuntimeError(f"verifier did not start: {log_path.read_text()[-2000:]}")


def run(args, minutes: float, secure: bool, workdir: Path, draft, prompts) -> dict:
    port = free_port()
    creds = None
    names = [f"soak-{i}" for i in range(args.drafters)]
    if secure:
        issued = init_certs(workdir / "certs", names=tuple(names))
        tokens = {n: add_token(workdir / "tokens.json", n) for n in names}
        creds = {"cert": str(issued["server"].cert), "key": str(issued["server"].key), "ca": str(issued["ca"].cert),
                 "tokens": str(workdir / "tokens.json")}
    log_path = workdir / ("verifier-tls.log" if secure else "verifier-plain.log")
    verifier = start_verifier(port, log_path, creds)
    stats = {"requests": 0, "empty": 0, "errors": [], "tokens": 0}
    lock = threading.Lock()
    rss: list[tuple[float, float]] = []
    try:
        wait_serving(log_path)
        started = time.monotonic()
        stop_at = started + minutes * 60

        def drafter(i: int) -> None:
            name = names[i]
            tls = ClientTLS(str(issued["ca"].cert), str(issued[name].cert), str(issued[name].key)) if secure else None
            config = DrafterConfig(f"127.0.0.1:{port}", name, fingerprint=draft.fingerprint, max_new_tokens=32, seed=i, tls=tls,
                                   token=tokens[name] if secure else None)
            client = DrafterClient(config, DraftRunner(draft.model))
            try:
                client.join()
                k = i
                while time.monotonic() < stop_at:
                    result = client.generate(str(k), prompts[k % len(prompts)])
                    with lock:
                        stats["requests"] += 1
                        stats["tokens"] += len(result.token_ids)
                        stats["empty"] += not result.token_ids
                    k += args.drafters
            except Exception as exc:  # counted, not hidden: the soak's point is that there are none
                with lock:
                    stats["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
            finally:
                client.close()

        threads = [threading.Thread(target=drafter, args=(i,), daemon=True) for i in range(args.drafters)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            rss.append((time.monotonic() - started, rss_mb(verifier.pid)))
            if not args.quiet:
                print(f"{'tls' if secure else 'plain'} {rss[-1][0]:6.0f} s  verifier RSS {rss[-1][1]:7.1f} MB  "
                      f"requests {stats['requests']}  errors {len(stats['errors'])}", file=sys.stderr)
            time.sleep(5)
        wall = time.monotonic() - started
    finally:
        verifier.terminate()
        verifier.wait(60)
    rounds = [json.loads(line) for line in log_path.read_text().splitlines() if '"event": "round"' in line]
    after_warmup = [mb for t, mb in rss if t >= 60] or [mb for _, mb in rss]
    phase = {k: statistics.mean(r[k] for r in rounds) * 1000 for k in ("receive_s", "verify_s", "send_s")} if rounds else {}
    return {"tls": secure, "drafters": args.drafters, "minutes": minutes, "wall_s": wall, "requests": stats["requests"],
            "tokens": stats["tokens"], "errors": stats["errors"], "empty_outputs": stats["empty"], "rounds": len(rounds),
            "round_phase_ms": phase, "rss_mb": rss, "rss_after_warmup_mb": [min(after_warmup), max(after_warmup)],
            "rss_spread": (max(after_warmup) - min(after_warmup)) / min(after_warmup)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafters", type=int, default=32)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--plain-minutes", type=float, default=2.0, help="the same without TLS, for the cost per round (0: skip)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args()
    pair = load_pair("target", "draft-tiny")
    if pair is None:
        return 1
    torch.set_num_threads(1)
    others = set(range(1, os.cpu_count() or 2)) or {0}
    os.sched_setaffinity(0, others)
    draft = pair[1]
    prompts = code_prompts(draft.tokenizer, 64, seed=0)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        results.append(run(args, args.minutes, True, Path(tmp), draft, prompts))
        if args.plain_minutes > 0:
            results.append(run(args, args.plain_minutes, False, Path(tmp), draft, prompts))
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print("| run | minutes | requests | tokens | rounds | errors | receive / verify / send ms per round | verifier RSS after warm-up MB (spread) |")
        print("|---|---|---|---|---|---|---|---|")
        for r in results:
            p = r["round_phase_ms"]
            lo, hi = r["rss_after_warmup_mb"]
            print(f"| {'mutual TLS + tokens' if r['tls'] else 'plaintext'} | {r['minutes']:g} | {r['requests']} | {r['tokens']} | "
                  f"{r['rounds']} | {len(r['errors'])} | {p.get('receive_s', 0):.1f} / {p.get('verify_s', 0):.1f} / {p.get('send_s', 0):.2f} | "
                  f"{lo:.0f}-{hi:.0f} ({r['rss_spread']:.1%}) |")
    return 0 if all(not r["errors"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
