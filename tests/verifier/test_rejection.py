"""Distribution tests: speculative verification must reproduce the target's own samples."""

import functools

import numpy as np
import pytest
import torch

from goodspeed.lm.decoding.sampling import process_logits, sample_from
from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.verifier.rejection import verify_chains, verify_greedy_chains, verify_greedy_trees, verify_tree

V = 6


@functools.lru_cache(maxsize=None)
def _logits(prefix, seed):
    rng = np.random.default_rng([seed, len(prefix), *prefix])
    return rng.normal(size=V) * 1.5


def logits_for(prefix, seed):
    return _logits(tuple(prefix), seed)


@functools.lru_cache(maxsize=None)
def _p(prefix):
    return torch.softmax(torch.tensor(logits_for(prefix, 1)), -1)


@functools.lru_cache(maxsize=None)
def _q(prefix, top_k):
    logits = torch.tensor(logits_for(prefix, 1) + logits_for(prefix, 2))
    return process_logits(logits, SamplingParams(temperature=1.0, top_k=top_k))


def p_dist(prefix):
    return _p(tuple(prefix))


def q_dist(prefix, top_k=0):
    """Correlated with p but different, optionally truncated (then it is sparse)."""
    return _q(tuple(prefix), top_k)


def exact_pairs():
    out = np.zeros((V, V))
    p1 = p_dist([]).numpy()
    for a in range(V):
        out[a] = p1[a] * p_dist([a]).numpy()
    return out


def chain_round(prefixes, num_drafted, rng, top_k=0, lossy=False):
    """One speculative round for every prefix at once; returns the emitted tokens per row."""
    n = len(prefixes)
    tokens = np.zeros((n, num_drafted), dtype=np.int64)
    q = torch.zeros(n, num_drafted, V, dtype=torch.float64)
    p = torch.zeros(n, num_drafted + 1, V, dtype=torch.float64)
    for i, pre in enumerate(prefixes):
        cur = list(pre)
        for j in range(num_drafted + 1):
            p[i, j] = p_dist(cur)
            if j < num_drafted:
                q[i, j] = q_dist(cur, top_k)
                tokens[i, j] = rng.choice(V, p=q[i, j].numpy() / q[i, j].sum().item())
                cur.append(int(tokens[i, j]))
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    res = verify_chains(p, q, torch.tensor(tokens), torch.full((n,), num_drafted), torch.rand(n, num_drafted, generator=gen, dtype=torch.float64), torch.rand(n, generator=gen, dtype=torch.float64))
    out = []
    for i in range(n):
        m = int(res.num_accepted[i])
        nxt = int(res.next_token[i])
        if lossy and m < num_drafted:  # the known-wrong shortcut: resample from p, not the residual
            nxt = int(sample_from(p[i, m], torch.rand(1, dtype=torch.float64)).item())
        out.append([*tokens[i, :m].tolist(), nxt])
    return out


def sample_pairs(n, num_drafted, seed, **kw):
    rng = np.random.default_rng(seed)
    seqs = [[] for _ in range(n)]
    while True:
        todo = [i for i, s in enumerate(seqs) if len(s) < 2]
        if not todo:
            break
        for i, emitted in zip(todo, chain_round([seqs[i] for i in todo], num_drafted, rng, **kw)):
            seqs[i].extend(emitted)
    counts = np.zeros((V, V))
    for s in seqs:
        counts[s[0], s[1]] += 1
    return counts


def tv(counts):
    return 0.5 * np.abs(counts / counts.sum() - exact_pairs()).sum()


def chi2_stat(counts):
    expected = exact_pairs() * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


CHI2_CRIT_35DOF_P001 = 66.6  # chi-square 0.999 quantile with V*V - 1 = 35 degrees of freedom


@pytest.mark.parametrize("top_k", [0, pytest.param(2, marks=pytest.mark.slow)])  # truncation: test_lossless by default
def test_chain_sampling_matches_target_and_tv_shrinks(top_k):
    small = sample_pairs(1000, 3, seed=1, top_k=top_k)
    large = sample_pairs(16000, 3, seed=2, top_k=top_k)
    assert chi2_stat(large) < CHI2_CRIT_35DOF_P001
    assert tv(large) < tv(small)
    assert tv(large) < 0.04


def test_lossy_shortcut_is_detected():
    # Resampling from p instead of norm(max(0, p - q)) is biased; the same test must catch it.
    assert chi2_stat(sample_pairs(16000, 3, seed=3, lossy=True)) > 3 * CHI2_CRIT_35DOF_P001


