"""Model-free draft sources (goodspeed.lm.decoding.lookup) against brute-force references: prompt lookup's
matches, the suffix trie's substring counts (streamed, added whole, removed), its longest match
and most frequent continuation (and the match length each draft carries as its evidence), the
node-wide cache's eviction under its bound; and the draft
source names, the hybrid's choice, and its trees (goodspeed.lm.decoding.draft_source): the lookup's branch
added to a beam tree holds exactly the union of both trees' paths."""

import random
from collections import Counter

import pytest
import torch

from goodspeed.lm.runtime.batch_draft import BatchDraftModel
from goodspeed.lm.decoding.proposals import BeamTree
from goodspeed.lm.decoding.draft_source import DraftSpec, HybridDraft, with_branch
from goodspeed.lm.decoding.lookup import NgramIndex, PromptLookup, SuffixDraft, SuffixTrie
from goodspeed.lm.decoding.params import SamplingParams
from modelkit import tiny_llama

GREEDY = SamplingParams()


def texts(seed: int, count: int = 40, vocab: int = 4, max_len: int = 40):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(1, max_len))] for _ in range(count)]


def brute_ngram(tokens, min_n, max_n, k, with_length=False):
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for end in range(len(tokens) - 2, n - 2, -1):  # latest earlier occurrence first
            if tokens[end - n + 1 : end + 1] == tokens[-n:]:
                return (tokens[end + 1 : end + 1 + k], n) if with_length else tokens[end + 1 : end + 1 + k]
    return ([], 0) if with_length else []


def brute_counts(seqs, depth):
    counts = Counter()
    for seq in seqs:
        for start in range(len(seq)):
            for length in range(1, min(depth, len(seq) - start) + 1):
                counts[tuple(seq[start : start + length])] += 1
    return dict(counts)


def test_prompt_lookup_proposes_what_followed_the_latest_earlier_occurrence():
    index = NgramIndex(2, 3)
    index.extend([7, 1, 2, 9, 1, 2, 5, 1, 2])
    assert index.propose(4) == [5, 1, 2]  # "1 2" last occurred before 5
    index.extend([5])
    assert index.propose(4) == [1, 2, 5]  # the 3-gram "1 2 5" first: what followed it, up to the text's end
    index.extend([8])
    assert index.propose(4) == []  # "5 8" never occurred before
    assert NgramIndex(2, 3).propose(3) == []


@pytest.mark.parametrize("seed", range(3))
def test_prompt_lookup_streamed_in_pieces_equals_the_brute_force_search(seed):
    rng = random.Random(seed)
    for tokens in texts(seed):
        index = NgramIndex(1, 4) if seed == 0 else NgramIndex(2, 5)
        done = 0
        while done < len(tokens):
            step = rng.randrange(1, 5)
            index.extend(tokens[done : done + step])
            done += step
            now = tokens[:done]
            assert index.propose(6) == brute_ngram(now, index.min_n, index.max_n, 6), now
            assert index.match(6) == brute_ngram(now, index.min_n, index.max_n, 6, with_length=True), now


def test_prompt_lookup_proposes_after_one_matched_token_by_default():
    """The default sizes are 1..5: a text whose last two tokens never occurred before is still
    drafted from its last token's latest earlier occurrence (evidence 1, which the goodput rule
    prices apart); from two tokens up, as before, nothing."""
    text = [3, 4, 5, 9, 4]
    one, two = PromptLookup(20), PromptLookup(20, min_n=2)
    for lookup in (one, two):
        lookup.add("r")
    assert one.proposal("r", text, 3) == ([5, 9, 4], 1)
    assert two.proposal("r", text, 3) == ([], 0)


def test_ngram_sizes_are_checked():
    with pytest.raises(ValueError, match="min_n"):
        PromptLookup(10, min_n=3, max_n=2)


