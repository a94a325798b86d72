"""Local serving over real gRPC: the Generate stream, its errors, cancellation, and local requests
sharing rounds with edge drafters — all greedy-equal to the target."""

import asyncio
import contextlib
import json
import threading

import grpc
import pytest
import torch

from goodspeed.launch import cli
from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.serving.generation import GenerationRequest
from goodspeed.launch.generate import MissingLogprobsError, OlderVerifierError, collect, generate_request
from goodspeed.proto.goodspeed.v1 import goodspeed_pb2 as pb
from goodspeed.proto.goodspeed.v1 import goodspeed_pb2_grpc as pb_grpc
from goodspeed.verifier.auth import ANONYMOUS, Identity
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from goodspeed.verifier.local import LocalConfig, LocalServing
from grpckit import ServerThread, run_clients
from modelkit import greedy_reference, perturbed, reference_ranks, tiny_llama

PROMPTS = [[1, 2, 3], [9, 8], [4, 4, 4, 4, 5], [30, 31, 32]]


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(0)
    return target, perturbed(target, 0.05, 1)


def local_server(target, draft, policy="chain", **kw):
    engine = VerificationEngine(target, EngineConfig(budget=8, max_draft_len=6))
    local = LocalServing(engine, draft, LocalConfig(policy=policy, k=3, budget=12))
    return ServerThread(engine, local=local, round_deadline_ms=500, **kw)


def stub_for(server):
    channel = grpc.insecure_channel(server.address)
    return channel, pb_grpc.VerifierStub(channel)


@pytest.mark.parametrize("policy", ["chain", "adaserve"])
def test_generate_streams_the_targets_greedy_tokens(models, policy):
    target, draft = models
    with local_server(target, draft, policy) as server:
        channel, stub = stub_for(server)
        results = {}

        def work(i):
            results[i] = collect(stub.Generate(generate_request(prompt_ids=PROMPTS[i], max_new_tokens=16)))

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        channel.close()
        generated = server.events("generated")
    for i, prompt in enumerate(PROMPTS):
        r = results[i]
        assert r["prompt_ids"] == prompt
        assert r["token_ids"] == greedy_reference(target, prompt, 16)
        assert r["finish_reason"] == "length" and r["tpot_s"] > 0
        assert len(r["token_times_s"]) == 16 and r["token_times_s"] == sorted(r["token_times_s"])
    assert sum(r["num_accepted"] for r in results.values()) > 0
    assert len(generated) == len(PROMPTS)


def test_local_requests_and_edge_drafters_share_the_engine(models):
    target, draft = models
    with local_server(target, draft) as server:
        channel, stub = stub_for(server)
        local = {}
        thread = threading.Thread(target=lambda: local.update(collect(stub.Generate(generate_request(prompt_ids=PROMPTS[0], max_new_tokens=40)))))
        thread.start()
        edge = run_clients(server.address, [draft], [PROMPTS[1:3]], max_new=14)
        thread.join(60)
        channel.close()
        rounds = server.events("round")
    assert local["token_ids"] == greedy_reference(target, PROMPTS[0], 40)
    assert edge[0] == [greedy_reference(target, p, 14) for p in PROMPTS[1:3]]
    assert any(r.get("local", {}).get("requests") and r["batch"] for r in rounds)  # one forward held both


