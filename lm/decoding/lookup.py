"""Model-free draft sources: drafts looked up in text the request (or the node) has already seen.

Text that repeats its context (code edits, summaries and extraction from a given passage, answers
over a given document, multi-turn chat, agent loops) can be drafted by lookup at no model cost:

* ``ngram`` (:class:`PromptLookup`): prompt lookup decoding, as vLLM's ``ngram`` method and
  transformers' ``prompt_lookup_num_tokens`` do it: the longest suffix of the committed text of
  ``min_n..max_n`` tokens (1..5) that occurred before, and the tokens that followed its latest
  earlier occurrence. A match of one token is weak evidence, but the goodput rule prices each
  match length by its own measured acceptance, so proposing after one token costs nothing where
  it does not pay: through an edge node it raised the per-task benchmark's geometric mean to
  1.52x and 1.62x from 1.42x and 1.54x with matches of two or more, in the same two runs
  (docs/MEASUREMENTS.md, *Prompt lookup from one matched token*).
* ``suffix`` (:class:`SuffixDraft`): SuffixDecoding (Oliaro et al., "SuffixDecoding: Extreme
  Speculative Decoding for Emerging AI Applications", NeurIPS 2025, arXiv 2411.04975): a suffix
  trie of bounded depth over the request's prompt and output, and one over the recent outputs of
  every request this source served (bounded in nodes, oldest outputs evicted first). The longest
  suffix of the committed text found in a trie is followed by the most frequent continuation;
  each token's estimated probability is its count over its siblings' total, a draft stops where
  the path's probability falls under ``min_token_prob`` and is at most ``max_spec_factor`` times
  the match length (longer matches draft more). Of the two tries, the draft with the higher
  expected number of accepted tokens (the sum of its path probabilities) is proposed.

A lookup draft is a deterministic function of text already committed, so its ``q`` is the point
mass on each drafted token (:attr:`goodspeed.lm.decoding.proposals.ChainDraft.probs` is None): the
verifier accepts a sampled request's drafted token with probability ``p(x)`` and otherwise
samples the residual, which keeps the output exactly the target's distribution
(:mod:`goodspeed.verifier.rejection`); greedy output stays the target's greedy decoding. Both
sources take the batched drafting interface of :class:`goodspeed.lm.runtime.batch_draft.BatchDraftModel`
(``add``, ``remove``, ``rollback``, ``draft_chains``), so an edge node and local serving use them
as they use a draft model (:mod:`goodspeed.lm.decoding.draft_source`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence

from goodspeed.lm.decoding.proposals import ChainDraft
from goodspeed.lm.decoding.params import SamplingParams


class NgramIndex:
    """One text and, for every n-gram of ``min_n..max_n`` tokens in it that has a successor, the
    position where its latest occurrence ends. Appending costs O(new tokens x (max_n - min_n + 1))."""

    def __init__(self, min_n: int = 1, max_n: int = 5) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes must satisfy 1 <= min_n <= max_n, got {min_n}..{max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._latest: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        start = len(self.tokens)
        self.tokens.extend(int(t) for t in tokens)
        for end in range(max(start - 1, 0), len(self.tokens) - 1):  # the old last token has a successor now
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self._latest[tuple(self.tokens[end - n + 1 : end + 1])] = end

    def propose(self, max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` tokens after the latest earlier occurrence of the longest suffix
        that occurred before; [] when none did."""
        return self.match(max_tokens)[0]

    def match(self, max_tokens: int) -> tuple[list[int], int]:
        """:meth:`propose`'s tokens and the length of the suffix they follow (0: none matched)."""
        for n in range(min(self.max_n, len(self.tokens) - 1), self.min_n - 1, -1):
            end = self._latest.get(tuple(self.tokens[-n:]))
            if end is not None:
                return self.tokens[end + 1 : end + 1 + max_tokens], n
        return [], 0


