import numpy as np
import pytest

from goodspeed.scheduler.goodspeed import expected_goodput
from goodspeed.scheduler.turbospec import LatencyModel, choose_proposal_length, fit_latency_model


def test_fit_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    ctx = rng.integers(0, 4096, 200)
    bat = rng.integers(1, 512, 200)
    t = 2e-6 * ctx + 5e-5 * bat + 0.01
    model = fit_latency_model(ctx, bat, t)
    assert model.alpha_s_per_context_token == pytest.approx(2e-6)
    assert model.gamma_s_per_batched_token == pytest.approx(5e-5)
    assert model.delta_s == pytest.approx(0.01)
    assert LatencyModel.from_dict(model.to_dict()) == model
    with pytest.raises(ValueError):
        fit_latency_model([1, 2, 3], [5, 5, 5], [1, 2, 3])  # batched never varies


def brute_force(acc, ctx, target, draft, max_k):
    best_k, best = 0, -1.0
    for k in range(max_k + 1):
        gen = sum(expected_goodput(a, k) for a in acc)
        t = target.predict_s(ctx, len(acc) * (k + 1)) + k * draft.predict_s(ctx, len(acc))
        if gen / t > best:
            best_k, best = k, gen / t
    return best_k


def test_large_batch_where_speculation_cannot_pay_returns_zero():
    # Compute-bound target: every batched token costs as much as the fixed overhead.
    target = LatencyModel(1e-7, 1e-3, 1e-3)
    draft = LatencyModel(1e-8, 1e-4, 5e-4)
    choice = choose_proposal_length([0.6] * 64, 64 * 512, target, draft, max_k=6)
    assert choice.k == 0


def test_matches_brute_force_argmax_elsewhere():
    rng = np.random.default_rng(1)
    for _ in range(300):
        target = LatencyModel(*rng.uniform([0, 0, 1e-3], [1e-6, 1e-3, 5e-2]))
        draft = LatencyModel(*rng.uniform([0, 0, 1e-4], [1e-7, 1e-4, 5e-3]))
        acc = rng.uniform(0, 1, int(rng.integers(1, 16)))
        ctx = int(rng.integers(0, 8192))
        choice = choose_proposal_length(acc, ctx, target, draft, max_k=8)
        assert choice.k == brute_force(acc, ctx, target, draft, 8)
        assert choice.predicted_goodput_tok_s.shape == (9,)


def test_small_batch_high_acceptance_speculates_and_oom_limit_applies():
    target = LatencyModel(1e-7, 1e-5, 2e-2)  # memory-bound: extra tokens nearly free
    draft = LatencyModel(1e-8, 1e-6, 1e-3)
    assert choose_proposal_length([0.9], 128, target, draft, max_k=8).k >= 4
    assert choose_proposal_length([0.9] * 4, 128, target, draft, max_k=8, max_batched_tokens=8).k == 1
