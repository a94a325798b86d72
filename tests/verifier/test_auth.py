"""Bearer tokens and session ownership, through a real server: every RPC but health needs a
listed token, and a session answers only to the identity that joined it."""

import stat
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from goodspeed.drafter.client import DrafterClient, DrafterConfig
from goodspeed.drafter.session import DrafterError
from goodspeed.drafter.runner import DraftRunner
from goodspeed.launch.generate import generate_request
from goodspeed.proto.goodspeed.v1 import goodspeed_pb2 as pb
from goodspeed.proto.goodspeed.v1 import goodspeed_pb2_grpc as pb_grpc
from goodspeed.verifier.auth import AuthError, TokenAuth, TokenFileError, add_token, token_hash
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from goodspeed.verifier.local import LocalConfig, LocalServing
from grpckit import ServerThread
from modelkit import greedy_reference, perturbed, tiny_llama


def bearer(token):
    return (("authorization", f"Bearer {token}"),)


def test_the_token_file_keeps_only_hashes(tmp_path):
    path = tmp_path / "tokens.json"
    alice, bob = add_token(path, "alice"), add_token(path, "bob", max_sessions=2)
    text = path.read_text()
    assert alice not in text and bob not in text and token_hash(alice) in text
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    auth = TokenAuth.from_file(path)
    assert auth.identify(bearer(alice)).name == "alice"
    assert auth.identify(bearer(bob)).max_sessions == 2
    for metadata in ((), bearer("nope"), (("authorization", alice),)):
        with pytest.raises(AuthError):
            auth.identify(metadata)


@pytest.mark.parametrize("content", ["", "{}", '{"tokens": [{"identity": "x", "sha256": "short"}]}',
                                     '{"tokens": [{"identity": "x", "sha256": "' + "a" * 64 + '", "max_sessions": 0}]}'])
def test_bad_token_files_are_refused(tmp_path, content):
    path = tmp_path / "tokens.json"
    path.write_text(content)
    with pytest.raises(TokenFileError):
        TokenAuth.from_file(path)


@pytest.mark.parametrize("identity, limits, said", [
    ("a b", {}, "the identity must be 1-64 characters"),
    ("x" * 65, {}, "the identity must be 1-64 characters"),
    ("phone", {"max_sessions": -1}, "max_sessions must be an integer > 0, got -1"),
    ("phone", {"rate_per_s": 0}, "rate_per_s must be a number > 0, got 0"),
    ("phone", {"max_wheels": 2}, "unknown limit 'max_wheels'"),
])
def test_an_entry_the_verifier_would_refuse_is_never_written(tmp_path, identity, limits, said):
    """`goodspeed tokens add` checks what loading the file checks: one bad entry written would
    stop the verifier from starting on that file. The file keeps its good entries, untouched."""
    path = tmp_path / "tokens.json"
    add_token(path, "alice")
    before = path.read_text()
    with pytest.raises(TokenFileError, match=said):
        add_token(path, identity, **limits)
    assert path.read_text() == before
    TokenAuth.from_file(path)  # still loads
    with pytest.raises(TokenFileError, match="cannot write"):
        add_token(tmp_path / "no-such-dir" / "tokens.json", "alice")


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(0)
    return target, perturbed(target, 0.05, 1)


@pytest.fixture
def secured(models, tmp_path):
    target, draft = models
    path = tmp_path / "tokens.json"
    tokens = {"alice": add_token(path, "alice"), "bob": add_token(path, "bob", max_sessions=1)}
    engine = VerificationEngine(target, EngineConfig(budget=8, max_draft_len=4))
    local = LocalServing(engine, draft, LocalConfig(policy="chain", k=2))
    with ServerThread(engine, local=local, auth_tokens=str(path)) as server:
        channel = grpc.insecure_channel(server.address)
        yield server, pb_grpc.VerifierStub(channel), health_pb2_grpc.HealthStub(channel), tokens
        channel.close()


