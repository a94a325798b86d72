"""Freezing a serving process's startup heap (``gc.freeze``).

Everything a daemon builds before it serves (the models and their modules, the tokenizer, the
compiled grammars' vocabulary, the KV pool's bookkeeping, the servers) lives as long as the
process, yet each of Python's full cyclic collections walks all of it: on the real pair's verifier
some 406,000 objects and 182 ms a collection, in the thread that runs the event loop and holding
the GIL the engine's thread needs (docs/MEASUREMENTS.md, *A full collection's pause*). Moved to
the permanent generation once the daemon serves, they are no longer walked; reference counting
still frees any of them dropped later, and only a reference cycle among them would stay
uncollected (bounded by the startup heap). vLLM and SGLang freeze their serving processes' heaps
after start-up for the same reason.
"""

from __future__ import annotations

import gc
import time


def freeze_startup_heap() -> dict:
    """Collect what start-up left unreachable, then freeze everything still alive; returns the
    frozen objects' count and the seconds it took (logged as the daemon's ``heap_frozen`` event)."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    return {"objects": gc.get_freeze_count(), "seconds": round(time.perf_counter() - started, 3)}
