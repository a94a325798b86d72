"""Fixed-S and Random-S, the two baselines of GoodSpeed's evaluation.

GoodSpeed (arXiv 2512.09963, Section IV-B2): "Fixed-S: each draft server consistently
generates a fixed number of tokens per iteration, with S_i = C/N; Random-S: each draft server
randomly samples S_i per iteration, constrained such that the total across clients does not
exceed C."
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def _caps(num_clients: int, budget: int, max_lengths) -> list[int]:
    """Each client's cap, ``min(max_length, C)``, as Python ints: a round has a handful of
    clients, where numpy's per-call overhead would dominate."""
    if num_clients < 0:
        raise ValueError("num_clients must be >= 0")
    if isinstance(budget, bool) or int(budget) != budget or budget < 0:
        raise ValueError(f"budget must be an integer >= 0, got {budget!r}")
    if max_lengths is None:
        return [int(budget)] * num_clients
    caps = np.asarray(max_lengths).reshape(-1).tolist()
    if len(caps) != num_clients or any(c < 0 or c != math.floor(c) for c in caps):
        raise ValueError("max_lengths must hold one integer >= 0 per client")
    return [min(int(c), int(budget)) for c in caps]


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
    lengths = [0] * num_clients
    order = [(i + int(offset)) % max(num_clients, 1) for i in range(num_clients)]
    left = int(budget)
    while left > 0:
        # Split what is left equally among clients still under their cap; the capped drop out.
        under = [i for i in order if lengths[i] < caps[i]]
        if not under:
            break
        share, extra = divmod(left, len(under))
        granted = 0
        for rank, i in enumerate(under):
            grant = min(share + (rank < extra), caps[i] - lengths[i])
            lengths[i] += grant
            granted += grant
        left -= granted
        if granted == 0:
            break
    return np.array(lengths, dtype=np.int64)


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
        return np.zeros(0, dtype=np.int64)
    shares = rng.dirichlet(np.ones(num_clients + 1))
    split = rng.multinomial(int(budget), shares)[:num_clients]
    return np.minimum(split.astype(np.int64), caps)
