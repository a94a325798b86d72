"""Goodness-of-fit helpers for the losslessness tests: exact target distributions computed from a
model, and a chi-square test against them (cells with small expectations pooled)."""

import math

import numpy as np
import torch

from goodspeed.lm.decoding.sampling import process_logits
from goodspeed.lm.decoding.params import SamplingParams

# Each goodness-of-fit test passes at p = 1e-5. About 40 of them run in the default suite (with
# fresh seeds on the threaded paths), so at p = 0.001 a correct suite failed by chance about once
# in 27 runs (it did: chi2 54.1 against 51.3 on min_tokens, whose 150 reruns averaged 24.6 on 24
# degrees of freedom); at 1e-5 about once in 2,500. Each negative control must exceed the
# critical value at p = 1e-6, beyond the test's own, so the tests still catch those bugs.
Z_TEST = 4.2649  # standard normal 1 - 1e-5 quantile
Z_POWER = 4.7534  # standard normal 1 - 1e-6 quantile


def chi2_critical(dof: int, z: float = Z_TEST) -> float:
    """Chi-square upper quantile by the Wilson-Hilferty approximation (the default z: p = 1e-5)."""
    if dof < 1:
        raise ValueError("need at least one degree of freedom")
    c = 2.0 / (9.0 * dof)
    return dof * (1.0 - c + z * math.sqrt(c)) ** 3


def chi2_stat(counts: np.ndarray, exact: np.ndarray, min_expected: float = 5.0) -> tuple[float, int]:
    """``(statistic, degrees of freedom)`` of ``counts`` against probabilities ``exact`` (same
    shape). Cells expected fewer than ``min_expected`` times are pooled into one. A count where
    the exact probability is 0 is an impossible outcome: the statistic is infinite."""
    counts, exact = np.asarray(counts, dtype=np.float64).ravel(), np.asarray(exact, dtype=np.float64).ravel()
    if counts[exact <= 0].sum() > 0:
        return math.inf, 1
    expected = exact * counts.sum()
    big = expected >= min_expected
    obs = list(counts[big]) + ([counts[~big].sum()] if (~big).any() else [])
    exp = list(expected[big]) + ([expected[~big].sum()] if (~big).any() else [])
    obs, exp = np.array(obs), np.array(exp)
    live = exp > 0
    return float(((obs[live] - exp[live]) ** 2 / exp[live]).sum()), max(1, int(live.sum()) - 1)


def fits(counts: np.ndarray, exact: np.ndarray) -> tuple[bool, str]:
    """Whether ``counts`` pass the chi-square test at p = 1e-5, and a message for the assertion."""
    stat, dof = chi2_stat(counts, exact)
    crit = chi2_critical(dof)
    tv = 0.5 * np.abs(counts / counts.sum() - exact).sum()
    return stat < crit, f"chi2 {stat:.1f} (critical {crit:.1f}, dof {dof}), TV {tv:.4f}, n {int(counts.sum())}"


def reference_adjust(logits: torch.Tensor, sampling: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """``logits [V]`` with the request's logit bias and penalties, written out densely from their
    definitions in vLLM's order (bias; repetition over prompt and output; frequency and presence
    over the output; min_tokens' ending tokens at -inf while the output is shorter; bad_words' last
    tokens where the output ends with the rest; every token
    but allowed_token_ids at -inf; every token a structured output's grammar refuses at -inf): the reference the sparse :func:`goodspeed.lm.decoding.adjust.adjust_logits` is
    tested against."""
    x = logits.clone()
    vocab = x.shape[-1]
    for token, bias in sampling.logit_bias:
        x[token] += bias
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab).to(x.dtype)
    seen = counts > 0
    if prompt:
        seen = seen | (torch.bincount(torch.tensor(prompt, dtype=torch.long), minlength=vocab) > 0)
    rep = sampling.repetition_penalty
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - sampling.frequency_penalty * counts - sampling.presence_penalty * (counts > 0).to(x.dtype)
    if len(output) < sampling.min_tokens:  # vLLM's min_tokens: the text may not end yet
        x[list(sampling.eos_token_ids)] = float("-inf")
    for word in sampling.bad_words:  # vLLM's bad_words: the last token where the output ends with the rest
        if len(word) == 1 or (len(word) - 1 <= len(output) and list(output[len(output) - len(word) + 1:]) == list(word[:-1])):
            x[word[-1]] = float("-inf")
    if sampling.allowed_token_ids:  # vLLM's allowed_token_ids: no other token
        others = torch.ones(vocab, dtype=torch.bool)
        others[list(sampling.allowed_token_ids)] = False
        x[others] = float("-inf")
    if sampling.structured is not None:  # a grammar: no token it refuses after the output
        x[~grammar_allows(sampling.structured, output, vocab)] = float("-inf")
    return x


