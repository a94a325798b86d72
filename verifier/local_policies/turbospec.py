"""``turbospec``: TurboSpec (Liu et al., arXiv 2406.14066, Listing 2)."""

from __future__ import annotations

from goodspeed.scheduler import choose_proposal_length
from goodspeed.verifier.local_policies.base import LocalPolicy


class TurboSpecChains(LocalPolicy):
    """The ``k`` (0 included) that maximises predicted goodput under the profiled latency models,
    from the requests' smoothed acceptances."""

    name = "turbospec"

    @staticmethod
    def check(config):
        if config.latency is None:
            raise ValueError("the turbospec policy needs a latency profile: run `goodspeed profile` and pass --latency-profile")

    @staticmethod
    def drafting(config):
        return config.max_k, None

    def plan(self, reqs):
        s, cfg = self.serving, self.serving.config
        acceptance = [s.acceptance(r) for r in reqs]
        context = sum(len(r.committed) for r in reqs)
        k = choose_proposal_length(acceptance, context, cfg.latency.target, cfg.latency.draft, cfg.max_k).k
        return s.chains(reqs, {r.request_id: min(k, r.cap) for r in reqs}), k
