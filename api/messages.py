"""Anthropic's Messages API (``POST /v1/messages``), served by the chat completion path.

For the clients written against Anthropic's SDK (coding agents among them) that are pointed at
a self-hosted model, as vLLM serves them. A request is read as the chat completion it stands for
(:meth:`MessagesRequest.to_chat`): ``system`` is a system message; a message's ``text`` blocks
are its content, an assistant's ``tool_use`` blocks its tool calls, a user's ``tool_result``
blocks tool messages (before the user's own text), ``thinking`` blocks given back are left out (as
reasoning models' templates drop earlier reasoning); ``tools`` (``name``, ``description``,
``input_schema``) are chat's function tools and ``tool_choice`` ``auto`` / ``any`` / ``tool`` /
``none`` is chat's "auto" / "required" / a named function / "none", ``disable_parallel_tool_use``
its ``parallel_tool_calls: false``; ``stop_sequences`` are stop strings; ``output_config.format``
(a JSON schema) is ``response_format``, held by the structured-output grammar; ``temperature``,
``top_p`` and ``top_k``, which Anthropic's current SDK no longer sends but older clients do, are
taken as chat takes them. So the output is the target's on every path, as every other endpoint's.

The reply is Anthropic's content blocks (:class:`MessageWriter`): a ``thinking`` block (the
reasoning parser's reasoning), ``text`` blocks and a ``tool_use`` block per call (its ``input`` the
call's arguments as an object), with ``stop_reason`` ``end_turn``, ``max_tokens``,
``stop_sequence`` (and the ``stop_sequence`` matched) or ``tool_use``. Streamed, it is Anthropic's
event sequence: ``message_start``, per block ``content_block_start``, its ``content_block_delta``
events (``text_delta``, ``thinking_delta``, ``input_json_delta``) and ``content_block_stop``, then
``message_delta`` (the stop reason and the output tokens) and ``message_stop``; a failure after
the headers is an ``error`` event. A tool call is sent when it is complete (its arguments as one
``input_json_delta``), so a call whose arguments do not parse as an object (a reply cut at
``max_tokens``) comes back as text, whole or streamed alike. Refusals are Anthropic's error
object, ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from goodspeed.api.errors import ApiError, parse_body, renamed
from goodspeed.api.protocol import MAX_STOP_STRINGS, ChatCompletionRequest
from goodspeed.api.responses import new_id
from goodspeed.api.text import TextStream
from goodspeed.api.tools import MAX_TOOLS, NAME_PATTERN
from goodspeed.lm.decoding.structured import loads_bounded

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
# chat completion fields a Messages request names otherwise
FIELD_NAMES = {"stop": "stop_sequences", "response_format": "output_config.format"}


def error_body(exc: ApiError) -> dict:
    """An :class:`ApiError` as Anthropic's error object."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(exc.status, "api_error"), "message": exc.message}}


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str
    cache_control: dict | None = None  # accepted: this server caches no prompt on request
    citations: list | None = None


