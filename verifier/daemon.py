"""The verifier daemon's server: the gRPC service (:mod:`goodspeed.verifier.server`) and the round
loop (:mod:`goodspeed.verifier.round_loop`) started together on one event loop, with health
checks, TLS, an optional HTTP front, and the drain a SIGTERM asks for (new sessions and requests
refused, rounds going on until the requests in progress finish or the drain timeout passes)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from goodspeed.proto.goodspeed.v1 import goodspeed_pb2_grpc as pb_grpc
from goodspeed.verifier import errors
from goodspeed.verifier.auth import TokenAuth
from goodspeed.verifier.engine import VerificationEngine
from goodspeed.verifier.local import LocalServing
from goodspeed.verifier.observability import JsonLog, Metrics
from goodspeed.verifier.server import SERVICE_NAME, ServerConfig, VerifierService, check_transit
from goodspeed.verifier.tls import ReloadingServerContext, is_loopback, server_credentials

RELOAD_CHECK_S = 2.0  # how often the HTTPS front's certificate files are checked for a renewal


class HttpFront(Protocol):
    """What :class:`VerifierServer` serves on its HTTP port."""

    async def start(self, host: str, port: int, ssl_context=None) -> int: ...

    async def stop(self) -> None: ...


class VerifierServer:
    """An unstarted server: ``port = await start()``, then ``await drain()`` / ``await stop()``."""

    def __init__(self, engine: VerificationEngine, config: ServerConfig = ServerConfig(), metrics: Metrics | None = None,
                 log: JsonLog | None = None, local: LocalServing | None = None, tokenizer=None,
                 http_front: Callable[[VerifierService, ServerConfig, object], HttpFront] | None = None) -> None:
        """``http_front(service, config, tokenizer)``: the front served on ``config.http_port``
        (the daemon's is the OpenAI API over local serving: :func:`goodspeed.launch.daemons.serve.make_http_front`)."""
        check_transit(config.rounds, engine.config.transit_tokens, config.transit_alone)
        if config.http_port is not None and http_front is None:
            raise ValueError("http_port is set but no HTTP front was given to serve on it")
        self.http_front = http_front
        self.engine, self.config = engine, config
        self.local, self.tokenizer = local, tokenizer
        self.metrics, self.log = metrics or Metrics(), log or JsonLog()
        self.metrics.watch_kv(engine)
        if local is not None and local.adapting is not None:
            self.metrics.watch_local_adapt(local.adapting)
        # Read now, so a bad token file fails before anything listens.
        self.auth = TokenAuth.from_file(config.auth_tokens) if config.auth_tokens else None
        self.health = health.aio.HealthServicer()
        self.service: VerifierService | None = None
        self._server: grpc.aio.Server | None = None
        self._rounds: asyncio.Task | None = None
        self.failed = asyncio.Event()  # set if the round loop dies: the daemon must not look healthy
        self.http = None  # the OpenAI-compatible front, when config.http_port is set
        self.http_port: int | None = None
        self._https_watch: asyncio.Task | None = None  # re-reads the HTTPS front's certificate files

    async def _set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def start(self) -> int:
        self.service = VerifierService(self.engine, self.config, self.metrics, self.log, self.local, self.tokenizer, self.auth)
        limit = self.config.max_message_bytes
        self._server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)])
        pb_grpc.add_VerifierServicer_to_server(self.service, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{self.config.host}:{self.config.port}"
        credentials = server_credentials(self.config, on_reload=lambda what: self.log.event("tls_certificates", result=what))
        try:
            port = self._server.add_insecure_port(address) if credentials is None else self._server.add_secure_port(address, credentials)
        except RuntimeError:  # grpc's "Failed to bind"
            port = 0
        if port == 0 or (self.config.port and port != self.config.port):  # never serve somewhere else than asked
            await self._server.stop(None)
            raise errors.ListenError(f"cannot listen on {address}: in use or not allowed" + (f" (bound {port} instead)" if port else ""))
        await self._server.start()
        if self.config.warmup:
            await self.service.call(self.service.warm_up)
        self._rounds = asyncio.create_task(self.service.rounds.run())
        self._rounds.add_done_callback(self._on_rounds_done)
        if self.config.http_port is not None:
            self.http = self.http_front(self.service, self.config, self.tokenizer)
            try:
                self.http_port = await self.http.start(self.config.http_host, self.config.http_port, ssl_context=self._http_tls())
            except OSError as exc:  # stop what did start, so nothing is left serving half the daemon
                self.http = None
                await self.stop(0)
                raise errors.ListenError(f"cannot serve HTTP on {self.config.http_host}:{self.config.http_port}: {exc.strerror or exc}") from None
            self.log.event("http_serving", host=self.config.http_host, port=self.http_port)
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        if credentials is None and not is_loopback(self.config.host):
            self.log.event("warning", message=f"--insecure: plaintext on {self.config.host}; anyone on the network can read "
                                              "and forge this traffic")
        self.log.event("serving", host=self.config.host, port=port, target=self.config.target_name, seed=self.engine.root_seed,
                       auth="tokens" if self.auth is not None else "none",
                       tls="mutual" if self.config.tls_client_ca else ("server" if self.config.tls_cert else "none"))
        return port

    def _http_tls(self):
        """HTTPS with the gRPC server's certificate, when it has one, re-read when its files
        change (:class:`~goodspeed.verifier.tls.ReloadingServerContext`, checked every
        ``RELOAD_CHECK_S``)."""
        if self.config.tls_cert is None:
            return None
        reloading = ReloadingServerContext(self.config.tls_cert, self.config.tls_key,
                                           on_reload=lambda what: self.log.event("https_certificates", result=what))

        async def watch() -> None:
            while True:
                await asyncio.sleep(RELOAD_CHECK_S)
                reloading.check()

        self._https_watch = asyncio.create_task(watch())
        return reloading.context

    def _on_rounds_done(self, task: asyncio.Task) -> None:
        """The round loop only ends when stopped; if it raised, no drafter would get another
        verdict, so health turns NOT_SERVING and :attr:`failed` tells the daemon to exit non-zero."""
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        self.log.event("round_loop_failed", error=f"{type(exc).__name__}: {exc}")
        self.failed.set()
        asyncio.get_running_loop().create_task(self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING))

    async def drain(self) -> None:
        """Refuse new sessions and requests; let the requests in progress finish (bounded)."""
        self.service.draining = True
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.log.event("draining", requests_in_progress=self.service.drafters.requests_in_progress())
        deadline = time.monotonic() + self.config.drain_timeout_s
        while self.service.drafters.requests_in_progress() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def stop(self, grace_s: float = 1.0) -> None:
        if self._https_watch is not None:
            self._https_watch.cancel()
        if self.http is not None:
            await self.http.stop()
        if self.service is not None:  # requests its handlers were freeing
            await asyncio.gather(*self.service.cleanups, return_exceptions=True)
        if self._rounds is not None:
            self._rounds.cancel()
        if self._server is not None:
            await self._server.stop(grace_s)
        self.log.event("stopped")


def make_server(engine: VerificationEngine, config: ServerConfig = ServerConfig(), **kwargs) -> VerifierServer:
    """Build an unstarted verifier server (tests run it on 127.0.0.1:0)."""
    return VerifierServer(engine, config, **kwargs)
