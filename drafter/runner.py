"""Draft-side model runner: drafts exactly ``S`` tokens with its own KV cache and applies verdicts.

The committed text (prompt + generated) is authoritative on the verifier; the runner mirrors it.
Its KV cache holds a prefix of the committed tokens plus the drafts it has fed; after a verdict
the cache is cropped to the committed tokens plus the accepted drafts (rollback), and whatever
committed tokens are not yet cached (at least the correction/bonus token) are fed at the start of
the next draft. The draft distribution ``q_j`` of every drafted token is returned after the same
:func:`goodspeed.lm.decoding.sampling.process_logits` the verifier applies to the target.

**Proactive drafting** (SpecEdge's idea): while a draft is in flight, :meth:`DraftRunner.predraft`
keeps going on the assumption that the whole draft is accepted — it guesses the verifier's bonus
token (the draft's own most likely next token) and drafts the next round's tokens after it. When
the verdict's tokens are exactly the draft plus that guess, the pre-drafted tokens are the next
draft and no drafting time is spent on it; otherwise they are rolled back. It is lossless: each
pre-drafted token was sampled from ``q`` given exactly the text the verifier then committed, with
the drafter's own random stream, and travels with that ``q`` — the verifier verifies it as any
other draft. The continuation (:attr:`DraftRunner.ahead`) holds at most ``S + 1 + K`` tokens, its
KV at most as many positions.

The KV is a transformers ``DynamicCache`` (:class:`GrowingDraftKV`), the fewest ops a forward:
rollback crops it. With ``cuda_graphs`` (CUDA only; :mod:`goodspeed.lm.runtime.graphs`) it is one slot of a
:class:`~goodspeed.lm.runtime.batch_draft.BatchDraftModel` (:class:`SlotDraftKV`), the structure batched
drafting and the target use, whose forwards take fixed shapes: a one-token draft step, which an
edge device repeats ``S`` times a round, is replayed as one graph. Eagerly on a launch-bound GPU,
a 4-layer draft's forward took 3.7-4.2 ms (docs/MEASUREMENTS.md). Eagerly on a CPU the slot's mask
and index bookkeeping cost more than the growing cache's, up to 2-4K positions of the SmolLM2
draft; beyond, the growing cache's copy of the whole KV every forward costs more
(docs/MEASUREMENTS.md, *One request's drafting at fixed shapes*). The slot is used for graphs, and
with ``torch_compile``: its fixed shapes let ``torch.compile`` specialise a handful of graphs, and
compiled, a round on this project's CPU cost 0.88-0.93x the growing cache's with the SmolLM2
draft and 0.98-1.01x with the demo's tiny one (docs/MEASUREMENTS.md, *torch.compile of the
fixed-shape steps*). Either way :meth:`DraftRunner.warm_up` compiles or captures the first graphs
before a request waits on them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from goodspeed.lm.runtime.attention import keep_logits, with_cache
from goodspeed.lm.runtime.batch_draft import BatchDraftModel
from goodspeed.lm.runtime.prefix import new_prefix_hasher, update_prefix_hasher
from goodspeed.lm.decoding.adjust import adjust_logits
from goodspeed.lm.decoding.history import TokenHistory
from goodspeed.lm.decoding.sampling import draft_proposal, process_logits, sample_from
from goodspeed.lm.decoding.params import PROPOSAL_TOP_K, SamplingParams, check_proposal_top_k
from goodspeed.drafter.serde import DraftOutput


class GrowingDraftKV:
    """One request's draft KV as a transformers ``DynamicCache``: each forward appends, rollback crops."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.cache = DynamicCache()

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def reset(self) -> None:
        self.cache = DynamicCache()

    def crop(self, length: int) -> None:
        """Keep at most ``length`` cached positions."""
        if self.length > length:
            self.cache.crop(length - self.length)

    def logits_after(self, tokens: list[int]) -> torch.Tensor:
        """The logits after feeding ``tokens``. The LM head runs at the last position only: a
        prompt's first feed would otherwise project every prompt position onto the vocabulary
        (1,000 tokens x 151,936 float32 logits is 608 MB)."""
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            out = self.model(input_ids=ids, **with_cache(self.model, self.cache), use_cache=True, **keep_logits(self.model, 1))
        return out.logits[0, -1]


