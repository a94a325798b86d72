"""Draft sources by name: a draft model, a lookup, or a lookup in front of a model.

A draft source proposes up to ``S`` tokens after each request's committed text, with the ``q``
each was drawn from (a model's processed distribution, or the point mass of a deterministic
proposal), and hears each request's text as its verdicts commit it. Every source has the batched
drafting interface of :class:`~goodspeed.lm.runtime.batch_draft.BatchDraftModel`: ``add(key)``,
``remove(key, committed)``, ``rollback(key, committed_before, num_accepted)`` after each verdict,
``draft_chains(...)``, ``warm_up(...)``, ``graphs``, ``forwards``. An edge node
(``goodspeed drafter --draft SOURCE``), a spec's ``draft`` and local serving (``--local-draft
SOURCE``) name one the same way:

* ``MODEL`` — a draft model (hub id, directory, ``demo:<name>``, ``real:<name>``);
* ``ngram`` or ``suffix`` — a lookup alone (:mod:`goodspeed.lm.decoding.lookup`): no model is loaded, so
  the node needs the target's tokenizer (``--tokenizer``);
* ``LOOKUP+MODEL`` (``suffix+real:smollm2-135m-draft``) — :class:`HybridDraft`: each round the
  part whose chain is worth more, by each part's acceptance measured on the request; where the
  policy verifies trees (local serving's ``adaserve``), one tree with both: the model's beam tree
  and the lookup's chain as a branch of it.

Adding a lookup is one :class:`~goodspeed.lm.decoding.lookup.LookupDraft` subclass with its ``name``, listed in
:data:`LOOKUPS`.

This module imports no torch: a node drafting by lookup alone never loads it. The model runtime
(:mod:`goodspeed.lm.runtime.batch_draft`) is imported where a source with a model is built.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from goodspeed.lm.decoding.lookup import LookupDraft, PromptLookup, SuffixDraft
from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.lm.decoding.proposals import BeamTree, ChainDraft

if TYPE_CHECKING:
    import torch

    from goodspeed.lm.runtime.batch_draft import BatchDraftModel

LOOKUPS: dict[str, type[LookupDraft]] = {cls.name: cls for cls in (PromptLookup, SuffixDraft)}

# HybridDraft's priors on each part's acceptance, as (accepted, rejections): a lookup's drafts are
# text the request (or the node) has seen, so it starts trusted a little more than the model
LOOKUP_PRIOR = (2.0, 1.0)
MODEL_PRIOR = (1.0, 1.0)


@dataclass(frozen=True)
class DraftSpec:
    """A parsed draft source name: its lookup (or None) and its model (or None), never both None."""

    lookup: str | None
    model: str | None

    @classmethod
    def parse(cls, name: str) -> "DraftSpec":
        """``MODEL``, ``LOOKUP`` or ``LOOKUP+MODEL``; a name that is neither raises ``ValueError``."""
        if not name or not name.strip():
            raise ValueError("the draft source is empty: give a model, " + " or ".join(LOOKUPS) + ", or LOOKUP+MODEL")
        head, plus, rest = name.partition("+")
        if name in LOOKUPS:
            return cls(name, None)
        if plus and head in LOOKUPS:
            if not rest or rest in LOOKUPS:
                raise ValueError(f"draft source {name!r}: after {head}+ name a draft model (hub id, directory or demo:<name>)")
            return cls(head, rest)
        if plus and head and ":" not in head and "/" not in head:
            raise ValueError(f"draft source {name!r}: unknown lookup {head!r} (known: {', '.join(LOOKUPS)})")
        return cls(None, name)

    @property
    def needs_model(self) -> bool:
        return self.model is not None

    def build(self, model: torch.nn.Module | None, vocab_size: int | None = None, proposal_top_k: int = 0,
              cuda_graphs: bool = False, torch_compile: bool = False):
        """The source: a :class:`BatchDraftModel` over ``model``, a lookup, or both in a
        :class:`HybridDraft`. ``vocab_size``: a lookup's alone (a model's is its own)."""
        if (model is None) == self.needs_model:
            raise ValueError(f"draft source {self}: {'a model is needed' if self.needs_model else 'takes no model'}")
        if model is None:
            if vocab_size is None:
                raise ValueError(f"draft source {self}: give the target's vocabulary size")
            return LOOKUPS[self.lookup](vocab_size)
        drafter = as_draft_source(model, proposal_top_k, cuda_graphs, torch_compile)
        if self.lookup is None:
            return drafter
        return HybridDraft(LOOKUPS[self.lookup](drafter.vocab_size), drafter)

    def __str__(self) -> str:
        return "+".join(part for part in (self.lookup, self.model) if part)


class HybridDraft:
    """A lookup in front of a draft model. Each round, for each request, the part expected to get
    more tokens accepted drafts: the lookup's ``m`` tokens are worth ``sum_{k<=m} a_L^k``, the
    model's ``n`` allotted ones ``sum_{k<=n} a_M^k``, each ``a`` the part's own acceptance on
    this request, counted from the verdicts of the rounds it drafted (accepted tokens and
    rejections, decayed by ``decay`` a round; priors :data:`LOOKUP_PRIOR` and :data:`MODEL_PRIOR`).
    A tie goes to the lookup, which costs nothing to run. The choice reads only the committed text
    and past verdicts (never a token sampled this round), so each drafted token's ``q`` is still
    what it was drawn from: the lookup's point mass or the model's distribution."""

    def __init__(self, lookup: LookupDraft, model: BatchDraftModel, decay: float = 0.8) -> None:
        if lookup.vocab_size != model.vocab_size:
            raise ValueError(f"lookup vocabulary {lookup.vocab_size} != draft vocabulary {model.vocab_size}")
        if not 0 <= decay < 1:
            raise ValueError(f"decay must lie in [0, 1), got {decay}")
        self.lookup, self.model, self.decay = lookup, model, decay
        self.vocab_size = model.vocab_size
        self.from_lookup = {"rounds": 0, "drafted": 0}  # rounds drafted by the lookup, and their tokens
        self._counts: dict[str, dict[str, list[float]]] = {}  # key -> part -> [accepted, rejections]
        self._last: dict[str, tuple[str, int, int]] = {}  # key -> (part, text length it drafted after, tokens)
        self._in_tree: dict[str, tuple[int, list[int]]] = {}  # key -> (text length, the lookup's branch of its tree)

    graphs = property(lambda self: self.model.graphs)
    slots = property(lambda self: self.lookup.slots)
    forwards = property(lambda self: self.model.forwards, lambda self, n: setattr(self.model, "forwards", n))
    on_forward = property(lambda self: self.model.on_forward, lambda self, fn: setattr(self.model, "on_forward", fn))

    def add(self, key: str) -> None:
        self.lookup.add(key)
        self.model.add(key)
        self._counts[key] = {"lookup": list(LOOKUP_PRIOR), "model": list(MODEL_PRIOR)}

    def remove(self, key: str, committed: Sequence[int] | None = None) -> None:
        self.lookup.remove(key, committed)
        self.model.remove(key)
        self._counts.pop(key, None)
        self._last.pop(key, None)
        self._in_tree.pop(key, None)

    def acceptance(self, key: str, part: str) -> float:
        accepted, rejected = self._counts[key][part]
        return accepted / (accepted + rejected)

    def rollback(self, key: str, committed_before: int, num_accepted: int) -> None:
        """After a verdict: the drafting part's counts (tokens forced before its draft aside),
        then the model's KV."""
        part, start, drafted = self._last.pop(key, ("", 0, 0))
        accepted = committed_before + num_accepted - start
        if drafted and accepted >= 0:
            self._count(key, part, min(accepted, drafted), accepted < drafted)
        self.model.rollback(key, committed_before, num_accepted)

    def _count(self, key: str, part: str, accepted: int, rejected: bool) -> None:
        if key in self._counts:
            counts = self._counts[key][part]
            counts[0] = self.decay * counts[0] + accepted
            counts[1] = self.decay * counts[1] + rejected

    def warm_up(self, chains: int = 0, tree=None, prompt_len: int = 32) -> int:
        return self.model.warm_up(chains, tree, prompt_len)

    def draft_chains(self, committed: Mapping[str, Sequence[int]], lengths: Mapping[str, int],
                     sampling: Mapping[str, SamplingParams], generator, histories=None) -> dict[str, ChainDraft]:
        out: dict[str, ChainDraft] = {}
        for key, n in lengths.items():
            if n <= 0:
                continue
            tokens = self.lookup.propose(key, committed[key], n)
            worth = [sum(self.acceptance(key, part) ** k for k in range(1, m + 1))
                     for part, m in (("lookup", len(tokens)), ("model", n))]
            if tokens and worth[0] >= worth[1]:
                out[key] = ChainDraft(tokens, None, [1.0] * len(tokens), sampled=not sampling[key].greedy)
                self.from_lookup["rounds"] += 1
                self.from_lookup["drafted"] += len(tokens)
        rest = {key: n for key, n in lengths.items() if key not in out}
        if rest:
            out.update(self.model.draft_chains(committed, rest, sampling, generator, histories))
        for key, draft in out.items():
            if draft.token_ids:
                self._last[key] = ("lookup" if draft.probs is None else "model", len(committed[key]), len(draft.token_ids))
        return out

    def draft_trees(self, committed: Mapping[str, Sequence[int]], depth: int, width: int,
                    sampling: Mapping[str, SamplingParams], max_depths: Mapping[str, int] | None = None,
                    histories=None) -> dict[str, BeamTree]:
        """The model's beam trees, each with the lookup's chain (up to the request's depth) as a
        branch: a lookup token that a beam already holds at its place shares that node, the others
        are new nodes. A lookup node's path probability is ``a_L^d`` at depth ``d``, ``a_L`` the
        lookup's acceptance on the request (a shared node keeps the larger of the two), so the
        policy's selection weighs the branch by what it has been worth. Every node is a
        deterministic candidate, verified as the point mass on its token.

        The lookup's acceptance in trees is learned from the committed text the next round brings:
        how many of its branch's tokens the text now matches (whether or not the policy verified
        the branch), and a rejection where it stops matching."""
        for key in committed:
            self._learn_branch(key, committed[key])
        trees = self.model.draft_trees(committed, depth, width, sampling, max_depths, histories)
        for key, toks in committed.items():
            cap = min(depth, (max_depths or {}).get(key, depth))
            branch = self.lookup.propose(key, toks, cap) if cap > 0 else []
            if branch:
                a = self.acceptance(key, "lookup")
                trees[key] = with_branch(trees[key], branch, [a ** d for d in range(1, len(branch) + 1)])
                self._in_tree[key] = (len(toks), branch)
                self.from_lookup["rounds"] += 1
                self.from_lookup["drafted"] += len(branch)
        return trees

    def _learn_branch(self, key: str, committed: Sequence[int]) -> None:
        start, branch = self._in_tree.pop(key, (0, []))
        new = committed[start : start + len(branch)]
        if not branch or len(committed) < start or not new:
            return
        matched = next((i for i, (a, b) in enumerate(zip(branch, new)) if a != b), len(new))
        self._count(key, "lookup", matched, matched < len(new))


