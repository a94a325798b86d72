"""Tokenizer fingerprints: draft and target must share one tokenizer, or verification is meaningless.

The fingerprint is a SHA-256 over the vocabulary (token -> id) and the special tokens, so two
tokenizers with the same vocabulary but different special tokens (or ids) are told apart, while
a fast and a slow tokenizer of the same vocabulary agree.
"""

from __future__ import annotations

import hashlib
import json


def tokenizer_fingerprint(tokenizer) -> str:
    """64 hex digits identifying the tokenizer's vocabulary and special tokens."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = sorted((str(tok), int(tokenizer.convert_tokens_to_ids(tok))) for tok in tokenizer.all_special_tokens)
    payload = json.dumps({"vocab": vocab, "special": special}, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()
