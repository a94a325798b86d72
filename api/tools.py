"""Tool calling on chat completions, as OpenAI's ``tools`` / ``tool_choice`` /
``parallel_tool_calls`` and vLLM's serving of them.

What each ``tool_choice`` does:

* **a named function** (``{"type": "function", "function": {"name": ...}}``): the reply is that
  function's arguments, held to its ``parameters`` schema by the structured-output grammar
  (:mod:`goodspeed.lm.decoding.structured`: exact under speculation on every path), returned as one tool
  call; ``finish_reason`` "stop" (OpenAI's for a forced call);
* ``"required"``: the reply is a JSON array of at least one ``{"name", "parameters"}`` object,
  each matching one of the tools (vLLM's schema: ``anyOf`` over the tools, their ``$defs``
  gathered at the top; at most one item with ``parallel_tool_calls: false``) with no other key
  in an item (``additionalProperties: false``, which vLLM's schema leaves out: JSON Schema then
  allows any key, and SmolLM2 went on after its call with a ``"description"`` of its own),
  returned as the tool calls; ``finish_reason`` "tool_calls";
* ``"auto"`` (the default when tools are given): the model decides, and the server's
  ``--tool-call-parser`` reads its calls out of the text: ``hermes`` (Qwen2.5, Qwen3, Hermes:
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks), ``qwen3_coder``
  (Qwen3-Coder, Qwen3.5: ``<tool_call><function=NAME>`` blocks of ``<parameter=KEY>`` values,
  typed by the tool's schema) or ``llama3_json`` (Llama 3.1 / 3.2: a reply that is one or more
  ``{"name": ..., "parameters": {...}}`` objects, separated by ``;``); ``finish_reason``
  "tool_calls" when it called one. A server without a parser, or a model whose chat template
  does not render ``tools`` (it could not know them), refuses it (400) rather than answer as if
  no tools had been given;
* ``"none"``: the tools are rendered into the prompt but no call is read.

Every reader works on the text as it streams (:class:`ToolCalls`): a streamed reply sends
content as soon as it cannot be part of a call, each call the model chose when it is complete,
and a forced call's arguments as they come (a named call's, and each "required" call's once its
name is read); the whole reply is read by the same code, so a response and its stream agree. Text
a reader cannot read as a call (a malformed block, an "auto" reply cut at ``max_tokens``) is
returned as content: nothing the model wrote is dropped but the whitespace between calls.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from goodspeed.api.text import held_back
from goodspeed.lm.decoding.structured import loads_bounded

MAX_TOOLS = 128  # OpenAI's limit
NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for a function's name


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object; none: no arguments
    strict: bool | None = None  # OpenAI's; the arguments always match the schema where a grammar holds them


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(BaseModel):
    """A call in an assistant message of the conversation (its ``arguments``: JSON text)."""

    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str


class ToolCallMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    def for_template(self) -> dict:
        """As chat templates read it (transformers' convention, vLLM's too): ``arguments`` a dict
        when it is a JSON object, else the text as sent."""
        try:
            parsed = loads_bounded(self.function.arguments)
        except ValueError:  # json.JSONDecodeError and JsonTooDeep are
            parsed = None
        arguments = parsed if isinstance(parsed, dict) else self.function.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


NO_ARGUMENTS = {"type": "object", "properties": {}}


def forced_schema(tools: list[Tool], choice: str | NamedToolChoice, parallel: bool = True) -> dict | None:
    """The JSON schema a reply is held to: a named function's ``parameters``; for "required", an
    array of ``{"name", "parameters"}`` objects, one of the tools each (at most one item unless
    ``parallel``), every tool's ``$defs`` moved to the top so its references resolve. None for
    "auto" and "none". ValueError: a named function that is not among the tools, two tools of one
    name, or two tools defining one ``$defs`` name differently."""
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ValueError("two tools share a name")
    if isinstance(choice, NamedToolChoice):
        for tool in tools:
            if tool.function.name == choice.function.name:
                return tool.function.parameters or NO_ARGUMENTS
        raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among the tools")
    if choice != "required":
        return None
    defs: dict[str, Any] = {}
    options = []
    for tool in tools:
        parameters = dict(tool.function.parameters or NO_ARGUMENTS)
        for name, schema in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, schema) != schema:
                raise ValueError(f"two tools define $defs {name!r} differently")
        options.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": parameters},
                        "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": options}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _arguments(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


# ------------------------------------------------------------------------------ readers
# Each reads a reply as it streams: push(text) -> (content, calls), finish() -> (content, calls), a
# call as (name or None, arguments piece): a name opens a new call, None adds to the open one.


class _Named:
    """A named function's reply: the whole text is its arguments, sent as it comes."""

    def __init__(self, name: str) -> None:
        self.name, self.opened = name, False

    def push(self, text: str):
        if not text:
            return "", []
        first, self.opened = not self.opened, True
        return "", [(self.name if first else None, text)]

    def finish(self):
        return "", [] if self.opened else [(self.name, "")]


