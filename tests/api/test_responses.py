"""The Responses API (``/v1/responses``) without a model: a request read as the chat completion it
stands for, its reply as output items (a stream's events build what the whole response holds),
the store, and the endpoint through the official client on a scripted backend."""

import json

import openai
import pytest
from multidict import MultiDict

from goodspeed.api.errors import ApiError, parse_body
from goodspeed.api.response_store import ResponseStore, page_of_items
from goodspeed.api.responses import Items, ResponsesRequest, as_messages
from goodspeed.api.tools import ToolCalls
from apikit import Scripted, serve, thinking

WEATHER = {"type": "function", "name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CLOCK = {"type": "function", "name": "clock"}


def request(**fields) -> ResponsesRequest:
    return parse_body(ResponsesRequest, {"model": "m", **fields})


def test_a_request_is_the_chat_completion_it_stands_for():
    body = request(instructions="Be brief.", max_output_tokens=9, temperature=0, tools=[WEATHER, CLOCK],
                   tool_choice={"type": "function", "name": "weather"}, parallel_tool_calls=False, input=[
                       {"role": "user", "content": "weather?"},
                       {"type": "reasoning", "id": "rs_1", "summary": []},  # given back: left out
                       {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
                       {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Oslo"}'},
                       {"type": "function_call", "call_id": "c2", "name": "clock", "arguments": "{}"},
                       {"type": "function_call_output", "call_id": "c1", "output": "4 C"},
                       {"type": "function_call_output", "call_id": "c2", "output": "noon"},
                       {"role": "user", "content": [{"type": "input_text", "text": "and "}, {"type": "input_text", "text": "now?"}]}])
    chat = body.to_chat([{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "yes"}])
    turns = [m.turn() for m in chat.messages]
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "user", "assistant", "tool", "tool", "user"]
    assert turns[0]["content"] == "Be brief." and turns[-1]["content"] == "and now?"
    assert turns[4]["content"] == "Checking." and [c["id"] for c in turns[4]["tool_calls"]] == ["c1", "c2"]
    assert turns[4]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}  # a dict for the template, as chat's
    assert (turns[5]["tool_call_id"], turns[5]["content"]) == ("c1", "4 C")
    assert chat.max_tokens == 9 and chat.temperature == 0 and not chat.parallel_tool_calls
    assert [t.function.name for t in chat.tools] == ["weather", "clock"] and chat.tool_mode.function.name == "weather"
    assert chat.structure() is not None  # the named call's schema
    plain = request(input="hi").to_chat([])
    assert [m.turn() for m in plain.messages] == [{"role": "user", "content": "hi"}] and plain.tools is None
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    shaped = request(input="hi", text={"format": {"type": "json_schema", "name": "x", "schema": schema}}).to_chat([])
    assert shaped.response_format.json_schema.schema_ == schema and shaped.structure().kind == "json"


@pytest.mark.parametrize("fields, param", [
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.items.0.message.content"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": []}, "input"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
])
def test_what_cannot_be_served_is_a_400_naming_the_responses_field(fields, param):
    with pytest.raises(ApiError) as refused:
        request(**{"input": "hi", **fields}).to_chat([])
    assert refused.value.status == 400 and (refused.value.param or "").startswith(param), refused.value.message


def events_rebuild(events: list[dict]) -> list[dict]:
    """The output items as a client rebuilds them from the events alone."""
    items: dict[int, dict] = {}
    for event in events:
        kind, index = event["type"], event.get("output_index")
        if kind == "response.output_item.added":
            items[index] = json.loads(json.dumps(event["item"]))
        elif kind == "response.content_part.added":
            items[index]["content"].append(dict(event["part"]))
        elif kind in ("response.output_text.delta", "response.reasoning_text.delta"):
            items[index]["content"][event["content_index"]]["text"] += event["delta"]
        elif kind == "response.function_call_arguments.delta":
            items[index]["arguments"] += event["delta"]
        elif kind == "response.output_item.done":
            assert {k: v for k, v in items[index].items() if k != "status"} == \
                   {k: v for k, v in event["item"].items() if k != "status"}
            items[index] = event["item"]
    return [items[i] for i in sorted(items)]


