"""Logit adjustments a request asks for, applied before :func:`~goodspeed.lm.decoding.sampling.process_logits`
(as vLLM's sampler does): ``logit_bias``, the repetition penalty, the frequency and presence
penalties, ``min_tokens``, ``allowed_token_ids``, ``bad_words`` and a structured output's grammar
(the order and each rule: :mod:`goodspeed.lm.decoding.sampling`'s docstring).

The penalties, ``min_tokens``, ``bad_words`` and the grammar read the text before each position,
so a speculative row's positions each see the history plus the drafted tokens before them
(:class:`TokenHistory` and the ``paths`` of :func:`adjust_logits`): the target's adjusted
distribution at each position is the one plain decoding would sample from there, and verification
stays exact against it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.lm.decoding.history import TokenHistory, sorted_unique


def adjust_logits(logits: torch.Tensor, rows: Sequence[int], params: Sequence[SamplingParams],
                  histories: Sequence[TokenHistory | None], paths: Sequence[Sequence[Sequence[int]]]) -> torch.Tensor:
    """Apply each listed row's logit bias and penalties to ``logits [R, Q, V]`` IN PLACE (pass a
    copy to keep the raw ones) and return it.

    ``rows[i]`` is a row of ``logits`` with settings ``params[i]`` and text ``histories[i]`` (None
    is an empty one: a request that only biases); ``paths[i][j]`` lists the tokens that follow the
    history before position ``j`` of that row (a chain's drafted tokens before ``j``, a tree
    node's ancestors and itself). Positions ``j >= len(paths[i])`` are left as they are. In vLLM's
    order: bias, then repetition over the prompt and the output, then frequency and presence over
    the output; then ``min_tokens``: a position whose text holds fewer than ``min_tokens`` output
    tokens (the history's plus its path's) gets -inf for each of ``eos_token_ids``; then
    ``bad_words``: a sequence's last token gets -inf where the position's output ends with its
    other tokens (a one-token sequence everywhere); then ``allowed_token_ids``: every other token
    gets -inf; last, a structured output's grammar (the history's ``constraint``): every token it
    does not allow after the position's text gets -inf (-inf commutes with the steps before, so
    the order is vLLM's result). The work touches only the tokens some setting names (the bias's,
    the prompt's and the output's, the drafted ones, the ending ones, the banned ones): it gathers
    those logits, adjusts them in the logits' dtype (callers pass float32 or wider), and scatters
    them back, so its cost does not grow with the vocabulary; ``allowed_token_ids`` and a grammar
    alone fill their row's positions over the vocabulary. Allowed and banned ids at or past
    ``logits``' vocabulary are left out (a draft with a smaller vocabulary cannot draft them); a
    row none of whose allowed ids fits is left unmasked, which only a draft's can be (the target's
    check refuses such ids).
    """
    chosen = [i for i, p in enumerate(params) if p.adjusts_logits and len(paths[i])]
    if not chosen:
        return logits
    _penalize(logits, rows, params, histories, paths, [i for i in chosen if params[i].penalized or params[i].logit_bias])
    _hold_back_endings(logits, rows, params, histories, paths, [i for i in chosen if params[i].min_tokens])
    _ban_words(logits, rows, params, histories, paths, [i for i in chosen if params[i].bad_words])
    _allow_only(logits, rows, params, paths, [i for i in chosen if params[i].allowed_token_ids])
    _constrain(logits, rows, histories, paths, [i for i in chosen if histories[i] is not None and histories[i].constraint])
    return logits


def _constrain(logits: torch.Tensor, rows, histories, paths, chosen: list[int]) -> None:
    """Structured output (:mod:`goodspeed.lm.decoding.structured`): -inf for every token the grammar does
    not allow after the row's text and each position's path. A position the grammar cannot reach
    (its path leaves the grammar) is left as it is, and so is one that allows no token of
    ``logits``' vocabulary (a draft's smaller one: only a draft's can be)."""
    for i in chosen:  # an unreachable position's bits are all set
        mask_logits(logits[rows[i], : len(paths[i])], histories[i].constraint.masks(paths[i])[0])


