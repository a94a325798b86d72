import pytest
import torch

from goodspeed.lm.runtime.attention import REFERENCE_VARLEN
from goodspeed.lm.runtime.kv_slots import SlotKVCache, SlotTable
from goodspeed.lm.runtime.packing import additive_mask, build_attention

# Packed forwards through each attention path: masked SDPA for every group (None), and chains
# through the varlen call (REFERENCE_VARLEN: its plain-torch meaning, on CPU).
VARLEN = [None, REFERENCE_VARLEN]
VARLEN_IDS = ["masked", "varlen"]


def test_slot_table_follows_the_cache_when_a_slot_is_freed():
    cache = SlotKVCache(num_layers=1)
    table = SlotTable(cache)
    assert [table.add(k) for k in ("a", "b", "c")] == [0, 1, 2]
    with torch.inference_mode():
        cache.keys[0] = torch.arange(3.0).view(3, 1, 1, 1).expand(3, 1, 4, 1).clone()  # slot s holds the value s
        cache.values[0] = cache.keys[0].clone()
    cache.lengths[:] = [4, 2, 3]
    table.remove("a")  # the last slot ("c") moves into the hole, with its KV and length
    assert table.keys == ["c", "b"] and table.slot("c") == 0 and table.slot("b") == 1 and "a" not in table
    assert cache.lengths == [3, 2] and cache.keys[0][0, 0, :3, 0].tolist() == [2.0, 2.0, 2.0]
    table.remove("b")  # the last slot: nothing moves
    assert table.keys == ["c"] and cache.lengths == [3]
    with pytest.raises(ValueError, match="already has a slot"):
        table.add("c")


def test_additive_mask_is_zero_where_allowed_and_finfo_min_elsewhere():
    allowed = torch.tensor([[[True, False], [True, True]]])
    mask = additive_mask(allowed, torch.float32, "cpu")
    assert mask.shape == (1, 1, 2, 2)
    assert mask[0, 0].tolist() == [[0.0, torch.finfo(torch.float32).min], [0.0, 0.0]]


def test_memory_is_given_back_when_long_sessions_leave():
    """A long prompt grew every buffer to its length; after its slot is freed the buffers shrink
    to what the remaining slots need."""
    cache = SlotKVCache(num_layers=1, initial_capacity=8)
    for _ in range(3):
        cache.add_slot()
    cache.prepare(200, slice(0, 1))  # slot 0 writes 200 positions: capacity grows to 256
    cache.update(torch.ones(1, 2, 200, 4), torch.ones(1, 2, 200, 4), 0)
    cache.commit(0, 0, list(range(200)))
    cache.prepare(3, slice(1, 3))
    cache.update(torch.full((2, 2, 3, 4), 2.0), torch.full((2, 2, 3, 4), 2.0), 0)
    cache.commit(1, 0, [0, 1, 2])
    cache.commit(2, 0, [0, 1, 2])
    assert cache.keys[0].shape[2] == 256
    cache.free_slot(0)  # the long one leaves; slot 2 moves into its place
    assert cache.keys[0].shape == (2, 2, 8, 4) and cache.lengths == [3, 3]
    assert bool((cache.keys[0][:, :, :3] == 2.0).all())  # the others' KV survives the shrink
    cache.free_slot(1)
    cache.free_slot(0)
    assert cache.keys[0].shape[2] == 8  # small buffers are kept for the next sessions
    long = SlotKVCache(num_layers=1, initial_capacity=8)
    long.add_slot()
    long.prepare(100, slice(0, 1))
    long.update(torch.ones(1, 2, 100, 4), torch.ones(1, 2, 100, 4), 0)
    long.commit(0, 0, list(range(100)))
    long.free_slot(0)  # the only (long) session leaves: everything goes
    assert long.keys == [None] and long.values == [None]


