"""Fuzzing every request message against a live server: whatever the fields hold, the answer is a
specific status (never INTERNAL or UNKNOWN), the round loop keeps running, and an honest drafter
still gets the target's own output afterwards."""

import collections

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from goodspeed.drafter.client import DrafterClient, DrafterConfig
from goodspeed.drafter.runner import DraftRunner
from goodspeed.proto.goodspeed.v1 import goodspeed_pb2 as pb
from goodspeed.proto.goodspeed.v1 import goodspeed_pb2_grpc as pb_grpc
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from goodspeed.verifier.local import LocalConfig, LocalServing
from grpckit import ServerThread
from modelkit import greedy_reference, perturbed, tiny_llama

V = 48
SPECIFIC = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ABORTED,
            grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.OUT_OF_RANGE}

# Each field mixes plausible values (so calls get past the first check and reach the engine) with
# wild ones (anything the wire type can hold).
wild_ids = st.lists(st.integers(-(2**31), 2**31 - 1), max_size=24)
ids = st.lists(st.integers(0, V - 1), min_size=1, max_size=8) | wild_ids
floats = st.floats(width=32, allow_nan=True, allow_infinity=True)
text = st.text(max_size=80)
names = st.from_regex(r"[a-z0-9]{1,8}", fullmatch=True) | text
small = st.integers(0, 8)
penalty = st.sampled_from([0.0, 0.5, -1.5]) | floats
sampling = st.builds(pb.SamplingParams, temperature=st.sampled_from([0.0, 0.7, 1.0, 1e-45]) | floats,
                     top_k=st.sampled_from([0, 3]) | st.integers(0, 2**32 - 1), top_p=st.sampled_from([0.0, 0.9, 1.0]) | floats,
                     min_p=st.sampled_from([0.0, 0.1]) | floats, presence_penalty=penalty, frequency_penalty=penalty,
                     repetition_penalty=st.none() | st.sampled_from([1.0, 1.3, 0.0]) | floats,
                     logit_bias=st.dictionaries(st.integers(0, V - 1) | st.integers(-(2**31), 2**31 - 1),
                                                st.sampled_from([2.0, -100.0]) | floats, max_size=4))


def draft_requests(session_id):
    def one_hot(tokens):
        rows = [0.0] * (len(tokens) * V)
        for j, tok in enumerate(tokens):
            if 0 <= tok < V:
                rows[j * V + tok] = 1.0
        return pb.DenseProbs(probs=rows)

    dense = st.builds(lambda p: pb.DenseProbs(probs=p), st.lists(floats | st.just(1.0 / V), max_size=3 * V))
    sparse = st.builds(lambda rows: pb.SparseProbs(rows=rows), st.lists(
        st.builds(pb.SparseRow, token_ids=ids, probs=st.lists(floats | st.just(1.0), max_size=8)), max_size=5))

    def build(sid, r, toks, parents, kind, probs):
        msg = pb.DraftRequest(session_id=sid, round_index=r, token_ids=toks, parents=parents)
        if kind == "one-hot":
            msg.dense.CopyFrom(one_hot(toks))
        elif isinstance(probs, pb.DenseProbs):
            msg.dense.CopyFrom(probs)
        elif isinstance(probs, pb.SparseProbs):
            msg.sparse.CopyFrom(probs)
        return msg

    return st.builds(build, st.just(session_id) | text, small | st.integers(0, 2**64 - 1), st.lists(st.integers(0, V - 1), max_size=4) | wild_ids,
                     st.just([]) | st.lists(st.integers(-2, 4), max_size=4) | wild_ids, st.sampled_from(["one-hot", "given"]),
                     st.none() | dense | sparse)


optional_count = small | st.integers(0, 2**32 - 1)  # an optional uint32: set (in range or wild) or, left out, unset


def with_optional(message, **fields):
    for name, value in fields.items():
        setattr(message, name, value)
    return message


def calls(session_id):
    sid = st.just(session_id) | text
    return st.one_of(
        st.builds(lambda m: ("Join", m), st.builds(pb.JoinRequest, drafter_name=names, model_name=text, tokenizer_fingerprint=text,
                                                  protocol_version=st.just(1) | st.integers(0, 2**32 - 1))),
        st.builds(lambda m, lps: ("StartRequest", with_optional(m, **lps)), st.builds(
            pb.StartRequestRequest, session_id=sid, prompt_ids=ids, sampling=sampling, max_new_tokens=small | st.integers(0, 2**32 - 1),
            eos_token_ids=ids, generated=st.just(0) | small | st.integers(0, 2**32 - 1)),
            st.fixed_dictionaries({}, optional={"logprobs": optional_count, "prompt_logprobs": optional_count})),
        st.builds(lambda m: ("SubmitDraft", m), draft_requests(session_id)),
        st.builds(lambda m: ("FinishRequest", m), st.builds(pb.FinishRequestRequest, session_id=sid)),
        st.builds(lambda m: ("Resync", m), st.builds(pb.ResyncRequest, session_id=sid)),
        st.builds(lambda m: ("Generate", m), st.builds(
            pb.GenerateRequest, prompt=st.just("") | text, prompt_ids=st.just([]) | ids, sampling=sampling,
            max_new_tokens=small | st.integers(0, 2**32 - 1), tpot_slo_ms=st.just(0.0) | st.floats(allow_nan=True),
            ignore_eos=st.booleans(), request_id=st.just("") | names)),
    )


@pytest.fixture(scope="module")
def live():
    target = tiny_llama(0)
    draft = perturbed(target, 0.05, 1)
    engine = VerificationEngine(target, EngineConfig(budget=8, max_draft_len=4, max_seq_len=128))
    local = LocalServing(engine, draft, LocalConfig(policy="chain", k=2, max_waiting=8))
    with ServerThread(engine, local=local, round_deadline_ms=100) as server:
        channel = grpc.insecure_channel(server.address)
        stub = pb_grpc.VerifierStub(channel)
        session = stub.Join(pb.JoinRequest(drafter_name="fuzz", protocol_version=1)).session_id
        stream = stub.StreamVerdicts(pb.StreamVerdictsRequest(session_id=session))
        yield server, stub, session, target, draft
        stream.cancel()
        channel.close()


def test_no_message_gets_an_unspecific_status(live):
    server, stub, session, target, draft = live
    seen = collections.Counter()

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(calls(session))
    def one(call):
        method, message = call
        try:
            reply = getattr(stub, method)(message, timeout=10)
            if method == "Generate":
                for _ in reply:  # drain the stream; its chunks may end in an error status too
                    pass
            seen[(method, "OK")] += 1
        except grpc.RpcError as err:
            assert err.code() in SPECIFIC, (method, err.code(), err.details(), message)
            seen[(method, err.code().name)] += 1

    one()
    assert seen[("Join", "OK")] and seen[("StartRequest", "INVALID_ARGUMENT")]  # the strategies reach past the first checks
    assert not server.server.failed.is_set()
    client = DrafterClient(DrafterConfig(server.address, "honest", max_new_tokens=8), DraftRunner(draft))
    client.join()
    assert client.generate("0", [1, 2, 3]).token_ids == greedy_reference(target, [1, 2, 3], 8)
    client.close()
