"""Precision names: what ``--dtype`` and a spec's ``dtype`` accept, and ``auto``'s choice.

``auto`` (the default of a spec's and the CLI's ``dtype``) is bfloat16 where the device computes it
natively (a CUDA device with bf16; a CPU whose flags say ``avx512_bf16``, ``amx_bf16`` or Arm's
``bf16``) and float32 elsewhere, and float32 for the embedded demo models (``demo:<name>``: at
about 1M parameters their forwards measured about 1.4x slower in bf16 on a CPU with AMX, the
casts outweighing the smaller weights; docs/MEASUREMENTS.md, *Lossless in bf16*). Names only
here (every settings check reads them; torch is imported where a device is resolved).
"""

from __future__ import annotations

from pathlib import Path

DTYPES = {  # accepted name -> the torch dtype's attribute name (torch.float32, ...)
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "float64": "float64",
}


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """This CPU's feature flags (``/proc/cpuinfo``'s ``flags`` on x86, ``Features`` on Arm); empty
    where it cannot tell."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    flags = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return flags


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes bfloat16 natively (``/proc/cpuinfo``'s flags: x86
    ``avx512_bf16`` / ``amx_bf16``, Arm ``bf16``); False where it cannot tell."""
    return bool(cpu_flags(cpuinfo) & {"avx512_bf16", "amx_bf16", "bf16"})


FLOAT32_MODELS = ("demo:",)  # model names (prefixes) that ``auto`` keeps in float32: too small for bf16 to pay


def resolve_dtype(name: str, device: str = "cpu", model: str | None = None) -> str:
    """``auto``: ``float32`` for a ``model`` named in :data:`FLOAT32_MODELS`, else ``bfloat16`` where
    ``device`` computes it natively (a CUDA device with bf16, a CPU with native bf16:
    :func:`cpu_has_native_bf16`), else ``float32``; any other name as it is."""
    if name != "auto":
        return name
    if model is not None and model.startswith(FLOAT32_MODELS):
        return "float32"
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
    return "bfloat16" if dev.type == "cpu" and cpu_has_native_bf16() else "float32"