def _ban_words(logits: torch.Tensor, rows, params, histories, paths, chosen: list[int]) -> None:
    """vLLM's ``bad_words`` (:func:`adjust_logits`): -inf for a sequence's last token at each
    position whose output (the history's plus its path) ends with the sequence's other tokens; a
    one-token sequence everywhere."""
    at_row, at_position, at_token = [], [], []
    for i in chosen:
        output = histories[i].output if histories[i] is not None else []
        for j, path in enumerate(paths[i]):
            for word in params[i].bad_words:
                head = len(word) - 1
                if head:
                    if head > len(output) + len(path):
                        continue
                    tail = list(path[-head:]) if head <= len(path) else output[len(output) - head + len(path):] + list(path)
                    if tail != list(word[:-1]):
                        continue
                at_row.append(rows[i])
                at_position.append(j)
                at_token.append(word[-1])
    if at_row:
        index = torch.tensor([at_row, at_position, at_token], dtype=torch.int64).to(logits.device)
        keep = index[2] < logits.shape[-1]  # ids past a draft's smaller vocabulary: it cannot draft them
        logits[index[0][keep], index[1][keep], index[2][keep]] = float("-inf")


def _allow_only(logits: torch.Tensor, rows, params, paths, chosen: list[int]) -> None:
    """``allowed_token_ids`` (:func:`adjust_logits`): -inf for every other token at the row's
    positions."""
    vocab = logits.shape[-1]
    for i in chosen:
        allowed = [t for t in params[i].allowed_token_ids if t < vocab]
        if not allowed:
            continue
        at = torch.tensor(allowed, dtype=torch.int64, device=logits.device)
        row = logits[rows[i], : len(paths[i])]
        kept = row[:, at]
        row.fill_(float("-inf"))
        row[:, at] = kept


def _hold_back_endings(logits: torch.Tensor, rows, params, histories, paths, chosen: list[int]) -> None:
    """``min_tokens`` (:func:`adjust_logits`): -inf for the ending tokens at positions whose text
    holds fewer than ``min_tokens`` output tokens."""
    at_row, at_position, at_token = [], [], []
    for i in chosen:
        p, history = params[i], histories[i]
        done = history.generated if history is not None else 0
        if done >= p.min_tokens or not p.eos_token_ids:
            continue
        for j, path in enumerate(paths[i]):
            if done + len(path) < p.min_tokens:
                at_row += [rows[i]] * len(p.eos_token_ids)
                at_position += [j] * len(p.eos_token_ids)
                at_token += p.eos_token_ids
    if at_row:
        index = torch.tensor([at_row, at_position, at_token], dtype=torch.int64).to(logits.device)
        logits[index[0], index[1], index[2]] = float("-inf")