def test_the_items_events_build_the_items_and_each_kind_opens_a_new_item():
    items = Items()
    events = items.push("Let me ", "", []) + items.push("think.", "", []) + items.push("", "Hello", [])
    events += items.push("", " there", [{"index": 0, "id": "call_1", "type": "function",
                                         "function": {"name": "weather", "arguments": '{"ci'}}])
    events += items.push("", "", [{"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}])
    events += items.push("", "", [{"index": 1, "id": "call_2", "type": "function", "function": {"name": "clock", "arguments": "{}"}}])
    events += items.push("", "Done.", []) + items.finish("completed")
    output = items.output
    assert [i["type"] for i in output] == ["reasoning", "message", "function_call", "function_call", "message"]
    assert output[0]["content"] == [{"type": "reasoning_text", "text": "Let me think."}]
    assert output[1]["content"][0]["text"] == "Hello there" and output[4]["content"][0]["text"] == "Done."
    assert [(i["call_id"], i["name"], i["arguments"]) for i in output[2:4]] == [
        ("call_1", "weather", '{"city": "Oslo"}'), ("call_2", "clock", "{}")]
    assert all(i["status"] == "completed" for i in output) and len({i["id"] for i in output}) == 5
    assert events_rebuild(events) == output
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [e["output_index"] for e in added] == [0, 1, 2, 3, 4] and all(e["item"]["status"] == "in_progress" for e in added)
    assert [e["type"] for e in events[-3:]] == ["response.output_text.done", "response.content_part.done",
                                                "response.output_item.done"]
    assert events[-3]["text"] == "Done."
    cut = Items()
    cut.push("", "Hel", [])
    assert cut.finish("incomplete")[-1]["item"]["status"] == "incomplete" and Items().finish("completed") == []


def test_a_reply_read_whole_and_streamed_as_items_agree():
    """A named call's reader through Items: the arguments stream as deltas of one function_call."""
    from goodspeed.api.tools import NamedToolChoice

    reader = ToolCalls(NamedToolChoice.model_validate({"type": "function", "function": {"name": "weather"}}))
    items, events = Items(), []
    for piece in ('{"ci', 'ty": ', '"Oslo"}'):
        events += items.push("", *reader.push(piece))
    events += items.push("", *reader.finish()) + items.finish("completed")
    assert [(i["type"], i["name"], i["arguments"]) for i in items.output] == [("function_call", "weather", '{"city": "Oslo"}')]
    assert sum(e["type"] == "response.function_call_arguments.delta" for e in events) == 3
    assert as_messages(items.output) == [{"role": "assistant", "content": None, "tool_calls": [
        {"id": items.output[0]["call_id"], "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]}]


def test_the_store_keeps_the_latest_within_its_bounds_and_each_owners_own():
    store = ResponseStore(responses=2, chars=10_000)
    for i in range(3):
        store.put("alice", {"id": f"r{i}", "output": []}, [{"role": "user", "content": str(i)}])
    assert len(store) == 2 and store.get("alice", "r2")[1] == [{"role": "user", "content": "2"}]
    for who, rid in (("alice", "r0"), ("bob", "r2")):  # forgotten; someone else's
        with pytest.raises(ApiError) as missing:
            store.get(who, rid)
        assert missing.value.status == 404
    store.delete("alice", "r2")
    assert len(store) == 1
    small = ResponseStore(responses=10, chars=300)
    for i in range(4):
        small.put("a", {"id": f"r{i}", "output": []}, [{"role": "user", "content": "x" * 80}])
    assert len(small) == 2 and small.get("a", "r3")  # 2 x ~130 characters fit in 300
    small.put("a", {"id": "huge", "output": []}, [{"role": "user", "content": "x" * 400}])
    assert len(small) == 2  # larger than the whole store: not kept, nothing evicted for it


def test_input_items_are_the_requests_input_in_openais_item_shapes():
    assert [(i["type"], i["role"], i["content"]) for i in request(input="hi").input_items()] == \
        [("message", "user", [{"type": "input_text", "text": "hi"}])]
    items = request(input=[
        {"role": "system", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather?"}], "id": "msg_given"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"role": "assistant", "content": "Checking."},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "4 C"}]).input_items()
    assert [i["type"] for i in items] == ["message", "message", "reasoning", "message", "function_call", "function_call_output"]
    assert items[1]["id"] == "msg_given" and items[2] == {"id": "rs_1", "type": "reasoning", "summary": []}
    assert items[3]["content"] == [{"type": "output_text", "text": "Checking."}]  # the assistant's text is output
    assert (items[4]["call_id"], items[4]["name"], items[5]["output"]) == ("c1", "weather", "4 C")
    assert len({i["id"] for i in items}) == 6 and all(i["id"].startswith(("msg_", "rs_", "fc_", "fco_")) for i in items)


def test_a_page_of_input_items_is_ordered_windowed_and_says_whether_more_follow():
    items = [{"id": f"i{k}"} for k in range(5)]

    def ids(**query):
        page = page_of_items(items, MultiDict(query))
        return [i["id"] for i in page["data"]], page["has_more"], page["first_id"], page["last_id"]

    assert ids() == (["i4", "i3", "i2", "i1", "i0"], False, "i4", "i0")  # newest first by default
    assert ids(order="asc", limit="2") == (["i0", "i1"], True, "i0", "i1")
    assert ids(order="asc", limit="2", after="i1") == (["i2", "i3"], True, "i2", "i3")
    assert ids(order="asc", after="i3") == (["i4"], False, "i4", "i4")
    assert ids(after="i3", before="i0") == (["i2", "i1"], False, "i2", "i1")  # desc: after i3 come i2, i1
    assert ids(order="asc", after="i4") == ([], False, None, None)
    assert ids(after="i1", before="i3") == ([], False, None, None)  # an empty window
    for query, param in (({"limit": "0"}, "limit"), ({"limit": "101"}, "limit"), ({"limit": "x"}, "limit"),
                         ({"order": "newest"}, "order"), ({"after": "nope"}, "after"), ({"before": "nope"}, "before"),
                         ({"include": "message.output_text.logprobs"}, "include"), ({"page": "2"}, "page")):
        with pytest.raises(ApiError) as refused:
            page_of_items(items, MultiDict(query))
        assert (refused.value.status, refused.value.param) == (400, param), query


@pytest.fixture(scope="module")
def thinking_tokenizer():
    return thinking(markers=True)


REPLY = ('The user wants Oslo.\n</think>\n\nOn it.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n'
         '</tool_call>')


def test_responses_through_the_official_client_whole_streamed_stored_and_continued(thinking_tokenizer):
    """A reasoning model's reply with a tool call: a reasoning item, a message and a function_call,
    whole and streamed (the stream's events in order, numbered, and its last response the whole
    one); stored and retrieved by its owner only; continued with previous_response_id, whose
    prompt holds the earlier conversation and reply; store false is not kept; max_output_tokens
    cuts it: incomplete."""
    backend = Scripted(thinking_tokenizer, REPLY)
    keys = {"Bearer alice": "alice", "Bearer bob": "bob"}

    def authorize(header):
        if header not in keys:
            raise ApiError(401, "bad key")
        return keys[header]

    api, stop = serve(backend, tool_parser="hermes", reasoning_parser="qwen3", authorize=authorize)
    api = api.with_options(api_key="alice")
    bob = api.with_options(api_key="bob")
    try:
        whole = api.responses.create(model="scripted", instructions="Be brief.", input="weather in Oslo?", tools=[WEATHER],
                                     metadata={"run": "1"})
        events = list(api.responses.create(model="scripted", input="weather in Oslo?", tools=[WEATHER], stream=True))
        kept = api.responses.retrieve(whole.id)
        with pytest.raises(openai.NotFoundError):
            bob.responses.retrieve(whole.id)
        follow = api.responses.create(model="scripted", previous_response_id=whole.id, tools=[WEATHER], input=[
            {"type": "function_call_output", "call_id": whole.output[2].call_id, "output": "4 C"}])
        with pytest.raises(openai.NotFoundError):
            bob.responses.create(model="scripted", previous_response_id=whole.id, input="hi")
        unkept = api.responses.create(model="scripted", input="hi", store=False)
        with pytest.raises(openai.NotFoundError):
            api.responses.retrieve(unkept.id)
        cut = api.responses.create(model="scripted", input="hi", max_output_tokens=4)
        listed = list(api.responses.input_items.list(whole.id))  # every page, the SDK following has_more
        paged = api.responses.input_items.list(follow.id, order="asc", limit=1)
        with pytest.raises(openai.NotFoundError):
            bob.responses.input_items.list(whole.id)
        with pytest.raises(openai.BadRequestError):
            api.responses.input_items.list(whole.id, limit=0)
        api.responses.delete(whole.id)
        with pytest.raises(openai.NotFoundError):
            api.responses.retrieve(whole.id)
    finally:
        stop()
    assert [i.type for i in whole.output] == ["reasoning", "message", "function_call"]
    assert whole.output[0].content[0].text == "The user wants Oslo.\n" and whole.output_text == "\n\nOn it.\n"
    assert (whole.output[2].name, json.loads(whole.output[2].arguments)) == ("weather", {"city": "Oslo"})
    assert whole.status == "completed" and whole.instructions == "Be brief." and whole.metadata == {"run": "1"}
    prompt = thinking_tokenizer.decode(backend.prompts[0])
    assert "Be brief." in prompt and '"weather"' in prompt  # the instructions and the tools reached the template
    assert whole.usage.output_tokens == len(thinking_tokenizer.encode(REPLY, add_special_tokens=False)) + 1  # + EOS
    assert 0 < whole.usage.output_tokens_details.reasoning_tokens < whole.usage.output_tokens
    assert kept.model_dump() == whole.model_dump()
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert [i.type for i in final.output] == [i.type for i in whole.output] and final.output_text == whole.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "The user wants Oslo.\n"
    assert events_rebuild([e.model_dump(exclude_unset=True) for e in events]) == [i.model_dump(exclude_unset=True)
                                                                                  for i in final.output]
    continued = thinking_tokenizer.decode(backend.prompts[2])
    assert "weather in Oslo?" in continued and "4 C" in continued and "Be brief." not in continued  # instructions not carried
    assert follow.previous_response_id == whole.id and follow.status == "completed"
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 4 and cut.output[-1].status == "incomplete"
    # input items: the response's own input (newest first by default); a continued one lists its own only
    assert [(i.type, i.role, i.content[0].text) for i in listed] == [("message", "user", "weather in Oslo?")]
    assert [i.type for i in paged.data] == ["function_call_output"] and not paged.has_more
    assert paged.data[0].call_id == whole.output[2].call_id and paged.first_id == paged.last_id == paged.data[0].id
