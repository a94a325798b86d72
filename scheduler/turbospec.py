"""TurboSpec: a profiled latency model and the proposal length that maximises goodput.

Implements TurboSpec (Liu et al., "TurboSpec: closed-loop speculation control for goodput", arXiv
2406.14066; Section 4.1.3):

* eq. (3): a forward pass costs ``T_fwd = alpha * N_context + gamma * N_batched + delta``, fitted by
  least squares on offline profile samples (one model for the target, one for the draft);
* eq. (2): a step costs ``T_batch = T_draft + T_target`` with ``T_draft = k * T_fwd^draft``;
* eq. (4): a request with acceptance ``a`` yields ``l(a, k) = (1 - a^(k+1)) / (1 - a)`` tokens;
* Listing 2: choose ``k`` maximising ``sum_i l(a_i, k) / T_batch(k)``. Unlike the listing, ``k = 0``
  (plain decoding: no draft pass, one token per request) is a candidate, so speculation switches
  off when it cannot pay.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from goodspeed.scheduler.goodspeed import expected_goodput


@dataclass(frozen=True)
class LatencyModel:
    """``T_fwd(N_context, N_batched) = alpha * N_context + gamma * N_batched + delta`` seconds."""

    alpha_s_per_context_token: float
    gamma_s_per_batched_token: float
    delta_s: float

    def predict_s(self, num_context_tokens, num_batched_tokens) -> np.ndarray:
        return (
            self.alpha_s_per_context_token * np.asarray(num_context_tokens, dtype=np.float64)
            + self.gamma_s_per_batched_token * np.asarray(num_batched_tokens, dtype=np.float64)
            + self.delta_s
        )

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, float]) -> "LatencyModel":
        return cls(**{k: float(data[k]) for k in ("alpha_s_per_context_token", "gamma_s_per_batched_token", "delta_s")})


def fit_latency_model(num_context_tokens, num_batched_tokens, latency_s) -> LatencyModel:
    """Least-squares fit of eq. (3) to profile samples (three or more, not all collinear)."""
    ctx = np.asarray(num_context_tokens, dtype=np.float64).reshape(-1)
    bat = np.asarray(num_batched_tokens, dtype=np.float64).reshape(-1)
    t = np.asarray(latency_s, dtype=np.float64).reshape(-1)
    if not ctx.size == bat.size == t.size or ctx.size < 3:
        raise ValueError("need at least three profile samples with matching lengths")
    design = np.column_stack([ctx, bat, np.ones_like(ctx)])  # [num_samples, 3]
    if np.linalg.matrix_rank(design) < 3:
        raise ValueError("profile samples must vary both context and batched token counts")
    coef, *_ = np.linalg.lstsq(design, t, rcond=None)
    return LatencyModel(float(coef[0]), float(coef[1]), float(coef[2]))


@dataclass(frozen=True)
class ProposalChoice:
    """The chosen ``k`` and the predicted goodput (tokens/s) of every candidate ``k = 0..K``."""

    k: int
    predicted_goodput_tok_s: np.ndarray  # [max_k + 1]


def choose_proposal_length(
    acceptance: Sequence[float] | np.ndarray,
    num_context_tokens: int,
    target: LatencyModel,
    draft: LatencyModel,
    max_k: int,
    max_batched_tokens: int | None = None,
) -> ProposalChoice:
    """Listing 2 with ``k = 0`` included; ties go to the smaller ``k``.

    ``acceptance[i]`` is request ``i``'s smoothed acceptance rate; ``num_context_tokens`` the KV
    tokens of the whole batch. ``k`` values whose ``n * (k + 1)`` verified tokens exceed
    ``max_batched_tokens`` are skipped (the listing's OOM check).
    """
    a = np.asarray(acceptance, dtype=np.float64).reshape(-1)
    if a.size == 0 or max_k < 0:
        raise ValueError("need at least one request and max_k >= 0")
    if np.any((a < 0) | (a > 1)) or np.any(~np.isfinite(a)):
        raise ValueError("acceptance rates must lie in [0, 1]")
    n = a.size
    ks = np.arange(max_k + 1)
    generated = expected_goodput(a[None, :], ks[:, None]).sum(axis=1)  # [max_k + 1]
    t_target = target.predict_s(num_context_tokens, n * (ks + 1))
    t_draft = ks * draft.predict_s(num_context_tokens, n)
    goodput = generated / (t_target + t_draft)
    if max_batched_tokens is not None:
        goodput = np.where(n * (ks + 1) <= max_batched_tokens, goodput, -np.inf)
    return ProposalChoice(k=int(np.argmax(goodput)), predicted_goodput_tok_s=goodput)
