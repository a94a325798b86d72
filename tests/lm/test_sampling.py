import math

import pytest
import torch

from goodspeed.lm.sampling import SamplingParams, process_logits, sample_from


def test_greedy_one_hot_lowest_index_on_ties():
    p = process_logits(torch.tensor([1.0, 3.0, 3.0, 0.0]), SamplingParams(temperature=0))
    assert p.tolist() == [0.0, 1.0, 0.0, 0.0]


def test_temperature_top_k_top_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert process_logits(logits, SamplingParams(temperature=1.0)).tolist() == pytest.approx([0.5, 0.3, 0.15, 0.05])
    assert process_logits(logits, SamplingParams(temperature=1.0, top_k=2)).tolist() == pytest.approx([0.625, 0.375, 0, 0])
    # top-p 0.8: smallest prefix with mass >= 0.8 is {0.5, 0.3}
    assert process_logits(logits, SamplingParams(temperature=1.0, top_p=0.8)).tolist() == pytest.approx([0.625, 0.375, 0, 0])
    hot = process_logits(logits, SamplingParams(temperature=0.5))
    squared = torch.tensor([0.5, 0.3, 0.15, 0.05]) ** 2  # temperature 1/2 squares the probabilities
    assert hot.tolist() == pytest.approx((squared / squared.sum()).tolist(), rel=1e-5)


def test_per_row_params_in_one_batch():
    logits = torch.randn(3, 5, 7)
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=0.7, top_p=0.9)]
    batch = process_logits(logits, params)
    for i, prm in enumerate(params):
        assert torch.allclose(batch[i], process_logits(logits[i], prm))
    assert torch.allclose(batch.sum(-1), torch.ones(3, 5))
    assert ((batch[1] > 0).sum(-1) == 3).all()


def test_sample_from_inverse_cdf():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75]] * 3)
    assert sample_from(probs, torch.tensor([0.0, 0.2499, 0.25])).tolist() == [1, 1, 3]
    assert sample_from(probs * 4, torch.tensor([0.999999, 0.5, 0.1])).tolist() == [3, 3, 1]


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(temperature=math.inf), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)])
def test_bad_params(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
