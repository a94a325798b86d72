"""The verifier's OpenAI-compatible front (``--http-port``): local serving as a backend of the API.

Requests join the same continuous batch as gRPC ``Generate`` (:meth:`VerifierService.open_local`:
the same admission, identity limits, cancellation and metrics), drafted by the verifier's own
draft model and verified by the target, so the verifier is a drop-in server for any client of
the OpenAI API. ``tpot_slo_ms`` in a body is AdaServe's per-request latency SLO. With a token
file (``--auth-tokens``) the API wants ``Authorization: Bearer <token>`` — the OpenAI client's
``api_key`` — and counts requests against that identity's limits, as gRPC does.

:class:`LocalServingBackend` speaks the generation contract (:mod:`goodspeed.serving.generation`):
engine refusals become error kinds, which the API maps to HTTP statuses. The daemon's entry point
puts it behind the API (:func:`goodspeed.launch.daemons.serve.make_http_front`).
"""

from __future__ import annotations

from goodspeed.serving.generation import Delta, GenerationRequest, RequestError, StopStringMatched
from goodspeed.verifier import errors
from goodspeed.verifier.auth import ANONYMOUS, AuthError, Identity

# Engine refusals by kind (everything else an engine error says is the request's fault: invalid).
ERROR_KINDS = {
    errors.QueueFullError: ("overloaded", None),
    errors.LimitExceededError: ("overloaded", None),
    errors.PromptTooLongError: ("invalid", "context_length_exceeded"),
    errors.LengthLimitError: ("invalid", "context_length_exceeded"),
    errors.DrainingError: ("unavailable", None),
}


def request_error(exc: errors.EngineError) -> RequestError:
    for cls in type(exc).__mro__:
        if cls in ERROR_KINDS:
            kind, code = ERROR_KINDS[cls]
            return RequestError(kind, str(exc), code=code, retry_after_s=getattr(exc, "retry_after_s", None))
    return RequestError("invalid", str(exc))


class LocalServingBackend:
    """A backend of the HTTP API (``goodspeed.api.server.Backend``) over a verifier's local serving."""

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
            raise RequestError("unauthorized", str(exc), code="invalid_api_key") from None

    async def open(self, request: GenerationRequest, identity: Identity):
        try:
            stream = await self.service.open_local(identity, request)
        except errors.EngineError as exc:
            raise request_error(exc) from None
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
