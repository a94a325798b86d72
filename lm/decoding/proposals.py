"""What a draft source proposes: a chain (:class:`ChainDraft`) or a tree (:class:`BeamTree`).
No torch import here (a lookup's chains carry no tensors, and an edge node drafting by lookup
alone imports this and never torch); a model's chain carries its ``q`` rows as a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ChainDraft:
    token_ids: list[int]  # [k]
    # [k, V] processed q of each drafted position; None: the point mass on each drafted token (a
    # deterministic proposal, as a lookup's: goodspeed.lm.decoding.lookup)
    probs: torch.Tensor | None
    # [k] the draft's probability of each drafted token: q_j(s_j), or for greedy requests (one-hot
    # q) the draft's softmax probability of its argmax
    token_probs: list[float]
    sampled: bool = False  # drawn from q (temperature > 0), not the argmax
    forced: int = 0  # leading tokens a grammar forced (fast-forward: always accepted)
    # a lookup's evidence for the tokens after the forced ones: the length of the context it
    # matched (goodspeed.lm.decoding.lookup); None for a model's draft
    evidence: int | None = None

    def q_rows(self) -> torch.Tensor | None:
        return self.probs if self.token_ids else None

    @property
    def expected_probs(self) -> list[float]:
        """[k] each position's confidence known BEFORE its token was drawn: ``E_{s~q_j}[q_j(s)] =
        sum_v q_j(v)^2`` for sampled drafts; for greedy ones (nothing is drawn) ``token_probs``.
        TETRIS ranks sampled tokens by this, never by their own sampled values (verifier.local)."""
        if not self.sampled or not self.token_ids or self.probs is None:
            return list(self.token_probs)
        return self.probs.double().square().sum(dim=-1).tolist()


@dataclass(frozen=True)
class BeamTree:
    """A candidate tree: ``parents[k]`` (-1: the root), ``path_probs[k]`` and ``depths[k]`` per node."""

    token_ids: list[int]
    parents: list[int]
    path_probs: list[float]
    depths: list[int]
