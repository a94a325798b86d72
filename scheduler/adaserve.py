"""AdaServe: SLO-customized selection of draft token trees under a verification budget.

Implements AdaServe (Li et al., "AdaServe: SLO-customized LLM serving with fine-grained speculative
decoding", arXiv 2501.12162):

* Section 3: a request needs ``A(r) = (l + t_spec) / t_TPOT - o`` accepted tokens this iteration
  to stay within its TPOT SLO (``l`` latency so far, ``o`` tokens decoded so far), and the
  expected number accepted from a tree is the sum of its nodes' path probabilities (Thm 3.1).
* Section 4.3: ``A_cap(r) = min(A(r), d + 1)`` (a depth-``d`` tree cannot yield more).
* Section 5.2, eqs. (8)-(9): speculation depth ``d = max(1, min(D_max, ceil(B / n)))`` and beam
  width ``w = max(1, min(W_max, floor(B / n)))``.
* Algorithm 2: every request's root costs one unit of budget and counts as one expected token
  (line 6, ``n_acc <- 1``); SLO-customized selection visits requests by descending ``A`` and adds
  each one's most probable candidate nodes until ``n_acc >= A_cap``, its tree has ``n_max``
  nodes, or the budget is gone; throughput-optimized selection then spends what is left on the
  most probable nodes of all candidate trees.

``GetTop`` draws from each tree's frontier (nodes whose parent is already in the tree), so every
selection is a valid tree even where approximated path probabilities tie or are not monotone; with
products of draft probabilities (monotone along a path) this equals the paper's global top node.
Alg. 2 writes its loops as ``while B >= 0``; that would spend one unit more than ``B``, so here
they stop at ``B = 0`` and the trees hold at most ``B`` nodes, roots included (eq. 1).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


def slo_need(latency_s, spec_time_s: float, tpot_slo_s, num_decoded) -> np.ndarray:
    """``A(r) = (l + t_spec) / t_TPOT - o`` per request (may be <= 0: the SLO is already safe)."""
    tpot = np.asarray(tpot_slo_s, dtype=np.float64)
    if np.any(tpot <= 0):
        raise ValueError("TPOT SLOs must be > 0")
    return (np.asarray(latency_s, dtype=np.float64) + spec_time_s) / tpot - np.asarray(num_decoded, dtype=np.float64)


def speculation_shape(budget: int, num_requests: int, max_depth: int, max_width: int) -> tuple[int, int]:
    """Eqs. (8)-(9): candidate-tree depth and beam width for ``n`` requests under budget ``B``.

    >>> speculation_shape(64, 10, 8, 4)  # ceil(6.4) = 7, floor(6.4) = 6 -> capped at 4
    (7, 4)
    """
    if num_requests <= 0 or budget <= 0 or max_depth <= 0 or max_width <= 0:
        raise ValueError("budget, num_requests, max_depth and max_width must be > 0")
    depth = max(1, min(max_depth, math.ceil(budget / num_requests)))
    width = max(1, min(max_width, budget // num_requests))
    return depth, width


@dataclass(frozen=True)
class CandidateTree:
    """A request's candidate token tree, drafted nodes only (the root is implicit).

    ``parents[k]`` is the index of node ``k``'s parent, or -1 when the parent is the root;
    parents come before children. ``path_probs[k]`` is the approximated path probability
    ``f(k)``: the product of draft probabilities from the root down to ``k``.
    """

    parents: np.ndarray  # [num_nodes] int
    path_probs: np.ndarray  # [num_nodes] float

    def __post_init__(self) -> None:
        parents = np.asarray(self.parents, dtype=np.int64).reshape(-1)
        probs = np.asarray(self.path_probs, dtype=np.float64).reshape(-1)
        if parents.shape != probs.shape:
            raise ValueError("parents and path_probs must have one entry per node")
        if np.any(parents >= np.arange(parents.size)) or np.any(parents < -1):
            raise ValueError("each parent must be -1 (root) or an earlier node")
        if np.any(~np.isfinite(probs)) or np.any((probs < 0) | (probs > 1)):
            raise ValueError("path probabilities must lie in [0, 1]")
        object.__setattr__(self, "parents", parents)
        object.__setattr__(self, "path_probs", probs)

    @property
    def num_nodes(self) -> int:
        return int(self.parents.size)

    def depth(self) -> int:
        """Depth of the deepest node (root = 0); computed from ``parents``."""
        return tree_depth(self.parents)


class TreeLike(Protocol):
    """What :func:`select_tree_nodes` reads of a tree: :class:`CandidateTree`'s two fields, as
    arrays or lists. A :class:`CandidateTree` checks them; a caller that builds valid trees itself
    (local serving's beam search) may pass them as they are, without the checks' cost."""

    parents: Sequence[int]
    path_probs: Sequence[float]


def tree_depth(parents: Sequence[int]) -> int:
    """Depth of the deepest node of a tree given by its ``parents`` (parents first; root = 0)."""
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return max(depth, default=0)


@dataclass(frozen=True)
class TreeSelection:
    """Alg. 2's output: per request, the selected node indices (ascending) and bookkeeping."""

    selected: list[np.ndarray]
    expected_accepted: np.ndarray  # [n] n_acc: root credit + sum of selected path probabilities
    slo_nodes: np.ndarray  # [n] nodes added during SLO-customized selection
    slo_order: np.ndarray  # [n] request indices in the order the SLO phase served them


class _Frontier:
    """Nodes of one tree whose parent is selected, best approximated path probability first."""

    def __init__(self, request: int, tree: TreeLike) -> None:
        self.request, self.tree = request, tree
        self.children: list[list[int]] = [[] for _ in range(len(tree.parents) + 1)]  # slot 0 = root
        for k, p in enumerate(tree.parents):
            self.children[p + 1].append(k)
        self.heap: list[tuple[float, int, int]] = []
        self._push_children(-1)

    def _push_children(self, node: int) -> None:
        for k in self.children[node + 1]:
            heapq.heappush(self.heap, (-float(self.tree.path_probs[k]), self.request, k))

    def top(self) -> tuple[float, int, int] | None:
        return self.heap[0] if self.heap else None

    def pop(self) -> int:
        _, _, node = heapq.heappop(self.heap)
        self._push_children(node)
        return node


def select_tree_nodes(
    trees: Sequence[TreeLike],
    need: Sequence[float] | np.ndarray,
    budget: int,
    max_slo_tree_size: int,
    depths: Sequence[int] | None = None,
    root_credit: float = 1.0,
) -> TreeSelection:
    """Algorithm 2's two selection phases over given candidate trees.

    ``need[i]`` is ``A(r_i)``; ``A_cap = min(A, d_i + 1)`` with ``d_i`` from ``depths`` (default:
    each tree's own depth). ``max_slo_tree_size`` is ``n_max``: the SLO phase stops growing a tree
    once it holds that many nodes, root included. ``root_credit`` is Alg. 2's initial
    ``n_acc = 1``, the root's guaranteed token; AdaServe's Figure 2 states its thresholds over
    drafted nodes only, which is ``root_credit = 0``.
    """
    n = len(trees)
    a = np.asarray(need, dtype=np.float64).reshape(-1)
    if a.size != n or np.any(np.isnan(a)):
        raise ValueError("need one A(r) per tree")
    if budget < n:
        raise ValueError(f"budget {budget} cannot cover the {n} roots")
    if max_slo_tree_size < 1:
        raise ValueError("max_slo_tree_size counts the root, so it must be >= 1")
    d = np.array([tree_depth(t.parents) for t in trees] if depths is None else depths, dtype=np.float64)
    a_cap = np.minimum(a, d + 1.0)
    frontiers = [_Frontier(i, t) for i, t in enumerate(trees)]
    chosen: list[list[int]] = [[] for _ in range(n)]
    n_acc = np.full(n, float(root_credit))
    left = int(budget) - n
    order = np.argsort(-a, kind="stable")
    slo_nodes = np.zeros(n, dtype=np.int64)
    for i in order:  # SLO-customized selection
        f = frontiers[i]
        while n_acc[i] < a_cap[i] and 1 + len(chosen[i]) < max_slo_tree_size and left > 0 and f.top():
            node = f.pop()
            chosen[i].append(node)
            n_acc[i] += trees[i].path_probs[node]
            slo_nodes[i] += 1
            left -= 1
    _throughput_phase(frontiers, trees, chosen, n_acc, left)
    return TreeSelection(
        selected=[np.sort(np.array(c, dtype=np.int64)) for c in chosen],
        expected_accepted=n_acc,
        slo_nodes=slo_nodes,
        slo_order=order.astype(np.int64),
    )


def _throughput_phase(frontiers, trees, chosen, n_acc, left: int) -> None:
    """Spend the remaining budget on the best frontier node across all trees (Alg. 2, 18-23)."""
    tops = [(f.top(), i) for i, f in enumerate(frontiers) if f.top()]
    heap = [top for top, _ in tops]
    heapq.heapify(heap)
    while left > 0 and heap:
        _, i, _ = heapq.heappop(heap)
        node = frontiers[i].pop()
        chosen[i].append(node)
        n_acc[i] += trees[i].path_probs[node]
        left -= 1
        nxt = frontiers[i].top()
        if nxt:
            heapq.heappush(heap, nxt)
