"""Local serving: the verifier drafts for its own generation requests (continuous batching).

Each iteration (:meth:`LocalServing.submit_work`, the engine's step, :meth:`LocalServing.absorb`;
the daemon's round loop runs the step, :meth:`LocalServing.step` does all three for callers with
no loop of their own):

1. admit waiting requests up to ``max_requests`` (an engine session and a draft KV slot each;
   the target prefills the prompt);
2. the local policy decides what to draft and what to verify for every request in the batch;
3. the drafts are queued in the engine and verified in the same single target forward as any edge
   drafts queued for this step (chains or trees, lossless). Local serving is a source of drafts
   like the edge drafters: its sessions are sized by its own book
   (:class:`~goodspeed.scheduler.OwnerSizedAllotments`, outside the edge budget ``C`` and the
   edge policy), which it fills each step with the sizes its policy chose;
4. accepted tokens are streamed to each request's callback with their times; finished requests
   leave the batch.

The policy (``--local-policy``) decides what each iteration drafts and verifies: one module each
in :mod:`goodspeed.verifier.local_policies` (plain decoding, chains, TETRIS, AdaServe, TurboSpec,
Nightjar and the goodput rule), which drafts through this class's :meth:`LocalServing.chains` or
its draft source's trees.

Losslessness under sampling (docs/DESIGN.md, *Lossless verification*): no decision looks at a sampled token's value
before it is verified. TETRIS ranks by what was known before each draw; AdaServe's beam
candidates are deterministic and verified as point masses; TurboSpec and Nightjar choose ``k``
before drafting, from past rounds only. ``tests/verifier/test_local_lossless.py`` checks every
policy's sampled output against the target's exact distribution.

Penalties, logit bias, min_tokens and allowed_token_ids (:func:`goodspeed.lm.decoding.adjust.adjust_logits`): the engine verifies every
position against the target's logits adjusted by the text before it; the chains and AdaServe's
beam trees drafted here adjust the draft's logits the same way (each request's
:class:`~goodspeed.lm.decoding.adjust.TokenHistory`, plus the chain or the beam's path), which keeps
acceptance up; exactness never depends on it.

Time comes from a :class:`~goodspeed.verifier.clocks.RealClock` in serving, or a :class:`~goodspeed.verifier.clocks.SimulatedClock` that charges every
forward its cost under given latency models, which makes SLO experiments exact and repeatable.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from goodspeed.lm.decoding.history import TokenHistory
from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.lm.decoding.seeding import numpy_rng, resolve_root_seed, torch_generator
from goodspeed.scheduler import OwnerSizedAllotments
from goodspeed.serving.generation import GenerationRequest
from goodspeed.verifier import errors
from goodspeed.verifier.clocks import LatencyProfile, RealClock, SimulatedClock
from goodspeed.verifier.engine import VerificationEngine
from goodspeed.lm.decoding.draft_source import as_draft_source, draft_model, draft_with_forced
from goodspeed.lm.models.adapt_config import AdaptConfig
from goodspeed.verifier.local_adapt import LocalAdaptation
from goodspeed.scheduler.admission import ADMISSIONS, SloAdmission
from goodspeed.verifier.local_policies import LOCAL_POLICIES, LOCAL_POLICY_CLASSES, Plan
from goodspeed.verifier.local_requests import LocalRequest, LocalWork, StepReport, TokenEvent
from goodspeed.verifier.types import Draft, RoundResult, SparseProbs


# ------------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class LocalConfig:
    policy: str = "chain"
    k: int = 4  # chain: tokens drafted per request; tetris: the base length
    extra: int = 2  # tetris: tokens drafted beyond k
    capacity: int | None = None  # tetris: draft tokens verified per iteration (default k * requests)
    budget: int = 32  # adaserve: B, tree nodes per iteration, roots included
    max_depth: int = 6  # adaserve: D_max
    max_width: int = 3  # adaserve: W_max
    max_slo_tree_size: int = 8  # adaserve: n_max (root included)
    max_k: int = 6  # turbospec / nightjar: largest k considered
    latency: LatencyProfile | None = None  # turbospec: required
    max_requests: int = 32  # requests decoded together; later ones wait
    max_waiting: int = 256  # requests queued behind them; more are refused (QueueFullError)
    iteration_smoothing: float = 0.5  # weight of the newest iteration time in t_spec
    initial_acceptance: float = 0.5  # turbospec: pooled acceptance before any local draft was verified
    seed: int | None = None  # root seed of the local streams; None: the engine's root seed
    admission: str = "count"  # which waiting requests join the batch: count or slo (goodspeed.scheduler.admission)
    floor: float = 0.0  # goodput: each request's least pace over its life, a fraction of plain decoding's (0: off)
    adapt: bool = False  # the draft model learns the requests served (goodspeed.verifier.local_adapt)
    adapt_every: int = 16  # finished requests between two fine-tunes
    adapt_dir: str | None = None  # where adopted weights persist across restarts

    def __post_init__(self) -> None:
        if self.policy not in LOCAL_POLICY_CLASSES:
            raise ValueError(f"unknown local policy {self.policy!r}; choose one of {', '.join(LOCAL_POLICIES)}")
        if self.k < 0 or self.extra < 0 or self.max_k < 0 or self.max_requests < 1 or self.max_waiting < 0:
            raise ValueError("k, extra and max_k must be >= 0, max_requests >= 1 and max_waiting >= 0")
        if self.capacity is not None and self.capacity < 0:
            raise ValueError("capacity must be >= 0")
        if self.budget < 1 or self.max_depth < 1 or self.max_width < 1 or self.max_slo_tree_size < 1:
            raise ValueError("budget, max_depth, max_width and max_slo_tree_size must be >= 1")
        LOCAL_POLICY_CLASSES[self.policy].check(self)
        if not 0.0 <= self.floor <= 1.0 or (self.floor and self.policy != "goodput"):
            raise ValueError(f"floor is the goodput policy's, a fraction in [0, 1]; got {self.floor} with policy {self.policy!r}")
        if not 0 < self.iteration_smoothing <= 1:
            raise ValueError("iteration_smoothing must lie in (0, 1]")
        if self.admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {', '.join(ADMISSIONS)}, got {self.admission!r}")
        self.adapt_config()  # its checks

    def adapt_config(self) -> AdaptConfig:
        return AdaptConfig(every=self.adapt_every, dir=self.adapt_dir)


# ----------------------------------------------------------------------------------- serving


class LocalServing:
    """Local generation on the verifier. Every method runs on the engine's thread."""

    def __init__(self, engine: VerificationEngine, draft: torch.nn.Module | object, config: LocalConfig,
                 clock: RealClock | SimulatedClock | None = None, log: Callable[[str], None] | None = None) -> None:
        """``draft``: a draft model, or any draft source (:mod:`goodspeed.lm.decoding.draft_source`; a
        lookup alone drafts chains, so it serves every policy but ``adaserve``'s beam trees, which
        a model or a lookup with a model drafts). ``log``: told what ``config.adapt`` did."""
        # A draft model's forwards replayed as CUDA graphs, or compiled, too when the target's are
        # (EngineConfig.cuda_graphs, EngineConfig.torch_compile)
        draft = as_draft_source(draft, 0, engine.config.cuda_graphs, engine.config.torch_compile)
        if draft.vocab_size != engine.vocab_size:
            raise ValueError(f"draft vocabulary {draft.vocab_size} != target vocabulary {engine.vocab_size}")
        if LOCAL_POLICY_CLASSES[config.policy].drafting(config)[1] is not None and not hasattr(draft, "draft_trees"):
            raise ValueError(f"the {config.policy} policy drafts beam trees, which need a draft model (MODEL or "
                             "LOOKUP+MODEL); a lookup alone drafts chains: use chain, tetris, turbospec, nightjar or goodput")
        self.engine, self.config = engine, config
        self.clock = clock or RealClock()
        self.draft = draft
        self.draft.on_forward = lambda ctx, batched: self.clock.charge("draft", ctx, batched)
        root = engine.root_seed if config.seed is None else config.seed
        # The local draft's sampling stream and the policy's (Nightjar's exploration): both
        # independent of the engine's accept uniforms even under the same root (lm.decoding.seeding).
        self.generator = torch_generator(root, "verifier", "local-draft")
        self.rng = numpy_rng(root, "verifier", "local-policy")
        self.policy = LOCAL_POLICY_CLASSES[config.policy](self)
        self.admission = SloAdmission() if config.admission == "slo" else None
        self.adapting = LocalAdaptation(draft_model(self.draft), config.adapt_config(), log) if config.adapt else None
        self.allotments = OwnerSizedAllotments(engine.config.smoothing)  # this source's sizes, set every step
        self._waiting: deque[LocalRequest] = deque()
        self._active: dict[str, LocalRequest] = {}
        self.finished: list[LocalRequest] = []
        self.retain_finished = True  # a long-running daemon turns this off (results go to callbacks)
        self._ids = itertools.count()
        self.t_spec_s = 0.0  # smoothed iteration time (AdaServe's t_spec)
        self.retry_hint_s = 1.0  # retry_after_s() as the last step left it, for queue_full() off the engine thread
        # Acceptance across local requests: a new request's estimate until it has drafted.
        self.pooled_acceptance = config.initial_acceptance
        self.draft_forward_s = 0.0  # smoothed time of one draft forward (Nightjar's switching cost)
        # drafting_s / round_s: clock seconds spent planning (drafting, selection) and in the
        # engine's round (target forward and verification), summed over drafting steps
        # forced: drafted tokens a grammar forced (fast-forward)
        self.totals = {"steps": 0, "drafted": 0, "accepted": 0, "emitted": 0, "forced": 0, "drafting_s": 0.0, "round_s": 0.0}

    # ------------------------------------------------------------------ requests

    def submit(self, prompt_ids: Sequence[int], sampling: SamplingParams = SamplingParams(), max_new_tokens: int = 64,
               eos_token_ids: Sequence[int] = (), tpot_slo_ms: float | None = None,
               on_event: Callable[[TokenEvent], None] | None = None, request_id: str | None = None,
               seed: int | None = None, logprobs: int | None = None, prompt_logprobs: int | None = None) -> str:
        """:meth:`submit_request` from the request's fields, for a caller with no door of its own."""
        if tpot_slo_ms is not None and not (math.isfinite(tpot_slo_ms) and tpot_slo_ms > 0):
            raise errors.MalformedDraftError(f"tpot_slo_ms must be > 0, got {tpot_slo_ms}")
        return self.submit_request(GenerationRequest(request_id or "", [int(t) for t in prompt_ids], int(max_new_tokens), sampling,
                                                     tuple(int(t) for t in eos_token_ids), seed, tpot_slo_ms, logprobs,
                                                     prompt_logprobs), on_event)

    def submit_request(self, request: GenerationRequest, on_event: Callable[[TokenEvent], None] | None = None) -> str:
        """Queue a request (validated now, so a bad one fails here); returns its id (one is made up
        for an empty ``request_id``). ``seed``: the request's draft sampling and its
        accept/correction uniforms come from streams of its own, so the same request with the same
        seed and draft lengths gives the same output. ``logprobs``: its events carry each token's
        log-probability under the target and that many top ones, and with ``prompt_logprobs`` its
        first event the prompt tokens' too (:meth:`VerificationEngine.start`)."""
        prompt, sampling = self.engine.check(request)  # sampling holds the ending tokens: in the draft's logits too
        if (refusal := self.queue_full(retry_after_s=self.retry_after_s)) is not None:
            raise refusal
        rid = request.request_id or f"local-{next(self._ids)}"
        if rid in self._active or any(r.request_id == rid for r in self._waiting):
            raise errors.RequestInProgressError(f"request id {rid!r} is already in use")
        spec = dataclasses.replace(request, request_id=rid, prompt_ids=prompt, sampling=sampling,
                                   eos_token_ids=tuple(int(t) for t in request.eos_token_ids),
                                   seed=None if request.seed is None else resolve_root_seed(request.seed))
        self._waiting.append(LocalRequest(spec, on_event, self.clock.now()))
        return rid

    def queue_full(self, arriving: int = 0, retry_after_s: Callable[[], float] | None = None) -> errors.QueueFullError | None:
        """The refusal a new request gets now because the wait queue is full, counting
        ``arriving`` requests a door has let through that are not queued yet; None where there
        is room. From any thread: it reads only the queue's length and, unless given
        ``retry_after_s``, the retry estimate the last step left (:attr:`retry_hint_s`), so a door
        (the gRPC and HTTP fronts) refuses at once instead of waiting for the engine thread to
        finish its step; :meth:`submit_request` checks again there."""
        waiting = len(self._waiting) + arriving
        if waiting < self.config.max_waiting:
            return None
        retry = retry_after_s() if retry_after_s is not None else self.retry_hint_s
        return errors.QueueFullError(f"{waiting} requests are already waiting (max_waiting); retry in about {retry:.2g} s",
                                     retry_after_s=retry)

    def retry_after_s(self) -> float:
        """About when a place in the wait queue frees: when the active request nearest its end ends,
        at the measured time of a step and one token a step (an upper estimate: drafts that are
        accepted end it sooner); one step, or a second before any step was measured."""
        step = self.t_spec_s if self.totals["steps"] else 1.0
        left = min((r.max_new_tokens - len(r.generated) for r in self._active.values()), default=1)
        return step * max(1, left)

    def cancel(self, request_id: str) -> bool:
        """Stop a request (its client went away); False if it already ended."""
        for req in self._waiting:
            if req.request_id == request_id:
                self._waiting.remove(req)
                self._finish(req, "cancelled")
                return True
        req = self._active.get(request_id)
        if req is None:
            return False
        self.engine.finish_request(req.session_id)
        self._release(req, "cancelled")
        return True

    def fail_all(self, reason: str) -> None:
        """End every request (waiting and active) with ``reason``, freeing their sessions: after a
        failed iteration their state cannot be trusted."""
        while self._waiting:
            self._finish(self._waiting.popleft(), reason)
        for req in list(self._active.values()):
            self._release(req, reason)

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._active)

    @property
    def num_active(self) -> int:
        return len(self._active)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def warm_up(self) -> int:
        """With fixed-shape draft forwards (``EngineConfig.cuda_graphs`` / ``torch_compile``), the
        draft model drafts what this policy drafts (:meth:`LocalPolicy.drafting`) for synthetic
        requests before any real one (:meth:`BatchDraftModel.warm_up
        <goodspeed.lm.runtime.batch_draft.BatchDraftModel.warm_up>`), so that compiling and capturing its
        first graphs stalls no request; the engine's own are :meth:`VerificationEngine.warm_up_steps`.
        Nothing else changes (no request, statistic or policy state). Returns the drafting steps
        run (0 without fixed shapes or for a policy that drafts nothing)."""
        if self._active or self._waiting:
            raise RuntimeError("warm up local serving before it takes requests")
        chains, tree = self.policy.drafting(self.config)
        on_forward, self.draft.on_forward = self.draft.on_forward, None  # no clock charged for it
        forwards = self.draft.forwards
        try:
            return self.draft.warm_up(chains=chains, tree=tree)
        finally:
            self.draft.on_forward, self.draft.forwards = on_forward, forwards

    def _admit(self) -> None:
        if self.adapting is not None:
            self.adapting.swap_if_idle(len(self._active))
            if self.adapting.holds_admission:  # new weights wait for the active requests to end
                return
        admitted = 0
        while self._waiting and len(self._active) < self.config.max_requests:
            if self.admission is not None and not self.admission.admits([r.tpot_slo_s for r in self._active.values()],
                                                                        self._waiting[0].tpot_slo_s, admitted):
                return  # one more would break a decoding request's SLO: the head waits
            admitted += 1
            req = self._waiting.popleft()
            req.session_id = self.engine.join(f"local:{req.request_id}", source=self.allotments)
            try:
                length = self.engine.start(req.session_id, req.spec)
            except errors.EngineError as exc:
                self.engine.leave(req.session_id)
                self._finish(req, f"error: {exc}")
                continue
            if length is not None:  # prefilled now; with chunked prefill the steps do it
                self.clock.charge("target", len(req.prompt_ids), len(req.prompt_ids))
                req.decode_start = self.clock.now()
            self.draft.add(req.request_id)
            self._active[req.request_id] = req

    def _release(self, req: LocalRequest, reason: str) -> None:
        self.engine.leave(req.session_id)
        self.draft.remove(req.request_id, req.committed)
        del self._active[req.request_id]
        if self.adapting is not None:
            self.adapting.finished(len(req.prompt_ids) - req.spec.generated, req.committed, reason)
        self._finish(req, reason)

    def _finish(self, req: LocalRequest, reason: str) -> None:
        req.finish_reason, req.finished_at = reason, self.clock.now()
        if self.retain_finished:
            self.finished.append(req)
        if req.on_event is not None:
            req.on_event(TokenEvent(req.request_id, [], [], True, reason, req.summary()))

    # ---------------------------------------------------------------------- step

    def step(self, periods: dict[str, float] | None = None) -> StepReport | None:
        """One iteration run here, for a caller with no round loop of its own (tests, benchmarks):
        :meth:`submit_work`, the engine's step, :meth:`absorb`. None when there is no work.
        ``periods``: the queued edge drafters' seconds since their last verdict (``run_round``)."""
        work = self.submit_work()
        if work is None:
            return None
        return self.absorb(work, self.engine.run_round(periods=periods))

    def submit_work(self) -> LocalWork | None:
        """Admit waiting requests and queue this iteration's drafts in the engine, as the policy
        plans them; the step that verifies them (with any queued edge drafts) is the caller's to
        run, and :meth:`absorb` reads its verdicts. None when there is no work."""
        started = self.clock.now()
        self._admit()
        if not self._active:
            return None
        # A request whose prompt is still being prefilled (chunked prefill) drafts from the step after.
        reqs = [r for r in self._active.values() if not self.engine.prefilling(r.session_id)]
        planning = self.clock.now()
        plans, k = self.policy.plan(reqs) if reqs else ({}, None)
        dense = self._host_q(reqs, plans)
        drafted = 0
        for req in reqs:
            plan = plans[req.request_id]
            self.allotments.set(req.session_id, len(plan.token_ids))
            self.engine.submit(req.session_id, Draft(self.engine.next_round(req.session_id), plan.token_ids, plan.parents,
                                                     dense.get(req.request_id), _point_masses(req, plan)))
            drafted += len(plan.token_ids)
        return LocalWork(started, planning, self.clock.now(), reqs, plans, k, drafted, self.engine.context_tokens)

    def absorb(self, work: LocalWork, result: RoundResult) -> StepReport:
        """The step that verified ``work``'s drafts: each request commits its verdict's tokens,
        its client hears of them, finished requests leave, and the policy learns the iteration."""
        reqs, plans, k, drafted = work.reqs, work.plans, work.k, work.drafted
        self.clock.charge("target", work.context, result.verified_tokens + result.prefill_tokens)
        now = self.clock.now()
        for req in self._active.values():
            if req.session_id in result.started:
                req.decode_start = now
        seen = [result.verdicts[r.session_id].acceptance for r in reqs if r.drafted or plans[r.request_id].token_ids]
        if seen:
            self.pooled_acceptance = float(np.mean(seen))
        accepted = emitted = 0
        for req in reqs:
            verdict = result.verdicts[req.session_id]
            plan = plans[req.request_id]
            if plan.parents is None and plan.token_ids:
                self.draft.rollback(req.request_id, len(req.committed), verdict.num_accepted)
            req.commit(verdict.token_ids, now)
            if verdict.logprobs is not None:
                req.token_logprobs.extend(verdict.logprobs)
            if verdict.prompt_logprobs is not None:
                req.prompt_token_logprobs = list(verdict.prompt_logprobs)
            req.drafted += verdict.num_drafted
            req.accepted += verdict.num_accepted
            req.acceptance = verdict.acceptance
            accepted += verdict.num_accepted
            emitted += len(verdict.token_ids)
            if req.on_event is not None:
                req.on_event(TokenEvent(req.request_id, list(verdict.token_ids), [now] * len(verdict.token_ids),
                                        logprobs=None if verdict.logprobs is None else list(verdict.logprobs),
                                        prompt_logprobs=None if verdict.prompt_logprobs is None else list(verdict.prompt_logprobs)))
            if verdict.finished:
                self._release(req, verdict.finish_reason)
        duration = now - work.started
        if not reqs:  # a prefill step: nothing drafted, nothing for the policies to learn
            return StepReport(result, 0, 0, 0, 0, duration, k)
        if self.admission is not None:  # the step's time as its requests' TPOT counts it (admissions' prefill too)
            self.admission.observe(len(reqs), emitted, duration)
        w = self.config.iteration_smoothing
        self.t_spec_s = duration if self.totals["steps"] == 0 else w * duration + (1 - w) * self.t_spec_s
        # the policy learns what planning and the round cost, not the whole prompts admitted before them
        self.policy.observe(len(reqs), k, emitted, now - work.planning, prefill_tokens=result.prefill_tokens)
        self.retry_hint_s = self.retry_after_s()
        for key, value in (("steps", 1), ("drafted", drafted), ("accepted", accepted), ("emitted", emitted),
                           ("drafting_s", work.planned - work.planning), ("round_s", now - work.planned)):
            self.totals[key] += value
        return StepReport(result, len(reqs), drafted, accepted, emitted, duration, k)

    @staticmethod
    def _host_q(reqs: list[LocalRequest], plans: dict[str, Plan]) -> dict[str, np.ndarray]:
        """The sampled chains' ``q`` as the Drafts' host arrays, by request id: every request's rows
        copied back from the draft's device in one copy (one sync), not one a request."""
        sampled = [r.request_id for r in reqs
                   if plans[r.request_id].q is not None and plans[r.request_id].token_ids and not r.sampling.greedy]
        if not sampled:
            return {}
        host = torch.cat([plans[rid].q for rid in sampled]).cpu().numpy()
        ends = np.cumsum([len(plans[rid].q) for rid in sampled])
        return dict(zip(sampled, np.split(host, ends[:-1])))

    # ---------------------------------------------------------------- drafting (for the policies)

    def draft_settings(self, reqs: list[LocalRequest]) -> tuple[dict[str, SamplingParams], dict[str, TokenHistory | None]]:
        """What the draft drafts each request with: its sampling settings and the text its
        penalties read."""
        return {r.request_id: r.sampling for r in reqs}, {r.request_id: r.history for r in reqs}

    def draft_chains(self, reqs: list[LocalRequest], lengths: dict[str, int]):
        """Chains from the draft source, tokens a grammar forces first (fast-forward)."""
        sampling, histories = self.draft_settings(reqs)
        drafts, forced = draft_with_forced(self.draft, {r.request_id: r.committed for r in reqs}, lengths, sampling,
                                           {r.request_id: r.generator or self.generator for r in reqs}, histories)
        self.totals["forced"] += forced
        return drafts

    def chains(self, reqs: list[LocalRequest], lengths: dict[str, int]) -> dict[str, Plan]:
        return {rid: Plan(d.token_ids, None, d.q_rows()) for rid, d in self.draft_chains(reqs, lengths).items()}

    def timed_chains(self, reqs: list[LocalRequest], lengths: dict[str, int]) -> dict[str, Plan]:
        """Chains, measuring one draft forward: Nightjar's switching cost ``c_prefill`` is the
        draft catch-up forward that turning speculation back on costs."""
        t0 = self.clock.now()
        before = self.draft.forwards
        plans = self.chains(reqs, lengths)
        n = self.draft.forwards - before
        if n:
            per = (self.clock.now() - t0) / n
            self.draft_forward_s = per if self.draft_forward_s == 0 else 0.5 * per + 0.5 * self.draft_forward_s
        return plans

    def acceptance(self, req: LocalRequest) -> float:
        """The request's smoothed acceptance (eq. 3) once it has drafted, else the pooled one."""
        return req.acceptance if req.drafted else self.pooled_acceptance

    # ------------------------------------------------------------------ reports

    def stats(self) -> dict:
        t = self.totals
        return {**t, "vsr": t["accepted"] / t["drafted"] if t["drafted"] else 0.0,
                "active": len(self._active), "waiting": len(self._waiting)}


def _point_masses(req: LocalRequest, plan: Plan) -> list[SparseProbs] | None:
    """A sampled chain drafted without ``q`` (a lookup's deterministic draft) goes to the engine
    as what it is: the point mass on each drafted token."""
    if req.sampling.greedy or plan.parents is not None or plan.q is not None or not plan.token_ids:
        return None
    return [SparseProbs([int(t)], [1.0]) for t in plan.token_ids]
