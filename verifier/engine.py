"""The verification engine: one session per drafter, one batched target forward per round.

A round (GoodSpeed Alg. 1, lines 12-16; docs/DESIGN.md: *Lossless verification*, *GoodSpeed's allocation*,
*A round costs O(new tokens)*):

1. assemble every submitted draft as one row of new tokens — the session's pending token (the
   last committed token, not yet in the KV cache) followed by its drafts — over a contiguous
   window of KV slots, with per-row positions and an additive 4-D mask (trees get ancestor masks);
2. run ONE target forward, packed: the model's layers see only the real tokens, attention alone
   works per row over its slot (:mod:`goodspeed.lm.attention`);
3. process the target logits with each request's sampling settings and verify losslessly
   (:mod:`goodspeed.verifier.rejection`); keep the KV of the pending token and the accepted
   drafts, roll back the rest;
4. update each drafter's smoothed acceptance and goodput (eqs. 3-4) and ask the configured policy
   for next round's draft lengths under the budget ``C``; answer each drafter with a verdict.

Chunked prefill (``EngineConfig.prefill_chunk``, vLLM's and Sarathi's idea): a new request's
prompt is not prefilled when it starts but packed, at most ``prefill_chunk`` tokens per step and
first come first served, into the steps' forwards next to the verification rows, as a row that
attends on its own (:class:`goodspeed.lm.kv_slots.AttentionGroup`) and whose logits are never
computed (``logits_to_keep``). One long prompt therefore costs every other drafter's round at most
one chunk, not the whole prompt. The request joins drafting (its first allotment, ``started``)
when its last chunk is in; between steps the serving layer may run a prefill-only step
(:meth:`VerificationEngine.prefill_step`).

Transit decoding (``EngineConfig.transit_tokens``, asynchronous rounds only): a session that
opted in (``join(transit=True)``) and has no draft queued — its draft is being drafted or is on
the wire — gets a row of its own in the steps that run anyway: plain decoding, its pending token
and no drafts, so the step adds the target's next token to its text.

* Bounds: at most ``transit_tokens`` such tokens per session between two of its verdicts (the
  work a silent drafter costs is bounded); transit rows only fill what the step's drafts leave of
  the budget ``C``, one token each, the sessions with the fewest tokens decoded in transit first,
  so a step's work stays bounded by ``C`` as before. The serving layer may also run a step for
  transit rows alone (:meth:`VerificationEngine.transit_room` says for whom it would decode;
  ``ServerConfig.transit_alone`` and :mod:`goodspeed.verifier.round_loop` decide when), bounded
  the same way.
* When the draft arrives, it was drafted from the text as of the session's last verdict, so its
  first ``m`` tokens stand where the ``m`` decoded ones now do. If they are equal, the rest of the
  draft is verified as usual after them; otherwise (or if the draft is no longer than ``m``)
  nothing of it is verified and its row decodes one more token.
* The verdict carries every token the session's text grew by since the last one, the decoded
  ones first (``num_transit``); ``num_accepted`` counts its leading tokens equal to the draft's
  (the draft KV the drafter keeps). Eq. (3) sees only the positions the target verified. A
  request that ends in transit (EOS, its length) is told with the next verdict; a resync
  (:meth:`VerificationEngine.resync`) makes the text so far the next draft's base.

Lossless: every decoded token is the target's own next token (argmax, or a sample of its
processed distribution with the session's uniforms), and whether a step decodes depends only on
timing and on tokens already committed, never on the token it draws. A kept tail is a proposal
from the draft given exactly the committed text: the drafter sampled it after its first ``m``
tokens, with randomness of its own, so given that those equal the decoded ones it is distributed
as the ``q`` rows it travels with, independent of the verifier's draws, and the rejection test
is exact for it. A request's seeded reproducibility (``seed``) does not survive transit decoding,
whose rows follow the timing of the link; its distribution does.

CUDA graphs (``EngineConfig.cuda_graphs``, CUDA only): a step with logits and no prompt chunk is
laid out at fixed shapes and replayed as the graph captured for its shape
(:mod:`goodspeed.lm.graphs`); the LM head runs after the replay. Other steps run eagerly.

Misuse raises a specific :mod:`goodspeed.verifier.errors` exception before any state changes.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence

import numpy as np
import torch

from goodspeed.lm.sampling import MAX_TOP_LOGPROBS, SamplingParams
from goodspeed.lm.seeding import numpy_rng, resolve_root_seed, torch_generator
from goodspeed.lm.structured import Structure, StructureError
from goodspeed.scheduler import DraftAllotments, OwnerSizedAllotments
from goodspeed.verifier import errors
from goodspeed.lm.attention import PACKED, flash_varlen_kernel, keep_logits, model_varlen_missing, use_gqa_attention, with_cache
from goodspeed.verifier.drafts import draft_depth, validate_draft
from goodspeed.lm.graphs import StepGraphs
from goodspeed.lm.kv_slots import SlotKVCache, SlotTable, build_attention
from goodspeed.verifier.sessions import EngineConfig, Request, Row, Session
from goodspeed.verifier.types import Draft, PrefillStep, RoundResult, RoundTimings, Verdict
from goodspeed.verifier.verify_rows import RowInput, RowOutcome, RowVerifier, committed_logprobs


class VerificationEngine:
    """In-process verifier. Not thread-safe: the serving layer calls it from one thread."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig | None = None, tokenizer_fingerprint: str | None = None) -> None:
        self.model = model.eval()
        use_gqa_attention(self.model)
        self.config = config or EngineConfig()
        self.fingerprint = tokenizer_fingerprint
        self.vocab_size = int(model.config.vocab_size)
        self.max_seq_len = self.config.max_seq_len or int(getattr(model.config, "max_position_embeddings", 4096))
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        # Probabilities are compared in at least float32, whatever the model's dtype.
        self._work_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        self.cache = SlotKVCache(int(model.config.num_hidden_layers))
        # Packed forwards' chains attend through a varlen kernel where there is one (CUDA, fp16 /
        # bf16, a torch whose flash op takes per-sequence key lengths) unless the config says
        # "masked"; "varlen" insists on it (EngineConfig.attention).
        wants_varlen = self.config.packed and self.config.attention != "masked"
        missing = model_varlen_missing(self.model) if wants_varlen else None
        if self.config.attention == "varlen" and missing:
            raise ValueError(f"attention 'varlen' needs flash's varlen kernel, which needs {missing} "
                             f"(this model: {self.device}, {self.dtype}); use 'auto' or 'masked'")
        self.cache.varlen = flash_varlen_kernel() if wants_varlen and not missing else None
        self.slots = SlotTable(self.cache)  # session id -> KV slot, for sessions with a request
        if self.config.cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs needs a CUDA device; this target is on {self.device}")
        # Steps at fixed shapes where they fit one (goodspeed.lm.graphs), replayed as CUDA graphs
        # and / or through a compiled decoder; None: every step packed at its own shape.
        self.graphs = (StepGraphs(self.model, self.cache, capture=self.config.cuda_graphs,
                                  torch_compile=self.config.torch_compile)
                       if self.config.cuda_graphs or self.config.torch_compile else None)
        # Independent streams from one root (goodspeed.lm.seeding): the accept/correction uniforms
        # and the policy's randomness (Random-S), never shared with a drafter's sampling stream.
        self.root_seed = resolve_root_seed(self.config.seed)
        self.generator = torch_generator(self.root_seed, "verifier", "verify")
        self.row_verifier = RowVerifier(self.vocab_size, self.device, self._work_dtype, self.generator)
        # Smoothing (eqs. 3-4), the policy and the budget: the same code the simulator runs.
        self.allotments = DraftAllotments(self.config.budget, self.config.policy, self.config.smoothing,
                                          self.config.max_draft_len, numpy_rng(self.root_seed, "verifier", "policy"),
                                          max_sessions=self.config.max_drafters)
        self.round_index = 0
        self._sessions: dict[str, Session] = {}
        self._prefilling: list[str] = []  # sessions whose prompt is not all in KV yet, first come first served

    # ----------------------------------------------------------------- sessions and requests

    def join(self, name: str, tokenizer_fingerprint: str | None = None, device: str | None = None,
             source: DraftAllotments | None = None, transit: bool = False) -> str:
        """Register a drafter; returns its session id.

        Sessions given the same ``device`` are one edge device serving several requests at once:
        GoodSpeed's utility has one term per device (see :meth:`_schedule`). ``None``: the session
        is its own device, as in the paper.

        ``source``: the book that sizes the session's drafts (:mod:`goodspeed.scheduler.allotments`).
        By default the engine's own, :attr:`allotments`: the budget ``C``, the draft-length policy
        and the ``max_drafters`` limit the edge drafters share. Local serving passes its own
        :class:`~goodspeed.scheduler.OwnerSizedAllotments` and sizes its drafts itself; the
        engine verifies every source's drafts alike, in one forward.

        ``transit``: the drafter reads verdicts that carry tokens decoded while its draft was in
        transit (the module docstring); the engine decodes for it only with
        ``EngineConfig.transit_tokens`` > 0.

        ``tokenizer_fingerprint`` is what a remote drafter sent: when the target has a fingerprint
        it must equal it, and an empty one is refused (it would skip the check). ``None`` is for
        in-process callers that built the draft themselves (tests, local serving, benchmarks).
        """
        source = self.allotments if source is None else source
        if source.full:
            raise errors.TooManyDraftersError(f"already serving {source.max_sessions} drafters")
        if tokenizer_fingerprint is not None and self.fingerprint and not tokenizer_fingerprint:
            raise errors.TokenizerMismatchError(
                f"drafter {name!r} sent no tokenizer fingerprint; the target's is {self.fingerprint[:12]}: "
                "send goodspeed.lm.fingerprint of the draft's tokenizer"
            )
        if tokenizer_fingerprint and self.fingerprint and tokenizer_fingerprint != self.fingerprint:
            raise errors.TokenizerMismatchError(
                f"drafter {name!r} tokenizer {tokenizer_fingerprint[:12]} != target tokenizer {self.fingerprint[:12]}: "
                "draft and target must share one tokenizer"
            )
        # 128 random bits: no client can guess another's session, and ids never repeat across
        # restarts (a drafter retrying its old id cannot land in a newcomer's session).
        session_id = f"{name}#{secrets.token_hex(16)}"
        source.join(session_id, device or session_id)
        self._sessions[session_id] = Session(session_id, name, source, transit=transit)
        return session_id

    @property
    def attention(self) -> str:
        """How packed forwards attend: the varlen kernel's name for chains, or masked SDPA (and
        whether rows are padded where a step allows it: ``EngineConfig.pad_rows``; whether steps
        are replayed as CUDA graphs: ``EngineConfig.cuda_graphs``)."""
        padded = ", rows padded where a step allows" if self.config.pad_rows else ""
        if self.graphs is not None:
            others = f"{self.cache.varlen.name} for chains, masked SDPA for trees" if self.cache.varlen else "masked SDPA"
            return f"CUDA graphs of padded steps (masked SDPA) where a step fits one; other steps: {others}{padded}"
        if self.cache.varlen is None:
            return ("masked SDPA" + padded) if self.config.packed else "masked SDPA (padded forwards)"
        return f"{self.cache.varlen.name} for chains, masked SDPA for trees{padded}"

    @property
    def estimator(self):
        """The edge drafters' smoothed acceptance and goodput (eqs. 3-4)."""
        return self.allotments.estimator

    def leave(self, session_id: str) -> None:
        """Drop a drafter and free its KV memory."""
        session = self._session(session_id)
        if session.request is not None:
            self._end_request(session)
        session.source.leave(session_id)
        del self._sessions[session_id]

    @property
    def context_tokens(self) -> int:
        """Committed KV entries over every slot: the context the next forward's attention reads."""
        return sum(self.cache.lengths)

    @property
    def session_ids(self) -> list[str]:
        return list(self._sessions)

    def start_request(
        self,
        session_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        max_new_tokens: int,
        eos_token_ids: Sequence[int] = (),
        seed: int | None = None,
        logprobs: int | None = None,
        generated: int = 0,
        prompt_logprobs: int | None = None,
    ) -> int | None:
        """Prefill the prompt into a fresh KV slot; returns the draft length for the first round.
        With chunked prefill (``EngineConfig.prefill_chunk``) a prompt of more than one token is
        queued instead and ``None`` returned: the steps prefill it, and the step that completes it
        lists the session in ``started`` with its first draft length. ``seed``: the request's
        accept/correction uniforms come from its own stream (reproducible per request) instead of
        the engine's shared one. ``logprobs``: its verdicts carry each token's log-probability under
        the target and that many of the most probable tokens at each position (0 to
        :data:`~goodspeed.lm.sampling.MAX_TOP_LOGPROBS`). ``generated``: the prompt's last tokens that
        are the request's output already (a request resumed from its verified text), which its
        penalties count as output (:func:`~goodspeed.lm.sampling.adjust_logits`).
        ``prompt_logprobs``: its first verdict carries each prompt token's log-probability (all but
        the first, which follows nothing) and that many top ones, read off the prefill's own logits
        (OpenAI's ``echo`` with ``logprobs``); its prefill then computes logits for every prompt
        token, in pieces of at most :attr:`SCORE_BLOCK` tokens (a long prompt's ``[tokens, V]``
        logits would not fit a device otherwise)."""
        session = self._session(session_id)
        if session.request is not None:
            raise errors.RequestInProgressError(f"session {session_id} already has a request running")
        prompt = [int(t) for t in prompt_ids]
        sampling = sampling.ending_with(eos_token_ids)  # min_tokens holds these back
        self.check_request(prompt, max_new_tokens, logprobs, sampling, generated, prompt_logprobs, eos_token_ids)
        slot = self.slots.add(session_id)
        generator = None if seed is None else torch_generator(resolve_root_seed(seed), "request", "verify")
        session.request = Request(prompt, len(prompt), sampling, int(max_new_tokens), frozenset(int(t) for t in eos_token_ids),
                                  generator=generator, logprobs=logprobs, generated=generated,
                                  prompt_logprobs=prompt_logprobs)
        if len(prompt) > 1 and self.config.prefill_chunk is not None:
            self._prefilling.append(session_id)
            return None
        piece = len(prompt) if prompt_logprobs is None else self.SCORE_BLOCK
        for start in range(0, len(prompt) - 1, piece):
            chunk = prompt[start : min(start + piece, len(prompt) - 1)]
            self._forward_rows([], [(slot, chunk)])
            self.cache.commit(slot, start, list(range(len(chunk))))
        return session.source.start(session_id, session.request.remaining)

    # warm_up_steps: (rows, drafted tokens a row) of each synthetic step, rows from the first slot;
    # requests start in two waves, so the KV pool grows from four slots to eight in between; the
    # first request's prompt is short and the others' longer, so the keys grow past a power of two
    # (past the 16 a compiled step reads at least) as the rows do.
    WARM_UP_PROMPTS = (5, 20)
    WARM_UP_PLAN = ((1, 0), (1, 3), (4, 3), (4, 0), (2, 1), (1, 0), (8, 3), (8, 0))

    def warm_up_steps(self) -> int:
        """Fixed-shape steps (``EngineConfig.cuda_graphs`` / ``torch_compile``) compile and capture
        their first graphs here, before a drafter's round would wait on them: synthetic requests
        stepped as :data:`WARM_UP_PLAN` says (one row and several, one query a row and several,
        keys growing, the pool growing), which makes each size dynamo saw change symbolic (compiled
        steps are at least 2 rows: :meth:`StepGraphs.shape_for
        <goodspeed.lm.graphs.StepGraphs.shape_for>`). The sessions are sized by a book of their own
        (not the drafters' budget or ``max_drafters``), drafts at most ``max_draft_len``. Returns
        the steps run; the sessions leave, and nothing of them stays but the graphs. Without
        fixed-shape steps, or where ``max_seq_len`` leaves no room for the plan, it does nothing
        (0)."""
        short, long = self.WARM_UP_PROMPTS
        new = 4 * len(self.WARM_UP_PLAN) + 1  # a row gains at most 4 tokens a step
        if self.graphs is None or (self.config.max_seq_len is not None and long + new > self.config.max_seq_len):
            return 0
        source = OwnerSizedAllotments(self.config.smoothing)
        sids = [self.join(f"warm-up-{i}", source=source) for i in range(8)]
        try:
            for rows, drafted in self.WARM_UP_PLAN:
                drafted = min(drafted, self.config.max_draft_len)
                for i, sid in enumerate(sids[:rows]):
                    if self._session(sid).request is None:
                        self.start_request(sid, [i + 1] * (short if i == 0 else long), SamplingParams(), new)
                while self.has_prefill:
                    self.prefill_step()
                for sid in sids[:rows]:
                    self.set_allotment(sid, drafted)
                    self.submit(sid, Draft(self.next_round(sid), [0] * drafted))
                self.run_round()
        finally:
            for sid in sids:
                self.leave(sid)
        return len(self.WARM_UP_PLAN)

    @property
    def has_prefill(self) -> bool:
        """Some request's prompt is still being prefilled (chunked prefill)."""
        return bool(self._prefilling)

    def prefilling(self, session_id: str) -> bool:
        return session_id in self._prefilling

    def prefill_step(self) -> PrefillStep:
        """Prefill one chunk (at most ``prefill_chunk`` tokens, oldest prompts first) and nothing
        else: the serving layer runs it while no draft is ready. Queued drafts stay queued."""
        t0 = time.perf_counter()
        chunks = self._chunks()
        if chunks:
            self._forward_rows([], chunks)
        started = self._start(self._prefilled(chunks))
        return PrefillStep(sum(len(c) for _, c in chunks), time.perf_counter() - t0, started)

    def _chunks(self) -> list[tuple[int, list[int]]]:
        """This step's prompt chunks: ``(slot, tokens)``, at most ``prefill_chunk`` tokens in all."""
        budget, out = self.config.prefill_chunk or 0, []
        for session_id in self._prefilling:
            if budget <= 0:
                break
            request, slot = self._sessions[session_id].request, self.slots.slot(session_id)
            done = self.cache.lengths[slot]
            n = min(request.prompt_len - 1 - done, budget, self.SCORE_BLOCK if request.prompt_logprobs is not None else budget)
            out.append((slot, request.committed[done : done + n]))
            budget -= n
        return out

    def _prefilled(self, chunks: list[tuple[int, list[int]]]) -> list[str]:
        """Keep the chunks' KV (right after the forward: slots move when a request ends); returns
        the sessions whose prompt is now all in."""
        done = []
        for slot, chunk in chunks:
            self.cache.commit(slot, self.cache.lengths[slot], list(range(len(chunk))))
            session_id = self.slots.keys[slot]
            if self.cache.lengths[slot] == self._sessions[session_id].request.prompt_len - 1:
                self._prefilling.remove(session_id)
                done.append(session_id)
        return done

    def _start(self, session_ids: list[str]) -> dict[str, int]:
        """Prefilled sessions join drafting: their first draft lengths."""
        started = {}
        for sid in session_ids:
            session = self._sessions[sid]
            started[sid] = session.source.start(sid, session.request.remaining)
        return started

    def _check_structure(self, structure: Structure, output: list[int], eos_token_ids: Sequence[int]) -> None:
        if not structure.is_bound:
            raise errors.MalformedDraftError("a structured output constraint must be compiled against the target's tokenizer")
        if structure.tokenizer.vocab_size > self.vocab_size:
            raise errors.MalformedDraftError(f"the constraint's tokenizer has {structure.tokenizer.vocab_size} tokens, "
                                             f"past the target's vocabulary of {self.vocab_size}")
        if structure.after is not None and structure.after >= self.vocab_size:
            raise errors.MalformedDraftError(f"the constraint's after token {structure.after} is past the target's "
                                             f"vocabulary of {self.vocab_size}")
        if not set(structure.tokenizer.eos_tokens) & {int(t) for t in eos_token_ids}:
            raise errors.MalformedDraftError(
                f"structured output ends the text with EOS ({structure.tokenizer.eos_token}), which is not one of the "
                "request's ending tokens (ignore_eos cannot be combined with it)")
        if not output:
            return
        try:
            failure = structure.constraint(output).failure
        except StructureError as exc:
            raise errors.MalformedDraftError(f"the resumed output does not match the constraint: {exc}") from None
        if failure is not None:
            raise errors.MalformedDraftError(failure)

    def check_request(self, prompt: list[int], max_new_tokens: int, logprobs: int | None = None,
                      sampling: SamplingParams | None = None, generated: int = 0,
                      prompt_logprobs: int | None = None, eos_token_ids: Sequence[int] = ()) -> None:
        """Raise the error a request with this prompt, length, ``logprobs``, sampling settings,
        resumed output, ``prompt_logprobs`` and ending tokens would get (nothing changes). A
        structured output's grammar must be bound to the target's tokenizer, end the text with one
        of ``eos_token_ids`` (its EOS, which it allows alone once the text is complete) and accept
        the resumed output."""
        if not prompt:
            raise errors.MalformedDraftError("the prompt must hold at least one token")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise errors.InvalidTokenError(f"prompt token ids must lie in [0, {self.vocab_size})")
        if max_new_tokens < 1:
            raise errors.MalformedDraftError("max_new_tokens must be >= 1")
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise errors.MalformedDraftError(f"logprobs must lie in 0..{MAX_TOP_LOGPROBS}, got {logprobs}")
        if prompt_logprobs is not None and not 0 <= prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise errors.MalformedDraftError(f"prompt_logprobs must lie in 0..{MAX_TOP_LOGPROBS}, got {prompt_logprobs}")
        if sampling is not None and sampling.logit_bias and sampling.logit_bias[-1][0] >= self.vocab_size:
            raise errors.InvalidTokenError(f"logit_bias token ids must lie in [0, {self.vocab_size})")
        if sampling is not None and sampling.min_tokens and sampling.eos_token_ids and sampling.eos_token_ids[-1] >= self.vocab_size:
            raise errors.InvalidTokenError(f"with min_tokens, eos token ids must lie in [0, {self.vocab_size})")
        if sampling is not None and sampling.allowed_token_ids and sampling.allowed_token_ids[-1] >= self.vocab_size:
            raise errors.InvalidTokenError(f"allowed_token_ids must lie in [0, {self.vocab_size})")
        if sampling is not None and sampling.bad_words and max(max(w) for w in sampling.bad_words) >= self.vocab_size:
            raise errors.InvalidTokenError(f"bad_words token ids must lie in [0, {self.vocab_size})")
        if sampling is not None and sampling.nothing_allowed:
            raise errors.MalformedDraftError("min_tokens or bad_words hold back every one of allowed_token_ids: "
                                             "no token could be sampled")
        if not 0 <= generated <= len(prompt):
            raise errors.MalformedDraftError(f"generated must lie in 0..{len(prompt)} (the prompt's length), got {generated}")
        if sampling is not None and sampling.structured is not None:
            self._check_structure(sampling.structured, prompt[len(prompt) - generated:], eos_token_ids)
        if len(prompt) >= self.max_seq_len:
            raise errors.PromptTooLongError(f"prompt of {len(prompt)} tokens does not fit the context of {self.max_seq_len}")
        if len(prompt) + max_new_tokens > self.max_seq_len:
            raise errors.LengthLimitError(
                f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) exceeds the context limit {self.max_seq_len}"
            )

    def _end_request(self, session: Session) -> None:
        if session.session_id in self._prefilling:
            self._prefilling.remove(session.session_id)
        self.slots.remove(session.session_id)
        session.source.end(session.session_id)
        session.request, session.pending = None, None
        session.decoded, session.decoded_end, session.decoded_logprobs = [], None, []

    def set_allotment(self, session_id: str, num_tokens: int) -> None:
        """Override the session's draft length for its next round: for callers that choose lengths
        themselves (tests, benchmarks) instead of the policy: at most what the session's book
        allows (the budget ``C`` for the engine's own)."""
        session = self._session(session_id)
        self._check_drafting(session)
        limit = session.source.max_allotment
        if num_tokens < 0 or (limit is not None and num_tokens > limit):
            raise errors.DraftTooLongError(f"allotment {num_tokens} outside [0, budget {limit}]")
        session.source.set(session_id, num_tokens)

    def finish_request(self, session_id: str) -> list[int]:
        """End the session's request early: free its KV slot, drop a queued draft; returns the
        committed tokens (prompt + generated)."""
        session = self._session(session_id)
        if session.request is None:
            raise errors.NoActiveRequestError(f"session {session_id} has no request in progress")
        committed = list(session.request.committed)
        self._end_request(session)
        return committed

    def committed(self, session_id: str) -> list[int]:
        """The current request's committed tokens (prompt + generated): the verifier's truth."""
        session = self._session(session_id)
        if session.request is None:
            raise errors.NoActiveRequestError(f"session {session_id} has no request in progress")
        return list(session.request.committed)

    def resync(self, session_id: str) -> tuple[list[int], int, int]:
        """For a drafter that drifted: the committed tokens, the round its next draft must carry
        and its allotment, read together. Its next draft is drafted from exactly these tokens, so
        tokens decoded in transit so far are no longer ahead of it."""
        committed = self.committed(session_id)
        session = self._sessions[session_id]
        session.decoded, session.decoded_logprobs = [], []
        return committed, session.round_index, session.source.allotted(session_id)

    def allotment(self, session_id: str) -> int:
        return self._session(session_id).source.allotted(session_id)

    def next_round(self, session_id: str) -> int:
        """The round index the session's next draft must carry."""
        return self._session(session_id).round_index

    def _check_drafting(self, session: Session) -> None:
        if session.request is None:
            raise errors.NoActiveRequestError(f"session {session.session_id} has no request in progress")
        if session.session_id in self._prefilling:
            raise errors.NoActiveRequestError(f"session {session.session_id}'s prompt is still being prefilled: "
                                              "draft once its request has started")

    def _session(self, session_id: str) -> Session:
        try:
            return self._sessions[session_id]
        except KeyError:
            raise errors.UnknownSessionError(f"unknown or evicted session {session_id!r}") from None

    # ------------------------------------------------------------------------- submissions

    def submit(self, session_id: str, draft: Draft) -> Verdict | None:
        """Queue a draft for the next round. A repeat of the last verified round returns its
        verdict again (idempotent retries); anything older is stale."""
        session = self._session(session_id)
        if draft.round_index < session.round_index:
            last = session.last_draft
            if last is not None and last.round_index == draft.round_index and list(last.token_ids) == list(draft.token_ids):
                return session.last_verdict
            raise errors.StaleRoundError(f"round {draft.round_index} is over; session {session_id} is at round {session.round_index}")
        if draft.round_index > session.round_index:
            raise errors.FutureRoundError(f"session {session_id} is at round {session.round_index}, not {draft.round_index}")
        self._check_drafting(session)
        if session.pending is not None:
            if list(session.pending.token_ids) == list(draft.token_ids):
                return None
            raise errors.MalformedDraftError(f"a different draft for round {draft.round_index} is already queued")
        validate_draft(draft, self.vocab_size, session.source.allotted(session_id), needs_probs=not session.request.sampling.greedy)
        depth = draft_depth(draft)
        remaining = session.request.remaining + len(session.decoded)  # as of its last verdict, which it drafted from
        if depth > remaining - 1:
            raise errors.DraftTooLongError(
                f"draft depth {depth} reaches past the request's end ({remaining} tokens left, "
                "the last of which the verifier adds)"
            )
        session.pending = draft
        return None

    # ------------------------------------------------------------------------------- rounds

    def run_round(self, uniforms: dict[str, np.ndarray] | None = None, periods: dict[str, float] | None = None,
                  prefill: bool = True) -> RoundResult:
        """Verify every queued draft in one target forward (with one prompt chunk, unless
        ``prefill`` is false; see the module docstring).

        ``uniforms[session_id]`` (tests): at least ``S + 1`` uniforms in ``[0, 1)`` consumed as
        the accept tests then the correction/bonus draw; otherwise they come from the engine's
        seeded generator. ``periods[session_id]``: seconds since the session's last verdict was
        sent (the serving layer's clock); this step's own duration is added and the total, with
        the draft's length, feeds the session's timing estimate (the time-aware allocation,
        :mod:`goodspeed.scheduler.timing`).
        """
        t0 = time.perf_counter()
        rows, settled = self._assemble()
        chunks = self._chunks() if prefill else []
        t1 = time.perf_counter()
        logits = self._forward_rows(rows, chunks) if rows or chunks else None
        t2 = time.perf_counter()
        prefilled = self._prefilled(chunks)
        given = dict(uniforms or {})
        for row in rows:  # seeded requests draw their S + 1 uniforms from their own stream
            generator = row.session.request.generator
            if generator is not None and row.input.key not in given:
                given[row.input.key] = torch.rand(row.input.draft.num_tokens + 1, generator=generator, dtype=torch.float64).numpy()
        checked = self.row_verifier.verify([r.input for r in rows], logits, given) if rows else []
        logprobs = self._logprobs(rows, logits, checked)
        # Every row's KV at once: a step of trees moves accepted paths in one op per layer, not per row.
        self.cache.commit_many([(row.slot, self.cache.lengths[row.slot], out.kept) for row, out in zip(rows, checked)],
                               mover=self.graphs.move if self.graphs is not None else None)
        outcomes = []
        for row, out, lps in zip(rows, checked, logprobs):
            if row.transit:
                self._apply_transit(row, out, lps)
            else:
                outcomes.append(self._apply(row, out, lps))
        outcomes += [(row, [], 0, row.session.decoded_end, []) for row in settled]
        t3 = time.perf_counter()
        for row in rows:  # before scheduling: the time-aware policy reads it
            if periods and row.input.key in periods and not row.transit:
                row.session.source.observe_period(row.input.key, row.draft.num_tokens, periods[row.input.key] + (t3 - t0))
        verdicts = self._schedule(outcomes)
        started = self._start(prefilled)  # after scheduling: a new request gets what the others leave of C
        t4 = time.perf_counter()
        self.round_index += 1
        q_len = max((len(r.tokens) for r in rows), default=0)
        slots = [r.slot for r in rows] + [slot for slot, _ in chunks]
        window = (max(slots) - min(slots) + 1) if slots else 0
        prefill_tokens = sum(len(c) for _, c in chunks)
        return RoundResult(
            round_index=self.round_index - 1,
            verdicts=verdicts,
            timings=RoundTimings(t1 - t0, t2 - t1, t3 - t2, t4 - t3),
            batch_rows=window,
            batch_tokens=sum(len(r.tokens) for r in rows) + prefill_tokens if self.config.packed
            else window * max([q_len] + [len(c) for _, c in chunks]),
            verified_tokens=sum(len(r.tokens) for r in rows),
            draft_lengths={sid: self.allotments.allotted(sid) for sid in self.allotments.active()},
            prefill_tokens=prefill_tokens,
            started=started,
            transit_tokens=sum(r.transit for r in rows),
        )

    def _assemble(self) -> tuple[list[Row], list[Row]]:
        """This step's rows (queued drafts, then transit decoding) and the drafts that need no
        forward (their request ended in transit: ``settled``)."""
        rows, settled, waiting = [], [], []
        for slot, session_id in enumerate(self.slots.keys):
            session = self._sessions[session_id]
            submitted = session.pending
            if submitted is None:
                if self._decodes_in_transit(session):
                    waiting.append((slot, session))
                continue
            if session.decoded_end is not None:
                settled.append(Row(session, slot, RowInput(session_id, [], submitted, session.request.sampling,
                                                           session.request.history), None))
                continue
            draft = after_decoded(submitted, session.decoded)
            pending_token = session.request.committed[-1]
            parents = None if draft.parents is None else [-1] + [p + 1 for p in draft.parents]
            tokens = [pending_token, *map(int, draft.token_ids)]
            rows.append(Row(session, slot, RowInput(session_id, tokens, draft, session.request.sampling, session.request.history),
                            parents,
                            submitted=None if draft is submitted else submitted))
        if waiting:
            rows += self._transit_rows(rows, waiting)
        return rows, settled

    def _transit_rows(self, rows: list[Row], waiting: list[tuple[int, Session]]) -> list[Row]:
        """Transit rows for the ``waiting`` ``(slot, session)``: they fill what ``rows``' drafts
        leave of C, the sessions with the fewest tokens decoded in transit first (ties in slot order)."""
        room = self.config.budget - sum(r.input.draft.num_tokens for r in rows if r.session.source is self.allotments)
        chosen = sorted(waiting, key=lambda w: len(w[1].decoded))[: max(room, 0)]
        out = []
        for slot, session in sorted(chosen, key=lambda w: w[0]):
            empty = Draft(session.round_index, [])
            out.append(Row(session, slot, RowInput(session.session_id, [session.request.committed[-1]], empty,
                                                   session.request.sampling, session.request.history), None, transit=True))
        return out

    def transit_room(self) -> tuple[str, ...]:
        """The sessions a step run now would decode for in transit: no draft queued, a request in
        progress, fewer than ``transit_tokens`` decoded since their last verdict."""
        return tuple(sid for sid in self.slots.keys
                     if (session := self._sessions[sid]).pending is None and self._decodes_in_transit(session))

    def _decodes_in_transit(self, session: Session) -> bool:
        """Whether this step decodes for the session while its draft is away (module docstring)."""
        return (session.transit and len(session.decoded) < self.config.transit_tokens and session.decoded_end is None
                and session.request is not None and session.request.remaining >= 1
                and session.session_id not in self._prefilling)

    def _forward_rows(self, rows: list[Row], chunks: list[tuple[int, list[int]]] = ()) -> torch.Tensor | None:
        """One forward over the slot window spanning the verification rows and the prompt chunks
        (``(slot, tokens)``); idle slots get padding. Logits ``[len(rows), q_len, V]`` of the rows
        (None without rows). A chunk's logits are computed only where its request asked for prompt
        log-probabilities, which are scored here (:meth:`_score_prompts`), before the chunk's KV is
        committed."""
        slots = [r.slot for r in rows] + [slot for slot, _ in chunks]
        first, last = min(slots), max(slots)
        tokens: list[list[int]] = [[] for _ in range(last - first + 1)]
        parents: list[list[int] | None] = [None] * len(tokens)
        for row in rows:
            tokens[row.slot - first], parents[row.slot - first] = row.tokens, row.parents
        for slot, chunk in chunks:
            tokens[slot - first] = chunk
        scored = [(slot, chunk) for slot, chunk in chunks if self._request_at(slot).prompt_logprobs is not None]
        logits, chunk_logits = self._forward(slice(first, last + 1), tokens, parents, [r.slot - first for r in rows],
                                             tuple(slot - first for slot, _ in chunks), [slot - first for slot, _ in scored])
        if scored:
            self._score_prompts(scored, chunk_logits)
        return logits

    def _request_at(self, slot: int) -> Request:
        return self._sessions[self.slots.keys[slot]].request

    # The most prompt tokens a forward scores: a scored prompt is prefilled in pieces (chunks) of at
    # most this many, which bounds its logits at [SCORE_BLOCK, V] (155 MB in bf16 at Qwen3's V).
    SCORE_BLOCK = 512

    def _score_prompts(self, chunks: list[tuple[int, list[int]]], logits: list[torch.Tensor]) -> None:
        """Keep each chunk's prompt log-probabilities on its request, with their ranks (vLLM's
        ``prompt_logprobs`` shows them): the logits at a prompt token's position are those of the
        token after it (raw logits, as a verdict's ``logprobs``, which carry no ranks)."""
        for (slot, chunk), chunk_logits in zip(chunks, logits):
            request, done = self._request_at(slot), self.cache.lengths[slot]
            wanted = [(0, range(len(chunk)), request.committed[done + 1 : done + 1 + len(chunk)], request.prompt_logprobs)]
            request.prompt_scores += committed_logprobs(chunk_logits.unsqueeze(0), wanted, ranks=True)[0]

    def _forward(self, window: slice, tokens: list[list[int]], parents: list[list[int] | None],
                 rows: list[int], solo: tuple[int, ...] = (), read: list[int] = ()) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """Logits ``[len(rows), q_len, V]`` of the window rows ``rows`` (None if there are none)
        for new tokens written at each slot's committed length, and ``[len(tokens[r]), V]`` of each
        window row ``r`` in ``read`` (prompt chunks whose request scores its prompt). Packed
        (``EngineConfig.packed``): the model sees only the real tokens, and the ``solo`` rows
        (prompt chunks) attend on their own, with no logits computed unless ``read`` lists one;
        otherwise every row is padded to the longest (the reference path)."""
        if self.config.packed:
            if self.graphs is not None and rows and not solo:  # a step of fixed shapes, replayed where it fits one
                layout = self.graphs.pack(tokens, parents, window, self.dtype, self.device)
                if layout is not None:  # its window is [0, W): rows are slots
                    return self.graphs.logits(layout, [window.start + r for r in rows]), []
            layout = self.cache.pack(tokens, parents, window, self.dtype, self.device, solo, pad=self.config.pad_rows)
            # Logits only for the tokens someone reads: a prompt chunk's only where its prompt is scored.
            extra = keep_logits(self.model, layout.input_ids.shape[1] if read else max(layout.keep, 1))
            with torch.inference_mode():
                out = self.model(input_ids=layout.input_ids, attention_mask=layout.mask, position_ids=layout.position_ids,
                                 **with_cache(self.model, self.cache), use_cache=True, **{PACKED: layout}, **extra)
            offset = layout.input_ids.shape[1] - out.logits.shape[1]
            chunks = [out.logits[0, layout.starts[r] - offset : layout.starts[r] - offset + len(tokens[r])] for r in read]
            return (layout.padded(out.logits, rows) if rows else None), chunks
        q_len = max(len(t) for t in tokens)
        ids = torch.zeros(len(tokens), q_len, dtype=torch.long)
        for i, t in enumerate(tokens):
            ids[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        kv_len = self.cache.prepare(q_len, window)
        mask, positions = build_attention(self.cache.lengths[window], parents, q_len, kv_len, self.dtype, self.device)
        with torch.inference_mode():
            out = self.model(
                input_ids=ids.to(self.device), attention_mask=mask, position_ids=positions, **with_cache(self.model, self.cache), use_cache=True
            )
        return (out.logits[rows] if rows else None), [out.logits[r, : len(tokens[r])] for r in read]

    @staticmethod
    def _logprobs(rows: list[Row], logits: torch.Tensor | None, checked: list[RowOutcome]) -> list[list]:
        """Each row's emitted tokens' :class:`TokenLogprob` where its request asked for them
        (``[]`` elsewhere): the logits at the kept positions are those the emitted tokens follow."""
        wanted = [(i, out.kept[: len(out.emitted)], out.emitted, row.session.request.logprobs)
                  for i, (row, out) in enumerate(zip(rows, checked)) if row.session.request.logprobs is not None]
        out: list[list] = [[] for _ in rows]
        if wanted:
            for (i, *_), lps in zip(wanted, committed_logprobs(logits, wanted)):
                out[i] = lps
        return out

    def _apply(self, row: Row, outcome: RowOutcome, logprobs: list) -> tuple:
        """Commit the verified tokens (already in the KV slot: ``run_round``) to the request; end
        finished requests."""
        session, request = row.session, row.session.request
        emitted, reason = _until_end(request, outcome.emitted)
        request.commit(emitted)
        accepted = len(outcome.kept) - 1
        session.source.observe(session.session_id, outcome.ratios, accepted)
        return row, emitted, accepted, reason, logprobs[: len(emitted)]

    def _apply_transit(self, row: Row, outcome: RowOutcome, logprobs: list) -> None:
        """Commit a transit row's token (the target's next one, already in the KV slot:
        ``run_round``) to the request; a request that ends here is told with the session's next
        verdict."""
        session, request = row.session, row.session.request
        emitted, session.decoded_end = _until_end(request, outcome.emitted[:1])
        request.commit(emitted)
        session.decoded += emitted
        session.decoded_logprobs += logprobs[: len(emitted)]

    def _schedule(self, outcomes: list[tuple]) -> dict[str, Verdict]:
        """Next round's draft lengths, from each source's book (eq. (5) or the configured baseline
        for the engine's own), then the verdicts."""
        finished = {row.session.session_id for row, _, _, reason, _ in outcomes if reason}
        for sid in finished:
            self._sessions[sid].source.end(sid)  # its allotment returns to the pool before the others share it
        by_source: dict[int, tuple[DraftAllotments, list[Session]]] = {}
        for row, *_ in outcomes:
            if row.session.session_id not in finished:
                by_source.setdefault(id(row.session.source), (row.session.source, []))[1].append(row.session)
        for source, participants in by_source.values():
            source.schedule([s.session_id for s in participants], [source.cap(s.request.remaining) for s in participants],
                            self.round_index)
        verdicts = {}
        for row, emitted, accepted, reason, logprobs in outcomes:
            verdicts[row.session.session_id] = self._verdict(row, emitted, accepted, reason, logprobs)
        return verdicts

    def _verdict(self, row: Row, emitted: list[int], accepted: int, reason: str | None, logprobs: list) -> Verdict:
        session = row.session
        committed = session.request.committed
        wants_logprobs = session.request.logprobs is not None
        est = session.source.estimator.get(session.session_id)
        decoded = session.decoded
        request, prompt_scores = session.request, None
        if request.prompt_logprobs is not None and not request.prompt_scores_sent:  # its first verdict: the prompt is all in
            prompt_scores, request.prompt_scores_sent = tuple(request.prompt_scores), True
        if decoded:  # the text grew in transit first: the drafter keeps what equals its draft
            emitted = decoded + emitted
            accepted = 0 if row.draft.parents is not None else common_prefix(row.draft.token_ids, emitted)
        verdict = Verdict(
            session_id=session.session_id,
            round_index=row.draft.round_index,
            num_drafted=row.draft.num_tokens,
            num_accepted=accepted,
            num_transit=len(decoded),
            token_ids=emitted,
            committed_length=len(committed),
            prefix_hash=session.request.hasher.hexdigest(),
            next_draft_length=0 if reason else session.source.allotted(session.session_id),
            finished=reason is not None,
            finish_reason=reason,
            acceptance=est.acceptance,
            goodput=est.goodput,
            logprobs=tuple(session.decoded_logprobs + logprobs) if wants_logprobs else None,
            prompt_logprobs=prompt_scores,
        )
        session.last_draft, session.last_verdict = row.draft, verdict
        session.round_index += 1
        session.pending = None
        session.decoded, session.decoded_end, session.decoded_logprobs = [], None, []
        if reason:
            self._end_request(session)
        return verdict


def _until_end(request, emitted: list[int]) -> tuple[list[int], str | None]:
    """``emitted`` cut where the request ends, and why it ends there (``"eos"``: its first EOS,
    kept; ``"length"``: its last token; ``"error: ..."``: its grammar failed, and its masks
    forced the EOS), or ``None`` if it goes on."""
    cut, reason = len(emitted), None
    eos_at = next((i for i, tok in enumerate(emitted) if tok in request.eos_token_ids), None)
    if eos_at is not None:
        cut, reason = eos_at + 1, "eos"
    if cut > request.remaining or (cut == request.remaining and reason is None):
        cut, reason = request.remaining, "length"
    constraint = request.history.constraint if request.history is not None else None
    if reason is not None and constraint is not None and constraint.failure is not None:
        reason = f"error: {constraint.failure}"
    return emitted[:cut], reason


def after_decoded(draft: Draft, decoded: list[int]) -> Draft:
    """What is left to verify of ``draft`` once ``decoded`` (tokens decoded in transit since the
    text it was drafted from) stand in its first positions: its tail, when its first
    ``len(decoded)`` tokens equal them, with its ``q`` rows; else nothing (an empty draft). Trees
    with anything decoded in transit verify nothing."""
    m = len(decoded)
    if not m:
        return draft
    if draft.parents is not None or draft.num_tokens <= m or [int(t) for t in draft.token_ids[:m]] != decoded:
        return Draft(draft.round_index, [])
    return Draft(draft.round_index, list(draft.token_ids[m:]),
                 dense_probs=None if draft.dense_probs is None else draft.dense_probs[m:],
                 sparse_probs=None if draft.sparse_probs is None else list(draft.sparse_probs[m:]))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The number of leading positions where ``a`` and ``b`` hold the same token."""
    n = 0
    for x, y in zip(a, b):
        if int(x) != int(y):
            break
        n += 1
    return n
