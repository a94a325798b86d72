"""OpenAI-compatible HTTP endpoints over any generation backend, on aiohttp.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (streaming as server-sent events —
``data: {chunk}`` lines, then ``data: [DONE]`` — with ``stream_options.include_usage``, or one
JSON body), ``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (Prometheus text).

aiohttp runs on the process's asyncio loop, the one ``grpc.aio`` already uses on the verifier
and on an edge node: one event loop serves both protocols, with no extra threads. Handlers are
cancelled when their client disconnects, and a cancelled stream closes its backend stream, which
frees the request on the verifier at once.

A backend (:class:`Backend`) is the verifier's local serving batch
(:mod:`goodspeed.verifier.http_front`) or an edge node's session pool
(:mod:`goodspeed.drafter.node`); this module knows neither.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from goodspeed.api.protocol import ApiError, ChatCompletionRequest, CompletionRequest, GenerationRequest, parse_body
from goodspeed.api.text import TextStream

MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
INLINE_CHARS = 8192  # prompts up to this long are tokenized on the event loop (about 1 ms at most)
MAX_CHARS_PER_TOKEN = 64  # no tokenizer packs more characters per token: longer text cannot fit the context


@dataclass(frozen=True)
class Delta:
    """New tokens of a request; the last delta has ``finished`` and a ``finish_reason``
    ("eos", "length", "cancelled" or "error: ...")."""

    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    error: ApiError | None = None  # with finish_reason "error: ...": what the client is told


class Backend(Protocol):
    model_ids: Sequence[str]  # names the ``model`` field may take; the first is listed by /v1/models
    tokenizer: object
    max_model_len: int

    def ready(self) -> bool: ...

    async def open(self, request: GenerationRequest, identity: str) -> AsyncIterator[Delta]:
        """Admit the request (raising :class:`ApiError` if refused) and return its delta stream;
        closing the stream (``aclose``) before its last delta cancels the request."""
        ...


def _finish_reason(stream: TextStream, reason: str | None) -> str:
    return "stop" if stream.stopped or reason == "eos" else "length"


class OpenAIServer:
    def __init__(self, backend: Backend, registry: CollectorRegistry,
                 authorize: Callable[[str | None], str] | None = None) -> None:
        """``authorize(authorization header) -> identity`` raises :class:`ApiError` (401) for a
        caller it refuses; None: everyone is ``anonymous``."""
        self.backend, self.registry, self.authorize = backend, registry, authorize
        self._runner: web.AppRunner | None = None

    # ---------------------------------------------------------------------------- app

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._errors])
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
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

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        """Every refusal as OpenAI's error object, aiohttp's own (404 path, 405, 413) included."""
        try:
            return await handler(request)
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)
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

    async def models(self, request: web.Request) -> web.Response:
        self._identify(request)
        name = self.backend.model_ids[0]
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "goodspeed", "max_model_len": self.backend.max_model_len}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        identity = self._identify(request)
        body = parse_body(CompletionRequest, await self._json(request))
        self._check_model(body.model)
        prompt_ids = list(body.prompt) if isinstance(body.prompt, list) else await self._tokenize(body.prompt)
        gen = self._generation("cmpl", body, prompt_ids, body.max_tokens or DEFAULT_COMPLETION_TOKENS)
        if body.stream:
            return await self._stream(request, identity, gen, body, chat=False)
        return await self._complete(identity, gen, body, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        identity = self._identify(request)
        body = parse_body(ChatCompletionRequest, await self._json(request))
        self._check_model(body.model)
        tokenizer = self.backend.tokenizer
        if getattr(tokenizer, "chat_template", None) is None:
            raise ApiError(400, f"model {body.model!r} has no chat template: use /v1/completions", param="messages")
        messages = [{"role": m.role if m.role != "developer" else "system", "content": m.text()} for m in body.messages]
        size = sum(len(m["content"]) for m in messages)
        render = functools.partial(tokenizer.apply_chat_template, messages, tokenize=False, add_generation_prompt=True)
        prompt_ids = await self._tokenize(await asyncio.to_thread(render) if size > INLINE_CHARS else render())
        limit = body.token_limit or max(1, self.backend.max_model_len - len(prompt_ids))
        gen = self._generation("chatcmpl", body, prompt_ids, limit)
        if body.stream:
            return await self._stream(request, identity, gen, body, chat=True)
        return await self._complete(identity, gen, body, chat=True)

    # ---------------------------------------------------------------------- helpers

    def _identify(self, request: web.Request) -> str:
        return self.authorize(request.headers.get("Authorization")) if self.authorize is not None else "anonymous"

    async def _tokenize(self, text: str) -> list[int]:
        """Token ids of ``text``: inline when short (a thread hop costs more than a short prompt's
        tokenization), on a worker thread when long, never stalling the event loop for long. Text
        too long to fit the context at any tokenization is refused before any CPU is spent on it."""
        if len(text) > MAX_CHARS_PER_TOKEN * self.backend.max_model_len:
            raise ApiError(400, f"a prompt of {len(text)} characters cannot fit this model's context of "
                                f"{self.backend.max_model_len} tokens", code="context_length_exceeded")
        if len(text) <= INLINE_CHARS:
            return list(self.backend.tokenizer(text, add_special_tokens=False)["input_ids"])
        encoded = await asyncio.to_thread(self.backend.tokenizer, text, add_special_tokens=False)
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

    def _generation(self, kind: str, body, prompt_ids: list[int], max_tokens: int) -> GenerationRequest:
        limit = self.backend.max_model_len
        if len(prompt_ids) >= limit or len(prompt_ids) + max_tokens > limit:
            raise ApiError(400, f"this model's context is {limit} tokens; the prompt holds {len(prompt_ids)} and "
                                f"{max_tokens} more were asked for", param="messages" if kind == "chatcmpl" else "prompt",
                           code="context_length_exceeded")
        eos = self.backend.tokenizer.eos_token_id
        return GenerationRequest(
            request_id=f"{kind}-{secrets.token_hex(12)}", prompt_ids=prompt_ids, max_tokens=max_tokens,
            sampling=body.sampling(), eos_token_ids=() if body.ignore_eos or eos is None else (int(eos),),
            seed=body.seed, tpot_slo_ms=body.tpot_slo_ms)

    def _envelope(self, gen: GenerationRequest, chat: bool, created: int) -> dict:
        return {"id": gen.request_id, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": self.backend.model_ids[0]}

    @staticmethod
    def _usage(gen: GenerationRequest, completion_tokens: int) -> dict:
        return {"prompt_tokens": len(gen.prompt_ids), "completion_tokens": completion_tokens,
                "total_tokens": len(gen.prompt_ids) + completion_tokens}

    @staticmethod
    async def _pieces(deltas, text: TextStream):
        """Yield ``(new text, finish_reason or None)`` from an opened backend stream until the end;
        the backend stream is always closed, which cancels the request if it did not finish."""
        try:
            async for delta in deltas:
                # inline: a step's few tokens decode in a window of a few tokens (microseconds)
                piece = text.push(delta.token_ids) if delta.token_ids else ""
                if text.stopped:
                    yield piece, "stop"
                    return
                if delta.finished:
                    if delta.error is not None:
                        raise delta.error
                    if delta.finish_reason not in ("eos", "length"):
                        raise ApiError(500, f"generation failed: {delta.finish_reason}")
                    yield piece + text.finish(), _finish_reason(text, delta.finish_reason)
                    return
                if piece:
                    yield piece, None
        finally:
            await deltas.aclose()

    async def _complete(self, identity: str, gen: GenerationRequest, body, chat: bool) -> web.Response:
        text, pieces, reason = TextStream(self.backend.tokenizer, body.stop_strings), [], None
        deltas = await self.backend.open(gen, identity)  # a refusal (queue full, ...) raises its 4xx here
        try:
            async with contextlib.aclosing(self._pieces(deltas, text)) as runs:
                async for piece, reason in runs:
                    pieces.append(piece)
        finally:
            await deltas.aclose()  # also when cancelled before the first piece
        content = "".join(pieces)
        choice = ({"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": None, "finish_reason": reason}
                  if chat else {"index": 0, "text": content, "logprobs": None, "finish_reason": reason})
        return web.json_response({
            "id": gen.request_id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": self.backend.model_ids[0], "choices": [choice], "usage": self._usage(gen, text.consumed)})

    async def _stream(self, request: web.Request, identity: str, gen: GenerationRequest, body, chat: bool) -> web.StreamResponse:
        """Admit the request (a refusal is still a plain 4xx), send the headers at once (so the
        first token's chunk is all that is left on its path), then one event per new text."""
        text = TextStream(self.backend.tokenizer, body.stop_strings)
        deltas = await self.backend.open(gen, identity)
        runs = self._pieces(deltas, text)
        envelope = self._envelope(gen, chat, int(time.time()))
        usage = {"usage": None} if body.include_usage else {}

        def chunk(piece: str, reason: str | None, role: bool = False) -> dict:
            if chat:
                delta = {"role": "assistant", "content": piece} if role else ({"content": piece} if piece else {})
                return {**envelope, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}], **usage}
            return {**envelope, "choices": [{"index": 0, "text": piece, "logprobs": None, "finish_reason": reason}], **usage}

        try:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await response.prepare(request)

            async def send(payload: dict) -> None:
                await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

            try:
                if chat:
                    await send(chunk("", None, role=True))
                async for piece, reason in runs:
                    await send(chunk(piece, reason))
            except ApiError as exc:  # the request failed after the headers went out: say so in the stream
                await send(exc.body())
        finally:
            await runs.aclose()
            await deltas.aclose()  # also when cancelled before the first piece
        if body.include_usage:
            await send({**envelope, "choices": [], "usage": self._usage(gen, text.consumed)})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


