"""A draft model drafting for many requests at once: batched chains and beam-search trees.

Three callers: the verifier's local serving (:mod:`goodspeed.verifier.local`) drafts for every
request of its continuous batch, an edge node serving several requests
(:mod:`goodspeed.drafter.node`) drafts for its requests together, and an edge drafter drafting one
request at a time with CUDA graphs (:class:`goodspeed.drafter.runner.SlotDraftKV`) keeps its one
request in a slot. Either way the draft model keeps
its KV in a :class:`~goodspeed.lm.runtime.kv_slots.SlotKVCache` (one slot per request, the same
structure the target uses) and every draft step is ONE forward over all requests.

* Catch-up: the committed tokens a request's draft KV does not hold yet (at least the last
  committed token; after speculation was off, everything since) are fed as one chain per row and
  committed to the draft KV.
* Chains (``none``, ``chain``, ``tetris``, ``turbospec``, ``nightjar``): ``k`` autoregressive steps;
  drafted tokens are committed to the draft KV as they are fed and rolled back after the verdict
  to what the target accepted (rollback is setting a length).
* Trees (AdaServe, Section 4.2 "Step 1: Speculation"): beam search of width ``w`` and depth ``d``.
  The first step expands each root (the last committed token) into its ``w`` most probable
  children; every later step feeds the ``w`` nodes chosen last (``n * w`` tokens) and keeps, per
  request, the ``w`` best of their ``w * |V|`` children by approximated path probability (the
  product of draft probabilities from the root). The tree nodes are written as scratch entries
  beyond the committed draft KV (node ``k`` at offset ``k``) and attend to the committed prefix
  and their own ancestors only; they are dropped after the step (nothing to roll back).

CUDA graphs (``cuda_graphs=True``, CUDA only; :mod:`goodspeed.lm.runtime.graphs`): a forward is laid out
at fixed shapes (:meth:`~goodspeed.lm.runtime.kv_slots.SlotKVCache.prepare_static`: the window from slot
0, rows, queries and keys rounded up to powers of two) and replayed as the graph captured for its
shape, the LM head run after it on the positions read; a forward that does not fit one (a long
catch-up, the first forward) runs eagerly.

Candidate probabilities (tree nodes, and the per-token confidence TETRIS ranks chains by) are the
request's processed draft distribution (its temperature, top-k, top-p); for greedy requests, whose
processed distribution is one-hot, the draft's softmax ranks the candidates. Trees hold deterministic candidates: the target verifies them losslessly without
``q`` (:func:`goodspeed.verifier.rejection.verify_tree`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from goodspeed.lm.decoding.adjust import adjust_logits
from goodspeed.lm.decoding.history import TokenHistory
from goodspeed.lm.decoding.sampling import draft_step, process_logits
from goodspeed.lm.decoding.params import SamplingParams, check_proposal_top_k
from goodspeed.lm.decoding.proposals import BeamTree, ChainDraft
from goodspeed.lm.runtime.attention import keep_logits, use_gqa_attention, with_cache
from goodspeed.lm.runtime.graphs import StepGraphs
from goodspeed.lm.runtime.kv_slots import SlotKVCache, SlotTable
from goodspeed.lm.runtime.packing import additive_mask, build_attention


class BatchDraftModel:
    """Batched drafting for a set of requests. Not thread-safe (one thread owns it: the verifier's
    engine thread, or an edge node's drafting thread)."""

    def __init__(self, model: torch.nn.Module, proposal_top_k: int = 0, cuda_graphs: bool = False,
                 torch_compile: bool = False) -> None:
        """``proposal_top_k``: sampled chains come from only the draft distribution's ``k`` most
        likely tokens a position (:func:`goodspeed.lm.decoding.sampling.cap_support`; 0: all, as local
        serving, whose ``q`` never travels, uses it). ``cuda_graphs``: forwards replayed as CUDA
        graphs where they fit one (the module docstring; CUDA only). ``torch_compile``: forwards
        at fixed shapes where they fit one, through a decoder compiled by ``torch.compile`` (any
        device; :class:`goodspeed.lm.runtime.graphs.StepGraphs`)."""
        self.model = model.eval()
        self.proposal_top_k = check_proposal_top_k(proposal_top_k)
        use_gqa_attention(self.model)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = int(model.config.vocab_size)
        self.cache = SlotKVCache(int(model.config.num_hidden_layers))
        self.slots = SlotTable(self.cache)  # request id -> draft KV slot
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs needs a CUDA device; this draft model is on {self.device}")
        # None: every forward eager at its own shape
        self.graphs = (StepGraphs(self.model, self.cache, capture=cuda_graphs, torch_compile=torch_compile)
                       if cuda_graphs or torch_compile else None)
        self.forwards = 0  # draft forward passes so far (for reports)
        # Called after every forward with (context tokens, batched tokens): a simulated clock
        # charges the forward's modeled cost here.
        self.on_forward = None

    # ------------------------------------------------------------------- slots

    def add(self, key: str) -> None:
        self.slots.add(key)

    def remove(self, key: str, committed: Sequence[int] | None = None) -> None:
        """Free the request's slot (``committed``, its final text, is for sources that learn from
        it: :mod:`goodspeed.lm.decoding.draft_source`)."""
        self.slots.remove(key)

    def cached_length(self, key: str) -> int:
        return self.cache.lengths[self.slots.slot(key)]

    def rollback(self, key: str, committed_before: int, num_accepted: int) -> None:
        """After a chain verdict: keep the draft KV of the committed tokens and accepted drafts."""
        slot = self.slots.slot(key)
        self.cache.truncate(slot, min(self.cache.lengths[slot], committed_before + num_accepted))

    # ---------------------------------------------------------------- forwards

    def _forward(self, tokens: dict[str, list[int]], parents: dict[str, list[int]] | None = None, offset: int = 0,
                 scratch_anc: dict[str, torch.Tensor] | None = None, last_only: bool = False,
                 stacked: bool = False) -> dict[str, torch.Tensor] | torch.Tensor:
        """One forward over the slot window holding ``tokens``' keys; returns their logits
        ``[len(tokens[key]), V]`` per key, or with ``last_only`` ``[1, V]``, the logits after each
        key's last token: the LM head then runs only at the positions where some row ends, not
        at every padded position (so a new request's prompt does not cost every row of the
        window ``len(prompt)`` vocabulary projections). ``scratch_anc`` (beam steps): per key a
        bool matrix ``[q_len, offset]`` of the scratch entries each new token may see, besides the prefix.
        ``stacked``: one tensor ``[len(tokens), q_len, V]`` instead, the keys' rows in ``tokens``'
        order, each padded to the longest (what a pad position holds is not defined)."""
        slots = sorted(self.slots.slot(k) for k in tokens)
        first, last = slots[0], slots[-1]
        width = last - first + 1
        q_len = max(len(t) for t in tokens.values())
        out = None
        if self.graphs is not None:
            out = self._static_forward(tokens, parents, offset, scratch_anc, last_only, stacked, last, q_len)
        if out is None:
            out = self._eager_forward(tokens, parents, offset, scratch_anc, last_only, stacked, first, last, q_len)
        self.forwards += 1
        if self.on_forward is not None:  # the window's context and batched tokens, whichever way it ran
            self.on_forward(sum(self.cache.lengths[first : last + 1]) + offset * width, width * q_len)
        return out

    def _eager_forward(self, tokens, parents, offset, scratch_anc, last_only, stacked, first, last, q_len):
        """:meth:`_forward`'s result, the window ``[first, last]`` run as it is."""
        width = last - first + 1
        ids, row_parents = self._rows(tokens, parents, first, width, q_len)
        window = slice(first, last + 1)
        kv_len = self.cache.prepare(q_len, window, offset)
        lengths = self.cache.lengths[window]
        if scratch_anc is None:
            mask, positions = build_attention(lengths, row_parents, q_len, kv_len, self.dtype, self.device)
        else:
            mask, positions = self._beam_attention(lengths, tokens, first, width, q_len, offset, kv_len, scratch_anc)
        keep: dict = {}
        if last_only:  # the distinct positions where some row ends; each key's index among them
            ends = sorted({len(t) - 1 for t in tokens.values()})
            keep = keep_logits(self.model, torch.tensor(ends, device=self.device))
            column = {end: i for i, end in enumerate(ends)} if keep else {end: end for end in ends}
        with torch.inference_mode():
            out = self.model(input_ids=ids.to(self.device), attention_mask=mask, position_ids=positions,
                             **with_cache(self.model, self.cache), use_cache=True, **keep)
        if last_only:
            return {key: out.logits[self.slots.slot(key) - first, column[len(toks) - 1]][None] for key, toks in tokens.items()}
        if stacked:
            return out.logits.index_select(0, torch.tensor([self.slots.slot(key) - first for key in tokens], device=out.logits.device))
        return {key: out.logits[self.slots.slot(key) - first, : len(toks)] for key, toks in tokens.items()}

    def _rows(self, tokens: dict[str, list[int]], parents: dict[str, list[int]] | None, first: int, width: int,
              q_len: int) -> tuple[torch.Tensor, list[list[int] | None]]:
        """Token ids ``[width, q_len]`` (0 where a row has none) and per-row parents of the window
        from slot ``first``."""
        ids = np.zeros((width, q_len), dtype=np.int64)  # numpy: no torch op a row (a small draft's step is overhead-bound)
        row_parents: list[list[int] | None] = [None] * width
        for key, toks in tokens.items():
            r = self.slots.slot(key) - first
            ids[r, : len(toks)] = toks
            if parents is not None:
                row_parents[r] = parents[key]
        return torch.from_numpy(ids), row_parents

    @torch.inference_mode()
    def _static_forward(self, tokens, parents, offset, scratch_anc, last_only, stacked, last, q_len):
        """:meth:`_forward`'s result through :attr:`graphs`: the window ``[0, W)``, rows, queries and
        keys rounded up to powers of two, pads (token 0) in idle rows and past each row's tokens,
        written past each slot's committed length plus ``offset`` as in the eager forward; the LM
        head on the positions read. None where the forward fits no shape."""
        shape = self.graphs.shape_for(last, q_len, offset)
        if shape is None or not self.cache.prepare_static(shape[1], shape[0], offset, shape[2]):
            return None
        width, q_pad, kv_len = shape
        ids, row_parents = self._rows(tokens, parents, 0, width, q_pad)
        lengths = self.cache.window_lengths(width)
        if scratch_anc is None:
            mask, positions = build_attention(lengths, row_parents, q_pad, kv_len, self.dtype, self.device)
        else:
            mask, positions = self._beam_attention(lengths, tokens, 0, width, q_pad, offset, kv_len, scratch_anc)
        hidden = self.graphs.run(ids.to(self.device), positions, mask)
        rows = hidden.index_select(0, torch.tensor([self.slots.slot(k) for k in tokens], device=hidden.device))
        head = self.graphs.head
        if last_only:  # each key's last token
            ends = torch.tensor([len(t) - 1 for t in tokens.values()], device=hidden.device)
            logits = head(rows[torch.arange(len(tokens), device=hidden.device), ends])
            return {key: logits[i][None] for i, key in enumerate(tokens)}
        logits = head(rows[:, :q_len])  # [keys, q_len, V]
        if stacked:
            return logits
        return {key: logits[i, : len(toks)] for i, (key, toks) in enumerate(tokens.items())}

    def _beam_attention(self, lengths, tokens, first, width, q_len, offset, kv_len, scratch_anc):
        allowed = torch.zeros(width, q_len, kv_len, dtype=torch.bool)
        positions = torch.zeros(width, q_len, dtype=torch.long)
        new = torch.arange(q_len)
        for b in range(width):  # every query sees its row's prefix and itself
            allowed[b, :, : lengths[b]] = True
            allowed[b, new, lengths[b] + offset + new] = True
            positions[b] = lengths[b]
        for key, anc in scratch_anc.items():
            b = self.slots.slot(key) - first
            n = lengths[b]
            allowed[b, : anc.shape[0], n : n + offset] = anc
            positions[b, : anc.shape[0]] = n + anc.sum(dim=1)  # a depth-d node: d - 1 drafted ancestors
        return additive_mask(allowed, self.dtype, self.device), positions.to(self.device)

    def catch_up(self, committed: dict[str, Sequence[int]]) -> dict[str, torch.Tensor]:
        """Feed each request's uncached committed tokens (at least the last one) and commit them
        to the draft KV; returns the logits after the last committed token, per key."""
        feed = {}
        for key, toks in committed.items():
            slot = self.slots.slot(key)
            pending = len(toks) - 1
            if self.cache.lengths[slot] > pending:  # drafts fed earlier and not yet rolled back
                self.cache.truncate(slot, pending)
            feed[key] = [int(t) for t in toks[self.cache.lengths[slot] :]]
        return self.feed(feed)

    def feed(self, tokens: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """Feed each key's ``tokens`` (at least one) after its cached entries, in one forward, and
        commit them to its draft KV; returns the logits ``[V]`` after each key's last token."""
        if any(not toks for toks in tokens.values()):
            raise ValueError("every key fed needs at least one token")
        logits = self._forward(tokens, last_only=True)
        for key, toks in tokens.items():
            slot = self.slots.slot(key)
            self.cache.commit(slot, self.cache.lengths[slot], list(range(len(toks))))
        return {key: lg[-1] for key, lg in logits.items()}

    # ------------------------------------------------------------------ warm-up

    # warm_up: (rows, what) of each synthetic drafting step, rows from the first key: requests join
    # in waves (a new key's prompt caught up beside rows already drafting; the pool growing from
    # one slot to four to eight), chains accepted whole (a catch-up of two tokens) and in part (of
    # one), trees one beam wide for one request and as wide as allowed for several; the keys' KV
    # grows between steps.
    WARM_UP_PLAN = ((1, "chain"), (1, "tree"), (4, "chain"), (4, "tree"), (2, "chain"), (1, "chain"),
                    (8, "tree"), (8, "chain"), (3, "tree"), (8, "chain"))

    # The chains an edge drafter's warm-up drafts (its lengths come from the verifier, round by
    # round; a chain's length only adds steps of one query a row, whatever it is).
    EDGE_WARM_UP_CHAIN = 4

    def warm_up(self, chains: int = 0, tree: tuple[int, int] | None = None, prompt_len: int = 32) -> int:
        """Fixed-shape forwards (``cuda_graphs`` / ``torch_compile``) compile and capture their first
        graphs here, before a request would wait on them: synthetic requests (greedy, prompts of
        ``prompt_len`` tokens) drafting as :data:`WARM_UP_PLAN` says, chains of ``chains`` tokens
        (0: no chain steps), trees of ``tree = (depth, width)`` (None: no tree steps), the trees of
        ``n`` requests ``min(width, n)`` beams wide. Returns the
        drafting steps run; the synthetic requests leave, and nothing of them stays but the graphs.
        Without fixed-shape forwards it does nothing (0)."""
        if self.graphs is None or (chains < 1 and tree is None):
            return 0
        if tree is not None and (tree[0] < 1 or tree[1] < 1):
            raise ValueError("the warm-up tree's depth and width must be >= 1")
        keys = [f"warm-up-{i}" for i in range(8)]
        committed = {key: [1 + i] * prompt_len for i, key in enumerate(keys)}
        generator = torch.Generator(device="cpu").manual_seed(0)
        steps = 0
        try:
            for index, (rows, what) in enumerate(self.WARM_UP_PLAN):
                now = keys[:rows]
                for key in now:
                    if key not in self.slots:
                        self.add(key)
                greedy = {key: SamplingParams() for key in now}
                if what == "chain" and chains >= 1:
                    drafts = self.draft_chains({k: committed[k] for k in now}, {k: chains for k in now}, greedy, generator)
                    for i, key in enumerate(now):  # alternately accepted whole and cut after one token
                        accepted = chains if (i + index) % 2 == 0 else min(1, chains)
                        before = len(committed[key])
                        committed[key] = committed[key] + drafts[key].token_ids[:accepted] + [0]
                        self.rollback(key, before, accepted)
                elif what == "tree" and tree is not None:
                    self.draft_trees({k: committed[k] for k in now}, tree[0], min(tree[1], len(now)), greedy)
                    for key in now:
                        committed[key] = committed[key] + [0]
                else:
                    continue
                steps += 1
        finally:
            for key in keys:
                if key in self.slots:
                    self.remove(key)
        return steps

    # ------------------------------------------------------------------ chains

    def draft_chains(self, committed: dict[str, Sequence[int]], lengths: dict[str, int], sampling: dict[str, SamplingParams],
                     generator: torch.Generator | Mapping[str, torch.Generator],
                     histories: Mapping[str, TokenHistory | None] | None = None) -> dict[str, ChainDraft]:
        """Draft ``lengths[key]`` tokens after each request's committed tokens (all in one batch
        per step); keys with length 0 are left alone. ``generator``: one sampling stream for all
        keys, or one per key (seeded requests). A request whose settings bias or penalise logits
        drafts from the draft's logits adjusted the same way (``histories[key]``: its text, the
        committed tokens; each step adds the tokens drafted before it), which keeps its acceptance
        where the target's adjusted distribution moves; exactness never depends on it."""
        streams = generator if isinstance(generator, Mapping) else {k: generator for k in lengths}
        active = {k: n for k, n in lengths.items() if n > 0}
        out = {k: ChainDraft([], torch.zeros(0, self.vocab_size), []) for k in lengths if k not in active}
        if not active:
            return out
        last = self.catch_up({k: committed[k] for k in active})
        drafted: dict[str, list[int]] = {k: [] for k in active}
        probs: dict[str, list[torch.Tensor]] = {k: [] for k in active}
        confidence: dict[str, list[float]] = {k: [] for k in active}
        for step in range(max(active.values())):
            now = [key for key in active if step < active[key]]
            # One uniform per request, drawn in key order from its stream (as a request drafting alone would).
            uniforms = torch.cat([torch.rand(1, generator=streams[key], dtype=torch.float64) for key in now])
            logits = _adjusted(torch.stack([last[key] for key in now]), now, [drafted[key] for key in now], sampling, histories)
            q, tokens, conf = draft_step(logits, [sampling[key] for key in now], self.proposal_top_k, uniforms)
            for j, key in enumerate(now):
                drafted[key].append(tokens[j])
                probs[key].append(q[j])
                confidence[key].append(conf[j])
            feeding = {k: [drafted[k][-1]] for k in active if step + 1 < active[k]}
            if not feeding:
                break
            last = {k: lg[-1] for k, lg in self._forward(feeding).items()}
            for key in feeding:
                slot = self.slots.slot(key)
                self.cache.commit(slot, self.cache.lengths[slot], [0])
        for key in active:
            q = torch.stack(probs[key])
            out[key] = ChainDraft(drafted[key], q, confidence[key], sampled=not sampling[key].greedy)
        return out

    # ------------------------------------------------------------------- trees

    @staticmethod
    def _ranking(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
        """What beam search ranks candidates by: the draft's softmax for a greedy request, its
        processed distribution (temperature, top-k / top-p) for a sampled one."""
        if sampling.greedy:
            return torch.softmax(logits.double(), dim=-1)
        return process_logits(logits.double(), sampling)

    @classmethod
    def _rankings(cls, logits: torch.Tensor, sampling: list[SamplingParams]) -> torch.Tensor:
        """:meth:`_ranking` of each row of ``logits`` ``[rows, V]`` with its own settings, in one
        pass over the rows (each row as it alone gives)."""
        if all(s.greedy for s in sampling):
            return torch.softmax(logits.double(), dim=-1)
        if not any(s.greedy for s in sampling):
            return process_logits(logits.double(), sampling)
        return torch.stack([cls._ranking(row, s) for row, s in zip(logits, sampling)])

    def draft_trees(self, committed: dict[str, Sequence[int]], depth: int, width: int, sampling: dict[str, SamplingParams],
                    max_depths: dict[str, int] | None = None,
                    histories: Mapping[str, TokenHistory | None] | None = None) -> dict[str, BeamTree]:
        """Beam search of ``width`` and ``depth`` for every request (``max_depths[key]`` caps one
        request's depth, e.g. by its remaining tokens); zero-probability candidates are dropped.
        A request whose settings bias or penalise logits ranks each beam's candidates by the
        draft's logits adjusted by its text (``histories[key]``) and the beam's path, as
        :meth:`draft_chains` does."""
        if depth < 1 or width < 1:
            raise ValueError("depth and width must be >= 1")
        caps = {k: min(depth, (max_depths or {}).get(k, depth)) for k in committed}
        trees = {k: BeamTree([], [], [], []) for k in committed}
        active = [k for k in committed if caps[k] >= 1]
        if not active:
            return trees
        last = self.catch_up({k: committed[k] for k in active})
        # Per key: all candidate nodes so far, and the indices of the current beams. The roots'
        # children for every key at once: one ranking and one top-k over the stacked rows, read
        # back in one copy (row by row, a launch-bound GPU paid a few ops and two syncs a request).
        beams: dict[str, list[int]] = {}
        roots = _adjusted(torch.stack([last[key] for key in active]), active, [[] for _ in active], sampling, histories)
        top = torch.topk(self._rankings(roots, [sampling[key] for key in active]), min(width, self.vocab_size), dim=-1)
        for key, values, indices in zip(active, top.values.tolist(), top.indices.tolist()):
            beams[key] = [_add_node(trees[key], tok, -1, p) for p, tok in zip(values, indices) if p > 0]
        scratch: dict[str, dict[int, int]] = {k: {} for k in active}  # node -> its scratch offset
        written = 0  # scratch entries written beyond the committed draft KV, per row (padded)
        for step in range(2, depth + 1):
            grow = [k for k in active if caps[k] >= step and beams[k]]
            if not grow:
                break
            offset = written  # every row writes this step's nodes at the same scratch offset
            feed, anc = {}, {}
            for key in grow:
                tree, nodes = trees[key], beams[key]
                feed[key] = [tree.token_ids[n] for n in nodes]
                a = torch.zeros(len(nodes), offset, dtype=torch.bool)
                for i, n in enumerate(nodes):
                    scratch[key][n] = offset + i
                    p = tree.parents[n]
                    while p >= 0:
                        a[i, scratch[key][p]] = True
                        p = tree.parents[p]
                anc[key] = a
            written += max(len(f) for f in feed.values())
            # Every key's beams at once: its candidates' path probabilities [keys, beams, V] (a
            # key with fewer beams than the longest gets path probability 0 on the pad rows, so
            # their candidates are dropped like any other of probability 0), one top-k over each
            # key's beams x V, read back in one copy.
            logits = self._forward(feed, offset=offset, scratch_anc=anc, stacked=True)  # [keys, beams, V]
            keys, rows, vocab = logits.shape
            base = torch.tensor([[trees[key].path_probs[n] for n in beams[key]] + [0.0] * (rows - len(beams[key]))
                                 for key in grow], dtype=torch.float64).to(logits.device)
            flat_keys, flat_paths = [], []  # each beam's key and path; a pad row's key is None
            for key in grow:
                for i in range(rows):
                    real = i < len(beams[key])
                    flat_keys.append(key if real else None)
                    flat_paths.append(_path(trees[key], beams[key][i]) if real else [])
            flat = _adjusted(logits.reshape(keys * rows, vocab), flat_keys, flat_paths, sampling, histories)
            rankings = self._rankings(flat, [sampling[key] for key in grow for _ in range(rows)])
            cand = (base.unsqueeze(2) * rankings.view(keys, rows, vocab)).view(keys, rows * vocab)
            top = torch.topk(cand, min(width, rows * vocab), dim=-1)
            for key, values, indices in zip(grow, top.values.tolist(), top.indices.tolist()):
                nodes = beams[key]
                beams[key] = [_add_node(trees[key], idx % vocab, nodes[idx // vocab], p) for p, idx in zip(values, indices) if p > 0]
        return trees


def _adjusted(logits: torch.Tensor, keys: Sequence[str | None], paths: Sequence[Sequence[int]],
              sampling: Mapping[str, SamplingParams], histories: Mapping[str, TokenHistory | None] | None) -> torch.Tensor:
    """``logits [n, V]`` (a fresh tensor, changed in place where it is float32 or wider) with row
    ``i`` adjusted by its request's bias and penalties (:func:`~goodspeed.lm.decoding.adjust.adjust_logits`)
    for the text ``histories[keys[i]]`` plus ``paths[i]`` (the tokens drafted since); rows of keys
    that adjust nothing, and ``None`` keys, as they are."""
    chosen = [i for i, key in enumerate(keys) if key is not None and sampling[key].adjusts_logits]
    if not chosen:
        return logits
    work = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    return adjust_logits(work[:, None], chosen, [sampling[keys[i]] for i in chosen],
                         [(histories or {}).get(keys[i]) for i in chosen], [[paths[i]] for i in chosen])[:, 0]


def _path(tree: BeamTree, node: int) -> list[int]:
    """The tokens from the root's child down to ``node``, inclusive."""
    tokens = []
    while node >= 0:
        tokens.append(tree.token_ids[node])
        node = tree.parents[node]
    return tokens[::-1]


def _add_node(tree: BeamTree, token: int, parent: int, path_prob: float) -> int:
    """Append a candidate (``parent`` -1: a child of the root); returns its index."""
    tree.token_ids.append(int(token))
    tree.parents.append(parent)
    tree.path_probs.append(float(path_prob))
    tree.depths.append(1 if parent < 0 else tree.depths[parent] + 1)
    return len(tree.token_ids) - 1


def subtree(tree: BeamTree, nodes: np.ndarray | Sequence[int]) -> tuple[list[int], list[int]]:
    """The selected nodes (a parent-closed set, ascending) as a draft: token ids and parents
    re-indexed into the selection."""
    chosen = [int(n) for n in nodes]
    index = {n: i for i, n in enumerate(chosen)}
    parents = []
    for n in chosen:
        p = tree.parents[n]
        if p >= 0 and p not in index:
            raise ValueError(f"node {n}'s parent {p} is not selected")
        parents.append(-1 if p < 0 else index[p])
    return [tree.token_ids[n] for n in chosen], parents
