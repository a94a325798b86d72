"""Tool calling's pieces without a model: the schema a forced call is held to, each reader on whole
replies and on the same replies cut at every character (a stream gives what the whole reply
gives), and the request checks."""

import json

import pytest

from goodspeed.api.errors import ApiError, parse_body
from goodspeed.api.protocol import ChatCompletionRequest
from goodspeed.api.tools import NamedToolChoice, Tool, ToolCalls, forced_schema, merge
from apikit import CLOCK, WEATHER, Scripted, serve



def read(reader: ToolCalls, text: str, cuts: list[int] = ()) -> tuple[str, list[dict], list[dict]]:
    """``text`` pushed in the pieces ``cuts`` makes, then finished: the content, the whole calls and the deltas."""
    content, deltas = "", []
    bounds = [0, *cuts, len(text)]
    for a, b in zip(bounds, bounds[1:]):
        piece, calls = reader.push(text[a:b])
        content, deltas = content + piece, deltas + calls
    piece, calls = reader.finish()
    return content + piece, merge(deltas + calls), deltas + calls


def strip_ids(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def every_cut(mode, text, parser=None, parallel=True, tools=()):
    """The reply read whole and cut in two at every character: all the same (ids aside)."""
    whole = read(ToolCalls(mode, parser, parallel, tools), text)
    for cut in range(len(text) + 1):
        content, calls, _ = read(ToolCalls(mode, parser, parallel, tools), text, [cut])
        assert content == whole[0] and strip_ids(calls) == strip_ids(whole[1]), cut
    one_char = read(ToolCalls(mode, parser, parallel, tools), text, list(range(1, len(text))))
    assert one_char[0] == whole[0] and strip_ids(one_char[1]) == strip_ids(whole[1])
    return whole[0], strip_ids(whole[1])


def test_hermes_reads_calls_and_keeps_the_text_around_them():
    text = ('Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "clock", "arguments": {}}\n</tool_call>\n')
    assert every_cut("auto", text, "hermes") == ("Let me look.\n", [("weather", {"city": "Oslo"}), ("clock", {})])
    assert every_cut("auto", "No tools needed < here.", "hermes") == ("No tools needed < here.", [])
    # a block that is not a call is content, as is one the reply did not close; text after a call is kept
    bad = '<tool_call>{"name": oops}</tool_call> then <tool_call>{"name": "clock"'
    assert every_cut("auto", bad, "hermes") == (bad, [])
    after = '<tool_call>{"name": "clock", "arguments": {}}</tool_call>\n\nDone.'
    assert every_cut("auto", after, "hermes") == ("\n\nDone.", [("clock", {})])
    # an unclosed block that holds a whole call (the reply ended there) is a call
    assert every_cut("auto", '<tool_call>{"name": "clock", "arguments": {}}', "hermes") == ("", [("clock", {})])


def test_qwen3_coder_reads_xml_calls_typed_by_the_tools_schemas():
    typed = Tool.model_validate({"type": "function", "function": {"name": "book", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "nights": {"type": "integer"}, "budget": {"type": "number"}, "late": {"type": "boolean"},
        "rooms": {"type": "array"}, "note": {"type": ["string", "null"]}, "extra": {"type": "object"}}}}})
    tools = [typed, Tool.model_validate(CLOCK)]
    text = ("Booking.\n<tool_call>\n<function=book>\n<parameter=city>\nNew York\n</parameter>\n"
            "<parameter=nights>\n3\n</parameter>\n<parameter=budget>\n99.5\n</parameter>\n<parameter=late>\nTrue\n</parameter>\n"
            "<parameter=rooms>\n[1, 2]\n</parameter>\n<parameter=note>\n007\n</parameter>\n<parameter=extra>\n{oops\n</parameter>\n"
            "<parameter=untyped>\n{\"a\": 1}\n</parameter>\n</function>\n</tool_call>\n"
            "<tool_call>\n<function=clock>\n</function>\n</tool_call>")
    content, calls = every_cut("auto", text, "qwen3_coder", tools=tools)
    assert content == "Booking.\n"
    assert calls == [("book", {"city": "New York", "nights": 3, "budget": 99.5, "late": True, "rooms": [1, 2], "note": "007",
                               "extra": "{oops", "untyped": {"a": 1}}), ("clock", {})]
    # a string keeps its inner lines; null is null but for a string; a parameter left open ends at the next
    multi = "<tool_call><function=book><parameter=city>\nline 1\nline 2\n</parameter><parameter=nights>null<parameter=late>x</function></tool_call>"
    assert every_cut("auto", multi, "qwen3_coder", tools=tools)[1] == [("book", {"city": "line 1\nline 2", "nights": None,
                                                                                 "late": "x"})]
    # not a call: stray text in the function, two functions, no function; all kept as content
    for bad in ("<tool_call><function=book>hello</function></tool_call>",
                "<tool_call><function=a></function><function=b></function></tool_call>",
                '<tool_call>{"name": "clock"}</tool_call>'):
        assert every_cut("auto", bad, "qwen3_coder", tools=tools) == (bad, [])
    # a reply cut inside a call that holds a whole function is that call (as hermes reads it)
    assert every_cut("auto", "<tool_call>\n<function=clock>\n", "qwen3_coder", tools=tools) == ("", [("clock", {})])


