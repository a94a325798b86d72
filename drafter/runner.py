"""Draft-side model runner: drafts exactly ``S`` tokens with its own KV cache and applies verdicts.

The committed text (prompt + generated) is authoritative on the verifier; the runner mirrors it.
Its KV cache holds a prefix of the committed tokens plus the drafts it has fed; after a verdict
the cache is cropped to the committed tokens plus the accepted drafts (rollback), and whatever
committed tokens are not yet cached (at least the correction/bonus token) are fed at the start of
the next draft. The draft distribution ``q_j`` of every drafted token is returned after the same
:func:`goodspeed.lm.sampling.process_logits` the verifier applies to the target.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from goodspeed.lm.prefix import new_prefix_hasher, update_prefix_hasher
from goodspeed.lm.sampling import SamplingParams, process_logits, sample_from


@dataclass(frozen=True)
class DraftOutput:
    token_ids: list[int]  # [S]
    probs: torch.Tensor  # [S, V] float32 q_j after logits processing: what was sampled from and travels

    def q_to_send(self, sampling: SamplingParams) -> tuple[str, object]:
        """How q travels, exactly: ``("none", None)`` for greedy (q is the point mass) or empty
        drafts; ``("sparse", [(ids, probs), ...])`` — each row's support — when the sampling
        truncates; else ``("dense", probs [S, V])``."""
        if sampling.greedy or not self.token_ids:
            return "none", None
        if sampling.truncates:
            rows = []
            for row in self.probs:
                ids = torch.nonzero(row > 0).squeeze(-1)
                rows.append((ids.tolist(), row[ids].tolist()))
            return "sparse", rows
        return "dense", self.probs


class DraftRunner:
    """One drafter's model state for one request at a time."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.start([])

    def start(self, prompt_ids: Sequence[int]) -> None:
        """Begin a request (or resynchronise with the verifier's committed tokens)."""
        self.committed = [int(t) for t in prompt_ids]
        self.cache = DynamicCache()
        self._hasher = new_prefix_hasher()
        update_prefix_hasher(self._hasher, self.committed)

    @property
    def prefix_hash(self) -> str:
        """:func:`goodspeed.lm.prefix.prefix_hash` of ``committed``, kept incrementally (O(new tokens) a round)."""
        return self._hasher.hexdigest()

    @property
    def cached_len(self) -> int:
        return self.cache.get_seq_length()

    def _logits_after(self, tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True)
        return out.logits[0, -1]

    def draft(self, num_tokens: int, sampling: SamplingParams, generator: torch.Generator) -> DraftOutput:
        """Draft ``num_tokens`` tokens after the committed text."""
        if num_tokens <= 0:
            return DraftOutput([], torch.zeros(0, self.model.config.vocab_size))
        pending = len(self.committed) - 1  # the last committed token is always fed again
        if self.cached_len > pending:  # drafting again without a verdict: drop the old drafts
            self.cache.crop(pending - self.cached_len)
        feed = self.committed[self.cached_len :]
        tokens, probs = [], []
        for j in range(num_tokens):
            # q as it travels (float32): the token is sampled from exactly what the verifier gets,
            # so a drafted token never has q = 0 there (a float64 q below float32's range would).
            q = process_logits(self._logits_after(feed).double(), sampling).float()
            token = int(sample_from(q, torch.rand(1, generator=generator, dtype=torch.float64)).item())
            tokens.append(token)
            probs.append(q)
            feed = [token]
        return DraftOutput(tokens, torch.stack(probs))

    def apply(self, emitted: Sequence[int], num_accepted: int) -> None:
        """Append the verdict's tokens; keep cached KV only for committed tokens."""
        keep = min(len(self.committed) + num_accepted, self.cached_len)
        if keep < self.cached_len:
            self.cache.crop(keep - self.cached_len)
        emitted = [int(t) for t in emitted]
        self.committed.extend(emitted)
        update_prefix_hasher(self._hasher, emitted)
