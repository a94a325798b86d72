"""The OpenAI API's request bodies, validated (their refusals: :mod:`goodspeed.api.errors`).

Bodies are parsed by pydantic models that follow the OpenAI reference (and vLLM's extensions
``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``, ``min_tokens``,
``return_token_ids``, ``return_tokens_as_token_ids``, ``prompt_logprobs``, ``allowed_token_ids``, ``bad_words``, the chat
template's options, and structured output: ``structured_outputs`` and the older ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar``, with OpenAI's ``response_format``; chat's
tool calling, :mod:`goodspeed.api.tools`, and ``include_reasoning``, :mod:`goodspeed.api.reasoning`;
ours: ``tpot_slo_ms``, AdaServe's per-request latency SLO). Every refusal is a 4xx with OpenAI's
error object ``{"error": {"message", "type", "param", "code"}}``:

* a body that is not JSON, has a wrong type, an out-of-range value or an unknown field: 400;
* a feature this server does not implement (``best_of``, ``suffix``): 400 naming the field,
  never a silent fallback; a structured output constraint that does not compile, more than one
  (a forced tool call is one), or one with ``ignore_eos``, ``min_tokens``, ``allowed_token_ids`` or
  ``bad_words``: 400; tools that cannot be served as asked (:mod:`goodspeed.api.tools`): 400; more
  than :data:`~goodspeed.lm.decoding.params.MAX_TOP_LOGPROBS` top log-probabilities: 400;
* more than :data:`MAX_CHOICES` choices (prompts times ``n``) in one request: 400;
* an unknown ``model``: 404 ``model_not_found``; a prompt (plus ``max_tokens``) past the context:
  400 ``context_length_exceeded``; a full queue: 429.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from goodspeed.api.errors import ApiError
from goodspeed.api.tools import MAX_TOOLS, NamedToolChoice, Tool, ToolCallMessage, forced_schema
from goodspeed.lm.decoding.params import MAX_BAD_WORDS, MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_TOKENS, MAX_PENALTY, MAX_TOP_LOGPROBS, MIN_TEMPERATURE, SamplingParams
from goodspeed.lm.decoding.structured import Structure, StructureError

MAX_STOP_STRINGS = 4  # as OpenAI's API
MAX_CHOICES = 128  # prompts x n in one request (OpenAI caps n at 128); each choice is a request of its own
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_BAD_WORD_CHARS = 256


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: one constraint the text must match (:mod:`goodspeed.lm.decoding.structured`)."""

    model_config = ConfigDict(extra="forbid")
    json_: str | dict | bool | None = Field(default=None, alias="json")  # a JSON schema
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark, or llama.cpp's GBNF
    json_object: bool | None = None  # any JSON object
    # JSON without whitespace between its tokens: the default (None) as True; False allows any
    disable_any_whitespace: bool | None = None


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON matching a schema."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


