"""The truncated target of bench/bench_truncated_draft.py: before training it must compute what
the target computes after the same number of layers (early exit), with the target's own head."""

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    import bench.bench_truncated_draft as module

    return module


def tiny_target(layers: int = 3):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


@torch.inference_mode()
def test_the_truncated_target_is_the_targets_early_exit(bench):
    target = tiny_target()
    x = torch.randint(0, 50, (2, 9))
    hidden = target(input_ids=x, output_hidden_states=True).hidden_states  # [embeddings, layer 1, ..., norm(layer 3)]
    for layers in (1, 2):
        draft = bench.truncated_target(target, layers)
        assert len(draft.model.layers) == layers
        expected = target.model.norm(hidden[layers])
        assert torch.allclose(draft.model(input_ids=x).last_hidden_state, expected, atol=1e-5)
        assert torch.allclose(draft(input_ids=x).logits, expected @ target.lm_head.weight.T, atol=1e-5)
        # negative control: the exit one layer later differs
        assert not torch.allclose(draft.model(input_ids=x).last_hidden_state, target.model.norm(hidden[layers + 1]), atol=1e-3)
        assert draft.lm_head.weight.data_ptr() == draft.model.embed_tokens.weight.data_ptr()  # the head stays tied


def test_the_truncated_target_keeps_fewer_layers_than_the_target(bench):
    with pytest.raises(ValueError, match="--layers"):
        bench.truncated_target(tiny_target(), 3)
