"""``chain``: every request drafts the same ``k`` tokens each iteration."""

from __future__ import annotations

from goodspeed.verifier.local_policies.base import LocalPolicy


class FixedChains(LocalPolicy):
    """Every request drafts ``k`` tokens (fewer near its end)."""

    name = "chain"

    @staticmethod
    def drafting(config):
        return config.k, None

    def plan(self, reqs):
        k = self.serving.config.k
        return self.serving.chains(reqs, {r.request_id: min(k, r.cap) for r in reqs}), k