def _penalize(logits: torch.Tensor, rows, params, histories, paths, chosen: list[int]) -> None:
    """Logit bias and the penalties (:func:`adjust_logits`) of the ``chosen`` rows."""
    if not chosen:
        return
    vocab = logits.shape[-1]
    # Every named (row, token) pair is one key, k * V + token for the k-th chosen row; the work is
    # a fixed number of array operations over all rows' keys, whatever the rows.
    positions = np.array([len(paths[i]) for i in chosen], dtype=np.int64)
    p_max = int(positions.max())
    out_keys, out_counts, prompt_keys, bias_keys, bias_values, path_keys = [], [], [], [], [], []
    for k, i in enumerate(chosen):
        p, history = params[i], histories[i]
        if p.penalized and history is not None:
            if history.counts:
                out_keys.append(k * vocab + np.fromiter(history.counts.keys(), dtype=np.int64, count=len(history.counts)))
                out_counts.append(np.fromiter(history.counts.values(), dtype=np.int64, count=len(history.counts)))
            if p.repetition_penalty != 1.0:
                prompt_keys.append(k * vocab + history.prompt)
        if p.penalized:  # the drafted tokens before each position: (k * p_max + j) * V + token
            path_keys += [(k * p_max + j) * vocab + np.asarray(path, dtype=np.int64) for j, path in enumerate(paths[i]) if len(path)]
        if p.logit_bias:
            bias_keys.append(k * vocab + np.array([t for t, _ in p.logit_bias], dtype=np.int64))
            bias_values.append(np.array([b for _, b in p.logit_bias], dtype=np.float64))
    join = lambda parts, dtype=np.int64: np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)  # noqa: E731
    out_keys, out_counts, prompt_keys = join(out_keys), join(out_counts), join(prompt_keys)
    bias_keys, bias_values, path_keys = join(bias_keys), join(bias_values, np.float64), join(path_keys)
    named = sorted_unique(np.concatenate([out_keys, prompt_keys, bias_keys,
                                           path_keys // (p_max * vocab) * vocab + path_keys % vocab]))
    if not len(named):
        return
    base = np.zeros(len(named), dtype=np.int64)
    base[np.searchsorted(named, out_keys)] = out_counts
    in_prompt = np.zeros(len(named), dtype=bool)
    in_prompt[np.searchsorted(named, prompt_keys)] = True
    bias = np.zeros(len(named), dtype=np.float64)
    bias[np.searchsorted(named, bias_keys)] = bias_values
    # one entry per named key and position of its row
    row_of, token = named // vocab, named % vocab
    reps = positions[row_of]
    key = np.repeat(np.arange(len(named)), reps)
    j = np.arange(len(key)) - np.repeat(np.cumsum(reps) - reps, reps)
    count = base[key]
    if len(path_keys):
        drafted = sorted_unique(path_keys)
        times = np.bincount(np.searchsorted(drafted, path_keys), minlength=len(drafted))
        at = (row_of[key] * p_max + j) * vocab + token[key]
        found = np.minimum(np.searchsorted(drafted, at), len(drafted) - 1)
        hit = drafted[found] == at
        count[hit] += times[found[hit]]
    entry_row = row_of[key]
    # preallocated and filled, one dtype (np.stack of the same mixed-dtype arrays took 1.04-1.2x as long: bench_penalties --numpy)
    index = np.empty((3, len(key)), dtype=np.int64)
    index[0], index[1], index[2] = np.asarray(rows, dtype=np.int64)[np.asarray(chosen)][entry_row], j, token[key]
    values = np.empty((6, len(key)), dtype=np.float64)
    values[0], values[1], values[2] = count, in_prompt[key] | (count > 0), bias[key]
    values[3:] = np.array([[params[i].repetition_penalty, params[i].frequency_penalty, params[i].presence_penalty]
                           for i in chosen], dtype=np.float64)[entry_row].T
    # two copies to the logits' device
    index = torch.from_numpy(index).to(logits.device)
    count, seen, bias, rep, freq, pres = torch.from_numpy(values).to(logits.device, logits.dtype)
    at = (index[0], index[1], index[2])
    x = logits[at] + bias
    x = torch.where(seen > 0, torch.where(x > 0, x / rep, x * rep), x)
    logits[at] = x - freq * count - pres * (count > 0).to(x.dtype)


_BYTE_BIAS: dict = {}  # (dtype, device) -> [256, 8]: row b holds 0 where bit i of b is set, else -inf


def mask_logits(logits: torch.Tensor, bits: np.ndarray) -> None:
    """Add -inf to ``logits [P, V]`` IN PLACE wherever :meth:`~goodspeed.lm.decoding.structured.Constraint.masks`' ``bits`` refuse a
    token (and past the mask's words: no token of the tokenizer). Each mask byte picks its eight
    tokens' biases (0 or -inf) from a 256-row table: one gather and one add over ``[P, V]``, with
    no boolean tensor unpacked or filled through. A position that allows none of ``logits``'
    tokens (a draft's smaller vocabulary) is left as it is."""
    key = (logits.dtype, logits.device)
    table = _BYTE_BIAS.get(key)
    if table is None:
        codes = torch.arange(256)
        table = _BYTE_BIAS[key] = torch.where((codes[:, None] >> torch.arange(8)) & 1 == 1, 0.0,
                                              float("-inf")).to(logits.dtype).to(logits.device)
    rows, vocab = logits.shape
    n = min(vocab, 32 * bits.shape[-1])
    codes = torch.from_numpy(bits.view(np.uint8)).to(logits.device).reshape(-1).long()
    bias = table.index_select(0, codes).view(rows, -1)[:, :n]
    if vocab < 32 * bits.shape[-1]:
        none = ~(bias == 0).any(dim=-1)
        if none.any():
            bias[none] = 0.0
    logits[:, :n].add_(bias)
    if vocab > n:
        logits[:, n:] = float("-inf")
