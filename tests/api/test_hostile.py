"""Hostile bodies against the OpenAI API (one OpenAIServer class serves the verifier's front and
every edge node's): nesting past the limit is a 400 that names it, on every JSON route; whatever
a generated body holds, the answer is a 4xx or a 2xx, never a 5xx, and an honest request still gets
its reply afterwards."""

import json
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apikit import Scripted, serve
from goodspeed.lm.decoding.structured import MAX_JSON_DEPTH
from modelkit import chat_pair

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/tokenize", "/detokenize")
REPLY = "a plain reply"


@pytest.fixture(scope="module")
def front():
    """(base URL, OpenAI client) of a server whose backend answers every request with REPLY."""
    backend = Scripted(chat_pair()[2], REPLY)
    api, stop = serve(backend)
    yield str(api.base_url).removesuffix("/v1/"), api
    stop()


def post(base: str, route: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(base + route, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, {}
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def nested(depth: int):
    """A JSON value ``depth`` levels deep: lists in lists."""
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


@pytest.mark.parametrize("route", ROUTES)
def test_a_body_nested_20000_levels_deep_is_a_400_that_names_the_limit(front, route):
    base, _ = front
    status, body = post(base, route, b"[" * 20_000 + b"]" * 20_000)
    assert status == 400 and f"nested deeper than {MAX_JSON_DEPTH} levels" in body["error"]["message"]
    if route != "/v1/messages":  # Anthropic's error object has a type, not a code
        assert body["error"]["code"] == "json_too_deep"


def test_the_limit_is_exact(front):
    """Negative control: a body exactly at the limit is read (and refused for its unknown field,
    not its depth); one level more is refused for its depth."""
    base, _ = front
    for depth, too_deep in ((MAX_JSON_DEPTH, False), (MAX_JSON_DEPTH + 1, True)):
        status, body = post(base, "/v1/completions", json.dumps({"model": "scripted", "prompt": "x",
                                                                 "extra": nested(depth - 1)}).encode())
        assert status == 400 and (body["error"]["code"] == "json_too_deep") == too_deep, (depth, body)


def deep_schema(depth: int) -> str:
    """A JSON schema of objects ``depth`` levels deep, as text (json.dumps itself stops near 1,000)."""
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth


def test_a_json_schema_nested_1000_levels_is_a_400_in_the_body_and_as_text(front):
    """A schema in response_format is part of the body (its depth counts there); one sent as text
    (vLLM's guided_json takes a string) is refused when it is compiled, naming the same limit."""
    base, _ = front
    in_body = ('{"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "response_format": '
               '{"type": "json_schema", "json_schema": {"name": "deep", "schema": ' + deep_schema(1000) + "}}}")
    status, body = post(base, "/v1/chat/completions", in_body.encode())
    assert status == 400 and body["error"]["code"] == "json_too_deep"
    as_text = {"model": "scripted", "prompt": "x", "guided_json": deep_schema(1000)}
    status, body = post(base, "/v1/completions", json.dumps(as_text).encode())
    assert status == 400 and f"nested deeper than {MAX_JSON_DEPTH} levels" in body["error"]["message"], body


def test_a_function_calls_arguments_nested_past_the_limit_are_read_as_text(front):
    """An assistant turn's tool-call arguments are a string the server parses for the chat
    template: nested past the limit, they are passed on as the text they are, not a 500."""
    _, api = front
    arguments = "[" * 5000 + "]" * 5000
    reply = api.chat.completions.create(model="scripted", max_tokens=8, messages=[
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"}])
    assert reply.choices[0].message.content


# Bodies from the fields the routes know, with values of any JSON shape (some plausible, so
# requests get past the first checks): every answer a 2xx or a 4xx.
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n", "stop",
          "stream", "logprobs", "top_logprobs", "logit_bias", "response_format", "tools", "tool_choice", "guided_json",
          "guided_regex", "guided_choice", "guided_grammar", "structured_outputs", "input", "instructions", "text",
          "system", "tokens", "seed", "bad_words", "allowed_token_ids", "min_tokens", "echo", "stream_options",
          "max_output_tokens", "role", "content", "type", "name", "parameters", "schema", "json_schema"]
scalars = st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | st.text(max_size=20) \
    | st.sampled_from(["scripted", "user", "assistant", "json_schema", "json_object", "function", "auto", "a|b", "[a-z]+"])
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) |
                      st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), inner, max_size=5), max_leaves=25)
bodies = st.dictionaries(st.sampled_from(FIELDS), values, max_size=8) | values


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(ROUTES), body=bodies)
def test_any_body_is_answered_with_a_2xx_or_a_4xx(front, route, body):
    base, _ = front
    status, _ = post(base, route, json.dumps(body).encode())
    assert 200 <= status < 500, (route, body)


def test_an_honest_request_gets_its_reply_after_the_fuzzing(front):
    _, api = front
    reply = api.chat.completions.create(model="scripted", max_tokens=16, messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content == REPLY


def test_any_body_on_the_verifiers_real_front_is_a_2xx_or_a_4xx_and_honest_text_is_unchanged():
    """The same generated bodies against the verifier's own front (local serving on a tiny target,
    its engine's refusals mapped to statuses too): never a 5xx, and afterwards an honest greedy
    request's text is the one it got before them."""
    import openai

    from goodspeed.verifier.engine import EngineConfig, VerificationEngine
    from goodspeed.verifier.local import LocalConfig, LocalServing
    from grpckit import ServerThread

    target, draft, tokenizer = chat_pair()
    engine = VerificationEngine(target, EngineConfig(budget=8, max_draft_len=6, max_seq_len=128))
    local = LocalServing(engine, draft, LocalConfig(policy="chain", k=3))
    with ServerThread(engine, local=local, tokenizer=tokenizer, http_port=0, target_name="tiny") as running:
        base = f"http://127.0.0.1:{running.server.http_port}"
        api = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)

        def honest() -> str:
            return api.completions.create(model="tiny", prompt="def f(x):", max_tokens=8, temperature=0).choices[0].text

        before = honest()

        @settings(max_examples=60, deadline=None)
        @given(route=st.sampled_from(ROUTES), body=bodies)
        def fuzz(route, body):
            if isinstance(body, dict) and "model" in body:
                body = {**body, "model": "tiny"}  # past the model check, into the backend
            status, _ = post(base, route, json.dumps(body).encode())
            assert 200 <= status < 500, (route, body)

        fuzz()
        assert honest() == before
