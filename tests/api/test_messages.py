"""Anthropic's Messages API (``/v1/messages``) without a model: a request read as the chat
completion it stands for, its reply as content blocks (the stream's events build the message the
whole response is), and the endpoint through Anthropic's official client on a scripted backend."""

import json

import anthropic
import pytest

from goodspeed.api.messages import MessagesRequest, MessageWriter
from goodspeed.api.errors import ApiError, parse_body
from apikit import Scripted, serve, thinking

WEATHER = {"name": "weather", "description": "the weather", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def request(**fields) -> MessagesRequest:
    return parse_body(MessagesRequest, {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **fields})


def test_a_request_is_the_chat_completion_it_stands_for():
    body = request(system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}], tools=[WEATHER],
                   tool_choice={"type": "any", "disable_parallel_tool_use": True}, stop_sequences=["END"], temperature=0,
                   messages=[
                       {"role": "user", "content": "weather in Oslo?"},
                       {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "x"},
                                                         {"type": "text", "text": "Checking."},
                                                         {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Oslo"}}]},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "4 C"},
                                                    {"type": "tool_result", "tool_use_id": "t2", "is_error": True,
                                                     "content": [{"type": "text", "text": "down"}]},
                                                    {"type": "text", "text": "and now?"}]}])
    chat = body.to_chat()
    turns = [m.turn() for m in chat.messages]
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "tool", "tool", "user"]
    assert turns[0]["content"] == "Be brief." and turns[2]["content"] == "Checking."  # thinking given back: left out
    assert turns[2]["tool_calls"] == [{"id": "t1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}]
    assert (turns[3]["tool_call_id"], turns[3]["content"]) == ("t1", "4 C") and turns[4]["content"] == "Error: down"
    assert turns[5]["content"] == "and now?"
    assert chat.tool_mode == "required" and not chat.parallel_tool_calls and chat.stop == ["END"] and chat.max_tokens == 8
    assert chat.tools[0].function.parameters == WEATHER["input_schema"]
    named = request(tools=[WEATHER], tool_choice={"type": "tool", "name": "weather"}).to_chat()
    assert named.tool_mode.function.name == "weather" and named.structure() is not None
    assert request(tools=[WEATHER], tool_choice={"type": "none"}).to_chat().tool_mode == "none"
    assert request(tools=[WEATHER]).to_chat().tool_mode == "auto"
    shaped = request(output_config={"format": {"type": "json_schema", "schema": WEATHER["input_schema"]}}).to_chat()
    assert shaped.response_format.json_schema.schema_ == WEATHER["input_schema"] and shaped.structure().kind == "json"


@pytest.mark.parametrize("fields, param", [
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"tool_choice": {"type": "tool"}, "tools": [WEATHER]}, "tool_choice"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
    ({"temperature": 1.5}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "a", "input": {}}]}]}, "messages"),
    ({"mcp_servers": []}, "mcp_servers"),
    ({"output_config": {"effort": "high"}}, "output_config.effort"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}, "tools": [WEATHER],
      "tool_choice": {"type": "any"}}, "tools"),  # two constraints at once
])
def test_what_cannot_be_served_is_a_400_naming_the_field(fields, param):
    with pytest.raises(ApiError) as refused:
        request(**fields).to_chat()
    assert refused.value.status == 400 and (refused.value.param or "").startswith(param), refused.value.message


class Consumed:
    """A stand-in for the TextStream a writer reads its counts and stop string from."""

    def __init__(self, consumed=5, matched=None):
        self.consumed, self.matched = consumed, matched


def rebuild(events: list[dict]) -> list[dict]:
    blocks: dict[int, dict] = {}
    partial: dict[int, str] = {}
    for event in events:
        if event["type"] == "content_block_start":
            blocks[event["index"]] = dict(event["content_block"])
        elif event["type"] == "content_block_delta":
            delta, block = event["delta"], blocks[event["index"]]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            else:
                partial[event["index"]] = partial.get(event["index"], "") + delta["partial_json"]
        elif event["type"] == "content_block_stop" and event["index"] in partial:
            blocks[event["index"]]["input"] = json.loads(partial[event["index"]])
    return [blocks[i] for i in sorted(blocks)]


