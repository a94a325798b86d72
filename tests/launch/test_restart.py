"""Restart without loss, with real processes and real credentials: the verifier is SIGKILLed
mid-run and started again on the same address; the drafter reconnects with its certificate and
token and its outputs equal an uninterrupted run's (greedy: the target's own decoding)."""

import json
import socket
import subprocess
import sys
import time

import pytest
import torch

from goodspeed.launch.cluster.certs import init_certs
from goodspeed.verifier.auth import add_token
from modelkit import greedy_reference, perturbed, save_models, tiny_llama

VOCAB = 300
CLI = [sys.executable, "-m", "goodspeed.launch.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_verifier(target_dir, port, certs, tokens, log_path):
    cmd = CLI + ["verifier", "--target", str(target_dir), "--port", str(port), "--budget", "4", "--max-draft-len", "4",
                 "--dtype", "float32", "--tls-cert", str(certs["server"].cert), "--tls-key", str(certs["server"].key),
                 "--tls-client-ca", str(certs["ca"].cert), "--auth-tokens", str(tokens)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log_path, "w"))


def wait_for(log_path, event, count=1, timeout_s=120):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = [json.loads(x) for x in log_path.read_text().splitlines() if x.startswith("{")] if log_path.exists() else []
        if sum(e.get("event") == event for e in lines) >= count:
            return
        time.sleep(0.05)
    pytest.fail(f"no {count} x {event!r} in {log_path} within {timeout_s} s:\n{log_path.read_text()[-2000:]}")


@pytest.mark.slow
def test_kill_9_and_restart_mid_run_loses_nothing(tmp_path):
    target = tiny_llama(0, vocab=VOCAB)
    paths = save_models(tmp_path / "models", {"target": target, "draft": perturbed(target, 0.3, 1)}, VOCAB)
    certs = init_certs(tmp_path / "certs", names=("edge",))
    tokens = tmp_path / "tokens.json"
    (tmp_path / "edge.token").write_text(add_token(tokens, "edge"))
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"id": str(i), "prompt_ids": p}) + "\n" for i, p in enumerate(prompts)))
    port = free_port()
    first = start_verifier(paths["target"], port, certs, tokens, tmp_path / "v1.log")
    drafter = subprocess.Popen(CLI + [
        "drafter", "--verifier", f"127.0.0.1:{port}", "--draft", str(paths["draft"]), "--prompts", str(tmp_path / "prompts.jsonl"),
        "--out", str(tmp_path / "out.jsonl"), "--name", "edge", "--max-new-tokens", "120", "--dtype", "float32", "--quiet",
        "--tls-ca", str(certs["ca"].cert), "--tls-cert", str(certs["edge"].cert), "--tls-key", str(certs["edge"].key),
        "--token-file", str(tmp_path / "edge.token"), "--connect-timeout-s", "90"], stdout=subprocess.DEVNULL, stderr=open(tmp_path / "d.log", "w"))
    try:
        wait_for(tmp_path / "v1.log", "round", count=5)  # mid-run: rounds are being verified
        first.kill()  # SIGKILL: no drain, no goodbye
        first.wait(10)
        second = start_verifier(paths["target"], port, certs, tokens, tmp_path / "v2.log")
        try:
            assert drafter.wait(180) == 0, (tmp_path / "d.log").read_text()[-2000:]
        finally:
            second.terminate()
            second.wait(30)
    finally:
        for proc in (first, drafter):
            if proc.poll() is None:
                proc.kill()
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    target32 = tiny_llama(0, vocab=VOCAB, dtype=torch.float32)
    assert [r["token_ids"] for r in records] == [greedy_reference(target32, p, 120) for p in prompts]
    assert sum(r["repairs"] for r in records) >= 1  # it really reconnected
    second_log = [json.loads(x) for x in (tmp_path / "v2.log").read_text().splitlines() if x.startswith("{")]
    assert any(e["event"] == "join" for e in second_log)
