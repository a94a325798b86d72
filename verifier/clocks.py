"""Local serving's clocks and the latency profile a simulated one charges: :class:`RealClock` in
serving; :class:`SimulatedClock`, whose time advances only by each forward's modeled cost, for SLO
experiments that are exact and repeatable."""

from __future__ import annotations

import time
from dataclasses import dataclass

from goodspeed.scheduler import LatencyModel


class RealClock:
    """Wall-clock time; forwards cost what they cost."""

    def now(self) -> float:
        return time.perf_counter()

    def charge(self, which: str, context_tokens: int, batched_tokens: int) -> None:
        pass

    def wait_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            time.sleep(delay)


class SimulatedClock:
    """Time that advances only by the modeled cost of each forward: ``model.predict_s(context
    tokens, batched tokens)`` per forward (a :class:`LatencyModel`, TurboSpec eq. 3, or any object
    with that method, e.g. a roofline). A target forward is charged for the tokens it verifies and
    prefills, as the engine's packed (variable-length) forward runs them."""

    def __init__(self, target: LatencyModel, draft: LatencyModel, start: float = 0.0) -> None:
        self.models = {"target": target, "draft": draft}
        self.t = float(start)

    def now(self) -> float:
        return self.t

    def charge(self, which: str, context_tokens: int, batched_tokens: int) -> None:
        self.t += float(self.models[which].predict_s(context_tokens, batched_tokens))

    def wait_until(self, t: float) -> None:
        self.t = max(self.t, t)


@dataclass(frozen=True)
class LatencyProfile:
    """The fitted latency models ``goodspeed profile`` writes (TurboSpec eq. 3)."""

    target: LatencyModel
    draft: LatencyModel

    def to_dict(self) -> dict:
        return {"target": self.target.to_dict(), "draft": self.draft.to_dict()}

    @classmethod
    def from_dict(cls, data: dict) -> "LatencyProfile":
        try:
            return cls(LatencyModel.from_dict(data["target"]), LatencyModel.from_dict(data["draft"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a latency profile (need target and draft models): {exc}") from exc
