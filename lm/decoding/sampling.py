"""Logits processing and sampling shared by drafter and verifier.

The draft distribution ``q`` and the target distribution ``p`` go through the SAME processing
(temperature, min-p, top-k, top-p) of the request (docs/DESIGN.md, *Lossless verification*), so both sides call
:func:`process_logits`; that is what keeps acceptance high. Exactness needs only that each drafted
token was sampled from the very ``q`` the verifier gets, so an edge drafter may also cap that
``q``'s support (:func:`cap_support`) to send it small. Temperature 0 means greedy: the result is
the one-hot distribution of the argmax (lowest token id on ties), which makes greedy decoding a
special case of the same rejection rule. Randomness is always passed in (uniforms or a
``torch.Generator``).

What a request asks for (:class:`~goodspeed.lm.decoding.params.SamplingParams`, with the logit
adjustments it may name) is defined in :mod:`goodspeed.lm.decoding.params`, which imports no torch.
"""

from __future__ import annotations

import math

import torch

from goodspeed.lm.decoding.params import SamplingParams


def process_logits(logits: torch.Tensor, params: SamplingParams | list[SamplingParams]) -> torch.Tensor:
    """Probabilities ``[..., V]`` (float32 or wider) from raw logits ``[..., V]``.

    ``params`` is one :class:`SamplingParams` for all rows, or a list with one entry per leading
    row (``logits`` is then ``[rows, ..., V]``), so a batch of requests with different sampling
    settings is processed in one pass.
    """
    if isinstance(params, SamplingParams):
        params = [params] * (logits.shape[0] if logits.dim() > 1 else 1)
        if logits.dim() == 1:
            return process_logits(logits[None], params)[0]
    if len(params) != logits.shape[0]:
        raise ValueError(f"{len(params)} sampling settings for {logits.shape[0]} rows")
    work = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    shape = (len(params),) + (1,) * (work.dim() - 1)
    temps = torch.tensor([p.temperature for p in params], dtype=work.dtype, device=work.device).view(shape)
    greedy = temps == 0
    scaled = work / torch.where(greedy, torch.ones_like(temps), temps)
    if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
        scaled = _truncate(scaled, params, shape)
    probs = torch.softmax(scaled, dim=-1)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, argmax_last(work).unsqueeze(-1), 1.0)
        probs = torch.where(greedy, one_hot, probs)
    return probs


def argmax_last(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)``, the lowest index on ties (torch's rule and numpy's alike). A CPU
    tensor goes through numpy (bfloat16 rows widened to float32 first, which is exact, ties
    included): torch's CPU argmax measured 9x slower over a greedy round's 8 x 5 rows of 2,048
    float32 logits and 30x over a batch-8 step of the real target's 49,152 bfloat16 logits a row
    (1.28 ms against 0.04 ms; ``python -m bench.bench_argmax``, docs/benchmarks/micro/argmax.json).
    Other devices use torch's."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        if x.dtype == torch.bfloat16:  # numpy has no bfloat16
            x = x.float()
        return torch.from_numpy(x.detach().numpy().argmax(axis=-1))
    return x.argmax(dim=-1)


def _truncate(scaled: torch.Tensor, params: list[SamplingParams], shape: tuple[int, ...]) -> torch.Tensor:
    """Mask logits outside each row's min-p, top-k and top-p sets with -inf (ties kept by sort
    order), in vLLM's order: min-p keeps the tokens whose probability is at least ``min_p`` times
    the most probable one's (a logit at most ``-log(min_p)`` below the largest), top-k the ``k``
    largest of those, top-p the smallest prefix of those whose renormalised mass reaches ``p``.

    Each row is truncated by its own settings only: a row with ``top_p = 1`` skips the nucleus
    test (float cumulative sums that round to 1 would otherwise drop its tail whenever another
    row of the batch truncates), and the nucleus mass is summed in float64.
    """
    vocab = scaled.shape[-1]
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=scaled.device)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=scaled.device).view(shape)
    keep_sorted = (rank < top_k).expand_as(scaled)
    if any(p.min_p > 0.0 for p in params):
        # log(0) = -inf keeps every token of a row without min-p
        log_min_p = torch.tensor([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params],
                                 dtype=torch.float64, device=scaled.device).view(shape)
        keep_sorted = keep_sorted & (sorted_logits.double() - sorted_logits[..., :1].double() >= log_min_p)
    nucleus = torch.tensor([p.top_p < 1.0 for p in params], device=scaled.device).view(shape)
    if bool(nucleus.any()):
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64, device=scaled.device).view(shape)
        sorted_probs = torch.softmax(sorted_logits.double().masked_fill(~keep_sorted, -math.inf), dim=-1)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        # smallest prefix whose mass reaches top_p, for the rows that ask for a nucleus
        keep_sorted = keep_sorted & ((mass_before < top_p) | ~nucleus)
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    return scaled.masked_fill(~keep, -math.inf)


