"""Logits processing and sampling shared by drafter and verifier.

Lossless verification needs the draft distribution ``q`` and the target distribution ``p`` to go
through the SAME processing (temperature, top-k, top-p) of the request (DESIGN.md section 3), so
both sides call :func:`process_logits` and nothing else. Temperature 0 means greedy: the result is
the one-hot distribution of the argmax (lowest token id on ties), which makes greedy decoding a
special case of the same rejection rule. Randomness is always passed in (uniforms or a
``torch.Generator``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How a request samples. ``temperature = 0`` is greedy; ``top_k = 0`` and ``top_p = 1`` are off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if isinstance(self.top_k, bool) or int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def truncates(self) -> bool:
        """Whether the processed distribution has limited support (so it travels sparse, exactly)."""
        return self.greedy or self.top_k > 0 or self.top_p < 1.0


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
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        scaled = _truncate(scaled, params, shape)
    probs = torch.softmax(scaled, dim=-1)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, work.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy, one_hot, probs)
    return probs


def _truncate(scaled: torch.Tensor, params: list[SamplingParams], shape: tuple[int, ...]) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p nucleus with -inf (ties kept by sort order)."""
    vocab = scaled.shape[-1]
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=scaled.device)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=scaled.device).view(shape)
    keep_sorted = (rank < top_k).expand_as(scaled)
    top_p = torch.tensor([p.top_p for p in params], dtype=scaled.dtype, device=scaled.device).view(shape)
    sorted_probs = torch.softmax(sorted_logits.masked_fill(~keep_sorted, -math.inf), dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep_sorted = keep_sorted & (mass_before < top_p)  # smallest prefix whose mass reaches top_p
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    return scaled.masked_fill(~keep, -math.inf)


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw, one token per row: ``probs [..., V]`` (need not sum to 1), ``uniforms [...]``
    in ``[0, 1)``. Deterministic given the uniforms, so tests can replay it."""
    cdf = torch.cumsum(probs, dim=-1)
    target = uniforms.to(cdf.dtype).unsqueeze(-1) * cdf[..., -1:]
    idx = torch.searchsorted(cdf, target, right=True)
    return idx.squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def uniform_like(shape: tuple[int, ...], generator: torch.Generator, dtype=torch.float64) -> torch.Tensor:
    """Uniforms in ``[0, 1)`` from an explicit generator."""
    return torch.rand(shape, generator=generator, dtype=dtype)
