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
:class:`~goodspeed.lm.decoding.params.TokenLogprob` (the target's, read off the verifying step's logits),
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
import importlib.metadata
import json
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from goodspeed.api.completions import Completions
from goodspeed.api.errors import ApiError
from goodspeed.api.reasoning import PARSERS as REASONING_PARSERS
from goodspeed.api.response_store import ResponseStore
from goodspeed.api.streaming import Streaming
from goodspeed.api.text import INLINE_CHARS
from goodspeed.api.tokenizer_routes import TokenizerRoutes
from goodspeed.api.tools import PARSERS
from goodspeed.api.translated import ResponsesAndMessages
from goodspeed.lm.decoding.structured import JsonTooDeep, loads_bounded
from goodspeed.serving.generation import Delta, GenerationRequest, RequestError

try:
    _VERSION = importlib.metadata.version("goodspeed")
except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
    _VERSION = "unknown"
MAX_BODY_BYTES = 8 * 1024 * 1024
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


def check_parsers(tool_parser: str | None, reasoning_parser: str | None) -> None:
    """ValueError for a tool-call or reasoning parser this server does not have (None: none)."""
    for what, name, known in (("tool_call_parser", tool_parser, PARSERS),
                              ("reasoning_parser", reasoning_parser, REASONING_PARSERS)):
        if name is not None and name not in known:
            raise ValueError(f"{what} must be one of {', '.join(known)}, got {name!r}")


class OpenAIServer(Completions, ResponsesAndMessages, TokenizerRoutes, Streaming):
    """The HTTP API over a backend: the routes, identities, models and errors here; the protocols'
    handlers in their modules (:class:`~goodspeed.api.completions.Completions`, ...)."""

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
            return web.json_response(exc.body(), status=exc.status, headers=exc.headers())
        except RequestError as exc:  # an authorizer's or backend's, by kind
            error = ApiError.of(exc)
            return web.json_response(error.body(), status=error.status, headers=error.headers())
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














    # ---------------------------------------------------------------------- helpers



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
            return loads_bounded(await request.read(), "the request body")
        except JsonTooDeep as exc:
            raise ApiError(400, str(exc), code="json_too_deep") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}") from None

    def _check_model(self, name: str) -> None:
        if name not in self.backend.model_ids:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {self.backend.model_ids[0]!r}",
                           param="model", code="model_not_found")