def as_draft_source(draft, proposal_top_k: int = 0, cuda_graphs: bool = False, torch_compile: bool = False):
    """A draft model (``torch.nn.Module``) as a source: a :class:`BatchDraftModel` over it with
    these settings; a draft source (a lookup, a hybrid, a batched model) as it is."""
    if hasattr(draft, "draft_chains"):
        return draft
    from goodspeed.lm.runtime.batch_draft import BatchDraftModel

    return BatchDraftModel(draft, proposal_top_k, cuda_graphs=cuda_graphs, torch_compile=torch_compile)


def draft_model(drafter) -> torch.nn.Module:
    """The draft model a batched draft source drafts with (alone, or behind a lookup);
    ``ValueError`` for a lookup alone."""
    if isinstance(drafter, HybridDraft):
        drafter = drafter.model
    if not isinstance(drafter, LookupDraft):
        return drafter.model
    raise ValueError("a lookup alone has no draft model (no weights to adapt): give MODEL or LOOKUP+MODEL")


def with_branch(tree: BeamTree, tokens: Sequence[int], path_probs: Sequence[float]) -> BeamTree:
    """``tree`` with the chain ``tokens`` from its root: along the chain, a node holding the same
    token under the same parent is shared (keeping the larger path probability), the rest are
    appended after it (parents before children, as every tree here is). ``path_probs`` must not
    increase along the chain, so no node's path probability exceeds its parent's."""
    token_ids, parents, probs, depths = list(tree.token_ids), list(tree.parents), list(tree.path_probs), list(tree.depths)
    children: dict[tuple[int, int], int] = {(p, t): k for k, (p, t) in enumerate(zip(parents, token_ids))}
    parent = -1
    for d, (tok, prob) in enumerate(zip(tokens, path_probs), start=1):
        node = children.get((parent, int(tok)))
        if node is None:
            node = len(token_ids)
            token_ids.append(int(tok))
            parents.append(parent)
            probs.append(float(prob))
            depths.append(d)
            children[(parent, int(tok))] = node
        else:
            probs[node] = max(probs[node], float(prob))
        parent = node
    return BeamTree(token_ids, parents, probs, depths)


