"""Real processes for tests: the CLI to start them with, a free loopback port, and waiting for an
HTTP front to serve while watching that its processes stay up (their logs in the failure)."""

import json
import socket
import sys
import time
import urllib.request

import pytest

CLI = [sys.executable, "-m", "goodspeed.launch.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(port: int, procs, logs, timeout_s: float = 120) -> None:
    """Until ``GET /health`` on ``port`` answers; fails at once if one of ``procs`` exits (with its
    log from ``logs``), or after ``timeout_s`` (with the last log)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc, log in zip(procs, logs):
            if proc.poll() is not None:
                pytest.fail(f"exited {proc.returncode}:\n{log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    pytest.fail(f"nothing served on port {port} within {timeout_s} s:\n{logs[-1].read_text()[-2000:]}")


def model_id(port: int) -> str:
    """The model an OpenAI front on ``port`` serves (its first)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as reply:
        return json.loads(reply.read())["data"][0]["id"]
