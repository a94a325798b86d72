"""``adaserve``: AdaServe (Li et al., arXiv 2501.12162, Alg. 2)."""

from __future__ import annotations

import numpy as np

from goodspeed.lm.runtime.batch_draft import subtree
from goodspeed.lm.decoding.draft_source import draft_trees_with_forced
from goodspeed.scheduler import select_tree_nodes, slo_need, speculation_shape
from goodspeed.verifier.local_policies.base import LocalPolicy, Plan


class AdaServeTrees(LocalPolicy):
    """Beam-search candidate trees with depth and width from eqs. (8)-(9), SLO-customized then
    throughput-optimized node selection under the budget ``B``, where ``A(r) = (l + t_spec) /
    t_TPOT - o`` with ``l`` the time since the request's decoding began, ``o`` its tokens so far and
    ``t_spec`` the smoothed iteration time. When the ``n`` requests' roots take the whole budget
    (``n >= B``) Alg. 2 can select no node, so the iteration drafts nothing and decodes plainly.
    Grammar-forced tokens are the trunk of a request's tree; a ``LOOKUP+MODEL`` source adds the
    lookup's chain as a branch. Every node is deterministic and verified as a point mass."""

    name = "adaserve"

    @staticmethod
    def drafting(config):
        return 0, (config.max_depth, config.max_width)

    def plan(self, reqs):
        s, cfg = self.serving, self.serving.config
        budget = cfg.budget
        if len(reqs) >= budget:  # every root costs one unit (Alg. 2 line 7): none is left for a node, so none is drafted
            return {r.request_id: Plan([]) for r in reqs}, None
        depth, width = speculation_shape(budget, len(reqs), cfg.max_depth, cfg.max_width)
        sampling, histories = s.draft_settings(reqs)
        trees, forced = draft_trees_with_forced(s.draft, {r.request_id: r.committed for r in reqs}, depth, width,
                                                sampling, {r.request_id: r.cap for r in reqs}, histories)
        s.totals["forced"] += forced
        now = s.clock.now()
        need = np.zeros(len(reqs))  # no SLO: only the throughput phase grows its tree
        timed = [i for i, r in enumerate(reqs) if r.tpot_slo_s is not None]
        if timed:  # one array op for every request with an SLO, not one a request
            need[timed] = slo_need([now - reqs[i].decode_start for i in timed], s.t_spec_s,
                                   [reqs[i].tpot_slo_s for i in timed], [len(reqs[i].generated) for i in timed])
        depths = [min(depth, r.cap) for r in reqs]
        # The beam trees as they are: valid by construction (parents first, path probabilities in
        # (0, 1]), so not re-checked as CandidateTrees.
        chosen = select_tree_nodes([trees[r.request_id] for r in reqs], need, budget, cfg.max_slo_tree_size, depths=depths)
        plans = {}
        for r, nodes in zip(reqs, chosen.selected):
            tokens, parents = subtree(trees[r.request_id], nodes)
            plans[r.request_id] = Plan(tokens, parents if tokens else None)
        return plans, None
