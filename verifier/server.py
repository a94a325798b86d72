"""The verifier daemon: the verification engine behind a ``grpc.aio`` server.

Every engine call runs on one worker thread (the engine is single-threaded; a target forward
must not block the event loop). The RPC handlers here validate each call, hand it to the engine
and tell the round loop (:mod:`goodspeed.verifier.round_loop`) what changed; the round loop
decides when a step runs (``sync``: the paper's lockstep round; ``async``: continuous batching of
drafts), drops drafters that miss rounds, go idle or never open their verdict stream, and writes
the round log. A drafter whose verdict stream closes is dropped and its KV freed, and the next
allocation is computed without it. SIGTERM (see the CLI) calls :meth:`VerifierServer.drain
<goodspeed.verifier.daemon.VerifierServer.drain>`: new
sessions and requests are refused, rounds continue until the requests in progress finish or the
drain timeout passes.

With local serving (:mod:`goodspeed.verifier.local`), Generate requests join the local batch;
while any is in progress the loop runs iterations back to back, each one verifying the local
drafts together with whatever edge drafts are queued (edge drafters are then never waited for, and
are dropped only by ``idle_timeout_s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from goodspeed.serving.aio import keep_until_done, run_to_the_end
from goodspeed.serving.generation import GenerationRequest
from goodspeed.serving.sampling_wire import request_from_pb
from goodspeed.serving.metrics import RequestTimer, finished_reason
from goodspeed.lm.decoding.params import FEATURES, SamplingParams
from goodspeed.lm.decoding.structured import StructureError
from goodspeed.proto import PROTOCOL_VERSION
from goodspeed.proto.goodspeed.v1 import goodspeed_pb2 as pb
from goodspeed.proto.goodspeed.v1 import goodspeed_pb2_grpc as pb_grpc
from goodspeed.verifier import errors
from goodspeed.verifier.auth import ANONYMOUS, AuthError, Identity, TokenAuth, Usage
from goodspeed.verifier.engine import VerificationEngine
from goodspeed.verifier.fields import (
    MAX_MODEL_NAME_CHARS, MAX_NAME_CHARS, MAX_PROMPT_CHARS_PER_TOKEN, MAX_REQUEST_ID_CHARS, check_free_text,
    check_identifier,
)
from goodspeed.verifier.local import LocalServing
from goodspeed.verifier.local_requests import TokenEvent
from goodspeed.verifier.observability import JsonLog, Metrics
from goodspeed.verifier.records import ROUND_MODES, SHARE_MODES
from goodspeed.verifier.edge_drafters import Drafter, DrafterRegistry
from goodspeed.verifier.round_loop import RoundLoop
from goodspeed.verifier.serde import SAMPLING_FIELDS, draft_from_pb, logprobs_to_pb, sampling_from_pb, verdict_to_pb
from goodspeed.verifier.tls import is_loopback

SERVICE_NAME = "goodspeed.v1.Verifier"
RETRY_AFTER_KEY = "retry-after-ms"  # trailing metadata of a refusal that knows when to retry (a full wait queue)
# StartRequestReply's flag per feature, from before its features list: still set, for older drafters
LEGACY_FEATURE_FLAGS = {name: True for name in FEATURES if name in pb.StartRequestReply.DESCRIPTOR.fields_by_name}
STATUS = {
    errors.UnknownSessionError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.NoActiveRequestError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.RequestInProgressError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.TokenizerMismatchError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.StaleRoundError: grpc.StatusCode.ABORTED,
    errors.PromptTooLongError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.LengthLimitError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.TooManyDraftersError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.QueueFullError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.LimitExceededError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.NotOwnerError: grpc.StatusCode.PERMISSION_DENIED,
    errors.MalformedDraftError: grpc.StatusCode.INVALID_ARGUMENT,  # and its subclasses
    errors.DrainingError: grpc.StatusCode.UNAVAILABLE,
}


def status_for(exc: errors.EngineError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return grpc.StatusCode.INTERNAL


def check_port(name: str, value: int | None) -> None:
    """A port to listen on (None: not serving it): 0..65535, 0 meaning a free one; ``ValueError``
    otherwise, before anything binds (a bind would fall back or fail with a traceback)."""
    if value is not None and not 0 <= value <= 65535:
        raise ValueError(f"{name} must lie in 0..65535 (0: a free port), got {value}")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 0
    rounds: str = "sync"  # "sync": the paper's lockstep round; "async": continuous batching of drafts (round_loop)
    round_deadline_ms: float = 250.0
    max_missed_rounds: int = 3
    max_message_bytes: int = 32 * 1024 * 1024
    drain_timeout_s: float = 30.0
    idle_timeout_s: float = 60.0  # drop a session with a request in progress that sends nothing this long
    stream_open_timeout_s: float = 10.0  # drop a session that never opens its verdict stream (squatting)
    target_name: str = ""
    warmup: bool = True
    auth_tokens: str | None = None  # token file (verifier.auth); None: every caller is "anonymous"
    tls_cert: str | None = None  # PEM: serve TLS with this certificate and key
    tls_key: str | None = None
    tls_client_ca: str | None = None  # PEM: mutual TLS, clients need a certificate signed by this CA
    insecure: bool = False  # allow plaintext on a non-loopback address (refused otherwise)
    http_port: int | None = None  # the OpenAI-compatible front (VerifierServer's http_front); None: off
    http_host: str = "127.0.0.1"
    tool_call_parser: str | None = None  # the HTTP API's reader of tool calls the model chooses (api.tools.PARSERS)
    reasoning_parser: str | None = None  # the HTTP API's reader of a chat reply's reasoning (api.reasoning.PARSERS)
    transit_alone: bool = False  # async, transit decoding: also run steps for transit rows alone (round_loop)
    async_shares: str = "plan"  # async: how a step's drafters share C (SHARE_MODES, round_loop)

    def __post_init__(self) -> None:
        check_port("port", self.port)
        check_port("http_port", self.http_port)
        if self.rounds not in ROUND_MODES:
            raise ValueError(f"rounds must be one of {', '.join(ROUND_MODES)}, got {self.rounds!r}")
        if self.async_shares not in SHARE_MODES:
            raise ValueError(f"async_shares must be one of {', '.join(SHARE_MODES)}, got {self.async_shares!r}")
        if self.round_deadline_ms <= 0 or self.max_missed_rounds < 0 or self.max_message_bytes < 1024:
            raise ValueError("round_deadline_ms > 0, max_missed_rounds >= 0 and max_message_bytes >= 1024 are required")
        if self.idle_timeout_s <= 0 or self.stream_open_timeout_s <= 0 or self.drain_timeout_s < 0:
            raise ValueError("idle_timeout_s and stream_open_timeout_s must be > 0, drain_timeout_s >= 0")
        if (self.tls_cert is None) != (self.tls_key is None) or (self.tls_client_ca and not self.tls_cert):
            raise ValueError("TLS needs both --tls-cert and --tls-key; --tls-client-ca needs them too")
        if self.tls_cert is None and not self.insecure and not is_loopback(self.host):
            raise ValueError(f"refusing plaintext on {self.host}, which other machines can reach: give --tls-cert and "
                             "--tls-key (and --tls-client-ca for mutual TLS), or --insecure to accept plaintext")
        if self.http_port is not None and self.tls_cert is None and not self.insecure and not is_loopback(self.http_host):
            raise ValueError(f"refusing plaintext HTTP on {self.http_host}: give --tls-cert and --tls-key (HTTPS), or --insecure")


def check_transit(rounds: str, transit_tokens: int, transit_alone: bool = False) -> None:
    """Transit decoding needs asynchronous rounds, and steps for transit rows alone need transit
    decoding (ValueError otherwise)."""
    if transit_tokens and rounds != "async":
        raise ValueError("transit decoding (transit_tokens > 0) needs asynchronous rounds (--rounds async): in the "
                         "paper's lockstep round no step runs while a draft is in transit")
    if transit_alone and not transit_tokens:
        raise ValueError("transit_alone runs steps for transit decoding alone: it needs transit_tokens > 0 "
                         "(and --rounds async)")


async def abort_for(context, exc: errors.EngineError) -> None:
    """End the call with the engine error's status; a refusal that knows when to retry (a full
    wait queue) says so in the trailing metadata ``retry-after-ms``."""
    retry = getattr(exc, "retry_after_s", None)
    if retry is not None:
        context.set_trailing_metadata(((RETRY_AFTER_KEY, str(max(1, math.ceil(retry * 1000)))),))
    await context.abort(status_for(exc), str(exc))


def _rpc(handler):
    """Map engine errors to their status codes; the engine and other sessions are unaffected."""

    @functools.wraps(handler)
    async def wrapper(self, request, context):
        try:
            return await handler(self, request, context)
        except errors.EngineError as exc:
            await abort_for(context, exc)

    return wrapper


class VerifierService(pb_grpc.VerifierServicer):
    def __init__(self, engine: VerificationEngine, config: ServerConfig, metrics: Metrics, log: JsonLog,
                 local: LocalServing | None = None, tokenizer=None, auth: TokenAuth | None = None) -> None:
        self.engine, self.config, self.metrics, self.log = engine, config, metrics, log
        self.local, self.tokenizer, self.auth = local, tokenizer, auth
        self.usage = Usage()  # what each identity holds (KV tokens, streams) and its request rate
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="goodspeed-engine")
        self.cleanups: set[asyncio.Task] = set()  # requests being freed: local ones cancelled (LocalStream.aclose), abandoned prefills
        # The round loop owns the registry of edge drafters; the handlers add to it and read it.
        self.drafters = DrafterRegistry(engine, local, self.call, self.usage, metrics, log)
        self.rounds = RoundLoop(engine, local, config, metrics, log, self.drafters, self.call)
        # Async: each step's drafters take the shares of C the policy plans for every active drafter (round_loop).
        engine.allotments.plan_shares = config.rounds == "async" and config.async_shares == "plan"
        self.draining = False
        self._arriving = 0  # local requests open_local let through, not yet queued (this event loop's count)

    async def call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))

    async def _identify(self, context) -> Identity:
        """The caller's identity: from its bearer token when the verifier has a token file
        (UNAUTHENTICATED without a valid one), else from its client certificate's common name
        under mutual TLS, else ``anonymous``."""
        if self.auth is None:
            names = (context.auth_context() or {}).get("x509_common_name") if self.config.tls_client_ca else None
            return Identity(names[0].decode()) if names else Identity(ANONYMOUS)
        try:
            return self.auth.identify(context.invocation_metadata())
        except AuthError as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))

    async def _owned(self, session_id: str, context) -> Drafter:
        """The caller's session: unknown ones FAILED_PRECONDITION, another identity's PERMISSION_DENIED."""
        identity = await self._identify(context)
        drafter = self.drafters.get(session_id)
        if drafter is None:
            raise errors.UnknownSessionError(f"unknown or evicted session {session_id!r}")
        if drafter.identity.name != identity.name:
            raise errors.NotOwnerError(f"session {session_id!r} belongs to another identity")
        return drafter

    async def _refuse_if_draining(self, context) -> None:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the verifier is draining")

    @_rpc
    async def Join(self, request, context):
        identity = await self._identify(context)
        await self._refuse_if_draining(context)
        if request.protocol_version != PROTOCOL_VERSION:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"protocol version {request.protocol_version} != {PROTOCOL_VERSION}")
        name = check_identifier("drafter_name", request.drafter_name or "drafter", MAX_NAME_CHARS)
        check_free_text("model_name", request.model_name, MAX_MODEL_NAME_CHARS)
        held = sum(d.identity.name == identity.name for d in self.drafters.by_session.values())
        if identity.max_sessions is not None and held >= identity.max_sessions:
            raise errors.LimitExceededError(f"identity {identity.name!r} already holds {held} sessions (its max_sessions)")
        device = check_identifier("device", request.device, MAX_NAME_CHARS) if request.device else None
        # One identity's sessions naming one device share a utility term; another identity
        # naming the same device does not join it.
        group = f"{identity.name}/{device}" if device else None
        join = functools.partial(self.engine.join, name, request.tokenizer_fingerprint, device=group, transit=request.transit)
        session_id = await self.call(join)
        self.drafters.add(Drafter(session_id, name, asyncio.Queue(), identity,
                                  transit=request.transit and self.engine.config.transit_tokens > 0))
        self.log.event("join", session=session_id, name=name, model=request.model_name, identity=identity.name)
        return pb.JoinReply(session_id=session_id, vocab_size=self.engine.vocab_size, max_seq_len=self.engine.max_seq_len, target_model=self.config.target_name)

    async def StreamVerdicts(self, request, context):
        try:
            drafter = await self._owned(request.session_id, context)
        except errors.EngineError as exc:
            await abort_for(context, exc)
        drafter.streaming = True
        try:
            while (item := await drafter.verdicts.get()) is not None:
                yield item
        finally:
            await self.rounds.drop(request.session_id, "verdict stream closed")

    @_rpc
    async def StartRequest(self, request, context):
        await self._refuse_if_draining(context)
        drafter = await self._owned(request.session_id, context)
        sampling = await self._bound(sampling_from_pb(request.sampling), context)
        spec = request_from_pb(request, sampling)
        started = time.perf_counter()
        kv_tokens = len(request.prompt_ids) + request.max_new_tokens
        self.usage.admit_request(drafter.identity, kv_tokens)
        try:
            length = await self.call(self.engine.start, request.session_id, spec)
            if length is None:  # chunked prefill: the steps prefill the prompt, this call waits
                length = await self.rounds.started(request.session_id)
        except errors.EngineError:
            self.usage.release_request(drafter.identity.name, kv_tokens)
            raise
        except asyncio.CancelledError:  # the client went away mid-prefill: free what it holds
            keep_until_done(self._abandon_start(request.session_id, drafter.identity.name, kv_tokens), self.cleanups)
            raise
        drafter.kv_tokens = kv_tokens
        drafter.timer = self.metrics.requests.track(len(request.prompt_ids), started, count_running=False)
        drafter.in_request, drafter.missed, drafter.last_seen = True, 0, time.monotonic()
        self.drafters.update_gauges()
        self.log.event("start", session=request.session_id, name=drafter.name, prompt_tokens=len(request.prompt_ids),
                       prefill_s=time.perf_counter() - started, draft_length=length)
        return pb.StartRequestReply(draft_length=length, round_index=await self.call(self.engine.next_round, request.session_id),
                                    prompt_logprobs=request.HasField("prompt_logprobs"), features=list(FEATURES),
                                    **LEGACY_FEATURE_FLAGS)

    async def _bound(self, sampling: SamplingParams, context) -> SamplingParams:
        """``sampling`` with its structured output constraint compiled against the target's
        tokenizer (off the event loop: ~1 s the first time, a large grammar longer)."""
        if sampling.structured is None:
            return sampling
        if self.tokenizer is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "this verifier has no tokenizer: structured output needs one (start it with the target's)")
        try:
            return dataclasses.replace(sampling, structured=await asyncio.to_thread(sampling.structured.bound, self.tokenizer))
        except StructureError as exc:
            raise errors.MalformedDraftError(str(exc)) from None

    async def _abandon_start(self, session_id: str, identity: str, kv_tokens: int) -> None:
        self.rounds.forget(session_id)
        try:
            await self.call(self.engine.finish_request, session_id)
        except errors.EngineError:
            pass  # it had already left, or its request had ended
        self.usage.release_request(identity, kv_tokens)

    @_rpc
    async def SubmitDraft(self, request, context):
        drafter = await self._owned(request.session_id, context)
        drafter.last_seen, arrived = time.monotonic(), time.perf_counter()
        draft = draft_from_pb(request, self.engine.vocab_size)
        verdict = await self.call(self.engine.submit, request.session_id, draft)
        if verdict is not None:
            return pb.SubmitReply(queued=False, verdict=verdict_to_pb(verdict))
        self.rounds.queued(request.session_id, arrived)
        return pb.SubmitReply(queued=True)

    @_rpc
    async def FinishRequest(self, request, context):
        drafter = await self._owned(request.session_id, context)
        committed = await self.call(self.engine.finish_request, request.session_id)
        drafter.in_request, drafter.verdict_at = False, None
        self.drafters.end_request(drafter)
        self.drafters.update_gauges()
        self.log.event("finish", session=request.session_id, name=drafter.name, committed_tokens=len(committed))
        self.rounds.forget(request.session_id)  # the round may now be complete without it
        return pb.FinishRequestReply(committed_ids=committed)

    @_rpc
    async def Resync(self, request, context):
        await self._owned(request.session_id, context)
        sid = request.session_id
        committed, round_index, draft_length = await self.call(self.engine.resync, sid)
        self.rounds.forget(sid)  # a draft queued for the round (one decoding ahead) was dropped
        return pb.ResyncReply(committed_ids=committed, round_index=round_index, draft_length=draft_length)

    @_rpc
    async def Leave(self, request, context):
        await self._owned(request.session_id, context)
        await self.rounds.drop(request.session_id, "left")
        return pb.LeaveReply()

    async def Generate(self, request, context):
        who = await self._identify(context)
        if self.local is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "local serving is off: start the verifier with --local-draft MODEL")
        await self._refuse_if_draining(context)
        prompt_ids = await self._generate_prompt(request, context)
        eos = () if request.ignore_eos or self.tokenizer is None or self.tokenizer.eos_token_id is None else (self.tokenizer.eos_token_id,)
        arrival = time.perf_counter()
        try:
            sampling = await self._bound(sampling_from_pb(request.sampling), context)
            if request.request_id:
                check_identifier("request_id", request.request_id, MAX_REQUEST_ID_CHARS)
            generation = GenerationRequest(request.request_id, prompt_ids, request.max_new_tokens, sampling, eos,
                                           request.seed if request.HasField("seed") else None, request.tpot_slo_ms or None,
                                           request.logprobs if request.HasField("logprobs") else None,
                                           request.prompt_logprobs if request.HasField("prompt_logprobs") else None)
            stream = await self.open_local(who, generation)
        except errors.EngineError as exc:
            await abort_for(context, exc)
        except ValueError as exc:  # the request's own fields (a tpot_slo_ms <= 0)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        rid = stream.request_id
        generated, text = [], ""
        async with contextlib.aclosing(stream):
            yield pb.GenerateChunk(request_id=rid, prompt_ids=prompt_ids, sampling_fields=SAMPLING_FIELDS)
            async for event in stream:
                generated += event.token_ids
                # detokenizing is CPU work too: a worker thread, never the event loop
                new_text = await asyncio.to_thread(self.tokenizer.decode, list(generated)) if self.tokenizer is not None else ""
                chunk = pb.GenerateChunk(request_id=rid, token_ids=event.token_ids, token_times_s=[t - arrival for t in event.times],
                                         text=new_text[len(text):] if new_text.startswith(text) else new_text, finished=event.finished,
                                         finish_reason=event.finish_reason or "", logprobs=logprobs_to_pb(event.logprobs),
                                         prompt_logprobs=logprobs_to_pb(event.prompt_logprobs))
                text = new_text
                if event.finished and event.summary is not None:
                    stats = event.summary
                    chunk.tpot_s, chunk.num_drafted, chunk.num_accepted = stats["tpot_s"] or 0.0, stats["drafted"], stats["accepted"]
                yield chunk

    async def open_local(self, who: Identity, request: GenerationRequest) -> "LocalStream":
        """Admit a local-serving request for ``who`` (gRPC Generate and the HTTP front, each having
        built ``request`` at its door); raises :class:`errors.EngineError` if refused. The stream
        yields its :class:`TokenEvent` s; closing it before the last one cancels the request at once."""
        if self.draining:
            raise errors.DrainingError("the verifier is draining")
        # At the door, counting the requests let through but not queued yet (this loop's own
        # count): a refusal never waits for the engine thread's step
        if (refusal := self.local.queue_full(self._arriving)) is not None:
            raise refusal
        kv_tokens = len(request.prompt_ids) + request.max_tokens
        self.usage.open_stream(who, kv_tokens)
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def on_event(event: TokenEvent) -> None:  # engine thread -> event loop
            loop.call_soon_threadsafe(events.put_nowait, event)

        self._arriving += 1
        try:
            rid = await self.call(self.local.submit_request, request, on_event)
        except errors.EngineError:
            self.usage.close_stream(who.name, kv_tokens)
            raise
        finally:
            self._arriving -= 1
        self.log.event("generate", request=rid, prompt_tokens=len(request.prompt_ids), max_new_tokens=request.max_tokens,
                       tpot_slo_ms=request.tpot_slo_ms)
        self.rounds.wake()
        self.drafters.update_gauges()
        return LocalStream(self, rid, events, who.name, kv_tokens, self.metrics.requests.track(len(request.prompt_ids),
                                                                                                count_running=False))

    async def _generate_prompt(self, request, context) -> list[int]:
        if bool(request.prompt) == bool(request.prompt_ids):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "give exactly one of prompt (text) and prompt_ids")
        if request.prompt_ids:
            return list(request.prompt_ids)
        if self.tokenizer is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "this verifier has no tokenizer: send prompt_ids")
        limit = MAX_PROMPT_CHARS_PER_TOKEN * self.engine.max_seq_len
        if len(request.prompt) > limit:  # refused before any CPU is spent on it
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"prompt of {len(request.prompt)} characters cannot fit the context of {self.engine.max_seq_len} tokens")
        # Off the event loop (a 4 MB prompt took 3.4 s there, stalling every session) and off the
        # engine thread: a worker thread (the tokenizer releases the GIL).
        encoded = await asyncio.to_thread(self.tokenizer, request.prompt, add_special_tokens=False)
        return list(encoded["input_ids"])

    def warm_up(self) -> None:
        """One tiny request through the engine, and with fixed-shape steps (CUDA graphs,
        torch.compile) the engine's warm-up steps and local serving's draft's, which compile and
        capture their first graphs (thread-safe: runs on the engine thread)."""
        sid = self.engine.join("warmup")
        self.engine.start_request(sid, [0], SamplingParams(), 2)
        self.engine.run_round()
        self.engine.leave(sid)
        if self.engine.graphs is not None:  # said first: compiling can take minutes before health turns SERVING
            self.log.event("warm_up_begin", what="compiling / capturing the fixed-shape steps' first graphs",
                           torch_compile=self.engine.config.torch_compile, cuda_graphs=self.engine.config.cuda_graphs)
            t0 = time.perf_counter()
            steps = self.engine.warm_up_steps()
            draft_steps = self.local.warm_up() if self.local is not None else 0
            self.log.event("warm_up", steps=steps, graphs=len(self.engine.graphs.shapes), draft_steps=draft_steps,
                           seconds=round(time.perf_counter() - t0, 3))

class LocalStream:
    """One local request's events as an async iterator (see :meth:`VerifierService.open_local`)."""

    def __init__(self, service: VerifierService, request_id: str, events: asyncio.Queue, who: str, kv_tokens: int,
                 timer: RequestTimer) -> None:
        self.service, self.request_id, self.events = service, request_id, events
        self.who, self.kv_tokens, self.timer = who, kv_tokens, timer
        self.finished = self.closed = False
        self.stop_string = False  # the HTTP front cut the text at a stop string: cancelled as finished ("stop")

    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenEvent:
        if self.finished:
            raise StopAsyncIteration
        event = await self.events.get()
        self.timer.tokens(len(event.token_ids))
        if event.finished:
            self.finished = True
            self.timer.finish(finished_reason(event.finish_reason))
            if event.summary is not None:
                self.service.log.event("generated", **event.summary)
        return event

    async def aclose(self) -> None:
        """Release the request's hold on its identity; cancel it if it has not finished (to the
        end, even when this is cancelled again meanwhile: :func:`run_to_the_end`)."""
        if self.closed:
            return
        self.closed = True
        self.service.usage.close_stream(self.who, self.kv_tokens)
        if not self.finished:  # the client went away (or its stop string came): free the request at once
            self.timer.finish("stop" if self.stop_string else "abort")
            await run_to_the_end(self._cancel(), self.service.cleanups)

    async def _cancel(self) -> None:
        freed = await self.service.call(self.service.local.cancel, self.request_id)
        self.service.drafters.update_gauges()
        self.service.log.event("cancelled", request=self.request_id, freed=freed)
