"""Edge-link emulation: the userspace proxy adds the configured delay, jitter and loss stalls,
and a partition holds everything until it heals;
namespaces + veth + tbf cap the bandwidth; setup and teardown leave nothing behind; without root
the feature is refused with a clear message."""

import socket
import statistics
import subprocess
import sys
import threading
import time

import pytest

from goodspeed.launch.cluster import links
from goodspeed.launch.cluster.links import DelayProxy, EdgeNetwork, LinkError, LinkSpec


def echo_server(host="127.0.0.1"):
    srv = socket.socket()
    srv.bind((host, 0))
    srv.listen()

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=lambda c=conn: [c.sendall(d) for d in iter(lambda: c.recv(65536), b"")], daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return srv


def round_trips(port, n, host="127.0.0.1"):
    sock = socket.create_connection((host, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        sock.sendall(b"x" * 32)
        got = b""
        while len(got) < 32:
            got += sock.recv(64)
        out.append(time.perf_counter() - t0)
    sock.close()
    return out


def test_proxy_adds_the_configured_rtt_and_jitter():
    """The proxy holds each chunk for a one-way delay of 20 +- 5 ms (40 ms RTT, 5 ms jitter): the
    delays it drew (its own record, not a clock's) lie in that range and vary, and no round trip
    came back sooner than two of the shortest. How much later it came is the machine's, so it
    is not asserted."""
    srv = echo_server()
    proxy = DelayProxy("127.0.0.1", ("127.0.0.1", srv.getsockname()[1]), LinkSpec(rtt_ms=40, jitter_ms=5), seed=1)
    drawn = []
    draw = proxy._delay_s
    proxy._delay_s = lambda: drawn.append(draw()) or drawn[-1]
    port = proxy.start()
    try:
        rtts = round_trips(port, 30)
    finally:
        proxy.stop()
        srv.close()
    assert len(drawn) >= 60 and all(0.015 <= d <= 0.025 for d in drawn), drawn  # one per chunk, each way
    assert statistics.pstdev(drawn) > 0.001  # jitter is really there
    assert min(rtts) >= 2 * min(drawn) - 0.001, (min(rtts), min(drawn))  # held both ways


def test_proxy_loss_stalls_like_a_retransmission():
    srv = echo_server()
    link = LinkSpec(rtt_ms=10, loss=0.3)
    proxy = DelayProxy("127.0.0.1", ("127.0.0.1", srv.getsockname()[1]), link, seed=2)
    port = proxy.start()
    try:
        rtts = round_trips(port, 30)
    finally:
        proxy.stop()
        srv.close()
    stalled = [t for t in rtts if t >= link.retransmit_s]
    # each round trip is two chunks lost with p = 0.3 each: about half the round trips stall
    assert 5 <= len(stalled) <= 25 and len(stalled) <= proxy.stats["lost"], (rtts, proxy.stats)
    assert all(t < 0.1 for t in rtts if t < link.retransmit_s)


def test_a_partitioned_link_carries_nothing_until_it_heals():
    """While cut, an open connection's bytes and a new connection's get no reply (nothing arrives
    in 0.3 s, however loaded the machine); after the heal both get their echo, in order, with
    nothing lost."""
    srv = echo_server()
    proxy = DelayProxy("127.0.0.1", ("127.0.0.1", srv.getsockname()[1]), LinkSpec(rtt_ms=2), seed=3)
    port = proxy.start()
    try:
        before = socket.create_connection(("127.0.0.1", port))
        before.sendall(b"up")
        assert before.recv(16) == b"up"  # the link works
        proxy.partition()
        assert proxy.cut
        before.sendall(b"held-1")
        before.sendall(b"held-2")
        during = socket.create_connection(("127.0.0.1", port))  # accepted by the proxy, forwarded nowhere
        during.sendall(b"new")
        for sock in (before, during):
            sock.settimeout(0.3)
            with pytest.raises(socket.timeout):
                sock.recv(16)
        proxy.heal()
        assert not proxy.cut
        for sock, want in ((before, b"held-1held-2"), (during, b"new")):
            sock.settimeout(30)
            got = b""
            while len(got) < len(want):
                got += sock.recv(64)
            assert got == want
            sock.close()
    finally:
        proxy.stop()
        srv.close()


def test_link_spec_validation():
    with pytest.raises(ValueError, match="loss"):
        LinkSpec(loss=1.0)
    with pytest.raises(ValueError, match="jitter"):
        LinkSpec(rtt_ms=4, jitter_ms=3)
    with pytest.raises(ValueError, match="mbit"):
        LinkSpec(mbit=0)


def test_refused_clearly_without_root(monkeypatch):
    monkeypatch.setattr(links.os, "geteuid", lambda: 1000)
    with pytest.raises(LinkError, match="needs root"):
        EdgeNetwork({"d0": LinkSpec(rtt_ms=10)}).__enter__()


def _supported():
    try:
        links.check_support()
        return True
    except LinkError:
        return False


@pytest.mark.skipif(not _supported(), reason="needs root and network namespaces")
def test_namespace_link_caps_bandwidth_and_leaves_nothing_behind():
    mbit, size = 8.0, 1_500_000
    with EdgeNetwork({"d0": LinkSpec(mbit=mbit)}) as net:
        edge = net["d0"]
        srv = socket.socket()
        srv.bind((edge.host_ip, 0))
        srv.listen()
        port = srv.getsockname()[1]
        received = {}

        def sink():
            conn, _ = srv.accept()
            t0, n = time.perf_counter(), 0
            while data := conn.recv(65536):
                n += len(data)
            received.update(bytes=n, seconds=time.perf_counter() - t0)

        thread = threading.Thread(target=sink)
        thread.start()
        code = f"import socket; s = socket.create_connection(('{edge.host_ip}', {port})); s.sendall(b'x' * {size}); s.close()"
        subprocess.run(edge.wrap([sys.executable, "-c", code]), check=True, timeout=60)
        thread.join(60)
        srv.close()
        namespace, dev = edge.namespace, edge.host_dev
    rate_mbit = received["bytes"] * 8 / received["seconds"] / 1e6
    assert received["bytes"] == size
    assert 0.6 * mbit <= rate_mbit <= 1.1 * mbit, rate_mbit
    assert namespace not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert subprocess.run(["ip", "link", "show", dev], capture_output=True).returncode != 0


@pytest.mark.skipif(not _supported(), reason="needs root and network namespaces")
def test_drafter_namespace_reaches_the_host_through_the_delay_proxy():
    srv = echo_server()
    with EdgeNetwork({"d0": LinkSpec(rtt_ms=30)}, upstream=("127.0.0.1", srv.getsockname()[1])) as net:
        edge = net["d0"]
        host, port = edge.verifier_address.split(":")
        code = ("import socket, time; s = socket.create_connection(('%s', %s)); s.setsockopt(6, 1, 1); r = []\n"
                "for _ in range(10):\n t = time.perf_counter(); s.sendall(b'x'); s.recv(1); r.append(time.perf_counter() - t)\n"
                "print(sorted(r)[5] * 1000)") % (host, port)
        out = subprocess.run(edge.wrap([sys.executable, "-c", code]), capture_output=True, text=True, timeout=60)
    srv.close()
    assert out.returncode == 0, out.stderr
    assert 27 <= float(out.stdout) <= 40


@pytest.mark.skipif(not _supported(), reason="needs root and network namespaces")
def test_launch_with_an_edge_link_is_lossless_and_reports_receive_time(tmp_path):
    import json

    import torch

    from goodspeed.launch.cluster.local import launch_local
    from goodspeed.launch.spec_files import load_spec
    from modelkit import greedy_reference, perturbed, save_models, tiny_llama

    target = tiny_llama(0, vocab=300)
    paths = save_models(tmp_path / "models", {"target": target, "draft": perturbed(target, 0.1, 1)}, 300)
    prompts = tmp_path / "prompts.jsonl"
    prompt_ids = [[5, 6, 7], [8, 9, 10, 11]]
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt_ids": p}) + "\n" for i, p in enumerate(prompt_ids)))
    drafter = {"draft": str(paths["draft"]), "prompts": str(prompts), "max_new_tokens": 12}
    spec = load_spec(tmp_path / "spec.toml", data={
        # float32, as the reference below (auto is bf16 on a CPU with native bf16)
        "verifier": {"target": str(paths["target"]), "budget": 8, "round_deadline_ms": 1000, "dtype": "float32"},
        "drafters": [{"name": "near", **drafter}, {"name": "far", **drafter, "link": {"rtt_ms": 60, "jitter_ms": 5, "mbit": 20}}],
    })
    summary = launch_local(spec, tmp_path / "run", log=lambda *a: None, live=False)
    target32 = tiny_llama(0, vocab=300, dtype=torch.float32)
    for name in ("near", "far"):
        rows = [json.loads(line) for line in (tmp_path / "run" / f"{name}.jsonl").read_text().splitlines()]
        assert [r["token_ids"] for r in rows] == [greedy_reference(target32, p, 12) for p in prompt_ids]
    near, far = summary["drafters"]["near"], summary["drafters"]["far"]
    assert far["link"]["rtt_ms"] == 60 and near["link"] is None
    # far: the round trip (60 ms) + drafting; near: drafting alone. Measured 77 vs 15 ms on an idle
    # machine; under CPU contention near's drafting slows most (86 vs 47 ms; 87 vs 117; in CI once
    # 85 vs 81), so not even their order holds on a loaded machine: only the link's physical floor
    # is asserted.
    assert far["receive_ms_median"] >= 0.8 * 60, summary["drafters"]
    assert not [line for line in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines() if line.startswith("gs")]


@pytest.mark.slow  # the default suite: a launch's receive times under a link (above), and the report's column (test_experiment)
@pytest.mark.skipif(not _supported(), reason="needs root and network namespaces")
def test_experiment_reports_each_drafters_receive_time_under_its_link(tmp_path):
    import json

    from goodspeed.launch.experiments.experiment import ExperimentSettings, run_experiment
    from goodspeed.launch.spec import DrafterSpec, LaunchSpec, VerifierSpec
    from modelkit import perturbed, save_models, tiny_llama

    target = tiny_llama(0, vocab=300)
    paths = save_models(tmp_path / "models", {"target": target, "draft": perturbed(target, 0.1, 1)}, 300)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": [5 + i, 6, 7]}) + "\n" for i in range(3)))
    near = DrafterSpec(name="near", draft=str(paths["draft"]), prompts=str(prompts), max_new_tokens=30)
    far = DrafterSpec(name="far", draft=str(paths["draft"]), prompts=str(prompts), max_new_tokens=30, link=LinkSpec(rtt_ms=80, mbit=20))
    spec = LaunchSpec(VerifierSpec(target=str(paths["target"]), budget=8, round_deadline_ms=1000, max_missed_rounds=10), (near, far))
    result = run_experiment(ExperimentSettings(name="links", policies=("goodspeed",), rounds=20), spec, tmp_path / "out", log=lambda *a: None)
    assert result["failed"] == []
    receive = result["metrics"]["goodspeed"]["receive_ms_median"]
    assert receive["far"] >= 0.8 * 80 and receive["far"] > receive["near"], receive  # measured 127 vs 37 ms
    assert "| far |" in (tmp_path / "out" / "REPORT.md").read_text()
