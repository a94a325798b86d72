"""Handing freed heap memory back to the operating system after a large transient allocation.

Building a tokenizer allocates far more than it keeps: transformers' fast tokenizer parses
``tokenizer.json`` into several intermediate structures, and llguidance's view of it serialises a
copy of the whole Rust tokenizer to JSON and parses that again. glibc's allocator keeps what was
freed in its arenas, so a process's resident memory stays at the peak (on SmolLM2's tokenizer, 29
MB after loading it and 20 MB after llguidance's, docs/MEASUREMENTS.md *Memory of a node with no
draft model*). :func:`trim_heap` asks glibc to return it (``malloc_trim(0)``); elsewhere (musl,
macOS, Windows) it does nothing. No torch import: an edge node drafting by lookup calls it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return getattr(libc, "malloc_trim", None) if libc is not None else None
    except OSError:
        return None


def trim_heap() -> bool:
    """Return freed heap memory to the operating system where the C library can (glibc);
    whether it could."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
