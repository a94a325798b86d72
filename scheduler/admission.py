"""Which waiting requests start: by count, or by their TPOT SLOs: local serving's batch
(``goodspeed verifier --local-admission``, :class:`SloAdmission`) and an edge node's requests
(``goodspeed drafter --serve --admission``, :class:`RoundAdmission`).

``count`` (the default) admits while fewer than ``max_requests`` decode. ``slo`` also predicts
the batch's time per output token with one more request and admits the queue's head only when
that stays within 90% (:data:`HEADROOM`) of the SLO of every request that would then decode (the head's included; a
request without an SLO constrains nothing). A bigger batch makes every step longer, so one
request too many makes all of them miss: past capacity the requests that would break the batch's
SLOs wait (a bounded queue; beyond it a refusal) instead of slowing everyone.

The prediction is measured, not profiled: a step of ``n`` drafting requests took ``a + b n``
seconds (least squares over recent steps, older ones forgotten geometrically) and each request
gains ``g`` tokens a step (smoothed), so ``TPOT(n) = (a + b n) / g``. Until steps of two different
batch sizes have been seen there is no slope, and a line fitted to small batches says little of a
big one: where an SLO is at stake, a batch grows past the largest one measured by one request a
step (its cost is measured as it grows). A step's time is all its requests wait for it, the
prefill of the requests admitted at it included, as their TPOT counts it. The head waits (first in,
first out) rather than being passed by a later request with a looser SLO: a strict request is
never starved by relaxed ones. A request that could not meet its SLO even alone is admitted when
nothing else decodes (best effort, as plain decoding would serve it).
"""

from __future__ import annotations

ADMISSIONS = ("count", "slo")
HEADROOM = 0.9  # a prediction is a mean a request's own TPOT varies around: admit within 90% of the SLO


class StepTimeModel:
    """``seconds(n) = a + b n`` by exponentially weighted least squares over ``(n, seconds)``."""

    def __init__(self, forget: float = 0.98) -> None:
        self.forget = forget
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.sizes: set[int] = set()
        self.largest = 0  # the largest batch measured

    def observe(self, n: int, seconds: float) -> None:
        f = self.forget
        self.w, self.sx, self.sy = f * self.w + 1, f * self.sx + n, f * self.sy + seconds
        self.sxx, self.sxy = f * self.sxx + n * n, f * self.sxy + n * seconds
        if len(self.sizes) < 2:
            self.sizes.add(n)
        self.largest = max(self.largest, n)

    def predict(self, n: int) -> float | None:
        """Seconds a step of ``n`` requests takes; None before two batch sizes were seen."""
        if len(self.sizes) < 2:
            return None
        det = self.w * self.sxx - self.sx * self.sx
        if det <= 1e-12:
            return None
        b = max(0.0, (self.w * self.sxy - self.sx * self.sy) / det)  # a step never gets cheaper with more rows
        a = (self.sy - b * self.sx) / self.w
        return a + b * n


class SloAdmission:
    """The ``slo`` rule (module docstring)."""

    def __init__(self, smoothing: float = 0.2) -> None:
        self.steps = StepTimeModel()
        self.gain: float | None = None  # tokens a request gains a step, smoothed
        self.smoothing = smoothing

    def observe(self, requests: int, emitted: int, seconds: float) -> None:
        """A drafting step: ``requests`` decoded, ``emitted`` tokens in all, ``seconds`` long."""
        if requests < 1 or seconds <= 0:
            return
        self.steps.observe(requests, seconds)
        g = emitted / requests
        self.gain = g if self.gain is None else self.smoothing * g + (1 - self.smoothing) * self.gain

    def tpot_s(self, n: int) -> float | None:
        """Predicted seconds per output token for each of ``n`` decoding requests."""
        step = self.steps.predict(n)
        if step is None or not self.gain:
            return None
        return step / self.gain

    def admits(self, slos_s: list[float | None], head_slo_s: float | None, admitted_now: int = 0) -> bool:
        """Whether the head may join ``len(slos_s)`` decoding requests whose SLOs are ``slos_s``
        (``admitted_now`` of them joined at this step). Before the batch's time per token can be
        predicted, one request joins a step where an SLO is at stake, so the steps measure the
        batch as it grows instead of filling it blind."""
        if not slos_s:
            return True  # alone: best effort
        tightest = min((s for s in [*slos_s, head_slo_s] if s is not None), default=None)
        if tightest is None:
            return True
        n = len(slos_s) + 1
        predicted = self.tpot_s(n)
        within = predicted is not None and predicted <= HEADROOM * tightest
        if predicted is None or n > self.steps.largest + 1:  # past what was measured: one a step
            return admitted_now == 0 and (predicted is None or within)
        return within


class RoundAdmission(SloAdmission):
    """The ``slo`` rule for requests whose rounds run apart, not in shared steps: an edge node's,
    each verified in its own round trip to the verifier. Each round observed is one request's
    time per token (the seconds since its previous verdict over the tokens this one gave) with
    ``n`` requests in flight on the node, fitted as ``TPOT(n) = a + b n`` itself: the verifier
    splits the node's share of its budget among the node's requests, so a request's tokens a
    round fall as ``n`` grows, which one gain smoothed over every ``n`` would miss. The rule
    (:meth:`SloAdmission.admits`) is the same; its ``admitted_now`` counts the requests admitted
    since the last round observed."""

    def observe_round(self, n: int, seconds: float, gained: int) -> None:
        if n >= 1 and seconds > 0 and gained >= 1:
            self.steps.observe(n, seconds / gained)

    def tpot_s(self, n: int) -> float | None:
        return self.steps.predict(n)