def tree_sample(rng, sampled_children):
    """Depth-2, width-2 tree; children either iid from q (sampled) or q's top-2 (deterministic)."""
    tokens, parents, q_rows, prefixes = [], [], [], {-1: []}
    frontier = [-1]
    for _ in range(2):
        nxt = []
        for parent in frontier:
            pre = prefixes[parent]
            q = q_dist(pre)
            picks = rng.choice(V, size=2, p=q.numpy()) if sampled_children else torch.topk(q, 2).indices.numpy()
            for tok in picks:
                tokens.append(int(tok))
                parents.append(parent)
                q_rows.append(q)
                prefixes[len(tokens) - 1] = pre + [int(tok)]
                nxt.append(len(tokens) - 1)
        frontier = nxt
    target = torch.stack([p_dist(prefixes[k]) for k in range(-1, len(tokens))])
    u = torch.tensor(rng.random(len(tokens) + 1))
    draft = torch.stack(q_rows) if sampled_children else None
    res = verify_tree(target, torch.tensor(tokens), parents, u, draft)
    return [tokens[k] for k in res.accepted_nodes] + [res.next_token]


@pytest.mark.parametrize("sampled_children", [False, True])
def test_tree_sampling_matches_target(sampled_children):
    rng = np.random.default_rng(5)
    counts = np.zeros((V, V))
    for _ in range(12000):
        seq = tree_sample(rng, sampled_children)
        while len(seq) < 2:  # only the root's correction: one more plain target draw
            seq.append(int(rng.choice(V, p=p_dist(seq).numpy())))
        counts[seq[0], seq[1]] += 1
    assert chi2_stat(counts) < CHI2_CRIT_35DOF_P001
    assert tv(counts) < 0.04


def test_greedy_is_argmax_matching():
    logits = torch.tensor([[0.1, 2.0, 0.3], [1.0, 0.0, 0.5], [0.0, 0.0, 3.0]])
    p = process_logits(logits, SamplingParams())[None]  # one-hot rows: argmax 1, 0, 2
    draft = torch.tensor([[1, 2]])
    q = torch.nn.functional.one_hot(draft, 3).double()
    res = verify_chains(p.double(), q, draft, torch.tensor([2]), torch.zeros(1, 2, dtype=torch.float64), torch.full((1,), 0.99, dtype=torch.float64))
    assert res.num_accepted.tolist() == [1] and res.next_token.tolist() == [0]
    assert res.acceptance_ratios.tolist() == [[1.0, 0.0]]


def test_greedy_chains_equal_the_chain_rule_on_one_hot_distributions():
    """verify_greedy_chains (the engine's greedy path: argmax, then Python comparisons) gives what
    verify_chains gives on the one-hot p of the same logits and one-hot q of the drafts: ragged
    rows, empty drafts, ties (lowest id wins) and mismatches past the first rejection included."""
    gen = torch.Generator().manual_seed(3)
    for _ in range(200):
        batch, s_max, vocab = 4, 5, 6
        logits = torch.randint(0, 3, (batch, s_max + 1, vocab), generator=gen).float()  # many ties
        lengths = torch.randint(0, s_max + 1, (batch,), generator=gen)
        best = process_logits(logits, SamplingParams()).argmax(-1)
        drafts = []
        for b in range(batch):  # mostly the argmax, sometimes not
            row = [int(best[b, j]) if torch.rand(1, generator=gen) < 0.7 else int(torch.randint(0, vocab, (1,), generator=gen))
                   for j in range(int(lengths[b]))]
            drafts.append(row)
        fast = verify_greedy_chains(logits, drafts)
        padded = torch.tensor([d + [0] * (s_max - len(d)) for d in drafts])
        p = process_logits(logits, SamplingParams()).double()
        q = torch.nn.functional.one_hot(padded, vocab).double()
        ref = verify_chains(p, q, padded, lengths, torch.zeros(batch, s_max, dtype=torch.float64), torch.full((batch,), 0.5, dtype=torch.float64))
        for b, v in enumerate(fast):
            assert (v.num_accepted, v.next_token) == (int(ref.num_accepted[b]), int(ref.next_token[b]))
            assert v.ratios == ref.acceptance_ratios[b, : len(drafts[b])].tolist()


