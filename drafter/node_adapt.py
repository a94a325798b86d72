"""An edge node's ``--adapt``: when its draft learns (:mod:`goodspeed.lm.models.adapt`) and when new
weights go live.

A finished request's committed text is recorded; every ``adapt_every`` of them a fine-tune runs on
a thread of its own (never the drafting thread, so drafting goes on meanwhile). Weights the guard
picks wait in ``pending`` until no request is admitted on the node; new requests wait meanwhile
(:meth:`NodeAdaptation.admit`), so the requests in flight are the only wait, and the swap runs on
the drafting thread, which owns the model.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import torch

from goodspeed.lm.models.adapt import DraftAdapter

LEARNS_FROM = ("stop", "length")  # requests that finished (metrics' reasons): an aborted or failed one's text is not kept


class NodeAdaptation:
    def __init__(self, node, model: torch.nn.Module) -> None:
        self.node = node
        self._say = node.config.on_wait or (lambda message: None)
        self.adapter = DraftAdapter(model, node.config.adapt_config(), log=self._say)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="goodspeed-adapt")
        self._training: asyncio.Task | None = None
        self._swapped = asyncio.Condition()
        node.node_metrics.draft_version.set(self.adapter.version)

    async def admit(self) -> None:
        """Wait while adopted weights wait to go live."""
        if self.adapter.pending is None:
            return
        async with self._swapped:
            await self._swapped.wait_for(lambda: self.adapter.pending is None)

    async def finished(self, req, reason: str) -> None:
        """A request freed its draft slot: learn its text if it finished, and swap if weights wait
        and no request is admitted."""
        if reason in LEARNS_FROM and self.adapter.record(req.prompt_len, req.committed) and self._training is None:
            self._training = asyncio.get_running_loop().create_task(self._fine_tune())
        await self._maybe_swap()

    async def _fine_tune(self) -> None:
        metrics = self.node.node_metrics
        metrics.adapting.set(1)
        try:
            update = await asyncio.get_running_loop().run_in_executor(self._thread, self.adapter.fine_tune)
        except Exception as exc:  # the node goes on drafting with the weights it has
            metrics.adapt_updates.labels("failed").inc()
            self._say(f"adapt: a fine-tune failed ({type(exc).__name__}: {exc}); the draft's weights are unchanged")
            return
        finally:
            self._training = None
            metrics.adapting.set(0)
        if update is not None:
            metrics.adapt_updates.labels(update.outcome).inc()
            metrics.adapt_seconds.inc(update.seconds)
            for weights in ("before", "candidate", "shipped", "after"):
                metrics.adapt_acceptance.labels(weights).set(getattr(update, weights))
        await self._maybe_swap()

    async def _maybe_swap(self) -> None:
        if self.adapter.pending is None or self.node.holding:
            return
        await self.node._call(self.adapter.swap)
        self.node.node_metrics.draft_version.set(self.adapter.version)
        async with self._swapped:
            self._swapped.notify_all()

    async def stop(self) -> None:
        """Stop a fine-tune in progress at its next step and wait for its thread."""
        self.adapter.stopping.set()
        if self._training is not None:
            await asyncio.gather(self._training, return_exceptions=True)
        self._thread.shutdown(wait=True)
