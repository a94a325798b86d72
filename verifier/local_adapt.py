"""Local serving's ``--local-draft-adapt``: the verifier's own draft model learns the requests it
serves (:mod:`goodspeed.lm.models.adapt`, the edge node's ``--adapt`` on the verifier).

A finished request's committed text is recorded on the engine's thread; a fine-tune runs on a
thread of its own. Weights the guard picks go live on the engine's thread (which owns the draft)
when no local request is active; while they wait, local serving admits no new request, so the
requests in flight are the only wait and no request's draft KV sees two versions of the weights.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from goodspeed.lm.models.adapt import DraftAdapter, Update
from goodspeed.lm.models.adapt_config import AdaptConfig

LEARNS_FROM = ("eos", "length")  # requests that finished: a cancelled or failed one's text is not kept


class LocalAdaptation:
    def __init__(self, model: torch.nn.Module, config: AdaptConfig, log: Callable[[str], None] | None = None) -> None:
        self.log = log or (lambda message: None)
        self.adapter = DraftAdapter(model, config, log=self.log)
        self._thread: threading.Thread | None = None
        self.failed = 0  # fine-tunes that raised (the draft's weights unchanged)

    @property
    def training(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def holds_admission(self) -> bool:
        """New weights wait for the active requests to end: admit none meanwhile."""
        return self.adapter.pending is not None

    def finished(self, prompt_len: int, committed: list[int], reason: str) -> None:
        """A request ended (engine thread): keep its text if it finished; start a fine-tune when one is due."""
        if reason in LEARNS_FROM and self.adapter.record(prompt_len, committed) and not self.training:
            self._thread = threading.Thread(target=self._fine_tune, name="goodspeed-local-adapt", daemon=True)
            self._thread.start()

    def _fine_tune(self) -> Update | None:
        try:
            return self.adapter.fine_tune()
        except Exception as exc:  # local serving goes on with the weights it has
            self.failed += 1
            self.log(f"adapt: a fine-tune failed ({type(exc).__name__}: {exc}); the draft's weights are unchanged")
            return None

    def swap_if_idle(self, active: int) -> bool:
        """Engine thread: put waiting weights live when no request is active."""
        return active == 0 and self.adapter.pending is not None and self.adapter.swap()

    def stop(self) -> None:
        """End a fine-tune in progress at its next step and wait for it."""
        self.adapter.stopping.set()
        if self._thread is not None:
            self._thread.join()
