"""The draft node's gRPC client: join, follow the verdict stream, draft exactly S_i per round.

The verifier owns the committed text. Verdicts are matched to rounds by ``round_index`` (a
duplicate of an earlier round's verdict, which a retried ``SubmitDraft`` can produce, is skipped).
After every verdict the client checks its own committed length and prefix hash against the
verdict's; on a mismatch it fetches the verifier's tokens (``Resync``) and rebuilds both its draft
cache and the request's output from them. Its sampling stream is derived from its root seed and
name (:mod:`goodspeed.lm.decoding.seeding`), never shared with the verifier's. If the verifier dropped the
session (e.g. the node was frozen past the round deadline), the client joins again and resumes
the request from its committed text: the continuation of a prefix under the target is still the target's own
distribution, so the output stays lossless. While the verifier is unavailable, calls are retried
with jittered exponential backoff up to ``connect_timeout_s``.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from goodspeed.drafter.credentials import ClientTLS, bearer_metadata, open_channel
from goodspeed.drafter.serde import draft_to_pb, unapplied_setting
from goodspeed.drafter.session import DrafterError, DraftSession, SessionLost, VerdictAhead, answers
from goodspeed.serving.generation import GenerationRequest
from goodspeed.serving.sampling_wire import request_to_pb
from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.lm.decoding.seeding import resolve_root_seed, torch_generator
from goodspeed.proto import PROTOCOL_VERSION
from goodspeed.proto.goodspeed.v1 import goodspeed_pb2 as pb
from goodspeed.proto.goodspeed.v1 import goodspeed_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from goodspeed.drafter.runner import DraftRunner

# What a retry may cure: the verifier unreachable, or a call it cancelled. This client cancels
# nothing it sends (its own time limits end as DEADLINE_EXCEEDED), so a CANCELLED call is the
# verifier's: it stopped with the call in flight, and gRPC cancels what is left when a server's
# grace period runs out. Repeating a call that did arrive is safe: a repeated SubmitDraft is
# answered with its round's verdict (``_next_verdict``), and a repeated Join or StartRequest at
# worst leaves a session behind (FAILED_PRECONDITION: this client joins again), which the
# verifier evicts once idle.
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


@dataclass(frozen=True)
class DrafterConfig:
    verifier: str  # HOST:PORT
    name: str
    model_name: str = ""
    fingerprint: str = ""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 64
    eos_token_ids: tuple[int, ...] = ()
    seed: int | None = None  # root seed; the sampling stream is (root, 'drafter', name). None: OS entropy
    connect_timeout_s: float = 60.0
    verdict_timeout_s: float = 120.0
    token: str | None = None  # bearer token (the verifier's --auth-tokens); sent on every call
    tls: ClientTLS | None = None  # TLS to the verifier (mutual with a client certificate); None: plaintext
    proactive: bool = True  # draft the next round while a draft is in flight (drafter.runner, SpecEdge)
    # Told once, with a sentence, when the verifier does not answer at the first try (a CLI prints
    # it, so a wrong address is not a silent wait of connect_timeout_s); None: nothing is said.
    on_wait: Callable[[str], None] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:  # min_tokens holds the ending tokens back in the draft too
        object.__setattr__(self, "sampling", self.sampling.ending_with(self.eos_token_ids))


@dataclass
class RequestResult:
    id: str
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    transit_tokens: int = 0  # of token_ids, those the verifier decoded while a draft was in transit
    wall_s: float = 0.0
    repairs: int = 0
    # Proactive drafting: rounds that pre-drafted, of those the verdicts that matched (hits), the
    # tokens pre-drafted and those sent as a later draft, and the seconds spent pre-drafting the
    # tokens that were sent (drafting time taken off the round's critical path).
    predrafted_rounds: int = 0
    proactive_hits: int = 0
    predrafted_tokens: int = 0
    predraft_used_tokens: int = 0
    hidden_s: float = 0.0


class DrafterClient:
    def __init__(self, config: DrafterConfig, runner: DraftRunner) -> None:
        self.config, self.runner = config, runner
        self.channel = open_channel(config.verifier, config.tls)
        self.stub = pb_grpc.VerifierStub(self.channel)
        self.metadata = bearer_metadata(config.token)
        self.root_seed = resolve_root_seed(config.seed)
        self.generator = torch_generator(self.root_seed, "drafter", config.name)
        self.session_id = ""
        self._verdicts: queue.Queue = queue.Queue()
        self._stream = None
        self._pump_thread: threading.Thread | None = None
        self._predraft_s_per_token: float | None = None  # the last pre-draft's seconds per token

    # ------------------------------------------------------------------------- plumbing

    def _retry(self, fn, request):
        """Call ``fn(request)``, retrying ``RETRYABLE`` codes with jittered exponential backoff."""
        for pause in backoff(self.config.connect_timeout_s, cap_s=2.0):
            try:
                return fn(request, timeout=self.config.verdict_timeout_s, metadata=self.metadata)
            except grpc.RpcError as exc:
                if exc.code() not in RETRYABLE or pause is None:
                    raise
            time.sleep(pause)

    def wait_until_serving(self) -> None:
        health = health_pb2_grpc.HealthStub(self.channel)
        for attempt, pause in enumerate(backoff(self.config.connect_timeout_s, cap_s=1.0)):
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if pause is None:
                break
            say_waiting(self.config, attempt == 0)
            time.sleep(pause)
        raise DrafterError(f"verifier {self.config.verifier} not serving after {self.config.connect_timeout_s} s")

    def join(self) -> None:
        try:
            reply = self._retry(self.stub.Join, pb.JoinRequest(
                drafter_name=self.config.name, model_name=self.config.model_name,
                tokenizer_fingerprint=self.config.fingerprint, protocol_version=PROTOCOL_VERSION,
                transit=True))  # DraftRunner.apply reads verdicts with tokens decoded in transit
        except grpc.RpcError as exc:  # e.g. UNAUTHENTICATED, a tokenizer mismatch, too many drafters
            raise DrafterError(f"join refused: {exc.code().name}: {exc.details()}") from None
        self._close_stream()  # a rejoin replaces the old session's stream
        self.session_id = reply.session_id
        self._verdicts = queue.Queue()
        self._stream = self.stub.StreamVerdicts(pb.StreamVerdictsRequest(session_id=self.session_id), metadata=self.metadata)
        self._pump_thread = threading.Thread(target=self._pump, args=(self._stream, self._verdicts), daemon=True)
        self._pump_thread.start()

    def _close_stream(self) -> None:
        """Cancel the verdict stream and wait for its reader, so no thread is inside gRPC at exit."""
        if self._stream is not None:
            self._stream.cancel()
            self._pump_thread.join(timeout=5.0)
            self._stream = None

    @staticmethod
    def _pump(stream, sink: queue.Queue) -> None:
        try:
            for verdict in stream:
                sink.put(verdict)
        except grpc.RpcError as exc:
            sink.put(exc)
        sink.put(None)

    def _next_verdict(self, round_index: int) -> pb.Verdict:
        """The stream's verdict for ``round_index``. Verdicts of earlier rounds are skipped: a
        retried ``SubmitDraft`` can get a verified round's verdict in its reply while the same
        verdict is also on the stream, and taking it for the next round would commit stale tokens."""
        deadline = time.monotonic() + self.config.verdict_timeout_s
        while True:
            try:
                item = self._verdicts.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise DrafterError(f"no verdict for round {round_index} within {self.config.verdict_timeout_s} s") from None
            if not isinstance(item, pb.Verdict):
                raise SessionLost()
            if answers(item, round_index):  # a later round's raises VerdictAhead: only a resync can tell
                return item

    def close(self) -> None:
        if self.session_id:
            try:
                self.stub.Leave(pb.LeaveRequest(session_id=self.session_id), timeout=5.0, metadata=self.metadata)
            except grpc.RpcError:
                pass
        self._close_stream()
        self.channel.close()

    # ------------------------------------------------------------------------ generation

    def generate(self, request_id: str, prompt_ids: list[int]) -> RequestResult:
        """One request to its end: rounds on :class:`~goodspeed.drafter.session.DraftSession`,
        repaired in place when the verifier loses the session or the text drifts."""
        result = RequestResult(request_id, [int(t) for t in prompt_ids])
        session = DraftSession(GenerationRequest(request_id, list(result.prompt_ids), self.config.max_new_tokens,
                                                 self.config.sampling, self.config.eos_token_ids), stats=result)
        started = time.perf_counter()
        self._start(session)
        while True:
            try:
                verdict = self._round(session, result)
            except SessionLost:
                session.lost()
                self.join()
                self._start(session)
                continue
            except VerdictAhead:
                self._resync(session)
                continue
            if session.apply(verdict):
                if verdict.finished:
                    break
            elif verdict.finished:  # the request is over on the verifier: its text can no longer be fetched
                raise DrafterError(f"request {request_id}: the final verdict's prefix hash does not match this drafter's text")
            else:
                self._resync(session)
        result.token_ids, result.wall_s = session.output, time.perf_counter() - started
        return result

    def _start(self, session: DraftSession) -> None:
        """``StartRequest``; when the verifier no longer knows the session (it restarted between
        requests, or dropped this drafter), join again once and start there."""
        self.runner.start(session.committed, session.generated)
        request = request_to_pb(self.session_id, session.start_request())
        try:
            reply = self._retry(self.stub.StartRequest, request)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise DrafterError(f"request {session.key} refused: {exc.code().name}: {exc.details()}") from None
            session.lost()
            self.join()
            request.session_id = self.session_id
            try:
                reply = self._retry(self.stub.StartRequest, request)
            except grpc.RpcError as again:
                raise DrafterError(f"request {session.key} refused after rejoining: {again.code().name}: {again.details()}") from None
        if (why := unapplied_setting(self.config.sampling, reply)) is not None:
            raise DrafterError(f"request {session.key}: {why}; upgrade the verifier or leave it out")
        session.started(reply.draft_length, reply.round_index)

    def _round(self, session: DraftSession, result: RequestResult) -> pb.Verdict:
        length, round_index = session.length, session.round_index
        ready = len(self.runner.ahead)
        out = self.runner.draft(length, self.config.sampling, self.generator)
        if ready and self._predraft_s_per_token is not None:
            used = min(ready, length)
            result.predraft_used_tokens += used
            result.hidden_s += used * self._predraft_s_per_token
        try:
            reply = self._retry(self.stub.SubmitDraft, draft_to_pb(self.session_id, round_index, out, self.config.sampling))
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise SessionLost() from None
            raise DrafterError(f"draft refused: {exc.code().name}: {exc.details()}") from None
        if reply.HasField("verdict"):
            verdict = reply.verdict
        else:
            self._predraft(length, result)
            verdict = self._next_verdict(round_index)
        if self.runner.apply(verdict.token_ids, verdict.num_accepted):
            result.proactive_hits += 1
        return verdict

    def _predraft(self, length: int, result: RequestResult) -> None:
        """Proactive drafting while the draft is verified: up to ``length`` tokens after the
        guessed bonus token, stopping as soon as the verdict arrives (``runner.predraft``)."""
        self._predraft_s_per_token = None
        if not self.config.proactive or length <= 0:
            return
        started = time.perf_counter()
        made = self.runner.predraft(length, length, self.config.sampling, self.generator, stop=lambda: not self._verdicts.empty())
        if made:
            result.predrafted_rounds += 1
            result.predrafted_tokens += made
            self._predraft_s_per_token = (time.perf_counter() - started) / (made + 1)  # + the guess's forward

    def _resync(self, session: DraftSession) -> None:
        """Take the verifier's committed tokens (:meth:`DraftSession.resync`) and redraft from them."""
        reply = self._retry(self.stub.Resync, pb.ResyncRequest(session_id=self.session_id))
        session.resync(reply.committed_ids, reply.draft_length, reply.round_index)
        self.runner.start(session.committed, session.generated)


def backoff(timeout_s: float, cap_s: float):
    """Jittered exponential pauses (from 50 ms, doubling up to ``cap_s``) for one attempt each;
    the last attempt, when the next pause would pass ``timeout_s``, gets ``None``."""
    deadline, delay = time.monotonic() + timeout_s, 0.05
    while True:
        pause = delay * (0.5 + random.random())
        yield pause if time.monotonic() + pause <= deadline else None
        delay = min(delay * 2, cap_s)


def say_waiting(config, first: bool) -> None:
    """After a first failed reach of the verifier, tell ``config.on_wait`` (a drafter's or a
    node's config) what is being waited for, once."""
    if first and config.on_wait is not None:
        config.on_wait(f"waiting for the verifier at {config.verifier} to serve (up to {config.connect_timeout_s:g} s)")
