"""Faults with HTTP requests in flight: an edge node (its own process) hung (SIGSTOP) and then
killed with `kill -9` while it streams completions. Its clients see their connection fail (no silent truncation: the stream
ends without its final chunk); the verifier frees every session and KV slot the node held, and a
new node's request on the same verifier is the target's greedy decoding."""

import http.client
import json
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest

from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from grpckit import ServerThread
from modelkit import chat_pair, greedy_reference
from prockit import CLI, free_port, model_id, wait_serving

def start_node(verifier: str, tokenizer_dir, port: int, log) -> subprocess.Popen:
    return subprocess.Popen(CLI + ["drafter", "--verifier", verifier, "--draft", "suffix", "--tokenizer", str(tokenizer_dir),
                                   "--serve", f"127.0.0.1:{port}", "--max-concurrency", "3", "--connect-timeout-s", "60"],
                            stdout=subprocess.DEVNULL, stderr=open(log, "w"))


def greedy_text(model, tokenizer, prompt: str, max_tokens: int) -> str:
    """The target's greedy text for ``prompt``, up to its EOS (where a server stops)."""
    ids = greedy_reference(model, tokenizer.encode(prompt), max_tokens)
    return tokenizer.decode(ids[: ids.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in ids else ids)


def completion(port: int, prompt: str, max_tokens: int, stream: bool):
    body = {"model": model_id(port), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=120)


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_an_edge_node_killed_mid_stream_leaves_nothing_behind_on_the_verifier(tmp_path):
    target, _, tokenizer = chat_pair()
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    engine = VerificationEngine(target, EngineConfig(budget=8, max_draft_len=6, seed=5))
    # idle_timeout_s an hour: what frees the node's sessions must be their broken streams, not idleness
    with ServerThread(engine, round_deadline_ms=500, target_name="tiny", idle_timeout_s=3600.0) as server:
        port = free_port()
        node = start_node(server.address, tmp_path / "tokenizer", port, tmp_path / "node.log")
        try:
            wait_serving(port, [node], [tmp_path / "node.log"])
            streams = [completion(port, prompt, 480, stream=True) for prompt in ("import os", "class A:", "def f(x):")]
            for reply in streams:  # each is decoding: its first chunk has arrived
                assert reply.readline().startswith(b"data: ")
            assert server.wait_for(lambda: sum(s.request is not None for s in engine.sessions.by_id.values()) == 3)
            node.send_signal(signal.SIGSTOP)  # hung first, so all three are surely mid-stream when it dies
            assert sum(s.request is not None for s in engine.sessions.by_id.values()) == 3
            node.send_signal(signal.SIGKILL)
            node.wait(30)
            endings = []

            def read_to_the_end(reply):
                try:
                    endings.append(b"data: [DONE]" in reply.read())
                except (OSError, http.client.HTTPException, ValueError):  # a reset, a cut chunk: the client sees it
                    endings.append(False)

            readers = [threading.Thread(target=read_to_the_end, args=(r,)) for r in streams]
            for t in readers:
                t.start()
            for t in readers:
                t.join(60)
            assert endings == [False, False, False]  # no stream ends as if it were complete
            # The verifier notices the node's streams broke: its sessions and KV slots are freed
            assert server.wait_for(lambda: not engine.sessions.by_id, tries=3000), \
                f"sessions left: {list(engine.sessions.by_id)}"
            assert engine.sessions.slots.keys == [] and len(engine.sessions.cache.lengths) == 0  # no KV slot held
        finally:
            if node.poll() is None:
                node.kill()
        # A new node on the same verifier: served, exact
        port = free_port()
        node = start_node(server.address, tmp_path / "tokenizer", port, tmp_path / "node2.log")
        try:
            wait_serving(port, [node], [tmp_path / "node2.log"])
            with completion(port, "def f(x):", 16, stream=False) as reply:
                text = json.loads(reply.read())["choices"][0]["text"]
        finally:
            node.terminate()
            node.wait(30)
    assert text == greedy_text(target, tokenizer, "def f(x):", 16)


def running(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith("goodspeed:num_requests_running"):
                return float(line.split()[-1])
    return 0.0


@pytest.mark.slow  # two verifier starts and two nodes: ~25 s
@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_a_verifier_killed_under_serving_nodes_loses_no_request_silently(tmp_path):
    """The verifier (its own process) hung and killed with `kill -9` while two edge nodes each have
    two completions in flight, then started again on the same address. The nodes wait for it (up
    to their --connect-timeout-s) and go on from each request's committed text: every request in
    flight completes with the target's greedy decoding, and the next requests too. (Before the
    nodes waited, all four failed with 'the verifier refused ...: UNAVAILABLE': told, not lost.)"""
    import torch

    from modelkit import tiny_llama

    target, _, tokenizer = chat_pair()
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    target32 = tiny_llama(0, vocab=len(tokenizer), dtype=torch.float32)  # what the verifier loads in float32
    grpc_port = free_port()

    def start_verifier(log):
        return subprocess.Popen(CLI + ["verifier", "--target", str(tmp_path / "target"), "--port", str(grpc_port),
                                       "--dtype", "float32"], stdout=subprocess.DEVNULL, stderr=open(log, "w"))

    def ask(port, prompt, max_tokens, results):
        try:
            with completion(port, prompt, max_tokens, stream=False) as reply:
                results.append((prompt, "text", json.loads(reply.read())["choices"][0]["text"]))
        except urllib.error.HTTPError as exc:
            results.append((prompt, "error", json.loads(exc.read())["error"]["message"]))

    def reference(prompt, max_tokens):
        return greedy_text(target32, tokenizer, prompt, max_tokens)

    verifier = start_verifier(tmp_path / "v1.log")
    ports = [free_port(), free_port()]
    nodes = [start_node(f"127.0.0.1:{grpc_port}", tmp_path / "target", p, tmp_path / f"node{i}.log") for i, p in enumerate(ports)]
    second = None
    try:
        for i, (p, n) in enumerate(zip(ports, nodes)):
            wait_serving(p, [n], [tmp_path / f"node{i}.log"])
        results: list = []
        prompts = {ports[0]: ["import os", "class A:"], ports[1]: ["def f(x):", "return None"]}
        askers = [threading.Thread(target=ask, args=(p, prompt, 480, results)) for p in ports for prompt in prompts[p]]
        for t in askers:
            t.start()
        deadline = time.monotonic() + 60
        while not all(running(p) == 2 for p in ports) and time.monotonic() < deadline:
            time.sleep(0.01)
        verifier.send_signal(signal.SIGSTOP)  # hung first: every request is surely in flight when it dies
        assert all(running(p) == 2 for p in ports), (results, [running(p) for p in ports])
        verifier.send_signal(signal.SIGKILL)
        verifier.wait(30)
        second = start_verifier(tmp_path / "v2.log")
        for t in askers:
            t.join(120)
        assert len(results) == 4
        for prompt, kind, value in results:  # repaired across the restart, exact
            assert (kind, value) == ("text", reference(prompt, 480)), (prompt, kind, value[:200])
        after: list = []  # the nodes reach the new verifier: served and exact
        for p in ports:
            deadline = time.monotonic() + 90
            while True:
                ask(p, "def f(x):", 24, after)
                if after[-1][1] == "text" or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
        assert [(kind, value) for _, kind, value in after[-2:]] == [("text", reference("def f(x):", 24))] * 2
    finally:
        for proc in (*nodes, verifier, second):
            if proc is not None and proc.poll() is None:
                proc.kill()


def _links_supported() -> bool:
    from goodspeed.launch.cluster.links import LinkError, check_support

    try:
        check_support()
        return True
    except LinkError:
        return False


@pytest.mark.slow  # four nodes behind emulated links, every fault once: ~1 min
@pytest.mark.skipif(not _links_supported(), reason="needs root and network namespaces (edge-link emulation)")
def test_the_chaos_run_at_small_scale_loses_nothing_and_leaves_nothing_behind(tmp_path):
    """``bench.bench_chaos`` with four nodes behind emulated links and every fault (certificates
    renewed, the verifier killed and restarted, a link partitioned and healed, a node killed with
    a request in flight): no request wrong or lost, each failure one its client saw with a reason,
    each fault hit work in flight, the HTTPS front served the renewed certificate, and nothing was
    left behind (KV slots, sessions, running requests, memory)."""
    import sys
    from pathlib import Path

    target, _, tokenizer = chat_pair()
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    report_path = tmp_path / "chaos.json"
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-m", "bench.bench_chaos", "--nodes", "4", "--partition-s", "6", "--warm-up-s", "8",
                          "--gap-s", "5", "--tail-s", "5", "--max-tokens", "32", "--target", str(tmp_path / "target"),
                          "--json", str(report_path)], cwd=root, capture_output=True, text=True, timeout=600)
    assert report_path.exists(), run.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert [f["fault"] for f in report["faults"]] == ["rotate", "verifier_kill", "verifier_restarted", "partition", "heal",
                                                      "node_kill", "node_restarted"]
    faults = {f["fault"]: f for f in report["faults"]}
    assert faults["verifier_kill"]["requests_running"] >= 1 and faults["node_kill"]["requests_running"] >= 1
    assert faults["rotate"]["https_serving_it_after_s"] is not None
    assert report["outcomes"]["wrong"] == 0 and report["outcomes"]["lost"] == 0, report["not_exact"]
    assert report["outcomes"]["exact"] > 0
    reasons = ("HTTP ", "connection: ", "stream cut before [DONE]", "stream error: ", "RemoteDisconnected", "ConnectionResetError")
    assert all(detail.startswith(reasons) for detail in report["not_exact"]), report["not_exact"]
    assert report["leaks"] == [] and report["passed"] and run.returncode == 0
