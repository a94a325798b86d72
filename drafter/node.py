"""An edge node as a server: applications' requests are drafted here and verified remotely.

``goodspeed drafter --serve HOST:PORT`` puts :class:`EdgeNode` behind the OpenAI API
(:mod:`goodspeed.api.server`); both run on one asyncio loop with the node's ``grpc.aio`` channel.

How a node holds several requests at once, and why fairness stays per DEVICE:

* Each request in progress has its own verifier session (the protocol's unit: one request, one
  KV slot, one round counter), taken from a pool of at most ``max_concurrency`` sessions that
  the node keeps joined (their acceptance estimates carry over between requests). Requests
  beyond that wait in a bounded queue; beyond it they get 429 with a hint of when to retry
  (:meth:`EdgeNode.retry_after_s`). With ``admission="slo"`` a request also waits, first in
  first out, until the node's time per token, fitted on its requests' rounds against how many
  were in flight (:class:`goodspeed.scheduler.admission.RoundAdmission`), stays within 90% of
  every request's ``tpot_slo_ms`` with it in flight too: past capacity a request that would
  slow the others past their SLOs waits, or is refused, instead.
* Every session of the node joins with the node's name as its ``device``. The verifier's
  GoodSpeed then has ONE utility term per device, ``log X_d`` with ``X_d`` the sum of the
  device's sessions' goodputs (:mod:`goodspeed.scheduler.allotments`): a node serving four
  requests gets a device's share of the budget ``C``, split among its requests by their marginal
  gains, exactly as eq. (5) splits it among devices. More requests buy no more of the verifier.
* Drafting is batched across the node's requests: requests waiting for a draft are drafted
  together, one forward per draft step, by :class:`goodspeed.lm.runtime.batch_draft.BatchDraftModel`
  (one KV slot per request). In the paper's synchronous rounds the node's verdicts arrive
  together, so its requests are drafted together.

Losslessness is the verifier's: the node only drafts. Each request samples from its own stream
(its ``seed``, else the node's root seed and the request id); each verdict's committed length and
prefix hash are checked against the node's copy. If the verifier drops a session (a restart, a
missed deadline), the request joins again and resumes from the tokens already verified (the
target's continuation of a verified prefix is still its own distribution); while the verifier is
unreachable it waits for it, up to ``connect_timeout_s`` (``tests/launch/test_chaos.py``: the
verifier killed with `kill -9` under two nodes' requests, every one completed exactly). A verdict that does
not match the node's text ends the request with an error: its tokens already reached the client,
so the node never papers over it.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from goodspeed.serving.aio import run_to_the_end
from goodspeed.serving.generation import Delta, GenerationRequest, RequestError, StopStringMatched
from goodspeed.serving.metrics import DrafterMetrics, RequestMetrics, SpecDecodeMetrics, finished_reason
from goodspeed.drafter.client import backoff, say_waiting
from goodspeed.drafter.credentials import ClientTLS, bearer_metadata, open_aio_channel
from goodspeed.lm.models.adapt_config import AdaptConfig
from goodspeed.drafter.node_requests import DraftJob, NodeRequest, PooledSession
from goodspeed.drafter.serde import (
    DraftOutput, applied_features, draft_to_pb, logprobs_from_pb, refusal, unapplied_setting, verdict_logprobs,
)
from goodspeed.drafter.session import DrafterError, RequestStats, SessionLost
from goodspeed.serving.sampling_wire import request_to_pb
from goodspeed.lm.decoding.seeding import resolve_root_seed, torch_generator
from goodspeed.lm.decoding.params import PROPOSAL_TOP_K, check_proposal_top_k
from goodspeed.proto import MAX_DECODE_AHEAD, PROTOCOL_VERSION
from goodspeed.proto.goodspeed.v1 import goodspeed_pb2 as pb
from goodspeed.proto.goodspeed.v1 import goodspeed_pb2_grpc as pb_grpc
from goodspeed.lm.decoding.proposals import ChainDraft
from goodspeed.lm.decoding.draft_source import as_draft_source, draft_model, draft_with_forced
from goodspeed.lm.decoding.lookup import LookupDraft
from goodspeed.scheduler.admission import ADMISSIONS, RoundAdmission
from goodspeed.scheduler.paying import EvidenceAcceptance, PayingLength

MAX_REPAIRS = 3  # session losses one request survives
DRAFT_LENGTH_RULES = ("goodput", "allotted")  # NodeConfig.draft_length
HEALTH_EVERY_S = 1.0  # how often the node checks its verifier's health
# Where the proposal of a lookup that reads the request's own text alone (``own_text_only``:
# ``ngram``) does not pay, the verifier decodes up to this many rounds by itself, stopping sooner
# where the text holds a match that would (DraftRequest.decode_ahead_until_match): a round trip
# saved a token meanwhile
LOOKUP_DECODE_AHEAD = 8


@dataclass(frozen=True)
class NodeConfig:
    verifier: str  # HOST:PORT
    name: str  # this device's name: the verifier's fairness unit
    model_name: str = ""
    fingerprint: str = ""
    max_concurrency: int = 4  # verifier sessions (requests generating at once)
    max_waiting: int = 64  # requests queued for a session; more get 429
    # Which waiting requests start: count (while fewer than max_concurrency generate) or slo (also
    # only while the node's fitted time per token stays within every request's tpot_slo_ms)
    admission: str = "count"
    seed: int | None = None  # root of the per-request sampling streams; None: OS entropy
    connect_timeout_s: float = 60.0
    verdict_timeout_s: float = 120.0
    token: str | None = None
    tls: ClientTLS | None = None
    proposal_top_k: int = PROPOSAL_TOP_K  # sampled drafts' q capped to this many tokens a position (lm.decoding.sampling.cap_support)
    cuda_graphs: bool = False  # the batched draft forwards replayed as CUDA graphs (goodspeed.lm.runtime.graphs; CUDA only)
    torch_compile: bool = False  # the batched draft forwards through a compiled decoder (goodspeed.lm.runtime.graphs.compiled)
    # goodput: each request drafts the length (at most the verifier's S_i) with the most expected
    # tokens per second from its measured acceptance and this node's drafting and round times, 0
    # where speculation does not pay (goodspeed.scheduler.paying); allotted: always S_i
    draft_length: str = "goodput"
    # Fine-tune the draft on this node's own traffic between requests (goodspeed.lm.models.adapt)
    adapt: bool = False
    adapt_every: int = 16  # finished requests between two fine-tunes
    adapt_dir: str | None = None  # where adopted weights persist across restarts
    # As DrafterConfig.on_wait; also told what --adapt did (each fine-tune's outcome)
    on_wait: Callable[[str], None] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.max_concurrency < 1 or self.max_waiting < 0:
            raise ValueError("max_concurrency must be >= 1 and max_waiting >= 0")
        check_proposal_top_k(self.proposal_top_k)
        if self.admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {', '.join(ADMISSIONS)}, got {self.admission!r}")
        if self.draft_length not in DRAFT_LENGTH_RULES:
            raise ValueError(f"draft_length must be one of {', '.join(DRAFT_LENGTH_RULES)}, got {self.draft_length!r}")
        self.adapt_config()  # its checks

    def adapt_config(self) -> AdaptConfig:
        return AdaptConfig(every=self.adapt_every, dir=self.adapt_dir)


class EdgeNode:
    """:class:`goodspeed.api.server.Backend` of an edge device: ``await start()``, then serve."""

    def __init__(self, config: NodeConfig, draft, tokenizer,
                 registry: CollectorRegistry | None = None) -> None:
        """``draft``: a draft model, or any draft source (:mod:`goodspeed.lm.decoding.draft_source`: a
        lookup, or a lookup in front of a model)."""
        self.config, self.tokenizer = config, tokenizer
        self.registry = registry or CollectorRegistry()
        self.requests = RequestMetrics(self.registry)
        self.spec = SpecDecodeMetrics(self.registry)
        self.node_metrics = DrafterMetrics(self.registry)
        self.drafter = as_draft_source(draft, config.proposal_top_k, config.cuda_graphs, config.torch_compile)
        self.paying = PayingLength()  # the goodput rule's estimates (config.draft_length)
        self.evidence = EvidenceAcceptance()  # a lookup's acceptance by the context its drafts matched
        self._looked: dict[str, tuple[int, int, bool]] = {}  # a lookup's last draft: evidence, forced, probe
        self._inline = isinstance(self.drafter, LookupDraft)  # drafted on the event loop, not the drafting thread
        self.adapting = None
        if config.adapt:  # the fine-tuning runtime is loaded only here (a lookup alone imports no torch)
            from goodspeed.drafter.node_adapt import NodeAdaptation

            self.adapting = NodeAdaptation(self, draft_model(self.drafter))
        self.root_seed = resolve_root_seed(config.seed)
        self.metadata = bearer_metadata(config.token)
        self.model_ids: tuple[str, ...] = ()
        self.max_model_len = 0
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="goodspeed-draft")  # owns the draft model
        # Requests admitted and not yet freed (each holds, or is about to hold, a draft KV slot):
        # weights swap only with none (node_adapt); retry_after_s reads their pace
        self._in_flight: set[NodeRequest] = set()
        self._free: list[PooledSession] = []
        self._sessions = 0  # joined, free or busy
        self._session_freed = asyncio.Condition()
        self._waiting = 0
        self.admission = RoundAdmission() if config.admission == "slo" else None
        self._gate: list[object] = []  # requests waiting for SLO admission, first in first out
        self._gate_changed = asyncio.Condition()  # a request freed, a round observed, the head left
        self._admitted_since = 0  # requests admitted since the last round observed
        self._jobs: list[DraftJob] = []
        self._jobs_ready = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._cleanups: set[asyncio.Task] = set()  # requests' _end, which stop() waits for and never cancels
        self._batcher: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self.channel = self.stub = None
        self.serving = False
        self.verifier_serving = False  # the verifier's health, checked every HEALTH_EVERY_S

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Warm up the draft's fixed-shape forwards (with ``cuda_graphs`` / ``torch_compile``:
        :meth:`BatchDraftModel.warm_up <goodspeed.lm.runtime.batch_draft.BatchDraftModel.warm_up>`), reach
        the verifier (retrying until ``connect_timeout_s``) and join the first session."""
        if self.drafter.graphs is not None:  # a model's fixed-shape forwards: the model runtime is loaded
            from goodspeed.drafter.runner import WARM_UP_NOTICE
            from goodspeed.lm.runtime.batch_draft import BatchDraftModel

            if self.config.on_wait is not None:  # compiling can take a minute before the node joins
                self.config.on_wait(WARM_UP_NOTICE)
            await self._call(self.drafter.warm_up, BatchDraftModel.EDGE_WARM_UP_CHAIN)
        self.channel = open_aio_channel(self.config.verifier, self.config.tls)
        self.stub = pb_grpc.VerifierStub(self.channel)
        health = health_pb2_grpc.HealthStub(self.channel)
        for attempt, pause in enumerate(backoff(self.config.connect_timeout_s, cap_s=1.0)):  # the file-mode client's schedule
            try:
                reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.aio.AioRpcError:
                pass
            if pause is None:
                raise DrafterError(f"verifier {self.config.verifier} not serving after {self.config.connect_timeout_s:g} s")
            say_waiting(self.config, attempt == 0)
            await asyncio.sleep(pause)
        try:
            session, reply = await self._join()
        except RequestError as exc:
            raise DrafterError(exc.message) from None
        self._sessions = 1
        self.node_metrics.sessions.set(1)
        self.model_ids = (reply.target_model or self.config.model_name,)
        self.max_model_len = int(reply.max_seq_len)
        self._free.append(session)
        self._batcher = asyncio.get_running_loop().create_task(self._batch_loop())
        self.verifier_serving = True
        self._watcher = asyncio.get_running_loop().create_task(self._watch(health))
        self.serving = True

    async def _watch(self, health) -> None:
        """Follow the verifier's health, so the node's own ``/health`` (and new requests) say at
        once when its verifier is unreachable or draining; requests in progress repair or fail
        on their own."""
        while True:
            await asyncio.sleep(HEALTH_EVERY_S)
            try:
                reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=HEALTH_EVERY_S)
                self.verifier_serving = reply.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.aio.AioRpcError:
                self.verifier_serving = False

    async def stop(self) -> None:
        """Cancel the requests in progress (freeing them on the verifier) and leave."""
        self.serving = False
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*self._cleanups, return_exceptions=True)
        for task in (self._batcher, self._watcher):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        for session in self._free:
            try:
                await self.stub.Leave(pb.LeaveRequest(session_id=session.session_id), timeout=5.0, metadata=self.metadata)
            except grpc.aio.AioRpcError:
                pass
            await session.close()
        self._free.clear()
        if self.channel is not None:
            await self.channel.close()
        if self.adapting is not None:
            await self.adapting.stop()
        self._executor.shutdown(wait=True)

    def ready(self) -> bool:
        return self.serving and self.verifier_serving

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))

    # ------------------------------------------------------------------ sessions

    async def _join(self) -> tuple[PooledSession, pb.JoinReply]:
        """Join one session (the caller counts it in ``_sessions``)."""
        try:
            reply = await self.stub.Join(pb.JoinRequest(
                drafter_name=self.config.name, model_name=self.config.model_name, tokenizer_fingerprint=self.config.fingerprint,
                protocol_version=PROTOCOL_VERSION, device=self.config.name, transit=True), timeout=self.config.verdict_timeout_s,
                metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            raise refusal("join", exc) from None
        stream = self.stub.StreamVerdicts(pb.StreamVerdictsRequest(session_id=reply.session_id), metadata=self.metadata)
        return PooledSession(reply.session_id, stream), reply

    async def _acquire(self) -> PooledSession:
        """A free session: a pooled one, a newly joined one while the pool is below
        ``max_concurrency``, or the next one freed (at most ``max_waiting`` requests wait)."""
        while True:
            if self._free:
                return self._free.pop()
            if self._sessions < self.config.max_concurrency:
                self._sessions += 1  # counted before the await, so concurrent callers cannot overshoot
                try:
                    session, _ = await self._join()
                except BaseException:
                    self._sessions -= 1
                    raise
                self.node_metrics.sessions.set(self._sessions)
                return session
            if self._waiting >= self.config.max_waiting:
                retry = self.retry_after_s()
                raise RequestError("overloaded", f"{self._waiting} requests are already waiting on this node; retry in "
                                                 f"about {retry:.2g} s", retry_after_s=retry)
            self._waiting += 1
            self.requests.waiting.set(self._waiting)
            try:
                async with self._session_freed:
                    await self._session_freed.wait_for(lambda: bool(self._free) or self._sessions < self.config.max_concurrency)
            finally:
                self._waiting -= 1
                self.requests.waiting.set(self._waiting)

    async def _admit_by_slo(self, request: GenerationRequest) -> None:
        """With ``admission="slo"``: wait, first in first out, until the rule admits ``request``
        next to the requests in flight (module docstring); 429 while ``max_waiting`` wait."""
        if self.admission is None:
            return
        if self._waiting >= self.config.max_waiting:
            retry = self.retry_after_s()
            raise RequestError("overloaded", f"{self._waiting} requests are already waiting on this node; retry in "
                                             f"about {retry:.2g} s", retry_after_s=retry)
        slo = request.tpot_slo_ms / 1000 if request.tpot_slo_ms is not None else None
        ticket = object()
        self._gate.append(ticket)
        self._waiting += 1
        self.requests.waiting.set(self._waiting)
        try:
            async with self._gate_changed:
                await self._gate_changed.wait_for(lambda: self._gate[0] is ticket and self.admission.admits(
                    [r.request.tpot_slo_ms / 1000 if r.request.tpot_slo_ms is not None else None for r in self._in_flight],
                    slo, self._admitted_since))
            self._admitted_since += 1
        finally:
            self._gate.remove(ticket)
            self._waiting -= 1
            self.requests.waiting.set(self._waiting)
            await self._gate_moved()

    async def _gate_moved(self) -> None:
        """Something the SLO admission reads changed: the waiting head looks again."""
        if self.admission is not None:
            async with self._gate_changed:
                self._gate_changed.notify_all()

    @property
    def holding(self) -> int:
        """Requests admitted and not yet freed."""
        return len(self._in_flight)

    def retry_after_s(self, now: float | None = None) -> float:
        """About when a session frees: when the request in flight nearest its end ends, at its own
        pace so far (seconds since it arrived per token it generated: an upper estimate, its time
        to first token included), its tokens left being what ``max_tokens`` leaves (EOS may end it
        sooner); one second where no request has a token yet."""
        now = time.perf_counter() if now is None else now
        ends = []
        for req in self._in_flight:
            made = req.generated - req.request.generated
            if made > 0:
                ends.append((now - req.timer.arrival) / made * max(1, req.request.max_tokens - made))
        return min(ends, default=1.0)

    async def _release(self, session: PooledSession) -> None:
        self._free.append(session)
        async with self._session_freed:
            self._session_freed.notify()

    async def _discard(self, session: PooledSession) -> None:
        """A session the verifier dropped: forget it (its place in the pool opens again)."""
        await session.close()
        self._sessions -= 1
        self.node_metrics.sessions.set(self._sessions)
        async with self._session_freed:
            self._session_freed.notify()

    # ------------------------------------------------------------------ requests

    async def open(self, request: GenerationRequest, identity: object = None, stats: RequestStats | None = None):
        """Admit the request: a session, a draft KV slot and ``StartRequest`` (refusals raise
        :class:`RequestError` here, before any response is sent); then its rounds run in a task.
        ``stats``: filled in as the request's verdicts arrive."""
        if not self.ready():
            raise RequestError("unavailable", "the node's verifier is not serving (unreachable or draining); retry later")
        if request.tpot_slo_ms is not None and self.admission is None:
            raise RequestError("invalid", "tpot_slo_ms needs a node started with --admission slo (this one admits by count)",
                               param="tpot_slo_ms")
        if self.adapting is not None:
            await self.adapting.admit()  # a request waits while new weights wait for a moment with none in flight
        generator = None  # a lookup alone draws nothing
        if not self._inline:
            generator = (torch_generator(request.seed, "request", "draft") if request.seed is not None
                         else torch_generator(self.root_seed, "drafter", self.config.name, request.request_id))
        await self._admit_by_slo(request)
        req = NodeRequest(request, generator, self.requests.track(len(request.prompt_ids)), stats)
        self._in_flight.add(req)  # before the slot exists, so weights never change under a request being admitted
        try:
            await self._call(self.drafter.add, req.key)
            await self._start(req)
        except BaseException as exc:
            await self._end(req, "abort" if isinstance(exc, asyncio.CancelledError) else "error")
            raise
        task = asyncio.get_running_loop().create_task(self._serve(req))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return self._deltas(req, task)

    @staticmethod
    async def _deltas(req: NodeRequest, task: asyncio.Task):
        finished = False
        try:
            while not finished:
                delta = await req.out.get()
                finished = delta.finished
                yield delta
        except StopStringMatched:
            req.stop_string = True  # cancelled below as finished ("stop"), not abandoned
        finally:
            if not finished:  # the client went away, or a stop string came: stop the request (frees the verifier's KV)
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # its cleanup runs to the end

    async def _start(self, req: NodeRequest) -> None:
        """A session and ``StartRequest`` for the request's committed text (prompt + verified
        tokens so far); a pooled session the verifier has forgotten is replaced. While the
        verifier is unavailable (restarting, a link down) the request waits for it as the node's
        start does, up to ``connect_timeout_s``, and goes on from its committed text (a request
        that arrives while the node knows its verifier is down is refused at once: :meth:`open`);
        past that it fails as unavailable."""
        waits = backoff(self.config.connect_timeout_s, cap_s=1.0)
        while True:
            try:
                return await self._start_once(req)
            except RequestError as exc:
                if exc.kind != "unavailable" or (pause := next(waits, None)) is None:
                    raise
                if req.session is not None:  # a session of the verifier that went away
                    session, req.session = req.session, None
                    await self._discard(session)
                await asyncio.sleep(pause)

    async def _start_once(self, req: NodeRequest) -> None:
        for _ in range(MAX_REPAIRS + 1):
            req.session = await self._acquire()
            start = req.start_request()  # a repair does not ask for the prompt's scores again
            try:
                reply = await self.stub.StartRequest(request_to_pb(req.session.session_id, start),
                                                     timeout=self.config.verdict_timeout_s, metadata=self.metadata)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    raise refusal("the request", exc) from None
                session, req.session = req.session, None
                await self._discard(session)
                continue
            req.started(reply.draft_length, reply.round_index)
            features = applied_features(reply)
            req.decode_ahead, req.until_match = "decode_ahead" in features, "decode_ahead_until_match" in features
            if (why := unapplied_setting(req.sampling, reply)) is not None:
                raise RequestError("upstream", f"{why}: this request needs it; upgrade the verifier or leave it out")
            if start.prompt_logprobs is not None and not reply.prompt_logprobs:
                raise RequestError("upstream", "the verifier does not score prompts (a version older than prompt_logprobs): "
                                    "this request needs it for echo with logprobs; upgrade the verifier or leave them out")
            return
        raise RequestError("upstream", f"the verifier dropped this node's sessions {MAX_REPAIRS + 1} times in a row")

    async def _serve(self, req: NodeRequest) -> None:
        reason = "error"
        try:
            while True:
                try:
                    verdict = await self._round(req)
                except SessionLost:
                    req.lost()
                    req.last_verdict_at = None  # the repair's wait is no round's time per token
                    if req.stats.repairs > MAX_REPAIRS:
                        raise RequestError("upstream", f"the verifier dropped this request's session {req.stats.repairs} times") from None
                    session, req.session = req.session, None
                    await self._discard(session)
                    await self._start(req)
                    continue
                # Keep the draft KV of the committed text and the accepted drafts only (the text
                # growing past a rejected draft in transit leaves rejected drafts cached otherwise).
                # A lookup caches nothing past the committed text, nor does a model whose round
                # drafted nothing (its KV ends at or before the text): no hop to the drafting thread.
                if not self._inline and req.drafted_last:
                    await self._call(self.drafter.rollback, req.key, len(req.committed), verdict.num_accepted)
                req.timer.tokens(len(verdict.token_ids))
                if not req.apply(verdict):  # its earlier tokens reached the client: not repaired
                    raise RequestError("upstream", "a verdict does not match this node's text (committed length or prefix hash)")
                prompt_scores = None
                if req.request.prompt_logprobs is not None and not req.prompt_scored:
                    prompt_scores, req.prompt_scored = logprobs_from_pb(verdict.prompt_logprobs), True
                    if [lp.token_id for lp in prompt_scores] != req.request.prompt_ids[1:]:
                        raise RequestError("upstream", "a verdict's prompt log-probabilities do not match this request's prompt")
                req.out.put_nowait(Delta(list(verdict.token_ids), verdict.finished, verdict.finish_reason or None,
                                         logprobs=verdict_logprobs(verdict) if req.request.logprobs is not None else None,
                                         prompt_logprobs=prompt_scores))
                if verdict.finished:
                    reason = finished_reason(verdict.finish_reason)
                    return
        except asyncio.CancelledError:
            reason = "stop" if req.stop_string else "abort"
            raise
        except Exception as exc:  # the client is told; the node and its other requests go on
            if isinstance(exc, RequestError):
                error = exc
            elif isinstance(exc, grpc.aio.AioRpcError):
                error = refusal("a round", exc)
            else:
                error = (RequestError("upstream", str(exc)) if isinstance(exc, DrafterError)
                         else RequestError("internal", f"{type(exc).__name__}: {exc}"))
            req.out.put_nowait(Delta([], True, f"error: {error.message}", error=error))
        finally:
            await self._end(req, reason)

    async def _end(self, req: NodeRequest, reason: str) -> None:
        """Free everything the request holds: its request on the verifier (if still running),
        its session, its draft KV slot; to the end, even when the caller is cancelled again
        meanwhile (:func:`run_to_the_end`; :meth:`stop` waits for it)."""
        await run_to_the_end(self._free_request(req, reason), self._cleanups)

    async def _free_request(self, req: NodeRequest, reason: str) -> None:
        req.timer.finish(reason)
        self.paying.forget(req.key)
        self.evidence.forget(req.key)
        self._looked.pop(req.key, None)
        if req.session is not None:
            if req.in_progress:
                try:
                    await self.stub.FinishRequest(pb.FinishRequestRequest(session_id=req.session.session_id), timeout=5.0,
                                                  metadata=self.metadata)
                except grpc.aio.AioRpcError:
                    pass  # it already ended there, or the verifier is gone
                req.in_progress = False
            session, req.session = req.session, None
            await self._release(session)
        if req.key in self.drafter.slots:  # a source that learns across requests keeps its text
            await self._call(self.drafter.remove, req.key, list(req.committed))
        self._in_flight.discard(req)
        await self._gate_moved()
        if self.adapting is not None:
            await self.adapting.finished(req, reason)

    async def _round(self, req: NodeRequest) -> pb.Verdict:
        session, length, round_index = req.session, req.length, req.round_index
        self._looked.pop(req.key, None)  # a round lost with its session is not heard
        if req.ahead > 0:  # the verifier decodes this round by itself: nothing to draft or send
            req.drafted_last = 0
            verdict = await session.verdict(round_index, self.config.verdict_timeout_s)
            req.ahead = verdict.decode_ahead_left if req.until_match else req.ahead - 1
            await self._heard(req, verdict)
            return verdict
        ahead = until = 0
        if (self.config.draft_length == "goodput" and self._inline and self.drafter.free_proposals
                and (costs := self.paying.round_costs()) is not None):
            draft = self._paying_lookup(req, await self._draft(req, length), costs)
            if not draft.token_ids and req.until_match and self.drafter.own_text_only:
                # nothing pays here: the verifier decodes until the text holds a match that would
                ahead = LOOKUP_DECODE_AHEAD
                until = self.evidence.paying_from(req.key, length, *costs, self.paying.draft_s_per_token)
        else:
            if self.config.draft_length == "goodput":
                length = self.paying.length(req.key, req.length)
                if length == 0 < req.length and req.decode_ahead:  # drafts do not pay: no round trip a token
                    ahead = min(self.paying.idle_run(req.key) - 1, MAX_DECODE_AHEAD)
            draft = await self._draft(req, length)
        req.drafted_last = len(draft.token_ids)
        message = draft_to_pb(session.session_id, round_index, DraftOutput(draft.token_ids, draft.probs), req.sampling)
        if ahead and not draft.token_ids:  # nothing forced by a grammar was drafted either
            message.decode_ahead, message.decode_ahead_until_match, req.ahead = ahead, until, ahead
        sent = time.perf_counter()
        try:
            reply = await self.stub.SubmitDraft(message, timeout=self.config.verdict_timeout_s, metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            # The session is gone: forgotten by the verifier, or with the verifier itself (it went
            # away or restarts: UNAVAILABLE, or CANCELLED as it stops; this node cancels no call).
            # Repaired from the committed text (_start waits for a verifier to come back).
            if exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                raise SessionLost() from None
            raise
        verdict = reply.verdict if reply.HasField("verdict") else await session.verdict(round_index, self.config.verdict_timeout_s)
        if message.decode_ahead and req.until_match:  # fewer where it stopped at a match or the request ended
            req.ahead = verdict.decode_ahead_left
        round_s = time.perf_counter() - sent
        self.node_metrics.round_trip_seconds.observe(round_s)
        self.node_metrics.draft_length.observe(req.length)  # what the verifier allotted (the draft may be shorter)
        self.paying.observe_round(req.key, len(draft.token_ids), verdict.num_accepted, round_s)
        if (looked := self._looked.pop(req.key, None)) is not None:
            evidence, forced, probe = looked
            self.evidence.observe(req.key, evidence, len(draft.token_ids) - forced, max(0, verdict.num_accepted - forced), probe)
        await self._heard(req, verdict)
        return verdict

    async def _heard(self, req: NodeRequest, verdict: pb.Verdict) -> None:
        """What every verdict tells the node's metrics and its SLO admission."""
        self.spec.observe(verdict.num_drafted, verdict.num_accepted)
        if self.admission is not None:  # a time per token at this many in flight
            now = time.perf_counter()
            if req.last_verdict_at is not None:
                self.admission.observe_round(len(self._in_flight), now - req.last_verdict_at, len(verdict.token_ids))
                self._admitted_since = 0
                await self._gate_moved()
            req.last_verdict_at = now

    def _paying_lookup(self, req: NodeRequest, draft: ChainDraft, costs: tuple[float, float]) -> ChainDraft:
        """A lookup's draft of the whole allotment cut to the prefix that pays at its evidence's
        acceptance against the node's round costs ``(t_round, t_verify)`` (drafting time a token
        as the longest chain's), or a one-token probe
        (:meth:`~goodspeed.scheduler.EvidenceAcceptance.keep`)."""
        evidence, forced = draft.evidence or 0, draft.forced
        [(keep, probe)] = self.evidence.keep([(req.key, evidence, forced, len(draft.token_ids))], *costs,
                                             self.paying.draft_s_per_token)
        if keep > forced:
            self._looked[req.key] = (evidence, forced, probe)
        if keep == len(draft.token_ids):
            return draft
        return ChainDraft(draft.token_ids[:keep], None, draft.token_probs[:keep], draft.sampled, min(forced, keep), draft.evidence)

    # ------------------------------------------------------------------ drafting

    async def _draft(self, req: NodeRequest, length: int) -> ChainDraft:
        """Queue the request for the next batched drafting call and wait for its draft; a lookup
        drafts here at once (no model to run, nothing to batch: the hops to the drafting thread
        were most of a round's turnaround on the node)."""
        if self._inline:
            key, started = req.key, time.perf_counter()
            drafts, forced = draft_with_forced(self.drafter, {key: list(req.committed)}, {key: length},
                                               {key: req.sampling}, {key: req.generator}, {key: req.history})
            self._drafted(time.perf_counter() - started, drafts, forced)
            return drafts[key]
        if length <= 0:  # nothing to draft, nothing forced (fast-forward drafts within the length): no hop either
            return ChainDraft([], None, [])
        future = asyncio.get_running_loop().create_future()
        self._jobs.append(DraftJob(req, length, list(req.committed), future))
        self._jobs_ready.set()
        return await future

    def _drafted(self, seconds: float, drafts: dict[str, ChainDraft], forced: int) -> None:
        self.node_metrics.draft_seconds.observe(seconds)
        self.node_metrics.forced_tokens.inc(forced)
        self.paying.observe_drafting(seconds, max(len(d.token_ids) for d in drafts.values()))

    async def _batch_loop(self) -> None:
        """Draft every queued request in one batched call (one forward per draft step)."""
        while True:
            await self._jobs_ready.wait()
            self._jobs_ready.clear()
            jobs = [job for job in self._jobs if not job.future.done()]
            self._jobs = []
            if not jobs:
                continue
            started = time.perf_counter()
            try:
                drafts, forced = await self._call(
                    draft_with_forced, self.drafter, {j.request.key: j.committed for j in jobs},
                    {j.request.key: j.length for j in jobs}, {j.request.key: j.request.sampling for j in jobs},
                    {j.request.key: j.request.generator for j in jobs}, {j.request.key: j.request.history for j in jobs})
            except Exception as exc:  # a device error: every request in the batch fails, the node goes on
                for job in jobs:
                    if not job.future.done():
                        job.future.set_exception(DrafterError(f"drafting failed: {type(exc).__name__}: {exc}"))
                continue
            self._drafted(time.perf_counter() - started, drafts, forced)
            for job in jobs:
                if not job.future.done():
                    job.future.set_result(drafts[job.request.key])