def calls(stub, sid):
    """Every RPC, each naming ``sid`` where it takes a session."""
    return {
        "Join": lambda md: stub.Join(pb.JoinRequest(drafter_name="x", protocol_version=1), metadata=md),
        "StreamVerdicts": lambda md: next(stub.StreamVerdicts(pb.StreamVerdictsRequest(session_id=sid), metadata=md)),
        "StartRequest": lambda md: stub.StartRequest(pb.StartRequestRequest(session_id=sid, prompt_ids=[1, 2], max_new_tokens=4), metadata=md),
        "SubmitDraft": lambda md: stub.SubmitDraft(pb.DraftRequest(session_id=sid, round_index=0, token_ids=[]), metadata=md),
        "FinishRequest": lambda md: stub.FinishRequest(pb.FinishRequestRequest(session_id=sid), metadata=md),
        "Resync": lambda md: stub.Resync(pb.ResyncRequest(session_id=sid), metadata=md),
        "Leave": lambda md: stub.Leave(pb.LeaveRequest(session_id=sid), metadata=md),
        "Generate": lambda md: list(stub.Generate(generate_request(prompt_ids=[1, 2], max_new_tokens=2), metadata=md)),
    }


def code_of(fn, metadata):
    with pytest.raises(grpc.RpcError) as err:
        fn(metadata)
    return err.value.code()


def test_every_rpc_needs_a_listed_token_and_health_stays_open(secured):
    server, stub, health, tokens = secured
    sid = stub.Join(pb.JoinRequest(drafter_name="a", protocol_version=1), metadata=bearer(tokens["alice"])).session_id
    assert set(calls(stub, sid)) == {m.name for m in pb.DESCRIPTOR.services_by_name["Verifier"].methods}
    for name, fn in calls(stub, sid).items():
        assert code_of(fn, ()) == grpc.StatusCode.UNAUTHENTICATED, name
        assert code_of(fn, bearer("forged")) == grpc.StatusCode.UNAUTHENTICATED, name
    assert health.Check(health_pb2.HealthCheckRequest(service="")).status == health_pb2.HealthCheckResponse.SERVING
    assert sid in server.server.engine.session_ids  # nothing an unauthenticated call did touched it


def test_a_session_answers_only_to_the_identity_that_joined_it(secured):
    server, stub, _, tokens = secured
    alice = bearer(tokens["alice"])
    sid = stub.Join(pb.JoinRequest(drafter_name="a", protocol_version=1), metadata=alice).session_id
    stream = stub.StreamVerdicts(pb.StreamVerdictsRequest(session_id=sid), metadata=alice)
    stub.StartRequest(pb.StartRequestRequest(session_id=sid, prompt_ids=[1, 2], max_new_tokens=4), metadata=alice)
    for name, fn in calls(stub, sid).items():
        if name not in ("Join", "Generate"):  # the two that name no session
            assert code_of(fn, bearer(tokens["bob"])) == grpc.StatusCode.PERMISSION_DENIED, name
    assert list(stub.Resync(pb.ResyncRequest(session_id=sid), metadata=alice).committed_ids) == [1, 2]
    stream.cancel()


def test_an_identitys_session_limit(secured):
    _, stub, _, tokens = secured
    bob = bearer(tokens["bob"])
    stub.Join(pb.JoinRequest(drafter_name="b", protocol_version=1), metadata=bob)
    assert code_of(lambda md: stub.Join(pb.JoinRequest(drafter_name="b2", protocol_version=1), metadata=md), bob) == \
        grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_drafter_with_its_token_generates_the_targets_output(secured, models):
    server, stub, _, tokens = secured
    target, draft = models
    client = DrafterClient(DrafterConfig(server.address, "a", max_new_tokens=10, token=tokens["alice"]), DraftRunner(draft))
    client.wait_until_serving()
    client.join()
    assert client.generate("0", [1, 2, 3]).token_ids == greedy_reference(target, [1, 2, 3], 10)
    client.close()
    stranger = DrafterClient(DrafterConfig(server.address, "s", max_new_tokens=10), DraftRunner(draft))
    with pytest.raises(DrafterError, match="UNAUTHENTICATED"):
        stranger.join()
    stranger.close()
    assert [e["auth"] for e in server.events("serving")] == ["tokens"]


