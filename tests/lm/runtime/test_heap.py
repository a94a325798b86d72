"""heap.trim_heap: freed heap memory handed back to the operating system (glibc)."""

import ctypes
import ctypes.util
from pathlib import Path

import pytest

from goodspeed.lm.runtime.heap import trim_heap


def _rss_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").exists() or ctypes.util.find_library("c") is None, reason="needs Linux")
def test_memory_freed_in_small_blocks_goes_back_to_the_system_once_trimmed():
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "malloc_trim"):
        pytest.skip("not glibc")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(1024) for _ in range(64 * 1024)]  # 64 MB in blocks glibc keeps in its heap
    for block in blocks:
        ctypes.memset(block, 1, 1024)
    kept = blocks[::64]  # one block live in every 64 KB: free alone cannot shrink the heap past them
    for i, block in enumerate(blocks):
        if i % 64:
            libc.free(block)
    before = _rss_kb()
    assert trim_heap()
    after = _rss_kb()
    for block in kept:
        libc.free(block)
    assert before - after > 32 * 1024, (before, after)  # most of the 64 MB was handed back
