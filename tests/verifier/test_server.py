"""The verifier over real gRPC: greedy equality, status codes for every misuse, health, draining."""

import threading
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import generate_latest

from goodspeed.proto import MAX_DECODE_AHEAD
from goodspeed.proto.goodspeed.v1 import goodspeed_pb2 as pb
from goodspeed.proto.goodspeed.v1 import goodspeed_pb2_grpc as pb_grpc
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from goodspeed.verifier.records import RoundRecord
from goodspeed.verifier.warm_up import WARM_UP_PLAN
from grpckit import ServerThread, run_clients
from modelkit import greedy_reference, perturbed, tiny_llama

V = 48
PROMPTS = [[1, 2, 3], [9, 8], [4, 4, 4, 4, 5], [30, 31, 32]]


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(0)
    return target, [perturbed(target, 0.05, 1), perturbed(target, 0.4, 2), tiny_llama(7, layers=1)]


@pytest.mark.parametrize("policy", ["goodspeed", "fixed", "random"])
def test_greedy_outputs_equal_target_through_grpc(models, policy):
    target, drafts = models
    engine = VerificationEngine(target, EngineConfig(budget=10, policy=policy, max_draft_len=6))
    prompts = [PROMPTS[:2], PROMPTS[1:3], PROMPTS[2:]]
    with ServerThread(engine, round_deadline_ms=500) as server:
        outputs = run_clients(server.address, drafts, prompts, max_new=14)
        rounds = server.events("round")
        scrape = generate_latest(server.server.metrics.registry).decode()
    for i, plist in enumerate(prompts):
        assert outputs[i] == [greedy_reference(target, p, 14) for p in plist]
    assert f"goodspeed:rounds_total {float(len(rounds))}" in scrape
    assert 'goodspeed:round_phase_seconds_count{phase="forward"}' in scrape
    drafted = sum(d["drafted"] for r in rounds for d in r["drafters"])
    assert f"goodspeed:spec_decode_num_draft_tokens_total {float(drafted)}" in scrape
    assert f"goodspeed:e2e_request_latency_seconds_count {float(sum(map(len, prompts)))}" in scrape  # edge requests too
    assert any(r["batch"] > 1 for r in rounds)  # drafters really shared rounds
    assert all(sum(d["next_draft_length"] for d in r["drafters"]) <= 10 for r in rounds)
    records = [RoundRecord.from_event(r) for r in rounds]  # the log is the typed record
    assert sum(d.drafted for r in records for d in r.drafters) == drafted


@pytest.mark.parametrize("rounds, shares, planned", [("async", "plan", True), ("async", "free", False), ("sync", "plan", False)])
def test_async_steps_plan_the_shares_of_C_and_stay_exact(models, rounds, shares, planned):
    """Async rounds plan every active drafter's share of C at each step (``async_shares``,
    scheduler.DraftAllotments.schedule); the output is the target's greedy decoding either way."""
    target, drafts = models
    engine = VerificationEngine(target, EngineConfig(budget=6, policy="goodspeed", max_draft_len=4))
    prompts = [PROMPTS[:2], PROMPTS[1:3], PROMPTS[2:]]
    with ServerThread(engine, rounds=rounds, async_shares=shares, round_deadline_ms=500) as server:
        assert engine.allotments.plan_shares is planned
        outputs = run_clients(server.address, drafts, prompts, max_new=10)
    for i, plist in enumerate(prompts):
        assert outputs[i] == [greedy_reference(target, p, 10) for p in plist]


@pytest.fixture
def served(models):
    engine = VerificationEngine(models[0], EngineConfig(budget=8, policy="fixed", max_draft_len=4, max_seq_len=64, max_drafters=4))
    with ServerThread(engine, round_deadline_ms=200, max_message_bytes=64 * 1024) as server:
        channel = grpc.insecure_channel(server.address)
        yield server, pb_grpc.VerifierStub(channel)
        channel.close()


def join(stub, name="x"):
    sid = stub.Join(pb.JoinRequest(drafter_name=name, protocol_version=1)).session_id
    reply = stub.StartRequest(pb.StartRequestRequest(session_id=sid, prompt_ids=[1, 2], max_new_tokens=10, sampling=pb.SamplingParams(temperature=1.0)))
    return sid, reply