def draft_with_forced(source, committed: Mapping[str, Sequence[int]], lengths: Mapping[str, int],
                      sampling: Mapping[str, SamplingParams], generator,
                      histories: Mapping[str, object] | None = None) -> tuple[dict[str, ChainDraft], int]:
    """``source.draft_chains`` with fast-forward (SGLang's jump-forward, done as drafting): where a
    request's grammar forces tokens after its committed text (one token allowed at a position:
    :meth:`goodspeed.lm.decoding.structured.Constraint.forced`), they open its draft as point masses,
    which the target's masked distribution always accepts, and the source drafts the rest of
    ``lengths[key]`` after them (its history extended by them, so its masks and penalties read
    the right text). Returns the drafts and how many tokens were forced."""
    forced = _forced(lengths, histories)
    if not forced:
        return source.draft_chains(committed, lengths, sampling, generator, histories), 0
    inner_committed, inner_lengths, inner_histories = _after(forced, committed, lengths, histories)
    drafts = source.draft_chains(inner_committed, inner_lengths, sampling, generator, inner_histories)
    for key, tokens in forced.items():
        drafts[key] = _after_forced(tokens, drafts[key], sampling[key])
    return drafts, sum(len(t) for t in forced.values())


def draft_trees_with_forced(source, committed: Mapping[str, Sequence[int]], depth: int, width: int,
                            sampling: Mapping[str, SamplingParams], max_depths: Mapping[str, int] | None = None,
                            histories: Mapping[str, object] | None = None) -> tuple[dict[str, BeamTree], int]:
    """``source.draft_trees`` with fast-forward: where a request's grammar forces tokens after its
    committed text, they are the trunk of its tree (a chain from the root, path probability 1) and
    the source's tree, drafted after them, hangs from the trunk's last node, all within the
    request's depth. Returns the trees and how many tokens were forced."""
    caps = {key: min(depth, (max_depths or {}).get(key, depth)) for key in committed}
    forced = _forced(caps, histories)
    if not forced:
        return source.draft_trees(committed, depth, width, sampling, max_depths, histories), 0
    inner_committed, inner_caps, inner_histories = _after(forced, committed, caps, histories)
    trees = source.draft_trees(inner_committed, depth, width, sampling, inner_caps, inner_histories)
    for key, tokens in forced.items():
        trees[key] = _under_trunk(tokens, trees[key])
    return trees, sum(len(t) for t in forced.values())


