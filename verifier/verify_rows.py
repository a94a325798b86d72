"""Turn one round's target logits into per-drafter outcomes: which KV entries to keep, which
tokens to emit, and eq. (3)'s ``min(1, p/q)`` terms.

Rows are grouped so the common cases cost a few batched tensor operations per round:

* greedy chains: argmax comparison on the raw logits (:func:`verify_greedy_chains`);
* sampled chains: logits processing and the batched rejection sampler (:func:`verify_chains_q`),
  with one draw of uniforms for the whole group and the draft's ``q`` kept sparse (:class:`DraftQ`);
* greedy trees: one argmax, then a walk down the children on the host (:func:`verify_greedy_trees`);
* sampled trees: logits processing for every row in one pass and one copy to the host, then the
  recursive multi-candidate walk (:func:`verify_tree`) one row at a time.

Rows whose requests bias or penalise logits have them adjusted first, on a copy
(:func:`~goodspeed.lm.decoding.adjust.adjust_logits`): each position by the text before it, the row's
drafted tokens included, so every group above verifies against the distribution plain decoding
with those settings samples from (the greedy groups take the adjusted argmax).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from goodspeed.lm.decoding.adjust import adjust_logits
from goodspeed.lm.decoding.history import TokenHistory
from goodspeed.lm.decoding.sampling import process_logits
from goodspeed.lm.decoding.params import SamplingParams, TokenLogprob
from goodspeed.verifier.drafts import DraftQ, dense_q, q_rows_at
from goodspeed.verifier.rejection import verify_chains_q, verify_greedy_chains, verify_greedy_trees, verify_tree
from goodspeed.verifier.types import Draft


@dataclass(frozen=True)
class RowInput:
    key: str  # session id: selects caller-given uniforms
    tokens: list[int]  # the pending token, then the drafted tokens
    draft: Draft
    sampling: SamplingParams
    history: TokenHistory | None = None  # the request's text, pending token included, for its penalties


def draft_paths(tokens: Sequence[int], parents: Sequence[int] | None) -> list[list[int]]:
    """For each position of a row (its pending token, then each drafted token), the drafted tokens
    the text holds before the token that position predicts: a chain's first ``j``, a tree node's
    ancestors and the node itself, root first. ``tokens`` are the drafted tokens; ``parents`` the
    tree's (``-1``: the root) or None for a chain."""
    if parents is None:
        return [list(tokens[:j]) for j in range(len(tokens) + 1)]
    paths: list[list[int]] = [[]]
    for node, parent in enumerate(parents):
        paths.append(paths[parent + 1] + [int(tokens[node])])
    return paths


@dataclass(frozen=True)
class RowOutcome:
    kept: list[int]  # offsets (from the row's first new position) of KV entries to keep
    emitted: list[int]  # accepted drafted tokens, then the correction or bonus token
    ratios: list[float]  # min(1, p/q) of every tested drafted token