class SlotDraftKV:
    """One request's draft KV as one slot of a :class:`~goodspeed.lm.runtime.batch_draft.BatchDraftModel`:
    forwards at fixed shapes where they fit one (replayed as CUDA graphs when its ``graphs`` are
    on), rollback sets the slot's length."""

    KEY = "request"

    def __init__(self, drafter: BatchDraftModel) -> None:
        self.drafter = drafter
        drafter.add(self.KEY)

    @property
    def length(self) -> int:
        return self.drafter.cached_length(self.KEY)

    def reset(self) -> None:
        self.crop(0)

    def crop(self, length: int) -> None:
        if self.length > length:
            self.drafter.cache.truncate(self.drafter.slots.slot(self.KEY), length)

    def logits_after(self, tokens: list[int]) -> torch.Tensor:
        return self.drafter.feed({self.KEY: tokens})[self.KEY]


# What an edge drafter says before its draft's warm-up (DraftRunner.warm_up, EdgeNode.start)
WARM_UP_NOTICE = "warming up the draft's fixed-shape forwards (compiling / capturing graphs)"


class DraftRunner:
    """One drafter's model state for one request at a time."""

    def __init__(self, model: torch.nn.Module, proposal_top_k: int = PROPOSAL_TOP_K, cuda_graphs: bool = False,
                 torch_compile: bool = False) -> None:
        """``proposal_top_k``: sampled drafts come from, and send, only the draft distribution's
        ``k`` most likely tokens a position (:func:`goodspeed.lm.decoding.sampling.cap_support`; 0: all).
        ``cuda_graphs``: draft forwards replayed as CUDA graphs where they fit one (CUDA only;
        the KV is then a :class:`SlotDraftKV`). ``torch_compile``: the slot's forwards through a
        decoder compiled by ``torch.compile`` (any device; the KV is a :class:`SlotDraftKV` too)."""
        self.model = model.eval()
        self.proposal_top_k = check_proposal_top_k(proposal_top_k)
        self.kv = (SlotDraftKV(BatchDraftModel(model, cuda_graphs=cuda_graphs, torch_compile=torch_compile))
                   if cuda_graphs or torch_compile else GrowingDraftKV(model))
        self.start([])

    def warm_up(self) -> int:
        """With fixed-shape forwards (``cuda_graphs`` / ``torch_compile``), compile and capture the
        draft's first graphs before the first request waits on them
        (:meth:`BatchDraftModel.warm_up <goodspeed.lm.runtime.batch_draft.BatchDraftModel.warm_up>`: chains
        only, as an edge drafter drafts); the request in progress, if any, is unchanged. Returns
        the drafting steps run (0 with a growing cache)."""
        if not isinstance(self.kv, SlotDraftKV):
            return 0
        return self.kv.drafter.warm_up(chains=BatchDraftModel.EDGE_WARM_UP_CHAIN)

    def start(self, prompt_ids: Sequence[int], generated: int = 0) -> None:
        """Begin a request (or resynchronise with the verifier's committed tokens, whose last
        ``generated`` are the request's output so far: its penalties count them as output)."""
        self.committed = [int(t) for t in prompt_ids]
        self._prompt_len = len(self.committed) - generated
        self._history: TokenHistory | None = None  # built at the first draft that adjusts its logits
        self.kv.reset()
        self._hasher = new_prefix_hasher()
        update_prefix_hasher(self._hasher, self.committed)
        # The speculative continuation after the committed text: tokens and the q rows they were
        # sampled from (None for the guessed bonus token, which nobody sampled). The cache holds
        # the committed text but its last token, then every continuation token but the last.
        self.ahead: list[int] = []
        self._ahead_q: list[torch.Tensor | None] = []
        self._reusable = False  # the continuation is pre-drafted text a verdict confirmed (apply)

    @property
    def prefix_hash(self) -> str:
        """:func:`goodspeed.lm.runtime.prefix.prefix_hash` of ``committed``, kept incrementally (O(new tokens) a round)."""
        return self._hasher.hexdigest()

    @property
    def cached_len(self) -> int:
        return self.kv.length

    def draft(self, num_tokens: int, sampling: SamplingParams, generator: torch.Generator) -> DraftOutput:
        """Draft ``num_tokens`` tokens after the committed text: the pre-drafted ones first (a
        proactive hit), then new ones."""
        if not self._reusable or any(q is None for q in self._ahead_q[:num_tokens]):
            self._truncate(0)  # drafting again without a verdict: the old draft is dropped
        self._reusable = False
        if num_tokens <= 0:
            self._truncate(0)
            return DraftOutput([], torch.zeros(0, self.model.config.vocab_size))
        self._truncate(num_tokens)
        self.extend(num_tokens - len(self.ahead), sampling, generator)
        return DraftOutput(list(self.ahead), torch.stack(self._ahead_q))

    def extend(self, num_tokens: int, sampling: SamplingParams, generator: torch.Generator, stop=None) -> int:
        """Sample ``num_tokens`` more continuation tokens (fewer if ``stop()`` turns true between
        two); returns how many."""
        done = 0
        while done < num_tokens and not (stop is not None and stop()):
            q = draft_proposal(self._logits(sampling), sampling, self.proposal_top_k)
            token = int(sample_from(q, torch.rand(1, generator=generator, dtype=torch.float64)).item())
            self.ahead.append(token)
            self._ahead_q.append(q)
            done += 1
        return done

    def predraft(self, num_drafted: int, num_tokens: int, sampling: SamplingParams, generator: torch.Generator,
                 stop=None) -> int:
        """While the first ``num_drafted`` continuation tokens are being verified: guess the bonus
        token after them (the draft's most likely one) and sample up to ``num_tokens`` after it,
        stopping early when ``stop()`` turns true. Returns the tokens pre-drafted."""
        self._truncate(num_drafted)
        if len(self.ahead) < num_drafted or num_tokens <= 0 or (stop is not None and stop()):
            return 0
        q = process_logits(self._logits(sampling).double(), sampling)
        self.ahead.append(int(torch.argmax(q).item()))
        self._ahead_q.append(None)
        return self.extend(num_tokens, sampling, generator, stop)

    def _logits(self, sampling: SamplingParams) -> torch.Tensor:
        """The draft's logits for the next continuation token, with the request's logit bias and
        penalties applied as the verifier applies them to the target's (by the committed text and
        the continuation before this position), which keeps acceptance up; exactness never
        depends on it (:func:`goodspeed.lm.decoding.adjust.adjust_logits`)."""
        logits = self.kv.logits_after(self._feed())
        if not sampling.adjusts_logits:
            return logits
        if self._history is None:
            self._history = TokenHistory(self.committed[: self._prompt_len], self.committed[self._prompt_len :],
                                         sampling.structured)
        adjusted = logits.to(torch.float32, copy=True).view(1, 1, -1)  # a replayed graph's output stays as it is
        return adjust_logits(adjusted, [0], [sampling], [self._history], [[list(self.ahead)]]).view(-1)

    def _feed(self) -> list[int]:
        """The tokens to feed before sampling the next continuation token (all but cached)."""
        if not self.committed:
            raise ValueError("nothing to draft after: start() the request with its prompt first")
        self.kv.crop(len(self.committed) + len(self.ahead) - 1)
        start = self.cached_len  # O(new tokens): the committed text is not copied
        return self.committed[start:] + self.ahead[max(0, start - len(self.committed)) :]

    def _truncate(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` continuation tokens (and no KV past them)."""
        del self.ahead[num_tokens:], self._ahead_q[num_tokens:]
        self.kv.crop(len(self.committed) + max(0, len(self.ahead) - 1))

    def apply(self, emitted: Sequence[int], num_accepted: int) -> bool:
        """Append the verdict's tokens; keep cached KV only for committed tokens, and the
        continuation past them only if it begins with exactly those tokens. True when pre-drafted
        tokens remain for the next draft (a proactive hit)."""
        emitted = [int(t) for t in emitted]
        hit = len(self.ahead) >= len(emitted) and self.ahead[: len(emitted)] == emitted
        if hit:
            del self.ahead[: len(emitted)], self._ahead_q[: len(emitted)]
        else:
            self.kv.crop(len(self.committed) + num_accepted)
            self.ahead, self._ahead_q = [], []
        self.committed.extend(emitted)
        update_prefix_hasher(self._hasher, emitted)
        if self._history is not None:
            self._history.extend(emitted, strict=False)
        self._reusable = hit and bool(self.ahead)
        return self._reusable
