"""OpenAI's Responses API (``POST /v1/responses``), served by the chat completion path.

A Responses request is read as the chat completion it stands for (:meth:`ResponsesRequest.to_chat`):
``instructions`` become a system message, ``input`` (a string, or a list of items: messages,
``function_call`` and ``function_call_output`` items, a previous response's ``reasoning`` items)
becomes the conversation, ``previous_response_id`` puts the stored conversation and output of an
earlier response before it, ``max_output_tokens`` is ``max_tokens``, ``text.format`` is
``response_format``, and the flat function tools (``{"type": "function", "name", "parameters"}``)
are chat's tools. Everything after that is chat completions' own code: the chat template, the
structured-output grammar, tool calling and the reasoning parser. So the output is the target's
(greedy: token for token; sampled: in distribution) on every path, as every other endpoint's.

The reply comes back as Responses output items, in order: a ``reasoning`` item (the reasoning
parser's reasoning, as ``reasoning_text`` content), a ``message`` with one ``output_text`` part,
and a ``function_call`` item per tool call (:class:`Items`). Streamed, it is OpenAI's event
sequence: ``response.created``, ``response.in_progress``, then per item ``output_item.added``,
its parts and deltas, ``output_item.done``, and ``response.completed`` (``response.incomplete``
at ``max_output_tokens``; ``response.failed`` for a failure after the headers), each event with
its ``sequence_number``.

Stored responses (``store``, true by default as OpenAI's) are kept in memory by
:class:`~goodspeed.api.response_store.ResponseStore`, the most recent first, within its limits;
an older one is forgotten, and asking for it is a 404. A response belongs to the identity (API
key) that created it: another gets a 404 for it. ``GET /v1/responses/{id}/input_items`` lists a
stored response's own input as items (:func:`~goodspeed.api.response_store.page_of_items`:
OpenAI's ``limit``, ``order``, ``after``, ``before``); a response continued from another lists its
own input, not the earlier turns'.
"""
from __future__ import annotations

import itertools
import json
import secrets
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from goodspeed.api.errors import ApiError, parse_body, renamed
from goodspeed.api.protocol import ChatCompletionRequest
from goodspeed.api.text import TextStream
from goodspeed.api.tools import MAX_TOOLS, NAME_PATTERN

MAX_METADATA = 16  # OpenAI's: keys of metadata, each up to 64 characters, values up to 512

# chat completion fields that a Responses request names otherwise (for its 400s)
FIELD_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
               "response_format": "text.format"}


class InputText(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list | None = None  # an output_text part given back: accepted, not read
    logprobs: list | None = None


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = None  # an output message given back
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call"]
    call_id: str
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class ReasoningItem(BaseModel):
    """A previous response's reasoning, given back: accepted and left out of the prompt (the
    chat templates of reasoning models drop earlier turns' reasoning themselves)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["reasoning"]


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """``text.format``: plain text, any JSON object, or JSON matching a named schema."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    effort: Literal["minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


def _kind(value) -> str | None:
    """An input item's type: a message may leave it out (OpenAI's "easy input message")."""
    return value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)


Item = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                 | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
                 Discriminator(_kind)]