def dense(tokens, vocab=V):
    rows = np.zeros((len(tokens), vocab), dtype=np.float32)
    rows[np.arange(len(tokens)), tokens] = 1.0
    return pb.DenseProbs(probs=rows.reshape(-1).tolist())


BAD = [
    ("id outside vocab", lambda sid: pb.DraftRequest(session_id=sid, round_index=0, token_ids=[V], dense=dense([0])), grpc.StatusCode.INVALID_ARGUMENT),
    ("nan probability", lambda sid: pb.DraftRequest(session_id=sid, round_index=0, token_ids=[1], dense=pb.DenseProbs(probs=[float("nan")] * V)), grpc.StatusCode.INVALID_ARGUMENT),
    ("zero probability", lambda sid: pb.DraftRequest(session_id=sid, round_index=0, token_ids=[1], sparse=pb.SparseProbs(rows=[pb.SparseRow(token_ids=[2], probs=[1.0])])), grpc.StatusCode.INVALID_ARGUMENT),
    ("more than allotted", lambda sid: pb.DraftRequest(session_id=sid, round_index=0, token_ids=[1] * 9, dense=dense([1] * 9)), grpc.StatusCode.INVALID_ARGUMENT),
    ("wrong dense shape", lambda sid: pb.DraftRequest(session_id=sid, round_index=0, token_ids=[1], dense=pb.DenseProbs(probs=[1.0])), grpc.StatusCode.INVALID_ARGUMENT),
    ("future round", lambda sid: pb.DraftRequest(session_id=sid, round_index=5, token_ids=[1], dense=dense([1])), grpc.StatusCode.INVALID_ARGUMENT),
    ("decode ahead of drafted tokens", lambda sid: pb.DraftRequest(session_id=sid, round_index=0, token_ids=[1], dense=dense([1]), decode_ahead=2), grpc.StatusCode.INVALID_ARGUMENT),
    ("decode ahead too far", lambda sid: pb.DraftRequest(session_id=sid, round_index=0, decode_ahead=MAX_DECODE_AHEAD + 1), grpc.StatusCode.INVALID_ARGUMENT),
    ("unknown session", lambda sid: pb.DraftRequest(session_id="nobody", round_index=0, token_ids=[]), grpc.StatusCode.FAILED_PRECONDITION),
    ("oversized message", lambda sid: pb.DraftRequest(session_id=sid, round_index=0, token_ids=[1] * 4, dense=pb.DenseProbs(probs=[0.0] * 40000)), grpc.StatusCode.RESOURCE_EXHAUSTED),
]


@pytest.mark.parametrize("name,make,code", BAD, ids=[b[0] for b in BAD])
def test_malformed_messages_get_their_status_and_others_keep_working(served, name, make, code):
    server, stub = served
    bad, _ = join(stub, "bad")
    good, reply = join(stub, "good")
    stream = stub.StreamVerdicts(pb.StreamVerdictsRequest(session_id=good))
    with pytest.raises(grpc.RpcError) as err:
        stub.SubmitDraft(make(bad))
    assert err.value.code() == code, err.value.details()
    tokens = [3] * reply.draft_length
    assert stub.SubmitDraft(pb.DraftRequest(session_id=good, round_index=reply.round_index, token_ids=tokens, dense=dense(tokens) if tokens else None)).queued
    verdict = next(stream)
    assert verdict.session_id == good and verdict.round_index == reply.round_index
    stream.cancel()


