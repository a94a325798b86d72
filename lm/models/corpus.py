"""The demo corpus: the Python standard library's own source, present on every machine.

Files are read in sorted order (``test/`` and other test folders skipped: Debian's Python omits
them), every 20th file is held out for evaluation, and the digest of the text decides whether
cached demo models were built from this same corpus.
"""

from __future__ import annotations

import hashlib
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
HELDOUT_EVERY = 20


@dataclass(frozen=True)
class Corpus:
    train_text: str
    heldout_text: str
    digest: str
    num_files: int


def stdlib_files(root: Path | None = None) -> list[Path]:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not SKIP_DIRS.intersection(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def load_corpus(max_bytes: int = 8_000_000, root: Path | None = None) -> Corpus:
    """Read stdlib sources until ``max_bytes`` characters; raise if the stdlib is not there."""
    files = stdlib_files(root)
    if not files:
        raise FileNotFoundError("no Python standard library sources found to build the demo corpus from")
    texts, size = [], 0
    for path in files:
        texts.append(path.read_text(encoding="utf-8", errors="replace"))
        size += len(texts[-1])
        if size >= max_bytes:
            break
    # Every 20th file is held out; a corpus of fewer files still holds out its last one.
    held = {i for i in range(len(texts)) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1} or {len(texts) - 1}
    train = [t for i, t in enumerate(texts) if i not in held or len(texts) == 1]
    heldout = [texts[i] for i in sorted(held)]
    used = len(texts)
    train_text, heldout_text = "\n".join(train), "\n".join(heldout)
    digest = hashlib.sha256((train_text + "\0" + heldout_text).encode("utf-8")).hexdigest()
    return Corpus(train_text, heldout_text, digest, used)


def encode(tokenizer, text: str) -> np.ndarray:
    """``text`` as token ids (int64), encoded in 200,000-character chunks (no special tokens added)
    so a corpus of megabytes never goes through the tokenizer in one call."""
    chunks = [text[i : i + 200_000] for i in range(0, len(text), 200_000)]
    return np.concatenate([np.asarray(tokenizer(c, add_special_tokens=False)["input_ids"], dtype=np.int64) for c in chunks])


def prompt_snippets(text: str, count: int, length: int, seed: int = 0) -> list[str]:
    """``count`` snippets of ``length`` characters starting at line beginnings (deterministic)."""
    starts = [i + 1 for i, ch in enumerate(text[: len(text) - length]) if ch == "\n"]
    rng = random.Random(seed)
    return [text[s : s + length] for s in sorted(rng.sample(starts, min(count, len(starts))))]