Input = Annotated[Annotated[str, Tag("text")] | Annotated[list[Item], Tag("items")],
                  Discriminator(lambda value: "text" if isinstance(value, str) else "items")]


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    input: Input
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    store: bool = True
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = None
    user: str | None = None
    truncation: Literal["disabled"] = "disabled"
    include: list[str] | None = None
    background: Literal[False] = False
    service_tier: str | None = None  # accepted, as vLLM's; there is one tier
    # vLLM's extensions, as on chat completions
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tpot_slo_ms: float | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value):
        if value is not None and (len(value) > MAX_METADATA or any(len(k) > 64 for k in value)):
            raise ValueError(f"at most {MAX_METADATA} keys of up to 64 characters")
        return value

    def refuse_unsupported(self) -> None:
        if self.include:
            raise ApiError(400, f"include: none of {', '.join(map(repr, self.include))} is served by this server "
                                "(it has no built-in tools, and its log-probabilities are on chat completions)",
                           param="include")
        if self.reasoning is not None and (self.reasoning.effort is not None or self.reasoning.summary is not None):
            raise ApiError(400, "reasoning.effort and reasoning.summary are not served: a reasoning model's reasoning "
                                "comes back whole as a reasoning item (start the server with --reasoning-parser); "
                                'turn Qwen3\'s off with chat_template_kwargs {"enable_thinking": false}', param="reasoning")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ApiError(400, "tool_choice requiring a call needs tools", param="tool_choice")

    def messages(self) -> list[dict]:
        """``input`` as chat messages: consecutive ``function_call`` items join the assistant
        message before them (or one of their own), each ``function_call_output`` a tool message."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict] = []
        for item in self.input:
            if isinstance(item, MessageItem):
                out.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
                if out and out[-1]["role"] == "assistant":
                    out[-1].setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        return out

    def input_items(self) -> list[dict]:
        """``input`` as the items ``GET /v1/responses/{id}/input_items`` lists, in order: each with
        its ``id`` (the one it was given, else a new one) and OpenAI's item shape (a string input is
        one user message; a message's text is parts, ``output_text`` for the assistant's)."""
        if isinstance(self.input, str):
            return [_message_item("user", [{"type": "input_text", "text": self.input}], None)]
        out = []
        for item in self.input:
            if isinstance(item, MessageItem):
                part = "output_text" if item.role == "assistant" else "input_text"
                parts = [{"type": part, "text": item.content}] if isinstance(item.content, str) \
                    else [p.model_dump(exclude_none=True) for p in item.content]
                out.append(_message_item(item.role, parts, item.id))
            elif isinstance(item, FunctionCallItem):
                out.append({"id": item.id or new_id("fc"), "type": "function_call", "call_id": item.call_id,
                            "name": item.name, "arguments": item.arguments, "status": "completed"})
            elif isinstance(item, FunctionCallOutputItem):
                out.append({"id": item.id or new_id("fco"), "type": "function_call_output", "call_id": item.call_id,
                            "output": item.output, "status": "completed"})
            else:  # reasoning given back: as it came
                given = item.model_dump()
                out.append({"id": given.pop("id", None) or new_id("rs"), **given})
        return out

    def to_chat(self, history: list[dict]) -> ChatCompletionRequest:
        """The chat completion this request stands for, after ``history`` (a previous response's
        conversation and reply, as chat messages); 400 with this request's field names."""
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions is not None else []) \
            + history + self.messages()
        if not messages:
            raise ApiError(400, "input holds no message", param="input")
        chat: dict[str, Any] = {"model": self.model, "messages": messages, "stream": self.stream}
        for name in ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "chat_template_kwargs", "tpot_slo_ms", "user"):
            if getattr(self, name) is not None:
                chat[name] = getattr(self, name)
        if self.max_output_tokens is not None:
            chat["max_tokens"] = self.max_output_tokens
        if self.tools:  # without tools, tool_choice is "none" or "auto" (refuse_unsupported): nothing to ask
            chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]
            chat["parallel_tool_calls"] = self.parallel_tool_calls
            choice = self.tool_choice
            if choice is not None:
                chat["tool_choice"] = choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            chat["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.name is None:
                raise ApiError(400, "text.format json_schema needs its name", param="text.format")
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name, "schema": fmt.schema_ or {}, **({"strict": fmt.strict} if fmt.strict is not None else {})}}
        try:
            body = parse_body(ChatCompletionRequest, chat)
            body.structure()  # its 400s, with this request's field names
        except ApiError as exc:
            raise renamed(exc, FIELD_NAMES) from None
        return body

    def settings(self) -> dict:
        """The request's settings as a response object echoes them (OpenAI's defaults where unset)."""
        fmt = self.text.format if self.text is not None and self.text.format is not None else TextFormat(type="text")
        choice = self.tool_choice if self.tool_choice is not None else ("auto" if self.tools else "none")
        return {
            "instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
            "previous_response_id": self.previous_response_id, "parallel_tool_calls": self.parallel_tool_calls,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "tools": [t.model_dump() for t in self.tools or ()],
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)},
            "reasoning": {"effort": None, "summary": None}, "truncation": self.truncation, "store": self.store,
            "metadata": self.metadata or {}, "user": self.user, "background": False, "service_tier": "default"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def _message_item(role: str, parts: list[dict], given_id: str | None) -> dict:
    return {"id": given_id or new_id("msg"), "type": "message", "role": role, "content": parts, "status": "completed"}


