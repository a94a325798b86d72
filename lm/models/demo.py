"""The embedded demo: a BPE tokenizer, one target and three drafts of clearly different quality.

All are Llama-architecture transformers checkpoints written with ``save_pretrained`` and trained
by the project from the Python standard library source (:mod:`goodspeed.lm.models.corpus`) with fixed
seeds and step counts. They live in the user's cache (``$GOODSPEED_CACHE``, else
``$XDG_CACHE_HOME/goodspeed``, else ``~/.cache/goodspeed``) and are rebuilt when missing, when
built from a different corpus, or when the recipes change (the manifest records digests of both). Anywhere a model is taken,
``demo:<name>`` names one of them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from goodspeed.lm.models.corpus import encode, load_corpus
from goodspeed.lm.models.model_dirs import DemoNotBuiltError, demo_dir, demo_model_path, read_manifest  # noqa: F401 (re-exported)
from goodspeed.lm.models.train import ModelRecipe, acceptance_against, heldout_cross_entropy, train_model

VOCAB_SIZE = 2048
EOS = "<|endoftext|>"
RECIPES = (
    ModelRecipe("target", "target", layers=4, hidden=128, steps=600, seed=1),
    ModelRecipe("draft-tiny", "draft", layers=1, hidden=64, steps=300, seed=2),
    ModelRecipe("draft-small", "draft", layers=2, hidden=96, steps=400, seed=3),
    ModelRecipe("draft-distilled", "draft", layers=2, hidden=128, steps=400, seed=4, distill=True),
)


# The demo models read and write Python, so a chat turns into comment lines: the role as a comment,
# then the message. Chat clients (``/v1/chat/completions``, ``generate --chat``) render it.
CHAT_TEMPLATE = (
    "{% for message in messages %}# {{ message['role'] }}:\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}# assistant:\n{% endif %}"
)


def recipes_digest(recipes: tuple[ModelRecipe, ...]) -> str:
    """Changes whenever any recipe (architecture, steps, seed, ...) or the chat template changes."""
    return hashlib.sha256(repr(([dataclasses.astuple(r) for r in recipes], CHAT_TEMPLATE)).encode()).hexdigest()


def _is_current(manifest: dict | None, digest: str, recipes: tuple[ModelRecipe, ...]) -> bool:
    return (
        manifest is not None
        and manifest.get("corpus_digest") == digest
        and manifest.get("recipes_digest") == recipes_digest(recipes)
        and all((demo_dir() / m["name"] / "config.json").exists() for m in manifest["models"])
    )


def train_tokenizer(text: str, vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Byte-level BPE with ``VOCAB_SIZE`` tokens; ``<|endoftext|>`` is BOS and EOS."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    chunks = (text[i : i + 100_000] for i in range(0, len(text), 100_000))
    tok.train_from_iterator(chunks, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, chat_template=CHAT_TEMPLATE)


def build_demo(
    force: bool = False, progress: bool = True, log=print, recipes: tuple[ModelRecipe, ...] = RECIPES, max_corpus_bytes: int = 8_000_000
) -> dict:
    """Build (or reuse) the demo models; returns the manifest. ``recipes`` and
    ``max_corpus_bytes`` exist for tests, which build toy-sized demos."""
    corpus = load_corpus(max_corpus_bytes)
    manifest = read_manifest(demo_dir())
    if not force and _is_current(manifest, corpus.digest, recipes):
        log(f"demo models are up to date in {demo_dir()}")
        return manifest
    started = time.perf_counter()
    staging = demo_dir().with_name("demo.building")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    log(f"building demo models from {corpus.num_files} stdlib files ({len(corpus.train_text) / 1e6:.1f} MB) into {demo_dir()}")
    tokenizer = train_tokenizer(corpus.train_text)
    train_ids, heldout_ids = encode(tokenizer, corpus.train_text), encode(tokenizer, corpus.heldout_text)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    entries, target = [], None
    for recipe in recipes:
        teacher = target if recipe.distill else None
        model = train_model(recipe, train_ids, VOCAB_SIZE, eos_id, teacher=teacher, progress=progress)
        target = model if recipe.role == "target" else target
        entries.append(_save(recipe, model, tokenizer, staging, heldout_ids, target))
    manifest = {
        "recipes_digest": recipes_digest(recipes),
        "corpus_digest": corpus.digest,
        "train_tokens": int(train_ids.size),
        "build_seconds": round(time.perf_counter() - started, 1),
        "models": entries,
    }
    (staging / "manifest.json").write_text(json.dumps(manifest, indent=2))
    shutil.rmtree(demo_dir(), ignore_errors=True)
    staging.rename(demo_dir())
    log(f"built {len(entries)} demo models in {manifest['build_seconds']} s")
    return manifest


def _save(recipe: ModelRecipe, model, tokenizer, root: Path, heldout_ids: np.ndarray, target) -> dict:
    path = root / recipe.name
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    entry = {
        "name": recipe.name,
        "role": recipe.role,
        "params": int(sum(p.numel() for p in model.parameters())),
        "layers": recipe.layers,
        "hidden": recipe.hidden,
        "heldout_ce": round(heldout_cross_entropy(model, heldout_ids), 4),
    }
    if recipe.role == "draft":
        sampled, greedy = acceptance_against(target, model, heldout_ids)
        entry.update(acceptance=round(sampled, 4), greedy_acceptance=round(greedy, 4))
    return entry


def list_models() -> list[dict]:
    """One dict per built model with at least ``name``, ``path``, ``params``, ``role``."""
    manifest = read_manifest(demo_dir())
    if manifest is None:
        return []
    return [{**m, "path": str(demo_dir() / m["name"])} for m in manifest["models"]]

