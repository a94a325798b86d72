"""How a request samples: :class:`SamplingParams`, the limits its fields are checked against, and
the sampling features a verifier names. No tensors here (an edge node drafting by lookup alone
imports this and never torch); the maths that applies these settings is
:mod:`goodspeed.lm.decoding.sampling` and :mod:`goodspeed.lm.decoding.adjust`.

A request may also adjust the logits before that processing, as vLLM's sampler does
(:func:`goodspeed.lm.decoding.adjust.adjust_logits`): ``logit_bias`` (OpenAI's: added to the logits), then the repetition penalty
(CTRL's, Keskar et al. 2019, as Hugging Face and vLLM apply it: a logit of a token seen in the prompt
or the output is divided by the penalty where positive, multiplied where negative), then the
frequency and presence penalties (OpenAI's: ``count * frequency + (count > 0) * presence`` taken
off a token's logit, ``count`` its occurrences in the output), then vLLM's ``min_tokens`` (the
tokens that end the text, EOS and the request's stop token ids, get a logit of -inf while fewer
than ``min_tokens`` tokens are generated), vLLM's ``allowed_token_ids`` (every other token gets
a logit of -inf), vLLM's ``bad_words`` (a banned sequence's last token gets -inf where the output
ends with the rest of it), and a structured output's grammar (:mod:`goodspeed.lm.decoding.structured`:
every token it refuses after the text gets -inf). The penalties, ``min_tokens``, ``bad_words`` and
the grammar read the text before
each position, so a speculative row's positions each see the history plus the drafted tokens
before them (:mod:`goodspeed.lm.decoding.adjust`): the target's
adjusted distribution at each position is the one plain decoding would sample from there, and
verification stays exact against it. Greedy decoding is the argmax of the adjusted logits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from goodspeed.lm.decoding.structured import Structure


# Below this (and above 0) ``logits / temperature`` overflows float32 to inf and the softmax to NaN
# (1e-45, a float32 subnormal, did); vLLM treats such temperatures as greedy, we refuse them.
MIN_TEMPERATURE = 1e-5
# The most top log-probabilities a request may ask for with its tokens' own (vLLM's default max_logprobs).
MAX_TOP_LOGPROBS = 20
# OpenAI's ranges: a logit bias lies in [-100, 100]; presence and frequency penalties in [-2, 2].
MAX_LOGIT_BIAS = 100.0
MAX_PENALTY = 2.0
# The most tokens one request may bias (OpenAI's API takes 300; vLLM sets no limit).
MAX_LOGIT_BIAS_TOKENS = 1024
# vLLM's bad_words (as token sequences): at most this many, each at most this many tokens.
# The sampling features a verifier says it applies (StartRequestReply.features), by name, with
# what each covers. A new sampling option that an older verifier would ignore adds its name here
# and to SamplingParams.features.
FEATURES = {
    "extended_sampling": "min_p, penalties or logit_bias",
    "min_tokens": "min_tokens",
    "allowed_token_ids": "allowed_token_ids",
    "structured_output": "structured output",
    "structured_after": "structured output after the reasoning",
    "bad_words": "bad_words",
    # Not a sampling option: the round protocol's DraftRequest.decode_ahead (a drafter uses it
    # only with a verifier that lists it).
    "decode_ahead": "decoding ahead of an empty draft",
    "decode_ahead_until_match": "decoding ahead until the text repeats (DraftRequest.decode_ahead_until_match)",
}
MAX_BAD_WORDS = 128
MAX_BAD_WORD_TOKENS = 32


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of a committed token, from its raw logits (before temperature,
    top-k and top-p: vLLM's default), the ``top`` most probable tokens at that position, and the
    token's ``rank`` there: vLLM's, the count of tokens at least as probable, itself included (1:
    the most probable; tokens tied with it count against it). The ``i``-th of ``top`` ranks ``i + 1``.
    ``rank`` is known for a prompt's scores only (vLLM's ``prompt_logprobs`` shows it; on a CPU it
    adds 44-83% to the log-probabilities' cost, which no generated token's format needs):
    None for generated tokens, from a verifier older than it, and for an echoed prompt's first
    token, which follows nothing."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability), most probable first
    rank: int | None = None


@dataclass(frozen=True)
class SamplingParams:
    """How a request samples. ``temperature = 0`` is greedy, else at least :data:`MIN_TEMPERATURE`;
    ``top_k = 0``, ``top_p = 1`` and ``min_p = 0`` are off. The logits adjustments
    (:func:`goodspeed.lm.decoding.adjust.adjust_logits`) are off at their defaults: ``presence_penalty = frequency_penalty = 0``,
    ``repetition_penalty = 1``, no ``logit_bias`` (``(token id, bias)`` pairs, ids ascending),
    ``min_tokens = 0``, no ``allowed_token_ids`` (vLLM's: ids ascending; only these may be
    sampled). ``eos_token_ids``: the tokens that end the request's text (EOS and its stop token
    ids), which ``min_tokens`` holds back; only that reads them (the request's own stop rule
    travels with it, not with its sampling: :meth:`ending_with` copies it in)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    eos_token_ids: tuple[int, ...] = ()
    allowed_token_ids: tuple[int, ...] = ()
    structured: Structure | None = None  # a grammar the text must match (goodspeed.lm.decoding.structured)
    # vLLM's bad_words, tokenized: a sequence's last token gets -inf where the output ends with the rest
    bad_words: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE:g}, got {self.temperature:g}")
        if isinstance(self.top_k, bool) or int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must lie in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must lie in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be finite and > 0, got {self.repetition_penalty}")
        bias = tuple((int(t), float(b)) for t, b in self.logit_bias)
        if len(bias) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"logit_bias may bias at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(bias)}")
        ids = [t for t, _ in bias]
        if any(t < 0 for t in ids) or ids != sorted(set(ids)):
            raise ValueError("logit_bias token ids must be >= 0, distinct and ascending")
        if any(not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for _, b in bias):
            raise ValueError(f"a logit bias must lie in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        object.__setattr__(self, "logit_bias", bias)
        if isinstance(self.min_tokens, bool) or int(self.min_tokens) != self.min_tokens or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens}")
        object.__setattr__(self, "min_tokens", int(self.min_tokens))
        ends = tuple(sorted({int(t) for t in self.eos_token_ids}))
        if any(t < 0 for t in ends):
            raise ValueError("eos_token_ids must be >= 0")
        object.__setattr__(self, "eos_token_ids", ends)
        allowed = tuple(int(t) for t in self.allowed_token_ids)
        if any(t < 0 for t in allowed) or list(allowed) != sorted(set(allowed)):
            raise ValueError("allowed_token_ids must be >= 0, distinct and ascending")
        object.__setattr__(self, "allowed_token_ids", allowed)
        words = tuple(tuple(int(t) for t in w) for w in self.bad_words)
        if len(words) > MAX_BAD_WORDS or any(not 1 <= len(w) <= MAX_BAD_WORD_TOKENS for w in words):
            raise ValueError(f"bad_words holds at most {MAX_BAD_WORDS} sequences of 1 to {MAX_BAD_WORD_TOKENS} tokens")
        if any(t < 0 for w in words for t in w):
            raise ValueError("bad_words token ids must be >= 0")
        object.__setattr__(self, "bad_words", tuple(dict.fromkeys(words)))
        if self.structured is not None and self.bad_words:
            raise ValueError("structured output cannot be combined with bad_words (together they could leave no token)")
        if self.structured is not None and not isinstance(self.structured, Structure):
            raise ValueError(f"structured must be a goodspeed.lm.decoding.structured.Structure, got {type(self.structured).__name__}")
        if self.structured is not None and (self.min_tokens or self.allowed_token_ids):
            # Either could leave a position with no token the grammar allows (min_tokens holding
            # back the EOS that a complete text needs; allowed ids outside the grammar's).
            raise ValueError("structured output cannot be combined with "
                             + ("min_tokens" if self.min_tokens else "allowed_token_ids"))

    def ending_with(self, eos_token_ids: Sequence[int]) -> SamplingParams:
        """These settings with the request's ending tokens, which ``min_tokens`` holds back (itself
        when ``min_tokens`` is 0: nothing reads them then)."""
        if not self.min_tokens:
            return self
        return replace(self, eos_token_ids=tuple(eos_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Some penalty is on: the adjusted logits depend on the text (:class:`TokenHistory`)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def extended(self) -> bool:
        """Uses min-p, a penalty or a logit bias (the ``extended_sampling`` feature)."""
        return self.min_p > 0.0 or self.penalized or bool(self.logit_bias)

    def features(self) -> set[str]:
        """The :data:`FEATURES` this request uses: a verifier that does not list one of them in
        its ``StartRequestReply.features`` (an older one) would ignore it."""
        used = {"extended_sampling": self.extended, "min_tokens": bool(self.min_tokens),
                "allowed_token_ids": bool(self.allowed_token_ids), "structured_output": self.structured is not None,
                "structured_after": self.structured is not None and self.structured.after is not None,
                "bad_words": bool(self.bad_words)}
        return {name for name, on in used.items() if on}

    @property
    def adjusts_logits(self) -> bool:
        """:func:`adjust_logits` changes this request's logits (a penalty, a logit bias,
        min_tokens holding back its ending tokens, allowed_token_ids, a structured output grammar, or
        bad_words)."""
        return (self.penalized or bool(self.logit_bias) or (self.min_tokens > 0 and bool(self.eos_token_ids))
                or bool(self.allowed_token_ids) or self.structured is not None or bool(self.bad_words))

    @property
    def nothing_allowed(self) -> bool:
        """Every one of ``allowed_token_ids`` is held back, by ``min_tokens`` (an ending token) or
        a one-token bad word: no token could be sampled at the first positions. A request must be
        refused for it."""
        held = set(self.eos_token_ids) if self.min_tokens else set()
        banned = held | {w[0] for w in self.bad_words if len(w) == 1}  # banned everywhere
        return bool(self.allowed_token_ids) and set(self.allowed_token_ids) <= banned


PROPOSAL_TOP_K = 256  # a drafter's default cap on the support of the q it samples from and sends (cap_support)


def check_proposal_top_k(k: int) -> int:
    """``k`` if it is a valid proposal cap (an integer >= 0; 0: the whole vocabulary), else ValueError."""
    if isinstance(k, bool) or int(k) != k or k < 0:
        raise ValueError(f"proposal_top_k must be an integer >= 0 (0: the whole vocabulary), got {k!r}")
    return int(k)