def _step(model, cache, tokens, parents, packed, solo=(), layouts=None, dtype=torch.float64, device="cpu", pad=False):
    """One forward over every slot of ``cache``; logits ``[rows, q_len, V]`` (packed: gathered back
    to the padded layout; pad positions are not compared). ``layouts`` collects packed layouts;
    ``pad``: ``pack(pad=True)``."""
    from goodspeed.lm.runtime.attention import PACKED, with_cache
    from goodspeed.lm.runtime.packing import build_attention

    window = slice(0, len(tokens))
    with torch.inference_mode():
        if packed:
            layout = cache.pack(tokens, parents, window, dtype, device, solo=solo, pad=pad)
            if layouts is not None:
                layouts.append(layout)
            out = model(input_ids=layout.input_ids, attention_mask=layout.mask, position_ids=layout.position_ids,
                        **with_cache(model, cache), use_cache=True, **{PACKED: layout})
            if not pad:
                assert out.logits.shape[1] == sum(map(len, tokens))  # the model saw no padding
            return layout.padded(out.logits, [r for r, t in enumerate(tokens) if t and r not in solo])
        q_len = max(map(len, tokens))
        ids = torch.tensor([t + [0] * (q_len - len(t)) for t in tokens], device=device)
        kv_len = cache.prepare(q_len, window)
        mask, positions = build_attention(cache.lengths[window], parents, q_len, kv_len, dtype, device)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, **with_cache(model, cache), use_cache=True).logits
        return logits[[r for r, t in enumerate(tokens) if t and r not in solo]]


@pytest.mark.parametrize("varlen", VARLEN, ids=VARLEN_IDS)
def test_packed_forwards_equal_padded_ones_for_chains_trees_and_idle_slots(varlen):
    """The packed target runner against the padded reference: ragged prefills, then one mixed step
    (a chain, a tree, an idle slot, a single token), then rows of equal length (no gather). Same logits to 1e-9 (float64; the only
    difference is the matmul shapes), same KV written."""
    from goodspeed.lm.runtime.attention import use_gqa_attention
    from modelkit import tiny_llama

    model = tiny_llama(7)  # 4 query heads over 2 KV heads: grouped-query attention
    use_gqa_attention(model)
    caches = {mode: SlotKVCache(num_layers=2, initial_capacity=8) for mode in ("padded", "packed")}
    caches["packed"].varlen, layouts = varlen, []
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [3, 3, 3, 3], [5]]
    steps = [
        (prompts, [None] * 4),
        ([[10, 11, 12], [13, 14, 15, 16, 17], [], [18]], [None, [-1, 0, 0, 1, 2], None, None]),
        ([[19, 20], [21, 22], [23, 24], [25, 26]], [None, [-1, -1], None, None]),  # no padding at all
    ]
    for mode, cache in caches.items():
        for _ in prompts:
            cache.add_slot()
    for tokens, parents in steps:
        out = {mode: _step(model, cache, tokens, parents, mode == "packed", layouts=layouts) for mode, cache in caches.items()}
        for r, row in enumerate(r for r, t in enumerate(tokens) if t):
            n = len(tokens[row])
            assert torch.allclose(out["packed"][r, :n], out["padded"][r, :n], atol=1e-9, rtol=0)
        for mode, cache in caches.items():
            for slot, t in enumerate(tokens):
                cache.commit(slot, cache.lengths[slot], list(range(len(t))))
        _assert_same_kv(caches["packed"], caches["padded"])
    # Slot 0 outgrows the pool (8) at step 1 and slot 1 at step 2: buffers of their own (16). Chains
    # take the varlen call, a tree (slot 1) keeps its group masked.
    expected = {None: [["masked"], ["masked"] * 2, ["masked"] * 3],
                REFERENCE_VARLEN: [["varlen"], ["varlen", "masked"], ["varlen", "masked", "varlen"]]}
    assert _paths(layouts) == expected[varlen]