def test_stale_round_duplicate_and_request_errors(served):
    server, stub = served
    sid, reply = join(stub)
    stream = stub.StreamVerdicts(pb.StreamVerdictsRequest(session_id=sid))
    msg = pb.DraftRequest(session_id=sid, round_index=reply.round_index, token_ids=[3], dense=dense([3]))
    stub.SubmitDraft(msg)
    verdict = next(stream)
    assert stub.SubmitDraft(msg).verdict == verdict  # idempotent retry
    with pytest.raises(grpc.RpcError) as err:
        stub.SubmitDraft(pb.DraftRequest(session_id=sid, round_index=reply.round_index, token_ids=[4], dense=dense([4])))
    assert err.value.code() == grpc.StatusCode.ABORTED
    with pytest.raises(grpc.RpcError) as err:
        stub.StartRequest(pb.StartRequestRequest(session_id=sid, prompt_ids=[1], max_new_tokens=3))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    other = stub.Join(pb.JoinRequest(drafter_name="y", protocol_version=1)).session_id
    for prompt, max_new in (([1] * 64, 1), ([1] * 60, 10)):
        with pytest.raises(grpc.RpcError) as err:
            stub.StartRequest(pb.StartRequestRequest(session_id=other, prompt_ids=prompt, max_new_tokens=max_new))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as err:
        stub.Join(pb.JoinRequest(drafter_name="v2", protocol_version=2))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert list(stub.Resync(pb.ResyncRequest(session_id=sid)).committed_ids)[:2] == [1, 2]
    stream.cancel()


@pytest.mark.parametrize("name", ["x" * 65, "tab\tname", "new\nline", "é"], ids=["long", "tab", "newline", "non-ascii"])
def test_names_are_bounded_and_plain(served, name):
    """A client-chosen name reaches session ids and logs: 1 MiB names used to become 1 MiB ids."""
    server, stub = served
    with pytest.raises(grpc.RpcError) as err:
        stub.Join(pb.JoinRequest(drafter_name=name, protocol_version=1))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "drafter_name" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.Join(pb.JoinRequest(drafter_name="ok", model_name="m\x00" * 10, protocol_version=1))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_session_ids_are_unguessable_and_never_repeat(served):
    server, stub = served
    ids = [stub.Join(pb.JoinRequest(drafter_name="same", protocol_version=1)).session_id for _ in range(4)]
    assert len(set(ids)) == 4
    assert all(i.startswith("same#") and len(i.split("#")[1]) == 32 for i in ids)  # 128 random bits
    for sid in ids:
        stub.Leave(pb.LeaveRequest(session_id=sid))


