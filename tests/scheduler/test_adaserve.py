import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from goodspeed.lm.decoding.proposals import BeamTree
from goodspeed.scheduler.adaserve import CandidateTree, select_tree_nodes, slo_need, speculation_shape, tree_depth


def figure2_trees():
    """AdaServe Figure 2: two candidate trees from 3 beam-search steps with w = 2.

    Node k is t_{k+1}; the figure gives f(t1^(0)) = 0.7, f(t1^(1)) = 0.5, f(t2^(1)) = 0.4 and says
    the throughput phase then adds t3^(0), t3^(1), t5^(0), the largest remaining. The other
    probabilities are chosen consistent with that.
    """
    r0 = CandidateTree(parents=[-1, -1, 0, 0, 2, 2], path_probs=[0.7, 0.25, 0.6, 0.08, 0.45, 0.1])
    r1 = CandidateTree(parents=[-1, -1, 0, 1, 2, 3], path_probs=[0.5, 0.4, 0.48, 0.3, 0.2, 0.1])
    return [r0, r1]


def test_figure2_worked_example():
    sel = select_tree_nodes(figure2_trees(), need=[0.6, 0.8], budget=8, max_slo_tree_size=8, root_credit=0.0)
    # SLO phase: r1 first (larger A): t1, t2; then r0: t1. Throughput phase: t3^(0), t3^(1), t5^(0).
    assert sel.slo_order.tolist() == [1, 0]
    assert sel.slo_nodes.tolist() == [1, 2]
    assert sel.selected[0].tolist() == [0, 2, 4]  # t1, t3, t5 of r0
    assert sel.selected[1].tolist() == [0, 1, 2]  # t1, t2, t3 of r1
    assert sum(len(s) for s in sel.selected) + 2 == 8
    assert sel.expected_accepted.tolist() == pytest.approx([0.7 + 0.6 + 0.45, 0.5 + 0.4 + 0.48])


def test_root_credit_counts_toward_the_need():
    # With Alg. 2's own n_acc = 1 start, needs of 0.6 and 0.8 are met by the roots alone.
    sel = select_tree_nodes(figure2_trees(), need=[0.6, 0.8], budget=8, max_slo_tree_size=8)
    assert sel.slo_nodes.tolist() == [0, 0]
    assert sum(len(s) for s in sel.selected) == 6


def test_n_max_limits_slo_phase_and_cap_uses_depth():
    sel = select_tree_nodes(figure2_trees(), need=[0.0, 9.0], budget=4, max_slo_tree_size=2, root_credit=0.0)
    assert sel.slo_nodes.tolist() == [0, 1]
    # A = 9 is capped at d + 1 = 4 but the budget ends first: 2 roots + 2 nodes.
    assert sum(len(s) for s in sel.selected) == 2


def reference(trees, need, budget, n_max, root_credit=1.0):
    """Alg. 2 written as plainly as possible: GetTop scans every frontier node each time."""
    n = len(trees)
    chosen = [set() for _ in range(n)]
    n_acc = [root_credit] * n
    left = budget - n
    a_cap = [min(need[i], trees[i].depth() + 1) for i in range(n)]

    def frontier(i):
        return [(-trees[i].path_probs[k], i, k) for k in range(trees[i].num_nodes)
                if k not in chosen[i] and (trees[i].parents[k] < 0 or trees[i].parents[k] in chosen[i])]

    for i in sorted(range(n), key=lambda i: -need[i]):
        while n_acc[i] < a_cap[i] and 1 + len(chosen[i]) < n_max and left > 0 and frontier(i):
            _, _, k = min(frontier(i))
            chosen[i].add(k)
            n_acc[i] += trees[i].path_probs[k]
            left -= 1
    while left > 0:
        cands = [c for i in range(n) for c in frontier(i)]
        if not cands:
            break
        _, i, k = min(cands)
        chosen[i].add(k)
        left -= 1
    return [sorted(c) for c in chosen]