class _Array:
    """"required"'s reply, ``[{"name": ..., "parameters": {...}}, ...]``, read as it streams: a
    call opens once its name and its ``"parameters":`` key are read (the grammar writes the keys
    in the schema's order, name first), and its arguments go out as they come, the parameters'
    text as the model wrote it, as vLLM streams them. An item with its keys the other way round
    goes out whole when it closes."""

    HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:')
    SPACE = " \t\r\n"

    def __init__(self) -> None:
        self.text, self.at, self.decoder = "", 0, json.JSONDecoder()
        self.state = "between"  # between items, in an item's "head", its parameters' "value", its "tail", or "broken"
        self.depth, self.quoted, self.escaped, self.started = 0, False, False, False

    def _value(self) -> tuple[str, bool]:
        """The parameters' text read from ``at`` on, and whether it ended (its closing bracket, or
        for a value that is not an object or array, the ``,`` or ``}`` after it)."""
        i = start = self.at
        while i < len(self.text):
            c = self.text[i]
            if not self.started:
                if c in self.SPACE:
                    i, start = i + 1, i + 1
                    continue
                self.started = True
            if self.quoted:
                self.escaped, self.quoted = (False, True) if self.escaped else (c == "\\", c != '"')
            elif c == '"':
                self.quoted = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]" or c == ",":
                if self.depth == 0:  # the end of a value that is not an object or array
                    self.at = i
                    return self.text[start:i].rstrip(self.SPACE), True
                if c != ",":
                    self.depth -= 1
                    if self.depth == 0:
                        self.at = i + 1
                        return self.text[start:i + 1], True
            i += 1
        self.at = i
        return self.text[start:i], False

    def push(self, text: str):
        self.text += text
        calls = []
        while True:
            if self.state == "between":
                while self.at < len(self.text) and self.text[self.at] in self.SPACE + "[,]":
                    self.at += 1
                if self.at == len(self.text) or self.text[self.at] != "{":
                    break  # the end so far, or text the grammar allows no item to be: content at the end
                self.state = "head"
            elif self.state == "head":
                head = self.HEAD.match(self.text, self.at)
                if head is not None:
                    calls.append((json.loads(head.group(1)), ""))
                    self.at, self.state, self.depth, self.quoted, self.escaped, self.started = head.end(), "value", 0, False, False, False
                    continue
                try:  # keys in another order: the item whole, once it closes
                    item, end = self.decoder.raw_decode(self.text, self.at)
                except (json.JSONDecodeError, RecursionError):  # the model's text, nested past the decoder
                    break
                if not (isinstance(item, dict) and isinstance(item.get("name"), str) and "parameters" in item):
                    self.state = "broken"
                    break
                calls.append((item["name"], _arguments(item["parameters"])))
                self.at, self.state = end, "between"
            elif self.state == "value":
                piece, ended = self._value()
                if piece:
                    calls.append((None, piece))
                if not ended:
                    break
                self.state = "tail"
            elif self.state == "tail":
                while self.at < len(self.text) and self.text[self.at] in self.SPACE:
                    self.at += 1
                if self.at == len(self.text):
                    break
                if self.text[self.at] != "}":  # a key after the parameters: the grammar allows none
                    self.state = "broken"
                    break
                self.at, self.state = self.at + 1, "between"
            else:
                break
        return "", calls

    def finish(self):
        if self.state in ("value", "tail"):  # cut inside a call: its arguments went out as far as they came
            return "", []
        rest = self.text[self.at:].lstrip(self.SPACE + "[,").rstrip()
        return ("" if rest == "]" else rest), []


