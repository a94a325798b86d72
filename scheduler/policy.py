"""The interface the verifier uses to choose next round's draft lengths by policy name.

A policy sees the round's numbers only — drafter ids, their smoothed acceptance and goodput
(GoodSpeed eqs. 3-4), the budget, per-drafter caps, the round index and a generator — and
returns one draft length per drafter. It is told each verified round through ``observe`` (the
distributed policies here are stateless between rounds, so theirs does nothing; policies with
memory keep it there). Registered names: ``goodspeed`` (eq. 5 with an exploration floor, the
default: docs/EXPERIMENT-LOG.md has the evidence), ``goodspeed-paper`` (the paper's eq. 5 exactly, for
reproductions), ``goodspeed-ucb`` (eq. 5 on an optimistic acceptance, an evaluated alternative),
``goodspeed-time`` (the log utility of tokens per second, :mod:`.timing`: for ``--rounds async``),
``fixed``, ``random``.

A policy also names the acceptance smoothing it was chosen with (``eta``, eq. 3): the verifier
uses it unless the operator sets ``--eta`` (:func:`default_eta`).

The policies of the verifier's local serving, which decide per iteration what the verifier's own
draft model drafts and verifies, are a module each in :mod:`goodspeed.verifier.local_policies`
(``LOCAL_POLICY_CLASSES``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from goodspeed.scheduler.baselines import fixed_draft_lengths, random_draft_lengths
from goodspeed.scheduler.goodspeed import SmoothingConfig, allocate_draft_lengths, fairness_exponent
from goodspeed.scheduler.timing import allocate_time_aware



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
    # The evidence behind each acceptance estimate (GoodputEstimator.evidence): rounds that
    # measured it, and rounds since the last one. None: unknown (policies then ignore it).
    measured: np.ndarray | None = None
    stale: np.ndarray | None = None
    # Each drafter's period model (scheduler.timing.PeriodFit) as arrays (base, per_token, mean),
    # seconds; a drafter not timed yet has (1, 0, 1): its term is eq. 5's. None: no timing known.
    periods: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None


class DraftLengthPolicy(Protocol):
    name: str
    uses_periods: bool  # it reads AllocationInputs.periods (only then are they computed each round)

    def allocate(self, inputs: AllocationInputs) -> np.ndarray: ...

    def observe(self, drafter_ids: Sequence[str], drafted: np.ndarray, accepted: np.ndarray) -> None: ...


class _Stateless:
    uses_periods = False

    def observe(self, drafter_ids: Sequence[str], drafted: np.ndarray, accepted: np.ndarray) -> None:
        return None


class GoodSpeedPaperPolicy(_Stateless):
    """Eq. (5) under an alpha-fair utility (``log`` by default), exactly as the paper states it."""

    name = "goodspeed-paper"
    eta = 0.2

    def __init__(self, utility: str | float = "log") -> None:
        fairness_exponent(utility)  # validate now, not on the first round
        self.utility = utility

    def allocate(self, inputs: AllocationInputs) -> np.ndarray:
        return allocate_draft_lengths(inputs.acceptance, inputs.goodput, inputs.budget, inputs.max_lengths, self.utility)


class GoodSpeedPolicy(GoodSpeedPaperPolicy):
    """Eq. (5) with an exploration floor, so no estimate can starve: the default ``goodspeed``.

    Eq. (3) updates ``alpha_hat`` only in rounds with ``S > 0``; a drafter the allocation starves
    keeps a pessimistic estimate for ever (docs/EXPERIMENT-LOG.md, 8 drafters). Here a drafter whose
    acceptance has not been measured for more than ``patience`` rounds gets ``S >= 1`` (the
    stalest first if the budget cannot floor them all), and the rest of the budget is eq. (5)'s
    exact optimum under that floor: past its floor a drafter's units gain ``w a^k`` for
    ``k >= 2`` — those of a drafter of weight ``w a`` — so the same solver runs with its goodput
    scaled to ``X / a^(1/f)``. With no stale drafter it is exactly the paper's rule.

    It was chosen with ``eta = 0.1``: greedy ratios are 0 or 1, and eq. (5)'s integer optimum
    follows the noise of a faster average; the floor keeps the slower average from starving
    anyone (docs/EXPERIMENT-LOG.md, "Estimates that cannot deadlock").
    """

    name = "goodspeed"
    eta = 0.1

    def __init__(self, utility: str | float = "log", patience: int = 4) -> None:
        super().__init__(utility)
        if fairness_exponent(utility) <= 0:
            raise ValueError("the exploration floor needs an alpha-fair exponent > 0 (utility 'log', 'maxmin' or a number > 0)")
        if patience < 0:
            raise ValueError(f"patience must be >= 0, got {patience}")
        self.patience = patience

    def allocate(self, inputs: AllocationInputs) -> np.ndarray:
        if not self._anyone_stale(inputs):  # most rounds: the paper's rule, no array work here
            return super().allocate(inputs)
        floor = self.floor(inputs)
        if not floor.any():
            return super().allocate(inputs)
        a, x = inputs.acceptance, inputs.goodput
        caps = np.full(a.shape, inputs.budget, dtype=np.int64) if inputs.max_lengths is None else np.asarray(inputs.max_lengths, dtype=np.int64)
        rest_caps = caps - floor
        scaled = x.copy()
        live = floor.astype(bool) & (a > 0)
        scaled[live] = x[live] / a[live] ** (1.0 / fairness_exponent(self.utility))
        rest_caps[floor.astype(bool) & (a <= 0)] = 0  # nothing more to gain past the floor
        rest = allocate_draft_lengths(a, scaled, inputs.budget - int(floor.sum()), rest_caps, self.utility)
        return rest + floor

    def _anyone_stale(self, inputs: AllocationInputs) -> bool:
        return inputs.stale is not None and max(inputs.stale.tolist(), default=0) > self.patience

    def floor(self, inputs: AllocationInputs) -> np.ndarray:
        """``S >= 1`` for drafters unmeasured for more than ``patience`` rounds (stalest first)."""
        floor = np.zeros(len(inputs.drafter_ids), dtype=np.int64)
        if not self._anyone_stale(inputs):
            return floor
        caps = np.full(floor.shape, inputs.budget, dtype=np.int64) if inputs.max_lengths is None else np.asarray(inputs.max_lengths)
        stale = np.flatnonzero((inputs.stale > self.patience) & (caps > 0))
        floor[stale[np.argsort(-inputs.stale[stale], kind="stable")][: inputs.budget]] = 1
        return floor


class TimeAwareGoodSpeedPolicy(GoodSpeedPolicy):
    """GoodSpeed on tokens per second (:mod:`goodspeed.scheduler.timing`), with the default's
    exploration floor. Without timing (or with no drafter's period depending on its draft
    length) it is the default ``goodspeed``."""

    name = "goodspeed-time"
    uses_periods = True

    def __init__(self, patience: int = 4) -> None:
        super().__init__("log", patience)

    def allocate(self, inputs: AllocationInputs) -> np.ndarray:
        if inputs.periods is None or not np.any(inputs.periods[1] > 0):
            return super().allocate(inputs)
        base, per_token, mean = inputs.periods
        return allocate_time_aware(inputs.acceptance, inputs.goodput, base, per_token, mean, inputs.budget,
                                   inputs.max_lengths, self.floor(inputs))


class OptimisticGoodSpeedPolicy(GoodSpeedPaperPolicy):
    """Eq. (5) on an optimistic acceptance (UCB): ``min(1, alpha_hat + c * sqrt(alpha_hat (1 -
    alpha_hat) / (m + 1)))`` with ``m`` the rounds that measured it. A drafter starved of drafts
    keeps its bonus while the others' shrink, until the allocation tries it again."""

    name = "goodspeed-ucb"

    def __init__(self, utility: str | float = "log", bonus: float = 1.0) -> None:
        super().__init__(utility)
        if not bonus >= 0:
            raise ValueError(f"bonus must be >= 0, got {bonus}")
        self.bonus = bonus

    def allocate(self, inputs: AllocationInputs) -> np.ndarray:
        if inputs.measured is None:
            return super().allocate(inputs)
        a = inputs.acceptance
        optimistic = np.minimum(1.0, a + self.bonus * np.sqrt(a * (1.0 - a) / (inputs.measured + 1.0)))
        return allocate_draft_lengths(optimistic, inputs.goodput, inputs.budget, inputs.max_lengths, self.utility)


