"""Edge links on one machine: drafters in their own network namespaces, with real bandwidth caps
and userspace delay, jitter and loss.

Each linked drafter gets a network namespace joined to the host by a veth pair (a /30 of
``10.231.0.0/16``: host side ``.1``, drafter side ``.2``). ``tc ... tbf`` caps the rate in both
directions (the kernel's token bucket: real queueing, real TCP back-pressure). This kernel has no
``netem``, so delay, jitter and loss come from a small userspace TCP proxy on the host side of
the veth: every chunk read from either side is released ``rtt/2 + U(-jitter, +jitter)`` later,
never before the chunk ahead of it (TCP keeps order), and a chunk "lost" with probability
``loss`` is released one retransmission timeout later (``max(200 ms, 2 * rtt)``, Linux's minimum
RTO): over TCP a lost segment costs exactly that stall, not missing bytes. A link can be
partitioned (:meth:`EdgeNetwork.partition`) and healed: while cut, nothing crosses it either way
and a new connection gets no further than the proxy; what was sent meanwhile arrives after the heal,
as TCP's retransmissions deliver it, unless an end gave the connection up first.

Setup needs root and namespace support; :func:`check_support` says clearly why not otherwise.
Teardown deletes the namespaces (which deletes the veths and their qdiscs): nothing is left.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import random
import shutil
import subprocess
import threading
from dataclasses import dataclass

SUBNET = ipaddress.ip_network("10.231.0.0/16")


class LinkError(RuntimeError):
    """Link emulation is unavailable or failed; the message says why."""


@dataclass(frozen=True)
class LinkSpec:
    """A drafter's edge link: round-trip delay, jitter (uniform, +/-), bandwidth cap, loss rate."""

    rtt_ms: float = 0.0
    jitter_ms: float = 0.0
    mbit: float | None = None  # None: no cap
    loss: float = 0.0

    def __post_init__(self) -> None:
        if self.rtt_ms < 0 or self.jitter_ms < 0 or not 0 <= self.loss < 1:
            raise ValueError("link: rtt_ms and jitter_ms must be >= 0 and loss in [0, 1)")
        if self.jitter_ms > self.rtt_ms / 2:
            raise ValueError("link: jitter_ms must not exceed rtt_ms / 2 (a one-way delay cannot go negative)")
        if self.mbit is not None and self.mbit <= 0:
            raise ValueError("link: mbit must be > 0")

    @property
    def retransmit_s(self) -> float:
        return max(0.2, 2 * self.rtt_ms / 1000)


def check_support() -> None:
    """Raise :class:`LinkError` unless this process can create namespaces, veths and tbf qdiscs."""
    if os.geteuid() != 0:
        raise LinkError("edge-link emulation needs root (network namespaces, veth pairs, tc); run as root or drop the drafters' `link` keys")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise LinkError(f"edge-link emulation needs `{tool}` (Debian: apt-get install iproute2)")
    probe = f"gsprobe{os.getpid()}"
    try:
        _run("ip", "netns", "add", probe)
    except LinkError as exc:
        raise LinkError(f"this kernel or container does not allow network namespaces: {exc}") from None
    _run("ip", "netns", "del", probe)


def _run(*cmd: str) -> str:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise LinkError(f"`{' '.join(cmd)}` failed: {result.stderr.strip()}")
    return result.stdout


# ------------------------------------------------------------------------------ the proxy


class DelayProxy:
    """A TCP forwarder adding one-way delay, jitter and loss stalls in both directions; runs on
    its own event-loop thread. ``port = start()``; ``stop()``; ``partition()`` and ``heal()``
    cut and restore the link (nothing is forwarded, no upstream connection opened, while cut)."""

    def __init__(self, listen_host: str, upstream: tuple[str, int], link: LinkSpec, seed: int = 0) -> None:
        self.listen_host, self.upstream, self.link = listen_host, upstream, link
        self.rng = random.Random(seed)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="goodspeed-link-proxy")
        self._server = None
        self._open: asyncio.Event | None = None  # set while the link is up; made on the loop (start)
        self.stats = {"chunks": 0, "bytes": 0, "lost": 0}

    def start(self, port: int = 0) -> int:
        self._thread.start()

        async def make_open() -> asyncio.Event:
            event = asyncio.Event()
            event.set()
            return event

        self._open = asyncio.run_coroutine_threadsafe(make_open(), self.loop).result(10)
        fut = asyncio.run_coroutine_threadsafe(asyncio.start_server(self._handle, self.listen_host, port), self.loop)
        self._server = fut.result(10)
        return self._server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        """Close the listener and every forwarded connection, then the event loop."""

        async def close():
            self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._server is not None:
            asyncio.run_coroutine_threadsafe(close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    def partition(self) -> None:
        """Cut the link: once this returns, nothing crosses it until :meth:`heal`."""
        self._on_loop(self._open.clear)

    def heal(self) -> None:
        """Restore the link: what was held is released in order, and held connections proceed."""
        self._on_loop(self._open.set)

    def _on_loop(self, fn) -> None:
        async def call() -> None:
            fn()

        asyncio.run_coroutine_threadsafe(call(), self.loop).result(10)

    @property
    def cut(self) -> bool:
        return self._open is not None and not self._open.is_set()

    def _delay_s(self) -> float:
        link = self.link
        delay = link.rtt_ms / 2000 + self.rng.uniform(-link.jitter_ms, link.jitter_ms) / 1000
        if link.loss and self.rng.random() < link.loss:
            self.stats["lost"] += 1
            delay += link.retransmit_s
        return max(0.0, delay)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._open.wait()  # a connection opened across a cut link hangs, as its SYNs would
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer), return_exceptions=True)
        except asyncio.CancelledError:  # stop(): the connection ends with the proxy, not as an error
            writer.close()
            up_writer.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        async def release():
            while (item := await queue.get()) is not None:
                at, data = item
                await asyncio.sleep(max(0.0, at - loop.time()))
                await self._open.wait()  # held while the link is cut
                writer.write(data)
                await writer.drain()
            writer.close()

        sender = asyncio.create_task(release())
        last = 0.0
        try:
            while data := await reader.read(65536):
                last = max(last, loop.time() + self._delay_s())  # in order, like TCP
                self.stats["chunks"] += 1
                self.stats["bytes"] += len(data)
                queue.put_nowait((last, data))
        except (ConnectionError, OSError):
            pass
        finally:
            queue.put_nowait(None)
            await asyncio.gather(sender, return_exceptions=True)