def test_the_writers_events_build_its_message_and_stop_reasons_are_anthropics():
    writer = MessageWriter("msg_1", "m", 3, Consumed())
    events = writer.opening() + writer.push("Let me ", "", []) + writer.push("think.", "Sure", [])
    events += writer.push("", "", [{"index": 0, "id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"ci'}}])
    events += writer.push("", "", [{"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}])
    events += writer.push("", " then.", []) + writer.finish("tool_calls")
    message = writer.whole()
    assert [b["type"] for b in message["content"]] == ["thinking", "text", "tool_use", "text"]
    assert message["content"][0]["thinking"] == "Let me think." and message["content"][1]["text"] == "Sure"
    assert message["content"][2] == {"type": "tool_use", "id": "c1", "name": "weather", "input": {"city": "Oslo"}}
    assert message["stop_reason"] == "tool_use" and message["usage"] == {"input_tokens": 3, "output_tokens": 5}
    assert rebuild(events) == message["content"]
    types = [e["type"] for e in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    assert types.count("content_block_start") == types.count("content_block_stop") == 4
    cut = MessageWriter("msg_2", "m", 3, Consumed())
    cut.push("", "", [{"index": 0, "id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Os'}}])
    events = cut.finish("length")
    assert cut.whole()["content"] == [{"type": "text", "text": '{"city": "Os'}] and cut.whole()["stop_reason"] == "max_tokens"
    assert rebuild(events) == cut.whole()["content"]  # a call that does not parse is text, streamed or not
    stopped = MessageWriter("msg_3", "m", 3, Consumed(matched="END"))
    stopped.push("", "x", [])
    stopped.finish("stop")
    assert (stopped.whole()["stop_reason"], stopped.whole()["stop_sequence"]) == ("stop_sequence", "END")
    plain = MessageWriter("msg_4", "m", 3, Consumed())
    plain.finish("stop")
    assert plain.whole()["stop_reason"] == "end_turn" and plain.whole()["content"] == []


REPLY = ('The user wants Oslo.\n</think>\n\nOn it.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n'
         '</tool_call>')


def test_messages_through_anthropics_client_whole_streamed_counted_and_refused():
    """A reasoning model's reply with a tool call through Anthropic's SDK: thinking, text and
    tool_use blocks, stop_reason tool_use; the SDK's stream accumulates the same message;
    count_tokens counts the prompt generated from; the x-api-key header is the API key; refusals
    are Anthropic's error objects; stop_sequences and max_tokens end the text as Anthropic's."""
    tokenizer = thinking(markers=True)
    backend = Scripted(tokenizer, REPLY)
    keys = {"Bearer alice": "alice"}

    def authorize(header):
        if header not in keys:
            raise ApiError(401, "unknown API key")
        return keys[header]

    openai_api, stop = serve(backend, tool_parser="hermes", reasoning_parser="qwen3", authorize=authorize)
    url = str(openai_api.base_url).removesuffix("/v1/")
    api = anthropic.Anthropic(base_url=url, api_key="alice", max_retries=0)
    ask = dict(model="scripted", max_tokens=100, system="Be brief.", messages=[{"role": "user", "content": "weather in Oslo?"}],
               tools=[WEATHER])
    try:
        whole = api.messages.create(**ask)
        with api.messages.stream(**ask) as stream:
            kinds = [event.type for event in stream]
            streamed = stream.get_final_message()
        counted = api.messages.count_tokens(model="scripted", system="Be brief.", tools=[WEATHER],
                                            messages=[{"role": "user", "content": "weather in Oslo?"}])
        cut = api.messages.create(model="scripted", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
        ended = api.messages.create(model="scripted", max_tokens=100, stop_sequences=["On it"],
                                    messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(anthropic.AuthenticationError) as unknown:
            anthropic.Anthropic(base_url=url, api_key="mallory", max_retries=0).messages.create(**ask)
        with pytest.raises(anthropic.BadRequestError) as bad:
            api.messages.create(**{**ask, "tool_choice": {"type": "tool", "name": "nope"}})
        with pytest.raises(anthropic.NotFoundError) as missing:
            api.messages.create(**{**ask, "model": "other"})
    finally:
        stop()
    assert [b.type for b in whole.content] == ["thinking", "text", "tool_use"]
    assert whole.content[0].thinking == "The user wants Oslo.\n" and whole.content[1].text == "\n\nOn it.\n"
    assert (whole.content[2].name, whole.content[2].input) == ("weather", {"city": "Oslo"})
    assert whole.stop_reason == "tool_use" and whole.stop_sequence is None and whole.role == "assistant"
    assert whole.usage.output_tokens == len(tokenizer.encode(REPLY, add_special_tokens=False)) + 1  # + EOS
    assert whole.usage.input_tokens == len(backend.prompts[0]) == counted.input_tokens
    prompt = tokenizer.decode(backend.prompts[0])
    assert "Be brief." in prompt and '"weather"' in prompt
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    drop_ids = lambda m: [{k: v for k, v in b.model_dump().items() if k != "id"} for b in m.content]  # noqa: E731
    assert drop_ids(streamed) == drop_ids(whole) and streamed.stop_reason == "tool_use"
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    assert (ended.stop_reason, ended.stop_sequence) == ("stop_sequence", "On it")
    assert [b.type for b in ended.content] == ["thinking", "text"] and ended.content[1].text == "\n\n"
    assert unknown.value.body["error"]["type"] == "authentication_error"
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
    assert missing.value.body["error"]["type"] == "not_found_error"