@pytest.mark.parametrize("seed", range(3))
def test_a_suffix_trie_counts_every_substring_streamed_or_added_whole(seed):
    seqs = texts(seed, count=12)
    streamed, whole = SuffixTrie(5), SuffixTrie(5)
    for seq in seqs[:1]:
        streamed.append(seq)
    for seq in seqs:
        whole.add(seq)
    assert streamed.paths() == brute_counts(seqs[:1], 5)
    assert whole.paths() == brute_counts(seqs, 5)
    assert whole.num_nodes == len(whole.paths())


def test_removing_a_text_leaves_the_trie_of_the_others():
    seqs = texts(4, count=10)
    trie = SuffixTrie(6)
    for seq in seqs:
        trie.add(seq)
    for seq in seqs[::2]:
        trie.add(seq, sign=-1)
    kept = seqs[1::2]
    assert trie.paths() == brute_counts(kept, 6) and trie.num_nodes == len(brute_counts(kept, 6))


def test_a_trie_holds_nothing_the_garbage_collector_walks_and_reuses_removed_nodes():
    """Nodes are ints in flat lists, children dicts of ints (untracked by Python's cyclic GC,
    which a trie of node objects made walk every node on each collection); removed nodes' slots
    are reused, so adding and removing texts does not grow the lists."""
    import gc

    trie = SuffixTrie(6)
    seqs = texts(3, count=20, vocab=7, max_len=40)
    for seq in seqs:
        trie.add(seq)
    assert trie._children and not any(gc.is_tracked(c) for c in trie._children if c is not None)
    size = len(trie._count)
    for seq in seqs:
        trie.add(seq, sign=-1)
    assert trie.num_nodes == 0 and trie.paths() == {}
    for seq in seqs:
        trie.add(seq)
    assert len(trie._count) == size and trie.paths() == brute_counts(seqs, 6)


@pytest.mark.parametrize("seed", range(3))
def test_the_longest_match_and_its_most_frequent_continuation_equal_brute_force(seed):
    seqs = texts(seed + 10, count=6, vocab=3, max_len=30)
    trie = SuffixTrie(8)
    for seq in seqs:
        trie.add(seq)
    counts = brute_counts(seqs, 8)
    for context in texts(seed + 20, count=30, vocab=3, max_len=12):
        node, length = trie.match(context, 4)
        want = 0
        for n in range(min(4, len(context)), 0, -1):  # longest suffix that occurs followed by something
            suffix = tuple(context[-n:])
            if any(path[:-1] == suffix for path in counts if len(path) == n + 1):
                want = n
                break
        assert length == want
        tokens, score = trie.continue_from(node, 3, 0.0)
        path, prob, expected = tuple(context[-length:]) if length else (), 1.0, 0.0
        for token in tokens:  # each step the most counted child (ties: smallest id), p = count / siblings' total
            children = {p[-1]: c for p, c in counts.items() if len(p) == len(path) + 1 and p[:-1] == path}
            best = max(children.values())
            assert token == min(t for t, c in children.items() if c == best)
            prob *= best / sum(children.values())
            expected += prob
            path += (token,)
        assert score == pytest.approx(expected)
        if node is not None and len(tokens) < 3:  # it stopped where the text did: no child below
            assert not any(len(p) == len(path) + 1 and p[:-1] == path for p in counts)


def test_a_continuation_stops_where_its_probability_falls_under_the_floor():
    trie = SuffixTrie(4)
    for seq in ([1, 2, 3], [1, 2, 3], [1, 2, 4], [1, 5, 6]):
        trie.add(seq)
    node, _ = trie.match([1], 3)
    assert trie.continue_from(node, 5, 0.0)[0] == [2, 3]  # 3/4 then 2/3: p = 0.5
    assert trie.continue_from(node, 5, 0.6)[0] == [2]  # 0.75 kept, 0.5 under the floor