class RowVerifier:
    def __init__(self, vocab_size: int, device: torch.device, work_dtype: torch.dtype, generator: torch.Generator) -> None:
        self.vocab_size, self.device, self.work_dtype, self.generator = vocab_size, device, work_dtype, generator

    def verify(self, rows: Sequence[RowInput], logits: torch.Tensor, given: dict[str, np.ndarray]) -> list[RowOutcome]:
        """``logits [len(rows), q_len, V]`` in row order; ``given[key]``: uniforms for that row.
        ``logits`` are not changed."""
        adjusted = [i for i, r in enumerate(rows) if r.sampling.adjusts_logits]
        if adjusted:
            logits = adjust_logits(logits.to(self.work_dtype, copy=True), adjusted, [rows[i].sampling for i in adjusted],
                                   [rows[i].history for i in adjusted],
                                   [draft_paths(rows[i].tokens[1:], rows[i].draft.parents) for i in adjusted])
        out: list[RowOutcome | None] = [None] * len(rows)
        greedy = [i for i, r in enumerate(rows) if r.draft.parents is None and r.sampling.greedy]
        sampled = [i for i, r in enumerate(rows) if r.draft.parents is None and not r.sampling.greedy]
        greedy_trees = [i for i, r in enumerate(rows) if r.draft.parents is not None and r.sampling.greedy]
        sampled_trees = [i for i, r in enumerate(rows) if r.draft.parents is not None and not r.sampling.greedy]
        # Sampled trees last: their uniforms come from the shared generator after the sampled chains'.
        for group, fn in ((greedy, self._greedy), (sampled, self._sampled), (greedy_trees, self._greedy_trees),
                          (sampled_trees, self._sampled_trees)):
            if group:
                # Every row in one group (the common case): the logits as they are, not a gathered copy.
                group_logits = logits if len(group) == len(rows) else logits[group]
                for i, res in zip(group, fn([rows[i] for i in group], group_logits, given)):
                    out[i] = res
        return out

    def _drafted(self, rows: Sequence[RowInput]) -> tuple[torch.Tensor, torch.Tensor, int]:
        s_max = max(r.draft.num_tokens for r in rows)
        padded = [r.tokens[1:] + [0] * (s_max - r.draft.num_tokens) for r in rows]
        drafted = torch.tensor(padded, dtype=torch.long).view(len(rows), s_max)
        num = torch.tensor([r.draft.num_tokens for r in rows])
        return drafted.to(self.device), num.to(self.device), s_max

    @staticmethod
    def _outcomes(rows, accepted: list[int], next_tokens: list[int], ratios: list[list[float]]) -> list[RowOutcome]:
        return [
            RowOutcome(list(range(m + 1)), row.tokens[1 : m + 1] + [nxt], r[: row.draft.num_tokens])
            for row, m, nxt, r in zip(rows, accepted, next_tokens, ratios)
        ]

    def _greedy(self, rows, logits: torch.Tensor, given) -> list[RowOutcome]:
        s_max = max(r.draft.num_tokens for r in rows)
        verdicts = verify_greedy_chains(logits[:, : s_max + 1], [r.tokens[1:] for r in rows])
        return [RowOutcome(list(range(v.num_accepted + 1)), row.tokens[1 : v.num_accepted + 1] + [v.next_token], v.ratios)
                for row, v in zip(rows, verdicts)]

    def _greedy_trees(self, rows, logits: torch.Tensor, given) -> list[RowOutcome]:
        n_max = max(r.draft.num_tokens for r in rows)
        verdicts = verify_greedy_trees(logits[:, : n_max + 1], [r.tokens[1:] for r in rows], [r.draft.parents for r in rows])
        outcomes = []
        for row, v in zip(rows, verdicts):
            kept = [0] + [node + 1 for node in v.accepted_nodes]
            outcomes.append(RowOutcome(kept, [row.tokens[k] for k in kept[1:]] + [v.next_token], v.tested_ratios))
        return outcomes

    def _sampled(self, rows, logits: torch.Tensor, given) -> list[RowOutcome]:
        drafted, num, s_max = self._drafted(rows)
        p = process_logits(logits[:, : s_max + 1].to(self.work_dtype), [r.sampling for r in rows])
        qs = [DraftQ(row.draft, self.work_dtype) for row in rows]  # sparse q stays sparse
        q_tok = torch.ones(len(rows), s_max, dtype=torch.float64)
        u = torch.rand(len(rows), s_max + 1, generator=self.generator, dtype=torch.float64)
        for b, row in enumerate(rows):
            n = row.draft.num_tokens
            if n:
                q_tok[b, :n] = torch.tensor(qs[b].at_tokens(), dtype=torch.float64)
            if row.key in given:
                u[b, : n + 1] = torch.as_tensor(np.asarray(given[row.key], dtype=np.float64)[: n + 1])
            u[b, s_max] = u[b, n]  # the correction/bonus uniform sits right after the row's drafts

        def q_rows(at: torch.Tensor) -> torch.Tensor:  # [B, V]: q where a row rejected, else unread zeros
            return q_rows_at(qs, at.tolist(), self.vocab_size, self.work_dtype, self.device)

        res = verify_chains_q(p, q_tok.to(self.device), q_rows, drafted, num, u[:, :s_max].to(self.device), u[:, s_max].to(self.device))
        return self._outcomes(rows, res.num_accepted.tolist(), res.next_token.tolist(), res.acceptance_ratios.tolist())

    def _sampled_trees(self, rows, logits: torch.Tensor, given) -> list[RowOutcome]:
        """Every row's processed distributions in one pass where the logits are, copied to the host
        at once (row by row, a GPU paid a dozen ops and a sync a row), then each row's walk."""
        n_max = max(r.draft.num_tokens for r in rows)
        p = process_logits(logits[:, : n_max + 1].to(self.work_dtype), [r.sampling for r in rows]).cpu()
        return [self._tree(row, p[b, : row.draft.num_tokens + 1], given) for b, row in enumerate(rows)]

    def _tree(self, row: RowInput, p: torch.Tensor, given) -> RowOutcome:
        """One sampled tree's walk over ``p`` ``[N + 1, V]``, its processed target distributions."""
        n = row.draft.num_tokens
        if row.key in given:
            u = torch.as_tensor(np.asarray(given[row.key], dtype=np.float64)[: n + 1])
        else:
            u = torch.rand(n + 1, generator=self.generator, dtype=torch.float64)
        q = dense_q(row.draft, self.vocab_size, self.work_dtype)
        res = verify_tree(p, torch.tensor(row.tokens[1:]), list(row.draft.parents), u, q)
        kept = [0] + [node + 1 for node in res.accepted_nodes]
        return RowOutcome(kept, [row.tokens[k] for k in kept[1:]] + [res.next_token], res.tested_ratios)