def test_generate_errors(models):
    target, draft = models
    engine = VerificationEngine(target)
    with ServerThread(engine) as server:  # no local serving
        channel, stub = stub_for(server)
        with pytest.raises(grpc.RpcError) as err:
            collect(stub.Generate(generate_request(prompt_ids=[1], max_new_tokens=2)))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "--local-draft" in err.value.details()
        channel.close()
    with local_server(target, draft) as server:
        channel, stub = stub_for(server)
        cases = [
            (generate_request(prompt_ids=[1], max_new_tokens=0), grpc.StatusCode.INVALID_ARGUMENT),
            (generate_request(prompt_ids=[999], max_new_tokens=3), grpc.StatusCode.INVALID_ARGUMENT),
            (generate_request(prompt="hello", prompt_ids=[1], max_new_tokens=3), grpc.StatusCode.INVALID_ARGUMENT),
            (generate_request(prompt="hello", max_new_tokens=3), grpc.StatusCode.INVALID_ARGUMENT),  # no tokenizer here
            (generate_request(prompt_ids=[1, 2], max_new_tokens=100_000), grpc.StatusCode.RESOURCE_EXHAUSTED),
            (generate_request(prompt_ids=[1, 2], max_new_tokens=3, temperature=1e-45), grpc.StatusCode.INVALID_ARGUMENT),
            (generate_request(prompt_ids=[1, 2], max_new_tokens=3, request_id="r" * 129), grpc.StatusCode.INVALID_ARGUMENT),
            (generate_request(prompt_ids=[1, 2], max_new_tokens=3, request_id="bad id\n"), grpc.StatusCode.INVALID_ARGUMENT),
            (generate_request(prompt_ids=[1, 2], max_new_tokens=3, logprobs=21), grpc.StatusCode.INVALID_ARGUMENT),
            (generate_request(prompt_ids=[1, 2], max_new_tokens=3, prompt_logprobs=21), grpc.StatusCode.INVALID_ARGUMENT),
        ]
        for request, code in cases:
            with pytest.raises(grpc.RpcError) as err:
                collect(stub.Generate(request))
            assert err.value.code() == code, (request, err.value.details())
        channel.close()


def test_cancelled_stream_frees_the_request(models):
    target, draft = models
    with local_server(target, draft) as server:
        channel, stub = stub_for(server)
        stream = stub.Generate(generate_request(prompt_ids=PROMPTS[0], max_new_tokens=400))
        next(stream), next(stream)  # the prompt chunk and a first batch of tokens
        stream.cancel()
        channel.close()
        local = server.server.local
        for _ in range(200):
            if not local.has_work:
                break
            threading.Event().wait(0.02)
        assert not local.has_work
        assert local.finished[-1].finish_reason == "cancelled"
        assert server.server.engine.session_ids == []


def test_a_local_stream_closed_and_cancelled_again_meanwhile_still_frees_the_request(models):
    """A stream whose closing is itself cancelled (an HTTP handler cancelled twice as its client
    goes away): the request is still cancelled, not left to run to max_new_tokens."""
    target, draft = models
    with local_server(target, draft) as server:
        service = server.server.service

        async def close_twice():
            stream = await service.open_local(Identity(ANONYMOUS), GenerationRequest("", PROMPTS[0], 400, SamplingParams(), ()))
            await anext(stream)
            closing = asyncio.ensure_future(stream.aclose())
            await asyncio.sleep(0)  # cancel() is on its way to the engine thread, behind a round
            closing.cancel()
            await asyncio.gather(closing, return_exceptions=True)

        server.run(close_twice())
        local = server.server.local
        for _ in range(200):  # bounded: until the engine thread has run the cancellation and it is logged
            if not local.has_work and server.events("cancelled"):
                break
            threading.Event().wait(0.02)
        assert not local.has_work
        assert local.finished[-1].finish_reason == "cancelled"
        assert server.events("cancelled")[-1]["freed"] is True


def test_generate_sends_the_targets_log_probabilities_of_its_tokens_and_of_the_prompt(models):
    """GenerateRequest.logprobs / prompt_logprobs: each generated token's log-probability and top
    ones, and the prompt's (with the first chunk that has tokens), equal the target's own forward;
    a request that asks for neither gets neither."""
    target, draft = models
    prompt = PROMPTS[2]
    with local_server(target, draft) as server:
        channel, stub = stub_for(server)
        scored = generate_request(prompt_ids=prompt, max_new_tokens=12, logprobs=2, prompt_logprobs=1)
        chunks = list(stub.Generate(scored))
        plain_chunks = list(stub.Generate(generate_request(prompt_ids=prompt, max_new_tokens=12)))
        channel.close()
    result, plain = collect(chunks, request=scored), collect(plain_chunks)
    generated = result["token_ids"]
    assert generated == greedy_reference(target, prompt, 12) == plain["token_ids"]
    with torch.no_grad():
        rows = torch.log_softmax(target(torch.tensor([prompt + generated])).logits[0].float(), dim=-1)

    def check(entries, ids, at, top, ranked):
        assert [e["token_id"] for e in entries] == ids
        expected = rows[at].gather(1, torch.tensor(ids).unsqueeze(1)).squeeze(1)
        assert torch.allclose(torch.tensor([e["logprob"] for e in entries]), expected, atol=1e-4)
        for e, row in zip(entries, rows[at]):
            assert (e["rank"] in reference_ranks(row, e["token_id"])) if ranked else (e["rank"] is None)
            assert torch.allclose(torch.tensor([x for _, x in e["top"]]), row.topk(top).values, atol=1e-4)

    check(result["logprobs"], generated, slice(len(prompt) - 1, -1), 2, ranked=False)  # ranks: prompt scores only
    check(result["prompt_logprobs"], prompt[1:], slice(0, len(prompt) - 1), 1, ranked=True)
    with_tokens = [c for c in chunks if c.token_ids]
    assert len(with_tokens[0].prompt_logprobs) == len(prompt) - 1 and not any(c.prompt_logprobs for c in with_tokens[1:])
    assert "logprobs" not in plain and not any(c.logprobs or c.prompt_logprobs for c in plain_chunks)


