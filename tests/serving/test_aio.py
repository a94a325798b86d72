"""``within``: a timed wait that a cancellation of its caller always wins (asyncio.wait_for before
Python 3.12 returns a result that arrives in the cancellation's loop iteration instead)."""

import ast
import asyncio
import sys
from pathlib import Path

import pytest

from goodspeed.serving.aio import run_to_the_end, within

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("api", "drafter", "launch", "lm", "scheduler", "verifier")


async def cancelled_as_the_item_arrives(wait) -> str:
    """A task waiting on a queue through ``wait`` is cancelled in the loop iteration its item
    arrives in: what the task ends with."""
    queue: asyncio.Queue = asyncio.Queue()
    task = asyncio.ensure_future(wait(queue.get(), 10.0))
    for _ in range(3):  # the task is waiting
        await asyncio.sleep(0)
    queue.put_nowait("verdict")
    task.cancel()
    try:
        return f"returned {await task}"
    except asyncio.CancelledError:
        return "cancelled"


def test_a_cancellation_as_the_result_arrives_is_not_lost():
    assert asyncio.run(cancelled_as_the_item_arrives(within)) == "cancelled"


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="fixed in Python 3.12 (CPython gh-86296)")
def test_the_python_3_11_race_that_within_avoids():
    """The negative control: asyncio.wait_for loses that cancellation here."""
    assert asyncio.run(cancelled_as_the_item_arrives(asyncio.wait_for)) == "returned verdict"


def test_within_returns_the_result_or_raises_what_the_awaitable_raised():
    async def value():
        await asyncio.sleep(0)
        return 7

    async def fails():
        await asyncio.sleep(0)
        raise KeyError("x")

    assert asyncio.run(within(value(), 5.0)) == 7
    with pytest.raises(KeyError):
        asyncio.run(within(fails(), 5.0))


def test_on_timeout_the_awaitable_is_cancelled_and_its_cleanup_has_run():
    events = []

    async def forever():
        try:
            await asyncio.Event().wait()
        finally:
            events.append("cleaned up")

    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await within(forever(), 0.01)
        events.append("timed out")

    asyncio.run(main())
    assert events == ["cleaned up", "timed out"]


def test_a_cancelled_caller_cancels_the_awaitable():
    async def main():
        started, stopped = asyncio.Event(), asyncio.Event()

        async def forever():
            started.set()
            try:
                await asyncio.Event().wait()
            finally:
                stopped.set()

        caller = asyncio.ensure_future(within(forever(), 10.0))
        await started.wait()
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        await asyncio.wait_for(stopped.wait(), 5.0)  # bounded: the awaitable's task ends too
        return stopped.is_set()

    assert asyncio.run(main())


def test_run_to_the_end_finishes_a_cleanup_its_caller_stops_waiting_for():
    async def main():
        keep, done = set(), []

        async def cleanup():
            for _ in range(5):
                await asyncio.sleep(0)
            done.append(True)

        caller = asyncio.ensure_future(run_to_the_end(cleanup(), keep))
        await asyncio.sleep(0)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        await asyncio.gather(*keep)  # what a backend's stop() waits on
        return done, keep

    assert asyncio.run(main()) == ([True], set())


def test_nothing_in_the_package_calls_asyncio_wait_for():
    """Its cancellation race (above) lost requests' cancellations: waits go through ``within``."""
    calls = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if (isinstance(node, ast.Attribute) and node.attr == "wait_for" and isinstance(node.value, ast.Name)
                        and node.value.id == "asyncio"):
                    calls.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert calls == []
