"""What every local-serving policy is: :class:`LocalPolicy`, and the :class:`Plan` it makes for a
request each iteration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from goodspeed.verifier.local import LocalConfig, LocalServing
    from goodspeed.verifier.local_requests import LocalRequest


@dataclass
class Plan:
    """What one request has verified this iteration: drafted tokens as a chain (``parents`` None)
    or a tree (each node's parent index, -1 for the root), and for a sampled chain the ``q`` rows
    its tokens were drawn from (None: point masses)."""

    token_ids: list[int]
    parents: list[int] | None = None
    q: torch.Tensor | None = None  # [k, V] for sampled chains


class LocalPolicy:
    """One paper's rule for what local serving drafts and verifies each iteration.

    A policy is built per :class:`~goodspeed.verifier.local.LocalServing` (it may keep state, as
    Nightjar's bandit does), checks the settings it needs before anything loads (:meth:`check`),
    plans an iteration (:meth:`plan`: per request the tokens to verify, and the chain length ``k``
    when it chose one) and hears how the iteration went (:meth:`observe`). It drafts through the
    serving's :meth:`~goodspeed.verifier.local.LocalServing.chains` (chains from its draft source,
    grammar-forced tokens first) or the draft source's own trees.
    """

    name = ""

    def __init__(self, serving: LocalServing) -> None:
        self.serving = serving

    @staticmethod
    def check(config: LocalConfig) -> None:
        """Raise ``ValueError`` for settings this policy cannot run with."""

    @staticmethod
    def drafting(config: LocalConfig) -> tuple[int, tuple[int, int] | None]:
        """What the draft model's warm-up drafts for this policy (:meth:`LocalServing.warm_up
        <goodspeed.verifier.local.LocalServing.warm_up>`): the longest chain it may draft (0: none)
        and the deepest, widest tree ``(depth, width)`` (None: none)."""
        return 0, None

    def plan(self, reqs: list[LocalRequest]) -> tuple[dict[str, Plan], int | None]:
        raise NotImplementedError

    def observe(self, batch_size: int, k: int | None, emitted: int, duration_s: float, prefill_tokens: int = 0) -> None:
        """The iteration planned with ``k`` emitted ``emitted`` tokens in ``duration_s`` seconds,
        ``prefill_tokens`` of other requests' prompts prefilled in the same forward."""
