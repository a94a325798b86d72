import numpy as np
import pytest
import torch

from goodspeed.drafter.runner import DraftRunner
from goodspeed.lm.sampling import SamplingParams
from modelkit import tiny_llama


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0, top_k=5)])
def test_rollback_equals_fresh_runner(sampling):
    model = tiny_llama(1)
    rng = np.random.default_rng(0)
    runner = DraftRunner(model)
    runner.start([1, 2, 3])
    for _ in range(12):
        s = int(rng.integers(0, 6))
        out = runner.draft(s, sampling, torch.Generator().manual_seed(int(rng.integers(1 << 30))))
        assert len(out.token_ids) == s and out.probs.shape == (s, 48)
        m = int(rng.integers(0, s + 1))
        emitted = out.token_ids[:m] + [int(rng.integers(0, 48))]
        runner.apply(emitted, m)
        fresh = DraftRunner(model)
        fresh.start(runner.committed)
        seed = int(rng.integers(1 << 30))
        a = runner.draft(3, sampling, torch.Generator().manual_seed(seed))
        b = fresh.draft(3, sampling, torch.Generator().manual_seed(seed))
        assert a.token_ids == b.token_ids and torch.allclose(a.probs, b.probs, atol=1e-10)
        runner.apply(a.token_ids[:1] + [5], 1)  # keep going from a known state


def test_greedy_draft_probs_are_one_hot_and_sampled_are_truncated():
    runner = DraftRunner(tiny_llama(2))
    runner.start([4])
    greedy = runner.draft(2, SamplingParams(), torch.Generator())
    assert torch.all(greedy.probs.max(-1).values == 1.0)
    sampled = runner.draft(2, SamplingParams(temperature=1.0, top_k=3), torch.Generator().manual_seed(0))
    assert torch.all((sampled.probs > 0).sum(-1) == 3)


class _Tail(torch.nn.Module):
    """Wraps a model so token 0's probability is ~1e-60: a float64 q below float32's range."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model, self.config = model, model.config

    def forward(self, **kw):
        out = self.model(**kw)
        out.logits[..., 0] = out.logits[..., 1:].max(-1).values - 140.0
        return out


def test_q_travels_as_sampled_in_float32_and_never_holds_an_unsendable_token():
    runner = DraftRunner(_Tail(tiny_llama(2)))
    runner.start([4])
    out = runner.draft(4, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    assert out.probs.dtype == torch.float32  # what was sampled from is exactly what is sent
    assert float(out.probs[:, 0].max()) == 0.0  # underflows in float32: it cannot be drafted
    assert all(float(out.probs[j, tok]) > 0 for j, tok in enumerate(out.token_ids))