def _spec(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


class _Sampling(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid", strict=False)

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0  # vLLM's extension; -1 and 0 are off
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0  # vLLM's extension; 0 is off
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1  # choices per prompt, each a request of its own
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None  # vLLM's
    # vLLM's: the text may not end (EOS, stop_token_ids, stop strings) before this many tokens; at most max_tokens
    min_tokens: Annotated[int, Field(ge=0)] = 0
    tpot_slo_ms: Annotated[float, Field(gt=0)] | None = None  # AdaServe's per-request SLO (an edge node: with --admission slo)
    user: str | None = None  # accepted for logs, as OpenAI's
    presence_penalty: Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 1.0  # vLLM's extension; 1 is off
    # token id (as a string, OpenAI's JSON) -> bias added to its logit
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]],
                          Field(max_length=MAX_LOGIT_BIAS_TOKENS)] | None = None
    best_of: int | None = None  # refused unless 1 (see :meth:`refuse_unsupported`)
    # vLLM's extensions for clients that work in tokens (RL rollouts, agents): the prompt's and the
    # completion's token ids in the response; log-probabilities' tokens as "token_id:<id>"
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    # vLLM's: a stop string, and the stop token (EOS, stop_token_ids) that ended the text, in the text
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # vLLM's: special tokens' text left out of the completion
    # vLLM's: each prompt token's log-probability and rank, and this many most probable tokens at its
    # position, in the response (a completion choice's; chat's once); not with stream, as vLLM's
    prompt_logprobs: int | None = None
    # vLLM's: a prompt longer than this many tokens keeps only its last ones (truncation_side "right":
    # its first ones); -1: the model's context
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] = "left"
    # vLLM's: only these tokens may be sampled (every other one gets a logit of -inf); at least one
    allowed_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | None = None
    # vLLM's: these words may not be generated (each tokenized as it stands and after a space; the
    # last token of a tokenization gets -inf where the output ends with the rest of it)
    bad_words: Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_BAD_WORD_CHARS)]],
                         Field(max_length=MAX_BAD_WORDS)] | None = None
    # Structured output, one of: vLLM's structured_outputs, its older guided_* fields, OpenAI's response_format
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    response_format: ResponseFormat | None = None
    STRUCTURE_FIELDS: ClassVar[tuple[str, ...]] = ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
                                                   "guided_grammar", "response_format")

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float) -> float:
        if 0 < value < MIN_TEMPERATURE:
            raise ValueError(f"must be 0 (greedy) or >= {MIN_TEMPERATURE:g}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop strings must hold 1 to {MAX_STOP_CHARS} characters")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value):
        for key in value or {}:
            if not (key.isascii() and key.isdigit()) or int(key) >= 2**31:  # "-1", " 1", "1.0" are not token ids
                raise ValueError(f"keys are token ids (integers in [0, 2^31) as strings), got {key[:32]!r}")
        return value

    def refuse_unsupported(self) -> None:
        """400 for features this server does not implement, naming the field."""
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options needs stream = true", param="stream_options")
        if self.best_of not in (None, 1):
            raise ApiError(400, "best_of is not supported by this server", param="best_of")
        if self.truncate_prompt_tokens == 0:
            raise ApiError(400, "truncate_prompt_tokens keeps at least 1 token (-1: the model's context)",
                           param="truncate_prompt_tokens")
        if self.prompt_logprobs is not None:
            if self.prompt_logprobs == -1:
                raise ApiError(400, f"prompt_logprobs = -1 (the whole vocabulary) is not served: at most {MAX_TOP_LOGPROBS}",
                               param="prompt_logprobs")
            if not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
                raise ApiError(400, f"prompt_logprobs must lie in [0, {MAX_TOP_LOGPROBS}]", param="prompt_logprobs")
            if self.stream:
                raise ApiError(400, "prompt_logprobs is not available with stream = true (as vLLM's)", param="prompt_logprobs")

    def asked_structures(self) -> list[tuple[str, Structure]]:
        """Every structured output constraint the body asks for, with the field that asks (unbound)."""
        asked: list[tuple[str, Structure]] = []
        so = self.structured_outputs
        if so is not None:
            whitespace = so.disable_any_whitespace is False
            given = [(k, v) for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                         ("grammar", so.grammar)) if v is not None]
            given += [("json_object", "")] if so.json_object else []
            asked += [(f"structured_outputs.{k}", Structure(k, "" if k == "json_object" else _spec(v), whitespace))
                      for k, v in given]
            if not given:
                raise ApiError(400, "structured_outputs names no constraint (json, regex, choice, grammar or json_object)",
                               param="structured_outputs")
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                asked.append((name, Structure(kind, _spec(value))))
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asked.append(("response_format", Structure("json_object")))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise ApiError(400, "response_format json_schema needs its json_schema", param="response_format")
            asked.append(("response_format", Structure("json", json.dumps(rf.json_schema.schema_ or {}))))
        return asked

    def structure(self) -> Structure | None:
        """The text's constraint (unbound: the server compiles it against its tokenizer), or None;
        400 for more than one, or for settings it cannot be combined with."""
        try:
            asked = self.asked_structures()
        except StructureError as exc:
            raise ApiError(400, str(exc), param=self.structure_field()) from None
        if len(asked) > 1:
            raise ApiError(400, f"one structured output constraint at a time: got {', '.join(n for n, _ in asked)}",
                           param=asked[1][0])
        if not asked:
            return None
        name, structure = asked[0]
        for conflict, on in (("ignore_eos", self.ignore_eos), ("min_tokens", self.min_tokens),
                             ("allowed_token_ids", self.allowed_token_ids), ("bad_words", self.bad_words)):
            if on:  # the grammar ends a complete text with EOS; either could leave no token to sample
                raise ApiError(400, f"{conflict} cannot be combined with structured output ({name})", param=conflict)
        return structure

    def structure_field(self) -> str:
        for name in self.STRUCTURE_FIELDS:
            if getattr(self, name) is not None:
                return name
        return "structured_outputs"

    def truncated(self, prompt_ids: list[int], context: int) -> list[int]:
        """vLLM's ``truncate_prompt_tokens``: the prompt's last (``truncation_side`` "right": first)
        ``truncate_prompt_tokens`` tokens (-1: ``context``), or the whole prompt when it is shorter."""
        keep = context if self.truncate_prompt_tokens == -1 else self.truncate_prompt_tokens
        if keep is None or len(prompt_ids) <= keep:
            return prompt_ids
        return prompt_ids[-keep:] if self.truncation_side == "left" else prompt_ids[:keep]

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling(self, structured: Structure | None = None, bad_words: tuple = ()) -> SamplingParams:
        """The request's sampling settings; ``structured``: its constraint, bound (:meth:`structure`);
        ``bad_words``: its bad words' token sequences (the server tokenizes them)."""
        bias = {}
        for key, value in (self.logit_bias or {}).items():  # "7" and "007" name one token: the later one wins
            bias[int(key)] = value
        return SamplingParams(temperature=self.temperature, top_k=max(0, self.top_k), top_p=self.top_p, min_p=self.min_p,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              repetition_penalty=self.repetition_penalty, logit_bias=tuple(sorted(bias.items())),
                              min_tokens=self.min_tokens, allowed_token_ids=tuple(sorted(set(self.allowed_token_ids or ()))),
                              structured=structured, bad_words=bad_words)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``continuous_usage_stats`` (with ``include_usage``): every chunk's usage so far."""
        return self.include_usage and self.stream_options.continuous_usage_stats