class ToolUseBlock(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["tool_use"]
    id: str
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    input: dict[str, Any]
    cache_control: dict | None = None


class ToolResultBlock(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: dict | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


class ThinkingBlock(BaseModel):
    """Reasoning given back (``thinking`` or ``redacted_thinking``): accepted, left out of the prompt."""

    model_config = ConfigDict(extra="allow")
    type: Literal["thinking", "redacted_thinking"]


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]
Content = Annotated[Annotated[str, Tag("text")] | Annotated[list[Block], Tag("blocks")],
                    Discriminator(lambda value: "text" if isinstance(value, str) else "blocks")]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: Content


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict | None = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)]
    system: str | list[TextBlock] | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None  # Anthropic's range
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    metadata: dict[str, Any] | None = None  # Anthropic's user_id: accepted, as OpenAI's user
    thinking: dict[str, Any] | None = None  # refused unless absent or disabled (refuse_unsupported)
    output_config: OutputConfig | None = None  # format: structured output, held by the grammar; effort: refused
    cache_control: dict | None = None  # accepted: this server caches no prompt on request
    service_tier: str | None = None  # accepted; there is one tier
    # vLLM's extensions, as on chat completions
    seed: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tpot_slo_ms: float | None = None

    def refuse_unsupported(self) -> None:
        if self.thinking is not None and self.thinking.get("type") != "disabled":
            raise ApiError(400, "thinking budgets are not served: a reasoning model's reasoning comes back whole as a "
                                "thinking block (start the server with --reasoning-parser); turn Qwen3's off with "
                                'chat_template_kwargs {"enable_thinking": false}', param="thinking")
        if self.output_config is not None and self.output_config.effort is not None:
            raise ApiError(400, "output_config.effort is not served: the model's reasoning is its own (start the server "
                                "with --reasoning-parser to have it as a thinking block)", param="output_config.effort")
        if self.tool_choice is not None and self.tool_choice.type == "tool" and not self.tool_choice.name:
            raise ApiError(400, "tool_choice of type tool needs the tool's name", param="tool_choice")
        if self.tool_choice is not None and self.tool_choice.type in ("any", "tool") and not self.tools:
            raise ApiError(400, f"tool_choice {self.tool_choice.type} needs tools", param="tool_choice")
        if self.stop_sequences is not None and len(self.stop_sequences) > MAX_STOP_STRINGS:
            raise ApiError(400, f"at most {MAX_STOP_STRINGS} stop_sequences are served", param="stop_sequences")

    def chat_messages(self) -> list[dict]:
        """The conversation as chat messages."""
        out: list[dict] = []
        if self.system is not None:
            system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system)
            out.append({"role": "system", "content": system})
        for message in self.messages:
            if isinstance(message.content, str):
                out.append({"role": message.role, "content": message.content})
                continue
            text = "".join(b.text for b in message.content if isinstance(b, TextBlock))
            if message.role == "assistant":
                calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                         for b in message.content if isinstance(b, ToolUseBlock)]
                turn: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
                if calls:
                    turn["tool_calls"] = calls
                out.append(turn)
                continue
            for block in message.content:
                if isinstance(block, ToolUseBlock):
                    raise ApiError(400, "tool_use blocks belong to assistant messages", param="messages")
                if isinstance(block, ToolResultBlock):
                    out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                "content": ("Error: " if block.is_error else "") + block.text()})
            if text or not any(isinstance(b, ToolResultBlock) for b in message.content):
                out.append({"role": "user", "content": text})
        return out

    def to_chat(self) -> ChatCompletionRequest:
        """The chat completion this request stands for; 400 with this request's field names."""
        chat: dict[str, Any] = {"model": self.model, "messages": self.chat_messages(), "stream": self.stream,
                                "max_tokens": self.max_tokens}
        for name in ("temperature", "top_p", "top_k", "seed", "chat_template_kwargs", "tpot_slo_ms"):
            if getattr(self, name) is not None:
                chat[name] = getattr(self, name)
        if self.stop_sequences:
            chat["stop"] = self.stop_sequences
        if self.output_config is not None and self.output_config.format is not None:
            chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                               "schema": self.output_config.format.schema_}}
        choice = self.tool_choice
        if self.tools:
            chat["tools"] = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                                               **({"description": t.description} if t.description else {})}}
                             for t in self.tools]
            if choice is not None:
                chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
                    {"type": "function", "function": {"name": choice.name}}
                chat["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        try:
            body = parse_body(ChatCompletionRequest, chat)
            body.structure()
        except ApiError as exc:
            raise renamed(exc, FIELD_NAMES) from None
        return body


class MessageWriter:
    """One reply as Anthropic's message: ``push(reasoning, content, tool call deltas)`` returns the
    stream events it makes; :meth:`whole` is the message so far. A new block opens when the kind
    of text changes; a tool call is held until it is complete (the next call, other text, or the
    end), then sent as a ``tool_use`` block, or as text if its arguments are not an object."""

    def __init__(self, rid: str, model: str, prompt_tokens: int, text: TextStream) -> None:
        self.rid, self.model, self.prompt_tokens, self.text = rid, model, prompt_tokens, text
        self.blocks: list[dict] = []
        self.open: dict | None = None  # the text or thinking block being written
        self.call: dict | None = None  # the tool call being read: {"id", "name", "arguments"}
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None

    @staticmethod
    def frame(event: dict) -> bytes:
        return f"event: {event['type']}\ndata: ".encode() + json.dumps(event).encode() + b"\n\n"

    def _usage(self) -> dict:
        return {"input_tokens": self.prompt_tokens, "output_tokens": self.text.consumed}

    def whole(self) -> dict:
        return {"id": self.rid, "type": "message", "role": "assistant", "model": self.model, "content": self.blocks,
                "stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence, "usage": self._usage()}

    def opening(self) -> list[dict]:
        return [{"type": "message_start", "message": {**self.whole(), "content": [],
                                                      "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}}}]

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def _start(self, block: dict, shown: dict) -> list[dict]:
        self.blocks.append(block)
        return [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": shown}]

    def _text(self, kind: str, piece: str) -> list[dict]:
        events: list[dict] = []
        if self.open is None or self.open["type"] != kind:
            events += self._close()
            empty = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text", "text": ""}
            events += self._start(dict(empty), empty)
            self.open = self.blocks[-1]
        field = "thinking" if kind == "thinking" else "text"
        self.open[field] += piece
        delta = {"type": "thinking_delta", "thinking": piece} if kind == "thinking" else {"type": "text_delta", "text": piece}
        return events + [{"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}]

    def _flush_call(self) -> list[dict]:
        call, self.call = self.call, None
        if call is None:
            return []
        try:
            arguments = loads_bounded(call["arguments"] or "{}")
        except ValueError:  # json.JSONDecodeError and JsonTooDeep are
            arguments = None
        if not isinstance(arguments, dict):  # cut before its arguments closed: the text as written
            return self._text("text", call["arguments"])
        events = self._close()
        events += self._start({"type": "tool_use", "id": call["id"], "name": call["name"], "input": arguments},
                              {"type": "tool_use", "id": call["id"], "name": call["name"], "input": {}})
        index = len(self.blocks) - 1
        return events + [{"type": "content_block_delta", "index": index,
                          "delta": {"type": "input_json_delta", "partial_json": json.dumps(arguments)}},
                         {"type": "content_block_stop", "index": index}]

    def push(self, reasoning: str, content: str, calls: list[dict]) -> list[dict]:
        events: list[dict] = []
        if reasoning:
            events += self._flush_call() + self._text("thinking", reasoning)
        if content:
            events += self._flush_call() + self._text("text", content)
        for delta in calls:
            if "id" in delta:
                events += self._flush_call()
                self.call = {"id": delta["id"], "name": delta["function"]["name"], "arguments": ""}
            self.call["arguments"] += delta["function"]["arguments"]
        return events

    def finish(self, reason: str) -> list[dict]:
        events = self._flush_call() + self._close()
        if reason == "length":
            self.stop_reason = "max_tokens"
        elif self.text.matched is not None:
            self.stop_reason, self.stop_sequence = "stop_sequence", self.text.matched
        elif any(b["type"] == "tool_use" for b in self.blocks):
            self.stop_reason = "tool_use"
        else:
            self.stop_reason = "end_turn"
        return events + [{"type": "message_delta", "delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
                          "usage": {"output_tokens": self.text.consumed}},
                         {"type": "message_stop"}]

    def failed(self, exc: ApiError) -> list[dict]:
        return [error_body(exc)]


def message_id() -> str:
    return new_id("msg")
