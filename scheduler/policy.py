"""The interface the verifier uses to choose next round's draft lengths by policy name.

A policy sees the round's numbers only — drafter ids, their smoothed acceptance and goodput
(GoodSpeed eqs. 3-4), the budget, per-drafter caps, the round index and a generator — and
returns one draft length per drafter. It is told each verified round through ``observe`` (the
distributed policies here are stateless between rounds, so theirs does nothing; policies with
memory keep it there). Registered names: ``goodspeed``, ``fixed``, ``random``.

``LOCAL_POLICIES`` names the policies of the verifier's local serving
(:mod:`goodspeed.verifier.local`), which decide per iteration what the verifier's own draft
model drafts and what it verifies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from goodspeed.scheduler.baselines import fixed_draft_lengths, random_draft_lengths
from goodspeed.scheduler.goodspeed import allocate_draft_lengths, fairness_exponent


LOCAL_POLICIES = ("none", "chain", "tetris", "adaserve", "turbospec", "nightjar")


@dataclass(frozen=True)
class AllocationInputs:
    """Everything a draft-length policy may look at for one round (arrays are ``[num_drafters]``)."""

    drafter_ids: Sequence[str]
    acceptance: np.ndarray
    goodput: np.ndarray
    budget: int
    max_lengths: np.ndarray | None
    round_index: int
    rng: np.random.Generator


class DraftLengthPolicy(Protocol):
    name: str

    def allocate(self, inputs: AllocationInputs) -> np.ndarray: ...

    def observe(self, drafter_ids: Sequence[str], drafted: np.ndarray, accepted: np.ndarray) -> None: ...


class _Stateless:
    def observe(self, drafter_ids: Sequence[str], drafted: np.ndarray, accepted: np.ndarray) -> None:
        return None


class GoodSpeedPolicy(_Stateless):
    """Eq. (5) under an alpha-fair utility (``log`` by default)."""

    name = "goodspeed"

    def __init__(self, utility: str | float = "log") -> None:
        fairness_exponent(utility)  # validate now, not on the first round
        self.utility = utility

    def allocate(self, inputs: AllocationInputs) -> np.ndarray:
        return allocate_draft_lengths(inputs.acceptance, inputs.goodput, inputs.budget, inputs.max_lengths, self.utility)


class FixedPolicy(_Stateless):
    """Fixed-S: ``C / N`` each; the leftover units rotate with the round index."""

    name = "fixed"

    def allocate(self, inputs: AllocationInputs) -> np.ndarray:
        n = len(inputs.drafter_ids)
        return fixed_draft_lengths(n, inputs.budget, inputs.max_lengths, offset=inputs.round_index)


class RandomPolicy(_Stateless):
    """Random-S: a uniformly random split with ``sum <= C``."""

    name = "random"

    def allocate(self, inputs: AllocationInputs) -> np.ndarray:
        return random_draft_lengths(len(inputs.drafter_ids), inputs.budget, inputs.rng, inputs.max_lengths)


POLICIES: dict[str, Callable[..., DraftLengthPolicy]] = {
    GoodSpeedPolicy.name: GoodSpeedPolicy,
    FixedPolicy.name: FixedPolicy,
    RandomPolicy.name: RandomPolicy,
}


def make_policy(name: str, **options) -> DraftLengthPolicy:
    """Build a registered draft-length policy; unknown names raise ``ValueError`` listing the known ones."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
    return factory(**options)