@st.composite
def instances(draw):
    n = draw(st.integers(1, 4))
    trees = []
    for _ in range(n):
        size = draw(st.integers(0, 8))
        parents, probs = [], []
        for k in range(size):
            p = draw(st.integers(-1, k - 1))
            q = draw(st.sampled_from([0.1, 0.3, 0.5, 0.5, 0.9, 1.0]))
            parents.append(p)
            probs.append(q * (1.0 if p < 0 else probs[p]))
        trees.append(CandidateTree(np.array(parents, dtype=np.int64), np.array(probs)))
    need = draw(st.lists(st.floats(-1, 6), min_size=n, max_size=n))
    budget = draw(st.integers(n, n + 20))
    n_max = draw(st.integers(1, 6))
    return trees, need, budget, n_max


@settings(max_examples=300, deadline=None)
@given(instances())
def test_matches_reference_and_forms_valid_trees_within_budget(inst):
    trees, need, budget, n_max = inst
    sel = select_tree_nodes(trees, need, budget, n_max)
    assert [s.tolist() for s in sel.selected] == reference(trees, need, budget, n_max)
    assert sum(len(s) for s in sel.selected) + len(trees) <= budget
    for tree, nodes in zip(trees, sel.selected):
        chosen = set(nodes.tolist())
        assert all(tree.parents[k] < 0 or tree.parents[k] in chosen for k in chosen)


@settings(max_examples=200, deadline=None)
@given(instances())
def test_trees_given_as_lists_select_what_candidate_trees_do(inst):
    """Local serving passes its beam trees' lists as they are (TreeLike), unchecked: the same
    selection and expected tokens as through CandidateTree, with each tree's depth as default."""
    trees, need, budget, n_max = inst
    as_lists = [BeamTree([0] * t.num_nodes, t.parents.tolist(), t.path_probs.tolist(), []) for t in trees]
    checked, unchecked = (select_tree_nodes(ts, need, budget, n_max) for ts in (trees, as_lists))
    assert [s.tolist() for s in unchecked.selected] == [s.tolist() for s in checked.selected]
    assert unchecked.expected_accepted.tolist() == checked.expected_accepted.tolist()
    assert [tree_depth(t.parents) for t in as_lists] == [t.depth() for t in trees]


@settings(max_examples=200, deadline=None)
@given(instances())
def test_slo_phase_serves_requests_by_descending_need(inst):
    trees, need, budget, n_max = inst
    sel = select_tree_nodes(trees, need, budget, n_max)
    order = sel.slo_order.tolist()
    assert [need[i] for i in order] == sorted(need, reverse=True)
    # Once a request is cut short by the budget, nobody after it in the order got SLO nodes.
    spent = len(trees)
    for pos, i in enumerate(order):
        spent += int(sel.slo_nodes[i])
        if spent == budget:
            assert all(sel.slo_nodes[j] == 0 for j in order[pos + 1 :])
            break


def test_need_and_shape_formulas():
    assert slo_need(latency_s=[0.5], spec_time_s=0.1, tpot_slo_s=[0.05], num_decoded=[10]).tolist() == pytest.approx([2.0])
    assert speculation_shape(8, 2, 3, 2) == (3, 2)
    assert speculation_shape(512, 64, 16, 8) == (8, 8)
    assert speculation_shape(10, 20, 4, 4) == (1, 1)
    with pytest.raises(ValueError):
        slo_need([0.1], 0.1, [0.0], [1])


@pytest.mark.parametrize(
    "call",
    [
        lambda: select_tree_nodes(figure2_trees(), [1.0, 1.0], budget=1, max_slo_tree_size=2),
        lambda: select_tree_nodes(figure2_trees(), [1.0], budget=8, max_slo_tree_size=2),
        lambda: CandidateTree(parents=[0], path_probs=[0.5]),
        lambda: CandidateTree(parents=[-1], path_probs=[1.5]),
    ],
)
def test_bad_input(call):
    with pytest.raises(ValueError):
        call()