class FixedPolicy(_Stateless):
    """Fixed-S: ``C / N`` each; the leftover units rotate with the round index."""

    name = "fixed"
    eta = 0.2  # reported, not used

    def allocate(self, inputs: AllocationInputs) -> np.ndarray:
        n = len(inputs.drafter_ids)
        return fixed_draft_lengths(n, inputs.budget, inputs.max_lengths, offset=inputs.round_index)


class RandomPolicy(_Stateless):
    """Random-S: a uniformly random split with ``sum <= C``."""

    name = "random"
    eta = 0.2  # reported, not used

    def allocate(self, inputs: AllocationInputs) -> np.ndarray:
        return random_draft_lengths(len(inputs.drafter_ids), inputs.budget, inputs.rng, inputs.max_lengths)


POLICIES: dict[str, Callable[..., DraftLengthPolicy]] = {
    GoodSpeedPolicy.name: GoodSpeedPolicy,
    GoodSpeedPaperPolicy.name: GoodSpeedPaperPolicy,
    OptimisticGoodSpeedPolicy.name: OptimisticGoodSpeedPolicy,
    TimeAwareGoodSpeedPolicy.name: TimeAwareGoodSpeedPolicy,
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


def default_eta(name: str) -> float:
    """The acceptance smoothing (eq. 3) the policy was chosen with."""
    make_policy(name)  # unknown names raise the same error
    return float(getattr(POLICIES[name], "eta", SmoothingConfig.eta))


def smoothing_of(name: str, eta: float | None = None, beta: float = SmoothingConfig.beta) -> SmoothingConfig:
    """Eqs. (3)-(4)'s smoothing for a policy: ``eta`` if set, else the policy's own."""
    return SmoothingConfig(eta=default_eta(name) if eta is None else eta, beta=beta)
