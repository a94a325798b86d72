"""``nightjar``: Nightjar (Li et al., arXiv 2512.22420, Alg. 1)."""

from __future__ import annotations

from goodspeed.scheduler import NightjarBandit
from goodspeed.verifier.local_policies.base import LocalPolicy


class NightjarChains(LocalPolicy):
    """A bandit over ``k`` per batch size, rewarded with each step's measured goodput, the draft
    catch-up forward as its switching cost."""

    name = "nightjar"

    def __init__(self, serving):
        super().__init__(serving)
        self.bandit = NightjarBandit(serving.config.max_k)

    @staticmethod
    def check(config):
        if config.max_k < 1:
            raise ValueError("nightjar needs max_k >= 1")

    @staticmethod
    def drafting(config):
        return config.max_k, None

    def plan(self, reqs):
        s = self.serving
        k = self.bandit.choose_arm(len(reqs), s.rng, prefill_cost_s=s.draft_forward_s)
        return s.timed_chains(reqs, {r.request_id: min(k, r.cap) for r in reqs}), k

    def observe(self, batch_size, k, emitted, duration_s, prefill_tokens=0):
        if k is not None and duration_s > 0:
            self.bandit.observe(batch_size, k, emitted / duration_s)