class SuffixTrie:
    """Every substring of at most ``depth`` tokens of the texts added, with how often it occurs:
    a node's count is the number of positions where its path ends. ``num_nodes`` is the memory it
    holds (the root excluded).

    A node is an index into flat lists (its count, and its children as a dict of token -> index),
    the root 0: the trie holds ints and dicts of ints only, which Python's cyclic garbage
    collector does not track. A trie of node objects had every collection walk all of them
    (200-226 ms, 6-10% of a batch-8 local-serving run, in a full collection: docs/MEASUREMENTS.md
    *A suffix trie the garbage collector does not walk*)."""

    def __init__(self, depth: int) -> None:
        if depth < 2:
            raise ValueError(f"a suffix trie needs depth >= 2, got {depth}")
        self.depth = depth
        self.num_nodes = 0
        self._count: list[int] = [0]
        self._children: list[dict[int, int] | None] = [None]
        self._free: list[int] = []  # indices of removed nodes, reused first
        self._frontier: list[int] = []  # the nodes of the streamed text's suffixes, shortest first

    def append(self, tokens: Sequence[int]) -> None:
        """Stream ``tokens`` onto the text being built (O(depth) a token)."""
        for token in tokens:
            frontier = [0] + self._frontier[: self.depth - 1]
            self._frontier = [self._visit(node, int(token), +1) for node in frontier]

    def add(self, tokens: Sequence[int], sign: int = +1) -> None:
        """Add (``sign = +1``) or remove (``-1``) every substring of one whole text."""
        for start in range(len(tokens)):
            node: int | None = 0
            for token in tokens[start : start + self.depth]:
                node = self._visit(node, int(token), sign)
                if node is None:
                    break

    def _visit(self, node: int, token: int, sign: int) -> int | None:
        children = self._children[node]
        if sign > 0:
            if children is None:
                children = self._children[node] = {}
            child = children.get(token)
            if child is None:
                child = children[token] = self._new()
                self.num_nodes += 1
            self._count[child] += 1
            return child
        child = children[token]
        self._count[child] -= 1
        if self._count[child] == 0:  # its subtree's counts are at most its own: all zero, all gone
            del children[token]
            self.num_nodes -= self._release(child)
            return None
        return child

    def _new(self) -> int:
        if self._free:
            return self._free.pop()
        self._count.append(0)
        self._children.append(None)
        return len(self._count) - 1

    def _release(self, node: int) -> int:
        """Free ``node`` and its subtree; returns how many nodes that was."""
        stack, freed = [node], 0
        while stack:
            i = stack.pop()
            if self._children[i]:
                stack.extend(self._children[i].values())
            self._count[i], self._children[i] = 0, None
            self._free.append(i)
            freed += 1
        return freed

    def match(self, context: Sequence[int], max_len: int) -> tuple[int | None, int]:
        """The node of the longest suffix of ``context`` (at most ``max_len`` tokens) that occurs
        with a continuation, and its length; ``(None, 0)`` when none does."""
        for length in range(min(max_len, len(context)), 0, -1):
            node: int | None = 0
            for token in context[len(context) - length :]:
                children = self._children[node]
                node = children.get(int(token)) if children else None
                if node is None:
                    break
            if node is not None and self._children[node]:
                return node, length
        return None, 0

    def continue_from(self, node: int | None, max_tokens: int, min_token_prob: float) -> tuple[list[int], float]:
        """The most frequent continuation below ``node``: each token the child with the largest
        count (ties: the smallest id), its probability the path's product of count / siblings'
        total, stopping before the path's probability falls under ``min_token_prob``. Returns the
        tokens and their summed path probabilities (the expected number accepted, were the
        estimates right)."""
        count = self._count
        tokens: list[int] = []
        prob, score = 1.0, 0.0
        while node is not None and (children := self._children[node]) and len(tokens) < max_tokens:
            total = sum(count[c] for c in children.values())
            token, child = max(children.items(), key=lambda item: (count[item[1]], -item[0]))
            if prob * count[child] / total < min_token_prob:
                break
            prob *= count[child] / total
            tokens.append(token)
            score += prob
            node = child
        return tokens, score

    def paths(self) -> dict[tuple[int, ...], int]:
        """Every path with its count (for tests and checks)."""
        out: dict[tuple[int, ...], int] = {}
        stack: list[tuple[tuple[int, ...], int]] = [((), 0)]
        while stack:
            path, node = stack.pop()
            for token, child in (self._children[node] or {}).items():
                out[path + (token,)] = self._count[child]
                stack.append((path + (token,), child))
        return out


