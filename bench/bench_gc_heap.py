"""What one full cyclic collection costs a serving verifier, with its start-up heap frozen and not.

    python -m bench.bench_gc_heap [--json PATH] -- VERIFIER_FLAGS...   (those of ``goodspeed verifier``;
                                                                       --http-port is required)

Starts the verifier daemon in this process (``goodspeed.launch.daemons.serve.serve``, as ``goodspeed
verifier`` does), waits for its HTTP front, then times full collections (``gc.collect()``, the
median of 5) over its heap as it would be unfrozen (``gc.unfreeze()``) and frozen again
(``gc.freeze()``, what the daemon does once serving: ``goodspeed.launch.daemons.heap``), with the
objects the collector tracks in each case.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import signal
import statistics
import sys
import time
import urllib.request
from pathlib import Path


def full_collection_ms(repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        gc.collect()
        times.append(1000 * (time.perf_counter() - started))
    return round(statistics.median(times), 2)


async def measure(flags: list[str]) -> dict:
    from goodspeed.launch.cli import verifier_settings
    from goodspeed.launch.daemons.serve import serve

    spec = verifier_settings(flags)
    if spec.http_port is None:
        raise SystemExit("give the verifier an --http-port: the measurement starts once it answers there")
    daemon = asyncio.create_task(serve(spec))
    while True:  # the health check from a thread: this loop is the daemon's
        try:
            await asyncio.to_thread(urllib.request.urlopen, f"http://127.0.0.1:{spec.http_port}/health", timeout=2)
            break
        except OSError:
            if daemon.done():
                daemon.result()  # raises what stopped it
            await asyncio.sleep(0.5)
    await asyncio.sleep(1.0)  # the daemon freezes its heap right after it starts serving
    gc.unfreeze()
    unfrozen = {"tracked_objects": len(gc.get_objects()), "full_collection_ms": full_collection_ms()}
    gc.freeze()
    frozen = {"frozen_objects": gc.get_freeze_count(), "tracked_objects": len(gc.get_objects()),
              "full_collection_ms": full_collection_ms()}
    os.kill(os.getpid(), signal.SIGTERM)  # the daemon's own way to stop: it drains and stops its servers
    await daemon
    return {"flags": flags, "unfrozen": unfrozen, "frozen": frozen}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, flags = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(ours)
    result = {"command": " ".join(["python -m bench.bench_gc_heap", *argv]), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "python": sys.version.split()[0], **asyncio.run(measure(flags))}
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