def test_a_temperature_that_would_give_nan_is_refused_and_the_loop_goes_on(served):
    """temperature 1e-45 (a float32 subnormal) made NaN probabilities that killed the round loop."""
    server, stub = served
    sid = stub.Join(pb.JoinRequest(drafter_name="nan", protocol_version=1)).session_id
    with pytest.raises(grpc.RpcError) as err:
        stub.StartRequest(pb.StartRequestRequest(session_id=sid, prompt_ids=[1, 2], max_new_tokens=4, sampling=pb.SamplingParams(temperature=1e-45)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in err.value.details()
    good, reply = join(stub, "good")
    stream = stub.StreamVerdicts(pb.StreamVerdictsRequest(session_id=good))
    tokens = [3] * reply.draft_length
    stub.SubmitDraft(pb.DraftRequest(session_id=good, round_index=reply.round_index, token_ids=tokens, dense=dense(tokens) if tokens else None))
    assert next(stream).session_id == good
    stream.cancel()


def wait_for_drop(server, sid, timeout_s=10.0):
    for _ in range(int(timeout_s / 0.05)):
        if any(e["session"] == sid for e in server.events("drop")):
            return
        threading.Event().wait(0.05)
    pytest.fail(f"session {sid} was not dropped within {timeout_s} s")


def test_closing_the_verdict_stream_frees_the_session(served):
    server, stub = served
    sid, reply = join(stub)
    stream = stub.StreamVerdicts(pb.StreamVerdictsRequest(session_id=sid))
    stub.SubmitDraft(pb.DraftRequest(session_id=sid, round_index=reply.round_index, token_ids=[3], dense=dense([3])))
    next(stream)  # the stream is established on the server
    stream.cancel()
    wait_for_drop(server, sid)
    assert sid not in server.server.engine.session_ids and server.server.engine.cache.num_slots == 0


def test_a_silent_session_is_dropped_even_when_no_rounds_run(models):
    engine = VerificationEngine(models[0], EngineConfig(budget=4))
    with ServerThread(engine, idle_timeout_s=0.4) as server:
        channel = grpc.insecure_channel(server.address)
        sid, _ = join(pb_grpc.VerifierStub(channel))  # a request, then silence: no stream, no drafts
        wait_for_drop(server, sid)
        assert "idle" in next(e["reason"] for e in server.events("drop") if e["session"] == sid)
        assert engine.cache.num_slots == 0
        channel.close()


def test_sessions_that_never_listen_are_reclaimed(models):
    """Squatting: joins that never open a verdict stream used to hold max_drafters slots forever."""
    target, _ = models
    engine = VerificationEngine(target, EngineConfig(budget=4, max_drafters=3))
    # 2 s: the honest session opens its stream within milliseconds; the margin is for loaded machines
    with ServerThread(engine, stream_open_timeout_s=2.0) as server:
        channel = grpc.insecure_channel(server.address)
        stub = pb_grpc.VerifierStub(channel)
        honest = stub.Join(pb.JoinRequest(drafter_name="honest", protocol_version=1)).session_id
        stream = stub.StreamVerdicts(pb.StreamVerdictsRequest(session_id=honest))
        squatters = [stub.Join(pb.JoinRequest(drafter_name=f"s{i}", protocol_version=1)).session_id for i in range(2)]
        with pytest.raises(grpc.RpcError) as err:
            stub.Join(pb.JoinRequest(drafter_name="late", protocol_version=1))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for sid in squatters:
            wait_for_drop(server, sid)
        assert stub.Join(pb.JoinRequest(drafter_name="late", protocol_version=1)).session_id
        assert honest in engine.session_ids  # the listening session stays
        stream.cancel()
        channel.close()


def until(condition, what, timeout_s=30.0):
    for _ in range(int(timeout_s / 0.01)):  # bounded
        if condition():
            return
        threading.Event().wait(0.01)
    pytest.fail(f"{what}: not within {timeout_s} s")


def test_a_start_request_abandoned_mid_prefill_frees_its_request_and_stop_waits_for_that(models):
    """Chunked prefill: the client gives up on StartRequest while its prompt is being prefilled.
    The request is ended on the engine and its KV tokens released, by a cleanup that the server's
    stop() waits for (here it is still queued behind the held prefill when the server stops)."""
    engine = VerificationEngine(models[0], EngineConfig(budget=4, max_draft_len=4, max_seq_len=64, prefill_chunk=4))
    entered, gate = threading.Event(), threading.Event()
    prefill_step = engine.prefill_step

    def held_prefill_step():  # on the engine thread: the first chunk waits for the test (bounded)
        entered.set()
        gate.wait(30)
        return prefill_step()

    engine.prefill_step = held_prefill_step
    with ServerThread(engine) as server:
        channel = grpc.insecure_channel(server.address)
        stub = pb_grpc.VerifierStub(channel)
        sid = stub.Join(pb.JoinRequest(drafter_name="x", protocol_version=1)).session_id
        started = stub.StartRequest.future(pb.StartRequestRequest(session_id=sid, prompt_ids=list(range(1, 41)), max_new_tokens=8))
        until(entered.is_set, "the prefill began")
        started.cancel()  # the client gives up
        service = server.server.service
        until(lambda: sid not in service.rounds._starting, "the handler saw the cancellation")
        gate.set()  # the cleanup waits for the engine thread: the server stops meanwhile
        channel.close()
    assert started.cancelled()
    assert engine.sessions.by_id[sid].request is None  # ended on the engine
    assert set(service.usage.kv_tokens.values()) == {0}  # its KV tokens released


@pytest.mark.parametrize("rounds", ["sync", "async"])
def test_a_drafter_decoded_ahead_hears_every_round_without_sending_a_draft(models, rounds):
    """One empty draft with ``decode_ahead``: its rounds' verdicts stream in order with nothing sent
    between them, in sync rounds too (a round the verifier queued counts as submitted), beside a
    drafter that drafts. A resync in the middle of a run drops the round queued ahead (the
    drafter's own draft for it is taken, not refused as stale); the text is the target's."""
    target = models[0]
    engine = VerificationEngine(target, EngineConfig(budget=8, max_draft_len=4, max_seq_len=64, seed=2))
    with ServerThread(engine, rounds=rounds, round_deadline_ms=2000) as server:
        others = {}
        other = threading.Thread(target=lambda: others.update(run_clients(server.address, [models[1][0]], [PROMPTS[:2]], 12)))
        other.start()
        stub = pb_grpc.VerifierStub(grpc.insecure_channel(server.address))
        sid = stub.Join(pb.JoinRequest(drafter_name="ahead", protocol_version=1)).session_id
        stream = stub.StreamVerdicts(pb.StreamVerdictsRequest(session_id=sid))
        reply = stub.StartRequest(pb.StartRequestRequest(session_id=sid, prompt_ids=PROMPTS[2], max_new_tokens=20))
        assert "decode_ahead" in reply.features and "decode_ahead_until_match" in reply.features
        stub.SubmitDraft(pb.DraftRequest(session_id=sid, round_index=reply.round_index, decode_ahead=5))
        run = [next(stream) for _ in range(6)]
        assert [v.round_index for v in run] == list(range(reply.round_index, reply.round_index + 6))
        assert [v.decode_ahead_left for v in run] == [5, 4, 3, 2, 1, 0]  # the rounds left, on the wire
        stub.SubmitDraft(pb.DraftRequest(session_id=sid, round_index=run[-1].round_index + 1, decode_ahead=8))
        next(stream)
        resync = stub.Resync(pb.ResyncRequest(session_id=sid))
        assert stub.SubmitDraft(pb.DraftRequest(session_id=sid, round_index=resync.round_index, decode_ahead=MAX_DECODE_AHEAD)).queued
        rest = []
        while not rest or not rest[-1].finished:
            verdict = next(stream)
            if verdict.round_index >= resync.round_index:  # those before it are in the resync's text
                rest.append(verdict)
        stream.cancel()
        other.join()
    assert all(v.num_drafted == 0 for v in run + rest) and rest[0].round_index == resync.round_index
    tokens = list(resync.committed_ids) + [t for v in rest for t in v.token_ids]
    assert tokens == PROMPTS[2] + greedy_reference(target, PROMPTS[2], 20) and rest[-1].finish_reason == "length"
    assert [t for v in run for t in v.token_ids] == tokens[len(PROMPTS[2]):][:6]
    assert others[0] == [greedy_reference(target, p, 12) for p in PROMPTS[:2]]


def test_finish_request_frees_the_slot_and_allows_a_new_request(served):
    server, stub = served
    sid, reply = join(stub)
    stub.SubmitDraft(pb.DraftRequest(session_id=sid, round_index=reply.round_index, token_ids=[3], dense=dense([3])))
    committed = list(stub.FinishRequest(pb.FinishRequestRequest(session_id=sid)).committed_ids)
    assert committed[:2] == [1, 2] and server.server.engine.cache.num_slots == 0
    with pytest.raises(grpc.RpcError) as err:
        stub.FinishRequest(pb.FinishRequestRequest(session_id=sid))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    again = stub.StartRequest(pb.StartRequestRequest(session_id=sid, prompt_ids=[5], max_new_tokens=3))
    assert again.round_index >= reply.round_index


def test_the_kv_gauges_count_a_requests_slot_until_it_is_freed(served):
    """``goodspeed:kv_slots_used`` and ``goodspeed:kv_reserved_positions``, read at each scrape:
    a request holds one slot and its positions; finished, its slot is counted free."""
    server, stub = served

    def gauge(name: str) -> float:
        lines = generate_latest(server.server.metrics.registry).decode().splitlines()
        return float(next(line for line in lines if line.startswith(f"goodspeed:{name} ")).split()[-1])

    before = gauge("kv_slots_used")
    sid, _ = join(stub)
    assert gauge("kv_slots_used") == before + 1 and gauge("kv_reserved_positions") > 0
    stub.FinishRequest(pb.FinishRequestRequest(session_id=sid))
    assert gauge("kv_slots_used") == before == server.server.engine.cache.num_slots


def submit_one(stub):
    """A fresh session with one draft queued (a round will run); its stream, to cancel later."""
    sid, reply = join(stub)
    stream = stub.StreamVerdicts(pb.StreamVerdictsRequest(session_id=sid))
    tokens = [3] * reply.draft_length
    stub.SubmitDraft(pb.DraftRequest(session_id=sid, round_index=reply.round_index, token_ids=tokens, dense=dense(tokens) if tokens else None))
    return sid, stream


def wait_until(predicate, timeout_s=10.0):
    for _ in range(int(timeout_s / 0.05)):
        if predicate():
            return True
        threading.Event().wait(0.05)
    return predicate()


def test_a_failed_round_drops_its_participants_and_the_loop_goes_on(models):
    """A round that raises (a bug, a device error) used to end the round loop silently. Now its
    participants are dropped (a drafter rejoins and resumes from the verified text, so its output
    is still the target's) and the next rounds run."""
    target, drafts = models
    engine = VerificationEngine(target, EngineConfig(budget=4, max_draft_len=4))
    real, calls = engine.run_round, []

    def fails_once(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected failure")
        return real(*args, **kw)

    with ServerThread(engine) as server:
        engine.run_round = fails_once
        outputs = run_clients(server.address, drafts[:1], [PROMPTS[:2]], 12)
        assert outputs[0] == [greedy_reference(target, p, 12) for p in PROMPTS[:2]]
        failed = server.events("round_failed")
        assert len(failed) == 1 and "injected failure" in failed[0]["error"]
        assert any("its round failed" in e["reason"] for e in server.events("drop"))
        assert not server.server.failed.is_set()


def test_a_round_loop_that_keeps_failing_is_not_serving(models):
    """Three failed rounds in a row are not one round's problem: the loop ends, health says
    NOT_SERVING (it used to stay SERVING with no rounds) and the daemon is told to exit 1."""
    target, _ = models
    engine = VerificationEngine(target, EngineConfig(budget=4))
    with ServerThread(engine) as server:
        def broken(*args, **kw):
            raise RuntimeError("injected failure")

        engine.run_round = broken
        channel = grpc.insecure_channel(server.address)
        stub, health = pb_grpc.VerifierStub(channel), health_pb2_grpc.HealthStub(channel)
        streams = []
        for attempt in range(3):
            streams.append(submit_one(stub)[1])
            assert wait_until(lambda: len(server.events("round_failed")) > attempt)
        assert wait_until(server.server.failed.is_set)
        assert any("injected failure" in e["error"] for e in server.events("round_loop_failed"))
        assert wait_until(lambda: health.Check(health_pb2.HealthCheckRequest(service="")).status == health_pb2.HealthCheckResponse.NOT_SERVING)
        for stream in streams:
            stream.cancel()
        channel.close()


def test_health_and_draining(served):
    server, stub = served
    channel = grpc.insecure_channel(server.address)
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(service="goodspeed.v1.Verifier")).status == health_pb2.HealthCheckResponse.SERVING
    server.run(server.server.drain())
    assert health.Check(health_pb2.HealthCheckRequest(service="")).status == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.RpcError) as err:
        stub.Join(pb.JoinRequest(drafter_name="late", protocol_version=1))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    channel.close()


def test_metrics_endpoint_serves_prometheus_text():
    import socket
    import urllib.request

    from goodspeed.verifier.observability import Metrics

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    metrics = Metrics()
    metrics.serve(port)
    verdicts = [SimpleNamespace(num_drafted=n, num_accepted=m) for n, m in ((4, 3), (8, 4), (0, 0))]
    metrics.observe_round({"forward": 0.01, "receive": 0.2}, verdicts, transit_tokens=2)
    metrics.observe_round({"forward": 0.01, "receive": 0.2}, [], transit_tokens=3)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "goodspeed:transit_tokens_total 5.0" in body and "goodspeed:rounds_total 2.0" in body
    metrics.observe_round({"forward": 0.01, "receive": 0.2}, verdicts)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "goodspeed:spec_decode_num_accepted_tokens_total 14.0" in body and "goodspeed:round_batch_drafters 3.0" in body
    assert "goodspeed:spec_decode_num_drafts_total 4.0" in body  # an empty draft is not a draft
    assert 'goodspeed:spec_decode_num_accepted_tokens_per_pos_total{position="2"} 4.0' in body
    assert 'goodspeed:spec_decode_num_accepted_tokens_per_pos_total{position="3"} 2.0' in body


def test_the_warm_up_says_what_it_compiles_the_engines_steps_and_the_local_drafts():
    """With fixed-shape steps, VerifierService.warm_up logs warm_up_begin, then runs the engine's
    warm-up steps and local serving's draft's (AdaServe: trees) and logs them in warm_up."""
    import io
    import json

    from goodspeed.lm.runtime.batch_draft import BatchDraftModel
    from goodspeed.lm.runtime.graphs import StepGraphs
    from goodspeed.verifier.local import LocalConfig, LocalServing
    from goodspeed.verifier.observability import JsonLog, Metrics
    from goodspeed.verifier.server import ServerConfig, VerifierService

    target = tiny_llama(3)
    engine = VerificationEngine(target, EngineConfig(seed=0))
    engine.runner.graphs = StepGraphs(engine.model, engine.cache, capture=False)
    local = LocalServing(engine, perturbed(target, 0.3, 1), LocalConfig(policy="adaserve"))
    local.draft.graphs = StepGraphs(local.draft.model, local.draft.cache, capture=False)
    stream = io.StringIO()
    service = VerifierService(engine, ServerConfig(port=0), Metrics(), JsonLog(stream), local=local)
    service.warm_up()
    events = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [e["event"] for e in events] == ["warm_up_begin", "warm_up"]
    assert events[1]["steps"] == len(WARM_UP_PLAN)
    assert events[1]["draft_steps"] == sum(what == "tree" for _, what in BatchDraftModel.WARM_UP_PLAN)
    assert engine.session_ids == [] and local.draft.slots.keys == []


@pytest.mark.parametrize("rounds", [pytest.param("sync", marks=pytest.mark.slow), "async"])
def test_sampled_outputs_follow_the_target_through_grpc(rounds):
    """Real drafter clients over gRPC with default seeds (fresh entropy on both sides), T > 0,
    proactive drafting on (the client's default), in either round mode: the first two tokens
    follow the target's own distribution (chi-square, p = 1e-5). The default suite runs async
    rounds (the mode with transit and windows); sync rounds' verification is the engine's, whose
    sampled tests (tests/verifier/test_lossless.py) run by default."""
    check_sampled_through_grpc(rounds, "cpu")


def test_a_drafter_that_sends_a_q_it_did_not_sample_from_is_caught_through_grpc(monkeypatch):
    """Negative control: drafters that sample from their q but send the uniform distribution in its
    place (as a wire format that lost the probabilities would) fail the same test at p < 1e-6
    (chi2 168 and 236 in two runs, against a critical 85.8)."""
    from goodspeed.drafter import runner as runner_module
    from statkit import Z_POWER, chi2_critical

    real = runner_module.DraftOutput.q_to_send

    def uniform(self, sampling):
        if self.token_ids and not sampling.greedy:
            return "sparse", [(list(range(6)), [1.0 / 6] * 6) for _ in self.token_ids]
        return real(self, sampling)

    monkeypatch.setattr(runner_module.DraftOutput, "q_to_send", uniform)
    stat, dof = sampled_through_grpc("async", "cpu")
    assert stat > chi2_critical(dof, z=Z_POWER), f"chi2 {stat:.1f}: the test lacks power at p = 1e-6"


def check_sampled_through_grpc(rounds: str, device: str) -> None:
    from statkit import chi2_critical

    stat, dof = sampled_through_grpc(rounds, device)
    assert stat < chi2_critical(dof), f"chi2 {stat:.1f} (critical {chi2_critical(dof):.1f}, dof {dof})"


def sampled_through_grpc(rounds: str, device: str) -> tuple[float, int]:
    """Six sampling drafters, 100 requests each, with the models on ``device``: the chi-square
    statistic of their first two tokens against the target's exact distribution (computed on the
    host), and its degrees of freedom."""
    import copy

    from goodspeed.lm.decoding.params import SamplingParams
    from statkit import chi2_stat, count_first_two, exact_first_two

    vocab, prompt, sampling = 6, [1, 2, 3], SamplingParams(temperature=1.0, top_p=0.95)
    target = tiny_llama(4, vocab=vocab, init=0.08)
    draft = perturbed(target, 1.0, 5).to(device)
    engine = VerificationEngine(copy.deepcopy(target).to(device), EngineConfig(budget=24, max_draft_len=3))
    with ServerThread(engine, rounds=rounds) as server:
        outputs = run_clients(server.address, [draft] * 6, [[prompt] * 100] * 6, 3, sampling=sampling)
    samples = [o for outs in outputs.values() for o in outs]
    assert len(samples) == 600
    return chi2_stat(count_first_two(samples, vocab), exact_first_two(target, prompt, sampling))


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rounds", ["sync", "async"])
def test_cuda_verifier_and_drafters_through_grpc(models, rounds):
    """The deployment's shape on one GPU: the verifier's target and every edge drafter's model on
    CUDA, real clients over gRPC. Greedy outputs are the target's own (decoded on the host), and
    sampled ones follow its distribution (chi-square, as above)."""
    import copy

    target, drafts = models
    engine = VerificationEngine(copy.deepcopy(target).cuda(), EngineConfig(budget=10, max_draft_len=6))
    prompts = [PROMPTS[:2], PROMPTS[1:3], PROMPTS[2:]]
    with ServerThread(engine, rounds=rounds, round_deadline_ms=500) as server:
        outputs = run_clients(server.address, [copy.deepcopy(d).cuda() for d in drafts], prompts, max_new=14)
    for i, plist in enumerate(prompts):
        assert outputs[i] == [greedy_reference(target, p, 14) for p in plist]
    check_sampled_through_grpc(rounds, "cuda")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not __import__("torch").cuda.is_available(), reason="needs CUDA"))])
