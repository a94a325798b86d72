"""OpenAI-compatible HTTP endpoints over any generation backend, on aiohttp.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (streaming as server-sent events —
``data: {chunk}`` lines, then ``data: [DONE]`` — with ``stream_options.include_usage``, or one
JSON body), ``POST /v1/responses`` (OpenAI's Responses API, read as the chat completion it stands
for: :mod:`goodspeed.api.responses`) with ``GET`` / ``DELETE /v1/responses/{id}`` and
``GET /v1/responses/{id}/input_items``, Anthropic's ``POST /v1/messages`` and ``/v1/messages/count_tokens`` (read the same way: :mod:`goodspeed.api.messages`),
``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (Prometheus text); and
vLLM's ``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``, which tokenize as the
completions do (a text prompt with the tokenizer's special tokens unless ``add_special_tokens`` is
false, vLLM's default; a chat through its template).

aiohttp runs on the process's asyncio loop, the one ``grpc.aio`` already uses on the verifier
and on an edge node: one event loop serves both protocols, with no extra threads. Handlers are
cancelled when their client disconnects, and a cancelled stream closes its backend stream, which
frees the request on the verifier at once.

A batch of prompts or ``n > 1`` asks for several choices: each is a backend request of its own,
all are admitted together (one refused: the whole request refused, the others cancelled), and their
pieces are merged into one response or one event stream, each event naming its choice.

``logprobs`` (chat: ``logprobs`` / ``top_logprobs``): the backend's deltas carry each token's
:class:`~goodspeed.lm.sampling.TokenLogprob` (the target's, read off the verifying step's logits),
formatted here as OpenAI's objects, trimmed with the text at a stop string. Completions' ``echo``
starts each choice's text with its prompt (streamed: the choice's first event); with ``logprobs``
the prompt's tokens come first in the log-probabilities, scored by the target's prefill of that
prompt (the first token's entries are null: it follows nothing), as the scoring clients (e.g.
lm-evaluation-harness's loglikelihood) read them; ``max_tokens = 0`` with ``echo`` answers the
prompt alone (OpenAI's legacy scoring call). Stop strings and ``usage`` count the completion
only.

A backend (:class:`Backend`) is the verifier's local serving batch
(:mod:`goodspeed.verifier.http_front`) or an edge node's session pool
(:mod:`goodspeed.drafter.node`); this module knows neither.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import importlib.metadata
import inspect
import itertools
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

import jinja2
import jinja2.meta
import jinja2.sandbox
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from goodspeed.serving.aio import keep_until_done, run_to_the_end
from goodspeed.api.protocol import (ApiError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeChatRequest,
                                    TokenizeCompletionRequest, parse_body, renamed)
from goodspeed.api import messages as anthropic_messages
from goodspeed.api import responses as openai_responses
from goodspeed.api.messages import MessagesRequest, MessageWriter, message_id
from goodspeed.api.messages import error_body as anthropic_error
from goodspeed.api.responses import ResponsesRequest, ResponseStore, ResponseWriter, as_messages
from goodspeed.api.text import TextStream
from goodspeed.api.reasoning import PARSERS as REASONING_PARSERS
from goodspeed.api.reasoning import Reasoning, closes_reasoning
from goodspeed.api.reasoning import end_token as reasoning_end
from goodspeed.api.tools import PARSERS, ToolCalls, merge
from goodspeed.lm.sampling import TokenLogprob
from goodspeed.lm.seeding import ROOT_SEED_BITS, stream_seed
from goodspeed.lm.structured import StructureError
from goodspeed.serving.generation import Delta, GenerationRequest, RequestError, StopStringMatched

try:
    _VERSION = importlib.metadata.version("goodspeed")
except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
    _VERSION = "unknown"
MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
INLINE_CHARS = 8192  # prompts up to this long are tokenized on the event loop (about 1 ms at most)
MAX_CHARS_PER_TOKEN = 64  # no tokenizer packs more characters per token: longer text cannot fit the context


class Backend(Protocol):
    model_ids: Sequence[str]  # names the ``model`` field may take; the first is listed by /v1/models
    tokenizer: object
    max_model_len: int

    def ready(self) -> bool: ...

    async def open(self, request: GenerationRequest, identity: str) -> AsyncIterator[Delta]:
        """Admit the request (raising :class:`~goodspeed.serving.generation.RequestError` if refused) and return its delta stream;
        closing the stream (``aclose``) before its last delta cancels the request, and frees it
        even when the closing is cancelled again meanwhile (:func:`run_to_the_end`). A stream that
        :class:`StopStringMatched` is thrown into cancels it too, as finished by a stop string."""
        ...


# Variables a chat template gets from the server, never from a request's chat_template_kwargs
# (with the tokenizer's special tokens, which transformers passes too).
RENDER_SET = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                        "raise_exception", "strftime_now"})


@functools.lru_cache(maxsize=8)
def template_variables(template: str) -> frozenset[str]:
    """The variables a Jinja chat template reads that it does not set itself."""
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment()
    return frozenset(jinja2.meta.find_undeclared_variables(environment.parse(template)))


def bad_word_ids(tokenizer, words) -> tuple[tuple[int, ...], ...]:
    """vLLM's tokenization of ``bad_words``: each word (leading whitespace stripped) as it stands,
    and after a space where that starts with another token and holds as many (so the word is
    banned at the start of the text and inside it). 400 for a word that is no token at all."""
    out = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise ApiError(400, f"bad word {word[:32]!r} holds no token", param="bad_words")
        out.append(tuple(plain))
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(tuple(spaced))
    return tuple(out)


def _raise_failure(delta: Delta) -> None:
    """A last delta that ended in failure, as the client's error."""
    if delta.error is not None:
        raise ApiError.of(delta.error)
    if delta.finish_reason not in ("eos", "length"):
        raise ApiError(500, f"generation failed: {delta.finish_reason}")


def _finish_reason(stream: TextStream, reason: str | None) -> str:
    return "stop" if stream.stopped or reason == "eos" else "length"


