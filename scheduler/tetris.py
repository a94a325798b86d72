"""TETRIS: pick the draft tokens of a batch most likely to be accepted, under a capacity.

Implements TETRIS (seeds 004_b5774adbc245755c, Section 4.1, Algorithm 1). Each request drafts
``k + extra`` tokens; the token at position ``j`` of request ``i`` is worth its cumulative draft
probability ``prod_{t<=j} q_{i,t}(s_{i,t})``, a surrogate of the probability that the whole prefix
up to ``j`` is accepted. Algorithm 1 pops the best frontier token of a heap ``C`` times. Because a
cumulative product of probabilities never grows along a row, "the ``C`` best tokens overall" is
already prefix-closed per row, so the same selection is computed here with one sort over the
batch (ties: lower request index, then earlier position — the heap's order). VSR, the paper's
metric (eq. 1), is ``accepted / sent``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _log_cumulative(draft_probs: Sequence[np.ndarray] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(log cumulative draft probability [num_requests, max_len], lengths [num_requests])``.

    Rows are padded with probability 1 past their length, so one ``cumsum`` serves the batch.
    """
    if isinstance(draft_probs, np.ndarray) and draft_probs.ndim == 2:
        probs = draft_probs.astype(np.float64, copy=False)
        lengths = np.full(probs.shape[0], probs.shape[1], dtype=np.int64)
    else:
        rows = [np.asarray(p, dtype=np.float64).reshape(-1) for p in draft_probs]
        lengths = np.array([r.size for r in rows], dtype=np.int64)
        probs = np.ones((len(rows), int(lengths.max(initial=0))))
        probs[np.arange(probs.shape[1]) < lengths[:, None]] = np.concatenate(rows) if rows else []
    bad = ~np.isfinite(probs) | (probs < 0) | (probs > 1)
    if bad.any():
        raise ValueError(f"draft probabilities of request {int(np.argwhere(bad)[0, 0])} must lie in [0, 1]")
    with np.errstate(divide="ignore"):
        return np.cumsum(np.log(probs), axis=1), lengths  # non-increasing along each row


def select_tokens(draft_probs: Sequence[np.ndarray] | np.ndarray, capacity: int) -> np.ndarray:
    """How many leading draft tokens of each request to verify; ``sum <= capacity``.

    ``draft_probs[i][j]`` is ``q(s_{i,j} | prefix, s_{i,<j})``, the draft model's conditional
    probability of the ``j``-th token it drafted for request ``i`` (a list of 1-D arrays, or one
    ``[num_requests, num_drafted]`` array when every request drafted the same number).

    Worked example: cumulative values are 0.9, 0.45, 0.405 for request 0 and 0.8, 0.72 for
    request 1; the three best are 0.9, 0.8 and 0.72.

    >>> select_tokens([np.array([0.9, 0.5, 0.9]), np.array([0.8, 0.9])], 3).tolist()
    [1, 2]
    """
    if isinstance(capacity, bool) or int(capacity) != capacity or capacity < 0:
        raise ValueError(f"capacity must be an integer >= 0, got {capacity!r}")
    log_cum, lengths = _log_cumulative(draft_probs)
    if lengths.sum() <= capacity:
        return lengths
    valid = np.arange(log_cum.shape[1]) < lengths[:, None]  # [num_requests, max_len]
    row, pos = np.nonzero(valid)  # row-major: ascending request, then position
    values = log_cum[row, pos]
    best = np.lexsort((pos, row, -values))[: int(capacity)]
    return np.bincount(row[best], minlength=lengths.size).astype(np.int64)


def verification_success_rate(num_accepted: int, num_sent: int) -> float:
    """VSR = accepted / sent (TETRIS eq. 1); 0 when nothing was sent."""
    if num_accepted < 0 or num_sent < 0 or num_accepted > num_sent:
        raise ValueError("need 0 <= accepted <= sent")
    return num_accepted / num_sent if num_sent else 0.0
