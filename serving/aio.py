"""asyncio pieces the servers here rely on where a request's cleanup must not be lost.

- :func:`within`: a timed wait that a cancellation always wins. ``asyncio.wait_for`` before
  Python 3.12 returns the awaited result instead of raising when its caller is cancelled in the
  same loop iteration as that result arrives (CPython gh-86296): the caller goes on as if never
  cancelled. An edge node waiting for a verdict so lost the cancellation of a request whose
  client had gone away, and drafted it on to its ``max_tokens`` for no one, its KV slot held on
  the verifier. Nothing in the package calls ``asyncio.wait_for`` (a test checks).
- :func:`run_to_the_end`: a cleanup (telling the verifier, freeing KV) that a second
  cancellation of its caller does not stop; :func:`keep_until_done` for one nobody awaits,
  which a backend's ``stop`` still waits for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(awaitable: Awaitable[T], timeout_s: float) -> T:
    """``awaitable``'s result, or ``asyncio.TimeoutError`` after ``timeout_s`` seconds (it is then
    cancelled, and waited for). A cancellation of the caller always raises here, also when the
    result arrived in the same loop iteration: that result is dropped (the awaitable runs as a
    task of its own, which is cancelled)."""
    inner = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait((inner,), timeout=timeout_s)
    except BaseException:  # the caller was cancelled: so is the awaitable, whatever it had
        inner.cancel()
        inner.add_done_callback(_retrieve)
        raise
    if not done:
        inner.cancel()
        await asyncio.wait((inner,))  # its own cleanup runs first, as wait_for's does
        if inner.cancelled():
            raise asyncio.TimeoutError(f"not done within {timeout_s:g} s")
    return inner.result()  # what it returned or raised (also if it finished as the time ran out)


def _retrieve(task: asyncio.Task) -> None:
    """Mark a dropped task's outcome as seen (asyncio otherwise logs an exception it raised)."""
    if not task.cancelled():
        task.exception()


def keep_until_done(coro, keep: set[asyncio.Task]) -> asyncio.Task:
    """Run ``coro`` as a task that ``keep`` holds until it is done (the event loop keeps only a
    weak reference to a task), for a backend's ``stop`` to wait on."""
    task = asyncio.get_running_loop().create_task(coro)
    keep.add(task)
    task.add_done_callback(keep.discard)
    return task


async def run_to_the_end(coro, keep: set[asyncio.Task]) -> None:
    """Await ``coro`` as a task of its own (:func:`keep_until_done`), which a cancellation of the
    caller does not stop.

    For a backend's cleanup of a request (telling the verifier, freeing KV): it must finish even
    when the stream being closed is cancelled again meanwhile, as happens to a handler whose client
    went away while its choices' streams are closed."""
    await asyncio.shield(keep_until_done(coro, keep))
