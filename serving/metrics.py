"""Request and speculative-decoding metrics under vLLM's names, with a ``goodspeed:`` prefix.

The names and meanings follow vLLM's (``vllm:spec_decode_num_drafts_total`` and so on), so a
dashboard built for vLLM needs only its prefix changed; ``launch/grafana/goodspeed.json`` is
ours. Labels are bounded: ``position`` is below the maximum draft length, ``finished_reason`` is
one of four words, and nothing is labelled per drafter or per request.

* ``spec_decode_*``: one draft is one drafter's (or one local request's) tokens in one verification
  step; ``num_accepted_tokens_per_pos{position=j}`` counts drafts whose token at position ``j``
  (0-based) was accepted.
* ``time_to_first_token_seconds``: arrival to the first generated token;
  ``inter_token_latency_seconds``: as vLLM's, one observation per step that produced tokens, the
  time since the previous step's tokens (a step that yields several tokens is one observation);
  ``e2e_request_latency_seconds``: arrival to the last token.

Both the verifier and each edge node keep these: the verifier counts every request it verifies
(edge and local), a node counts its own requests, seen from the device (its latencies include the
links to the verifier).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "goodspeed:"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)
FINISHED_REASONS = ("stop", "length", "abort", "error")


class SpecDecodeMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.drafts = Counter(f"{PREFIX}spec_decode_num_drafts", "Drafts verified", registry=registry)
        self.draft_tokens = Counter(f"{PREFIX}spec_decode_num_draft_tokens", "Draft tokens verified", registry=registry)
        self.accepted_tokens = Counter(f"{PREFIX}spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=registry)
        self.accepted_per_pos = Counter(f"{PREFIX}spec_decode_num_accepted_tokens_per_pos",
                                        "Drafts whose token at this position was accepted", ["position"], registry=registry)
        self._positions: list = []  # accepted_per_pos's children by position (a label lookup each is not free)

    def observe(self, drafted: int, accepted: int) -> None:
        """One draft of ``drafted`` tokens of which the first ``accepted`` were kept (for a tree,
        ``drafted`` is its node count and ``accepted`` the depth of the accepted path)."""
        if drafted <= 0:
            return
        self.drafts.inc()
        self.draft_tokens.inc(drafted)
        self.accepted_tokens.inc(accepted)
        while len(self._positions) < accepted:
            self._positions.append(self.accepted_per_pos.labels(position=str(len(self._positions))))
        for child in self._positions[:accepted]:
            child.inc()


class RequestMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.running = Gauge(f"{PREFIX}num_requests_running", "Requests generating", registry=registry)
        self.waiting = Gauge(f"{PREFIX}num_requests_waiting", "Requests queued before generating", registry=registry)
        self.ttft = Histogram(f"{PREFIX}time_to_first_token_seconds", "Arrival to first token", buckets=LATENCY_BUCKETS,
                              registry=registry)
        self.itl = Histogram(f"{PREFIX}inter_token_latency_seconds", "Time between steps that produced tokens",
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.e2e = Histogram(f"{PREFIX}e2e_request_latency_seconds", "Arrival to last token", buckets=LATENCY_BUCKETS,
                             registry=registry)
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens", "Generated tokens", registry=registry)
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Prefilled prompt tokens", registry=registry)
        self.success = Counter(f"{PREFIX}request_success", "Finished requests by reason", ["finished_reason"],
                               registry=registry)

    def track(self, prompt_tokens: int, arrival: float | None = None, count_running: bool = True) -> "RequestTimer":
        """A timer for one request. ``count_running``: it moves ``num_requests_running`` (off for
        an owner that sets the gauges from its own state, as the verifier does)."""
        return RequestTimer(self, prompt_tokens, time.perf_counter() if arrival is None else arrival, count_running)


class RequestTimer:
    """One request's latencies: call :meth:`tokens` as tokens arrive and :meth:`finish` once."""

    def __init__(self, metrics: RequestMetrics, prompt_tokens: int, arrival: float, count_running: bool = True) -> None:
        self.metrics, self.arrival, self.count_running = metrics, arrival, count_running
        self.last: float | None = None
        self.done = False
        metrics.prompt_tokens.inc(prompt_tokens)
        if count_running:
            metrics.running.inc()

    def tokens(self, count: int, now: float | None = None) -> None:
        if count <= 0 or self.done:
            return
        now = time.perf_counter() if now is None else now
        if self.last is None:
            self.metrics.ttft.observe(now - self.arrival)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now
        self.metrics.generation_tokens.inc(count)

    def finish(self, reason: str) -> None:
        """``reason``: "stop", "length", "abort" (cancelled) or "error"; idempotent."""
        if self.done:
            return
        self.done = True
        if self.count_running:
            self.metrics.running.dec()
        if self.last is not None:
            self.metrics.e2e.observe(self.last - self.arrival)
        self.metrics.success.labels(finished_reason=reason if reason in FINISHED_REASONS else "error").inc()


def finished_reason(reason: str | None) -> str:
    """Our finish reasons ("eos", "length", "stop", "cancelled", "error: ...") in vLLM's words."""
    if reason in ("eos", "stop"):
        return "stop"
    if reason == "length":
        return "length"
    if reason == "cancelled":
        return "abort"
    return "error"


class DrafterMetrics:
    """An edge node's own view of its rounds (besides its spec-decode and request metrics)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.draft_seconds = Histogram(f"{PREFIX}drafter_draft_seconds", "One batched drafting call on the device",
                                       buckets=LATENCY_BUCKETS, registry=registry)
        self.round_trip_seconds = Histogram(f"{PREFIX}drafter_round_trip_seconds",
                                            "Draft sent to its verdict received (link + verifier)",
                                            buckets=LATENCY_BUCKETS, registry=registry)
        self.sessions = Gauge(f"{PREFIX}drafter_sessions", "Verifier sessions this node holds", registry=registry)
        self.forced_tokens = Counter(f"{PREFIX}drafter_forced_tokens", "Draft tokens a grammar forced (fast-forward: "
                                     "drafted as point masses, always accepted)", registry=registry)
        self.draft_length = Histogram(f"{PREFIX}drafter_draft_length", "Draft length S the verifier allotted",
                                      buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32), registry=registry)
        # --adapt (goodspeed.lm.models.adapt): the draft's weights version, each fine-tune's outcome, the
        # held-back greedy acceptance the last one measured, and the time spent adapting
        self.draft_version = Gauge(f"{PREFIX}drafter_draft_version", "Version of the draft's weights (0: as shipped)",
                                   registry=registry)
        self.adapt_updates = Counter(f"{PREFIX}drafter_adapt_updates", "Fine-tunes of the draft, by the guard's outcome",
                                     ["outcome"], registry=registry)
        self.adapt_acceptance = Gauge(f"{PREFIX}drafter_adapt_acceptance", "Held-back greedy acceptance at the last "
                                      "fine-tune, of the weights live before it, its candidate, the shipped ones and "
                                      "those live after it", ["weights"], registry=registry)
        self.adapting = Gauge(f"{PREFIX}drafter_adapting", "1 while a fine-tune of the draft runs", registry=registry)
        self.adapt_seconds = Counter(f"{PREFIX}drafter_adapt_seconds", "Seconds spent fine-tuning and judging the draft",
                                     registry=registry)
