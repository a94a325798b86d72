"""The feature head's training-time test (bench/bench_feature_head.py): one forward over three
streams must compute, at every position, what drafting the chain step by step computes."""

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    import bench.bench_feature_head as module

    return module


def tiny_target():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


def test_chain_mask_against_the_keys_each_draft_step_sees(bench):
    length, depth = 5, 3
    mask = bench.chain_mask(length, depth)
    for s in range(depth):
        for p in range(length):
            seen = {(k, q) for k in range(depth) for q in range(length) if mask[s * length + p, k * length + q] == 0}
            expected = {(0, q) for q in range(p - s + 1)} | {(k, p - (s - k)) for k in range(1, s + 1) if p - (s - k) >= 0}
            assert seen == expected, (s, p)
    # depth 1 is the ordinary causal mask
    assert torch.equal(bench.chain_mask(length, 1) == 0, torch.ones(length, length).tril().bool())


@torch.inference_mode()
def test_one_forward_over_three_streams_equals_drafting_step_by_step(bench):
    target = tiny_target()
    head = bench.FeatureHead(target).eval()
    length, d = 7, target.config.hidden_size
    f, x = torch.randn(1, length, d), torch.randint(0, 50, (1, length))
    out0 = head(f, x)
    f1 = torch.cat([f[:, :1], out0[:, :-1]], 1)  # stream 1 reads stream 0's predictions one position on
    both = head(torch.cat([f, f1], 1), x.repeat(1, 2), torch.arange(length).repeat(2), bench.chain_mask(length, 2))
    f2 = torch.cat([f[:, :1], both[:, length:][:, :-1]], 1)
    all3 = head(torch.cat([f, f1, f2], 1), x.repeat(1, 3), torch.arange(length).repeat(3), bench.chain_mask(length, 3))
    assert torch.allclose(all3[:, :2 * length], both, atol=1e-5)  # a stream never sees the streams after it
    for p in range(2, length):
        # the chain whose last true feature is at p - 1 (one step) and at p - 2 (two steps)
        step1 = head(torch.cat([f[:, :p], f1[:, p : p + 1]], 1), x[:, : p + 1])[0, -1]
        step2 = head(torch.cat([f[:, : p - 1], f1[:, p - 1 : p], f2[:, p : p + 1]], 1), x[:, : p + 1])[0, -1]
        assert torch.allclose(all3[0, length + p], step1, atol=1e-5)
        assert torch.allclose(all3[0, 2 * length + p], step2, atol=1e-5)
    # negative control: the same streams under a plain causal mask see other chains' steps
    causal = head(torch.cat([f, f1, f2], 1), x.repeat(1, 3), torch.arange(length).repeat(3))
    assert not torch.allclose(causal[0, 2 * length + length - 1], all3[0, 2 * length + length - 1], atol=1e-3)


def test_training_windows_draw_the_same_starts_at_either_length(bench):
    """The head trains on windows of SEQ + 1 tokens and the truncated draft on SEQ: both read the
    same draws, so a window of SEQ is the head's window less its last token."""
    import numpy as np

    rng = np.random.default_rng(5)
    seqs = [rng.integers(0, 100, int(n)) for n in rng.integers(50, 700, 40)]
    feats = [torch.randn(len(s), 3) for s in seqs]
    short, long = bench.windows(seqs, feats, bench.SEQ), bench.windows(seqs, feats, bench.SEQ + 1)
    for _ in range(4):
        (x, f), (x1, f1) = next(short), next(long)
        assert x.shape == (bench.BATCH, bench.SEQ) and x1.shape == (bench.BATCH, bench.SEQ + 1)
        assert torch.equal(x, x1[:, :-1]) and torch.equal(f, f1[:, :-1])
    assert not torch.equal(next(short)[0], x)  # later batches are new draws