def cap_support(probs: torch.Tensor, k: int) -> torch.Tensor:
    """``probs [..., V]`` restricted to each row's ``k`` most likely tokens and renormalised; the
    rows unchanged when ``k`` is 0 or at least ``V``.

    A drafter's proposal (drafter.runner, lm.runtime.batch_draft): the accept test and the residual
    ``max(0, p - q)`` are exact for ANY ``q`` the token was sampled from, provided the verifier gets
    that very ``q`` (docs/DESIGN.md, *Lossless verification*, needs ``s_j ~ q_j``, nothing about how ``q_j`` was made).
    Capping the support lets a sampled draft travel sparse: ``k`` (id, prob) pairs a position
    instead of ``V`` floats; the correctness argument of speculative sampling (Leviathan et al.,
    verifier.rejection) never uses where the proposal came from. It costs acceptance at most the
    mass cut off: ``sum min(p, q')`` loses at most the dropped mass of ``q``.
    """
    if k <= 0 or k >= probs.shape[-1]:
        return probs
    values, ids = torch.topk(probs, k, dim=-1)
    capped = torch.zeros_like(probs).scatter_(-1, ids, values)
    return capped / capped.sum(dim=-1, keepdim=True)


def draft_proposal(logits: torch.Tensor, params: SamplingParams, proposal_top_k: int) -> torch.Tensor:
    """The float32 ``q`` a drafter samples its next token from, and that travels with it: the
    request's processing of ``logits`` in float64, its support capped to ``proposal_top_k`` tokens
    when sampling (:func:`cap_support`; greedy q is one-hot already). The token is drawn from this
    very tensor, as the verifier reads it, so a drafted token never has q = 0 there (a float64 q
    below float32's range would)."""
    q = process_logits(logits.double(), params)
    if not params.greedy:
        q = cap_support(q, proposal_top_k)
    return q.float()


def draft_step(logits: torch.Tensor, params: list[SamplingParams], proposal_top_k: int,
               uniforms: torch.Tensor) -> tuple[torch.Tensor, list[int], list[float]]:
    """One drafting step for ``n`` requests at once: ``logits [n, V]`` (each request's last
    position), one :class:`SamplingParams` and one uniform (``uniforms [n]``) per row. Returns
    ``(q [n, V] float32, tokens, confidence)``, row ``i`` exactly what one request's
    :func:`draft_proposal`, then :func:`sample_from` with ``uniforms[i]``, give: ``q`` is the
    request's processed distribution (one-hot for greedy rows, support capped to
    ``proposal_top_k`` for sampled ones), the token is drawn from that very ``q``, and the
    confidence is ``q(token)`` for sampled rows and the draft's float64 softmax probability of the
    argmax for greedy rows (whose ``q`` says nothing). Every full-vocabulary pass runs once over
    the rows that need it, not once per request, and greedy rows make no float64 copy of the
    vocabulary."""
    n = logits.shape[0]
    if len(params) != n or uniforms.shape != (n,):
        raise ValueError(f"need one SamplingParams and one uniform per row ({n} rows)")
    q = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    tokens = [0] * n
    confidence = [0.0] * n
    greedy = [i for i, p in enumerate(params) if p.greedy]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if greedy:
        rows = logits if len(greedy) == n else logits[greedy]
        top = argmax_last(rows).to(logits.device)  # process_logits' one-hot position, lowest id on ties
        # softmax at the argmax, 1 / sum_v exp(x_v - x_max): exponentials in the logits' dtype,
        # summed in float64 (no float64 copy of the vocabulary)
        work = rows.float() if rows.dtype in (torch.float16, torch.bfloat16) else rows
        soft = 1.0 / (work - work.gather(-1, top.unsqueeze(-1))).exp_().sum(dim=-1, dtype=torch.float64)
        q[torch.tensor(greedy, device=q.device), top] = 1.0
        for i, tok, c in zip(greedy, top.tolist(), soft.tolist()):  # one copy to the host each
            tokens[i], confidence[i] = tok, c
    if sampled:
        rows = cap_support(process_logits(logits[sampled].double(), [params[i] for i in sampled]), proposal_top_k).float()
        drawn = sample_from(rows, uniforms[sampled])  # the draw on the logits' device
        picked = rows.gather(-1, drawn.unsqueeze(-1)).squeeze(-1)
        q[sampled] = rows
        for i, tok, c in zip(sampled, drawn.tolist(), picked.tolist()):
            tokens[i], confidence[i] = tok, c
    return q, tokens, confidence


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw, one token per row: ``probs [..., V]`` (need not sum to 1), ``uniforms [...]``
    in ``[0, 1)``. Deterministic given the uniforms, so tests can replay it.

    The cumulative sum and the uniforms are float64 whatever ``probs``' dtype (a float32 uniform
    rounds up to 1 for ``u >= 1 - 2^-25``), and a token of probability 0 is never returned: a draw
    that rounding puts at or past the total mass takes the last token with positive probability.
    """
    cdf = torch.cumsum(probs.double(), dim=-1)
    total = cdf[..., -1:].contiguous()  # [..., 1]
    u = uniforms.to(device=cdf.device, dtype=torch.float64)  # drawn on the host, probs maybe on a GPU
    idx = torch.searchsorted(cdf, u.unsqueeze(-1) * total, right=True)
    # A draw below the total lands on a token of positive mass; only one rounded up to it runs past
    # the end. The first index whose cdf reaches the total is the last token of positive mass.
    last_positive = torch.searchsorted(cdf, total)
    return torch.minimum(idx, last_positive).squeeze(-1)


def uniform_like(shape: tuple[int, ...], generator: torch.Generator, dtype=torch.float64) -> torch.Tensor:
    """Uniforms in ``[0, 1)`` from an explicit generator."""
    return torch.rand(shape, generator=generator, dtype=dtype)