def test_a_drafter_at_fixed_shapes_through_grpc_gives_the_targets_greedy_text(models, device):
    """An edge drafter drafting one request at a time through fixed-shape forwards (goodspeed
    drafter --cuda-graphs; proactive drafting on, the client's default): on CUDA captured and
    replayed, against a verifier on the same GPU; on CPU the same forwards run without capture.
    Its greedy outputs are the target's own."""
    import copy

    from goodspeed.drafter.runner import DraftRunner
    from graphkit import static_runner

    target, drafts = models
    made = []

    def runner(model):
        made.append(static_runner(model) if device == "cpu" else DraftRunner(model, cuda_graphs=True))
        return made[-1]
    engine = VerificationEngine(copy.deepcopy(target).to(device), EngineConfig(budget=10, max_draft_len=6))
    with ServerThread(engine, rounds="async", round_deadline_ms=500) as server:
        outputs = run_clients(server.address, [copy.deepcopy(drafts[0]).to(device)], [PROMPTS], max_new=14, runner=runner)
    assert outputs[0] == [greedy_reference(target, p, 14) for p in PROMPTS]
    graphs = made[0].kv.drafter.graphs
    assert graphs.steps > 10 and (device == "cpu" or graphs.replays > 0)


def test_a_port_that_cannot_be_had_stops_the_daemon_with_its_reason(models):
    """Not a port, or a port in use: the server refuses to start and names the address; it never
    falls back to another port (the HTTP front's port: test_http_front.py)."""
    import asyncio
    import socket

    from goodspeed.verifier.errors import ListenError
    from goodspeed.verifier.daemon import make_server
    from goodspeed.verifier.server import ServerConfig

    with pytest.raises(ValueError, match="port must lie in 0..65535"):
        ServerConfig(port=99999)
    with pytest.raises(ValueError, match="http_port must lie in 0..65535"):
        ServerConfig(http_port=-1)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    engine = VerificationEngine(models[0], EngineConfig())

    async def start(config):
        server = make_server(engine, config)
        with pytest.raises(ListenError, match=f"127.0.0.1:{port}"):
            await server.start()
        return server

    try:
        asyncio.run(start(ServerConfig(port=port, warmup=False)))
    finally:
        taken.close()
