"""Bad requests get 4xx with OpenAI's error object — never a 500 — from the official client's view
(served here by a verifier's local serving; the edge node shares this server)."""

import json
import urllib.error
import urllib.request

import openai
import pytest

from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from goodspeed.verifier.local import LocalConfig, LocalServing
from grpckit import ServerThread
from modelkit import chat_pair

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    target, draft, tokenizer = chat_pair()
    engine = VerificationEngine(target, EngineConfig(budget=8, max_draft_len=6, max_seq_len=128))
    local = LocalServing(engine, draft, LocalConfig(policy="chain", k=3))
    with ServerThread(engine, local=local, tokenizer=tokenizer, http_port=0, target_name="tiny") as running:
        yield running


@pytest.fixture(scope="module")
def api(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.server.http_port}/v1", api_key="unused", max_retries=0)


def refusal(call, **kwargs):
    with pytest.raises(openai.APIStatusError) as caught:
        call(**kwargs)
    error = caught.value
    assert set(error.body) == {"message", "type", "param", "code"} and error.body["message"]
    return error.status_code, error.body


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature="hot"), "temperature"),
    (dict(temperature=3.0), "temperature"),
    (dict(max_tokens=-1), "max_tokens"),
    (dict(max_tokens=0), "max_tokens"),  # no completion: only with echo
    (dict(top_p=0), "top_p"),
    (dict(n=0), "n"),
    (dict(n=129), "n"),  # OpenAI's cap
    (dict(prompt=["x"] * 65, n=2), "n"),  # 130 choices
    (dict(prompt=["x"] * 129), "prompt"),
    (dict(prompt=["x", 5]), "prompt"),
    (dict(prompt=[[1, 2], []]), "prompt"),
    (dict(prompt=[]), "prompt"),
    (dict(prompt=["x", ""]), "prompt"),
    (dict(seed=-5), "seed"),
    (dict(logprobs=21), "logprobs"),  # 20 top log-probabilities at most, as vLLM's default
    (dict(extra_body={"top_logprobs": 2}), "top_logprobs"),  # chat's field, not completions'
    (dict(presence_penalty=2.5), "presence_penalty"),  # OpenAI's range, -2 to 2
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
    (dict(extra_body={"min_p": 1.5}), "min_p"),
    (dict(logit_bias={"7": 101}), "logit_bias.7"),
    (dict(logit_bias={"-1": 1}), "logit_bias"),
    (dict(logit_bias={"seven": 1}), "logit_bias"),
    (dict(best_of=2), "best_of"),
    (dict(stop=["a", "b", "c", "d", "e"]), "stop"),
    (dict(suffix="x"), "suffix"),
    (dict(stream_options={"include_usage": True}), "stream_options"),
    (dict(extra_body={"frobnicate": 1}), "frobnicate"),
    (dict(extra_body={"ignore_eos": "yes please"}), "ignore_eos"),
    (dict(extra_body={"prompt_logprobs": 21}), "prompt_logprobs"),
    (dict(extra_body={"prompt_logprobs": -1}), "prompt_logprobs"),  # vLLM's whole vocabulary: past the 20
    (dict(extra_body={"prompt_logprobs": -2}), "prompt_logprobs"),
    (dict(stream=True, extra_body={"prompt_logprobs": 0}), "prompt_logprobs"),  # vLLM's rule
    (dict(extra_body={"bad_words": [""]}), "bad_words.0"),
    (dict(extra_body={"bad_words": ["x"] * 129}), "bad_words"),
    (dict(extra_body={"bad_words": ["x"], "guided_regex": "a+"}), "bad_words"),  # could leave no token
])
def test_bad_completion_bodies_are_400_naming_the_field(api, kwargs, param):
    status, body = refusal(api.completions.create, model="tiny", **{"prompt": "x", **kwargs})
    assert status == 400 and body["type"] == "invalid_request_error" and body["param"] == param


