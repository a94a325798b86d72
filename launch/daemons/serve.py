"""``goodspeed verifier``: load the target, start the daemon, drain on SIGTERM/SIGINT.

The engine, server and local-serving configs are composed from a :class:`VerifierSpec`: each
setting lands where its declaration says (:meth:`VerifierSpec.routed`); this module handles only
the settings that become something else (the models to load, the smoothing config from the
policy, ``eta`` and ``beta``, the metrics endpoint, the latency profile, ``prefill_chunk = 0``
meaning whole prompts, the daemon's default port)."""

from __future__ import annotations

import asyncio
import json
import signal
from dataclasses import replace
from pathlib import Path

import torch

from goodspeed.api.server import OpenAIServer, check_parsers
from goodspeed.launch.daemons.heap import freeze_startup_heap
from goodspeed.launch.spec import SpecError, VerifierSpec
from goodspeed.lm.runtime.attention import varlen_missing
from goodspeed.lm.decoding.draft_source import DraftSpec
from goodspeed.lm.models.loading import LoadedModel, load_causal_lm, torch_dtype
from goodspeed.lm.models.precision import resolve_dtype
from goodspeed.scheduler import smoothing_of
from goodspeed.verifier.auth import TokenAuth
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from goodspeed.verifier.http_front import LocalServingBackend
from goodspeed.verifier.clocks import LatencyProfile
from goodspeed.verifier.local import LocalConfig, LocalServing
from goodspeed.verifier.observability import JsonLog, Metrics
from goodspeed.verifier.daemon import make_server
from goodspeed.verifier.server import ServerConfig, check_port, check_transit
from goodspeed.verifier.tls import server_credentials


def engine_config(opts: VerifierSpec) -> EngineConfig:
    """The engine's settings of a spec; bad ones fail here, before any model loads (``attention
    = "varlen"`` too, where the device, dtype or torch build cannot give it, and ``cuda_graphs``
    off CUDA)."""
    try:
        config = EngineConfig(**opts.routed("engine"), smoothing=smoothing_of(opts.policy, opts.eta, opts.beta),
                              prefill_chunk=opts.prefill_chunk or None)
    except ValueError as exc:
        raise SpecError(f"verifier: {exc}") from None
    if config.attention == "varlen" and (need := varlen_missing(opts.device, torch_dtype(opts.dtype, opts.device, opts.target))):
        raise SpecError(f"verifier: attention 'varlen' (flash's varlen kernel) needs {need}; device {opts.device}, "
                        f"dtype {opts.dtype}: use 'auto' or 'masked'")
    if config.cuda_graphs and torch.device(opts.device).type != "cuda":
        raise SpecError(f"verifier: --cuda-graphs needs a CUDA device, not {opts.device}")
    return config


def build_engine(opts: VerifierSpec) -> tuple[VerificationEngine, LoadedModel]:
    config = engine_config(opts)
    target = load_causal_lm(opts.target, dtype=opts.dtype, device=opts.device)
    return VerificationEngine(target.model, config, target.fingerprint), target


