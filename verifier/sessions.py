"""The engine's configuration and its per-drafter bookkeeping (sessions, requests, round rows)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from goodspeed.lm.runtime.prefix import new_prefix_hasher, update_prefix_hasher
from goodspeed.lm.decoding.history import TokenHistory
from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.lm.decoding.seeding import resolve_root_seed
from goodspeed.scheduler import DraftAllotments, SmoothingConfig, make_policy, smoothing_of
from goodspeed.verifier.types import Draft, Verdict

if TYPE_CHECKING:
    from goodspeed.verifier.verify_rows import RowInput


ATTENTION_PATHS = ("auto", "varlen", "masked")


@dataclass(frozen=True)
class EngineConfig:
    """Budget ``C`` per round, the draft-length policy, smoothing, and limits."""

    budget: int = 16
    policy: str = "goodspeed"
    smoothing: SmoothingConfig | None = None  # default: eq. 3's eta the policy was chosen with, beta 0.5
    max_drafters: int = 64
    max_draft_len: int = 16
    max_seq_len: int | None = None  # default: the model's max_position_embeddings
    seed: int | None = None  # the root seed (goodspeed.lm.decoding.seeding); None: fresh OS entropy
    packed: bool = True  # the target sees only real tokens (goodspeed.lm.runtime.attention); False: padded rows (reference)
    # Chunked prefill: at most this many prompt tokens per step, packed into the steps' forwards
    # (a prompt joins drafting when its last chunk is in); None: a prompt is prefilled whole, in
    # its own forward, when its request starts (in-process callers that drive steps themselves).
    prefill_chunk: int | None = None
    # Transit decoding: while a session that opted in (``join(transit=True)``) has no draft
    # queued — its draft is on the wire or being drafted — the steps that run give it a row of its
    # own (plain decoding: its pending token, no drafts) in what their drafts leave of ``budget``,
    # at most this many tokens between two of its verdicts. 0: off. See the engine's docstring.
    transit_tokens: int = 0
    # How packed forwards attend (goodspeed.lm.runtime.attention): "auto" takes flash's varlen kernel for
    # chains where there is one (CUDA, fp16 / bf16, a torch whose flash op takes per-sequence key
    # lengths) and masked SDPA elsewhere; "varlen" requires the kernel (the engine refuses to start
    # without it); "masked" keeps masked SDPA everywhere.
    attention: str = "auto"
    # Packed forwards whose rows share one masked attention group (trees; chains without the varlen
    # kernel) lay those rows out padded to the longest, pads included in the model's input, where
    # the step allows it (no prompt chunk, no slot with KV buffers of its own): attention then
    # gathers and scatters nothing, two ops a layer that a launch-bound GPU pays for, while the
    # linear layers see the pads (goodspeed.lm.runtime.kv_slots.SlotKVCache.pack). Off by default: not yet
    # timed on a GPU (docs/MEASUREMENTS.md).
    pad_rows: bool = False
    # Steps replayed as CUDA graphs (goodspeed.lm.runtime.graphs), one per shape: rows, queries and keys
    # rounded up to powers of two, each row padded; steps that do not fit (prompt chunks, a slot
    # with KV buffers of its own, more than MAX_GRAPH_TOKENS tokens or MAX_GRAPH_QUERIES a row) run eagerly. Local serving's
    # draft model replays its forwards the same way. CUDA only. Off by default until a GPU runs every
    # CUDA test with it on; on an H200 a step cost 2.4-5.5x less (docs/MEASUREMENTS.md).
    cuda_graphs: bool = False
    # The same fixed-shape steps through a decoder compiled by torch.compile (inductor, a handful of
    # graphs for every shape; goodspeed.lm.runtime.graphs.compiled), on any device; with cuda_graphs the
    # compiled kernels are what the graphs record. Local serving's draft too. The verifier's warm-up
    # compiles the engine's graphs (VerificationEngine.warm_up_steps) and the local draft's
    # (LocalServing.warm_up) before it serves. Off by default: a CPU needs a C++ compiler for it, and
    # it is not yet run with CUDA graphs on a GPU (docs/MEASUREMENTS.md).
    torch_compile: bool = False
    # Batch invariance (goodspeed.lm.runtime.invariant): every linear layer of the target runs its
    # rows in runs of at most 32, so a token's logits are the same bit for bit whatever else its
    # step holds, and greedy output in bf16 equals plain decoding's at batch > 1 too (without it:
    # one request at a time; as measured, docs/DESIGN.md, *Lossless in bf16*). bf16 on a CPU with
    # AMX only (the runner refuses others); off by default: a forward of over 32 tokens costs more.
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        if self.budget < 0 or self.max_drafters < 1 or self.max_draft_len < 0:
            raise ValueError("budget and max_draft_len must be >= 0, max_drafters >= 1")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ValueError("max_seq_len must be >= 2")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1 (or None: whole prompts)")
        if self.transit_tokens < 0:
            raise ValueError("transit_tokens must be >= 0 (0: no transit decoding)")
        if self.attention not in ATTENTION_PATHS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_PATHS)}, not {self.attention!r}")
        if self.attention == "varlen" and not self.packed:
            raise ValueError("attention 'varlen' needs packed forwards")
        if self.pad_rows and not self.packed:
            raise ValueError("pad_rows needs packed forwards (padded ones pad every row already)")
        if self.cuda_graphs and not self.packed:
            raise ValueError("cuda_graphs needs packed forwards")
        if self.batch_invariant and (self.cuda_graphs or self.torch_compile):
            raise ValueError("batch_invariant runs the target's layers eagerly: not with cuda_graphs or torch_compile")
        if self.torch_compile and not self.packed:
            raise ValueError("torch_compile needs packed forwards")
        make_policy(self.policy)  # unknown names fail here, not on the first round
        if self.smoothing is None:
            object.__setattr__(self, "smoothing", smoothing_of(self.policy))
        if self.seed is not None:
            resolve_root_seed(self.seed)


@dataclass
class Request:
    committed: list[int]  # prompt + generated token ids; the last one is pending (not in KV)
    prompt_len: int
    sampling: SamplingParams
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    hasher: object = field(default_factory=new_prefix_hasher)  # BLAKE2b of ``committed`` so far
    generator: object = None  # torch.Generator of a seeded request's uniforms; None: the engine's stream
    logprobs: int | None = None  # verdicts carry each token's log-probability and this many top ones; None: none
    # The last ``generated`` tokens of the prompt are output already (a request resumed from its
    # verified text): its penalties count them as output, not as prompt.
    generated: int = 0
    history: TokenHistory | None = None  # what its penalties read; None unless its sampling adjusts logits
    # Its first verdict carries each prompt token's log-probability (after the first) and this many
    # top ones, gathered as its prompt is prefilled; None: none.
    prompt_logprobs: int | None = None
    prompt_scores: list = field(default_factory=list)  # TokenLogprob of prompt tokens 1.., as prefill reaches them
    prompt_scores_sent: bool = False

    def __post_init__(self) -> None:
        update_prefix_hasher(self.hasher, self.committed)
        if self.sampling.adjusts_logits:
            split = self.prompt_len - self.generated
            self.history = TokenHistory(self.committed[:split], self.committed[split:], self.sampling.structured)

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - (len(self.committed) - self.prompt_len)

    def commit(self, tokens: list[int]) -> None:
        self.committed.extend(tokens)
        update_prefix_hasher(self.hasher, tokens)  # O(new tokens) per round
        if self.history is not None:
            self.history.extend(tokens)


@dataclass
class Session:
    session_id: str
    name: str
    source: DraftAllotments  # the book that sizes its drafts (the engine's, or local serving's)
    request: Request | None = None
    round_index: int = 0  # the round the session submits next
    pending: Draft | None = None
    last_draft: Draft | None = None
    last_verdict: Verdict | None = None
    transit: bool = False  # it reads verdicts carrying tokens decoded while its draft was in transit
    decoded: list[int] = field(default_factory=list)  # tokens decoded in transit since its last verdict
    decoded_end: str | None = None  # "eos" / "length": its request ended in transit (told with the next verdict)
    decoded_logprobs: list = field(default_factory=list)  # TokenLogprob of ``decoded``, if its request asked


@dataclass
class Row:
    """One participant of a round."""

    session: Session
    slot: int
    input: RowInput
    parents: list[int] | None  # None for a chain; else parent of each new token (-1: prefix)
    submitted: Draft | None = None  # the draft as submitted, when the row verifies only its tail (transit)
    transit: bool = False  # plain decoding for a session whose draft has not arrived (transit decoding)

    @property
    def draft(self) -> Draft:
        """The draft as submitted (what the verdict answers)."""
        return self.submitted if self.submitted is not None else self.input.draft

    @property
    def tokens(self) -> list[int]:
        return self.input.tokens
