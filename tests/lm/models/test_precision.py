"""Precision names (goodspeed.lm.models.precision): ``auto`` is bf16 exactly where the CPU's flags say it
computes bf16 natively, fp32 elsewhere; other names stand as they are."""

import pytest
import torch

from goodspeed.lm.models import loading, precision


@pytest.mark.parametrize("cpuinfo, native", [
    ("flags\t\t: fpu sse2 avx2 fma\nflags\t\t: fpu sse2 avx2 fma\n", False),  # AVX2 only: emulated
    ("flags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile\n", True),
    ("flags\t\t: fpu avx2 avx512f amx_bf16\n", True),
    ("Features\t: fp asimd bf16 i8mm\n", True),  # Arm
    ("Features\t: fp asimd\n", False),
    ("", False),
])
def test_native_bf16_is_read_from_the_cpus_flags(cpuinfo, native):
    assert precision.cpu_has_native_bf16(cpuinfo) == native


def test_auto_dtype_is_bf16_where_the_cpu_computes_it_natively_and_fp32_elsewhere(monkeypatch):
    for native, want in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda native=native: native)
        assert precision.resolve_dtype("auto", "cpu") == want and loading.torch_dtype("auto") == getattr(torch, want)
    assert precision.resolve_dtype("float32", "cpu") == "float32" and precision.resolve_dtype("bf16") == "bf16"


def test_auto_keeps_the_demo_models_in_fp32_and_the_loader_resolves_auto_for_the_model_it_loads(monkeypatch, tmp_path):
    """The demo models stay float32 under ``auto`` even where bf16 is native (too small for bf16 to
    pay); any other model follows the device; the loader passes the model it loads to the rule."""
    from modelkit import save_models, tiny_llama

    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    assert precision.resolve_dtype("auto", "cpu", "demo:target") == "float32"
    assert precision.resolve_dtype("auto", "cpu", "real:smollm2-135m") == "bfloat16"
    assert precision.resolve_dtype("bf16", "cpu", "demo:target") == "bf16"  # a named dtype stands
    path = save_models(tmp_path, {"target": tiny_llama(0, vocab=300, dtype=torch.float32)}, 300)["target"]
    assert loading.load_causal_lm(str(path), "auto").model.dtype == torch.bfloat16
    monkeypatch.setattr(precision, "FLOAT32_MODELS", (str(tmp_path),))  # as if this model were a demo model
    assert loading.load_causal_lm(str(path), "auto").model.dtype == torch.float32
    monkeypatch.setattr(precision, "FLOAT32_MODELS", ())
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    assert loading.load_causal_lm(str(path), "auto").model.dtype == torch.float32


def test_specs_and_the_cli_default_to_auto():
    from goodspeed.launch.cli import build_parser
    from goodspeed.launch.spec import DrafterSpec, VerifierSpec

    assert VerifierSpec(target="demo:target").dtype == "auto"
    assert DrafterSpec(name="edge", draft="demo:draft-small", prompts="code").dtype == "auto"
    parser = build_parser()
    assert parser.parse_args(["profile"]).dtype == "auto"
    assert parser.parse_args(["verifier", "--target", "demo:target"]).dtype == "auto"
    assert parser.parse_args(["drafter", "--verifier", "127.0.0.1:50051", "--draft", "suffix"]).dtype == "auto"
