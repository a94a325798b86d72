"""The verifier's OpenAI-compatible front (``--http-port``): the API served by local serving.

Requests join the same continuous batch as gRPC ``Generate`` (:meth:`VerifierService.open_local`:
the same admission, identity limits, cancellation and metrics), drafted by the verifier's own
draft model and verified by the target, so the verifier is a drop-in server for any client of
the OpenAI API. ``tpot_slo_ms`` in a body is AdaServe's per-request latency SLO. With a token
file (``--auth-tokens``) the API wants ``Authorization: Bearer <token>`` — the OpenAI client's
``api_key`` — and counts requests against that identity's limits, as gRPC does.
"""

from __future__ import annotations

from goodspeed.api.protocol import ApiError, GenerationRequest
from goodspeed.api.server import Delta, OpenAIServer, StopStringMatched
from goodspeed.verifier import errors
from goodspeed.verifier.auth import ANONYMOUS, AuthError, Identity

# Engine refusals as HTTP statuses (everything else an engine error says is the request's fault: 400).
HTTP_STATUS = {
    errors.QueueFullError: (429, None),
    errors.LimitExceededError: (429, None),
    errors.PromptTooLongError: (400, "context_length_exceeded"),
    errors.LengthLimitError: (400, "context_length_exceeded"),
    errors.DrainingError: (503, None),
}


def api_error(exc: errors.EngineError) -> ApiError:
    for cls in type(exc).__mro__:
        if cls in HTTP_STATUS:
            status, code = HTTP_STATUS[cls]
            return ApiError(status, str(exc), code=code)
    return ApiError(400, str(exc))


class LocalServingBackend:
    """:class:`goodspeed.api.server.Backend` over a verifier's local serving."""

    def __init__(self, service, model_name: str, tokenizer) -> None:
        if service.local is None:
            raise ValueError("the HTTP front serves local requests: start the verifier with --local-draft MODEL")
        if tokenizer is None:
            raise ValueError("the HTTP front needs the target's tokenizer")
        self.service, self.tokenizer = service, tokenizer
        self.model_ids = (model_name,)
        self.max_model_len = service.engine.max_seq_len

    def ready(self) -> bool:
        return not self.service.draining

    def authorize(self, header: str | None) -> Identity:
        auth = self.service.auth
        if auth is None:
            return Identity(ANONYMOUS)
        try:
            return auth.identify([("authorization", header)] if header else [])
        except AuthError as exc:
            raise ApiError(401, str(exc), code="invalid_api_key") from None

    async def open(self, request: GenerationRequest, identity: Identity):
        try:
            stream = await self.service.open_local(identity, request.prompt_ids, request.sampling, request.max_tokens,
                                                   request.eos_token_ids, request.tpot_slo_ms, request.request_id, request.seed,
                                                   request.logprobs, request.prompt_logprobs)
        except errors.EngineError as exc:
            raise api_error(exc) from None
        return _deltas(stream)


async def _deltas(stream):
    try:
        async for event in stream:
            yield Delta(list(event.token_ids), event.finished, event.finish_reason, logprobs=event.logprobs,
                        prompt_logprobs=event.prompt_logprobs)
    except StopStringMatched:
        stream.stop_string = True  # cancelled as finished, not abandoned
    finally:
        await stream.aclose()


def make_http_front(service, model_name: str, tokenizer, tool_parser: str | None = None,
                    reasoning_parser: str | None = None) -> OpenAIServer:
    backend = LocalServingBackend(service, model_name, tokenizer)
    return OpenAIServer(backend, service.metrics.registry, authorize=backend.authorize, tool_parser=tool_parser,
                        reasoning_parser=reasoning_parser)