@pytest.mark.parametrize("varlen", VARLEN, ids=VARLEN_IDS)
def test_padded_rows_equal_gathered_ones_and_fall_back_where_they_cannot_pad(varlen):
    """pack(pad=True): where a step has no prompt chunk and no slot with KV buffers of its own, and
    its rows share a masked group, the rows are laid out padded (pads in the model's input, no
    gather or scatter), with the same logits at every real position as the gathered layout and
    the same committed KV after each step's commits, tree moves included (float64, 1e-9). Where
    the step cannot pad (a chunk, a slot outgrowing the pool, chains for the varlen kernel), the
    layout is the gathered one."""
    from goodspeed.lm.runtime.attention import use_gqa_attention
    from modelkit import tiny_llama

    model = tiny_llama(11)
    use_gqa_attention(model)
    caches = {mode: SlotKVCache(num_layers=2, initial_capacity=16) for mode in ("gather", "pad")}
    for cache in caches.values():
        cache.varlen = varlen
        for _ in range(4):
            cache.add_slot()
    steps = [  # (tokens, parents, solo, kept per row: what each row commits)
        ([[1, 2, 3, 4, 5], [9, 8], [3, 3, 3], [5]], [None] * 4, (), None),
        ([[10, 11, 12], [13, 14, 15, 16], [], [18]], [None, [-1, 0, 0, 1], None, None], (), [[0, 1], [0, 2, 3], [], [0]]),
        ([[19], [20, 21, 22], [23, 24], [25]], [[-1], [-1, -1, 0], None, None], (), [[0], [0, 2], [0, 1], [0]]),
        ([[26, 27], [28], [30, 31, 32, 33, 34, 35, 36, 37], [29]], [None] * 4, (2,), None),  # a prompt chunk: no pad
        ([[38], [39, 40], [41, 42, 43, 44, 45, 46, 47, 7, 6], []], [None, [-1, 0], None, None], (), None),  # slot 2 outgrows 16
    ]
    padded = []
    for tokens, parents, solo, kept in steps:
        out = {}
        for mode, cache in caches.items():
            layouts = []
            out[mode] = _step(model, cache, tokens, parents, True, solo=solo, layouts=layouts, pad=mode == "pad")
            if mode == "pad":
                layout = layouts[0]
                padded.append(layout.input_ids.shape[1] == len(tokens) * max(map(len, tokens)))
                if padded[-1]:
                    assert len(layout.groups) == 1 and layout.groups[0].gather is None and layout.groups[0].scatter is None
        for r, row in enumerate(r for r, t in enumerate(tokens) if t and r not in solo):
            n = len(tokens[row])
            assert torch.allclose(out["pad"][r, :n], out["gather"][r, :n], atol=1e-9, rtol=0)
        for cache in caches.values():
            cache.commit_many([(slot, cache.lengths[slot], (kept[slot] if kept else list(range(len(t)))))
                               for slot, t in enumerate(tokens)])
        _assert_same_kv(caches["pad"], caches["gather"])
    # Steps 0-2 pad when the shared group is masked (with the varlen kernel, step 0's chains need no
    # gather); the chunk (3) and the slot outgrowing the pool (4) keep the gathered layout.
    assert padded == ([True, True, True, False, False] if varlen is None else [False, True, True, False, False])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_packed_forwards_through_flash_varlen_equal_masked_ones():
    """GPU: the engine's varlen choice on a bf16 model on CUDA, then the same packed steps (ragged
    prefills, chains with an idle slot, a prompt chunk beside chains, a tree) through flash's
    varlen kernel and through masked SDPA, and padded in float32: the varlen logits are as close
    to float32's as the masked ones (within 1% of the logits' range more) and within 2% of that
    range of the masked ones; every chain group took the kernel."""
    from goodspeed.lm.runtime.attention import use_gqa_attention, varlen_kernel_for
    from modelkit import tiny_llama

    half = tiny_llama(5, hidden=256, heads=4, kv_heads=2, dtype=torch.bfloat16).cuda()  # head dim 64
    full = tiny_llama(5, hidden=256, heads=4, kv_heads=2, dtype=torch.float32).cuda()
    kernel = varlen_kernel_for(half)
    if kernel is None:
        pytest.skip("this torch's flash varlen op takes no per-sequence key lengths")
    for model in (half, full):
        use_gqa_attention(model)
    caches = {mode: SlotKVCache(num_layers=2) for mode in ("varlen", "masked", "float32")}
    caches["varlen"].varlen, layouts = kernel, []
    steps = [
        ([list(range(1, 40)), [9, 8], list(range(5, 20)), [5]], [None] * 4, ()),
        ([[10, 11, 12], [13, 14, 15, 16, 17], [], [18]], [None] * 4, ()),
        ([[19], list(range(1, 47)) * 3, [20, 21], [22, 23, 24]], [None] * 4, (1,)),  # slot 1: a 138-token chunk
        ([[25, 26, 27], [28], [29, 30, 31, 32], [33]], [[-1, 0, 0], None, None, None], ()),  # a tree: masked
    ]
    for cache in caches.values():
        for _ in range(4):
            cache.add_slot()
    for tokens, parents, solo in steps:
        out = {mode: _step(full if mode == "float32" else half, cache, tokens, parents, mode != "float32",
                           solo if mode != "float32" else (), layouts if mode == "varlen" else None,
                           torch.float32 if mode == "float32" else torch.bfloat16, "cuda").float()
               for mode, cache in caches.items()}
        rows = [r for r, t in enumerate(tokens) if t]
        kept = [r for r in rows if r not in solo]
        want = out["float32"][[rows.index(r) for r in kept]]
        span = float(want.max() - want.min())
        for r, row in enumerate(kept):
            n = len(tokens[row])
            varlen, masked, exact = out["varlen"][r, :n], out["masked"][r, :n], want[r, :n]
            assert (varlen - masked).abs().max() <= 0.02 * span
            assert (varlen - exact).abs().max() <= (masked - exact).abs().max() + 0.01 * span
        for cache in caches.values():
            for slot, t in enumerate(tokens):
                cache.commit(slot, cache.lengths[slot], list(range(len(t))))
    assert _paths(layouts) == [["varlen"], ["varlen"], ["varlen", "varlen"], ["masked"]]