# --------------------------------------------------------------------------- namespaces


@dataclass
class EdgeLink:
    namespace: str
    host_ip: str
    drafter_ip: str
    host_dev: str
    link: LinkSpec
    proxy: DelayProxy | None = None
    proxy_port: int | None = None

    def wrap(self, cmd: list[str]) -> list[str]:
        """``cmd`` run inside this drafter's namespace."""
        return ["ip", "netns", "exec", self.namespace, *cmd]

    @property
    def verifier_address(self) -> str:
        """Where the drafter dials: the proxy on the host side of its veth."""
        return f"{self.host_ip}:{self.proxy_port}"


class EdgeNetwork:
    """Namespaces + veths + tbf for a set of drafters, and a delay proxy each to one upstream.

    ``with EdgeNetwork({"d0": LinkSpec(...)}, upstream=("127.0.0.1", port)) as net: net["d0"]``
    """

    def __init__(self, links: dict[str, LinkSpec], upstream: tuple[str, int] | None = None, seed: int = 0) -> None:
        if len(links) > 16000:
            raise LinkError("at most 16000 emulated links")
        self.links, self.upstream, self.seed = links, upstream, seed
        self.tag = f"{os.getpid() % 100000}"
        self.edges: dict[str, EdgeLink] = {}

    def __enter__(self) -> "EdgeNetwork":
        check_support()
        try:
            for i, (name, link) in enumerate(self.links.items()):
                self.edges[name] = self._create(i, link)
                if self.upstream is not None:
                    self.start_proxy(name, self.upstream)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getitem__(self, name: str) -> EdgeLink:
        return self.edges[name]

    def _create(self, i: int, link: LinkSpec) -> EdgeLink:
        index = ((os.getpid() % 1000) * 16 + i) % (SUBNET.num_addresses // 4)  # distinct /30s per process
        net = ipaddress.ip_network((int(SUBNET.network_address) + 4 * index, 30))
        host_ip, drafter_ip = str(net[1]), str(net[2])
        ns, host_dev, ns_dev = f"gs{self.tag}-{i}", f"gsh{self.tag}x{i}"[:15], f"gsn{self.tag}x{i}"[:15]
        edge = EdgeLink(ns, host_ip, drafter_ip, host_dev, link)
        _run("ip", "netns", "add", ns)
        try:
            _run("ip", "link", "add", host_dev, "type", "veth", "peer", "name", ns_dev)
            _run("ip", "link", "set", ns_dev, "netns", ns)
            _run("ip", "addr", "add", f"{host_ip}/30", "dev", host_dev)
            _run("ip", "link", "set", host_dev, "up")
            _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{drafter_ip}/30", "dev", ns_dev)
            _run("ip", "netns", "exec", ns, "ip", "link", "set", ns_dev, "up")
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            if link.mbit is not None:
                rate = f"{link.mbit}mbit"
                burst = str(max(1600, int(link.mbit * 1e6 / 8 / 100)))  # >= one 10 ms tick of tokens
                _run("tc", "qdisc", "add", "dev", host_dev, "root", "tbf", "rate", rate, "burst", burst, "latency", "100ms")
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", ns_dev, "root", "tbf", "rate", rate, "burst", burst, "latency", "100ms")
        except LinkError:
            _remove(edge)
            raise
        return edge

    def partition(self, name: str) -> None:
        """Cut ``name``'s link to its upstream (its proxy holds everything until :meth:`heal`)."""
        self.edges[name].proxy.partition()

    def heal(self, name: str) -> None:
        self.edges[name].proxy.heal()

    def start_proxy(self, name: str, upstream: tuple[str, int]) -> None:
        edge = self.edges[name]
        edge.proxy = DelayProxy(edge.host_ip, upstream, edge.link, seed=self.seed + len(self.edges))
        edge.proxy_port = edge.proxy.start()

    def close(self) -> None:
        for edge in list(self.edges.values()):
            if edge.proxy is not None:
                edge.proxy.stop()
            _remove(edge)
        self.edges.clear()


def _remove(edge: EdgeLink) -> None:
    """Delete the namespace (its veth end and qdiscs go with it) and the host end if still there."""
    subprocess.run(["ip", "netns", "del", edge.namespace], capture_output=True)
    subprocess.run(["ip", "link", "del", edge.host_dev], capture_output=True)