def local_config(opts: VerifierSpec) -> LocalConfig:
    """The local-serving settings of a spec (the latency profile is read here)."""
    latency = None
    if opts.latency_profile is not None:
        path = Path(opts.latency_profile)
        try:
            latency = LatencyProfile.from_dict(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            raise SpecError(f"cannot read the latency profile {path}: {exc}") from None
        except ValueError as exc:
            raise SpecError(f"{path}: {exc}") from None
    try:
        return LocalConfig(**opts.routed("local"), latency=latency)
    except ValueError as exc:
        raise SpecError(f"local serving: {exc}") from None


def local_draft_source(opts: VerifierSpec) -> DraftSpec:
    """``--local-draft`` parsed (:mod:`goodspeed.lm.decoding.draft_source`); a bad name fails here."""
    try:
        return DraftSpec.parse(opts.local_draft)
    except ValueError as exc:
        raise SpecError(f"--local-draft: {exc}") from None


def build_local(opts: VerifierSpec, engine: VerificationEngine, target: LoadedModel, log: JsonLog | None = None) -> LocalServing:
    """The verifier's own draft source for Generate requests: a draft model sharing the target's
    tokenizer, a lookup, or both."""
    config = local_config(opts)  # bad settings fail before the draft model loads
    source = local_draft_source(opts)
    model = None
    if source.model is not None:
        draft = load_causal_lm(source.model, dtype=opts.dtype, device=opts.device)
        if draft.fingerprint != target.fingerprint:
            raise SpecError(f"--local-draft {source.model!r} does not share the target's tokenizer "
                            f"({draft.fingerprint[:12]} != {target.fingerprint[:12]})")
        model = draft.model
    if source.lookup is not None:  # a model alone is built by LocalServing, with the engine's graph settings
        model = source.build(model, engine.vocab_size, cuda_graphs=engine.config.cuda_graphs,
                             torch_compile=engine.config.torch_compile)
    try:
        local = LocalServing(engine, model, config, log=None if log is None else (lambda message: log.event("adapt", message=message)))
    except ValueError as exc:
        raise SpecError(f"local serving: {exc}") from None
    local.retain_finished = False  # a daemon streams results; it must not keep every request
    return local


def server_config(opts: VerifierSpec, target_name: str = "") -> ServerConfig:
    """The daemon's settings of a spec; bad ones (plaintext on a reachable host, half a TLS pair,
    an unreadable token file) fail here, before any model loads."""
    try:
        config = ServerConfig(**opts.routed("server"), port=50051 if opts.port is None else opts.port, target_name=target_name)
        check_parsers(config.tool_call_parser, config.reasoning_parser)
        server_credentials(config)  # the PEM files are readable
        check_transit(config.rounds, opts.transit_tokens, opts.transit_alone)
        check_port("metrics_port", opts.metrics_port)
    except ValueError as exc:
        raise SpecError(str(exc)) from None
    if opts.http_port is not None and opts.local_draft is None:
        raise SpecError("--http-port serves local requests: give --local-draft MODEL too")
    if config.auth_tokens:
        TokenAuth.from_file(config.auth_tokens)
    return config


def make_http_front(service, config: ServerConfig, tokenizer) -> OpenAIServer:
    """The verifier's OpenAI-compatible front (``--http-port``): the API over local serving."""
    backend = LocalServingBackend(service, config.target_name or "target", tokenizer)
    return OpenAIServer(backend, service.metrics.registry, authorize=backend.authorize, tool_parser=config.tool_call_parser,
                        reasoning_parser=config.reasoning_parser)


async def serve(opts: VerifierSpec, log: JsonLog | None = None) -> int:
    log = log or JsonLog()
    config = server_config(opts)
    engine_config(opts)
    if opts.local_draft is not None:
        local_config(opts)
        local_draft_source(opts)
    log.event("loading", target=opts.target, device=opts.device, dtype=resolve_dtype(opts.dtype, opts.device, opts.target))
    engine, target = build_engine(opts)
    log.event("attention", path=engine.attention)
    smoothing = engine.config.smoothing
    log.event("scheduling", policy=opts.policy, budget=opts.budget, eta=smoothing.eta, beta=smoothing.beta)
    local = None
    if opts.local_draft is not None:
        log.event("loading", local_draft=opts.local_draft, local_policy=opts.local_policy)
        local = build_local(opts, engine, target, log)
    metrics = Metrics()
    if opts.metrics_port is not None:
        metrics.serve(opts.metrics_port, addr=opts.metrics_host)  # loopback unless told otherwise
    server = make_server(engine, replace(config, target_name=target.name), metrics=metrics, log=log,
                         local=local, tokenizer=target.tokenizer, http_front=make_http_front)
    await server.start()
    log.event("heap_frozen", **freeze_startup_heap())  # full collections no longer walk the models and servers
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stopped, failed = asyncio.create_task(stop.wait()), asyncio.create_task(server.failed.wait())
    await asyncio.wait([stopped, failed], return_when=asyncio.FIRST_COMPLETED)
    for task in (stopped, failed):
        task.cancel()
    if server.failed.is_set():  # the round loop died (logged): exit non-zero so a supervisor restarts us
        await server.stop()
        return 1
    await server.drain()
    await server.stop()
    return 0