def test_a_generate_stream_without_the_log_probabilities_asked_for_is_an_error_not_a_blank():
    """What a verifier older than GenerateRequest.logprobs sends: tokens alone."""
    asked = generate_request(prompt_ids=[1, 2], max_new_tokens=2, logprobs=0)
    tokens_alone = [pb.GenerateChunk(request_id="r", prompt_ids=[1, 2]), pb.GenerateChunk(token_ids=[3, 4], finished=True)]
    with pytest.raises(MissingLogprobsError, match="without their log-probabilities"):
        collect(tokens_alone, request=asked)
    with pytest.raises(MissingLogprobsError, match="did not score the prompt"):
        collect(tokens_alone, request=generate_request(prompt_ids=[1, 2], max_new_tokens=2, prompt_logprobs=0))
    assert collect(tokens_alone)["token_ids"] == [3, 4]


def test_a_generate_stream_from_a_verifier_that_does_not_say_it_applies_a_setting_is_an_error():
    """GenerateChunk.sampling_fields: a verifier older than it says 0, so a request that sets a
    field past top_p (min_p, penalties, min_tokens, ...) is refused before any text; one that sets
    only temperature, top-k and top-p is served; a verifier that says it applies the field serves it."""
    old = [pb.GenerateChunk(request_id="r", prompt_ids=[1, 2]), pb.GenerateChunk(token_ids=[3, 4], text="x", finished=True)]
    shown = []
    with pytest.raises(OlderVerifierError, match="SamplingParams.min_tokens"):
        collect(old, on_text=shown.append, request=generate_request(prompt_ids=[1, 2], sampling=SamplingParams(min_tokens=2)))
    with pytest.raises(OlderVerifierError, match="SamplingParams.presence_penalty"):
        collect(old, request=generate_request(prompt_ids=[1, 2], sampling=SamplingParams(presence_penalty=0.5)))
    assert shown == []
    assert collect(old, request=generate_request(prompt_ids=[1, 2], temperature=1.0, top_k=3, top_p=0.5))["token_ids"] == [3, 4]
    knows = [pb.GenerateChunk(request_id="r", prompt_ids=[1, 2], sampling_fields=9)] + old[1:]
    assert collect(knows, request=generate_request(prompt_ids=[1, 2], sampling=SamplingParams(min_tokens=2)))["token_ids"] == [3, 4]
    with pytest.raises(OlderVerifierError, match="allowed_token_ids"):
        collect(knows, request=generate_request(prompt_ids=[1, 2], sampling=SamplingParams(allowed_token_ids=(3,))))


