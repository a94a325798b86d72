"""``tetris``: TETRIS (Wu et al., ACL 2025, arXiv 2502.15197, Alg. 1)."""

from __future__ import annotations

import numpy as np

from goodspeed.scheduler import presample_scores, select_by_scores
from goodspeed.verifier.local_policies.base import LocalPolicy, Plan


class TetrisSelection(LocalPolicy):
    """Each request drafts ``k + extra`` tokens; the batch verifies the ``capacity`` (default
    ``k`` per request) most probable. Sampled tokens are ranked by the confidence known before each
    was drawn (:meth:`scores`): ranking them by their own sampled values would condition them and
    bias the output."""

    name = "tetris"

    @staticmethod
    def drafting(config):
        return config.k + config.extra, None

    def plan(self, reqs):
        s, cfg = self.serving, self.serving.config
        drafts = s.draft_chains(reqs, {r.request_id: min(cfg.k + cfg.extra, r.cap) for r in reqs})
        capacity = cfg.capacity if cfg.capacity is not None else cfg.k * len(reqs)
        keep = select_by_scores(self.scores([drafts[r.request_id] for r in reqs]), capacity)
        plans = {}
        for r, n in zip(reqs, keep.tolist()):
            d = drafts[r.request_id]
            plans[r.request_id] = Plan(d.token_ids[:n], None, d.q_rows()[:n] if d.q_rows() is not None else None)
        return plans, None

    @staticmethod
    def scores(drafts: list) -> list[np.ndarray]:
        """Log scores ranked by TETRIS: each position's confidence known before its token was drawn
        (:func:`~goodspeed.scheduler.presample_scores`), so the selection keeps sampled tokens exact;
        for greedy drafts these are TETRIS's cumulative draft probabilities."""
        return presample_scores([np.array(d.token_probs) for d in drafts], [np.array(d.expected_probs) for d in drafts])
