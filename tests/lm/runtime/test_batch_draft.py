"""The batched local draft model against plain full-sequence forwards of the same model."""

import pytest
import torch

from goodspeed.lm.decoding.sampling import cap_support, process_logits
from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.lm.runtime.batch_draft import BatchDraftModel, subtree
from modelkit import tiny_llama

GREEDY = SamplingParams()


def next_probs(model, seq, sampling=None):
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([list(seq)])).logits[0, -1].double()
    return torch.softmax(logits, -1) if sampling is None or sampling.greedy else process_logits(logits, sampling)


def path_of(tree, node):
    path = []
    while node >= 0:
        path.append(tree.token_ids[node])
        node = tree.parents[node]
    return path[::-1]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(5)


def test_chains_are_the_models_greedy_continuations_across_rounds(model):
    draft = BatchDraftModel(model)
    committed = {"a": [1, 2, 3, 4, 5], "b": [7, 8], "c": [9, 10, 11]}
    for key in committed:
        draft.add(key)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):  # draft, accept a prefix, append a correction (or several tokens, as a verdict
        # with tokens decoded in transit does): the KV must stay right
        lengths = {"a": 3, "b": 1, "c": 0}
        out = draft.draft_chains(committed, lengths, {k: GREEDY for k in committed}, gen)
        for key, n in lengths.items():
            seq = list(committed[key])
            for j in range(n):
                expect = int(next_probs(model, seq).argmax())
                assert out[key].token_ids[j] == expect
                seq.append(expect)
            assert len(out[key].token_ids) == n
        for key, n in lengths.items():
            accepted = min(n, 1)
            before = len(committed[key])
            grown = [int(3 + (before + i) % 5) for i in range(1 + before % 3)]
            committed[key] = committed[key] + out[key].token_ids[:accepted] + grown
            draft.rollback(key, before, accepted)
    draft.remove("b")  # slots move; the others keep their KV
    out = draft.draft_chains(committed, {"a": 2, "c": 2}, {"a": GREEDY, "c": GREEDY}, gen)
    for key in ("a", "c"):
        assert out[key].token_ids[0] == int(next_probs(model, committed[key]).argmax())


def test_sampled_chain_reports_the_processed_draft_distribution(model):
    draft = BatchDraftModel(model)
    draft.add("x")
    sampling = SamplingParams(temperature=0.8, top_k=5)
    out = draft.draft_chains({"x": [3, 4, 5]}, {"x": 2}, {"x": sampling}, torch.Generator().manual_seed(1))["x"]
    q0 = next_probs(model, [3, 4, 5], sampling)
    q1 = next_probs(model, [3, 4, 5, out.token_ids[0]], sampling)
    assert out.probs.dtype == torch.float32  # sampled from exactly what the engine reads
    torch.testing.assert_close(out.probs[0], q0.float(), atol=1e-6, rtol=0)
    torch.testing.assert_close(out.probs[1], q1.float(), atol=1e-6, rtol=0)
    assert out.token_probs == pytest.approx([float(q0[out.token_ids[0]]), float(q1[out.token_ids[1]])], abs=1e-6)
    # what TETRIS may rank by: each position's confidence before its draw, E_{s~q}[q(s)]
    assert out.expected_probs == pytest.approx([float((q0**2).sum()), float((q1**2).sum())], abs=1e-6)
    greedy = draft.draft_chains({"x": [3, 4, 5]}, {"x": 1}, {"x": GREEDY}, torch.Generator())["x"]
    assert greedy.token_probs[0] == pytest.approx(float(next_probs(model, [3, 4, 5]).max()))  # softmax confidence, not 1
    assert greedy.expected_probs == greedy.token_probs  # nothing drawn: the same


def test_a_capped_sampled_chain_draws_from_its_capped_q(model):
    """The edge node's proposal cap: each position's q is the processed distribution cut to its
    k likeliest tokens, and the drafted token is one of them."""
    draft = BatchDraftModel(model, proposal_top_k=3)
    draft.add("x")
    sampling = SamplingParams(temperature=1.0)
    out = draft.draft_chains({"x": [3, 4, 5]}, {"x": 2}, {"x": sampling}, torch.Generator().manual_seed(2))["x"]
    q0 = cap_support(next_probs(model, [3, 4, 5], sampling), 3)
    torch.testing.assert_close(out.probs[0], q0.float(), atol=1e-6, rtol=0)
    assert [int((row > 0).sum()) for row in out.probs] == [3, 3]
    assert all(float(row[t]) > 0 for row, t in zip(out.probs, out.token_ids))