def test_llama3_json_reads_objects_from_the_start_only():
    text = '{"name": "weather", "parameters": {"city": "Oslo"}}; {"name": "clock", "parameters": {}}'
    assert every_cut("auto", text, "llama3_json") == ("", [("weather", {"city": "Oslo"}), ("clock", {})])
    assert every_cut("auto", '<|python_tag|>{"name": "clock", "parameters": {}}', "llama3_json") == ("", [("clock", {})])
    prose = 'The JSON {"name": "clock"} is an example.'
    assert every_cut("auto", prose, "llama3_json") == (prose, [])
    broken = '{"name": "clock", "parameters": {'
    assert every_cut("auto", broken, "llama3_json") == (broken, [])


def test_required_streams_each_calls_arguments_as_they_come():
    text = '[{"name": "weather", "parameters": {"city": "Oslo", "q": "a\\"}]"}}, {"name": "clock", "parameters": {}}]'
    assert every_cut("required", text) == ("", [("weather", {"city": "Oslo", "q": 'a"}]'}), ("clock", {})])
    _, calls, deltas = read(ToolCalls("required"), text)
    assert [c["function"]["arguments"] for c in calls] == ['{"city": "Oslo", "q": "a\\"}]"}', "{}"]  # as written
    reader = ToolCalls("required")
    _, first = reader.push(text[:47])  # into the first call's parameters: it is open, its arguments so far sent
    assert [d["function"].get("name") for d in first] == ["weather", None]
    assert "".join(d["function"]["arguments"] for d in first) == '{"city": "Os'
    # keys the other way round: the item whole once it closes; a reply cut inside a call keeps what was sent
    backwards = '[{"parameters": {"city": "Oslo"}, "name": "weather"}]'
    assert every_cut("required", backwards) == ("", [("weather", {"city": "Oslo"})])
    content, calls, _ = read(ToolCalls("required"), '[{"name": "clock", "parameters": {"a"', [20, 37])
    assert content == "" and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("clock", '{"a"')]
    assert every_cut("required", '[{"name": "clock"') == ('{"name": "clock"', [])  # no call opened: content


def test_a_named_call_streams_its_arguments_and_parallel_false_keeps_the_first_call():
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "weather"}})
    reader = ToolCalls(named)
    content, calls, deltas = read(reader, '{"city": "Oslo"}', [3, 9])
    assert content == "" and strip_ids(calls) == [("weather", {"city": "Oslo"})]
    assert [d.get("id") is not None for d in deltas] == [True, False, False]  # the id, type and name come first
    assert reader.finish_reason("stop") == "stop"  # OpenAI's for a forced call
    two = '<tool_call>{"name": "weather", "arguments": {"city": "A"}}</tool_call><tool_call>{"name": "clock"}</tool_call>'
    assert every_cut("auto", two, "hermes", parallel=False) == ("", [("weather", {"city": "A"})])
    reader = ToolCalls("auto", "hermes")
    read(reader, two)
    assert reader.finish_reason("stop") == "tool_calls" and reader.finish_reason("length") == "length"
    reader = ToolCalls("auto", "hermes")
    read(reader, "no call")
    assert reader.finish_reason("stop") == "stop"


def test_the_forced_schemas_are_vllms():
    tools = [Tool.model_validate(t) for t in (WEATHER, CLOCK)]
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "clock"}})
    assert forced_schema(tools, named) == {"type": "object", "properties": {}}
    assert forced_schema(tools, "auto") is None and forced_schema(tools, "none") is None
    schema = forced_schema(tools, "required", parallel=False)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [o["properties"]["name"]["enum"] for o in schema["items"]["anyOf"]] == [["weather"], ["clock"]]
    assert all(o["additionalProperties"] is False for o in schema["items"]["anyOf"])  # a call holds no other key
    with_defs = Tool.model_validate({"type": "function", "function": {"name": "at", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "integer"}}}}})
    schema = forced_schema([with_defs, tools[0]], "required")
    assert schema["$defs"] == {"P": {"type": "integer"}} and "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    clash = with_defs.model_copy(deep=True)
    clash.function.name, clash.function.parameters["$defs"]["P"] = "at2", {"type": "string"}
    with pytest.raises(ValueError, match="defs"):
        forced_schema([with_defs, clash], "required")
    with pytest.raises(ValueError, match="not among"):
        forced_schema(tools, NamedToolChoice.model_validate({"type": "function", "function": {"name": "nope"}}))


MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("extra, param", [
    ({"tools": []}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "clock"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "ignore_eos": True}, "ignore_eos"),
    ({"messages": [{"role": "tool", "content": "4"}]}, "messages.0"),  # no tool_call_id
    ({"messages": [{"role": "user", "content": None}]}, "messages.0"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages.0"),
])
def test_bad_tool_requests_are_400_naming_the_field(extra, param):
    with pytest.raises(ApiError) as caught:
        parse_body(ChatCompletionRequest, {"model": "m", "messages": MESSAGES, **extra}).structure()
    assert caught.value.status == 400 and caught.value.param == param


