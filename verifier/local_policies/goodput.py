"""``goodput``: each request drafts its own paying length, 0 where speculation does not pay."""

from __future__ import annotations

import math

from goodspeed.scheduler import PayingLength, paying_batch_lengths
from goodspeed.verifier.local_policies.base import LocalPolicy


class GoodputChains(LocalPolicy):
    """``goodput``: each request drafts the length (at most ``max_k``) that, with the others',
    gives the batch the most expected tokens per second (:func:`goodspeed.scheduler.paying_batch_lengths`),
    from each request's acceptance (its verdicts' accepted tokens and rejections, a new request
    starting from the recent requests': :class:`~goodspeed.scheduler.PayingLength`) and the step's
    measured costs: a round's time fitted against the tokens it verified, the draft's forward
    time per drafting step. A request whose
    drafts do not pay drafts nothing, and one token after ``probe_every`` steps to hear its
    acceptance again (longer after rejected probes: :meth:`~goodspeed.scheduler.PayingLength.probed`). The first step, with nothing measured, drafts ``k``."""

    name = "goodput"

    def __init__(self, serving):
        super().__init__(serving)
        self.costs = PayingLength()
        self._seen: dict[str, tuple[int, int]] = {}  # a request's drafted and accepted totals at its last plan
        self._drafted = 0
        self._drafting_s = 0.0

    @staticmethod
    def check(config):
        if config.max_k < 1:
            raise ValueError("goodput needs max_k >= 1")

    @staticmethod
    def drafting(config):
        return max(config.k, config.max_k), None

    def plan(self, reqs):
        s, cfg = self.serving, self.serving.config
        current = {r.request_id for r in reqs}
        for gone in [key for key in self._seen if key not in current]:  # finished (or prefilling again): forgotten
            del self._seen[gone]
            self.costs.forget(gone)
        for r in reqs:  # each request's last verdict, from its running totals: accepted tokens and a rejection
            before = self._seen.get(r.request_id, (0, 0))
            self.costs.observe_round(r.request_id, r.drafted - before[0], r.accepted - before[1], math.nan)
            self._seen[r.request_id] = (r.drafted, r.accepted)
        costs = self.costs.round_costs()
        if costs is None:
            lengths = {r.request_id: min(cfg.k, r.cap) for r in reqs}
        else:
            acceptance = [self.costs.acceptance(r.request_id) for r in reqs]
            chosen = paying_batch_lengths(acceptance, cfg.max_k, costs[0], costs[1], s.draft_forward_s)
            lengths = {r.request_id: min(self.costs.probed(r.request_id, n), r.cap) for r, n in zip(reqs, chosen)}
        self._drafted = sum(lengths.values())
        started = s.clock.now()
        plans = s.timed_chains(reqs, lengths)
        self._drafting_s = s.clock.now() - started
        return plans, None

    def observe(self, batch_size, k, emitted, duration_s):
        self.costs.observe_round("batch", self._drafted, 0, duration_s - self._drafting_s)
