"""The committed-prefix hash both sides compute to detect a drafter whose text drifted.

16 hex digits of BLAKE2b-64 over the committed token ids as little-endian int64, fed
incrementally (appending tokens updates the hash in O(new tokens)).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np


def new_prefix_hasher():
    return hashlib.blake2b(digest_size=8)


def update_prefix_hasher(hasher, token_ids: Sequence[int]) -> None:
    hasher.update(np.asarray(token_ids, dtype="<i8").tobytes())


def prefix_hash(token_ids: Sequence[int]) -> str:
    hasher = new_prefix_hasher()
    update_prefix_hasher(hasher, token_ids)
    return hasher.hexdigest()