@pytest.mark.parametrize("sampled_children", [False, True])
def test_greedy_trees_equal_the_tree_rule_on_one_hot_distributions(sampled_children):
    """verify_greedy_trees (the engine's greedy tree path: argmax, then a walk on the host) gives
    what verify_tree gives on the one-hot p of the same logits: accepted path, correction-or-bonus
    token and tested ratios, for random trees with ties in the logits (lowest id wins), sibling
    duplicates, empty trees and, with sampled children, any q and any uniforms."""
    gen = torch.Generator().manual_seed(4)
    vocab = 5
    for _ in range(300):
        batch, n_max = 3, 7
        logits = torch.randint(0, 3, (batch, n_max + 1, vocab), generator=gen).float()  # many ties
        best = process_logits(logits, SamplingParams()).argmax(-1)
        tokens, parents = [], []
        for b in range(batch):
            n = int(torch.randint(0, n_max + 1, (1,), generator=gen))
            par = [int(torch.randint(-1, k, (1,), generator=gen)) for k in range(n)]
            # a node's token: its parent's argmax more often than chance, else any token
            tok = [int(best[b, p + 1]) if torch.rand(1, generator=gen) < 0.5 else int(torch.randint(0, vocab, (1,), generator=gen))
                   for p in par]
            tokens.append(tok)
            parents.append(par)
        fast = verify_greedy_trees(logits, tokens, parents)
        p = process_logits(logits, SamplingParams()).double()
        for b, v in enumerate(fast):
            n = len(tokens[b])
            q = None
            if sampled_children and n:
                q = torch.softmax(torch.randn(n, vocab, generator=gen, dtype=torch.float64), -1)
            u = torch.rand(n + 1, generator=gen, dtype=torch.float64)
            ref = verify_tree(p[b, : n + 1], torch.tensor(tokens[b], dtype=torch.long), parents[b], u, q)
            assert (v.accepted_nodes, v.next_token, v.tested_ratios) == (ref.accepted_nodes, ref.next_token, ref.tested_ratios)


def test_ragged_rows_and_empty_drafts():
    p = torch.softmax(torch.randn(2, 3, 4, dtype=torch.float64), -1)
    q = torch.softmax(torch.randn(2, 2, 4, dtype=torch.float64), -1)
    res = verify_chains(p, q, torch.tensor([[1, 2], [3, 0]]), torch.tensor([2, 0]), torch.zeros(2, 2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64))
    assert res.num_accepted[1] == 0 and res.acceptance_ratios[1].tolist() == [0.0, 0.0]
    assert res.acceptance_ratios[0].tolist() == pytest.approx((p[0, :2].gather(-1, torch.tensor([[1], [2]])).squeeze(-1) / q[0, :2].gather(-1, torch.tensor([[1], [2]])).squeeze(-1)).clamp(max=1).tolist())
    none = verify_chains(p, q[:, :0], torch.zeros(2, 0, dtype=torch.long), torch.tensor([0, 0]), torch.zeros(2, 0), torch.zeros(2, dtype=torch.float64))
    assert none.num_accepted.tolist() == [0, 0]


def test_chain_accept_test_compares_in_float64():
    """Regression: the chain test rounded its uniform to float32, so u = 0.75 - 2^-40 against a
    ratio of exactly 0.75 was a rejection."""
    p = torch.tensor([[[0.375, 0.625], [0.5, 0.5]]])  # float32, as the engine's work dtype
    q = torch.tensor([[[0.5, 0.5]]])
    res = verify_chains(p, q, torch.tensor([[0]]), torch.tensor([1]), torch.tensor([[0.75 - 2**-40]], dtype=torch.float64),
                        torch.tensor([0.1], dtype=torch.float64))
    assert res.num_accepted.tolist() == [1]
    assert res.acceptance_ratios.dtype == torch.float64 and res.acceptance_ratios.tolist() == [[0.75]]


def test_empty_residual_draws_from_the_target():
    """p and q agree to rounding except at the drafted token: max(0, p - q) is empty, and the
    correction is drawn from p (rejection.py's stated fallback), never from a zero vector."""
    q = torch.tensor([[[0.5, 0.25, 0.25]]], dtype=torch.float64)
    p = torch.tensor([[[0.5 - 1e-12, 0.25, 0.25], [1 / 3, 1 / 3, 1 / 3]]], dtype=torch.float64)
    assert float((p[0, 0] - q[0, 0]).clamp_min(0).sum()) == 0
    for u_sample in (0.1, 0.6, 0.9):
        res = verify_chains(p, q, torch.tensor([[0]]), torch.tensor([1]), torch.tensor([[1 - 1e-15]], dtype=torch.float64),
                            torch.tensor([u_sample], dtype=torch.float64))
        assert res.num_accepted.tolist() == [0]
        assert int(res.next_token) == int(sample_from(p[0, 0], torch.tensor(u_sample, dtype=torch.float64)))