def _one_or_many(prompt) -> list:
    """A completion request's prompts: one string, one token-id list, or a list of either."""
    return [prompt] if isinstance(prompt, str) or (prompt and not isinstance(prompt[0], (str, list))) else list(prompt)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]  # one prompt, or a batch of them (choice order)
    max_tokens: Annotated[int, Field(ge=0)] | None = None  # 0: the prompt alone (with echo), as OpenAI's legacy scoring
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None  # top ones besides each token's own
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's extension: the tokenizer's special tokens (e.g. BOS) around a text prompt

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value):
        """One message for any other shape (pydantic's would name one member of the union)."""
        def ids(x):
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if not (isinstance(value, str) or ids(value) or (isinstance(value, list) and (
                all(isinstance(p, str) for p in value) or all(ids(p) for p in value)))):
            raise ValueError("must be a string, a list of token ids, or a list of strings or of token-id lists")
        return value

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("no prompt: give a string, a list of token ids, or a list of either")
        for prompt in _one_or_many(value):
            if isinstance(prompt, list) and (not prompt or any(t < 0 for t in prompt)):
                raise ValueError("a token-id prompt holds at least one id, each >= 0")
            if isinstance(prompt, str) and not prompt:
                raise ValueError("the prompt is empty")
        return value

    @property
    def requested_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def requested_prompt_logprobs(self) -> int | None:
        """How many top tokens the prompt's scores need: ``echo`` with ``logprobs`` scores the
        prompt's tokens too (vLLM does the same), and so does ``prompt_logprobs``; the larger count."""
        asked = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        return max(asked) if asked else None

    @property
    def prompts(self) -> list[str | list[int]]:
        """Every prompt of the request, in order (one unless a batch was sent)."""
        return _one_or_many(self.prompt)

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if len(self.prompts) * self.n > MAX_CHOICES:
            raise ApiError(400, f"{len(self.prompts)} prompts x n = {self.n} asks for more than {MAX_CHOICES} choices "
                                "in one request", param="prompt" if self.n == 1 else "n")
        if self.suffix:
            raise ApiError(400, "suffix is not supported by this server", param="suffix")
        if self.max_tokens == 0 and not self.echo:
            raise ApiError(400, "max_tokens = 0 asks for no completion: it needs echo (the prompt, with logprobs "
                                "its tokens' log-probabilities)", param="max_tokens")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None: only an assistant message that calls tools
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant message's calls
    tool_call_id: str | None = None  # a tool message's: the call it answers

    @model_validator(mode="after")
    def _shape(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message holds tool_calls")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("a tool message needs the tool_call_id it answers, and only a tool message has one")
        if self.content is None and not self.tool_calls:
            raise ValueError("content is required (it may be null only in an assistant message with tool_calls)")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def turn(self) -> dict:
        """The message as a chat template reads it (``developer`` as ``system``)."""
        turn = {"role": self.role if self.role != "developer" else "system", "content": self.text()}
        if self.tool_calls:
            turn["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            turn["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            turn["name"] = self.name
        return turn


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # OpenAI's tool calling (api.tools): the functions the model may call, and whether it must
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: "auto" with tools
    parallel_tool_calls: bool = True  # False: one call at most
    include_reasoning: bool = True  # vLLM's: with a reasoning parser, the reply's reasoning in the response (api.reasoning)
    add_special_tokens: bool = False  # vLLM's extension: off, as the chat template holds them
    # vLLM's extensions: how the chat template renders the messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # more variables the template reads (Qwen3's enable_thinking)
    # vLLM's: the reply starts with the last message's text when that message has the reply's role
    # (an assistant message the model continues, or any last message without add_generation_prompt)
    echo: bool = False

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_shape(cls, value):
        """One message for any other value (pydantic's would name one member of the union)."""
        if value is None or value in ("none", "auto", "required") or isinstance(value, dict):
            return value
        raise ValueError('must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')

    @property
    def tool_mode(self) -> str | NamedToolChoice:
        """What the tools ask: "none" (no tools, or tool_choice "none"), "auto", "required" or a named function."""
        if not self.tools:
            return "none"
        return "auto" if self.tool_choice is None else self.tool_choice

    def asked_structures(self) -> list[tuple[str, Structure]]:
        asked = super().asked_structures()
        if self.tools:
            try:
                schema = forced_schema(self.tools, self.tool_mode, self.parallel_tool_calls)
            except ValueError as exc:
                raise ApiError(400, str(exc), param="tool_choice" if "tool_choice" in str(exc) else "tools") from None
            if schema is not None:  # a forced call: its arguments' schema, compiled as any other
                asked.append(("tools", Structure("json", json.dumps(schema))))
        return asked

    def structure_field(self) -> str:
        return "tools" if self.tool_mode not in ("none", "auto") else super().structure_field()

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        refuse_render_conflict(self)
        if self.tools is not None and not self.tools:
            raise ApiError(400, "tools must not be empty: give at least one, or leave the field out", param="tools")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ApiError(400, f"tool_choice {self.tool_choice if isinstance(self.tool_choice, str) else 'naming a function'} "
                                "needs tools", param="tool_choice")
        if self.max_tokens is not None and self.max_completion_tokens is not None and self.max_tokens != self.max_completion_tokens:
            raise ApiError(400, "max_tokens and max_completion_tokens disagree", param="max_completion_tokens")
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs = true", param="top_logprobs")

    @property
    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs  # chat has no echo

    @property
    def echoed(self) -> str:
        """vLLM's chat ``echo``: the text the reply starts with, the last message's where it has the
        reply's role (the assistant's, or the last message's own without add_generation_prompt)."""
        last = self.messages[-1]
        return last.text() if self.echo and (not self.add_generation_prompt or last.role == "assistant") else ""

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def refuse_render_conflict(body) -> None:
    """A chat rendered open for the model's reply and continuing its last message at once: 400."""
    if body.add_generation_prompt and body.continue_final_message:
        raise ApiError(400, "add_generation_prompt and continue_final_message cannot both be true (set "
                            "add_generation_prompt to false to continue the final message)", param="continue_final_message")
