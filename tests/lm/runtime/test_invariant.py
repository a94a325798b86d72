"""lm.runtime.invariant: linear layers whose rows do not depend on how many rows their call holds,
and the engine option that turns them on."""

import doctest

import pytest
import torch

from goodspeed.lm.models.precision import cpu_flags
from goodspeed.lm.runtime import invariant, packing
from goodspeed.lm.runtime.invariant import LINEAR_ROWS, batch_invariance_missing, make_batch_invariant, runs
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from modelkit import tiny_llama

# SmolLM2-135M's hidden width into a wide layer: a shape where oneDNN's bf16 matmul blocks calls of
# more than 32 rows otherwise than a lone row (measured on a CPU with AMX)
WIDE = (576, 4096)
AMX = "amx_bf16" in cpu_flags()
measured_here = pytest.mark.skipif(not AMX, reason="batch invariance is measured on CPUs with AMX (amx_bf16) only")
ROW_COUNTS = (1, 31, LINEAR_ROWS, LINEAR_ROWS + 1, 56, 200)


def _rows_alone_and_together(layer):
    """Per row count: whether the layer's outputs over the first rows equal each row computed alone."""
    x = torch.randn(200, layer.in_features, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.inference_mode():
        alone = torch.cat([layer(x[r : r + 1]) for r in range(len(x))])
        return {m: torch.equal(layer(x[:m]), alone[:m]) for m in ROW_COUNTS}


@measured_here
def test_rows_in_runs_equal_each_row_alone_at_every_row_count():
    """With the layer made batch invariant, a call of 1 to 200 rows gives each row exactly what the
    row alone gives. Negative control: the same layer as torch runs it parts from the lone rows in
    a call of more than 32."""
    layer = torch.nn.Linear(*WIDE, bias=True).to(torch.bfloat16)
    as_is = _rows_alone_and_together(layer)
    assert all(as_is[m] for m in ROW_COUNTS if m <= LINEAR_ROWS)
    assert not all(as_is[m] for m in ROW_COUNTS if m > LINEAR_ROWS)
    wrapper = torch.nn.Sequential(layer)
    assert make_batch_invariant(wrapper) == 1 and make_batch_invariant(wrapper) == 1  # idempotent
    assert all(_rows_alone_and_together(layer).values())


def test_runs_are_the_fewest_of_at_most_32_rows_and_as_even_as_they_go():
    for rows in range(1, 300):
        bounds = runs(rows)
        sizes = [b - a for a, b in zip(bounds, bounds[1:])]
        assert bounds[0] == 0 and bounds[-1] == rows and len(sizes) == -(-rows // LINEAR_ROWS)
        assert all(0 < n <= LINEAR_ROWS for n in sizes) and max(sizes) - min(sizes) <= 1
    assert doctest.testmod(invariant).failed == 0 and doctest.testmod(packing).failed == 0


def test_rows_in_runs_keep_the_shape_and_the_values_of_a_3d_input():
    layer = torch.nn.Linear(16, 24).to(torch.bfloat16)
    x = torch.randn(2, 40, 16).to(torch.bfloat16)
    with torch.inference_mode():
        reference = torch.nn.functional.linear(x, layer.weight, layer.bias)
        make_batch_invariant(layer)
        out = layer(x)
    assert out.shape == (2, 40, 24)
    assert torch.allclose(out.float(), reference.float(), atol=0.05, rtol=0.02)  # bf16 rounding apart


@measured_here
def test_the_engine_option_turns_the_targets_linear_layers_invariant():
    target = tiny_llama(1, dtype=torch.bfloat16)
    engine = VerificationEngine(target, EngineConfig(batch_invariant=True))
    layers = [m for m in engine.model.modules() if isinstance(m, torch.nn.Linear)]
    assert layers and all(m.forward.__func__.__name__ == "_rows_in_runs" for m in layers)
    plain = tiny_llama(1, dtype=torch.bfloat16)
    VerificationEngine(plain, EngineConfig())
    assert all("forward" not in vars(m) for m in plain.modules() if isinstance(m, torch.nn.Linear))


def test_the_engine_option_refuses_what_was_not_measured():
    with pytest.raises(ValueError, match="bf16 on a CPU only.*float64"):
        VerificationEngine(tiny_llama(1), EngineConfig(batch_invariant=True))
    assert "AMX" in batch_invariance_missing(torch.device("cpu"), torch.bfloat16, {"avx2", "avx512_bf16"})
    assert batch_invariance_missing(torch.device("cpu"), torch.bfloat16, {"avx512_bf16", "amx_bf16"}) is None
    assert "CPU only" in batch_invariance_missing(torch.device("cuda"), torch.bfloat16, {"amx_bf16"})
    if not AMX:
        with pytest.raises(ValueError, match="AMX"):
            VerificationEngine(tiny_llama(1, dtype=torch.bfloat16), EngineConfig(batch_invariant=True))
    with pytest.raises(ValueError, match="not with cuda_graphs or torch_compile"):
        EngineConfig(batch_invariant=True, torch_compile=True)