class _Hermes:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen2.5, Qwen3, Hermes)."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, tools: list[Tool] = ()) -> None:
        self.buffer, self.inside, self.called, self.pending = "", False, False, ""

    def _content(self, text: str) -> str:
        """Text outside the calls: as it is before the first call; after one, whitespace is held
        until text follows it (dropped if only a call or the end does)."""
        if not self.called:
            return text
        self.pending += text
        if not self.pending.strip():
            return ""
        out, self.pending = self.pending, ""
        return out

    def _call(self, body: str):
        """A block's body as ``(name, arguments)``, or None if it is not a call."""
        try:
            item = loads_bounded(body)
        except ValueError:  # json.JSONDecodeError and JsonTooDeep are
            return None
        if not (isinstance(item, dict) and isinstance(item.get("name"), str)):
            return None
        return item["name"], _arguments(item.get("arguments", item.get("parameters", {})))

    def push(self, text: str):
        self.buffer += text
        content, calls = [], []
        while True:
            if not self.inside:
                k = self.buffer.find(self.START)
                if k < 0:  # keep what could still open a block
                    keep = held_back(self.buffer, self.START)
                    content.append(self._content(self.buffer[:len(self.buffer) - keep]))
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                content.append(self._content(self.buffer[:k]))
                self.buffer, self.inside = self.buffer[k + len(self.START):], True
            k = self.buffer.find(self.END)
            if k < 0:
                break
            body, self.buffer, self.inside = self.buffer[:k], self.buffer[k + len(self.END):], False
            call = self._call(body)
            if call is None:
                content.append(self._content(self.START + body + self.END))
            else:
                calls.append(call)
                self.called, self.pending = True, ""
        return "".join(content), calls

    def finish(self):
        if self.inside:  # a block the reply did not close (cut at max_tokens, or the model's own end)
            call = self._call(self.buffer)
            if call is not None:
                return "", [call]
            text = self.START + self.buffer
        else:
            text = self.buffer
        return self._content(text), []


class _Qwen3Coder(_Hermes):
    """Qwen3-Coder's and Qwen3.5's XML calls, in the same ``<tool_call>`` blocks as hermes:
    ``<function=NAME>`` then ``<parameter=KEY>`` value ``</parameter>`` pairs, ``</function>``.
    A value is text (one newline either side of it is the layout's): it is converted by the type
    its tool's ``parameters`` schema gives the key, as vLLM's ``qwen3_coder`` parser does: a
    string as written, an integer or number parsed, a boolean from ``true``/``false``, an object
    or array (or a key the schema does not type) read as JSON where it is JSON, else kept as text;
    ``null`` is null for any type but a string."""

    FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?$", re.DOTALL)
    PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)

    def __init__(self, tools: list[Tool] = ()) -> None:
        super().__init__(tools)
        self.types = {t.function.name: {k: v.get("type") if isinstance(v, dict) else None
                                        for k, v in ((t.function.parameters or {}).get("properties") or {}).items()}
                      for t in tools}

    @staticmethod
    def _value(text: str, kind) -> Any:
        text = text.removeprefix("\n").removesuffix("\n")
        kinds = set(kind) if isinstance(kind, list) else {kind}
        if "string" in kinds:
            return text
        if text.strip() == "null":
            return None
        try:
            if kinds & {"integer", "number"}:
                try:
                    return int(text.strip())
                except ValueError:
                    number = float(text.strip())
                    return number if math.isfinite(number) else text  # JSON has no NaN or infinity
            if "boolean" in kinds and text.strip().lower() in ("true", "false"):
                return text.strip().lower() == "true"
            return loads_bounded(text)
        except ValueError:  # json.JSONDecodeError and JsonTooDeep are
            return text

    def _call(self, body: str):
        match = self.FUNCTION.fullmatch(body)
        if match is None or "<function=" in match.group(2):
            return None
        name, inner = match.group(1).strip(), match.group(2)
        types = self.types.get(name, {})
        arguments = {key.strip(): self._value(value, types.get(key.strip()))
                     for key, value in self.PARAMETER.findall(inner)}
        if self.PARAMETER.sub("", inner).strip():  # text outside the parameters: not a call
            return None
        return name, json.dumps(arguments, ensure_ascii=False)