def check_parsers(tool_parser: str | None, reasoning_parser: str | None) -> None:
    """ValueError for a tool-call or reasoning parser this server does not have (None: none)."""
    for what, name, known in (("tool_call_parser", tool_parser, PARSERS),
                              ("reasoning_parser", reasoning_parser, REASONING_PARSERS)):
        if name is not None and name not in known:
            raise ValueError(f"{what} must be one of {', '.join(known)}, got {name!r}")


class _Reply:
    """One chat choice's text read as OpenAI's message parts: its reasoning (``thinking``, a
    reasoning parser's reader), its content and its tool calls (``tools``), in that order."""

    def __init__(self, thinking: Reasoning | None, tools: ToolCalls | None) -> None:
        self.thinking, self.tools = thinking, tools

    def push(self, text: str, final: bool = False) -> tuple[str, str, list[dict]]:
        """``(reasoning, content, tool_calls deltas)`` that ``text`` lets out; ``final``: the
        reply's last piece, after which what the readers hold comes out."""
        reasoning = ""
        if self.thinking is not None:
            reasoning, text = self.thinking.push(text)
            if final:
                more, rest = self.thinking.finish()
                reasoning, text = reasoning + more, text + rest
        calls: list[dict] = []
        if self.tools is not None:
            text, calls = self.tools.push(text)
            if final:
                rest, last = self.tools.finish()
                text, calls = text + rest, calls + last
        return reasoning, text, calls

    def finish_reason(self, reason: str) -> str:
        return reason if self.tools is None else self.tools.finish_reason(reason)


