"""What an edge node holds per request and per pooled verifier session
(:mod:`goodspeed.drafter.node`): a session with its verdict stream, a request (its drafter
session and the node's own state) and a batched draft job."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from goodspeed.drafter.session import DrafterError, DraftSession, RequestStats, SessionLost, VerdictAhead, answers
from goodspeed.proto.goodspeed.v1 import goodspeed_pb2 as pb
from goodspeed.serving.aio import within
from goodspeed.serving.generation import GenerationRequest
from goodspeed.serving.metrics import RequestTimer

if TYPE_CHECKING:
    import torch


class PooledSession:
    """One pooled verifier session and its verdict stream."""

    def __init__(self, session_id: str, stream) -> None:
        self.session_id, self.stream = session_id, stream
        self.verdicts: asyncio.Queue = asyncio.Queue()
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        try:
            async for verdict in self.stream:
                self.verdicts.put_nowait(verdict)
        except grpc.aio.AioRpcError:
            pass
        self.verdicts.put_nowait(None)

    async def verdict(self, round_index: int, timeout_s: float) -> pb.Verdict:
        """The verdict for ``round_index`` (earlier ones — a retried submit's — are skipped)."""
        while True:
            try:
                item = await within(self.verdicts.get(), timeout_s)
            except asyncio.TimeoutError:
                raise DrafterError(f"no verdict for round {round_index} within {timeout_s:g} s") from None
            if item is None:
                raise SessionLost()
            try:
                if answers(item, round_index):
                    return item
            except VerdictAhead as exc:  # its tokens may have reached the client: not repaired
                raise DrafterError(str(exc)) from None

    async def close(self) -> None:
        self.stream.cancel()
        await asyncio.gather(self.reader, return_exceptions=True)


class NodeRequest(DraftSession):
    """A request on the node: its :class:`~goodspeed.drafter.session.DraftSession`, and what only
    the node holds: its sampling stream, its metrics, the deltas its client reads, the pooled
    verifier session it runs on."""

    def __init__(self, request: GenerationRequest, generator: torch.Generator | None, timer: RequestTimer,
                 stats: RequestStats | None = None) -> None:
        super().__init__(request, stats)
        self.generator, self.timer = generator, timer
        self.out: asyncio.Queue = asyncio.Queue()
        self.session: PooledSession | None = None
        self.stop_string = False  # its client's text ended at a stop string: cancelled as finished ("stop")
        self.last_verdict_at: float | None = None  # when its previous verdict came (SLO admission's rounds)
        self.drafted_last = 0  # tokens its last round drafted: none, and no draft KV past its text to roll back
        self.decode_ahead = False  # its verifier decodes rounds ahead of an empty draft (StartRequestReply.features)
        self.until_match = False  # ... and stops at a match, counting the rounds left in each verdict (the same)
        self.ahead = 0  # rounds the verifier is decoding by itself before this node drafts again

    def lost(self) -> None:
        super().lost()
        self.ahead = 0  # the new session decodes nothing ahead until asked


@dataclass
class DraftJob:
    request: NodeRequest
    length: int
    committed: list[int]
    future: asyncio.Future