class LookupDraft:
    """Batched drafting by lookup: the interface of :class:`~goodspeed.lm.runtime.batch_draft.BatchDraftModel`
    that edge nodes and local serving call, with no model and no forwards. Subclasses keep one
    state a request (``_new_state``), bring it up to the committed text and propose from it. Each
    chain carries its evidence (:attr:`~goodspeed.lm.decoding.proposals.ChainDraft.evidence`: the
    length of the context matched), which the goodput rule reads its acceptance by."""

    name = ""
    graphs = None  # no fixed-shape forwards to warm up
    free_proposals = True  # proposing costs no forward: a policy may look up the longest draft, then keep what pays
    # proposals read the request's own committed text alone, so a verifier holding that text can tell
    # where one appears (an edge node's decode_ahead_until_match); not where other requests' text counts
    own_text_only = False

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = int(vocab_size)
        self.slots: dict[str, object] = {}
        self.forwards = 0  # draft model forwards: none
        self.on_forward = None

    def add(self, key: str) -> None:
        if key in self.slots:
            raise ValueError(f"request {key!r} is already drafting")
        self.slots[key] = self._new_state()

    def remove(self, key: str, committed: Sequence[int] | None = None) -> None:
        """End a request; ``committed``: its final text, which a source that learns across
        requests keeps."""
        self._learn(self.slots.pop(key), committed)

    def rollback(self, key: str, committed_before: int, num_accepted: int) -> None:
        """Nothing to roll back: a lookup caches nothing past the committed text."""

    def warm_up(self, chains: int = 0, tree=None, prompt_len: int = 32) -> int:
        return 0

    def draft_chains(self, committed: Mapping[str, Sequence[int]], lengths: Mapping[str, int],
                     sampling: Mapping[str, SamplingParams], generator=None, histories=None) -> dict[str, ChainDraft]:
        """Up to ``lengths[key]`` looked-up tokens after each request's committed text (fewer, or
        none, where the lookup finds less). No random stream is drawn from."""
        out = {}
        for key, n in lengths.items():
            tokens, evidence = self.proposal(key, committed[key], n) if n > 0 else ([], 0)
            out[key] = ChainDraft(tokens, None, [1.0] * len(tokens), sampled=not sampling[key].greedy, evidence=evidence)
        return out

    def propose(self, key: str, committed: Sequence[int], max_tokens: int) -> list[int]:
        """The lookup's draft of at most ``max_tokens`` tokens after ``committed``."""
        return self.proposal(key, committed, max_tokens)[0]

    def proposal(self, key: str, committed: Sequence[int], max_tokens: int) -> tuple[list[int], int]:
        """:meth:`propose`'s draft and its evidence: the length of the context it matched."""
        state = self.slots[key]
        self._sync(state, committed)
        return self._propose(state, max_tokens)

    # ------------------------------------------------------------------ subclasses

    def _new_state(self):
        raise NotImplementedError

    def _sync(self, state, committed: Sequence[int]) -> None:
        """Bring ``state`` up to ``committed`` (O(new tokens); a text that does not extend the
        state's is read afresh, as after a resynchronisation)."""
        raise NotImplementedError

    def _propose(self, state, max_tokens: int) -> tuple[list[int], int]:
        """The draft and the length of the context it matched."""
        raise NotImplementedError

    def _learn(self, state, committed: Sequence[int] | None) -> None:
        pass


def _extends(known: Sequence[int], committed: Sequence[int]) -> bool:
    """Whether ``committed`` continues ``known`` (checked at its last token: texts only grow
    between two rounds, and a resynchronised text differs where it was cut)."""
    return len(committed) >= len(known) and (not known or int(committed[len(known) - 1]) == known[-1])


