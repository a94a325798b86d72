"""Random streams: one root seed per run, one independent stream per role by construction.

Lossless verification assumes the drafted tokens are independent of the verifier's uniforms
(docs/DESIGN.md, *Random streams*). Two generators seeded with the same integer are the SAME stream whatever
the tensor shapes (``torch.rand`` yields the same values), so the verifier's accept uniform would
be the very uniform that sampled the drafted token. No two components here are ever seeded from
the same integer: each stream's seed is derived from the run's root seed and a *domain* — the
role and the process's name, e.g. ``("drafter", "edge-3")`` or ``("verifier", "verify")`` —
through :class:`numpy.random.SeedSequence`, whose spawn keys are hashed into the seed (its
documented purpose: independent streams from one entropy source). Changing any word of the domain
gives an unrelated stream; the same root and domain give the same stream, so a run is
reproducible from its root alone.

No root given means fresh OS entropy (as vLLM does): :func:`resolve_root_seed` draws one, and the
daemons log it, so a run that showed something interesting can still be replayed with
``--seed N``.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


ROOT_SEED_BITS = 63  # fits a signed int64 everywhere it is logged, passed on a command line or stored


def resolve_root_seed(seed: int | None) -> int:
    """``seed`` itself (validated), or a fresh root from OS entropy when it is None."""
    if seed is None:
        return int(np.random.SeedSequence().entropy) % (1 << ROOT_SEED_BITS)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"a seed must be an integer >= 0, got {seed!r}")
    return int(seed)


def _spawn_key(domain: tuple[str, ...]) -> tuple[int, ...]:
    """The domain as four 32-bit words of a BLAKE2b hash (JSON-encoded, so ("a", "b") != ("a b",))."""
    if not domain or not all(isinstance(part, str) for part in domain):
        raise ValueError(f"a stream's domain is one or more strings, got {domain!r}")
    digest = hashlib.blake2b(json.dumps(list(domain)).encode(), digest_size=16, person=b"goodspeed-rng").digest()
    return tuple(int.from_bytes(digest[i : i + 4], "little") for i in range(0, 16, 4))


def stream_seed(root: int, *domain: str) -> int:
    """The 64-bit seed of the stream named ``domain`` under ``root``.

    >>> stream_seed(0, "drafter", "a") == stream_seed(0, "drafter", "a")
    True
    >>> stream_seed(0, "drafter", "a") == stream_seed(0, "verifier", "verify")
    False
    """
    sequence = np.random.SeedSequence(entropy=resolve_root_seed(root), spawn_key=_spawn_key(domain))
    return int(sequence.generate_state(1, np.uint64)[0])


def torch_generator(root: int, *domain: str, device: str | torch.device = "cpu") -> torch.Generator:
    """A torch generator on the stream ``domain`` of ``root`` (torch imported here, on first use:
    a node drafting by lookup alone draws no tensors and never loads it)."""
    import torch

    return torch.Generator(device=device).manual_seed(stream_seed(root, *domain))


def numpy_rng(root: int, *domain: str) -> np.random.Generator:
    """A numpy generator on the stream ``domain`` of ``root``."""
    return np.random.default_rng(stream_seed(root, *domain))