def test_point_mass_rejection_never_returns_the_rejected_token():
    """A deterministic candidate (q = point mass) that is rejected leaves norm(p without it)."""
    p = torch.tensor([[0.2, 0.5, 0.3], [1.0, 0.0, 0.0]], dtype=torch.float64)
    for u in np.linspace(0, 0.999, 50):
        res = verify_tree(p, torch.tensor([1]), [-1], torch.tensor([0.6, u], dtype=torch.float64))
        assert res.accepted_nodes == [] and res.next_token != 1


def test_sparse_q_gives_the_verdicts_of_dense_q_without_densifying():
    """``DraftQ`` (what the engine verifies sampled chains with) against ``dense_q`` + the dense
    ``verify_chains``: the same q_j(s_j), the same rows, the same verdicts for the same uniforms —
    for sparse, dense and point-mass drafts in one batch. The rows come from ``q_rows_at`` (every
    rejecting row's q in one scatter), checked against ``dense_q``."""
    from goodspeed.verifier.drafts import DraftQ, dense_q, q_rows_at
    from goodspeed.verifier.rejection import verify_chains_q
    from goodspeed.verifier.types import Draft, SparseProbs

    vocab, gen = 40, torch.Generator().manual_seed(3)
    rng = np.random.default_rng(3)
    drafts = []
    for kind, n in (("sparse", 4), ("dense", 3), ("sparse", 1), ("point", 0), ("point", 2)):
        tokens, sparse, dense = [], [], np.zeros((n, vocab), dtype=np.float32)
        for j in range(n):
            support = rng.choice(vocab, 5, replace=False)
            probs = rng.dirichlet(np.ones(5))
            tokens.append(int(support[rng.integers(5)]))
            sparse.append(SparseProbs(support.tolist(), probs.tolist()))
            dense[j, support] = probs
        drafts.append(Draft(0, tokens, sparse_probs=sparse if kind == "sparse" else None, dense_probs=dense if kind == "dense" else None))
    s_max = max(d.num_tokens for d in drafts)
    qs = [DraftQ(d, torch.float32) for d in drafts]
    dense = torch.zeros(len(drafts), s_max, vocab)
    for b, d in enumerate(drafts):
        if d.num_tokens:
            q = dense_q(d, vocab, torch.float32)  # None for point masses: one-hot at the drafted tokens
            dense[b, : d.num_tokens] = q if q is not None else torch.eye(vocab)[torch.tensor(d.token_ids)]
            at = dense[b, torch.arange(d.num_tokens), torch.tensor(d.token_ids)]
            assert torch.allclose(torch.tensor(qs[b].at_tokens()), at, atol=1e-7, rtol=0)
            for j in range(d.num_tokens):
                assert torch.allclose(q_rows_at([qs[b]], [j], vocab, torch.float32, "cpu")[0], dense[b, j], atol=1e-7, rtol=0)
    tokens = torch.tensor([list(d.token_ids) + [0] * (s_max - d.num_tokens) for d in drafts])
    num = torch.tensor([d.num_tokens for d in drafts])
    q_tok = torch.ones(len(drafts), s_max, dtype=torch.float64)
    for b, q in enumerate(qs):
        q_tok[b, : drafts[b].num_tokens] = torch.tensor(q.at_tokens(), dtype=torch.float64)

    def rows(at):
        got = q_rows_at(qs, at.tolist(), vocab, torch.float32, "cpu")
        want = torch.stack([dense[b, j] if j < d.num_tokens else torch.zeros(vocab) for b, (d, j) in enumerate(zip(drafts, at))])
        assert torch.allclose(got, want, atol=1e-7, rtol=0)
        return got

    for _ in range(50):
        p = torch.softmax(torch.randn(len(drafts), s_max + 1, vocab, generator=gen) * 2, -1)
        u = torch.rand(len(drafts), s_max + 1, generator=gen, dtype=torch.float64)
        a = verify_chains(p, dense, tokens, num, u[:, :s_max], u[:, s_max])
        b = verify_chains_q(p, q_tok, rows, tokens, num, u[:, :s_max], u[:, s_max])
        assert torch.equal(a.num_accepted, b.num_accepted) and torch.equal(a.next_token, b.next_token)
        assert torch.allclose(a.acceptance_ratios, b.acceptance_ratios, atol=1e-6)
