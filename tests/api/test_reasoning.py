"""A reasoning model's thinking apart from its answer: where it starts (read off the prompt and the
reply), the reader on whole replies and cut at every character, and through the server with tool
calls, streamed and whole."""

import json

import pytest

from goodspeed.api.reasoning import Reasoning, closes_reasoning, opens_reasoning
from apikit import CLOCK, WEATHER, Scripted, serve, thinking

QWEN_OPEN = "<|im_start|>assistant\n<think>\n"  # Qwen3-2507 thinking, DeepSeek-R1: the prompt opens the block
QWEN_CLOSED = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # Qwen3 with enable_thinking false
PLAIN = "<|im_start|>assistant\n"  # Qwen3's first release: the reply opens it, or not


def read(parser, prompt, text, cuts=()):
    reader = Reasoning(parser, prompt)
    reasoning = content = ""
    bounds = [0, *cuts, len(text)]
    for a, b in zip(bounds, bounds[1:]):
        r, c = reader.push(text[a:b])
        reasoning, content = reasoning + r, content + c
    r, c = reader.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("parser, prompt, text, want", [
    ("qwen3", QWEN_OPEN, "Paris is in France.\n</think>\n\nParis.", ("Paris is in France.\n", "\n\nParis.")),
    ("qwen3", PLAIN, "<think>\nhmm</think>\n\nParis.", ("\nhmm", "\n\nParis.")),
    ("qwen3", PLAIN, "Paris. A <think> tag mid-text is content.", ("", "Paris. A <think> tag mid-text is content.")),
    ("qwen3", QWEN_CLOSED, "Paris.", ("", "Paris.")),
    ("qwen3", QWEN_OPEN, "still thinking when cut </thi", ("still thinking when cut </thi", "")),  # never closed: reasoning
    ("qwen3", QWEN_OPEN, "<think>repeated opening</think>x", ("repeated opening", "x")),
    ("deepseek_r1", PLAIN, "R1 without its opening tag</think>answer", ("R1 without its opening tag", "answer")),
    ("deepseek_r1", QWEN_CLOSED, "plain", ("", "plain")),
    ("qwen3", PLAIN, "   ", ("", "   ")),
])
def test_the_reasoning_and_the_content_at_every_cut(parser, prompt, text, want):
    assert read(parser, prompt, text) == want
    for cut in range(len(text) + 1):
        assert read(parser, prompt, text, [cut]) == want, cut
    assert read(parser, prompt, text, list(range(1, len(text)))) == want


def test_where_a_prompt_leaves_the_reasoning():
    assert opens_reasoning(QWEN_OPEN) and not closes_reasoning(QWEN_OPEN)
    assert closes_reasoning(QWEN_CLOSED) and not opens_reasoning(QWEN_CLOSED)
    assert not opens_reasoning(PLAIN) and not closes_reasoning(PLAIN)


@pytest.fixture(scope="module")
def thinking_tokenizer():
    return thinking(markers=True)


MESSAGES = [{"role": "user", "content": "weather in Oslo?"}]
REPLY = ('The user wants Oslo.\n</think>\n\nOn it.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n'
         '</tool_call>')


def test_reasoning_and_tool_calls_through_the_server_whole_and_streamed(thinking_tokenizer):
    backend = Scripted(thinking_tokenizer, REPLY)
    api, stop = serve(backend, tool_parser="hermes", reasoning_parser="qwen3")
    try:
        whole = api.chat.completions.create(model="scripted", messages=MESSAGES, tools=[WEATHER, CLOCK])
        events = list(api.chat.completions.create(model="scripted", messages=MESSAGES, tools=[WEATHER, CLOCK], stream=True))
        hidden = api.chat.completions.create(model="scripted", messages=MESSAGES, extra_body={"include_reasoning": False})
    finally:
        stop()
    message = whole.choices[0].message
    assert message.model_extra["reasoning_content"] == message.model_extra["reasoning"] == "The user wants Oslo.\n"
    assert message.content == "\n\nOn it.\n" and whole.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [("weather", {"city": "Oslo"})]
    reasoning = content = ""
    calls = []
    for event in events:
        for choice in event.choices:
            reasoning += choice.delta.model_extra.get("reasoning_content") or ""
            content += choice.delta.content or ""
            calls += choice.delta.tool_calls or []
    assert (reasoning, content) == ("The user wants Oslo.\n", "\n\nOn it.\n")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("weather", {"city": "Oslo"})]
    assert "reasoning_content" not in hidden.choices[0].message.model_extra  # include_reasoning false
    assert hidden.choices[0].message.content.startswith("\n\nOn it.")  # no tools: the block is content


def test_a_grammar_waits_for_the_reasoning_to_end(thinking_tokenizer):
    """On a prompt that leaves the reasoning open, a forced call's grammar holds the reply from
    its </think> token on (``Structure.after``); on one that closes it, from the first token; a
    tokenizer without </think> as one token cannot mark that point: 400."""
    import openai

    end = thinking_tokenizer.convert_tokens_to_ids("</think>")
    named = {"type": "function", "function": {"name": "weather"}}
    backend = Scripted(thinking_tokenizer, 'Oslo, then.</think>{"city": "Oslo"}')
    api, stop = serve(backend, reasoning_parser="qwen3")
    try:
        thought = api.chat.completions.create(model="scripted", messages=MESSAGES, tools=[WEATHER], tool_choice=named)
        api.chat.completions.create(model="scripted", messages=MESSAGES, tools=[WEATHER], tool_choice=named,
                                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    finally:
        stop()
    assert [r.sampling.structured.after for r in backend.requests] == [end, None]
    assert thought.choices[0].message.model_extra["reasoning_content"] == "Oslo, then."
    calls = thought.choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in calls] == [("weather", '{"city": "Oslo"}')]
    api, stop = serve(Scripted(thinking(markers=False), "x"), reasoning_parser="qwen3")
    try:
        with pytest.raises(openai.BadRequestError) as refused:
            api.chat.completions.create(model="scripted", messages=MESSAGES, tools=[WEATHER], tool_choice=named)
    finally:
        stop()
    assert refused.value.body["param"] == "tools" and "</think>" in refused.value.body["message"]
