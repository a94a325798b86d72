"""Load any causal LM and its tokenizer through transformers, by hub id, local path or ``demo:<name>``.

Real deployments name hub ids (``Qwen/Qwen3-14B``) or directories; the embedded demo models are
named ``demo:<name>`` and resolve to the project's cache (``goodspeed models build-demo``).
AWQ-quantized checkpoints load through transformers' quantization config and need the optional
``awq`` extra; when its package is missing the error says which one and how to install it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from goodspeed.lm.fingerprint import tokenizer_fingerprint

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float64": torch.float64,
}
AWQ_BACKENDS = ("gptqmodel", "awq")  # transformers 5 routes AWQ through gptqmodel; 4.x through autoawq


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message says why and what to do."""


@dataclass
class LoadedModel:
    name: str  # what the user asked for
    path: str  # hub id or resolved directory
    model: torch.nn.Module
    tokenizer: object
    fingerprint: str

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def resolve_model_path(spec: str) -> str:
    """``demo:<name>`` -> the built demo model's directory; anything else is passed through."""
    if spec.startswith("demo:"):
        from goodspeed.lm.demo import demo_model_path

        return str(demo_model_path(spec.removeprefix("demo:")))
    return spec


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ModelLoadError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}") from None


def check_device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} asked for, but this torch build sees no CUDA device")
    return dev


def _check_quantization(config) -> None:
    quant = getattr(config, "quantization_config", None)
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    if str(method).lower().endswith("awq") and not any(importlib.util.find_spec(m) for m in AWQ_BACKENDS):
        raise ModelLoadError(
            "this checkpoint is AWQ-quantized and needs an AWQ backend (gptqmodel, which needs CUDA torch): "
            "pip install 'goodspeed[awq]'"
        )


def load_causal_lm(spec: str, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
    """Load ``spec`` (hub id, directory or ``demo:<name>``) in inference mode on ``device``."""
    dev, torch_type = check_device(device), torch_dtype(dtype)
    path = resolve_model_path(spec)
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load model {spec!r}: {exc}") from exc
    _check_quantization(config)
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(path, **{dtype_kw: torch_type}).to(dev).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return LoadedModel(spec, path, model, tokenizer, tokenizer_fingerprint(tokenizer))
