"""What an edge node holds per request and per pooled verifier session
(:mod:`goodspeed.drafter.node`): a session with its verdict stream, a request's text and round
state beside its spec, and a batched draft job."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
import torch

from goodspeed.drafter.client import DrafterError, SessionLost
from goodspeed.lm.decoding.adjust import TokenHistory
from goodspeed.lm.runtime.prefix import new_prefix_hasher, update_prefix_hasher
from goodspeed.proto.goodspeed.v1 import goodspeed_pb2 as pb
from goodspeed.serving.aio import within
from goodspeed.serving.generation import GenerationRequest
from goodspeed.serving.metrics import RequestTimer


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
            if item.round_index == round_index:
                return item
            if item.round_index > round_index:
                raise DrafterError(f"the verifier answered round {item.round_index} while this node waited for {round_index}")

    async def close(self) -> None:
        self.stream.cancel()
        await asyncio.gather(self.reader, return_exceptions=True)


@dataclass
class RequestStats:
    """What one request's rounds did, for callers that report per request (``open(stats=...)``):
    the file-mode drafter's JSONL records."""

    rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    transit_tokens: int = 0  # of the request's tokens, those the verifier decoded while a draft was in transit
    repairs: int = 0


@dataclass
class NodeRequest:
    gen: GenerationRequest
    committed: list[int]
    generator: torch.Generator
    timer: RequestTimer
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    hasher: object = field(default_factory=new_prefix_hasher)
    generated: int = 0
    session: PooledSession | None = None
    in_progress: bool = False  # the verifier holds the request (StartRequest done, not finished)
    length: int = 0  # S for the next round
    round_index: int = 0
    stats: RequestStats = field(default_factory=RequestStats)  # rounds, tokens and repairs so far
    history: TokenHistory | None = None  # the text its penalties read, when its sampling adjusts logits
    prompt_scored: bool = False  # its prompt's log-probabilities (if asked for) reached its client
    stop_string: bool = False  # its client's text ended at a stop string: cancelled as finished ("stop")

    def __post_init__(self) -> None:
        update_prefix_hasher(self.hasher, self.committed)
        if self.gen.sampling.adjusts_logits:  # as the verifier splits it: prompt, then everything generated
            split = len(self.committed) - self.generated
            self.history = TokenHistory(self.committed[:split], self.committed[split:], self.gen.sampling.structured)

    @property
    def key(self) -> str:
        return self.gen.request_id

    def commit(self, tokens: list[int]) -> None:
        self.committed.extend(tokens)
        self.generated += len(tokens)
        update_prefix_hasher(self.hasher, tokens)
        if self.history is not None:  # drafting and committing alternate, so no draft reads it meanwhile
            self.history.extend(tokens, strict=False)


@dataclass
class DraftJob:
    request: NodeRequest
    length: int
    committed: list[int]
    future: asyncio.Future
