"""Fixed-S and Random-S, the two baselines of GoodSpeed's evaluation.

GoodSpeed (seeds 003_e4f9b92fd7e1d2ba, Section IV-B2): "Fixed-S: each draft server consistently
generates a fixed number of tokens per iteration, with S_i = C/N; Random-S: each draft server
randomly samples S_i per iteration, constrained such that the total across clients does not
exceed C."
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _caps(num_clients: int, budget: int, max_lengths) -> np.ndarray:
    if num_clients < 0:
        raise ValueError("num_clients must be >= 0")
    if isinstance(budget, bool) or int(budget) != budget or budget < 0:
        raise ValueError(f"budget must be an integer >= 0, got {budget!r}")
    if max_lengths is None:
        return np.full(num_clients, int(budget), dtype=np.int64)
    caps = np.asarray(max_lengths).reshape(-1)
    if caps.size != num_clients or np.any(caps < 0) or np.any(caps != np.floor(caps)):
        raise ValueError("max_lengths must hold one integer >= 0 per client")
    return np.minimum(caps.astype(np.int64), int(budget))


def fixed_draft_lengths(
    num_clients: int,
    budget: int,
    max_lengths: Sequence[int] | np.ndarray | None = None,
    offset: int = 0,
) -> np.ndarray:
    """Equal split ``S_i = C // N``; the ``C % N`` leftover units go one each to the clients
    ``offset, offset + 1, ...`` (mod N), so a caller that passes the round number rotates them.
    A client capped below its share keeps its cap and the rest is split among the others.

    >>> fixed_draft_lengths(3, 7).tolist()
    [3, 2, 2]
    >>> fixed_draft_lengths(3, 7, offset=1).tolist()
    [2, 3, 2]
    """
    caps = _caps(num_clients, budget, max_lengths)
    lengths = np.zeros(num_clients, dtype=np.int64)
    order = (np.arange(num_clients) + offset) % max(num_clients, 1)
    left = int(budget)
    open_ = caps > 0
    while left > 0 and open_.any():
        # Split what is left equally among clients still under their cap; the capped drop out.
        idx = order[open_[order]]
        share, extra = divmod(left, idx.size)
        grant = np.full(idx.size, share, dtype=np.int64)
        grant[:extra] += 1
        grant = np.minimum(grant, caps[idx] - lengths[idx])
        lengths[idx] += grant
        left -= int(grant.sum())
        open_ = lengths < caps
        if grant.sum() == 0:
            break
    return lengths


def random_draft_lengths(
    num_clients: int,
    budget: int,
    rng: np.random.Generator,
    max_lengths: Sequence[int] | np.ndarray | None = None,
) -> np.ndarray:
    """A uniformly random split of the budget: ``(S_1, ..., S_N, slack)`` is drawn uniformly among
    all ``N + 1`` non-negative integers summing to ``C`` (a Dirichlet(1)-multinomial draw), so
    ``sum S_i <= C``; then each ``S_i`` is clipped to its cap.
    """
    caps = _caps(num_clients, budget, max_lengths)
    if num_clients == 0:
        return caps
    shares = rng.dirichlet(np.ones(num_clients + 1))
    split = rng.multinomial(int(budget), shares)[:num_clients]
    return np.minimum(split.astype(np.int64), caps)
