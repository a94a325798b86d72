"""The settings of adapting a draft to its own traffic (:class:`AdaptConfig`; the work is
:mod:`goodspeed.lm.models.adapt`). No torch import: every edge node and local server checks them,
a node drafting by lookup alone included.
"""

from __future__ import annotations

from dataclasses import dataclass


HELD_BACK_EVERY = 4  # one recorded request in this many judges candidates instead of training them


@dataclass(frozen=True)
class AdaptConfig:
    every: int = 16  # finished requests between two fine-tunes
    keep: int = 256  # recent requests kept
    keep_tokens: int = 262_144  # tokens kept over all of them
    steps: int = 40  # optimiser steps a fine-tune
    batch: int = 8
    seq_len: int = 128  # tokens a training window (generated tokens and the context before them)
    lr: float = 3e-4
    # of the wall time while training (it pauses between steps): with the first fine-tune running
    # through the last 9 of a node's first 25 requests, those 25 took 1.17x the shipped node's time
    # at 0.5 and 1.01x at 0.25 (docs/MEASUREMENTS.md, *An edge draft that adapts*)
    cpu_share: float = 0.25
    dir: str | None = None  # where adopted weights persist; None: nowhere
    seed: int = 0

    def __post_init__(self) -> None:
        if self.every < 1 or self.keep < HELD_BACK_EVERY or self.keep_tokens < 1 or self.steps < 1 or self.batch < 1:
            raise ValueError(f"adapt: every, steps and batch must be >= 1, keep >= {HELD_BACK_EVERY}, keep_tokens >= 1")
        if self.seq_len < 2 or not self.lr > 0 or not 0 < self.cpu_share <= 1:
            raise ValueError("adapt: seq_len must be >= 2, lr > 0 and cpu_share in (0, 1]")
