"""Validating submitted drafts and turning their draft distributions into dense ``q`` rows.

Every check raises its own :mod:`goodspeed.verifier.errors` class, before anything touches the
model or another session. A draft's ``q`` arrives dense ``[S, V]``, sparse (the exact support of a
truncated distribution) or not at all (greedy sessions and deterministic tree candidates: the
point mass on the drafted token). Rows must sum to 1 within ``PROB_SUM_TOLERANCE`` and are
renormalised exactly afterwards, since ``max(0, p - q)`` needs a true distribution.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from goodspeed.proto import MAX_DECODE_AHEAD, MAX_UNTIL_MATCH
from goodspeed.verifier.errors import (
    DraftTooLongError,
    InvalidProbabilityError,
    InvalidTokenError,
    MalformedDraftError,
)
from goodspeed.verifier.types import Draft

PROB_SUM_TOLERANCE = 1e-3


def validate_draft(draft: Draft, vocab_size: int, allotted: int, needs_probs: bool) -> None:
    """Check a draft's shape, token ids, tree structure and probabilities."""
    n = draft.num_tokens
    if not 0 <= draft.decode_ahead <= MAX_DECODE_AHEAD:
        raise MalformedDraftError(f"decode_ahead must lie in 0..{MAX_DECODE_AHEAD}, got {draft.decode_ahead}")
    if draft.decode_ahead and n:
        raise MalformedDraftError("decode_ahead goes with an empty draft only (the verifier decodes those rounds itself)")
    if not 0 <= draft.decode_ahead_until_match <= MAX_UNTIL_MATCH:
        raise MalformedDraftError(f"decode_ahead_until_match must lie in 0..{MAX_UNTIL_MATCH}, "
                                  f"got {draft.decode_ahead_until_match}")
    if draft.decode_ahead_until_match and not draft.decode_ahead:
        raise MalformedDraftError("decode_ahead_until_match goes with decode_ahead only")
    if n > allotted:
        raise DraftTooLongError(f"drafted {n} tokens but the allocation for this round is {allotted}")
    ids = np.asarray(draft.token_ids, dtype=np.int64) if n else np.zeros(0, dtype=np.int64)
    if ids.ndim != 1 or np.any(ids < 0) or np.any(ids >= vocab_size):
        raise InvalidTokenError(f"token ids must lie in [0, {vocab_size})")
    if draft.parents is not None:
        _validate_parents(list(draft.parents), n)
    if draft.dense_probs is not None and draft.sparse_probs is not None:
        raise MalformedDraftError("send dense_probs or sparse_probs, not both")
    if draft.dense_probs is not None:
        _validate_dense(np.asarray(draft.dense_probs), ids, vocab_size)
    elif draft.sparse_probs is not None:
        _validate_sparse(draft, ids, vocab_size)
    elif needs_probs and n and draft.parents is None:
        raise MalformedDraftError("a sampled (temperature > 0) chain needs its draft distributions")


def _validate_parents(parents: list[int], n: int) -> None:
    if len(parents) != n:
        raise MalformedDraftError(f"{len(parents)} parents for {n} tree nodes")
    for k, parent in enumerate(parents):
        if not -1 <= parent < k:
            raise MalformedDraftError(f"node {k}'s parent {parent} must be -1 or an earlier node")


def _check_row(row: np.ndarray, drafted_prob: float, where: str) -> None:
    if not np.all(np.isfinite(row)) or np.any(row < 0) or np.any(row > 1):
        raise InvalidProbabilityError(f"{where}: probabilities must be finite and in [0, 1]")
    if not drafted_prob > 0:
        raise InvalidProbabilityError(f"{where}: the drafted token has probability {drafted_prob} <= 0")
    if abs(float(row.sum()) - 1.0) > PROB_SUM_TOLERANCE:
        raise InvalidProbabilityError(f"{where}: probabilities sum to {float(row.sum()):.6f}, not 1")


def _validate_dense(dense: np.ndarray, ids: np.ndarray, vocab_size: int) -> None:
    if dense.shape != (ids.size, vocab_size):
        raise MalformedDraftError(f"dense_probs must be [{ids.size}, {vocab_size}], got {list(dense.shape)}")
    for j, tok in enumerate(ids):
        _check_row(dense[j], float(dense[j, tok]), f"position {j}")


def _validate_sparse(draft: Draft, ids: np.ndarray, vocab_size: int) -> None:
    if len(draft.sparse_probs) != ids.size:
        raise MalformedDraftError(f"{len(draft.sparse_probs)} sparse distributions for {ids.size} tokens")
    for j, (tok, sp) in enumerate(zip(ids, draft.sparse_probs)):
        support = np.asarray(sp.token_ids, dtype=np.int64)
        probs = np.asarray(sp.probs, dtype=np.float64)
        if support.ndim != 1 or support.shape != probs.shape or support.size == 0:
            raise MalformedDraftError(f"position {j}: sparse ids and probs must be equal-length, non-empty lists")
        if np.any(support < 0) or np.any(support >= vocab_size):
            raise InvalidTokenError(f"position {j}: support ids must lie in [0, {vocab_size})")
        if np.unique(support).size != support.size:
            raise MalformedDraftError(f"position {j}: repeated support ids")
        if not np.all(np.isfinite(probs)) or np.any(probs <= 0):
            raise InvalidProbabilityError(f"position {j}: sparse probabilities must be finite and > 0")
        hit = probs[support == tok]
        _check_row(probs, float(hit[0]) if hit.size else math.nan, f"position {j}")


