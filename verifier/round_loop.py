"""The verifier's round loop: when a verification step runs, who is evicted, what the log says.

The RPC handlers (:mod:`goodspeed.verifier.server`) validate a call, hand it to the engine and
tell the loop what changed (:meth:`RoundLoop.queued`, :meth:`RoundLoop.forget`,
:meth:`RoundLoop.wake`); the loop alone decides when the engine verifies, counts missed rounds,
sweeps idle sessions and writes the :class:`~goodspeed.verifier.records.RoundRecord`. It owns the
registry of edge drafters (:class:`~goodspeed.verifier.edge_drafters.DrafterRegistry`: the
handlers add to it, :meth:`RoundLoop.drop` removes from it), so it calls nothing of the server's. Its state
(``_queued``: sessions with a draft waiting) changes only on the event loop, from what engine
calls returned, so it never races the engine thread.

Two modes (``ServerConfig.rounds``):

* ``sync`` — GoodSpeed's lockstep round (the paper's model, Alg. 1): a round closes when every
  drafter with a request in progress has submitted, or ``round_deadline_ms`` after its first
  draft. A drafter that misses more than ``max_missed_rounds`` rounds in a row is dropped.
* ``async`` — continuous batching of drafts: whenever the engine is free and a draft is waiting,
  a step runs with the drafts that are there, and waits for one not yet here only while that pays
  (below); drafts that arrive while a step runs join the next one, so under load batches form by
  themselves, and a draft that is here is not held back for long by one still on a slow link.
  Each drafter advances at its own cadence. Missed rounds mean nothing here (nobody waits for
  anyone); a drafter that sends nothing for ``idle_timeout_s`` with a request in progress is
  dropped.

How long an async step waits. Drafter ``j``'s next draft is due at its last verdict plus its
smoothed cycle (link and drafting, as measured here) less two smoothed absolute deviations: a
drafter whose cycles vary (drafting on a loaded core) is thus expected early, and one with no
cycle yet, or already late, may come any moment. Say the step opened at ``t`` with the queued
drafters ``Q`` and ``j``'s draft comes at ``t + d``. Closing now delivers ``Q``'s verdicts ``d``
earlier; ``j``'s draft then waits for the step to end and for a step of its own, about one step
``f`` more. GoodSpeed's objective on tokens per second is ``sum_i log(T_i / P_i)``, with ``T_i``
the tokens a round of drafter ``i`` gives and ``P_i`` its *period*, the seconds between two of its
verdicts (link, drafting, the wait for a step and the step). It moves by ``-dx / P_i`` when
``i``'s round grows by ``dx``, so with weights ``w_i = 1 / P_i`` waiting pays iff
``d * sum_{i in Q} w_i < (f - d) * w_j``, that is iff

    d < f * w_j / (W_Q + w_j),       W_Q = sum of the queued drafters' weights.

With equal periods that is ``f / (|Q| + 1)``: the more drafts wait, the less a late one is waited
for; a fast drafter is waited for longer than a slow one, whose round a step barely lengthens.
``f`` is the smoothed time of the last steps, and no step waits longer than ``f`` (the window; the
ski-rental bound: waiting longer than a step costs more than running one) nor than
``round_deadline_ms``. The step closes at once when no drafter is due before its own limit
(``none-due``). Waiting up to ``f`` for every due draft, whatever waits for it, would idle the
engine for the slowest link's drafter at every step (docs/EXPERIMENT-LOG.md, *How long a step waits*).

With transit decoding (``EngineConfig.transit_tokens``, async only) the steps the loop runs also
decode the next tokens of drafters whose draft is still on the way (:mod:`goodspeed.verifier.engine`);
the loop never runs a step for them alone. Each such token is ``1 / T_i`` of drafter ``i``'s round,
in the same units as above (``T_i``: the smoothed tokens its verdicts carry, the decoded ones
included). So a step closed now also decodes one for ``j`` (worth ``v_j``), and while the engine
waits ``d`` the drafters away lose ``d / f`` of a step's tokens (worth ``V``, summed over them,
``j`` aside). Waiting for ``j`` then pays iff ``d * W_Q + d * (V - v_j) / f + v_j < (f - d) * w_j``,
that is iff

    d < (f * w_j - v_j) / (W_Q + (V - v_j) / f + w_j),

which is the rule above when no drafter decodes in transit.

Steps for transit rows alone (``ServerConfig.transit_alone``, off by default). Behind long links
the steps that drafts open leave the engine idle most of the time while drafts are away, and
the away drafters get a token only when some draft opens a step. With this setting, when no
draft is queued and the engine can still decode for some away drafter
(:meth:`~goodspeed.verifier.engine.VerificationEngine.transit_room`), the loop runs a step of
transit rows alone (``closed = "transit"``) if, in the same units, it pays. It decodes a token
for each drafter ``i`` in the room, worth ``1 / T_i``. It occupies the engine for about one step
``f``, so drafter ``j``'s draft, due at ``t + d``, waits ``f - d`` longer when ``d < f``, which
costs ``(f - d) * w_j``; a draft already late (or with no cycle yet) may come any moment and
costs ``f * w_j``. So the step runs iff

    sum_{i in room} 1 / T_i > sum_{j away} w_j * max(0, f - max(0, d_j)).

Both sides only move on events (a draft queued, a step's verdicts, a request started), as the
cost of a due draft only grows while it comes nearer, so a step that does not pay now is not
polled for: the loop checks again at its next event (or its idle sweep, at most a second on).
The engine's cap (``transit_tokens`` a verdict) bounds these steps as it bounds transit rows, so
a drafter that goes silent costs at most that many steps. Their time is not in the smoothed step
time ``f``, which stays that of the steps that verify drafts.

Why the period and not the *cycle* (link and drafting only), with a transit token worth ``1 / X``
(eq. 4's goodput of the drafts alone): on the real pair behind links, cycle weights are 2-5 times
too large (periods of 112-245 ms against cycles of 22-117 ms, the fastest drafter's the most)
against the transit tokens' worth (``X`` 1.0-1.4 against 1.6-2.5 tokens a verdict carried), so
steps wait for drafts worth less than the wait. The period rule gave 2.8% more throughput there,
with transit decoding and without (docs/EXPERIMENT-LOG.md, *How long a step waits: one over the
period*).

In both modes the budget ``C`` bounds every step: a drafter's allotment stays outstanding until
its draft is verified, and the policy shares only what the others' outstanding allotments leave
of ``C`` (:class:`goodspeed.scheduler.DraftAllotments`), so a step never verifies more than ``C``
draft tokens plus one pending token per row. In async mode a step often verifies one drafter while
the others' drafts are on their way, so by default (``ServerConfig.async_shares = "plan"``) the
policy splits ``C`` among every drafter with a request in progress at each step, and the step's
drafters take their planned shares as far as the others' outstanding allotments leave room.
With ``"free"`` they split what the others left, so a lone drafter is given all that is free
whatever the policy, and the shares follow the order of the verdicts.

Chunked prefill (``EngineConfig.prefill_chunk``): a StartRequest whose prompt the engine queued
waits here (:meth:`RoundLoop.started`) until a step completes its prefill. Every verification
step carries at most one chunk; while no step is ready (no draft queued, or a sync round still
waiting for drafts) the loop runs prefill-only steps. A round that waited behind a prefill-only
step carries no chunk itself, so one long prompt delays any round by at most one chunk.

Every record says why its step closed (``closed``, :data:`~goodspeed.verifier.records.CLOSE_REASONS`):
``all`` (every drafter submitted), ``window`` (the wait ran out: in sync mode the round deadline;
in async mode the window, or the limit of the due draft it waited for), ``none-due`` (async: no
other draft due soon enough to wait for), ``local`` (local serving's work was waiting) or
``transit`` (a step for transit rows alone, above).

Each drafter's *period* — the seconds between two of its verdicts, the round time it sees: link,
drafting and verification — is measured here and given to the engine with the step that ends it
(``run_round(periods=...)``), for the time-aware allocation (:mod:`goodspeed.scheduler.timing`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from goodspeed.serving.aio import within
from goodspeed.serving.metrics import finished_reason
from goodspeed.verifier import errors
from goodspeed.verifier.edge_drafters import DrafterRegistry
from goodspeed.verifier.records import DrafterRound, LocalRound, RoundRecord
from goodspeed.verifier.serde import verdict_to_pb

MAX_FAILED_ROUNDS = 3  # consecutive failed rounds after which the round loop gives up (NOT_SERVING)
STEP_SMOOTHING = 0.2  # weight of the newest step in the async coalescing window's moving average


class RoundLoop:
    """Runs verification steps on the engine thread as the mode says (see the module docstring)."""

    def __init__(self, engine, local, config, metrics, log, registry: DrafterRegistry, call: Callable[..., Awaitable]) -> None:
        """``registry``: the edge drafters (the loop drops them; the handlers add them); ``call``:
        runs a function on the engine's thread."""
        self.engine, self.local, self.config, self.metrics, self.log = engine, local, config, metrics, log
        self.registry, self.call = registry, call
        self.drafters = registry.by_session  # the registry's own dict (by session id), read here, never copied
        self._queued: set[str] = set()  # sessions with a draft waiting for the next step
        self._wakeup = asyncio.Event()
        self._failed_rounds = 0  # consecutive steps that raised
        self._round_opened = time.perf_counter()
        self._step_s: float | None = None  # smoothed seconds per verification step (async window)
        self._starting: dict[str, asyncio.Future] = {}  # sessions waiting for their prompt's prefill -> first draft length
        self._ready: dict[str, int] = {}  # prefilled before their StartRequest began to wait (kept for it)

    # ------------------------------------------------------------------ told by the handlers

    def queued(self, session_id: str, arrived: float) -> None:
        """The engine queued the session's draft, which arrived at ``arrived`` (perf_counter:
        before the engine call, which may wait behind a step), for the next step."""
        drafter = self.drafters[session_id]
        drafter.receive_s = max(0.0, arrived - self._round_opened)
        if drafter.verdict_at is None:
            drafter.cycle_s = None
        else:
            drafter.observe_cycle(arrived - drafter.verdict_at)
        self._queued.add(session_id)
        self._wakeup.set()

    def forget(self, session_id: str) -> None:
        """The session's request ended or the session left: the step may close without it (and a
        StartRequest waiting for its prefill gets an error)."""
        self._queued.discard(session_id)
        self._ready.pop(session_id, None)
        waiting = self._starting.pop(session_id, None)
        if waiting is not None and not waiting.done():
            waiting.set_exception(errors.NoActiveRequestError(f"session {session_id}'s request ended while its prompt was prefilled"))
        self._wakeup.set()

    async def drop(self, session_id: str, reason: str) -> None:
        """Drop a drafter: no step may include it from now on, and the registry frees what it
        held (idempotent)."""
        if session_id not in self.registry:
            return
        self.forget(session_id)  # before the registry's await: no step may include it now
        await self.registry.remove(session_id, reason)

    async def started(self, session_id: str) -> int:
        """Wait until the steps have prefilled the session's queued prompt (chunked prefill);
        returns its first draft length."""
        if session_id in self._ready:
            return self._ready.pop(session_id)
        waiting = self._starting[session_id] = asyncio.get_running_loop().create_future()
        self._wakeup.set()
        try:
            return await waiting
        finally:
            if self._starting.get(session_id) is waiting:
                del self._starting[session_id]

    def _resolve(self, started: dict[str, int]) -> None:
        for session_id, length in started.items():
            if session_id not in self.drafters:  # a local-serving request: LocalServing takes it from here
                continue
            waiting = self._starting.pop(session_id, None)
            if waiting is None:  # its StartRequest has not begun to wait yet
                self._ready[session_id] = length
            elif not waiting.done():
                waiting.set_result(length)

    def wake(self) -> None:
        """Something changed that may let a step close (a local request arrived)."""
        self._wakeup.set()

    # ------------------------------------------------------------------------------ the loop

    @property
    def window_s(self) -> float:
        """How long a step waits for more drafts after the first one arrived."""
        deadline = self.config.round_deadline_ms / 1000
        if self.config.rounds == "sync":
            return deadline
        return min(deadline, self._step_s if self._step_s is not None else 0.0)

    def _everyone_submitted(self) -> bool:
        return all(d.session_id in self._queued for d in self.drafters.values() if d.in_request)

    def _weights(self) -> dict[str, float]:
        """Each drafter's weight in the log utility of tokens per second: one over its smoothed
        period, the seconds between two of its verdicts (a round that is ``x`` seconds longer
        costs ``log`` rate ``x / period``). Before its second verdict, its cycle plus a step (the
        least a period can be); with neither, what the others weigh on average."""
        step = self.window_s
        known = {}
        for sid, d in self.drafters.items():
            if not d.in_request:
                continue
            if d.period_mean_s is not None and d.period_mean_s > 0:
                known[sid] = 1.0 / d.period_mean_s
            elif d.cycle_mean_s is not None and d.cycle_mean_s + step > 0:
                known[sid] = 1.0 / (d.cycle_mean_s + step)
        fallback = sum(known.values()) / len(known) if known else 1.0
        return {sid: known.get(sid, fallback) for sid, d in self.drafters.items() if d.in_request}

    def _wait_until(self, opened: float, now: float) -> float | None:
        """Async: until when (``perf_counter``) the step that opened at ``opened`` is worth holding
        open for a draft not yet here; None when no draft is (the module docstring derives the rule).

        Drafter ``j``'s draft is due at its last verdict plus :attr:`Drafter.due_after_s`; one with no
        cycle yet, or already late, may come any moment. Waiting for it is worth it until
        ``opened + (f * w_j - v_j) / (W + (V - v_j) / f + w_j)``, where ``f`` is the smoothed step time (the
        window), ``w_j`` its weight and ``W`` the queued drafters' (:meth:`_weights`); with transit
        decoding, ``V`` is the value of the tokens a step decodes for the other drafters whose
        drafts are away and ``v_j`` that of the one it would decode for ``j`` (:meth:`_transit_values`;
        both 0 without it). Never past the window."""
        weights = self._weights()
        queued = sum(weights.get(sid, 0.0) for sid in self._queued)
        values = self._transit_values()
        away = sum(values.values())
        step = self.window_s
        until = None
        for sid, w in weights.items():
            if sid in self._queued:
                continue
            d = self.drafters[sid]
            v = values.get(sid, 0.0)
            gain = step * w - v  # what waiting saves j, less the token a step closed now decodes for it
            if gain <= 0:
                continue
            limit = opened + gain / (queued + (away - v) / step + w)
            if now < limit and d.due_at(now) <= limit:
                until = limit if until is None else max(until, limit)
        return until

    def _transit_values(self) -> dict[str, float]:
        """With transit decoding: each drafter with a request whose draft is away (not queued) gets
        a token from every step that runs, worth ``1 / T`` of its round (``T``: the smoothed tokens
        its verdicts carry, 1 before its first) in the same log-rate units as a step's delay
        weighed by :meth:`_weights`. Empty without transit decoding."""
        return {sid: 1.0 / max(d.tokens_mean or 1.0, 1.0) for sid, d in self.drafters.items()
                if d.transit and d.in_request and sid not in self._queued}

    async def _transit_step_pays(self) -> bool:
        """Whether a step for transit rows alone, run now, is worth the delay it may cause the
        drafts not yet here (the module docstring derives the rule)."""
        if self._wakeup.is_set():  # an event is waiting to be seen first (a draft may have arrived)
            return False
        room = set(await self.call(self.engine.transit_room))
        return self._transit_step_worth(room, time.perf_counter())

    def _transit_step_worth(self, room: set[str], now: float) -> bool:
        """The rule itself, at ``now``, for the sessions in ``room``: the tokens such a step
        decodes against the delay it may cause; never while a draft is queued (one may have
        arrived while the engine answered)."""
        if self._queued:
            return False
        gain = sum(v for sid, v in self._transit_values().items() if sid in room)
        if gain <= 0:
            return False
        step = self.window_s
        # j's draft waits what is left of the step when it comes (the whole step when late or unmeasured)
        cost = sum(w * max(0.0, step - max(0.0, self.drafters[sid].due_at(now) - now)) for sid, w in self._weights().items())
        return gain > cost

    def _close_reason(self, opened: float, now: float) -> str | None:
        """Why the step waiting for drafts since ``opened`` closes at ``now`` (``perf_counter``; one
        of :data:`~goodspeed.verifier.records.CLOSE_REASONS`), or None while it waits on."""
        if self._everyone_submitted():
            return "all"
        if self._local_work():
            return "local"
        if now >= opened + self.window_s:
            return "window"
        if self.config.rounds == "async" and self._wait_until(opened, now) is None:
            return "none-due"
        return None

    def _wait_s(self, opened: float) -> float:
        """How long the step that opened at ``opened`` waits for its next wake-up before closing."""
        now = time.perf_counter()
        until = opened + self.window_s
        if self.config.rounds == "async":
            until = self._wait_until(opened, now) or now
        return max(0.0, until - now)

    def _local_work(self) -> bool:
        return self.local is not None and self.local.has_work

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        sweep_every_s = min(1.0, self.config.idle_timeout_s / 2, self.config.stream_open_timeout_s / 2)
        last_sweep = loop.time()
        while True:
            if loop.time() - last_sweep > sweep_every_s:
                await self._sweep_idle()  # missed-round counting cannot act when no edge rounds run
                last_sweep = loop.time()
            if self._local_work():
                await self._close(local=True, closed="local")
                continue
            if self._starting and not self._queued:  # nothing to verify: the engine prefills
                await self._prefill()
                continue
            if not self._queued and self.config.transit_alone and await self._transit_step_pays():
                await self._close(closed="transit")
                continue
            if not await self._woken(sweep_every_s) or not self._queued:
                continue
            opened = time.perf_counter()
            chunked = False  # a prefill-only step ran while this round waited: the round carries no chunk
            while (closed := self._close_reason(opened, time.perf_counter())) is None:
                if self._starting:
                    await self._prefill()
                    chunked = True
                elif not await self._woken(self._wait_s(opened)):
                    closed = "window"
                    break
            if self._queued:
                await self._close(prefill=not chunked, closed=closed)

    async def _woken(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a wake-up (and consume it); False if none came."""
        try:
            await within(self._wakeup.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        self._wakeup.clear()
        return True

    def _periods(self) -> dict[str, float]:
        """Each queued drafter's seconds since its last verdict (its period ends with this step)."""
        now = time.perf_counter()
        return {sid: now - d.verdict_at for sid in self._queued
                if (d := self.drafters.get(sid)) is not None and d.verdict_at is not None}

    async def _prefill(self) -> None:
        """One prefill-only step (at most one chunk); its completed prompts start drafting."""
        try:
            step = await self.call(self.engine.prefill_step)
        except Exception as exc:
            await self._fail(exc)
            return
        self._failed_rounds = 0
        self._resolve(step.started)
        if not step.tokens:  # nothing left to prefill for those still waiting: their requests are gone
            for session_id in list(self._starting):
                self.forget(session_id)
            return
        self.log.event("prefill", tokens=step.tokens, seconds=round(step.seconds, 6), started=len(step.started))

    def _local_step(self, periods: dict[str, float]):
        """On the engine's thread: local serving queues its drafts, this loop runs the step that
        verifies them with the edge drafts queued, and local serving reads its verdicts."""
        work = self.local.submit_work()
        return None if work is None else self.local.absorb(work, self.engine.run_round(periods=periods))

    async def _close(self, closed: str, local: bool = False, prefill: bool = True) -> None:
        receive_s = time.perf_counter() - self._round_opened
        report = None
        waiting = set(self._queued)  # every draft queued before the step is verified by it
        try:
            if local:
                report = await self.call(self._local_step, self._periods())
                result = report.round if report is not None else None
                if result is None:
                    return
            else:
                result = await self.call(self.engine.run_round, None, self._periods(), prefill)
        except Exception as exc:  # inputs are refused before a step; this is a bug or a device error
            await self._fail(exc)
            return
        self._failed_rounds = 0
        self._resolve(result.started)
        step_s = result.timings.total_s
        if closed != "transit":  # f is the time of the steps that verify drafts (module docstring)
            self._step_s = step_s if self._step_s is None else (1 - STEP_SMOOTHING) * self._step_s + STEP_SMOOTHING * step_s
        sent = time.perf_counter()
        for session_id, verdict in result.verdicts.items():
            self._queued.discard(session_id)
            drafter = self.drafters.get(session_id)
            if drafter is not None:
                drafter.missed, drafter.in_request = 0, not verdict.finished
                drafter.observe_verdict(sent, len(verdict.token_ids))
                drafter.verdict_at = None if verdict.finished else sent
                if drafter.timer is not None:
                    drafter.timer.tokens(len(verdict.token_ids), sent)
                if verdict.finished:
                    self.registry.end_request(drafter, finished_reason(verdict.finish_reason))
                drafter.verdicts.put_nowait(verdict_to_pb(verdict))
        # Queued before the step and not answered: no draft of theirs was left in the engine (a
        # request that ended between the step and its next round decoded ahead): not waited for.
        self._queued -= waiting - result.verdicts.keys()
        for session_id in result.ahead:  # the engine queued their next round itself (decoding ahead)
            drafter = self.drafters.get(session_id)
            if drafter is not None and drafter.in_request:  # else its request ended meanwhile: the engine dropped it too
                drafter.last_seen = time.monotonic()
                self._queued.add(session_id)
        send_s = time.perf_counter() - sent
        self._round_opened = time.perf_counter()
        if not local and self.config.rounds == "sync":
            await self._count_missed(result.verdicts)
        self._record(result, receive_s, send_s, closed, report)
        if self._queued:
            self._wakeup.set()  # drafts that arrived during verification open the next step

    async def _fail(self, exc: Exception) -> None:
        """A step raised: its participants' requests may be half-applied, so their sessions are
        dropped (a drafter rejoins and resumes from the text already verified) and local requests
        end with an error; the loop goes on. ``MAX_FAILED_ROUNDS`` failures in a row mean the
        failure is not one step's: the loop ends (health NOT_SERVING, the daemon exits 1)."""
        self._failed_rounds += 1
        error = f"{type(exc).__name__}: {exc}"
        self.log.event("round_failed", error=error, consecutive=self._failed_rounds)
        if self._failed_rounds >= MAX_FAILED_ROUNDS:
            raise exc
        for session_id in list(self._queued) + list(self._starting):
            await self.drop(session_id, f"its round failed ({error})")
        if self.local is not None:
            await self.call(self.local.fail_all, f"error: the round failed ({error})")
        self._round_opened = time.perf_counter()

    async def _sweep_idle(self) -> None:
        now = time.monotonic()
        for drafter in list(self.drafters.values()):
            if drafter.in_request and drafter.session_id not in self._queued and now - drafter.last_seen > self.config.idle_timeout_s:
                await self.drop(drafter.session_id, f"idle for {now - drafter.last_seen:.1f} s")
            elif not drafter.streaming and now - drafter.joined_at > self.config.stream_open_timeout_s:
                # Joined and never listened: it holds a session slot (max_drafters) for nothing.
                await self.drop(drafter.session_id, f"no verdict stream within {self.config.stream_open_timeout_s:g} s")

    async def _count_missed(self, verified) -> None:
        for drafter in list(self.drafters.values()):
            if drafter.in_request and drafter.session_id not in verified and drafter.session_id not in self._queued:
                drafter.missed += 1
                if drafter.missed > self.config.max_missed_rounds:
                    await self.drop(drafter.session_id, f"missed {drafter.missed} rounds")

    def _record(self, result, receive_s: float, send_s: float, closed: str, local=None) -> None:
        t = result.timings
        phases = {"receive": receive_s, "assembly": t.assembly_s, "forward": t.forward_s, "sampling": t.sampling_s,
                  "scheduling": t.scheduling_s, "send": send_s}
        verdicts = result.verdicts.values()
        self.metrics.observe_round(phases, verdicts, result.transit_tokens)
        self.registry.update_gauges()
        rows = tuple(
            DrafterRound(session=v.session_id, name=(d := self.drafters[v.session_id]).name, drafted=v.num_drafted,
                         accepted=v.num_accepted, gained=len(v.token_ids), acceptance=v.acceptance, goodput=v.goodput,
                         next_draft_length=v.next_draft_length, finished=v.finished, receive_s=d.receive_s, cycle_s=d.cycle_s,
                         transit=v.num_transit)
            for v in verdicts if v.session_id in self.drafters
        )
        local_round = None
        if local is not None:
            local_round = LocalRound(requests=local.requests, drafted=local.drafted, accepted=local.accepted,
                                     emitted=local.emitted, k=local.k, waiting=self.local.num_waiting)
        self.log.write(RoundRecord(round=result.round_index, receive_s=receive_s, verify_s=t.total_s, forward_s=t.forward_s,
                                   send_s=send_s, batch=len(rows), budget=self.engine.config.budget, drafters=rows,
                                   local=local_round, mode=self.config.rounds, prefill_tokens=result.prefill_tokens,
                                   closed=closed, transit_tokens=result.transit_tokens).to_event())