def _paths(layouts) -> list[list[str]]:
    """Each packed forward's attention groups, in order: "varlen" (no mask) or "masked"."""
    kinds = []
    for layout in layouts:
        assert all((g.varlen is None) != (g.mask is None) for g in layout.groups)
        kinds.append(["varlen" if g.varlen is not None else "masked" for g in layout.groups])
    return kinds


def _assert_same_kv(got: SlotKVCache, want: SlotKVCache) -> None:
    assert got.lengths == want.lengths
    for layer in range(got.num_layers):
        for slot in range(got.num_slots):
            for mine, theirs in zip(got.committed_kv(layer, slot), want.committed_kv(layer, slot)):
                assert torch.allclose(mine, theirs, atol=1e-9)


def _packed_against_padded(model, caches, prompts, steps, layouts) -> None:
    """Run ``steps`` (tokens, parents, solo rows) on both caches after a slot per prompt: every
    real query's logits (solo rows' apart) and every committed KV equal the padded reference's
    (float64, 1e-9)."""
    for cache in caches.values():
        for _ in prompts:
            cache.add_slot()
    for tokens, parents, solo in steps:
        out = {mode: _step(model, cache, tokens, parents, mode == "packed", solo if mode == "packed" else (), layouts)
               for mode, cache in caches.items()}
        padded_rows = [r for r, t in enumerate(tokens) if t]
        for i, row in enumerate(r for r in padded_rows if r not in solo):
            n = len(tokens[row])
            assert torch.allclose(out["packed"][i, :n], out["padded"][padded_rows.index(row), :n], atol=1e-9, rtol=0)
        for cache in caches.values():
            for slot, t in enumerate(tokens):
                cache.commit(slot, cache.lengths[slot], list(range(len(t))))
        _assert_same_kv(caches["packed"], caches["padded"])


@pytest.mark.parametrize("overhead", [0.0, 30.0], ids=["every-split", "some-splits"])
def test_split_attention_groups_equal_padded_forwards(overhead):
    """The shared rows split into several masked groups (packing.split_rows, its overhead low
    enough to split a long chain, a tree and single tokens apart; an idle slot and a solo prompt
    chunk between them): every real query's logits and every committed KV equal the padded
    reference's (float64, 1e-9), and the layouts did split."""
    from goodspeed.lm.runtime.attention import use_gqa_attention
    from modelkit import tiny_llama

    model = tiny_llama(7)
    use_gqa_attention(model)
    caches = {mode: SlotKVCache(num_layers=2, initial_capacity=8) for mode in ("padded", "packed")}
    caches["packed"].group_overhead, layouts = overhead, []
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [4], [3, 3, 3, 3], [5], [6, 6]]
    steps = [
        (prompts, [None] * 6, ()),
        ([[10], [11, 12, 13, 14, 15, 16], [], [17], [18, 19, 20, 21], [22]], [None, None, None, None, [-1, 0, 0, 1], None], ()),
        ([[23], list(range(30, 42)), [24, 25, 26, 27, 28], [29], [30], [31]], [None] * 6, (1,)),
    ]
    _packed_against_padded(model, caches, prompts, steps, layouts)
    masked = [len([g for g in layout.groups if g.own is None and g.rows.stop - g.rows.start >= 1]) for layout in layouts]
    assert max(masked[1:]) >= 3, masked  # the mixed steps ran as several groups