@pytest.mark.parametrize("kwargs, param", [
    (dict(messages=[]), "messages"),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages.0.role"),
    (dict(messages=[{"role": "user", "content": 5}]), "messages.0.content.str"),
    (dict(messages=MESSAGES, tools=[{"type": "function", "function": {"name": "f"}}]), "tool_choice"),  # auto: no parser
    (dict(messages=MESSAGES, response_format={"type": "json_schema"}), "response_format"),  # no schema
    (dict(messages=MESSAGES, response_format={"type": "yaml"}), "response_format.type"),
    (dict(messages=MESSAGES, max_tokens=3, max_completion_tokens=4), "max_completion_tokens"),
    (dict(messages=MESSAGES, top_logprobs=2), "top_logprobs"),  # needs logprobs = true
    (dict(messages=MESSAGES, logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(messages=MESSAGES, extra_body={"echo": "maybe"}), "echo"),
    (dict(messages=MESSAGES, max_tokens=0), "max_tokens"),
    (dict(messages=MESSAGES, stream=True, extra_body={"prompt_logprobs": 1}), "prompt_logprobs"),
])
def test_bad_chat_bodies_are_400(api, kwargs, param):
    status, body = refusal(api.chat.completions.create, model="tiny", **kwargs)
    assert status == 400 and body["param"] == param


def test_an_unknown_model_is_404_model_not_found(api):
    status, body = refusal(api.completions.create, model="gpt-4", prompt="x")
    assert status == 404 and body["code"] == "model_not_found"


def test_a_model_is_retrieved_by_its_name_and_the_server_says_its_version(api, server):
    """OpenAI's ``models.retrieve`` (an id may hold a "/", as org/name ids do) and vLLM's ``/version``."""
    import importlib.metadata

    assert api.models.retrieve("tiny").id == "tiny" and api.models.retrieve("tiny").model_extra["max_model_len"] == 128
    status, body = refusal(api.models.retrieve, model="org/other")
    assert status == 404 and body["code"] == "model_not_found"
    with urllib.request.urlopen(f"http://127.0.0.1:{server.server.http_port}/version", timeout=10) as response:
        assert json.loads(response.read()) == {"version": importlib.metadata.version("goodspeed")}
    target, draft, tokenizer = chat_pair()
    engine = VerificationEngine(target, EngineConfig(budget=8, max_draft_len=6))
    with ServerThread(engine, local=LocalServing(engine, draft, LocalConfig(policy="chain", k=3)), tokenizer=tokenizer,
                      http_port=0, target_name="org/tiny") as named:
        other = openai.OpenAI(base_url=f"http://127.0.0.1:{named.server.http_port}/v1", api_key="unused", max_retries=0)
        assert other.models.retrieve("org/tiny").id == "org/tiny"


def test_a_prompt_past_the_context_is_400_context_length_exceeded(api, server):
    status, body = refusal(api.completions.create, model="tiny", prompt="word " * 400, max_tokens=4)
    assert status == 400 and body["code"] == "context_length_exceeded" and "tokens" in body["message"]
    status, body = refusal(api.chat.completions.create, model="tiny", messages=[{"role": "user", "content": "x" * 9000}])
    assert status == 400 and body["code"] == "context_length_exceeded" and "characters" in body["message"]  # before tokenizing
    status, body = refusal(api.completions.create, model="tiny", prompt=[1, 2, 3], max_tokens=126)  # 3 + 126 > 128
    assert status == 400 and body["code"] == "context_length_exceeded"
    status, body = refusal(api.completions.create, model="tiny", prompt=[1, 2, 300], max_tokens=4)  # id past V = 300
    assert status == 400 and "token" in body["message"]
    status, body = refusal(api.completions.create, model="tiny", prompt=[1, 2], max_tokens=4, logit_bias={"300": 5})
    assert status == 400 and "logit_bias" in body["message"]
    status, body = refusal(api.completions.create, model="tiny", prompt=[[1, 2], [1] * 127], max_tokens=4)  # the second
    assert status == 400 and body["code"] == "context_length_exceeded" and "prompt 1 holds 127" in body["message"]


def post(server, path, data: bytes):
    request = urllib.request.Request(f"http://127.0.0.1:{server.server.http_port}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize("data", [b"{not json", b"[1, 2]", b"\xff\xfe", b'"a string"'])
def test_bodies_that_are_not_a_json_object_are_400(server, data):
    status, body = post(server, "/v1/completions", data)
    assert status == 400 and body["error"]["type"] == "invalid_request_error"


def test_unknown_paths_and_huge_bodies_get_the_error_object_too(server):
    assert post(server, "/v1/embeddings", b"{}")[0] == 404
    status, body = post(server, "/v1/completions", b'{"prompt": "' + b"x" * (9 * 1024 * 1024) + b'"}')
    assert status == 413 and body["error"]["message"]


def test_the_server_still_serves_after_every_refusal(api):
    out = api.completions.create(model="tiny", prompt="x", max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3


def get(server, path):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server.http_port}{path}", timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_tokenize_and_detokenize_as_vllms_agree_with_what_completions_count(server, api):
    tokenizer = server.server.service.tokenizer
    text = "def decode(self, s):\n    return s"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    status, body = post(server, "/tokenize", json.dumps({"model": "tiny", "prompt": text, "return_token_strs": True}).encode())
    assert status == 200 and body == {"count": len(ids), "max_model_len": 128, "tokens": ids,
                                      "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    status, chat = post(server, "/tokenize", json.dumps({"messages": MESSAGES}).encode())
    completion = api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, temperature=0)
    assert status == 200 and chat["count"] == completion.usage.prompt_tokens and chat["token_strs"] is None
    status, body = post(server, "/detokenize", json.dumps({"tokens": ids}).encode())
    assert status == 200 and body == {"prompt": text}
    status, info = get(server, "/tokenizer_info")
    assert status == 200 and info["eos_token"] == tokenizer.eos_token and info["chat_template"] == tokenizer.chat_template
    assert info["model_max_length"] == 128 and info["vocab_size"] == len(tokenizer)


@pytest.mark.parametrize("path, payload, status, param", [
    ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/tokenize", {"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", [1, 2], 400, None),
    ("/detokenize", {"tokens": [1, 300]}, 400, "tokens"),  # past the vocabulary of 300
    ("/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
    ("/detokenize", {}, 400, "tokens"),
])
def test_bad_tokenizer_calls_are_refused_with_the_error_object(server, path, payload, status, param):
    got, body = post(server, path, json.dumps(payload).encode())
    assert got == status and body["error"]["param"] == param and body["error"]["message"]


def test_a_text_prompt_gets_the_tokenizers_special_tokens_unless_asked_not_to():
    """vLLM's ``add_special_tokens`` (default true for completions and /tokenize, false for chat):
    a tokenizer that puts a BOS before the text (Llama's) gets it before a completion's prompt."""
    import copy

    from tokenizers.processors import TemplateProcessing

    from modelkit import greedy_reference

    target, draft, tokenizer = chat_pair()
    tokenizer = copy.deepcopy(tokenizer)
    bos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    tokenizer._tokenizer.post_processor = TemplateProcessing(single=f"{tokenizer.eos_token} $A",
                                                             special_tokens=[(tokenizer.eos_token, bos)])
    ids = tokenizer("def f(x):", add_special_tokens=False)["input_ids"]
    assert tokenizer("def f(x):")["input_ids"] == [bos] + ids
    engine = VerificationEngine(target, EngineConfig(budget=8, max_draft_len=6))
    with ServerThread(engine, local=LocalServing(engine, draft, LocalConfig(policy="chain", k=3)), tokenizer=tokenizer,
                      http_port=0, target_name="tiny") as running:
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{running.server.http_port}/v1", api_key="unused", max_retries=0)
        greedy = dict(max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        with_bos = api.completions.create(model="tiny", prompt="def f(x):", **greedy)
        without = api.completions.create(model="tiny", prompt="def f(x):", **{**greedy, "extra_body": {
            "ignore_eos": True, "add_special_tokens": False}})
        counted = post(running, "/tokenize", b'{"prompt": "def f(x):"}')[1]["count"]
    assert (with_bos.usage.prompt_tokens, without.usage.prompt_tokens, counted) == (len(ids) + 1, len(ids), len(ids) + 1)
    assert with_bos.choices[0].text == tokenizer.decode(greedy_reference(target, [bos] + ids, 6), skip_special_tokens=True)


def test_chat_template_kwargs_and_continue_final_message_render_as_vllms():
    """vLLM's chat extensions: ``chat_template_kwargs`` sets a variable the template reads (Qwen3's
    ``enable_thinking``), ``continue_final_message`` leaves the last message open; a keyword the
    template does not read, or one the server sets itself, is a 400, as are both modes at once."""
    import copy

    target, draft, tokenizer = chat_pair()
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = ("{% for m in messages %}{{ '# ' + m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
                               "{% if enable_thinking is defined and not enable_thinking %}{{ '# quiet\\n' }}{% endif %}"
                               "{% if add_generation_prompt %}{{ '# assistant:' }}{% endif %}")
    engine = VerificationEngine(target, EngineConfig(budget=8, max_draft_len=6))
    with ServerThread(engine, local=LocalServing(engine, draft, LocalConfig(policy="chain", k=3)), tokenizer=tokenizer,
                      http_port=0, target_name="tiny") as running:
        def rendered(**fields):
            status, body = post(running, "/tokenize", json.dumps({"messages": MESSAGES, **fields}).encode())
            return status, (tokenizer.decode(body["tokens"]) if status == 200 else body["error"])

        plain = rendered()
        quiet = rendered(chat_template_kwargs={"enable_thinking": False})
        assistant = [*MESSAGES, {"role": "assistant", "content": "Hel"}]
        status, body = post(running, "/tokenize", json.dumps({"messages": assistant, "add_generation_prompt": False,
                                                               "continue_final_message": True}).encode())
        open_end = tokenizer.decode(body["tokens"])
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{running.server.http_port}/v1", api_key="unused", max_retries=0)
        chat = api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, temperature=0,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        unread = rendered(chat_template_kwargs={"frobnicate": 1})
        reserved = rendered(chat_template_kwargs={"messages": []})
        both = rendered(continue_final_message=True)
    assert plain == (200, "# user: hi\n# assistant:")
    assert quiet == (200, "# user: hi\n# quiet\n# assistant:")
    assert status == 200 and open_end == "# user: hi\n# assistant: Hel"
    assert chat.usage.prompt_tokens == len(tokenizer("# user: hi\n# quiet\n# assistant:", add_special_tokens=False)["input_ids"])
    assert unread[0] == 400 and "frobnicate" in unread[1]["message"] and "enable_thinking" in unread[1]["message"]
    assert reserved[0] == 400 and reserved[1]["param"] == "chat_template_kwargs"
    assert both[0] == 400 and both[1]["param"] == "continue_final_message"


def test_hostile_nesting_on_the_verifiers_front_is_a_400_that_names_the_limit(server, api):
    """The verifier's own front: a body nested 20,000 levels deep, and a schema sent as text
    nested 1,000 levels deep (compiled against the target's tokenizer), are each a 400 naming the
    limit; the front keeps serving."""
    import json
    import urllib.error
    import urllib.request

    from goodspeed.lm.decoding.structured import MAX_JSON_DEPTH

    deep = '{"type": "object", "properties": {"a": ' * 1000 + '{"type": "string"}' + "}}" * 1000
    base = f"http://127.0.0.1:{server.server.http_port}/v1/completions"

    def honest() -> str:
        return api.completions.create(model="tiny", prompt="def f(x):", max_tokens=4, temperature=0).choices[0].text

    before = honest()
    for body in (b"[" * 20_000 + b"]" * 20_000, json.dumps({"model": "tiny", "prompt": "x", "guided_json": deep}).encode()):
        request = urllib.request.Request(base, data=body, headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 400
        assert f"nested deeper than {MAX_JSON_DEPTH} levels" in json.loads(refused.value.read())["error"]["message"]
    assert honest() == before  # still serving, the same text
