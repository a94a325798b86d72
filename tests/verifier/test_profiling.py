"""``goodspeed profile``'s measurement: the fitted eq. (3) predicts the samples it was fitted on."""

import pytest

from goodspeed.scheduler import LatencyModel
from goodspeed.verifier.profiling import baseline_tpot_s, fit_error, profile_model
from modelkit import tiny_llama


def test_profile_fits_measured_forwards():
    model = tiny_llama(0, layers=2)
    samples, fitted = profile_model(model, batch_sizes=(1, 4), contexts=(8, 64), query_lens=(1, 4), repeats=3)
    assert len(samples) == 8
    assert {(s["batch"], s["context"], s["query"]) for s in samples} == {(b, c, q) for b in (1, 4) for c in (8, 64) for q in (1, 4)}
    assert all(s["latency_s"] > 0 and s["num_batched_tokens"] == s["batch"] * s["query"] for s in samples)
    assert fitted.delta_s > 0  # a forward has a fixed cost
    assert fit_error(samples, fitted) < 1.0


def test_baseline_is_batch_8_plain_decoding():
    assert baseline_tpot_s(LatencyModel(1e-6, 1e-4, 0.01)) == pytest.approx(0.01 + 8 * 1e-4 + 256 * 1e-6)


def test_profile_rejects_contexts_past_the_model():
    with pytest.raises(ValueError, match="exceeds"):
        profile_model(tiny_llama(0), contexts=(600,), query_lens=(1,))


def test_a_profile_with_cuda_graphs_needs_cuda():
    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device"):
        profile_model(tiny_llama(0), batch_sizes=(1,), contexts=(8,), query_lens=(1,), repeats=1, cuda_graphs=True)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_a_profile_with_cuda_graphs_times_replays():
    """On CUDA the timed forwards are replays (the warm-up captured each shape), and fit as well."""
    model = tiny_llama(0, layers=2, hidden=256, heads=4, kv_heads=2, dtype=__import__("torch").float32).cuda()
    samples, fitted = profile_model(model, batch_sizes=(1, 4), contexts=(8, 64), query_lens=(1, 4), repeats=3, cuda_graphs=True)
    assert len(samples) == 8 and all(s["latency_s"] > 0 for s in samples) and fitted.delta_s > 0
