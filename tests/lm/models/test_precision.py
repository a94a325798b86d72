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
