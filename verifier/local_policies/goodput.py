"""``goodput``: each request drafts its own paying length, 0 where speculation does not pay."""

from __future__ import annotations

import math

from goodspeed.scheduler import EvidenceAcceptance, PayingLength, paying_batch_lengths, plain_steps
from goodspeed.verifier.local_policies.base import LocalPolicy, Plan


class GoodputChains(LocalPolicy):
    """``goodput``: each request drafts the length (at most ``max_k``) that, with the others',
    gives the batch the most expected tokens per second (:func:`goodspeed.scheduler.paying_batch_lengths`),
    from each request's acceptance (its verdicts' accepted tokens and rejections, a new request
    starting from the recent requests': :class:`~goodspeed.scheduler.PayingLength`) and the step's
    measured costs: a round's time fitted against the tokens it verified and its longest chain
    (:meth:`~goodspeed.scheduler.PayingLength.batch_costs`: one row drafting six costs more than
    six rows drafting one), the draft's forward time per drafting step. A request whose
    drafts do not pay drafts nothing, and one token after ``probe_every`` steps to hear its
    acceptance again (longer after rejected probes: :meth:`~goodspeed.scheduler.PayingLength.probed`).
    The first step, with nothing measured, drafts ``k`` (nothing under a ``floor``).

    A draft source that proposes at no cost (a lookup: ``free_proposals``) is asked for every
    request's longest chain first, and each keeps the prefix that pays
    (:func:`goodspeed.scheduler.paying_lengths`), its tokens taken at the acceptance of the
    lookup's evidence (the context it matched; :class:`~goodspeed.scheduler.EvidenceAcceptance`),
    tokens a grammar forces at 1. A weak match drafts nothing where the batch's step makes its
    tokens cost more than they bring, a long one drafts long.

    Most tokens a second for the batch can slow one request: a request whose own drafts do not pay
    still waits on the step that verifies the others'. ``floor`` (``LocalConfig.floor``; 0, the
    default, is off) keeps every request at that fraction of plain decoding's pace over its life.
    Each request keeps a credit, the tokens it got less ``floor`` times the steps it waited on,
    each counted in steps of plain decoding by the fitted costs
    (:func:`~goodspeed.scheduler.plain_steps`), and the batch's lengths are chosen among those
    after which every request is expected to keep a non-negative credit
    (:func:`goodspeed.scheduler.paying_lengths`). A request that drafts well builds credit that
    others' drafts may spend; one that never does lets them spend ``1 - floor`` of a step a step,
    and one left behind (drafts the estimates took for paying that did not) holds the others'
    drafts until it is ahead again. The lookups' and the planning's own time is not counted."""

    name = "goodput"

    def __init__(self, serving):
        super().__init__(serving)
        self.costs = PayingLength()
        self.evidence = EvidenceAcceptance()
        self._seen: dict[str, tuple[int, int]] = {}  # a request's drafted and accepted totals at its last plan
        self._looked: dict[str, tuple[int, int, int, bool]] = {}  # a lookup's last plan: evidence, forced, kept, probe
        self._drafted = self._longest = 0
        self._drafting_s = 0.0
        self.floor = serving.config.floor
        self.credit: dict[str, float] = {}  # a request's tokens ahead of floor x plain decoding's, so far
        self._generated: dict[str, int] = {}  # a request's tokens at its last plan
        self._plain_steps = 1.0  # the last step's cost in plain steps, as planned

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
            self._looked.pop(gone, None)
            self.credit.pop(gone, None)
            self._generated.pop(gone, None)
            self.costs.forget(gone)
            self.evidence.forget(gone)
        for r in reqs:  # each request's last verdict, from its running totals: accepted tokens and a rejection
            before = self._seen.get(r.request_id, (0, 0))
            drafted, accepted = r.drafted - before[0], r.accepted - before[1]
            self.costs.observe_round(r.request_id, drafted, accepted, math.nan)
            if drafted and (looked := self._looked.pop(r.request_id, None)) is not None:
                evidence, forced, kept, probe = looked
                self.evidence.observe(r.request_id, evidence, kept - forced, max(0, accepted - forced), probe)
            self._seen[r.request_id] = (r.drafted, r.accepted)
        if self.floor:  # each request's credit after the last step: the tokens it got, the step's cost
            for r in reqs:
                if (before := self._generated.get(r.request_id)) is not None:
                    got = len(r.generated) - before
                    self.credit[r.request_id] = self.credit.get(r.request_id, 0.0) + got - self.floor * self._plain_steps
                self._generated[r.request_id] = len(r.generated)
            self._plain_steps = 1.0
        costs = self.costs.batch_costs()
        if costs is not None and getattr(s.draft, "free_proposals", False):
            return self._plan_lookups(reqs, costs), None
        if costs is None:  # nothing measured: k, or nothing where a floor must not be risked on a guess
            lengths = {r.request_id: 0 if self.floor else min(cfg.k, r.cap) for r in reqs}
        else:
            acceptance = [self.costs.acceptance(r.request_id) for r in reqs]
            costs = (costs[0], costs[1], s.draft_forward_s + costs[2])
            chosen = paying_batch_lengths(acceptance, cfg.max_k, *costs, *self._floor(reqs))
            lengths = {r.request_id: min(self.costs.probed(r.request_id, n), r.cap) for r, n in zip(reqs, chosen)}
            self._planned([lengths[r.request_id] for r in reqs], costs)
        self._drafted = sum(lengths.values())
        self._longest = max(lengths.values(), default=0)
        started = s.clock.now()
        plans = s.timed_chains(reqs, lengths)
        self._drafting_s = s.clock.now() - started
        return plans, None

    def observe(self, batch_size, k, emitted, duration_s, prefill_tokens=0):
        if not prefill_tokens:  # a step that prefilled a prompt too says nothing of what drafted tokens cost
            self.costs.observe_round("batch", self._drafted, 0, duration_s - self._drafting_s, longest=self._longest)

    def _plan_lookups(self, reqs, costs) -> dict[str, Plan]:
        """Every request's longest lookup (grammar-forced tokens first), then the prefixes that
        pay, by each proposal's evidence; an evidence class no request drafts is probed now and
        then (:meth:`~goodspeed.scheduler.EvidenceAcceptance.keep`)."""
        s, cfg = self.serving, self.serving.config
        started = s.clock.now()
        drafts = s.draft_chains(reqs, {r.request_id: min(cfg.max_k, r.cap) for r in reqs})
        proposals = [(r.request_id, drafts[r.request_id].evidence or 0, drafts[r.request_id].forced,
                      len(drafts[r.request_id].token_ids)) for r in reqs]
        plans = {}
        kept = self.evidence.keep(proposals, *costs, *self._floor(reqs))
        self._planned([n for n, _ in kept], costs)
        for (rid, evidence, forced, _), (n, probe) in zip(proposals, kept):
            s.totals["forced"] -= max(0, forced - n)  # counted as drafted, then cut
            if n > forced:
                self._looked[rid] = (evidence, forced, n, probe)
            d, q = drafts[rid], drafts[rid].q_rows()
            plans[rid] = Plan(d.token_ids[:n], None, q[:n] if q is not None and n else None)
        self._drafted = sum(len(p.token_ids) for p in plans.values())
        self._longest = max((len(p.token_ids) for p in plans.values()), default=0)
        self._drafting_s = s.clock.now() - started
        return plans

    def _floor(self, reqs) -> tuple[list[float] | None, float]:
        """``(credit, floor)`` for :func:`~goodspeed.scheduler.paying_lengths`: each request's
        credit (0 for a new one)."""
        return ([self.credit.get(r.request_id, 0.0) for r in reqs], self.floor) if self.floor else (None, 0.0)

    def _planned(self, lengths, costs) -> None:
        """The planned step's cost in plain steps (probes included), which its requests' credits pay."""
        if self.floor:
            self._plain_steps = plain_steps(lengths, *costs)
