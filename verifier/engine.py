"""The verification engine: one session per drafter, one batched target forward per step.

A step (GoodSpeed Alg. 1, lines 12-16; docs/DESIGN.md: *Lossless verification*, *GoodSpeed's
allocation*, *A round costs O(new tokens)*) is a composition of stages, each in a module of its own:

1. **sessions** (:mod:`~goodspeed.verifier.session_table`): who joined, which request holds which
   KV slot, whose prompt is still being prefilled;
2. **plan** (:mod:`~goodspeed.verifier.planner`): the step's rows, each queued draft behind its
   session's pending token, prompt chunks (chunked prefill) and transit rows (tokens decoded while a
   draft is on the wire), as a :class:`~goodspeed.verifier.planner.StepPlan`;
3. **run** (:mod:`~goodspeed.verifier.model_runner`): ONE target forward over the plan, packed, or
   replayed as a CUDA graph where the step fits one;
4. **verify** (:mod:`~goodspeed.verifier.verify_rows`): the target's logits processed with each
   request's sampling settings and each row verified losslessly; the KV of the pending token and the
   accepted drafts kept, the rest rolled back;
5. **apply** (:mod:`~goodspeed.verifier.apply`): requests commit their tokens, each drafter's
   smoothed acceptance and goodput update (eqs. 3-4), the policy sizes next round's drafts under the
   budget ``C``, and each draft gets its verdict.

**Decoding ahead.** A drafter whose drafts do not pay sends an empty draft with
``decode_ahead = m`` (:class:`~goodspeed.verifier.types.Draft`): the engine then queues the
session's next ``m`` rounds itself, each an empty draft (plain decoding: the target's own
token, sampled as any round's bonus token), so the drafter skips a round trip a token while it
drafts nothing; it drafts again for the round after them (sooner if the request ends). With
``decode_ahead_until_match = n`` it stops sooner, after a round whose text ends in ``n`` tokens
that occurred earlier in it (followed by a token there): a lookup matching ``n`` tokens, which the
drafter finds worth drafting, has something to propose. Each verdict says how many rounds are
still queued (``decode_ahead_left``). Each round is a round as any other (its verdict, the
allocation, the budget), and whether the next is queued reads committed text only, so the
output's distribution and the fairness bookkeeping are unchanged.

Requests arrive whole (:class:`~goodspeed.serving.generation.GenerationRequest`, built once at each
door) and are checked by :mod:`~goodspeed.verifier.admission` before any state changes; misuse
raises a specific :mod:`goodspeed.verifier.errors` exception.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from goodspeed.lm.runtime.kv_slots import SlotKVCache
from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.lm.decoding.seeding import numpy_rng, resolve_root_seed, torch_generator
from goodspeed.scheduler import DraftAllotments
from goodspeed.serving.generation import GenerationRequest
from goodspeed.verifier import apply, errors
from goodspeed.verifier.admission import check_draft, check_request
from goodspeed.verifier.model_runner import ModelRunner
from goodspeed.verifier.planner import Planner
from goodspeed.verifier.session_table import SessionTable
from goodspeed.verifier.sessions import EngineConfig, Request
from goodspeed.verifier.types import Draft, PrefillStep, RoundResult, RoundTimings, Verdict
from goodspeed.verifier.verify_rows import RowVerifier
from goodspeed.verifier.warm_up import warm_up_steps


def repeats_its_tail(tokens: Sequence[int], n: int) -> bool:
    """Whether the last ``n`` of ``tokens`` occurred earlier in them, followed by a token there
    (a lookup matching ``n`` tokens would propose: :class:`goodspeed.lm.decoding.lookup.NgramIndex`)."""
    if n <= 0 or len(tokens) <= n:
        return False
    text = np.asarray(tokens, dtype=np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(text[:-1], n)  # every n tokens with a successor
    return bool((windows == text[-n:]).all(axis=1).any())


class VerificationEngine:
    """In-process verifier. Not thread-safe: the serving layer calls it from one thread."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig | None = None, tokenizer_fingerprint: str | None = None) -> None:
        self.config = config or EngineConfig()
        self.runner = ModelRunner(model, self.config)
        self.vocab_size = int(model.config.vocab_size)
        self.max_seq_len = self.config.max_seq_len or int(getattr(model.config, "max_position_embeddings", 4096))
        self.sessions = SessionTable(self.runner.cache, tokenizer_fingerprint)
        # Independent streams from one root (goodspeed.lm.decoding.seeding): the accept/correction uniforms
        # and the policy's randomness (Random-S), never shared with a drafter's sampling stream.
        self.root_seed = resolve_root_seed(self.config.seed)
        work_dtype = torch.float64 if self.runner.dtype == torch.float64 else torch.float32  # probabilities in >= float32
        self.row_verifier = RowVerifier(self.vocab_size, self.runner.device, work_dtype,
                                        torch_generator(self.root_seed, "verifier", "verify"))
        # Smoothing (eqs. 3-4), the policy and the budget: the same code the simulator runs.
        self.allotments = DraftAllotments(self.config.budget, self.config.policy, self.config.smoothing,
                                          self.config.max_draft_len, numpy_rng(self.root_seed, "verifier", "policy"),
                                          max_sessions=self.config.max_drafters)
        self.planner = Planner(self.sessions, self.config, self.allotments)
        self.round_index = 0

    # What the stages hold, read through the engine.
    model = property(lambda self: self.runner.model)
    device = property(lambda self: self.runner.device)
    dtype = property(lambda self: self.runner.dtype)
    cache = property(lambda self: self.runner.cache)
    graphs = property(lambda self: self.runner.graphs)
    attention = property(lambda self: self.runner.attention, doc=ModelRunner.attention.__doc__)
    slots = property(lambda self: self.sessions.slots)
    estimator = property(lambda self: self.allotments.estimator, doc="The edge drafters' smoothed acceptance and goodput.")
    session_ids = property(lambda self: list(self.sessions.by_id))
    has_prefill = property(lambda self: bool(self.sessions.prefilling), doc="A prompt is still being prefilled.")
    context_tokens = property(lambda self: sum(self.runner.cache.lengths), doc="Committed KV entries over every slot.")

    def use_cache(self, cache: SlotKVCache) -> None:
        """Run on ``cache`` from now on (tests and benchmarks pick its layout); only while no
        request is in progress. Fixed-shape steps, if any, must be rebuilt over it."""
        self.sessions.use_cache(cache)
        self.runner.cache = cache

    # ----------------------------------------------------------------- sessions and requests

    def join(self, name: str, tokenizer_fingerprint: str | None = None, device: str | None = None,
             source: DraftAllotments | None = None, transit: bool = False) -> str:
        """Register a drafter; returns its session id.

        Sessions given the same ``device`` are one edge device serving several requests at once:
        GoodSpeed's utility has one term per device. ``None``: the session is its own device.
        ``source``: the book that sizes the session's drafts (:mod:`goodspeed.scheduler.allotments`);
        by default :attr:`allotments` (the budget ``C``, the policy, ``max_drafters``); local serving
        passes its own and sizes its drafts itself. ``transit``: the drafter reads verdicts carrying
        tokens decoded while its draft was in transit (:mod:`~goodspeed.verifier.planner`).
        ``tokenizer_fingerprint``: what a remote drafter sent, which must equal the target's (an
        empty one is refused); ``None`` for in-process callers that built the draft themselves.
        """
        return self.sessions.join(name, self.allotments if source is None else source, tokenizer_fingerprint, device, transit)

    def leave(self, session_id: str) -> None:
        """Drop a drafter and free its KV memory."""
        self.sessions.leave(session_id)

    def check(self, request: GenerationRequest) -> tuple[list[int], SamplingParams]:
        """Raise the error ``request`` would get (nothing changes); else its prompt ids and its
        sampling settings holding its ending tokens (which ``min_tokens`` holds back)."""
        prompt, eos = [int(t) for t in request.prompt_ids], tuple(int(t) for t in request.eos_token_ids)
        sampling = request.sampling.ending_with(eos)
        check_request(prompt, request.max_tokens, request.logprobs, sampling, request.generated, request.prompt_logprobs,
                      eos, self.vocab_size, self.max_seq_len)
        return prompt, sampling

    def start(self, session_id: str, request: GenerationRequest) -> int | None:
        """Start ``request`` on the session; returns its first draft length. Without chunked
        prefill the prompt is prefilled now; with it (``EngineConfig.prefill_chunk``) a prompt of
        more than one token is queued and ``None`` returned: the step that completes it lists the
        session in ``started``. ``seed``: its accept/correction uniforms come from a stream of its
        own. ``logprobs``: its verdicts carry each token's log-probability and that many top ones;
        ``prompt_logprobs``: its first verdict carries the prompt's (scored in pieces of at most
        :data:`~goodspeed.verifier.planner.SCORE_BLOCK` tokens). ``generated``: the prompt's last
        tokens that are output already, which its penalties count as output."""
        session = self.sessions.get(session_id)
        if session.request is not None:
            raise errors.RequestInProgressError(f"session {session_id} already has a request running")
        prompt, sampling = self.check(request)
        eos = frozenset(int(t) for t in request.eos_token_ids)
        generator = None if request.seed is None else torch_generator(resolve_root_seed(request.seed), "request", "verify")
        state = Request(prompt, len(prompt), sampling, int(request.max_tokens), eos,
                        generator=generator, logprobs=request.logprobs, generated=request.generated,
                        prompt_logprobs=request.prompt_logprobs)
        chunked = len(prompt) > 1 and self.config.prefill_chunk is not None
        slot = self.sessions.open(session, state, chunked)
        if chunked:
            return None
        for chunk in Planner.prompt_pieces(state, slot):
            self.runner.run([], [chunk], self.sessions.request_at)
            self.runner.cache.commit(slot, self.runner.cache.lengths[slot], list(range(len(chunk[1]))))
        return session.source.start(session_id, state.remaining)

    def start_request(self, session_id: str, prompt_ids: Sequence[int], sampling: SamplingParams, max_new_tokens: int,
                      eos_token_ids: Sequence[int] = (), seed: int | None = None, logprobs: int | None = None,
                      generated: int = 0, prompt_logprobs: int | None = None) -> int | None:
        """:meth:`start` from the request's fields (in-process callers with no door of their own)."""
        return self.start(session_id, GenerationRequest(session_id, list(prompt_ids), max_new_tokens, sampling,
                                                        tuple(eos_token_ids), seed, None, logprobs, prompt_logprobs, generated))

    def warm_up_steps(self) -> int:
        """Compile and capture the fixed-shape steps' first graphs (:func:`~goodspeed.verifier.warm_up.warm_up_steps`)."""
        return warm_up_steps(self)

    def prefilling(self, session_id: str) -> bool:
        return session_id in self.sessions.prefilling

    def has_request(self, session_id: str) -> bool:
        return self.sessions.get(session_id).request is not None

    def prefill_step(self) -> PrefillStep:
        """Prefill one chunk (at most ``prefill_chunk`` tokens, oldest prompts first) and nothing
        else: the serving layer runs it while no draft is ready. Queued drafts stay queued."""
        t0 = time.perf_counter()
        chunks = self.planner.chunks()
        if chunks:
            self.runner.run([], chunks, self.sessions.request_at)
        started = self.sessions.start_drafting(self.sessions.prefilled(chunks))
        return PrefillStep(sum(len(c) for _, c in chunks), time.perf_counter() - t0, started)

    def transit_room(self) -> tuple[str, ...]:
        """The sessions a step run now would decode for in transit (:meth:`Planner.transit_room
        <goodspeed.verifier.planner.Planner.transit_room>`)."""
        return self.planner.transit_room()

    def set_allotment(self, session_id: str, num_tokens: int) -> None:
        """Override the session's draft length for its next round (tests, benchmarks): at most what
        the session's book allows (the budget ``C`` for the engine's own)."""
        session = self.sessions.get(session_id)
        self.sessions.check_drafting(session)
        limit = session.source.max_allotment
        if num_tokens < 0 or (limit is not None and num_tokens > limit):
            raise errors.DraftTooLongError(f"allotment {num_tokens} outside [0, budget {limit}]")
        session.source.set(session_id, num_tokens)

    def finish_request(self, session_id: str) -> list[int]:
        """End the session's request early (its KV slot freed, a queued draft dropped); returns
        the committed tokens (prompt + generated)."""
        committed = self.committed(session_id)
        self.sessions.end(self.sessions.get(session_id))
        return committed

    def committed(self, session_id: str) -> list[int]:
        """The current request's committed tokens (prompt + generated): the verifier's truth."""
        return list(self.sessions.active_request(session_id).committed)

    def resync(self, session_id: str) -> tuple[list[int], int, int]:
        """For a drafter that drifted: the committed tokens, the round its next draft must carry
        and its allotment, read together. Its next draft is drafted from exactly these tokens, so
        tokens decoded in transit so far are no longer ahead of it, and a draft queued for the
        round (its own, or one the engine queued to decode ahead) is dropped."""
        committed = self.committed(session_id)
        session = self.sessions.get(session_id)
        session.decoded, session.decoded_logprobs = [], []
        session.pending = None
        return committed, session.round_index, session.source.allotted(session_id)

    def allotment(self, session_id: str) -> int:
        return self.sessions.get(session_id).source.allotted(session_id)

    def next_round(self, session_id: str) -> int:
        """The round index the session's next draft must carry."""
        return self.sessions.get(session_id).round_index

    # ------------------------------------------------------------------------------- steps

    def submit(self, session_id: str, draft: Draft) -> Verdict | None:
        """Queue a draft for the next round. A repeat of the last verified round returns its
        verdict again (idempotent retries); anything older is stale."""
        session = self.sessions.get(session_id)
        if draft.round_index < session.round_index:
            last = session.last_draft
            if last is not None and last.round_index == draft.round_index and list(last.token_ids) == list(draft.token_ids):
                return session.last_verdict
            raise errors.StaleRoundError(f"round {draft.round_index} is over; session {session_id} is at round {session.round_index}")
        if draft.round_index > session.round_index:
            raise errors.FutureRoundError(f"session {session_id} is at round {session.round_index}, not {draft.round_index}")
        self.sessions.check_drafting(session)
        if session.pending is not None:
            if list(session.pending.token_ids) == list(draft.token_ids):
                return None
            raise errors.MalformedDraftError(f"a different draft for round {draft.round_index} is already queued")
        check_draft(session, draft, self.vocab_size)
        session.pending = draft
        return None

    def _decode_ahead(self, rows, verdicts: dict[str, Verdict]) -> tuple[str, ...]:
        """Queue the next round of each session whose verified draft asked the engine to decode
        ahead (an empty draft carrying one round fewer), unless its request ended or its text now
        ends in the match the draft waits for; each verdict says how many rounds are left
        queued. Returns the sessions queued."""
        queued = []
        for row in rows:
            ahead, session, key = row.draft.decode_ahead, row.session, row.input.key
            if not ahead or row.transit or (verdict := verdicts.get(key)) is None:
                continue
            until = row.draft.decode_ahead_until_match
            if (not verdict.finished and session.request is not None and session.pending is None
                    and not (until and repeats_its_tail(session.request.committed, until))):
                session.pending = Draft(session.round_index, [], decode_ahead=ahead - 1, decode_ahead_until_match=until)
                verdicts[key] = session.last_verdict = replace(verdict, decode_ahead_left=ahead)  # a retry's answer too
                queued.append(key)
        return tuple(queued)

    def run_round(self, uniforms: dict[str, np.ndarray] | None = None, periods: dict[str, float] | None = None,
                  prefill: bool = True) -> RoundResult:
        """Verify every queued draft in one target forward (with one prompt chunk, unless
        ``prefill`` is false): the stages in the module docstring's order.

        ``uniforms[session_id]`` (tests): at least ``S + 1`` uniforms in ``[0, 1)`` consumed as
        the accept tests then the correction/bonus draw; otherwise they come from the engine's
        seeded generator (or a seeded request's own). ``periods[session_id]``: seconds since the
        session's last verdict was sent (the serving layer's clock); this step's own duration is
        added and the total, with the draft's length, feeds the session's timing estimate (the
        time-aware allocation, :mod:`goodspeed.scheduler.timing`).
        """
        t0 = time.perf_counter()
        plan = self.planner.plan(prefill)
        t1 = time.perf_counter()
        logits = self.runner.run(plan.rows, plan.chunks, self.sessions.request_at) if plan.runs_forward else None
        t2 = time.perf_counter()
        prefilled = self.sessions.prefilled(plan.chunks)
        given = dict(uniforms or {})
        for row in plan.rows:  # seeded requests draw their S + 1 uniforms from their own stream
            generator = row.session.request.generator
            if generator is not None and row.input.key not in given:
                given[row.input.key] = torch.rand(row.input.draft.num_tokens + 1, generator=generator, dtype=torch.float64).numpy()
        checked = self.row_verifier.verify([r.input for r in plan.rows], logits, given) if plan.rows else []
        logprobs = apply.row_logprobs(plan.rows, logits, checked)
        self.runner.commit(plan.rows, [out.kept for out in checked])
        outcomes = apply.apply_rows(plan.rows, checked, logprobs, plan.settled)
        t3 = time.perf_counter()
        for row in plan.rows:  # before scheduling: the time-aware policy reads it
            if periods and row.input.key in periods and not row.transit:
                row.session.source.observe_period(row.input.key, row.draft.num_tokens, periods[row.input.key] + (t3 - t0))
        verdicts = apply.schedule(outcomes, self.sessions, self.round_index)
        ahead = self._decode_ahead(plan.rows, verdicts)
        started = self.sessions.start_drafting(prefilled)  # after scheduling: a new request gets what the others leave of C
        t4 = time.perf_counter()
        self.round_index += 1
        return RoundResult(
            round_index=self.round_index - 1,
            verdicts=verdicts,
            timings=RoundTimings(t1 - t0, t2 - t1, t3 - t2, t4 - t3),
            batch_rows=plan.window,
            batch_tokens=plan.batch_tokens(self.config.packed),
            verified_tokens=plan.verified_tokens,
            draft_lengths={sid: self.allotments.allotted(sid) for sid in self.allotments.active()},
            prefill_tokens=plan.prefill_tokens,
            started=started,
            transit_tokens=sum(r.transit for r in plan.rows),
            ahead=ahead,
        )