def test_generate_cli_json(models, capsys):
    target, draft = models
    with local_server(target, draft) as server:
        code = cli.main(["generate", "--verifier", server.address, "--prompt-ids", "1,2,3", "--max-new-tokens", "7", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert out["prompt_ids"] == [1, 2, 3] and out["token_ids"] == greedy_reference(target, [1, 2, 3], 7)
    assert len(out["token_times_s"]) == 7 and out["text"] == ""  # this test server has no tokenizer
    assert "logprobs" not in out and "prompt_logprobs" not in out

    with local_server(target, draft) as server:  # min_tokens (no EOS here to hold back): served, not refused
        held = cli.main(["generate", "--verifier", server.address, "--prompt-ids", "1,2,3", "--max-new-tokens", "7", "--json",
                         "--min-tokens", "3", "--presence-penalty", "0.5"])
        out = json.loads(capsys.readouterr().out)
        too_many = cli.main(["generate", "--verifier", server.address, "--prompt-ids", "1,2,3", "--max-new-tokens", "2",
                             "--min-tokens", "3"])
    assert held == 0 and len(out["token_ids"]) == 7
    assert too_many == 2 and "--min-tokens (3) must be at most --max-new-tokens (2)" in capsys.readouterr().err


def test_generate_cli_log_probabilities(models, capsys):
    target, draft = models
    with local_server(target, draft) as server:
        code = cli.main(["generate", "--verifier", server.address, "--prompt-ids", "1,2,3", "--max-new-tokens", "5", "--json",
                         "--logprobs", "3", "--prompt-logprobs", "0"])
        out = json.loads(capsys.readouterr().out)
        refused = cli.main(["generate", "--verifier", server.address, "--prompt-ids", "1,2,3", "--logprobs", "1"])
    assert code == 0 and refused == 2
    assert [e["token_id"] for e in out["logprobs"]] == out["token_ids"] and all(len(e["top"]) == 3 for e in out["logprobs"])
    assert [e["token_id"] for e in out["prompt_logprobs"]] == [2, 3] and all(e["top"] == [] for e in out["prompt_logprobs"])
    assert "--logprobs and --prompt-logprobs need --json" in capsys.readouterr().err


@contextlib.contextmanager
def _full_wait_queue(models):
    """A server whose local serving has one request decoding and one waiting (max_requests 1,
    max_waiting 1): its queue is full. Yields the server and a stub; both requests end on exit."""
    target, draft = models
    engine = VerificationEngine(target, EngineConfig(budget=8, max_draft_len=6))
    local = LocalServing(engine, draft, LocalConfig(policy="chain", k=3, max_requests=1, max_waiting=1))
    with ServerThread(engine, local=local, round_deadline_ms=500) as server:
        channel, stub = stub_for(server)
        first = stub.Generate(generate_request(prompt_ids=PROMPTS[0], max_new_tokens=400, temperature=0.0, ignore_eos=True))
        next(iter(first))  # decoding
        second = stub.Generate(generate_request(prompt_ids=PROMPTS[1], max_new_tokens=4, temperature=0.0, ignore_eos=True))
        waiting = threading.Thread(target=lambda: list(second), daemon=True)
        waiting.start()
        assert server.wait_for(lambda: local.num_waiting == 1)  # the second request is queued
        try:
            yield server, stub
        finally:
            first.cancel()
            waiting.join(60)
            channel.close()


def _assert_refused_with_a_hint(refused) -> None:
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry in about" in refused.value.details()
    assert int(dict(refused.value.trailing_metadata())["retry-after-ms"]) >= 1


def test_a_full_wait_queue_refuses_at_the_door_while_the_engine_thread_is_busy(models):
    """The queue's refusal does not wait for the engine's step (under load a step is tens of ms):
    with the engine thread held, a request past max_waiting is refused RESOURCE_EXHAUSTED, with
    the retry hint the last step left, before the thread is let go."""
    with _full_wait_queue(models) as (server, stub):
        held, release = threading.Event(), threading.Event()

        def hold():
            held.set()
            release.wait(120)

        holding = asyncio.run_coroutine_threadsafe(server.server.service.call(hold), server.loop)
        assert held.wait(60)
        try:
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Generate(generate_request(prompt_ids=PROMPTS[2], max_new_tokens=4, temperature=0.0, ignore_eos=True),
                                   timeout=60))
            assert not release.is_set() and not holding.done()  # refused while the engine thread was still held
        finally:
            release.set()
        holding.result(60)
    _assert_refused_with_a_hint(refused)


def test_a_full_wait_queue_refuses_with_a_retry_after_hint(models):
    """One request decoding, one waiting (max_requests 1, max_waiting 1): a third is refused at once
    with RESOURCE_EXHAUSTED, and the trailing metadata says when to retry (retry-after-ms, from the
    decoding request's tokens left at the measured step time)."""
    with _full_wait_queue(models) as (server, stub):
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(generate_request(prompt_ids=PROMPTS[2], max_new_tokens=4, temperature=0.0, ignore_eos=True)))
    _assert_refused_with_a_hint(refused)