def _forced(lengths: Mapping[str, int], histories: Mapping[str, object] | None) -> dict[str, list[int]]:
    """Per request with a grammar: the tokens it forces next, at most ``lengths[key]``."""
    forced: dict[str, list[int]] = {}
    for key, n in lengths.items():
        history = histories.get(key) if histories else None
        if n > 0 and history is not None and history.constraint is not None:
            if tokens := history.constraint.forced(n):
                forced[key] = tokens
    return forced


def _after(forced: Mapping[str, list[int]], committed: Mapping[str, Sequence[int]], lengths: Mapping[str, int],
           histories: Mapping[str, object]) -> tuple[dict, dict, dict]:
    """What a source drafts after the forced tokens: each request's text, length left and history
    with its forced tokens added."""
    inner_committed = {k: list(committed[k]) + forced[k] if k in forced else committed[k] for k in lengths}
    inner_lengths = {k: n - len(forced.get(k, ())) for k, n in lengths.items()}
    inner_histories = {k: histories[k].extended(forced[k]) if k in forced else h for k, h in histories.items()}
    return inner_committed, inner_lengths, inner_histories


def _under_trunk(trunk: list[int], tree: BeamTree) -> BeamTree:
    """The chain ``trunk`` (path probability 1), then ``tree`` hanging from its last node."""
    f = len(trunk)
    return BeamTree(list(trunk) + list(tree.token_ids),
                    list(range(-1, f - 1)) + [f - 1 if p < 0 else p + f for p in tree.parents],
                    [1.0] * f + list(tree.path_probs), list(range(1, f + 1)) + [d + f for d in tree.depths])


def _after_forced(forced: list[int], draft: ChainDraft, sampling: SamplingParams) -> ChainDraft:
    """``forced`` point masses, then ``draft``: its q rows (if any) after one-hot rows for them."""
    if not draft.token_ids or draft.probs is None:
        return ChainDraft(forced + list(draft.token_ids), None, [1.0] * len(forced) + list(draft.token_probs),
                          sampled=not sampling.greedy, forced=len(forced), evidence=draft.evidence)
    import torch  # a model's q rows: torch is loaded already

    one_hot = torch.zeros(len(forced), draft.probs.shape[-1], dtype=draft.probs.dtype, device=draft.probs.device)
    one_hot[torch.arange(len(forced)), torch.tensor(forced)] = 1.0
    return ChainDraft(forced + list(draft.token_ids), torch.cat([one_hot, draft.probs]),
                      [1.0] * len(forced) + list(draft.token_probs), sampled=draft.sampled, forced=len(forced))