class OpenAIServer:
    def __init__(self, backend: Backend, registry: CollectorRegistry,
                 authorize: Callable[[str | None], str] | None = None, tool_parser: str | None = None,
                 reasoning_parser: str | None = None) -> None:
        """``authorize(authorization header) -> identity`` raises :class:`ApiError` (401), or a
        :class:`~goodspeed.serving.generation.RequestError` of kind ``unauthorized``, for a
        caller it refuses; None: everyone is ``anonymous``. ``tool_parser``: how a reply's tool
        calls are read where the model chooses (``tool_choice`` "auto"; :data:`~goodspeed.api.tools.PARSERS`);
        None: such requests are refused. ``reasoning_parser``: how a chat reply's reasoning is
        told from its content (:mod:`goodspeed.api.reasoning`); None: it is all content."""
        check_parsers(tool_parser, reasoning_parser)
        self.backend, self.registry, self.authorize = backend, registry, authorize
        self.tool_parser, self.reasoning_parser = tool_parser, reasoning_parser
        self._runner: web.AppRunner | None = None
        self.stored = ResponseStore()  # the Responses API's stored responses (api.responses)
        # responses' backend cleanups that run after the response went out (_close), which stop() waits for
        self._cleanups: set[asyncio.Task] = set()

    # ---------------------------------------------------------------------------- app

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._errors])
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)  # an id may hold "/" (org/name)
        app.router.add_get("/version", self.version)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_get("/v1/responses/{response_id}", self.get_response)
        app.router.add_get("/v1/responses/{response_id}/input_items", self.response_input_items)
        app.router.add_delete("/v1/responses/{response_id}", self.delete_response)
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/messages/count_tokens", self.count_message_tokens)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/tokenizer_info", self.tokenizer_info)
        return app

    async def start(self, host: str, port: int, ssl_context=None) -> int:
        """Listen on ``host:port`` (0: any free port) on the running loop; returns the port."""
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port, ssl_context=ssl_context).start()
        return int(self._runner.addresses[-1][1])

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        await asyncio.gather(*self._cleanups, return_exceptions=True)

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        """Every refusal as OpenAI's error object, aiohttp's own (404 path, 405, 413) included."""
        try:
            return await handler(request)
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)
        except RequestError as exc:  # an authorizer's or backend's, by kind
            error = ApiError.of(exc)
            return web.json_response(error.body(), status=error.status)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return web.json_response(ApiError(exc.status, exc.reason).body(), status=exc.status)

    # ------------------------------------------------------------------------ routes

    async def health(self, request: web.Request) -> web.Response:
        if not self.backend.ready():
            return web.json_response(ApiError(503, "not serving").body(), status=503)
        return web.Response(text="")

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _model_object(self) -> dict:
        return {"id": self.backend.model_ids[0], "object": "model", "created": 0, "owned_by": "goodspeed",
                "max_model_len": self.backend.max_model_len}

    async def models(self, request: web.Request) -> web.Response:
        self._identify(request)
        return web.json_response({"object": "list", "data": [self._model_object()]})

    async def model(self, request: web.Request) -> web.Response:
        """OpenAI's ``GET /v1/models/{model}`` (``client.models.retrieve``): the model, by any name
        the ``model`` field takes; else 404 ``model_not_found``."""
        self._identify(request)
        self._check_model(request.match_info["model"])
        return web.json_response(self._model_object())

    async def version(self, request: web.Request) -> web.Response:
        """vLLM's ``GET /version``: this server's version (no API key needed, as ``/health``)."""
        return web.json_response({"version": _VERSION})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        identity = self._identify(request)
        body = parse_body(CompletionRequest, await self._json(request))
        self._check_model(body.model)
        cut = body.truncate_prompt_tokens is not None
        whole = [list(p) if isinstance(p, list) else await self._tokenize(p, body.add_special_tokens, must_fit=not cut)
                 for p in body.prompts]
        prompts = [body.truncated(ids, self.backend.max_model_len) for ids in whole]
        # max_tokens = 0 (with echo): the prompt alone, served as a one-token request (its first
        # verdict, its last, brings the prompt's scores); its token is not returned
        limit = DEFAULT_COMPLETION_TOKENS if body.max_tokens is None else max(body.max_tokens, 1)
        rid, gens = self._generations("cmpl", body, prompts, limit, await self._bind(body, body.structure()))
        echoes = None
        if body.echo:  # each choice's text starts with its prompt's: as sent, or a token-id prompt's decode
            decode = functools.partial(self.backend.tokenizer.decode, skip_special_tokens=False)
            # a truncated prompt (truncate_prompt_tokens) echoes what was kept of it
            echoes = [p if isinstance(p, str) and len(kept) == len(ids) else decode(kept)
                      for p, kept, ids in zip(body.prompts, prompts, whole) for _ in range(body.n)]
        if body.stream:
            return await self._stream(request, identity, rid, gens, body, chat=False, echoes=echoes)
        return await self._complete(identity, rid, gens, body, chat=False, echoes=echoes)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        identity = self._identify(request)
        body = parse_body(ChatCompletionRequest, await self._json(request))
        self._check_model(body.model)
        rid, gens, replies = await self._chat_generations("chatcmpl", body)
        echoes = [body.echoed] * len(gens) if body.echoed else None  # vLLM's echo
        if body.stream:
            return await self._stream(request, identity, rid, gens, body, chat=True, echoes=echoes, replies=replies)
        return await self._complete(identity, rid, gens, body, chat=True, echoes=echoes, replies=replies)

    async def _chat_generations(self, kind: str, body: ChatCompletionRequest, read: bool = False):
        """A chat request's id, backend requests (one per choice) and each choice's reader of its
        reasoning and tool calls (None where neither the request nor the server asks for one, unless
        ``read``: the Responses API reads every reply into items)."""
        self._check_tools(body)
        rendered = await self._render_chat(body)
        prompt_ids = body.truncated(await self._tokenize(rendered, body.add_special_tokens,
                                                         must_fit=body.truncate_prompt_tokens is None), self.backend.max_model_len)
        limit = body.token_limit or max(1, self.backend.max_model_len - len(prompt_ids))
        structure = body.structure()
        if structure is not None and self.reasoning_parser is not None and not closes_reasoning(rendered):
            # a reasoning model's grammar waits for its reasoning to end (api.reasoning)
            after = reasoning_end(self.backend.tokenizer)
            if after is None:
                raise ApiError(400, "this prompt leaves the model's reasoning open and the tokenizer has no </think> token "
                                    "to start the grammar at: the reasoning would be held to it too; give a prompt that "
                                    'closes it (Qwen3: chat_template_kwargs {"enable_thinking": false})',
                               param=body.structure_field())
            structure = dataclasses.replace(structure, after=after)
        rid, gens = self._generations(kind, body, [prompt_ids], limit, await self._bind(body, structure))
        replies = None
        if read or body.tool_mode != "none" or self.reasoning_parser is not None:
            replies = [_Reply(None if self.reasoning_parser is None else Reasoning(self.reasoning_parser, rendered),
                              None if body.tool_mode == "none" else ToolCalls(body.tool_mode, self.tool_parser,
                                                                               body.parallel_tool_calls, body.tools)) for _ in gens]
        return rid, gens, replies

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's ``POST /v1/responses`` (:mod:`goodspeed.api.responses`): the chat completion
        the request stands for, its reply as output items, whole or as the Responses events."""
        identity = self._identify(request)
        body = parse_body(ResponsesRequest, await self._json(request))
        self._check_model(body.model)
        history: list[dict] = []
        if body.previous_response_id is not None:
            previous, conversation = self.stored.get(identity, body.previous_response_id, param="previous_response_id")
            history = conversation + as_messages(previous["output"])
        chat = body.to_chat(history)
        try:
            rid, gens, replies = await self._chat_generations("resp", chat, read=True)
        except ApiError as exc:
            raise renamed(exc, openai_responses.FIELD_NAMES) from None
        text = self._text_stream(chat, gens[0])
        writer = ResponseWriter(rid, self.backend.model_ids[0], body, len(gens[0].prompt_ids), text)
        response, ended = await self._translated(request, identity, gens, text, replies[0], writer, body.stream)
        if body.store and ended:  # what a later turn continues (instructions are not carried)
            self.stored.put(identity, writer.whole(), history + body.messages(), body.input_items())
        return response

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """Anthropic's ``POST /v1/messages`` (:mod:`goodspeed.api.messages`): the chat completion
        the request stands for, its reply as content blocks, whole or as Anthropic's events;
        refusals in Anthropic's error object."""
        try:
            identity = self._identify(request, anthropic=True)
            body = parse_body(MessagesRequest, await self._json(request))
            self._check_model(body.model)
            chat = body.to_chat()
            try:
                _, gens, replies = await self._chat_generations("msg", chat, read=True)
            except ApiError as exc:
                raise renamed(exc, anthropic_messages.FIELD_NAMES) from None
            text = self._text_stream(chat, gens[0])
            writer = MessageWriter(message_id(), self.backend.model_ids[0], len(gens[0].prompt_ids), text)
            return (await self._translated(request, identity, gens, text, replies[0], writer, body.stream))[0]
        except ApiError as exc:
            return web.json_response(anthropic_error(exc), status=exc.status)

    async def count_message_tokens(self, request: web.Request) -> web.Response:
        """Anthropic's ``POST /v1/messages/count_tokens``: the prompt tokens a message request's
        conversation and tools make, rendered as :meth:`messages` renders them."""
        try:
            self._identify(request, anthropic=True)
            raw = await self._json(request)
            if isinstance(raw, dict):
                raw = {"max_tokens": 1, **raw}  # count_tokens takes no max_tokens
            body = parse_body(MessagesRequest, raw)
            self._check_model(body.model)
            chat = body.to_chat()
            ids = await self._tokenize(await self._render_chat(chat), chat.add_special_tokens)
            return web.json_response({"input_tokens": len(ids)})
        except ApiError as exc:
            return web.json_response(anthropic_error(exc), status=exc.status)

    async def _translated(self, request: web.Request, identity: str, gens: list[GenerationRequest], text: TextStream,
                          reply: _Reply, writer, stream: bool) -> tuple[web.StreamResponse, bool]:
        """One chat choice's reply through ``writer`` (the Responses or the Messages API's: its
        ``opening``, ``push``, ``finish`` and ``failed`` events, framed by its ``frame``, and its
        ``whole`` body): streamed as those events, or whole. Returns the response and whether the
        reply ended (not failed)."""
        streams = await self._open_all(gens, identity)  # a refusal (queue full, ...) raises its 4xx here
        runs = self._choices(streams, [text], None)
        response, running, failed = None, True, False

        async def send(events: list[dict]) -> None:
            for event in events:
                await response.write(writer.frame(event))

        try:
            if stream:
                response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                await response.prepare(request)
                await send(writer.opening())
            try:
                async for _, piece, reason, _, _ in runs:
                    events = writer.push(*reply.push(piece, final=reason is not None))
                    if reason is not None:
                        events += writer.finish(reply.finish_reason(reason))
                        running = False
                    if stream:
                        await send(events)
                    if not running:
                        break
                if running:
                    raise ApiError(502, "the generation ended without a finish reason")
            except ApiError as exc:  # a failure after the headers went out: said in the stream
                if not stream:
                    raise
                failed = True
                await send(writer.failed(exc))
        finally:
            await self._close(runs, streams, detach=not running)
        if not stream:
            return web.json_response(writer.whole()), True
        await response.write_eof()
        return response, not failed

    async def get_response(self, request: web.Request) -> web.Response:
        """OpenAI's ``GET /v1/responses/{id}``: a stored response, to its owner (else 404)."""
        identity = self._identify(request)
        whole, _ = self.stored.get(identity, request.match_info["response_id"])
        return web.json_response(whole)

    async def response_input_items(self, request: web.Request) -> web.Response:
        """OpenAI's ``GET /v1/responses/{id}/input_items``: a page of a stored response's own input
        items (:func:`goodspeed.api.responses.page_of_items`), to its owner (else 404)."""
        identity = self._identify(request)
        items = self.stored.input_items(identity, request.match_info["response_id"])
        return web.json_response(openai_responses.page_of_items(items, request.query))

    async def delete_response(self, request: web.Request) -> web.Response:
        """OpenAI's ``DELETE /v1/responses/{id}``: forget a stored response (its owner's; else 404)."""
        identity = self._identify(request)
        response_id = request.match_info["response_id"]
        self.stored.delete(identity, response_id)
        return web.json_response({"id": response_id, "object": "response", "deleted": True})

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /tokenize``: a prompt's token ids (``prompt``, as completions tokenize it)
        or a chat's (``messages``, rendered as chat completions render them), with their count and
        the context length; ``return_token_strs`` adds each token's string."""
        self._identify(request)
        raw = await self._json(request)
        chat = isinstance(raw, dict) and "messages" in raw
        body = parse_body(TokenizeChatRequest if chat else TokenizeCompletionRequest, raw)
        if body.model is not None:
            self._check_model(body.model)
        text = await self._render_chat(body) if chat else body.prompt
        ids = await self._tokenize(text, body.add_special_tokens)
        strs = self.backend.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return web.json_response({"count": len(ids), "max_model_len": self.backend.max_model_len, "tokens": ids,
                                  "token_strs": strs})

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /detokenize``: token ids to text (special tokens kept, as vLLM's)."""
        self._identify(request)
        body = parse_body(DetokenizeRequest, await self._json(request))
        if body.model is not None:
            self._check_model(body.model)
        vocab = len(self.backend.tokenizer)
        if body.tokens and max(body.tokens) >= vocab:
            raise ApiError(400, f"token ids must lie in [0, {vocab}) (the tokenizer's vocabulary)", param="tokens")
        decode = functools.partial(self.backend.tokenizer.decode, body.tokens, skip_special_tokens=False)
        return web.json_response({"prompt": await asyncio.to_thread(decode) if len(body.tokens) > INLINE_CHARS else decode()})

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        """vLLM's ``GET /tokenizer_info``: the tokenizer's class, special tokens, chat template
        and the context length, what a client needs to tokenize as this server does (e.g.
        lm-evaluation-harness's remote tokenizer, which looks for this and ``/tokenize``)."""
        self._identify(request)
        tokenizer = self.backend.tokenizer
        return web.json_response({
            "tokenizer_class": type(tokenizer).__name__, "eos_token": tokenizer.eos_token, "bos_token": tokenizer.bos_token,
            "pad_token": tokenizer.pad_token, "unk_token": tokenizer.unk_token,
            "chat_template": getattr(tokenizer, "chat_template", None), "model_max_length": self.backend.max_model_len,
            "vocab_size": len(tokenizer)})

    # ---------------------------------------------------------------------- helpers

    async def _render_chat(self, body) -> str:
        """A chat request's ``messages`` rendered by the tokenizer's chat template (on a worker
        thread when long), with its ``add_generation_prompt``, ``continue_final_message`` and
        ``chat_template_kwargs``; 400 for a model without a template, and for a keyword the
        template does not read or that the server sets itself."""
        tokenizer = self.backend.tokenizer
        template = getattr(tokenizer, "chat_template", None)
        if template is None:
            raise ApiError(400, f"model {self.backend.model_ids[0]!r} has no chat template: use /v1/completions",
                           param="messages")
        extra = body.chat_template_kwargs or {}
        if extra:
            readable = (template_variables(template) - RENDER_SET - set(tokenizer.special_tokens_map)
                        - set(inspect.signature(tokenizer.apply_chat_template).parameters))  # tokenize=, return_dict=, ...
            for key in extra:
                if key not in readable:
                    raise ApiError(400, f"chat_template_kwargs.{key}: this model's chat template does not read it (it reads "
                                        f"{', '.join(sorted(readable)) or 'none'})", param="chat_template_kwargs")
        turns = [m.turn() for m in body.messages]
        tools = {"tools": [t.model_dump(exclude_none=True) for t in body.tools]} if body.tools else {}
        render = functools.partial(tokenizer.apply_chat_template, turns, tokenize=False,
                                   add_generation_prompt=body.add_generation_prompt,
                                   continue_final_message=body.continue_final_message, **tools, **extra)
        try:
            return await asyncio.to_thread(render) if sum(len(t["content"]) for t in turns) > INLINE_CHARS else render()
        except (ValueError, jinja2.TemplateError) as exc:  # e.g. the template's own raise_exception
            raise ApiError(400, f"the chat template refused these messages: {exc}", param="messages") from None

    def _check_tools(self, body: ChatCompletionRequest) -> None:
        """400 for a reply whose tool calls could not be read (``tool_choice`` "auto" without
        ``tool_parser``) or that could not call them (a chat template that does not render ``tools``)."""
        if body.tool_mode != "auto":
            return
        if self.tool_parser is None:
            raise ApiError(400, 'tool_choice "auto" (the default with tools) needs a server started with --tool-call-parser; '
                                'name a function in tool_choice or give "required" to have the reply be a call',
                           param="tool_choice")
        template = getattr(self.backend.tokenizer, "chat_template", None)
        if template is not None and "tools" not in template_variables(template):
            raise ApiError(400, f"model {self.backend.model_ids[0]!r}'s chat template does not render tools, so the model "
                                'could not know them: name a function in tool_choice or give "required"', param="tools")

    def _identify(self, request: web.Request, anthropic: bool = False) -> str:
        """The caller's identity from its API key: the bearer token (OpenAI's clients), or for
        Anthropic's API, the ``x-api-key`` header where no bearer token is given (its SDK's way)."""
        if self.authorize is None:
            return "anonymous"
        header = request.headers.get("Authorization")
        if header is None and anthropic and "x-api-key" in request.headers:
            header = f"Bearer {request.headers['x-api-key']}"
        try:
            return self.authorize(header)
        except RequestError as exc:
            raise ApiError.of(exc) from None

    async def _tokenize(self, text: str, add_special_tokens: bool, must_fit: bool = True) -> list[int]:
        """Token ids of ``text`` (with the tokenizer's special tokens, e.g. BOS, where asked):
        inline when short (a thread hop costs more than a short prompt's tokenization), on a worker
        thread when long, never stalling the event loop for long. Text too long to fit the context
        at any tokenization is refused before any CPU is spent on it (unless it need not fit: a
        prompt ``truncate_prompt_tokens`` cuts; the body's size bounds it then)."""
        if must_fit and len(text) > MAX_CHARS_PER_TOKEN * self.backend.max_model_len:
            raise ApiError(400, f"a prompt of {len(text)} characters cannot fit this model's context of "
                                f"{self.backend.max_model_len} tokens", code="context_length_exceeded")
        if len(text) <= INLINE_CHARS:
            return list(self.backend.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
        encoded = await asyncio.to_thread(self.backend.tokenizer, text, add_special_tokens=add_special_tokens)
        return list(encoded["input_ids"])

    @staticmethod
    async def _json(request: web.Request):
        try:
            return json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}") from None

    def _check_model(self, name: str) -> None:
        if name not in self.backend.model_ids:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {self.backend.model_ids[0]!r}",
                           param="model", code="model_not_found")

    async def _bind(self, body, structure):
        """``structure`` (the request's constraint, :meth:`structure`, or None) compiled against the
        tokenizer (off the event loop: a vocabulary is indexed once, ~1 s, and a large grammar
        compiles slowly); 400 naming ``body``'s field if it does not compile."""
        if structure is None:
            return None
        try:
            return await asyncio.to_thread(structure.bound, self.backend.tokenizer)
        except StructureError as exc:
            raise ApiError(400, str(exc), param=body.structure_field()) from None

    def _generations(self, kind: str, body, prompts: list[list[int]], max_tokens: int,
                     structured=None) -> tuple[str, list[GenerationRequest]]:
        """The response's id and one backend request per choice: ``body.n`` for each prompt, choice
        ``i * n + j`` the ``j``-th of prompt ``i`` (OpenAI's order). A choice's request id is the
        response's, suffixed with the choice's index when there are several. Choice ``j > 0`` of a seeded request draws from
        the seed's stream ``("choice", j)``, so its samples are its own and as reproducible."""
        limit, n = self.backend.max_model_len, body.n
        for i, prompt_ids in enumerate(prompts):
            if len(prompt_ids) >= limit or len(prompt_ids) + max_tokens > limit:
                which = f"prompt {i} holds" if len(prompts) > 1 else "the prompt holds"
                raise ApiError(400, f"this model's context is {limit} tokens; {which} {len(prompt_ids)} and "
                                    f"{max_tokens} more were asked for", param="prompt" if kind == "cmpl" else "messages",
                               code="context_length_exceeded")
        asked = body.max_tokens if body.max_tokens is not None else max_tokens
        if body.min_tokens > asked:  # vLLM's rule
            raise ApiError(400, f"min_tokens ({body.min_tokens}) must be at most max_tokens ({asked})", param="min_tokens")
        eos = self.backend.tokenizer.eos_token_id
        # vLLM's stop_token_ids end the text like EOS (counted as a token; its text left out: api.text)
        stops = tuple(dict.fromkeys(([] if body.ignore_eos or eos is None else [int(eos)]) + list(body.stop_token_ids or ())))
        try:
            sampling = body.sampling(structured, bad_word_ids(self.backend.tokenizer, body.bad_words or ())).ending_with(stops)
        except ValueError as exc:  # a bad word past MAX_BAD_WORD_TOKENS tokens
            raise ApiError(400, str(exc), param="bad_words") from None
        if sampling.nothing_allowed:
            raise ApiError(400, "min_tokens or bad_words hold back every one of allowed_token_ids: no token could be sampled",
                           param="allowed_token_ids")
        base, many = f"{kind}-{secrets.token_hex(12)}", len(prompts) * n > 1
        return base, [GenerationRequest(
            request_id=f"{base}-{i * n + j}" if many else base, prompt_ids=prompt_ids, max_tokens=max_tokens,
            sampling=sampling, eos_token_ids=stops,
            seed=body.seed if body.seed is None or j == 0 else stream_seed(body.seed, "choice", str(j)) % (1 << ROOT_SEED_BITS),
            tpot_slo_ms=body.tpot_slo_ms, logprobs=body.requested_logprobs,
            prompt_logprobs=body.requested_prompt_logprobs) for i, prompt_ids in enumerate(prompts) for j in range(n)]

    def _logprobs(self, logprobs: list, chat: bool, offset: int, as_ids: bool = False) -> dict:
        """A choice's (or a chunk's) ``logprobs`` object: chat's ``{"content": [{token, logprob,
        bytes, top_logprobs}]}``, or completions' ``{tokens, token_logprobs, top_logprobs,
        text_offset}`` (each token's text from ``offset``; ``top_logprobs`` maps text to
        log-probability and includes the chosen token, as vLLM's). A token's text is its own decode,
        or with ``as_ids`` (vLLM's ``return_tokens_as_token_ids``) ``"token_id:<id>"``.
        An echoed prompt's first token follows nothing: its ``logprob`` is None, and so is its entry
        in ``token_logprobs`` and ``top_logprobs`` (OpenAI's and vLLM's shape)."""
        text_of = functools.partial(self.backend.tokenizer.decode, skip_special_tokens=False)

        def decode(ids: list[int]) -> str:
            return f"token_id:{ids[0]}" if as_ids else text_of(ids)

        if chat:
            def entry(token_id: int, logprob: float) -> dict:
                text = decode([token_id])
                return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

            return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                                for lp in logprobs]}
        tokens = [decode([lp.token_id]) for lp in logprobs]
        offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=offset)) if tokens else []
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
                "top_logprobs": [None if lp.logprob is None else {**{decode([t]): v for t, v in lp.top}, text: lp.logprob}
                                 for text, lp in zip(tokens, logprobs)],
                "text_offset": offsets}

    @staticmethod
    def _echoed(gen: GenerationRequest, scores: list | None, top: int | None) -> list:
        """The log-probabilities an echoed prompt's tokens open a choice's with: none for its first
        token (it follows nothing), then ``scores`` (the backend's, one per later prompt token) with
        the ``top`` most probable tokens each (the scores may hold more, for ``prompt_logprobs``);
        ``[]`` where the prompt is not scored (``scores`` or ``top`` None: no echo, or no ``logprobs``)."""
        if scores is None or top is None:
            return []
        return [TokenLogprob(gen.prompt_ids[0], None, None)] + [dataclasses.replace(lp, top=lp.top[:top]) for lp in scores]

    def _prompt_logprobs(self, scores: list, top: int) -> list:
        """vLLM's ``prompt_logprobs``: null for the prompt's first token (it follows nothing), then
        for each later one a map from token id to ``{logprob, rank, decoded_token}`` holding the
        prompt's token and the ``top`` most probable tokens at its position (ranked 1 to ``top``),
        in that order, as vLLM's (a prompt token among the top ones is one entry)."""
        decode = functools.partial(self.backend.tokenizer.decode, skip_special_tokens=False)
        names: dict[int, str] = {}  # a long prompt's entries repeat tokens: each is decoded once

        def entry(token_id: int, logprob: float, rank: int) -> dict:
            if token_id not in names:
                names[token_id] = decode([token_id])
            return {"logprob": logprob, "rank": rank, "decoded_token": names[token_id]}

        out: list = [None]
        for lp in scores:
            if lp.rank is None:
                raise ApiError(502, "the verifier sent prompt log-probabilities without their ranks (is it older than this node?)")
            out.append({lp.token_id: entry(lp.token_id, lp.logprob, lp.rank),
                        **{t: entry(t, v, r) for r, (t, v) in enumerate(lp.top[:top], start=1)}})
        return out

    def _text_stream(self, body, gen: GenerationRequest) -> TextStream:
        eos = self.backend.tokenizer.eos_token_id
        return TextStream(self.backend.tokenizer, body.stop_strings, skip_special_tokens=body.skip_special_tokens,
                          include_stop=body.include_stop_str_in_output, stop_token_ids=gen.eos_token_ids,
                          min_tokens=body.min_tokens, eos_token_id=None if body.ignore_eos or eos is None else int(eos))

    def _envelope(self, rid: str, chat: bool, created: int) -> dict:
        return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": self.backend.model_ids[0]}

    @staticmethod
    def _usage(gens: list[GenerationRequest], n: int, texts: list[TextStream]) -> dict:
        """Each prompt's tokens once (whatever ``n``), every choice's completion tokens."""
        prompt = sum(len(g.prompt_ids) for g in gens[::n])
        completion = sum(t.consumed for t in texts)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def _open_all(self, gens: list[GenerationRequest], identity: str) -> list:
        """Every choice's backend stream, or none. The choices are admitted concurrently (on an edge
        node a choice may wait for a session, which an earlier choice of the same request frees);
        a refusal (queue full, ...) raises its 4xx after cancelling the others' admissions and
        closing the streams already opened, which cancels their requests."""
        if len(gens) == 1:
            return [await self._open(gens[0], identity)]
        tasks = [asyncio.ensure_future(self._open(gen, identity)) for gen in gens]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in tasks:
                if task.done() and task.exception() is not None:
                    raise task.exception()
            return [task.result() for task in tasks]
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._close_all([t.result() for t in tasks if not t.cancelled() and t.exception() is None])
            raise

    async def _open(self, gen: GenerationRequest, identity: str):
        try:
            return await self.backend.open(gen, identity)
        except RequestError as exc:
            raise ApiError.of(exc) from None

    @staticmethod
    async def _close_all(streams: list) -> None:
        for deltas in streams:
            await deltas.aclose()

    @staticmethod
    async def _pieces(deltas, text: TextStream, logprobs: list | None, prompt: list | None = None, prompt_only: bool = False):
        """Yield ``(new text, finish_reason or None, log-probabilities, token ids)`` from an opened
        backend stream until the end: the ids of the tokens consumed since the last yield (a stop
        string ends consumption; text held back still has its tokens here), and with ``logprobs``
        (a list this fills with every token's :class:`TokenLogprob`) theirs, else None. ``prompt``: a list
        this fills with the prompt tokens' log-probabilities (after the first), which the first
        delta brings. ``prompt_only`` (completions' ``max_tokens = 0``): end with ``length`` when the
        (one-token) request has finished, none of its tokens consumed. The backend stream is always
        closed, which cancels the request if it did not finish: after a stop string, by throwing
        :class:`StopStringMatched` into it once the last piece has gone out."""
        sent, scored, cut = 0, False, False

        def new() -> tuple[list | None, list[int]]:
            nonlocal sent
            out = None if logprobs is None else logprobs[sent : text.consumed]
            ids, sent = text.consumed_ids[sent:], text.consumed
            return out, ids

        try:
            async for delta in deltas:
                if prompt is not None and not scored and delta.token_ids:  # the first verdict's (a failure has none)
                    if delta.prompt_logprobs is None:
                        raise ApiError(502, "the verifier sent no prompt log-probabilities though the request asked for "
                                            "them (is it older than this node?)")
                    prompt.extend(delta.prompt_logprobs)
                    scored = True
                if prompt_only:  # the one token the request generates is not the answer: wait for its end
                    if delta.finished:
                        _raise_failure(delta)
                        if prompt is not None and not scored:
                            raise ApiError(502, "the verifier sent no prompt log-probabilities though the request asked for them")
                        yield "", "length", None if logprobs is None else [], []
                        return
                    continue
                if logprobs is not None and delta.token_ids:
                    if delta.logprobs is None or len(delta.logprobs) != len(delta.token_ids):
                        raise ApiError(502, "the verifier sent tokens without the log-probabilities asked for "
                                            "(is it older than this node?)")
                    logprobs.extend(delta.logprobs)
                # inline: a step's few tokens decode in a window of a few tokens (microseconds)
                piece = text.push(delta.token_ids) if delta.token_ids else ""
                if text.stopped:
                    cut = not delta.finished
                    yield piece, "stop", *new()
                    return
                if delta.finished:
                    _raise_failure(delta)
                    yield piece + text.finish(), _finish_reason(text, delta.finish_reason), *new()
                    return
                if piece:
                    yield piece, None, *new()
        finally:
            if cut:  # after the last piece went out: tell the backend why its request ends early
                with contextlib.suppress(StopStringMatched, StopAsyncIteration):
                    await deltas.athrow(StopStringMatched())
            await deltas.aclose()

    async def _choices(self, streams: list, texts: list[TextStream], logprobs: list[list] | None,
                       prompts: list[list] | None = None, prompt_only: bool = False):
        """Yield ``(choice index, new text, finish_reason or None, log-probabilities or None, token ids)`` from
        every choice's stream as its pieces come (:meth:`_pieces`; ``logprobs[i]``: choice ``i``'s
        list to fill, or None when not asked for; ``prompts[i]`` likewise for its prompt's
        log-probabilities, filled before its first piece; ``prompt_only`` as :meth:`_pieces`). A
        choice that fails raises here; closing this generator (the callers do, in a ``finally``)
        stops every choice's task, and each task's :meth:`_pieces` closes its stream."""
        if len(streams) == 1:
            async with contextlib.aclosing(self._pieces(streams[0], texts[0], logprobs and logprobs[0],
                                                        prompts and prompts[0], prompt_only)) as runs:
                async for piece, reason, lps, ids in runs:
                    yield 0, piece, reason, lps, ids
            return
        queue: asyncio.Queue = asyncio.Queue()
        end = object()

        async def pump(i: int) -> None:
            try:
                async with contextlib.aclosing(self._pieces(streams[i], texts[i], logprobs and logprobs[i],
                                                            prompts and prompts[i], prompt_only)) as runs:
                    async for piece, reason, lps, ids in runs:
                        queue.put_nowait((i, piece, reason, lps, ids))
                queue.put_nowait((i, end, None, None, None))
            except Exception as exc:  # said by the consumer; a cancelled pump has nothing to say
                queue.put_nowait((i, exc, None, None, None))

        tasks = [asyncio.ensure_future(pump(i)) for i in range(len(streams))]
        try:
            running = len(tasks)
            while running:
                i, piece, reason, lps, ids = await queue.get()
                if piece is end:
                    running -= 1
                elif isinstance(piece, Exception):
                    raise piece
                else:
                    yield i, piece, reason, lps, ids
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _complete(self, identity: str, rid: str, gens: list[GenerationRequest], body, chat: bool,
                        echoes: list[str] | None = None, replies: list[_Reply] | None = None) -> web.Response:
        """The whole response at once; ``echoes[i]``: the text choice ``i`` starts with (completions'
        ``echo``: its prompt, whose tokens' log-probabilities come first where asked for; chat's:
        the last message's); ``replies[i]``: the reader of chat choice ``i``'s reasoning and tool
        calls, where the request or the server asks for either."""
        texts = [self._text_stream(body, gen) for gen in gens]
        pieces: list[list[str]] = [[] for _ in gens]
        reasons: list[str | None] = [None] * len(gens)
        received = None if gens[0].logprobs is None else [[] for _ in gens]
        scored = None if gens[0].prompt_logprobs is None else [[] for _ in gens]
        kept: list[list] = [[] for _ in gens]
        kept_ids: list[list[int]] = [[] for _ in gens]
        streams = await self._open_all(gens, identity)  # a refusal (queue full, ...) raises its 4xx here
        # max_tokens = 0 is completions' scoring call (chat's max_tokens is >= 1)
        runs = self._choices(streams, texts, received, scored, prompt_only=body.max_tokens == 0)
        running = len(gens)  # choices not ended yet
        try:
            async for i, piece, reason, lps, ids in runs:
                pieces[i].append(piece)
                reasons[i] = reason
                kept[i] += lps or []
                kept_ids[i] += ids
                running -= reason is not None
                if not running:  # every choice has ended: the rest is the backends' cleanup
                    break
        finally:
            await self._close(runs, streams, detach=not running)
        messages = [{"role": "assistant", "content": (echoes[i] if echoes else "") + "".join(p)} for i, p in enumerate(pieces)]
        if replies is not None:  # the reply read by the code a stream's is
            for i, (message, reply) in enumerate(zip(messages, replies)):
                reasoning, content, calls = reply.push("".join(pieces[i]), final=True)
                text = (echoes[i] if echoes else "") + content
                message["content"] = text if text or not (calls or reasoning) else None
                if reasoning and body.include_reasoning:
                    message["reasoning_content"] = message["reasoning"] = reasoning
                if calls:
                    message["tool_calls"] = merge(calls)
                reasons[i] = reply.finish_reason(reasons[i])
        contents = [m["content"] for m in messages]
        echoed = None if chat or echoes is None or scored is None else body.logprobs  # completions' echo with logprobs
        logprobs = [None if received is None else self._logprobs(self._echoed(gens[i], scored and scored[i], echoed) + kept[i],
                                                                 chat, 0, body.return_tokens_as_token_ids)
                    for i in range(len(gens))]
        choices = [{"index": i, "message": messages[i], "logprobs": lp, "finish_reason": r, "stop_reason": t.stop_reason}
                   if chat else {"index": i, "text": c, "logprobs": lp, "finish_reason": r, "stop_reason": t.stop_reason}
                   for i, (c, r, lp, t) in enumerate(zip(contents, reasons, logprobs, texts))]
        extra = {}
        if body.prompt_logprobs is not None:  # vLLM's: a completion choice's own, chat's once (one prompt)
            if chat:
                extra["prompt_logprobs"] = self._prompt_logprobs(scored[0], body.prompt_logprobs)
            else:
                for i, choice in enumerate(choices):
                    choice["prompt_logprobs"] = self._prompt_logprobs(scored[i], body.prompt_logprobs)
        if body.return_token_ids:  # vLLM's: chat's prompt once (one prompt), a completion choice's its own
            for i, choice in enumerate(choices):
                choice.update({} if chat else {"prompt_token_ids": gens[i].prompt_ids}, token_ids=kept_ids[i])
            if chat:
                extra["prompt_token_ids"] = gens[0].prompt_ids
        return web.json_response({
            "id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": self.backend.model_ids[0], "choices": choices,
            "usage": self._usage(gens, body.n, texts), **extra})

    async def _stream(self, request: web.Request, identity: str, rid: str, gens: list[GenerationRequest], body,
                      chat: bool, echoes: list[str] | None = None, replies: list[_Reply] | None = None) -> web.StreamResponse:
        """Admit every choice (a refusal is still a plain 4xx), send the headers at once (so the
        first token's chunk is all that is left on its path), then one event per new text of a
        choice, which the event's ``index`` names. With ``echoes`` (completions' ``echo``), a
        choice's first event is its prompt text (and its tokens' log-probabilities, where asked for);
        chat's echo follows each choice's role event. With ``replies`` (chat's readers, as
        :meth:`_complete`), a choice's text goes through its reader: the reasoning and content it
        lets out, and ``tool_calls`` deltas as its calls complete."""
        texts = [self._text_stream(body, gen) for gen in gens]
        received = None if gens[0].logprobs is None else [[] for _ in gens]
        scored = None if gens[0].prompt_logprobs is None else [[] for _ in gens]
        offsets = [0] * len(gens)  # completions' text_offset: characters of each choice's tokens so far
        streams = await self._open_all(gens, identity)
        runs = self._choices(streams, texts, received, scored, prompt_only=body.max_tokens == 0)
        envelope = self._envelope(rid, chat, int(time.time()))
        usage = {"usage": None} if body.include_usage else {}

        def chunk(i: int, piece: str, reason: str | None, lps: list | None = None, role: bool = False,
                  ids: list[int] = (), prompt: bool = False, calls: list[dict] = (), reasoning: str = "") -> dict:
            """Choice ``i``'s event; with ``return_token_ids`` its ``token_ids`` (``ids``) and, in the
            first event (``prompt``), the prompt's: chat's in the envelope, a completion choice's its own."""
            logprobs = None
            if lps is not None:
                logprobs = self._logprobs(lps, chat, offsets[i], body.return_tokens_as_token_ids)
                offsets[i] += sum(len(t) for t in logprobs.get("tokens", ()))
            tokens = {"token_ids": list(ids)} if body.return_token_ids else {}
            if reason is not None:  # vLLM's: with the finish_reason, the stop string or token that ended the text
                tokens["stop_reason"] = texts[i].stop_reason
            head = {"prompt_token_ids": gens[i].prompt_ids} if body.return_token_ids and prompt else {}
            counts = {"usage": self._usage(gens, body.n, texts)} if body.continuous_usage else usage  # the tokens so far
            if chat:
                delta = {"role": "assistant", "content": piece} if role else ({"content": piece} if piece else {})
                if reasoning and body.include_reasoning:
                    delta["reasoning_content"] = delta["reasoning"] = reasoning
                if calls:
                    delta["tool_calls"] = list(calls)
                return {**envelope, **head, "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": reason,
                                                         **tokens}], **counts}
            return {**envelope, "choices": [{"index": i, "text": piece, "logprobs": logprobs, "finish_reason": reason,
                                             **head, **tokens}], **counts}

        running = len(gens)  # choices not ended yet
        try:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await response.prepare(request)

            async def send(payload: dict) -> None:
                await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

            try:
                opened = [chat] * len(gens)  # a choice's first event (its prompt's ids, where asked for) was sent
                if chat:
                    for i in range(len(gens)):
                        await send(chunk(i, "", None, role=True, prompt=i == 0))
                        if echoes is not None:  # vLLM's chat echo: the last message's text, after the role
                            await send(chunk(i, echoes[i], None))
                async for i, piece, reason, lps, ids in runs:
                    if echoes is not None and not opened[i]:  # the prompt's log-probabilities came with its first delta
                        opened[i] = True
                        await send(chunk(i, echoes[i], None, None if received is None else self._echoed(gens[i], scored and scored[i], body.logprobs),
                                         prompt=True))
                    reasoning, calls = "", []
                    if replies is not None:
                        reasoning, piece, calls = replies[i].push(piece, final=reason is not None)
                        reason = reason and replies[i].finish_reason(reason)
                        if not (reasoning or piece or calls or reason or lps or body.return_token_ids):
                            continue  # held back by the reader: nothing to say yet
                    await send(chunk(i, piece, reason, lps, ids=ids, prompt=not opened[i], calls=calls, reasoning=reasoning))
                    opened[i] = True
                    running -= reason is not None
                    if not running:  # every choice has ended: the rest is the backends' cleanup
                        break
            except ApiError as exc:  # a choice failed after the headers went out: say so in the stream
                await send(exc.body())
            if body.include_usage:
                await send({**envelope, "choices": [], "usage": self._usage(gens, body.n, texts)})
            await response.write(b"data: [DONE]\n\n")
        finally:
            await self._close(runs, streams, detach=not running)
        await response.write_eof()
        return response

    async def _close(self, runs, streams: list, detach: bool) -> None:
        """Close a response's choices and its backend streams (also when cancelled before the first
        piece). Once every choice has ended (``detach``), the response goes out without waiting
        for this: a request a stop string cut short is cancelled on its verifier (an edge node: a
        round trip), which its client need not wait for; :meth:`stop` waits for it."""

        async def close() -> None:
            await runs.aclose()
            await self._close_all(streams)

        if detach:
            keep_until_done(close(), self._cleanups)
        else:
            await close()
