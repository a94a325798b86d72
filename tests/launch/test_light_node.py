"""An edge node drafting by lookup alone never loads torch: `goodspeed drafter --draft suffix
--serve` as its own process, serving a chat completion and a JSON-schema one through a verifier
process. Checked in the node's memory map (``/proc/PID/maps``: torch's library is mapped once
anything imports torch); the verifier's own map, which must show it, is the control that the
check sees torch where it is loaded. Both processes, once serving, freeze their start-up heap
for the cyclic collector (their ``heap_frozen`` event, after ``serving``)."""

import json
import subprocess
import urllib.request
from pathlib import Path

import pytest

from modelkit import chat_pair
from prockit import CLI, free_port, model_id, wait_serving

def maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def post(port: int, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read())


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/PID/maps (Linux)")
def test_a_node_drafting_by_suffix_serves_without_loading_torch(tmp_path):
    target, _, tokenizer = chat_pair()
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    grpc_port, http_port = free_port(), free_port()
    logs = [tmp_path / "verifier.log", tmp_path / "node.log"]
    verifier = subprocess.Popen(CLI + ["verifier", "--target", str(tmp_path / "target"), "--port", str(grpc_port),
                                       "--dtype", "float32"], stdout=subprocess.DEVNULL, stderr=open(logs[0], "w"))
    node = subprocess.Popen(CLI + ["drafter", "--verifier", f"127.0.0.1:{grpc_port}", "--draft", "suffix",
                                   "--tokenizer", str(tmp_path / "target"), "--serve", f"127.0.0.1:{http_port}",
                                   "--connect-timeout-s", "120"], stdout=subprocess.DEVNULL, stderr=open(logs[1], "w"))
    try:
        wait_serving(http_port, [verifier, node], logs)
        model = model_id(http_port)
        chat = post(http_port, {"model": model, "messages": [{"role": "user", "content": "def f(x):"}],
                                "max_tokens": 12, "temperature": 0})
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        structured = post(http_port, {"model": model, "messages": [{"role": "user", "content": "a number"}], "max_tokens": 24,
                                      "temperature": 0, "response_format": {"type": "json_schema",
                                                                            "json_schema": {"name": "n", "schema": schema}}})
        assert chat["usage"]["completion_tokens"] > 0 and structured["usage"]["completion_tokens"] > 0
        assert structured["choices"][0]["message"]["content"].startswith("{")  # the grammar was applied
        assert maps_torch(verifier.pid)  # the control: the check sees torch where it is loaded
        assert not maps_torch(node.pid)
    finally:
        for proc in (node, verifier):
            proc.terminate()
        for proc in (node, verifier):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    for log in logs:
        events = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
        names = [e["event"] for e in events]
        assert names.index("heap_frozen") > names.index("serving"), log.name
        assert next(e for e in events if e["event"] == "heap_frozen")["objects"] > 10_000, log.name
