"""``goodspeed verifier``: load the target, start the daemon, drain on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import signal
from goodspeed.launch.spec import VerifierSpec
from goodspeed.lm.loading import load_causal_lm
from goodspeed.scheduler import SmoothingConfig
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from goodspeed.verifier.observability import JsonLog, Metrics
from goodspeed.verifier.server import ServerConfig, make_server


def build_engine(opts: VerifierSpec) -> tuple[VerificationEngine, str]:
    target = load_causal_lm(opts.target, dtype=opts.dtype, device=opts.device)
    config = EngineConfig(
        budget=opts.budget, policy=opts.policy, smoothing=SmoothingConfig(eta=opts.eta, beta=opts.beta),
        max_drafters=opts.max_drafters, max_draft_len=opts.max_draft_len, seed=opts.seed,
    )
    return VerificationEngine(target.model, config, target.fingerprint), target.name


async def serve(opts: VerifierSpec, log: JsonLog | None = None) -> int:
    log = log or JsonLog()
    log.event("loading", target=opts.target, device=opts.device, dtype=opts.dtype)
    engine, name = build_engine(opts)
    metrics = Metrics()
    if opts.metrics_port is not None:
        metrics.serve(opts.metrics_port, addr=opts.host)
    server = make_server(engine, ServerConfig(
        host=opts.host, port=opts.port, round_deadline_ms=opts.round_deadline_ms,
        max_missed_rounds=opts.max_missed_rounds, idle_timeout_s=opts.idle_timeout_s, target_name=name), metrics=metrics, log=log)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.drain()
    await server.stop()
    return 0