def test_suffix_drafts_from_the_request_and_from_earlier_outputs():
    source = SuffixDraft(100, max_match=4, max_spec=6)
    source.add("a")
    assert source.draft_chains({"a": [1, 2, 3, 4, 9, 1, 2, 3]}, {"a": 8}, {"a": GREEDY})["a"].token_ids == [4, 9, 1]
    source.remove("a", [1, 2, 3, 4, 9, 1, 2, 3, 4, 9, 8, 7, 6])  # its output (after the 8-token prompt) is kept
    assert source._cached[0] == [4, 9, 8, 7, 6]
    source.add("b")
    draft = source.draft_chains({"b": [50, 51, 9, 8]}, {"b": 8}, {"b": SamplingParams(temperature=1.0)})["b"]
    assert draft.token_ids == [7, 6] and draft.probs is None and draft.sampled  # the point mass, from the node's cache
    assert draft.evidence == 2  # "9 8" matched in the cached output
    assert source.draft_chains({"b": [50, 51, 9, 8]}, {"b": 1}, {"b": GREEDY})["b"].token_ids == [7]  # at most S
    assert source.draft_chains({"b": [50, 51]}, {"b": 0}, {"b": GREEDY})["b"].token_ids == []


def test_a_text_that_does_not_continue_the_last_one_is_read_afresh():
    for kind in (SuffixDraft, PromptLookup):
        source, fresh = kind(100), kind(100)
        source.add("a")
        fresh.add("a")
        source.propose("a", [1, 2, 3, 1, 2, 3, 1, 2], 3)
        got = source.propose("a", [5, 6, 7, 5, 6], 3)  # a resynchronised text: nothing of the old one is used
        assert got == fresh.propose("a", [5, 6, 7, 5, 6], 3) and got[:1] == [7]


def test_the_node_wide_cache_evicts_oldest_outputs_to_stay_under_its_bound():
    source = SuffixDraft(100, max_match=3, max_spec=3, max_nodes=200)
    outputs = texts(7, count=60, vocab=20, max_len=25)
    for i, out in enumerate(outputs):
        source.add(str(i))
        source.propose(str(i), [99], 3)  # a one-token prompt, seen at its first draft
        source.remove(str(i), [99] + out)
        assert source.outputs.num_nodes <= 200
    assert 0 < len(source._cached) < len(outputs)
    kept = [out for out in outputs if len(out) >= 2][-len(source._cached) :]
    assert list(source._cached.values()) == kept
    assert source.outputs.paths() == brute_counts(kept, 6)


def test_draft_source_names():
    assert DraftSpec.parse("suffix") == DraftSpec("suffix", None)
    assert DraftSpec.parse("ngram+demo:draft-tiny") == DraftSpec("ngram", "demo:draft-tiny")
    assert DraftSpec.parse("Qwen/Qwen3-0.6B") == DraftSpec(None, "Qwen/Qwen3-0.6B")
    for bad, why in (("", "empty"), ("suffix+", "name a draft model"), ("suffix+ngram", "name a draft model"),
                     ("lookup+demo:x", "unknown lookup")):
        with pytest.raises(ValueError, match=why):
            DraftSpec.parse(bad)
    with pytest.raises(ValueError, match="takes no model"):
        DraftSpec.parse("suffix").build(torch.nn.Linear(1, 1), 10)


def test_the_hybrid_drafts_with_the_part_whose_measured_acceptance_makes_its_draft_worth_more():
    model = tiny_llama(0, vocab=16)
    hybrid = HybridDraft(PromptLookup(16), BatchDraftModel(model))
    for key in "ab":
        hybrid.add(key)
    committed = {"a": [1, 2, 3, 4, 1, 2], "b": [5, 6, 7]}  # a repeats itself; b does not
    drafts = hybrid.draft_chains(committed, {"a": 3, "b": 3}, {"a": GREEDY, "b": GREEDY}, torch.Generator().manual_seed(0))
    assert drafts["a"].token_ids == [3, 4, 1] and drafts["a"].probs is None  # the priors favour the free lookup
    assert len(drafts["b"].token_ids) == 3 and drafts["b"].probs is not None  # nothing to look up: the model, with its q
    assert hybrid.from_lookup == {"rounds": 1, "drafted": 3} and hybrid.forwards > 0
    hybrid.rollback("b", 3, 1)
    assert hybrid.model.cached_length("b") == 4  # the committed text and the accepted draft
    assert hybrid.acceptance("b", "model") == pytest.approx((0.8 * 1 + 1) / (0.8 * 2 + 1 + 1))
    parts = []
    for _ in range(6):  # every draft for a rejected outright, round after round
        d = hybrid.draft_chains(committed, {"a": 3}, {"a": GREEDY}, torch.Generator().manual_seed(0))["a"]
        parts.append("lookup" if d.probs is None else "model")
        hybrid.rollback("a", len(committed["a"]), 0)
    assert parts[0] == "lookup" and "model" in parts  # the lookup's measured acceptance fell below the model's
    assert hybrid.acceptance("a", "lookup") < 2 / 3
    hybrid.remove("a", committed["a"])
    assert "a" not in hybrid.slots and "a" not in hybrid.model.slots