class Items:
    """One reply's output items, built as its reader's pieces come: ``push(reasoning, content,
    tool call deltas)`` returns the Responses stream events they make (without ``sequence_number``,
    which the response's stream numbers); :attr:`output` holds the items so far. A new item opens
    when the kind of text changes (reasoning, then content, then calls: a content piece after a
    call opens a second message)."""

    def __init__(self) -> None:
        self.output: list[dict] = []
        self.open: dict | None = None  # the item being written

    def _event(self, kind: str, **fields) -> dict:
        return {"type": f"response.{kind}", **fields}

    def _close(self, status: str) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.output) - 1
        item["status"] = status
        if item["type"] == "function_call":
            return [self._event("function_call_arguments.done", item_id=item["id"], output_index=index,
                                arguments=item["arguments"], name=item["name"]),
                    self._event("output_item.done", output_index=index, item=item)]
        kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
        part = item["content"][0]
        extra = {"logprobs": []} if kind == "output_text" else {}
        return [self._event(f"{kind}.done", item_id=item["id"], output_index=index, content_index=0, text=part["text"], **extra),
                self._event("content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part),
                self._event("output_item.done", output_index=index, item=item)]

    def _start(self, item: dict, part: dict | None) -> list[dict]:
        self.output.append(item)
        self.open = item
        index = len(self.output) - 1
        shown = {**item, "content": []} if part is not None else dict(item)
        events = [self._event("output_item.added", output_index=index, item=shown)]
        if part is not None:
            item["content"] = [part]
            events.append(self._event("content_part.added", item_id=item["id"], output_index=index, content_index=0,
                                      part=dict(part)))
        return events

    def _text(self, kind: str, piece: str) -> list[dict]:
        events: list[dict] = []
        if self.open is None or self.open["type"] != kind:
            events += self._close("completed")
            if kind == "reasoning":
                events += self._start({"type": "reasoning", "id": new_id("rs"), "summary": [], "status": "in_progress"},
                                      {"type": "reasoning_text", "text": ""})
            else:
                events += self._start({"type": "message", "id": new_id("msg"), "status": "in_progress", "role": "assistant"},
                                      {"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        item, index = self.open, len(self.output) - 1
        item["content"][0]["text"] += piece
        name = "reasoning_text.delta" if kind == "reasoning" else "output_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        return events + [self._event(name, item_id=item["id"], output_index=index, content_index=0, delta=piece, **extra)]

    def push(self, reasoning: str, content: str, calls: list[dict]) -> list[dict]:
        events: list[dict] = []
        if reasoning:
            events += self._text("reasoning", reasoning)
        if content:
            events += self._text("message", content)
        for delta in calls:
            function = delta["function"]
            if "id" in delta:  # a new call
                events += self._close("completed")
                events += self._start({"type": "function_call", "id": new_id("fc"), "call_id": delta["id"],
                                       "name": function["name"], "arguments": "", "status": "in_progress"}, None)
            item = self.open
            if function["arguments"]:
                item["arguments"] += function["arguments"]
                events.append(self._event("function_call_arguments.delta", item_id=item["id"],
                                          output_index=len(self.output) - 1, delta=function["arguments"]))
        return events

    def finish(self, status: str) -> list[dict]:
        """Close the item being written: ``status`` "completed", or "incomplete" where the reply
        was cut at ``max_output_tokens``."""
        return self._close(status)


def usage(prompt_tokens: int, output_tokens: int, reasoning_chars: int, text_chars: int) -> dict:
    """OpenAI's Responses usage. ``reasoning_tokens`` is counted by the share of characters the
    reasoning took of the reply's text (the reader splits text, not tokens), rounded."""
    total_chars = reasoning_chars + text_chars
    reasoning = round(output_tokens * reasoning_chars / total_chars) if total_chars else 0
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt_tokens + output_tokens}


def as_messages(output: list[dict]) -> list[dict]:
    """A response's output items as the chat messages a later turn's prompt holds: its text and
    calls as one assistant message (reasoning left out, as the chat templates of reasoning models do)."""
    content = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return [message]


class ResponseWriter:
    """One reply as a Responses response object: its events as the reply's pieces come (each
    numbered as it is framed), and the whole object (:meth:`whole`) at any point."""

    def __init__(self, rid: str, model: str, body: ResponsesRequest, prompt_tokens: int, text: TextStream) -> None:
        self.rid, self.model, self.body, self.prompt_tokens, self.text = rid, model, body, prompt_tokens, text
        self.created, self.items, self.status, self.error = int(time.time()), Items(), "in_progress", None
        self.chars = [0, 0]  # the reply's reasoning and its other text, for usage's reasoning_tokens
        self.sequence = itertools.count()

    def frame(self, event: dict) -> bytes:
        event = {**event, "sequence_number": next(self.sequence)}
        return f"event: {event['type']}\ndata: ".encode() + json.dumps(event).encode() + b"\n\n"

    def whole(self) -> dict:
        counted = None if self.status == "in_progress" else usage(self.prompt_tokens, self.text.consumed, *self.chars)
        return {"id": self.rid, "object": "response", "created_at": self.created, "status": self.status, "error": self.error,
                "incomplete_details": {"reason": "max_output_tokens"} if self.status == "incomplete" else None,
                "model": self.model, "output": self.items.output, "usage": counted, **self.body.settings()}

    def opening(self) -> list[dict]:
        return [{"type": "response.created", "response": self.whole()}, {"type": "response.in_progress", "response": self.whole()}]

    def push(self, reasoning: str, content: str, calls: list[dict]) -> list[dict]:
        self.chars[0] += len(reasoning)
        self.chars[1] += len(content) + sum(len(c["function"]["arguments"]) for c in calls)
        return self.items.push(reasoning, content, calls)

    def finish(self, reason: str) -> list[dict]:
        self.status = "incomplete" if reason == "length" else "completed"
        return self.items.finish(self.status) + [{"type": f"response.{self.status}", "response": self.whole()}]

    def failed(self, exc: ApiError) -> list[dict]:
        self.status, self.error = "failed", {"code": exc.code or exc.type, "message": exc.message}
        return [{"type": "response.failed", "response": self.whole()}]
