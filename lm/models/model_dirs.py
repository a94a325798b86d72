"""Built model directories: where the cache lives (``$GOODSPEED_CACHE``, else the XDG cache), their
manifests, writing one atomically, and the error a model that cannot be loaded raises. The demo
models (:mod:`goodspeed.lm.models.demo`), the real ones (:mod:`goodspeed.lm.models.real`), the distilled drafts
(:mod:`goodspeed.lm.models.distill`) and the loader (:mod:`goodspeed.lm.models.loading`) all build on it; it
imports none of them."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message says why and what to do."""


def cache_root() -> Path:
    if os.environ.get("GOODSPEED_CACHE"):
        return Path(os.environ["GOODSPEED_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "goodspeed"


def read_manifest(directory: Path) -> dict | None:
    """The ``manifest.json`` of a built model directory; None before it is built."""
    path = directory / "manifest.json"
    return json.loads(path.read_text()) if path.exists() else None


def save_model_dir(model, tokenizer, out: Path, extra=None) -> None:
    """``save_pretrained`` model and tokenizer into ``out`` atomically: written to ``out.partial``
    and renamed, so an interrupted save never leaves a half-written model where one is looked for.
    ``extra(staging)``, when given, writes more files into the folder before the rename."""
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if extra is not None:
            extra(staging)  # more files to land with the model (a draft's pruned head)
        shutil.rmtree(out, ignore_errors=True)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


class DemoNotBuiltError(ModelLoadError):
    """A ``demo:`` model was asked for before ``goodspeed models build-demo``."""


def demo_dir() -> Path:
    return cache_root() / "demo"


def demo_model_path(name: str) -> Path:
    """The directory of ``demo:<name>`` (here, not in :mod:`goodspeed.lm.models.demo`, which
    imports the trainer and torch: an edge node drafting by lookup resolves its tokenizer with this)."""
    manifest = read_manifest(demo_dir())
    names = [m["name"] for m in manifest["models"]] if manifest else []
    if name not in names:
        hint = f"known: {', '.join(names)}" if names else "run `goodspeed models build-demo` first"
        raise DemoNotBuiltError(f"no demo model {name!r} ({hint})")
    return demo_dir() / name