def test_usage_limits_by_hand():
    from goodspeed.verifier.auth import Identity, Usage
    from goodspeed.verifier.errors import LimitExceededError

    now = [0.0]
    usage = Usage(clock=lambda: now[0])
    slow = Identity("slow", rate_per_s=0.5, max_kv_tokens=30, max_streams=1)
    usage.admit_request(slow, 10)  # the burst of one
    with pytest.raises(LimitExceededError, match="rate"):
        usage.admit_request(slow, 10)
    now[0] = 2.0  # one more request's worth of rate
    usage.admit_request(slow, 10)
    now[0] = 10.0
    with pytest.raises(LimitExceededError, match="max_kv_tokens"):
        usage.admit_request(slow, 11)  # 20 held + 11 > 30
    usage.release_request("slow", 10)
    usage.admit_request(slow, 11)
    now[0] = 20.0  # a stream opens a request too: rate and KV count
    usage.open_stream(slow, 5)
    with pytest.raises(LimitExceededError, match="max_streams"):
        usage.open_stream(slow, 0)
    strict = Usage(clock=lambda: now[0])
    with pytest.raises(LimitExceededError, match="max_kv_tokens"):
        strict.open_stream(Identity("kv", max_kv_tokens=4), 5)
    assert strict.streams.get("kv", 0) == 0 and strict.kv_tokens.get("kv", 0) == 0  # refused whole
    usage.close_stream("slow", 5)
    assert usage.streams["slow"] == 0 and usage.kv_tokens["slow"] == 21
    now[0] = 30.0
    usage.open_stream(slow, 0)


def test_an_identitys_kv_tokens_and_streams_through_the_server(models, tmp_path):
    target, draft = models
    path = tmp_path / "tokens.json"
    token = add_token(path, "small", max_kv_tokens=24, max_streams=1)
    engine = VerificationEngine(target, EngineConfig(budget=8, max_draft_len=4))
    local = LocalServing(engine, draft, LocalConfig(policy="chain", k=2))
    with ServerThread(engine, local=local, auth_tokens=str(path)) as server:
        channel = grpc.insecure_channel(server.address)
        stub, md = pb_grpc.VerifierStub(channel), bearer(token)
        a, b = (stub.Join(pb.JoinRequest(drafter_name=n, protocol_version=1), metadata=md).session_id for n in ("a", "b"))
        start = pb.StartRequestRequest(session_id=a, prompt_ids=[1, 2], max_new_tokens=10)  # 12 KV tokens
        stub.StartRequest(start, metadata=md)
        start.session_id = b
        stub.StartRequest(start, metadata=md)  # 24: at the limit
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(generate_request(prompt_ids=[1], max_new_tokens=2), metadata=md))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_kv_tokens" in err.value.details()
        stub.FinishRequest(pb.FinishRequestRequest(session_id=a), metadata=md)  # gives its 12 back
        gate, step = threading.Event(), local.step
        local.step = lambda *a: (gate.wait(30), step(*a))[1]  # hold the first stream open (no race with its end)
        first = stub.Generate(generate_request(prompt_ids=[1], max_new_tokens=8), metadata=md)
        next(first)  # the stream is open
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(generate_request(prompt_ids=[1], max_new_tokens=2), metadata=md))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_streams" in err.value.details()
        gate.set()
        assert list(first)[-1].finished
        assert list(stub.Generate(generate_request(prompt_ids=[1], max_new_tokens=2), metadata=md))[-1].finished
        channel.close()
