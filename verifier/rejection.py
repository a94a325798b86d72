"""Lossless speculative verification: chains (batched) and token trees.

Vocabulary (docs/DESIGN.md, *Lossless verification*): ``p_j`` is the target's processed distribution at drafted
position ``j`` and ``q_j`` the draft's, both after the SAME logits processing. For a chain of ``S``
drafted tokens, accept ``s_j`` while ``u_j < p_j(s_j) / q_j(s_j)``; at the first rejection ``m + 1``
the correction is drawn from ``norm(max(0, p_{m+1} - q_{m+1}))``; if all ``S`` are accepted the bonus
is drawn from ``p_{S+1}`` (Leviathan et al.; GoodSpeed section II). The emitted tokens are then
distributed exactly as the target's own samples. Greedy is the same rule with one-hot ``p`` and
``q``: accept while ``s_j = argmax p_j``, correct with ``argmax p_{m+1}``.

Trees use recursive rejection over siblings (SpecInfer's multi-step speculative sampling): at a
node with target distribution ``p``, try its children in order; child ``c`` was proposed from
``q_c`` (a sampled child: the draft distribution; a deterministic child such as a beam-search
candidate: the point mass on its token), is accepted with probability ``min(1, p(c) / q_c(c))``, and
on rejection ``p <- norm(max(0, p - q_c))``. If no child is accepted the correction is drawn from the
final ``p``; at an accepted leaf the bonus is drawn from the leaf's target distribution. Each test is
exact for any candidate drawn independently of the earlier tests, so the walk emits an exact
target sample. A chain is the tree with one child per node.

All randomness is passed in as uniforms in ``[0, 1)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from goodspeed.lm.decoding.sampling import argmax_last, sample_from


@dataclass(frozen=True)
class ChainVerdicts:
    """Per row of a batch: ``num_accepted`` ``m``, the correction-or-bonus token, and
    ``min(1, p/q)`` at every drafted position (eq. 3's terms; 0 past the row's draft)."""

    num_accepted: torch.Tensor  # [B] int64
    next_token: torch.Tensor  # [B] int64
    acceptance_ratios: torch.Tensor  # [B, S_max]


def _residual_or_target(p_at: torch.Tensor, q_at: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """``max(0, p - q)`` (unnormalised; :func:`sample_from` scales by its mass) where rejected,
    else ``p``.

    The empty residual, stated: a rejection of ``s`` means ``p(s) < q(s)``, and since ``p`` and
    ``q`` both sum to 1 some other token has ``p > q``, so in exact arithmetic the residual is never
    empty. In floating point it can be, only when ``p`` and ``q`` agree to rounding everywhere
    but at ``s`` (then the rejection itself had probability ``(q(s) - p(s)) / q(s)``, a rounding
    error). That row then draws from ``p``, the distribution the residual approximates as ``q -> p``;
    the deviation is bounded by that rejection probability. ``test_rejection`` pins this down.
    A ``q`` whose drafted token underflows to 0 never reaches here: drafts are sampled from the
    float32 ``q`` they send (``DraftRunner``), so a drafted token has ``q > 0`` as sent, and a draft
    with ``q(s) = 0`` is refused at submission (``InvalidProbabilityError``)."""
    residual = (p_at - q_at).clamp_min(0.0)
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    return torch.where(rejected.unsqueeze(-1) & ~empty, residual, p_at)


def verify_chains(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_drafted: torch.Tensor,
    accept_uniforms: torch.Tensor,
    sample_uniforms: torch.Tensor,
) -> ChainVerdicts:
    """Verify ``B`` ragged chains at once, with dense draft distributions.

    target_probs    [B, S_max + 1, V]  p_1 .. p_{S+1} per row (rows past ``S_b + 1`` ignored)
    draft_probs     [B, S_max, V]      q_1 .. q_S (``q_j(s_j) > 0`` for drafted positions)
    draft_tokens    [B, S_max]         s_1 .. s_S (padding ignored)
    num_drafted     [B]                S_b
    accept_uniforms [B, S_max]         u_j
    sample_uniforms [B]                one uniform for the correction/bonus draw
    """
    s_max = draft_tokens.shape[1]
    if s_max == 0:
        return verify_chains_q(target_probs, None, None, draft_tokens, num_drafted, accept_uniforms, sample_uniforms)
    tokens = draft_tokens.masked_fill(~_valid(draft_tokens, num_drafted), 0).unsqueeze(-1)
    rows = torch.arange(draft_tokens.shape[0], device=draft_tokens.device)
    return verify_chains_q(target_probs, draft_probs.gather(-1, tokens).squeeze(-1),
                           lambda at: draft_probs[rows, at.clamp(max=s_max - 1)],
                           draft_tokens, num_drafted, accept_uniforms, sample_uniforms)


def _valid(draft_tokens: torch.Tensor, num_drafted: torch.Tensor) -> torch.Tensor:
    return torch.arange(draft_tokens.shape[1], device=draft_tokens.device) < num_drafted.unsqueeze(1)  # [B, S_max]


def verify_chains_q(
    target_probs: torch.Tensor,
    draft_at_tokens: torch.Tensor | None,
    draft_rows,
    draft_tokens: torch.Tensor,
    num_drafted: torch.Tensor,
    accept_uniforms: torch.Tensor,
    sample_uniforms: torch.Tensor,
) -> ChainVerdicts:
    """:func:`verify_chains` without dense ``q``: ``draft_at_tokens [B, S_max]`` holds
    ``q_j(s_j)``, all the accept tests need, and ``draft_rows(at)`` returns ``[B, V]``: row ``b``'s
    ``q`` at position ``at[b]`` (only read where the row rejected there: its correction's residual
    ``max(0, p - q)``). A sparse draft thus never becomes an ``[S, V]`` tensor."""
    batch, s_max = draft_tokens.shape
    rows = torch.arange(batch, device=draft_tokens.device)
    if s_max == 0:
        token = sample_from(target_probs[:, 0], sample_uniforms)
        zeros = torch.zeros(batch, dtype=torch.long, device=draft_tokens.device)
        return ChainVerdicts(zeros, token, target_probs.new_zeros(batch, 0))
    valid = _valid(draft_tokens, num_drafted)
    tokens = draft_tokens.masked_fill(~valid, 0).unsqueeze(-1)
    # The accept test runs in float64 (as the tree walk does): a float32 uniform rounds.
    p_tok = target_probs[:, :s_max].gather(-1, tokens).squeeze(-1).double()
    q_tok = draft_at_tokens.double()
    ratio = torch.where(valid, p_tok / torch.where(valid, q_tok, torch.ones_like(q_tok)), torch.zeros_like(p_tok))
    accepted = (accept_uniforms.double() < ratio) & valid
    num_accepted = torch.cumprod(accepted.long(), dim=1).sum(dim=1)  # leading accepts
    rejected = num_accepted < num_drafted
    p_at = target_probs[rows, num_accepted]  # [B, V]
    q_at = draft_rows(num_accepted)
    dist = _residual_or_target(p_at, q_at.to(p_at.dtype), rejected)
    return ChainVerdicts(num_accepted, sample_from(dist, sample_uniforms), ratio.clamp(max=1.0))


@dataclass(frozen=True)
class GreedyVerdict:
    """One greedy chain's outcome: ``num_accepted`` ``m``, the correction-or-bonus token
    ``argmax p_{m+1}``, and ``min(1, p/q)`` at every drafted position (1 where the drafted token is
    the argmax, else 0)."""

    num_accepted: int
    next_token: int
    ratios: list[float]


def verify_greedy_chains(target_logits: torch.Tensor, draft_tokens: Sequence[Sequence[int]]) -> list[GreedyVerdict]:
    """Greedy rows without probabilities: accept while ``s_j = argmax p_j``, then ``argmax p_{m+1}``.

    Identical to :func:`verify_chains` on one-hot ``p`` and ``q`` (``process_logits`` at
    temperature 0 is the one-hot of this same argmax, lowest id on ties), without building either.
    One argmax over the batch and one copy of its ``[B, S_max + 1]`` ids to the host; the rest is
    a few Python comparisons per row (on CPU each tensor op on these tiny shapes cost more than
    the whole comparison; on a GPU each would be a kernel launch).

    target_logits [B, >= S_b + 1, V]; ``draft_tokens[b]``: row b's ``S_b`` drafted tokens.
    """
    best = argmax_last(target_logits).tolist()
    out = []
    for drafted, top in zip(draft_tokens, best):
        ratios = [1.0 if token == top[j] else 0.0 for j, token in enumerate(drafted)]
        m = next((j for j, hit in enumerate(ratios) if not hit), len(ratios))
        out.append(GreedyVerdict(m, top[m], ratios))
    return out


def verify_greedy_trees(target_logits: torch.Tensor, draft_tokens: Sequence[Sequence[int]],
                        draft_parents: Sequence[Sequence[int]]) -> list[TreeVerdict]:
    """Greedy trees without probabilities: from the root, follow the first child (in node order)
    whose token is the argmax of its parent's ``p``; stop where none is, and emit that argmax.

    Identical to :func:`verify_tree` on one-hot ``p`` (``process_logits`` at temperature 0, lowest
    id on ties), for deterministic candidates and sampled ones alike: a child other than the argmax
    has ratio ``0 / q = 0``, the argmax child ``min(1, 1 / q) = 1``, and a rejection leaves the
    one-hot ``p`` as it was, so no uniform can change the walk. One argmax over the batch, as
    :func:`verify_greedy_chains`; ratios are those :func:`verify_tree` records (0 for each child
    tested before the match, 1 for the match).

    target_logits [B, >= N_b + 1, V]; row b: ``N_b`` node tokens and their parents (-1: the root).
    """
    best = argmax_last(target_logits).tolist()
    out = []
    for tokens, parents, top in zip(draft_tokens, draft_parents, best):
        children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
        for node, parent in enumerate(parents):
            children[parent + 1].append(node)
        node, accepted, ratios = -1, [], []
        while True:
            want = top[node + 1]
            match = None
            for child in children[node + 1]:
                hit = int(tokens[child]) == want
                ratios.append(1.0 if hit else 0.0)
                if hit:
                    match = child
                    break
            if match is None:
                out.append(TreeVerdict(accepted, want, ratios))
                break
            accepted.append(match)
            node = match
    return out


@dataclass(frozen=True)
class TreeVerdict:
    """The accepted path (node indices from the root down), the correction-or-bonus token, and
    ``min(1, p/q)`` of every candidate tested on the way."""

    accepted_nodes: list[int]
    next_token: int
    tested_ratios: list[float]


def verify_tree(
    target_probs: torch.Tensor,
    tokens: torch.Tensor,
    parents: list[int],
    uniforms: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> TreeVerdict:
    """Verify one token tree.

    target_probs [N + 1, V]  row 0: p after the root (the pending token); row k + 1: p after node k
    tokens       [N]         token of each drafted node
    parents      N ints      parent node index, -1 for the root; parents come before children
    uniforms     [N + 1]     consumed in order: one per tested candidate, one for the final draw
    draft_probs  [N, V]      the distribution each node was sampled from, or None: every node is
                             a deterministic candidate (point mass on its token)
    """
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for node, parent in enumerate(parents):
        children[parent + 1].append(node)
    node, p = -1, target_probs[0]
    accepted, ratios, draw = [], [], 0
    while True:
        moved = False
        for child in children[node + 1]:
            tok = int(tokens[child])
            q = draft_probs[child] if draft_probs is not None else None
            q_tok = float(q[tok]) if q is not None else 1.0
            ratio = min(1.0, float(p[tok]) / q_tok)
            ratios.append(ratio)
            u = float(uniforms[draw])
            draw += 1
            if u < ratio:
                accepted.append(child)
                node, p, moved = child, target_probs[child + 1], True
                break
            q_dense = q if q is not None else torch.zeros_like(p).index_fill_(0, torch.tensor([tok]), 1.0)
            p = _residual_or_target(p, q_dense.to(p.dtype), torch.tensor(True))
            p = p / p.sum()
        if not moved:
            token = int(sample_from(p, uniforms[draw : draw + 1].to(p.dtype)).item())
            return TreeVerdict(accepted, token, ratios)
