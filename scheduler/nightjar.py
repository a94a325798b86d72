"""Nightjar: a per-batch-size bandit over the speculative length, aware of switching cost.

Implements Nightjar (Li et al., "Nightjar: bandit-based adaptive speculative length", arXiv
2512.22420; Section 3, Algorithm 1 and eq. 3). Each batch
size ``B`` keeps its own hierarchy: blocks ``j`` of length ``H = 2^(j-1)`` steps-squared, split into
bins of ``sqrt(H)`` steps. A bin is an exploration bin with probability ``1 / sqrt(b)`` (``b`` the
bin's index within its block); exploration plays a uniform arm in ``0..G_max``, exploitation plays

    argmin_gamma  1 / g(B, gamma) + 1[prev = 0 and gamma > 0] * c_prefill / gamma      (eq. 3)

where ``g`` is the running mean of observed goodput (``g^(n) = g^(n-1) + (r - g^(n-1)) / n``,
``g^(0) = 0``, so an arm never played is never exploited) and ``c_prefill`` the cost, in the same
time unit as ``1 / g``, of rebuilding the draft KV cache after speculation was off. Ties go to the
shorter length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass
class _BatchState:
    """Alg. 1 lines 1-3 for one batch size, plus its arms' running means."""

    num_arms: int
    block: int = 1  # j_B
    horizon: int = 1  # H_B
    bin: int = 1  # b_B
    step_in_bin: int = 1  # tau_B
    exploring: bool = False
    mean_goodput: list[float] = field(default_factory=list)
    plays: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.mean_goodput = [0.0] * self.num_arms
        self.plays = [0] * self.num_arms

    def advance(self) -> None:
        """Lines 16-22: end of a step; close the bin after sqrt(H) steps, the block after sqrt(H) bins."""
        self.step_in_bin += 1
        if self.step_in_bin * self.step_in_bin > self.horizon:
            self.bin += 1
            self.step_in_bin = 1
            if self.bin * self.bin > self.horizon:
                self.block += 1
                self.horizon = 2 ** (self.block - 1)
                self.bin = 1


class NightjarBandit:
    """Chooses the speculative length ``gamma`` in ``0..max_length`` for each decoding step."""

    def __init__(self, max_length: int) -> None:
        if max_length < 1:
            raise ValueError("max_length must be >= 1")
        self.max_length = int(max_length)
        self._states: dict[int, _BatchState] = {}
        self.previous_length = 0  # gamma_{t-1}; speculation starts off (no draft KV yet)

    def _state(self, batch_size: int) -> _BatchState:
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        state = self._states.get(batch_size)
        if state is None:
            state = self._states[batch_size] = _BatchState(self.max_length + 1)
        return state

    def choose_arm(self, batch_size: int, rng: np.random.Generator, prefill_cost_s: float = 0.0) -> int:
        """Alg. 1 lines 5-14 and 16-22 for one step; returns ``gamma_t``."""
        state = self._state(batch_size)
        if state.step_in_bin == 1:
            state.exploring = rng.random() < 1.0 / math.sqrt(state.bin)
        if state.exploring:
            arm = int(rng.integers(0, self.max_length + 1))
        else:
            arm = self.exploit(batch_size, prefill_cost_s)
        state.advance()
        self.previous_length = arm
        return arm

    def exploit(self, batch_size: int, prefill_cost_s: float = 0.0) -> int:
        """Eq. (3) given the current estimates and the previous step's length."""
        means = self._state(batch_size).mean_goodput
        switching_on = self.previous_length == 0
        best_arm, best_cost = 0, math.inf
        for arm, g in enumerate(means):
            cost = 1.0 / g if g > 0 else math.inf
            if switching_on and arm > 0:
                cost += prefill_cost_s / arm
            if cost < best_cost:
                best_arm, best_cost = arm, cost
        return best_arm

    def observe(self, batch_size: int, arm: int, goodput_tok_s: float) -> None:
        """Line 15: fold the reward of playing ``arm`` into its running mean."""
        if not 0 <= arm <= self.max_length:
            raise ValueError(f"arm {arm} outside 0..{self.max_length}")
        if not math.isfinite(goodput_tok_s) or goodput_tok_s < 0:
            raise ValueError("goodput must be finite and >= 0")
        state = self._state(batch_size)
        state.plays[arm] += 1
        state.mean_goodput[arm] += (goodput_tok_s - state.mean_goodput[arm]) / state.plays[arm]

    def is_exploring(self, batch_size: int) -> bool:
        """Whether the last step chosen for this batch size was in an exploration bin."""
        return self._state(batch_size).exploring