def committed_logprobs(logits: torch.Tensor, wanted: Sequence[tuple[int, Sequence[int], Sequence[int], int]],
                       ranks: bool = False) -> list[list[TokenLogprob]]:
    """The target's log-probabilities of committed tokens, read off a step's logits: ``wanted[i] =
    (row, positions, tokens, top)`` asks, for each ``tokens[j]``, its log-probability under the
    distribution at ``logits[row, positions[j]]`` (the position whose next token it is) and the
    ``top`` most probable tokens there, and with ``ranks`` its rank (vLLM's: how many tokens are
    at least as probable, itself included; else None). Raw logits (no temperature, top-k or top-p:
    vLLM's default ``raw_logprobs``), log-softmax in float32: one log-softmax and one top-k over the
    vocabulary for every asked position of the step at once (and one comparison for the ranks,
    which on a CPU adds 44-83% to the call: only prompt scores ask for them), their
    results brought to the host as lists. Reads the logits only: verification is untouched."""
    flat = [(row, pos) for row, positions, _, _ in wanted for pos in positions]
    if not flat:
        return [[] for _ in wanted]
    device = logits.device
    rows = torch.tensor([r for r, _ in flat], device=device)
    positions = torch.tensor([p for _, p in flat], device=device)
    logprobs = torch.log_softmax(logits[rows, positions].float(), dim=-1)
    tokens = torch.tensor([t for _, _, toks, _ in wanted for t in toks], device=device)
    chosen = logprobs.gather(1, tokens.unsqueeze(1))
    ranked = (logprobs >= chosen).sum(dim=-1).tolist() if ranks else [None] * len(flat)
    chosen = chosen.squeeze(1).tolist()
    top = max(k for *_, k in wanted)
    top_values, top_ids = (logprobs.topk(top, dim=-1) if top else (None, None))
    top_values = top_values.tolist() if top else None
    top_ids = top_ids.tolist() if top else None
    out, i = [], 0
    for _, positions, toks, k in wanted:
        out.append([TokenLogprob(int(t), chosen[i + j], tuple(zip(top_ids[i + j][:k], top_values[i + j][:k])) if k else (),
                                 ranked[i + j]) for j, t in enumerate(toks)])
        i += len(positions)
    return out