class _Llama3Json:
    """Llama 3.1 / 3.2's JSON calls: a reply that opens with ``{`` (or ``<|python_tag|>``) is
    one or more ``{"name": ..., "parameters": {...}}`` objects separated by ``;``."""

    TAG = "<|python_tag|>"

    def __init__(self, tools: list[Tool] = ()) -> None:
        self.buffer, self.mode = "", None  # None: undecided, "content" or "calls"

    def push(self, text: str):
        if self.mode == "content":
            return text, []
        self.buffer += text
        if self.mode == "calls":
            return "", []
        head = self.buffer.lstrip()
        if not head or (self.TAG.startswith(head) and head != self.TAG):
            return "", []  # undecided yet
        if head.startswith("{") or head.startswith(self.TAG):
            self.mode = "calls"
            return "", []
        self.mode, out, self.buffer = "content", self.buffer, ""
        return out, []

    def finish(self):
        if self.mode != "calls":
            out, self.buffer = self.buffer, ""
            return out, []
        text = self.buffer.strip().removeprefix(self.TAG)
        decoder, calls, i = json.JSONDecoder(), [], 0
        while True:
            while i < len(text) and text[i] in " \t\r\n;":
                i += 1
            if i == len(text):
                return "", calls
            try:
                item, i = decoder.raw_decode(text, i)
            except (json.JSONDecodeError, RecursionError):  # the model's text, nested past the decoder
                return self.buffer, []
            if not (isinstance(item, dict) and isinstance(item.get("name"), str)):
                return self.buffer, []
            calls.append((item["name"], _arguments(item.get("parameters", item.get("arguments", {})))))


READERS = {"hermes": _Hermes, "llama3_json": _Llama3Json, "qwen3_coder": _Qwen3Coder}
PARSERS = tuple(READERS)  # the servers' --tool-call-parser
PARSER_HELP = ("how tool calls are read out of a reply the model chose to make (tool_choice auto, the default with "
               "tools): hermes (Qwen2.5/Qwen3, Hermes), qwen3_coder (Qwen3-Coder, Qwen3.5) or llama3_json (Llama 3.1/3.2); "
               "unset: such requests are refused")


class ToolCalls:
    """One choice's reader: its reply's text in, OpenAI's content and ``tool_calls`` deltas out.

    ``mode``: a :class:`NamedToolChoice`, "required", or "auto" with ``parser`` (one of
    :data:`PARSERS`). ``parallel`` False keeps the first call only. ``tools``: the request's (the
    ``qwen3_coder`` reader types a call's values by their schemas). Each call gets an id
    (``chatcmpl-tool-<hex>``, vLLM's form); its first delta holds the id, type and name."""

    def __init__(self, mode: str | NamedToolChoice, parser: str | None = None, parallel: bool = True,
                 tools: list[Tool] = ()) -> None:
        if isinstance(mode, NamedToolChoice):
            self.reader = _Named(mode.function.name)
        elif mode == "required":
            self.reader = _Array()
        elif mode == "auto" and parser in READERS:
            self.reader = READERS[parser](tools)
        else:
            raise ValueError(f"no reader for tool_choice {mode!r} with parser {parser!r}")
        self.parallel, self.count, self.dropped = parallel, 0, False

    def _deltas(self, calls) -> list[dict]:
        out = []
        for name, arguments in calls:
            if name is not None:
                self.count += 1
                self.dropped = self.count > 1 and not self.parallel
                if not self.dropped:
                    out.append({"index": self.count - 1, "id": f"chatcmpl-tool-{secrets.token_hex(16)}", "type": "function",
                                "function": {"name": name, "arguments": arguments}})
            elif not self.dropped:
                out.append({"index": self.count - 1, "function": {"arguments": arguments}})
        return out

    def push(self, text: str) -> tuple[str, list[dict]]:
        """The content to send and the ``tool_calls`` deltas completed by ``text``."""
        content, calls = self.reader.push(text)
        return content, self._deltas(calls)

    def finish(self) -> tuple[str, list[dict]]:
        """What the end of the reply releases (content held back, a call it closes)."""
        content, calls = self.reader.finish()
        return content, self._deltas(calls)

    def finish_reason(self, reason: str) -> str:
        """OpenAI's: "tool_calls" when the model called a tool ("auto") or was made to
        ("required") and stopped; "stop" for a named call; otherwise the reply's own."""
        called = self.count > 0 and not isinstance(self.reader, _Named)
        return "tool_calls" if called and reason == "stop" else reason


def merge(deltas: list[dict]) -> list[dict]:
    """A reply's ``tool_calls`` deltas as the whole calls of a response message."""
    calls: list[dict] = []
    for delta in deltas:
        if "id" in delta:
            calls.append({"id": delta["id"], "type": "function", "function": dict(delta["function"])})
        else:
            calls[delta["index"]]["function"]["arguments"] += delta["function"]["arguments"]
    return calls
