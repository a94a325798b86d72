"""A request's text as its logit adjustments read it (:class:`TokenHistory`), kept by the verifier
for each request and by a drafter for its drafts' own adjustments. No tensors here: the rules that
read it are :mod:`goodspeed.lm.decoding.adjust`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from goodspeed.lm.decoding.structured import Constraint, Structure, StructureError


class TokenHistory:
    """A request's text as its penalties read it: the prompt's distinct token ids (the repetition
    penalty counts them as seen), how often each token occurs in the output, how many tokens the
    output holds (``min_tokens`` reads that), and the output itself (``bad_words`` reads its end).
    Extended with each committed token; a speculative row's drafted tokens come on top as
    :func:`adjust_logits`' ``paths``, never into the history itself.
    With a bound ``structure`` it also holds the request's grammar matcher (``constraint``), which
    consumes the output (:class:`~goodspeed.lm.decoding.structured.StructureError` if the grammar refuses it)."""

    def __init__(self, prompt: Sequence[int], output: Sequence[int] = (), structure: Structure | None = None) -> None:
        self.prompt = sorted_unique(np.asarray(list(prompt), dtype=np.int64))
        self.counts: Counter[int] = Counter(int(t) for t in output)
        self.generated = len(output)
        self.output = [int(t) for t in output]  # bad_words read its last tokens
        self.constraint: Constraint | None = None if structure is None else structure.constraint(output)

    def extended(self, tokens: Sequence[int]) -> "TokenHistory":
        """A copy of this history with ``tokens`` added (a drafter's, as :meth:`extend` with
        ``strict`` False); this one is unchanged."""
        other = object.__new__(TokenHistory)
        other.prompt, other.counts, other.generated = self.prompt, Counter(self.counts), self.generated
        other.output = list(self.output)
        other.constraint = None if self.constraint is None else self.constraint.copy()
        other.extend(tokens, strict=False)
        return other

    def extend(self, tokens: Sequence[int], strict: bool = True) -> None:
        """Add committed ``tokens``. ``strict`` False (a drafter's copy of the text, which the
        verifier decides): a grammar refusing them drops the constraint instead of raising, as
        where the verifier's matcher ran past its limits and ended the text with EOS; the drafts
        then go unmasked, which costs acceptance only."""
        if self.constraint is not None:
            try:
                self.constraint.extend(tokens)
            except StructureError:
                if strict:
                    raise
                self.constraint = None
        self.counts.update(int(t) for t in tokens)
        self.generated += len(tokens)
        self.output.extend(int(t) for t in tokens)


def sorted_unique(x: np.ndarray) -> np.ndarray:
    """``np.unique(x)`` by sorting: numpy 2's default for integers hashes, which measured 11-17x
    slower here (5,600 keys: 898-906 us against 54-81 us; ``bench_penalties --numpy``)."""
    x = np.sort(x)
    return x[np.concatenate(([True], x[1:] != x[:-1]))] if len(x) else x