# "c" keeps 2 tokens a step: 2 beams at the root where the others have 3 (ragged beams, rows padded)
MIXED = {"a": GREEDY, "b": SamplingParams(temperature=1.3), "c": SamplingParams(temperature=0.7, top_k=2)}


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=1.3), MIXED], ids=["greedy", "sampled", "mixed"])
def test_beam_trees_match_full_forwards(model, sampling):
    """Every node's path probability is the draft's own (by full forwards), each row ranked by its
    own settings though the rows are ranked together (``mixed``: a greedy, a sampled and a
    truncated request in one batch, the truncated one with fewer beams than the others)."""
    draft = BatchDraftModel(model)
    committed = {"a": [1, 2, 3, 4], "b": [5, 6], "c": [7, 8, 9, 10, 11]}
    settings = sampling if isinstance(sampling, dict) else {k: sampling for k in committed}
    for key in committed:
        draft.add(key)
    for round_ in range(2):
        trees = draft.draft_trees(committed, depth=3, width=3, sampling=settings, max_depths={"c": 2})
        for key, tree in trees.items():
            sampling = settings[key]
            assert max(tree.depths) == (2 if key == "c" else 3)
            for depth in range(1, max(tree.depths) + 1):
                assert sum(d == depth for d in tree.depths) <= 3
            for node in range(len(tree.token_ids)):
                path = path_of(tree, node)
                assert len(path) == tree.depths[node]
                prob = 1.0
                for j in range(len(path)):
                    prob *= float(next_probs(model, committed[key] + path[:j], sampling)[path[j]])
                assert tree.path_probs[node] == pytest.approx(prob, rel=1e-6)
            for depth in range(2, max(tree.depths) + 1):  # each level: the w best children of the level above
                above = [n for n, d in enumerate(tree.depths) if d == depth - 1]
                candidates = sorted((tree.path_probs[n] * p for n in above
                                     for p in next_probs(model, committed[key] + path_of(tree, n), sampling).tolist() if p > 0),
                                    reverse=True)
                chosen = sorted((tree.path_probs[n] for n, d in enumerate(tree.depths) if d == depth), reverse=True)
                assert chosen == pytest.approx(candidates[:3], rel=1e-6)
            # the w best children of the root by draft probability
            root = next_probs(model, committed[key], sampling)
            top = [t for t in torch.topk(root, 3).indices.tolist() if root[t] > 0]
            assert [t for t, p in zip(tree.token_ids, tree.parents) if p < 0] == top
        for key in committed:  # commit a root child and a correction, like a verdict would
            committed[key] = committed[key] + [trees[key].token_ids[0], 2]


def test_subtree_reindexes_parents(model):
    draft = BatchDraftModel(model)
    draft.add("a")
    tree = draft.draft_trees({"a": [1, 2, 3]}, depth=3, width=2, sampling={"a": GREEDY})["a"]
    chosen = [0] + [k for k in range(len(tree.parents)) if tree.parents[k] == 0]
    tokens, parents = subtree(tree, chosen)
    assert parents[0] == -1 and all(p == 0 for p in parents[1:])
    assert tokens == [tree.token_ids[k] for k in chosen]
    orphan = [k for k in range(len(tree.parents)) if tree.parents[k] >= 0][-1]
    with pytest.raises(ValueError, match="not selected"):
        subtree(tree, [orphan])


def test_catch_up_projects_only_where_rows_end(model):
    """A catch-up of ragged rows (a new request's whole prompt next to one-token rows) runs the LM
    head at the distinct positions where some row ends, not at every padded position, and each
    row still gets the logits after its own last token."""
    draft = BatchDraftModel(model)
    committed = {"a": list(range(1, 9)), "b": [7, 8], "c": [9, 10, 11]}
    for key in committed:
        draft.add(key)
    seen = []
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: seen.append(tuple(args[0].shape)))
    try:
        last = draft.catch_up(committed)
    finally:
        hook.remove()
    assert seen == [(3, 3, model.config.hidden_size)]  # 3 rows x ends {1, 2, 7}, not x 8 positions
    for key, seq in committed.items():
        want = torch.log_softmax(next_probs(model, seq).log(), -1)
        assert torch.allclose(torch.log_softmax(last[key].double(), -1), want, atol=1e-5), key


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=1.3)])
def test_cuda_drafting_is_the_hosts(model, sampling):
    """The same draft model on the GPU: catch-up (logits kept at a device tensor of positions),
    chains (a batched step on the device) and beam trees give the host's tokens, and the logits
    agree to rounding."""
    import copy

    host, device = BatchDraftModel(model), BatchDraftModel(copy.deepcopy(model).cuda())
    committed = {"a": list(range(1, 9)), "b": [7, 8], "c": [9, 10, 11]}
    for key in committed:
        host.add(key)
        device.add(key)
    want, got = host.catch_up(committed), device.catch_up(committed)
    for key in committed:  # float64 but for the rotary tables, which transformers builds in float32
        diff = float((got[key].cpu() - want[key]).abs().max())
        assert diff < 1e-4, (key, diff)
    lengths, params = {"a": 3, "b": 2, "c": 1}, {k: sampling for k in committed}
    want = host.draft_chains(committed, lengths, params, torch.Generator().manual_seed(1))
    got = device.draft_chains(committed, lengths, params, torch.Generator().manual_seed(1))
    for key in committed:
        assert got[key].token_ids == want[key].token_ids, key
        assert got[key].token_probs == pytest.approx(want[key].token_probs, rel=1e-5), key  # q is float32
    want = host.draft_trees(committed, depth=3, width=2, sampling=params)
    got = device.draft_trees(committed, depth=3, width=2, sampling=params)
    for key in committed:
        assert (got[key].token_ids, got[key].parents) == (want[key].token_ids, want[key].parents), key
        assert got[key].path_probs == pytest.approx(want[key].path_probs, rel=1e-5), key