def grammar_allows(structure, output: list[int], vocab: int) -> torch.Tensor:
    """``[vocab]`` bool: the tokens a fresh matcher of ``structure`` allows after ``output`` (after
    its first ``structure.after`` token, where that is set: every token before one), read bit by
    bit from llguidance's bytes (not through :func:`allowed`)."""
    import llguidance

    if structure.after is not None:  # the grammar holds only what follows the first `after` token
        if structure.after not in output:
            return torch.ones(vocab, dtype=torch.bool)
        output = output[output.index(structure.after) + 1:]
    matcher = llguidance.LLMatcher(structure.tokenizer, structure.grammar, log_level=0)
    assert matcher.consume_tokens(list(output)), matcher.get_error()
    mask = matcher.compute_bitmask()
    return torch.tensor([t < 8 * len(mask) and bool(mask[t // 8] >> (t % 8) & 1) for t in range(vocab)])


def allowed(bits: np.ndarray, vocab: int) -> torch.Tensor:
    """Unpack :meth:`goodspeed.lm.decoding.structured.Constraint.masks`' int32 words into a bool tensor
    ``[P, vocab]`` (True: allowed; bit ``t % 32`` of word ``t // 32``); tokens past the words never."""
    flat = np.unpackbits(bits.view(np.uint8), axis=-1, count=min(vocab, 32 * bits.shape[-1]), bitorder="little")
    out = torch.zeros(len(bits), vocab, dtype=torch.bool)
    out[:, : flat.shape[-1]] = torch.from_numpy(flat.view(np.bool_))
    return out


def exact_first_two(model, prompt: list[int], sampling: SamplingParams, eos: int | None = None) -> np.ndarray:
    """``[V, V + 1]``: P(first token a, second token b) under ``model``'s own sampling (its logit
    bias and penalties by :func:`reference_adjust`); column V holds P(a) when ``a`` is ``eos`` (the
    request ends there, no second token)."""
    with torch.inference_mode():
        def dist(seq):
            logits = model(input_ids=torch.tensor([seq])).logits[0, -1].double()
            if sampling.adjusts_logits:
                logits = reference_adjust(logits, sampling, prompt, seq[len(prompt):])
            return process_logits(logits, sampling).numpy()

        first = dist(prompt)
        vocab = first.size
        out = np.zeros((vocab, vocab + 1))
        for a in range(vocab):
            if first[a] == 0:
                continue
            if a == eos:
                out[a, vocab] = first[a]
            else:
                out[a, :vocab] = first[a] * dist(prompt + [a])
    return out


def count_first_two(outputs, vocab: int) -> np.ndarray:
    """Counts of (first, second) generated tokens, column ``vocab`` for outputs of one token."""
    counts = np.zeros((vocab, vocab + 1))
    for out in outputs:
        counts[out[0], out[1] if len(out) > 1 else vocab] += 1
    return counts


def exact_marginal(model, prompt: list[int], sampling: SamplingParams, index: int) -> np.ndarray:
    """``[V]``: P(the generated token at ``index`` (0-based) is v) under ``model``'s own sampling
    (no logit adjustment, no EOS), summed over every text before it: ``V ** index`` prefixes, so
    for small vocabularies and indices only."""
    with torch.inference_mode():
        def dist(seq):
            return process_logits(model(input_ids=torch.tensor([seq])).logits[0, -1].double(), sampling).numpy()

        paths = {(): 1.0}
        for _ in range(index):
            grown: dict[tuple[int, ...], float] = {}
            for path, weight in paths.items():
                for token, p in enumerate(dist(list(prompt) + list(path))):
                    if p > 0:
                        grown[path + (token,)] = weight * p
            paths = grown
        out = 0.0
        for path, weight in paths.items():
            out = out + weight * dist(list(prompt) + list(path))
        return out
