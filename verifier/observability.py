"""Prometheus metrics (bounded labels) and structured JSON log lines for the verifier daemon.

Names follow vLLM's under a ``goodspeed:`` prefix (:mod:`goodspeed.serving.metrics`). Per-drafter
detail goes to the JSON round log only (one line per round, read by the experiment
runner and the launcher's live table); metrics carry no drafter labels, so their cardinality does
not grow with the fleet.
"""

from __future__ import annotations

import json
import sys
import time
from typing import TextIO

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from goodspeed.serving.metrics import PREFIX, RequestMetrics, SpecDecodeMetrics

PHASES = ("receive", "assembly", "forward", "sampling", "scheduling", "send")


class Metrics:
    """The verifier's metrics: its rounds (``goodspeed:round_*``) and vLLM's request and
    spec-decode metrics (:mod:`goodspeed.serving.metrics`), all in one registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        buckets = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
        self.phase_seconds = Histogram(f"{PREFIX}round_phase_seconds", "Round time by phase", ["phase"], buckets=buckets,
                                       registry=self.registry)
        self.batch_size = Gauge(f"{PREFIX}round_batch_drafters", "Drafters verified in the last round", registry=self.registry)
        self.active = Gauge(f"{PREFIX}active_drafters", "Joined drafter sessions", registry=self.registry)
        self.rounds = Counter(f"{PREFIX}rounds", "Verified rounds", registry=self.registry)
        self.kv_slots = Gauge(f"{PREFIX}kv_slots_used", "Target KV slots held (one per request in progress)",
                              registry=self.registry)
        self.kv_positions = Gauge(f"{PREFIX}kv_reserved_positions", "Target KV positions allocated per layer (the KV "
                                  "cache's memory, in one position's keys and values)", registry=self.registry)
        self.transit_tokens = Counter(f"{PREFIX}transit_tokens", "Tokens decoded while their drafter's draft was in "
                                      "transit (--transit-tokens)", registry=self.registry)
        self.spec = SpecDecodeMetrics(self.registry)
        self.requests = RequestMetrics(self.registry)

    def watch_kv(self, engine) -> None:
        """Read ``engine``'s KV slots and reserved positions at each scrape (what a leak would
        leave behind: counted after a chaos run)."""
        self.kv_slots.set_function(lambda: engine.sessions.kv_usage()[0])
        self.kv_positions.set_function(lambda: engine.sessions.kv_usage()[1])

    def watch_local_adapt(self, adapting) -> None:
        """Local serving's ``--local-draft-adapt`` (a :class:`~goodspeed.verifier.local_adapt.LocalAdaptation`),
        read at each scrape: the edge node's ``goodspeed:drafter_*`` adapt metrics under
        ``goodspeed:local_draft_*`` (:class:`LocalAdaptCollector`)."""
        self.registry.register(LocalAdaptCollector(adapting))

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        from goodspeed.verifier.errors import ListenError

        try:
            start_http_server(port, addr=addr, registry=self.registry)
        except OSError as exc:
            raise ListenError(f"cannot serve metrics on {addr}:{port}: {exc.strerror or exc}") from None

    def observe_round(self, phases: dict[str, float], verdicts, transit_tokens: int = 0) -> None:
        """One step: its phases, its verdicts' drafts (a verdict's ``num_accepted`` may count
        drafted tokens that equal tokens decoded in transit, which the drafter keeps) and the
        tokens it decoded in transit."""
        for phase, seconds in phases.items():
            self.phase_seconds.labels(phase=phase).observe(seconds)
        self.batch_size.set(len(verdicts))
        for verdict in verdicts:
            self.spec.observe(verdict.num_drafted, verdict.num_accepted)
        self.transit_tokens.inc(transit_tokens)
        self.rounds.inc()


class LocalAdaptCollector:
    """``goodspeed:local_draft_version`` (0: as shipped), ``..._adapting`` (1 while a fine-tune
    runs), ``..._adapt_updates_total{outcome}`` (each fine-tune by the guard's outcome, or
    ``failed``), ``..._adapt_acceptance{weights}`` (the held-back greedy acceptance the last one
    measured of the weights live ``before`` it, its ``candidate``, the ``shipped`` ones and those
    live ``after``) and ``..._adapt_seconds_total``, from the adapter's own record."""

    def __init__(self, adapting) -> None:
        self.adapting = adapting

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        adapter = self.adapting.adapter
        updates = list(adapter.updates)
        yield GaugeMetricFamily(f"{PREFIX}local_draft_version", "Version of the local draft's weights (0: as shipped)",
                                value=adapter.version)
        yield GaugeMetricFamily(f"{PREFIX}local_draft_adapting", "1 while a fine-tune of the local draft runs",
                                value=int(self.adapting.training))
        outcomes = CounterMetricFamily(f"{PREFIX}local_draft_adapt_updates", "Fine-tunes of the local draft, by the "
                                       "guard's outcome", labels=["outcome"])
        for outcome in ("adopted", "reverted", "kept"):
            outcomes.add_metric([outcome], sum(u.outcome == outcome for u in updates))
        outcomes.add_metric(["failed"], self.adapting.failed)
        yield outcomes
        acceptance = GaugeMetricFamily(f"{PREFIX}local_draft_adapt_acceptance", "Held-back greedy acceptance at the last "
                                       "fine-tune, of the weights live before it, its candidate, the shipped ones and those "
                                       "live after it", labels=["weights"])
        if updates:
            for weights in ("before", "candidate", "shipped", "after"):
                acceptance.add_metric([weights], getattr(updates[-1], weights))
        yield acceptance
        yield CounterMetricFamily(f"{PREFIX}local_draft_adapt_seconds", "Seconds spent fine-tuning and judging the local draft",
                                  value=adapter.seconds)


class JsonLog:
    """One JSON object per line: ``{"ts": ..., "event": ..., ...}``."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr

    def event(self, event: str, **fields) -> None:
        self.write({"ts": round(time.time(), 6), "event": event, **fields})

    def write(self, event: dict) -> None:
        """One already-built event (e.g. :meth:`goodspeed.verifier.records.RoundRecord.to_event`)."""
        self.stream.write(json.dumps(event) + "\n")
        self.stream.flush()