class PromptLookup(LookupDraft):
    """``ngram``: prompt lookup over the request's prompt and output so far (:class:`NgramIndex`)."""

    name = "ngram"
    own_text_only = True

    def __init__(self, vocab_size: int, min_n: int = 1, max_n: int = 5) -> None:
        super().__init__(vocab_size)
        NgramIndex(min_n, max_n)  # the sizes are checked now, not at the first request
        self.min_n, self.max_n = min_n, max_n

    def _new_state(self) -> NgramIndex:
        return NgramIndex(self.min_n, self.max_n)

    def _sync(self, state: NgramIndex, committed: Sequence[int]) -> None:
        if not _extends(state.tokens, committed):
            state.__init__(self.min_n, self.max_n)
        state.extend(committed[len(state.tokens) :])

    def _propose(self, state: NgramIndex, max_tokens: int) -> tuple[list[int], int]:
        return state.match(max_tokens)


class _SuffixState:
    def __init__(self, depth: int) -> None:
        self.trie = SuffixTrie(depth)
        self.tokens: list[int] = []
        self.prompt_len: int | None = None  # the text first seen: its prompt (the rest is output)


class SuffixDraft(LookupDraft):
    """``suffix``: SuffixDecoding's drafting over a per-request trie (prompt and output) and a
    node-wide trie of recent outputs (module docstring). ``max_match``: the longest suffix
    matched; ``max_spec``: the most tokens a draft looks ahead (the tries' depth is the sum);
    ``max_nodes``: the node-wide trie's bound (each node some 250 bytes: its children's dict and
    two list entries)."""

    name = "suffix"

    def __init__(self, vocab_size: int, max_match: int = 12, max_spec: int = 16, max_spec_factor: float = 1.0,
                 min_token_prob: float = 0.1, max_nodes: int = 262_144) -> None:
        super().__init__(vocab_size)
        if max_match < 1 or max_spec < 1 or max_spec_factor <= 0 or not 0 <= min_token_prob <= 1 or max_nodes < 1:
            raise ValueError("suffix drafting needs max_match, max_spec, max_nodes >= 1, max_spec_factor > 0 and "
                             "min_token_prob in [0, 1]")
        self.max_match, self.max_spec = max_match, max_spec
        self.max_spec_factor, self.min_token_prob = max_spec_factor, min_token_prob
        self.max_nodes = max_nodes
        self.depth = max_match + max_spec
        self.outputs = SuffixTrie(self.depth)  # every cached output's substrings
        self._cached: OrderedDict[int, list[int]] = OrderedDict()  # oldest first
        self._next_id = 0

    def _new_state(self) -> _SuffixState:
        return _SuffixState(self.depth)

    def _sync(self, state: _SuffixState, committed: Sequence[int]) -> None:
        if not _extends(state.tokens, committed):
            prompt_len = state.prompt_len
            state.__init__(self.depth)
            state.prompt_len = prompt_len
        if state.prompt_len is None:
            state.prompt_len = len(committed)
        new = [int(t) for t in committed[len(state.tokens) :]]
        state.tokens.extend(new)
        state.trie.append(new)

    def _propose(self, state: _SuffixState, max_tokens: int) -> tuple[list[int], int]:
        best: tuple[list[int], float, int] = ([], 0.0, 0)  # the draft, its expected accepted tokens, its match
        for trie in (state.trie, self.outputs):
            node, length = trie.match(state.tokens, self.max_match)
            limit = min(max_tokens, self.max_spec, math.ceil(self.max_spec_factor * length))
            tokens, score = trie.continue_from(node, limit, self.min_token_prob)
            if score > best[1]:
                best = (tokens, score, length)
        return best[0], best[2]

    def _learn(self, state: _SuffixState, committed: Sequence[int] | None) -> None:
        if committed is not None:
            self._sync(state, committed)
        output = state.tokens[state.prompt_len or 0 :]
        if len(output) < 2:
            return
        self.outputs.add(output)
        self._cached[self._next_id] = output
        self._next_id += 1
        while self.outputs.num_nodes > self.max_nodes and self._cached:
            _, oldest = self._cached.popitem(last=False)
            self.outputs.add(oldest, sign=-1)