def draft_depth(draft: Draft) -> int:
    """Longest root-to-node path: the most drafted tokens one round can accept (a chain: its length)."""
    if draft.parents is None:
        return draft.num_tokens
    depth: list[int] = []
    for parent in draft.parents:
        depth.append(1 if parent < 0 else depth[parent] + 1)
    return max(depth, default=0)


def dense_q(draft: Draft, vocab_size: int, dtype: torch.dtype) -> torch.Tensor | None:
    """``[S, V]`` draft distributions, renormalised; ``None`` for point masses (no ``q`` sent)."""
    n = draft.num_tokens
    if draft.dense_probs is not None:
        q = torch.as_tensor(np.asarray(draft.dense_probs), dtype=dtype)
    elif draft.sparse_probs is not None:
        q = torch.zeros(n, vocab_size, dtype=dtype)
        for j, sp in enumerate(draft.sparse_probs):
            q[j, torch.as_tensor(np.asarray(sp.token_ids, dtype=np.int64))] = torch.as_tensor(np.asarray(sp.probs), dtype=dtype)
    else:
        return None
    return q / q.sum(dim=-1, keepdim=True)


class DraftQ:
    """A validated chain draft's ``q``, renormalised per position like :func:`dense_q`, without
    densifying a sparse one: ``at_tokens()`` gives ``q_j(s_j)`` (all the accept tests need) and
    ``entries(j)`` the support of ``q_j``, from which :func:`q_rows_at` builds a dense ``q_j`` only
    for a position where a correction needs it. Host memory per round is then independent of
    ``V`` for sparse drafts (at most one ``[V]`` row per rejecting drafter, built on the
    verifier's device)."""

    def __init__(self, draft: Draft, dtype: torch.dtype) -> None:
        self.draft, self.dtype = draft, dtype
        self._dense = None
        if draft.dense_probs is not None:
            q = torch.as_tensor(np.asarray(draft.dense_probs), dtype=dtype)
            self._dense = q / q.sum(dim=-1, keepdim=True)

    def _sparse(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        sp = self.draft.sparse_probs[j]
        probs = torch.as_tensor(np.asarray(sp.probs), dtype=self.dtype)
        return torch.as_tensor(np.asarray(sp.token_ids, dtype=np.int64)), probs / probs.sum()

    def at_tokens(self) -> list[float]:
        tokens = [int(t) for t in self.draft.token_ids]
        if self._dense is not None:
            return self._dense[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)].tolist()
        if self.draft.sparse_probs is None:
            return [1.0] * len(tokens)  # point masses
        out = []
        for j, tok in enumerate(tokens):
            ids, probs = self._sparse(j)
            out.append(float(probs[ids == tok][0]))
        return out

    def entries(self, j: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``q_j``'s support on the host: its token ids and their probabilities, or ``(None, the
        dense row [V])`` for a dense draft (a point mass is one id with probability 1)."""
        if self._dense is not None:
            return None, self._dense[j]
        if self.draft.sparse_probs is None:
            return torch.tensor([int(self.draft.token_ids[j])]), torch.ones(1, dtype=self.dtype)
        return self._sparse(j)


def q_rows_at(qs: Sequence[DraftQ], at: Sequence[int], vocab_size: int, dtype: torch.dtype,
              device: torch.device | str) -> torch.Tensor:
    """``[len(qs), V]`` on ``device``: row ``b`` is ``qs[b]``'s dense ``q`` at position ``at[b]``
    where the draft has one (``at[b] < S_b``), zeros elsewhere. Every row's support is scattered in
    one op from one copy of the ids and one of the probabilities (a dense row in one more), however
    many rows there are: row by row, a GPU paid a few ops and copies a row."""
    out = torch.zeros(len(qs), vocab_size, dtype=dtype, device=device)
    dense_rows, dense, sparse_rows, sparse_ids, sparse_probs = [], [], [], [], []
    for b, (q, j) in enumerate(zip(qs, at)):
        if j >= q.draft.num_tokens:
            continue
        ids, probs = q.entries(j)
        if ids is None:
            dense_rows.append(b)
            dense.append(probs)
        else:
            sparse_rows.append(torch.full((len(ids),), b, dtype=torch.long))
            sparse_ids.append(ids)
            sparse_probs.append(probs)
    if dense:
        out[torch.tensor(dense_rows, device=device)] = torch.stack(dense).to(device=device, dtype=dtype)
    if sparse_ids:
        index = torch.stack([torch.cat(sparse_rows), torch.cat(sparse_ids)]).to(device)
        out[index[0], index[1]] = torch.cat(sparse_probs).to(device=device, dtype=dtype)
    return out