def paths(tree) -> dict[tuple[int, ...], float]:
    """Every node's path of tokens from the root, with its path probability."""
    out, at = {}, []
    for tok, parent, prob in zip(tree.token_ids, tree.parents, tree.path_probs):
        at.append((tok,) if parent < 0 else at[parent] + (tok,))
        assert at[-1] not in out, "two nodes hold one path"
        out[at[-1]] = prob
    return out


@pytest.mark.parametrize("seed", range(20))
def test_a_branch_added_to_a_tree_holds_the_union_of_their_paths_and_keeps_probabilities_falling(seed):
    rng = random.Random(seed)
    tokens, parents, probs, depths = [], [], [], []
    for k in range(rng.randrange(0, 12)):  # a random tree over 3 tokens, no two siblings alike
        parent = rng.randrange(-1, k)
        taken = {t for t, p in zip(tokens, parents) if p == parent}
        if len(taken) == 3:
            continue
        tokens.append(rng.choice([t for t in range(3) if t not in taken]))
        parents.append(parent)
        probs.append((probs[parent] if parent >= 0 else 1.0) * rng.random())
        depths.append(1 if parent < 0 else depths[parent] + 1)
    tree = BeamTree(tokens, parents, probs, depths)
    branch = [rng.randrange(3) for _ in range(rng.randrange(1, 6))]
    a = rng.random()
    merged = with_branch(tree, branch, [a ** d for d in range(1, len(branch) + 1)])
    want = paths(tree)
    for d in range(1, len(branch) + 1):
        want[tuple(branch[:d])] = max(want.get(tuple(branch[:d]), 0.0), a ** d)
    assert paths(merged) == want
    assert merged.token_ids[: len(tokens)] == tokens and merged.parents[: len(tokens)] == parents  # the beam tree's nodes kept
    for k, parent in enumerate(merged.parents):
        assert parent < k and (parent < 0 or merged.path_probs[k] <= merged.path_probs[parent])
        assert merged.depths[k] == (1 if parent < 0 else merged.depths[parent] + 1)


def test_the_hybrids_tree_carries_the_lookups_branch_weighted_by_what_it_has_been_worth():
    model = tiny_llama(0, vocab=16)
    hybrid = HybridDraft(PromptLookup(16), BatchDraftModel(model))
    hybrid.add("a")
    committed = [1, 2, 3, 4, 1, 2]
    trees = hybrid.draft_trees({"a": committed}, 3, 2, {"a": GREEDY}, {"a": 3})
    beam = hybrid.model.draft_trees({"a": committed}, 3, 2, {"a": GREEDY}, {"a": 3})["a"]
    got = paths(trees["a"])
    a = hybrid.acceptance("a", "lookup")
    for d in (1, 2, 3):  # the lookup's 3, 4, 1 at its acceptance's powers, or the beam's where larger
        assert got[(3, 4, 1)[:d]] == pytest.approx(max(a ** d, paths(beam).get((3, 4, 1)[:d], 0.0)))
    assert set(paths(beam)) <= set(got) and hybrid.from_lookup == {"rounds": 1, "drafted": 3}
    hybrid.draft_trees({"a": committed + [3, 9]}, 3, 2, {"a": GREEDY}, {"a": 3})  # the text took 3, then not 4
    assert hybrid.acceptance("a", "lookup") == pytest.approx((0.8 * 2 + 1) / (0.8 * 3 + 1 + 1))