def test_a_conversation_with_calls_renders_for_the_template():
    body = parse_body(ChatCompletionRequest, {"model": "m", "tools": [WEATHER], "tool_choice": "none", "messages": [
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "4 C"}]})
    turns = [m.turn() for m in body.messages]
    assert turns[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}]}
    assert turns[2] == {"role": "tool", "content": "4 C", "tool_call_id": "c1"}
    assert body.tool_mode == "none" and body.structure() is None


@pytest.fixture(scope="module")
def tool_tokenizer():
    """The demo's byte-level BPE with a chat template that renders tools (as Qwen3's and Llama 3.1's do)."""
    from modelkit import chat_pair

    tokenizer = chat_pair()[2]
    tokenizer.chat_template = "{% if tools %}# tools: {{ tools | tojson }}\n{% endif %}" + tokenizer.chat_template
    return tokenizer


@pytest.mark.parametrize("parser, reply, content", [
    ("hermes", 'Checking.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "clock", "arguments": {}}\n</tool_call>', "Checking.\n"),
    ("llama3_json", '{"name": "weather", "parameters": {"city": "Oslo"}}; {"name": "clock", "parameters": {}}', None),
    ("qwen3_coder", 'Checking.\n<tool_call>\n<function=weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>\n'
                    '<tool_call>\n<function=clock>\n</function>\n</tool_call>', "Checking.\n"),
])
def test_auto_tool_calls_through_the_official_client_whole_and_streamed(tool_tokenizer, parser, reply, content):
    """tool_choice "auto" with a --tool-call-parser: the model's calls come back as tool_calls
    (finish_reason "tool_calls"), streamed as the client accumulates them; the prompt rendered the
    tools; parallel_tool_calls false keeps the first call."""
    backend = Scripted(tool_tokenizer, reply)
    api, stop = serve(backend, tool_parser=parser)
    try:
        whole = api.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "weather?"}],
                                            tools=[WEATHER, CLOCK])
        events = list(api.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "weather?"}],
                                                  tools=[WEATHER, CLOCK], stream=True))
        first = api.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "weather?"}],
                                            tools=[WEATHER, CLOCK], parallel_tool_calls=False)
    finally:
        stop()
    choice = whole.choices[0]
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == [("weather", {"city": "Oslo"}), ("clock", {})] and choice.finish_reason == "tool_calls"
    assert choice.message.content == content and all(c.id.startswith("chatcmpl-tool-") for c in choice.message.tool_calls)
    assert '"weather"' in tool_tokenizer.decode(backend.prompts[0])  # the template rendered the tools
    text, streamed = "", {}
    for event in events:
        for c in event.choices:
            text += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                call = streamed.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
                call["arguments"] += d.function.arguments or ""
    assert text == (content or "") and events[-1].choices[0].finish_reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(streamed.items())] == calls
    assert [c.function.name for c in first.choices[0].message.tool_calls] == ["weather"]


def test_auto_on_a_reply_without_calls_is_plain_content(tool_tokenizer):
    api, stop = serve(Scripted(tool_tokenizer, "It is sunny <tool_ in Oslo."), tool_parser="hermes")
    try:
        reply = api.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "weather?"}],
                                            tools=[WEATHER])
    finally:
        stop()
    assert reply.choices[0].message.content == "It is sunny <tool_ in Oslo." and not reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "stop"


def test_tokenize_renders_the_tools_as_chat_completions_do(tool_tokenizer):
    """vLLM's /tokenize with messages and tools counts the prompt a chat completion generates from."""
    import urllib.request

    backend = Scripted(tool_tokenizer, "ok")
    api, stop = serve(backend, tool_parser="hermes")
    try:
        api.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER])
        body = json.dumps({"messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER]}).encode()
        request = urllib.request.Request(str(api.base_url).replace("/v1/", "/tokenize"), data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            tokens = json.loads(response.read())["tokens"]
    finally:
        stop()
    assert tokens == backend.prompts[0] and '"weather"' in tool_tokenizer.decode(tokens)


def test_json_is_compact_by_default_and_any_whitespace_only_when_asked():
    """OpenAI's structured outputs write JSON without whitespace between tokens; vLLM's
    ``disable_any_whitespace: false`` asks for any."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}

    def structure(**extra):
        return parse_body(ChatCompletionRequest, {"model": "m", "messages": MESSAGES, **extra}).structure()

    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    assert not structure(response_format=fmt).any_whitespace
    assert not structure(response_format={"type": "json_object"}).any_whitespace
    assert not structure(tools=[WEATHER], tool_choice="required").any_whitespace
    assert not structure(structured_outputs={"json": schema}).any_whitespace
    assert structure(structured_outputs={"json": schema, "disable_any_whitespace": False}).any_whitespace