@pytest.mark.parametrize("varlen", VARLEN, ids=VARLEN_IDS)
def test_solo_rows_attend_alone_and_leave_the_others_logits_and_kv_unchanged(varlen):
    """A prompt chunk packed as a solo row (its own attention group, first in the packed order)
    next to a chain, a tree and an idle slot: the others' logits and every row's KV equal the
    padded reference's (float64, 1e-9), and the chunk's own KV too."""
    from goodspeed.lm.runtime.attention import use_gqa_attention
    from modelkit import tiny_llama

    model = tiny_llama(7)
    use_gqa_attention(model)
    caches = {mode: SlotKVCache(num_layers=2, initial_capacity=8) for mode in ("padded", "packed")}
    caches["packed"].varlen, layouts = varlen, []
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [], [3, 3, 3, 3], [5]]
    chunk = list(range(10, 31))  # slot 2's prompt chunk: 21 tokens, far longer than the others' rows
    steps = [
        (prompts, [None] * 5, ()),
        ([[10, 11, 12], [13, 14, 15, 16, 17], chunk, [], [18]], [None, [-1, 0, 0, 1, 2], None, None, None], (2,)),
        ([[19], [20, 21], list(range(31, 36)), [22], [23, 24]], [None] * 5, (2,)),  # the chunk's second part
        ([[25, 26]] * 5, [None] * 5, (0, 4)),  # two solo rows, no padding in the shared group
    ]
    _packed_against_padded(model, caches, prompts, steps, layouts)


@pytest.mark.parametrize("varlen", VARLEN, ids=VARLEN_IDS)
def test_a_slot_far_longer_than_the_others_keeps_its_kv_in_buffers_of_its_own(varlen):
    """Per-slot KV sizing: a slot that alone outgrows the pool moves to buffers of its own (grown
    with it, copying only it) while the pool keeps its capacity; the pool doubles once most of its
    slots need more, and takes back an own slot it now fits. Through chains, a tree on an own slot
    with its accepted path moved, a chunk, and freeing an own slot, the packed cache's logits and
    KV equal the padded reference's (which holds every slot at the longest one's capacity), and it
    reserves less."""
    from goodspeed.lm.runtime.attention import use_gqa_attention
    from modelkit import tiny_llama

    model = tiny_llama(3)
    use_gqa_attention(model)
    caches = {mode: SlotKVCache(num_layers=2, initial_capacity=8) for mode in ("padded", "packed")}
    caches["packed"].varlen, layouts = varlen, []
    packed = caches["packed"]
    for cache in caches.values():
        for _ in range(4):
            cache.add_slot()

    def step(tokens, parents=None, kept=None):
        parents = parents or [None] * len(tokens)
        out = {mode: _step(model, cache, tokens, parents, mode == "packed", layouts=layouts) for mode, cache in caches.items()}
        for r, row in enumerate(r for r, t in enumerate(tokens) if t):
            n = len(tokens[row])
            assert torch.allclose(out["packed"][r, :n], out["padded"][r, :n], atol=1e-9, rtol=0)
        for cache in caches.values():
            for slot, t in enumerate(tokens):
                cache.commit(slot, cache.lengths[slot], (kept or {}).get(slot, list(range(len(t)))))
        _assert_same_kv(packed, caches["padded"])

    step([list(range(1, 31)), [2, 3], [4], [5, 6, 7]])  # slot 0: 30 tokens, the others 1-3
    assert packed.capacity == 8 and packed.own_slots == {0: 32}
    # A tree on the own slot (tokens 0, 2, 4 accepted: moved onto consecutive positions) and chains.
    step([[8, 9, 10, 11, 12], [13], [14, 15], []], [[-1, 0, 0, 1, 2], None, None, None], kept={0: [0, 2, 4]})
    assert packed.lengths == [33, 3, 3, 3] and packed.own_slots == {0: 64}  # grown with its slot alone
    step([[16], list(range(17, 27)), [27], [28]])  # slot 1 outgrows the pool alone: buffers of its own
    assert packed.capacity == 8 and packed.own_slots == {0: 64, 1: 16}
    step([[29], [30], [31] * 6, [32] * 6])  # slots 2 and 3 (the pool's majority) need 10: it doubles
    assert packed.capacity == 16 and packed.own_slots == {0: 64}  # ... and takes slot 1 (14) back
    assert packed.reserved_positions < caches["padded"].reserved_positions
    for cache in caches.values():
        cache.free_slot(0)  # the own slot leaves: slot 3 moves into its place
    _assert_same_kv(packed, caches["padded"])
    assert packed.own_slots == {}
    step([[33, 34], [35], [36, 37, 38]])
    step([list(range(40)), [1], [2]])
    assert packed.own_slots == {0: 64}
    with pytest.raises(RuntimeError, match="own"):  # padded forwards keep every slot in the pool
        packed.prepare(1, slice(0, 3))
    paths = _paths(layouts)
    if varlen is None:
        assert all(kind == "masked" for kinds in paths for kind in kinds)
    else:  # masked only for the tree on the own slot
        assert paths[1] == ["masked", "varlen"] and sum(kinds.count("masked") for kinds in paths) == 1


