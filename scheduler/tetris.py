"""TETRIS: pick the draft tokens of a batch most likely to be accepted, under a capacity.

Implements TETRIS (Wu et al., "TETRIS: optimal draft token selection for batch speculative
decoding", ACL 2025, arXiv 2502.15197; Section 4.1, Algorithm 1). Each request drafts
``k + extra`` tokens; the token at position ``j`` of request ``i`` is worth its cumulative draft
probability ``prod_{t<=j} q_{i,t}(s_{i,t})``, a surrogate of the probability that the whole prefix
up to ``j`` is accepted. Algorithm 1 pops the best frontier token of a heap ``C`` times. Because a
cumulative product of probabilities never grows along a row, "the ``C`` best tokens overall" is
already prefix-closed per row, so the same selection is computed here with one sort over the
batch (ties: lower request index, then earlier position — the heap's order). VSR, the paper's
metric (eq. 1), is ``accepted / sent``.

Sampled drafts (temperature > 0) need one change to stay lossless. The rejection test
``u < p(s_j) / q_j(s_j)`` is exact only if ``s_j ~ q_j`` given everything that decided to verify
it; ranking position ``j`` by ``q_j(s_j)`` — its own sampled value — conditions the sample
(docs/DESIGN.md, *Lossless verification*), and the output drifts off the target's distribution. So for sampled
drafts :func:`presample_scores` ranks position ``j`` by what was known before ``s_j`` was drawn:

    score_j = min_{i <= j} ( prod_{t < i} q_t(s_t) ) * E_{s ~ q_i}[q_i(s)],   E_{s ~ q}[q(s)] = sum_v q(v)^2

The expectation replaces the one unknown factor of TETRIS's surrogate by its mean, and the
running minimum keeps the scores non-increasing along a row, so the selection stays
prefix-closed and a later position can never decide an earlier one. Whether position ``j`` is
verified then depends only on ``s_<j`` and on other requests' independent drafts: the number of
verified tokens is a stopping time, and speculative sampling with a stopping-time length is
exact. For greedy drafts nothing is sampled (``E[q(s)]`` is the argmax's own confidence), so the
scores equal TETRIS's cumulative probabilities.
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
    log_cum, lengths = _log_cumulative(draft_probs)
    return _select_prefixes(log_cum, lengths, capacity)


def presample_scores(token_probs: Sequence[np.ndarray], expected_probs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Per request, ``log score_j`` of the module docstring: ranks sampled positions without
    looking at their own sampled values.

    ``token_probs[i][j] = q_{i,j}(s_{i,j})`` and ``expected_probs[i][j] = sum_v q_{i,j}(v)^2``.
    Worked example: ``q_1(s_1) = 0.5``, ``E[q_1] = 0.6``, ``E[q_2] = 0.9``: scores 0.6 and
    ``min(0.6, 0.5 * 0.9) = 0.45``.

    >>> [round(float(v), 6) for v in np.exp(presample_scores([np.array([0.5, 0.2])], [np.array([0.6, 0.9])])[0])]
    [0.6, 0.45]
    """
    if len(token_probs) != len(expected_probs):
        raise ValueError(f"{len(token_probs)} token-probability rows for {len(expected_probs)} expectation rows")
    out = []
    for i, (drawn, expected) in enumerate(zip(token_probs, expected_probs)):
        drawn, expected = (np.asarray(a, dtype=np.float64).reshape(-1) for a in (drawn, expected))
        if drawn.shape != expected.shape:
            raise ValueError(f"request {i}: {drawn.size} token probabilities for {expected.size} expectations")
        if not drawn.size:
            out.append(np.zeros(0))
            continue
        log_drawn, _ = _log_cumulative([drawn])  # [1, n] cumulative logs; validates the range
        _log_cumulative([expected])  # validates the range
        with np.errstate(divide="ignore"):
            log_expected = np.log(expected)
        log_before = np.concatenate([[0.0], log_drawn[0, :-1]])  # prod_{t<j} q_t(s_t)
        out.append(np.minimum.accumulate(log_before + log_expected))
    return out


def select_by_scores(log_scores: Sequence[np.ndarray], capacity: int) -> np.ndarray:
    """TETRIS's selection on given per-position ``log`` scores, non-increasing along each request
    (e.g. :func:`presample_scores`): how many leading tokens of each request to verify."""
    rows = [np.asarray(r, dtype=np.float64).reshape(-1) for r in log_scores]
    lengths = np.array([r.size for r in rows], dtype=np.int64)
    padded = np.full((len(rows), int(lengths.max(initial=0))), -np.inf)
    for i, r in enumerate(rows):
        if np.any(np.isnan(r)) or np.any(np.diff(r) > 0):
            raise ValueError(f"scores of request {i} must be non-increasing and not NaN")
        padded[i, : r.size] = r
    return _select_prefixes(padded, lengths, capacity)


def _select_prefixes(log_scores: np.ndarray, lengths: np.ndarray, capacity: int) -> np.ndarray:
    """The ``capacity`` best (request, position) pairs of ``log_scores [num_requests, max_len]``,
    prefix-closed because scores never grow along a row; counts per request."""
    if isinstance(capacity, bool) or int(capacity) != capacity or capacity < 0:
        raise ValueError(f"capacity must be an integer >= 0, got {capacity!r}")
    if lengths.sum() <= capacity:
        return lengths
    valid = np.arange(log_scores.shape[1]) < lengths[:, None]  # [num_requests, max_len]
    row, pos = np.nonzero(valid)  # row-major: ascending request, then position
    values = log_scores[row, pos]
    best = np.lexsort((pos, row, -values))[: int(capacity)]
    return np.bincount(row[best], minlength=lengths.size).astype(np.int64)


def verification_success_rate(num_accepted: int, num_sent: int) -> float:
    """VSR = accepted / sent (TETRIS eq. 1); 0 when nothing was sent."""
    if num_accepted < 0 or num_sent < 0 or num_accepted > num_sent:
        raise ValueError("need 0 <= accepted <= sent")
    return num_accepted / num_sent if num_sent else 0.0
