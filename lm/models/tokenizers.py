"""Where a model spec lives (:func:`resolve_model_path`) and its tokenizer without its weights
(:func:`load_tokenizer`), for what needs text and no model: an edge node drafting by lookup alone,
the chat prompts of a launch. No torch import: transformers' ``AutoTokenizer`` reads the model's
configuration code, which imports torch (220 MB of a process's memory), so the tokenizer class is
taken from the directory's ``tokenizer_config.json`` by name, the class ``AutoTokenizer`` picks
for that name.
"""

from __future__ import annotations

import json
from pathlib import Path

from goodspeed.lm.models.fingerprint import tokenizer_fingerprint
from goodspeed.lm.runtime.heap import trim_heap
from goodspeed.lm.models.model_dirs import ModelLoadError


def resolve_model_path(spec: str) -> str:
    """``demo:<name>`` / ``real:<name>`` -> the built model's directory; anything else is passed through."""
    if spec.startswith("demo:"):
        from goodspeed.lm.models.model_dirs import demo_model_path

        return str(demo_model_path(spec.removeprefix("demo:")))
    if spec.startswith("real:"):
        from goodspeed.lm.models.real import real_model_path

        return str(real_model_path(spec.removeprefix("real:")))
    return spec


def load_tokenizer(spec: str) -> tuple[object, str]:
    """The tokenizer of ``spec`` (hub id, directory, ``demo:<name>``, ``real:<name>``) and its
    fingerprint. A directory whose ``tokenizer_config.json`` names its class loads through that
    class; a hub id, or a directory that names none, through ``AutoTokenizer`` (which imports
    torch)."""
    import transformers

    path = resolve_model_path(spec)
    try:
        cls = named_class(Path(path))
        tokenizer = (cls or transformers.AutoTokenizer).from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {spec!r}: {exc}") from exc
    fingerprint = tokenizer_fingerprint(tokenizer)
    trim_heap()  # what loading freed (tens of MB): goodspeed.lm.runtime.heap
    return tokenizer, fingerprint


def named_class(path: Path):
    """The tokenizer class ``path/tokenizer_config.json`` names, if transformers has it; else None."""
    import transformers

    try:
        name = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        return None
    if not (isinstance(name, str) and name.isidentifier()):
        return None
    try:
        return getattr(transformers, name, None)
    except ImportError:  # a class whose backend is missing: AutoTokenizer says which
        return None