def _count_ops(fn) -> dict[str, int]:
    """aten ops ``fn`` dispatches that do work, by name (views aside: each of the others is a kernel
    launch or a copy on a GPU)."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    with Counting() as counting:
        fn()
    return dict(counting.ops)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                               reason="needs CUDA"))])
def test_commit_many_equals_row_by_row_commits_in_one_move_per_buffer(device):
    """Committing every row of a step at once leaves the same KV and lengths as committing them one
    by one (tree paths moved onto consecutive positions, chains kept as they are, a slot with
    buffers of its own among them), and the pool's moves cost the same ops for one moving row as
    for three: one gather and one scatter per layer's keys and values."""
    layers, slots = 3, 5
    gen = torch.Generator().manual_seed(0)
    caches = [SlotKVCache(num_layers=layers, initial_capacity=16) for _ in range(3)]
    with torch.inference_mode():
        pool = [torch.randn(slots, 2, 16, 4, generator=gen).to(device) for _ in range(2 * layers)]
        own = [torch.randn(1, 2, 32, 4, generator=gen).to(device) for _ in range(2 * layers)]
    from goodspeed.lm.runtime.kv_slots import _OwnBuffer

    for cache in caches:
        for _ in range(slots):
            cache.add_slot()
        cache.keys, cache.values = [b.clone() for b in pool[:layers]], [b.clone() for b in pool[layers:]]
        cache._own[4] = _OwnBuffer(32, [b.clone() for b in own[:layers]], [b.clone() for b in own[layers:]])
        cache.lengths[:] = [3, 5, 2, 4, 20]
    commits = [(0, 3, [0, 2]), (1, 5, [0, 1, 2]), (2, 2, [0, 3, 5]), (3, 4, [0, 1, 4]), (4, 20, [0, 2, 3])]
    caches[0].commit_many(commits)
    for commit in commits:
        caches[1].commit(*commit)
    assert caches[0].lengths == caches[1].lengths == [5, 8, 5, 7, 23]
    for layer in range(layers):
        for slot in range(slots):
            for mine, theirs in zip(caches[0].committed_kv(layer, slot), caches[1].committed_kv(layer, slot)):
                assert torch.equal(mine, theirs)
    assert torch.equal(caches[0].committed_kv(0, 2)[0][:, 3], pool[0][2, :, 5])  # node 3 of slot 2's step, moved
    one = _count_ops(lambda: caches[2].commit_many([(0, 3, [0, 2])]))
    three = _count_ops(lambda: caches[2].commit_many([(1, 5, [0, 2]), (2, 2, [0, 3, 5]), (3, 4, [0, 1, 4])]))
    assert one == three and one["index_put_"] == 2 * layers


def test_tree_masks_and_positions_follow_each_node_s_ancestors():
    """build_attention against a per-node reference: a tree node sees the committed prefix, itself
    and its ancestors, at position length + depth - 1; chain rows are causal; keys may stop short
    of a row's padding (a packed group's kv_len)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        rows, q_len = 4, 6
        lengths = torch.randint(0, 5, (rows,), generator=gen).tolist()
        parents = []
        for _ in range(rows):
            if torch.rand(1, generator=gen) < 0.3:
                parents.append(None)
                continue
            n = int(torch.randint(1, q_len + 1, (1,), generator=gen))
            parents.append([int(torch.randint(-1, j, (1,), generator=gen)) for j in range(n)])
        kv_len = max(lengths) + q_len - int(torch.randint(0, 2, (1,), generator=gen))
        mask, positions = build_attention(lengths, parents, q_len, kv_len, torch.float32)
        allowed = mask[:, 0] == 0
        for r, (length, tree) in enumerate(zip(lengths, parents)):
            for j in range(q_len):
                if tree is None or j >= len(tree):  # causal (padding of a tree row sees only itself)
                    seen = set(range(length + j + 1)) if tree is None else set(range(length)) | {length + j}
                    depth = j + 1 if tree is None else 1
                else:
                    chain, node = [j], tree[j]
                    while node >= 0:
                        chain.append(node)
                        node = tree[node]
                    seen, depth = set(range(length)) | {length + a for a in chain}, len(chain)
                assert set(allowed[r, j].nonzero().view(-1).tolist()) == {k for k in seen if k < kv_len}
                assert int(positions[r, j]) == length + depth - 1
