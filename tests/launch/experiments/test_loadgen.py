"""The load generator: Poisson traces with AdaServe's SLO classes, the summary, and replaying a
trace in-process (simulated time) and over gRPC."""

import asyncio

import numpy as np
import pytest

from goodspeed.launch.experiments.loadgen import SLO_CLASSES, make_trace, run_trace_grpc, run_trace_local, summarize
from goodspeed.scheduler import LatencyModel
from goodspeed.verifier.engine import VerificationEngine
from goodspeed.verifier.clocks import SimulatedClock
from goodspeed.verifier.local import LocalConfig, LocalServing
from grpckit import ServerThread
from modelkit import greedy_reference, perturbed, tiny_llama

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]


def test_trace_is_poisson_with_the_slo_classes_and_reproducible():
    trace = make_trace(PROMPTS, 4000, rate_per_s=20.0, baseline_tpot_ms=10.0, max_new_tokens=8, seed=1)
    gaps = np.diff([it.arrival_s for it in trace])
    assert trace[0].arrival_s == 0.0 and np.all(gaps >= 0)
    assert abs(gaps.mean() - 1 / 20) < 0.004  # exponential inter-arrivals with mean 1/rate
    assert abs(gaps.std() / gaps.mean() - 1) < 0.08  # coefficient of variation 1
    counts = {c: sum(it.slo_class == c for it in trace) for c in SLO_CLASSES}
    assert all(abs(n / 4000 - 1 / 3) < 0.03 for n in counts.values())
    assert {it.slo_class: it.tpot_slo_ms for it in trace} == {"strict": 10.0, "moderate": 24.0, "relaxed": 80.0}
    assert make_trace(PROMPTS, 50, 5.0, 10.0, 8, seed=1) == make_trace(PROMPTS, 50, 5.0, 10.0, 8, seed=1)
    only = make_trace(PROMPTS, 30, 5.0, 10.0, 8, shares={"strict": 1.0}, seed=2)
    assert {it.slo_class for it in only} == {"strict"}
    with pytest.raises(ValueError):
        make_trace(PROMPTS, 10, 0.0, 10.0, 8)
    with pytest.raises(ValueError, match="shares"):
        make_trace(PROMPTS, 10, 1.0, 10.0, 8, shares={"urgent": 1.0})


def test_summary_by_hand():
    records = [
        {"slo_class": "strict", "tpot_slo_ms": 10.0, "tpot_s": 0.008, "new_tokens": 10, "drafted": 20, "accepted": 10, "arrival": 0.0, "finished_at": 1.0},
        {"slo_class": "strict", "tpot_slo_ms": 10.0, "tpot_s": 0.012, "new_tokens": 10, "drafted": 20, "accepted": 5, "arrival": 0.5, "finished_at": 2.0},
        {"slo_class": "relaxed", "tpot_slo_ms": 80.0, "tpot_s": 0.020, "new_tokens": 20, "drafted": 0, "accepted": 0, "arrival": 1.0, "finished_at": 4.0},
    ]
    s = summarize(records)
    assert s["makespan_s"] == 4.0 and s["tokens"] == 40 and s["throughput_tok_s"] == 10.0
    assert s["tpot_mean_ms"] == pytest.approx(40 / 3)
    assert s["slo_attainment"] == pytest.approx(2 / 3)
    assert s["per_class"]["strict"]["attainment"] == 0.5 and s["per_class"]["relaxed"]["attainment"] == 1.0
    assert s["goodput_tok_s"] == pytest.approx(30 / 4)
    assert s["vsr"] == pytest.approx(15 / 40)


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(1)
    return target, perturbed(target, 0.05, 2)


def test_replay_in_simulated_time_respects_arrivals(models):
    target, draft = models
    cost = LatencyModel(0.0, 1e-4, 0.005)
    serving = LocalServing(VerificationEngine(target), draft, LocalConfig(policy="chain", k=2), SimulatedClock(cost, cost))
    trace = make_trace(PROMPTS, 12, rate_per_s=30.0, baseline_tpot_ms=8.0, max_new_tokens=10, seed=3)
    records = run_trace_local(serving, trace)
    by_id = {r["request_id"]: r for r in records}
    for it in trace:
        r = by_id[it.request_id]
        assert r["arrival"] >= it.arrival_s - 1e-12 and r["new_tokens"] == 10
    summary = summarize(records)
    assert summary["completed"] == 12 and 0 < summary["vsr"] <= 1


def test_replay_over_grpc(models):
    target, draft = models
    engine = VerificationEngine(target)
    local = LocalServing(engine, draft, LocalConfig(policy="tetris", k=2, extra=2))
    trace = make_trace(PROMPTS, 8, rate_per_s=50.0, baseline_tpot_ms=5.0, max_new_tokens=12, seed=4)
    with ServerThread(engine, local=local) as server:
        records = asyncio.run(run_trace_grpc(server.address, trace))
    assert all(r["finish_reason"] == "length" and r["new_tokens"] == 12 for r in records)
    assert all(0 < r["ttft_s"] <= r["finished_at"] - r["arrival"] for r in records)  # the first token comes before the end
    summary = summarize(records)
    assert summary["completed"] == 8 and summary["throughput_tok_s"] > 0
    outputs = {r.request_id: r.generated for r in local.finished}
    for it in trace:
        assert outputs[it.request_id] == greedy_reference(target, it.prompt_ids, 12)


def test_an_unreachable_verifier_is_said_then_an_error(monkeypatch, capsys):
    """A wrong address: the load generator says what it waits for, then raises (the CLI turns it
    into a one-line error and status 2), where it used to wait silently and end in a traceback."""
    import socket

    from goodspeed.launch import generate

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setattr(generate, "SAY_WAITING_AFTER_S", 0.1)
    monkeypatch.setattr(generate, "CONNECT_TIMEOUT_S", 0.6)
    trace = make_trace([[1, 2, 3]], 2, 10.0, 50.0, 4, seed=0)
    with pytest.raises(ConnectionError, match=f"no verifier answers at {address}"):
        asyncio.run(run_trace_grpc(address, trace))
    assert f"waiting for a verifier at {address}" in capsys.readouterr().err
