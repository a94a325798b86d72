"""Steps of fixed shapes, as CUDA graphs replay them (goodspeed.lm.runtime.graphs): on CPU, everything but
the capture (the layout, the static copies, the forward a graph records), and that the forward
reads nothing a replay would hold stale; on CUDA, the capture and the replays."""

import numpy as np
import pytest
import torch

from goodspeed.lm.runtime.attention import PACKED, with_cache
from goodspeed.lm.runtime.batch_draft import BatchDraftModel
from goodspeed.lm.runtime.graphs import StepGraphs, bucket, cpp_compiler_missing, decoder_and_head
from goodspeed.lm.runtime.kv_slots import SlotKVCache
from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from goodspeed.verifier.types import Draft
from goodspeed.verifier.warm_up import WARM_UP_PLAN
from graphkit import ReadsOnly, checking, fresh_dynamo, needs_cpp, static_inputs  # noqa: F401 (a fixture)
from modelkit import tiny_llama


def test_bucket_rounds_up_to_powers_of_two():
    assert [bucket(n) for n in (0, 1, 2, 3, 4, 5, 16, 17)] == [1, 1, 2, 4, 4, 8, 16, 32]


def engine_pair(target, captures=(None, False), **config):
    """The same engine twice, each recording its logits: per engine, steps eager (None) or through
    StepGraphs, capturing (True) or not (False)."""
    engines, logits = [], ([], [])
    for i, capture in enumerate(captures):
        engine = VerificationEngine(target, EngineConfig(budget=64, max_draft_len=8, seed=0, **config))
        if capture is not None:
            engine.runner.graphs = StepGraphs(engine.model, engine.cache, capture=capture)
        forward = engine.runner.forward

        def recorded(*a, _f=forward, _out=logits[i], **k):
            rows, chunks = _f(*a, **k)
            _out.append(rows)  # the verification rows' logits (None for a prefill)
            return rows, chunks

        engine.runner.forward = recorded
        engines.append(engine)
    return engines, logits


def drive(engines, rng, rounds, sessions=5, vocab=48, leave_at=None, prompt_len=20):
    """Random greedy drafts, chains and trees, some drafters idle, into every engine alike; the
    verdicts of each round must be the same in each."""
    ids = [[e.join(f"d{i}") for i in range(sessions)] for e in engines]
    for i in range(sessions):
        prompt = rng.integers(0, vocab, int(rng.integers(1, prompt_len))).tolist()
        for e, sids in zip(engines, ids):
            e.start_request(sids[i], prompt, SamplingParams(), 300)
    for round_index in range(rounds):
        if round_index == leave_at:  # a slot is freed: the last one moves into its hole
            for e, sids in zip(engines, ids):
                e.leave(sids.pop(0))
        drafts = {}
        for i in range(len(ids[0])):
            if rng.random() < 0.3 or engines[0].prefilling(ids[0][i]):
                continue
            n = int(rng.integers(0, 8))
            tokens = rng.integers(0, vocab, n).tolist()
            tree = n > 1 and rng.random() < 0.5
            parents = [int(rng.integers(-1, k)) for k in range(n)] if tree else None
            drafts[i] = (tokens, parents)
        verdicts = []
        for e, sids in zip(engines, ids):
            for i, (tokens, parents) in drafts.items():
                e.set_allotment(sids[i], 8)
                e.submit(sids[i], Draft(e.next_round(sids[i]), tokens, parents=parents))
            if not drafts and e.has_prefill:
                e.prefill_step()
            result = e.run_round() if drafts else None
            verdicts.append(None if result is None else sorted((k.split("#")[0], v.token_ids) for k, v in result.verdicts.items()))
        assert all(v == verdicts[0] for v in verdicts), round_index


def test_static_steps_give_the_packed_forwards_logits():
    """Chains, trees and idle rows in steps of several shapes, a slot freed mid-run: the static
    layout's logits equal the packed forward's (float64: keys past a row's end add exact zeros)."""
    target = tiny_llama(3)
    (eager, graphed), (expected, got) = engine_pair(target)
    drive([eager, graphed], np.random.default_rng(0), rounds=14, leave_at=7)
    steps = [x for x in got if x is not None]  # the verification steps (whole-prompt prefills have no logits)
    assert graphed.graphs.steps == len(steps) >= 10  # every one took the static path
    assert len({q for _, q, _ in graphed.graphs.shapes}) >= 2
    for a, b in zip(expected, got):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(b, a, rtol=0, atol=1e-10)


def test_a_pool_that_moves_drops_every_shape():
    """The pool grows under the slots: the shapes made over the old buffers are dropped, the ones
    left were all made over the buffers of now, and the steps agree throughout."""
    target = tiny_llama(4)
    (eager, graphed), (expected, got) = engine_pair(target)
    for engine in (eager, graphed):
        engine.use_cache(SlotKVCache(engine.cache.num_layers, initial_capacity=16))
    graphs = graphed.graphs
    graphs.cache = graphed.cache
    made, static = [], graphs._static
    graphs._static = lambda ids, positions, mask, layout: made.append((mask.shape[3], graphed.cache.generation)) or static(
        ids, positions, mask, layout)
    drive([eager, graphed], np.random.default_rng(1), rounds=30, sessions=3, prompt_len=6)  # every slot outgrows 16 positions
    assert graphed.cache.capacity > 16 and made[0][1] < graphed.cache.generation  # shapes were made over old buffers
    now = [k for k, generation in made if generation == graphed.cache.generation]
    assert sorted(k for _, _, k in graphs.shapes) == sorted(now) and all(k <= graphed.cache.capacity for k in now)
    for a, b in zip(expected, got):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(b, a, rtol=0, atol=1e-10)


def kv_pair(device: str):
    """Two pools of the same random KV (3 layers, 6 slots): one to move eagerly, one through
    StepGraphs.move."""
    layers, slots = 3, 6
    gen = torch.Generator().manual_seed(0)
    pool = [torch.randn(slots, 2, 32, 4, generator=gen).to(device) for _ in range(2 * layers)]
    caches = []
    for _ in range(2):
        cache = SlotKVCache(num_layers=layers, initial_capacity=32)
        for _ in range(slots):
            cache.add_slot()
        cache.keys, cache.values = [b.clone() for b in pool[:layers]], [b.clone() for b in pool[layers:]]
        cache.lengths[:] = [3, 5, 2, 4, 6, 1]
        caches.append(cache)
    return caches


def assert_same_pool(a: SlotKVCache, b: SlotKVCache) -> None:
    for mine, theirs in zip((*a.keys, *a.values), (*b.keys, *b.values)):
        assert torch.equal(mine, theirs)


def test_kv_moves_padded_to_a_graph_size_move_what_unpadded_ones_do():
    """A step's KV moves through StepGraphs.move, padded to 8 or 16 by repeating the last (on CPU
    run eagerly over the static indices): the pool ends as the eager moves leave it, step after
    step, one static index tensor per size; the pool reallocated drops them."""
    eager, graphed = kv_pair("cpu")
    graphs = StepGraphs(tiny_llama(3), graphed, capture=False)
    steps = [
        [(0, 3, [0, 2]), (2, 2, [0, 3, 5])],  # 3 moves -> 8
        [(1, 5, [0, 2, 4]), (3, 4, [0, 1, 4]), (4, 6, [0, 2, 3, 7])],  # 5 moves -> 8, a new list in the same indices
        [(0, 5, [0, 3, 4, 6]), (1, 7, [0, 2]), (2, 5, [0, 4, 5, 6]), (3, 7, [1, 2, 3, 4]), (5, 1, [0, 3, 5])],  # 15 -> 16
        [(4, 9, [0])],  # no move: nothing to run
    ]
    for commits in steps:
        eager.commit_many(commits)
        graphed.commit_many(commits, mover=graphs.move)
        assert eager.lengths == graphed.lengths
        assert_same_pool(eager, graphed)
    assert sorted(graphs._moves) == [8, 16]
    graphed._resize_pool(12)
    graphs.move([(0, 1, 2)])
    assert sorted(graphs._moves) == [8]


def compiled_pair(seed: int):
    """An eager engine and one whose fixed-shape steps run through a compiled decoder, each
    recording its logits."""
    (eager, compiled), logits = engine_pair(tiny_llama(seed), captures=(None, None))
    compiled.runner.graphs = StepGraphs(compiled.model, compiled.cache, capture=False, torch_compile=True)
    return (eager, compiled), logits


def assert_float32_close(expected, got):
    """The compiled logits against eager ones. The tolerance is float32's, not float64's:
    transformers' Llama computes its RMSNorm and rotary tables in float32 whatever the model's
    dtype, and inductor fuses those ops in another order than eager kernels do."""
    assert len(expected) == len(got)
    for a, b in zip(expected, got):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_torch_compile_without_a_cpp_compiler_is_refused_on_a_cpu(monkeypatch):
    from torch._inductor import cpp_builder

    def missing():
        raise RuntimeError("No working C++ compiler found")

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", missing)
    assert cpp_compiler_missing() == "No working C++ compiler found"
    with pytest.raises(ValueError, match="torch_compile on a CPU needs a C\\+\\+ compiler.*apt-get install g\\+\\+"):
        VerificationEngine(tiny_llama(0), EngineConfig(torch_compile=True))


def test_warm_up_steps_leave_nothing_but_their_shapes():
    """VerificationEngine.warm_up_steps with fixed-shape steps: the plan's steps run through
    StepGraphs, their sessions leave with their KV, and the engine then serves
    as an engine that never warmed up (the same logits and verdicts); the drafters' limits do not
    bind it (a budget of 1, one drafter, drafts of at most 2); without fixed shapes, or without
    room under max_seq_len, it does nothing."""
    target = tiny_llama(13)
    assert VerificationEngine(target, EngineConfig()).warm_up_steps() == 0
    for config, steps in ((EngineConfig(budget=1, max_drafters=1, max_draft_len=2), len(WARM_UP_PLAN)),
                          (EngineConfig(max_seq_len=16), 0)):
        small = VerificationEngine(target, config)
        small.runner.graphs = StepGraphs(small.model, small.cache, capture=False)
        assert small.warm_up_steps() == steps and small.session_ids == []
    (eager, graphed), (expected, got) = engine_pair(target)
    assert graphed.warm_up_steps() == len(WARM_UP_PLAN)
    assert graphed.graphs.steps == len(WARM_UP_PLAN)  # (the pool grew: earlier shapes dropped)
    assert graphed.session_ids == [] and graphed.cache.lengths == [] and not graphed.has_prefill
    del got[:]
    drive([eager, graphed], np.random.default_rng(7), rounds=6, sessions=3)
    for a, b in zip(expected, got, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-10)


@needs_cpp
@pytest.mark.slow  # compiles the warm-up's graphs (about 40 s cold here)
def test_after_the_warm_up_compiled_steps_compile_nothing_more(fresh_dynamo):
    """With torch_compile, the warm-up steps meet every case dynamo's guards distinguish in the
    rounds a server then runs: rows, queries, keys and pool slots of other sizes, trees, a freed
    slot; no graph is compiled after it."""
    from torch._dynamo.utils import counters

    (eager, compiled), (expected, got) = compiled_pair(14)
    compiled.warm_up_steps()
    before = counters["stats"]["unique_graphs"]
    del got[:]
    drive([eager, compiled], np.random.default_rng(8), rounds=24, sessions=6, prompt_len=30, leave_at=12)
    assert counters["stats"]["unique_graphs"] == before
    assert_float32_close(expected, got)


@pytest.mark.slow  # compiles a graph (about 30 s cold here); the static steps' test above runs by default
@needs_cpp
def test_a_compiled_step_gives_the_packed_forwards_logits(fresh_dynamo):
    """EngineConfig.torch_compile: a step of a chain and a tree at fixed shapes through a decoder
    compiled by torch.compile gives the packed forward's logits and the same verdicts, compiled in
    one graph (no break)."""
    from torch._dynamo.utils import counters

    (eager, compiled), (expected, got) = compiled_pair(11)
    before, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    verdicts = []
    for engine in (eager, compiled):
        sids = [engine.join(f"d{i}") for i in range(2)]
        for i, sid in enumerate(sids):
            engine.start_request(sid, [1 + i, 2, 3, 4, 5], SamplingParams(), 20)
        for sid, (tokens, parents) in zip(sids, (([7, 8, 9], None), ([7, 8, 9], [-1, -1, 0]))):
            engine.set_allotment(sid, 8)
            engine.submit(sid, Draft(engine.next_round(sid), tokens, parents=parents))
        result = engine.run_round()
        verdicts.append(sorted((k.split("#")[0], v.token_ids) for k, v in result.verdicts.items()))
    assert verdicts[0] == verdicts[1] and compiled.graphs.steps == 1
    assert counters["stats"]["unique_graphs"] - before == 1 and sum(counters["graph_break"].values()) == breaks
    assert_float32_close(expected, got)


@needs_cpp
@pytest.mark.slow  # compiles several graphs (about 40 s cold here)
def test_compiled_steps_over_many_shapes_take_few_graphs(fresh_dynamo):
    """Rounds of chains, trees and idle rows over a freed slot: the compiled steps give the
    packed forward's logits and verdicts, and the shapes take fewer graphs than there are shapes
    (dynamo recompiles a dimension seen at a second size as symbolic)."""
    from torch._dynamo.utils import counters

    (eager, compiled), (expected, got) = compiled_pair(12)
    before = counters["stats"]["unique_graphs"]
    drive([eager, compiled], np.random.default_rng(6), rounds=16, sessions=4, prompt_len=8, leave_at=8)
    graphs = counters["stats"]["unique_graphs"] - before
    assert 1 <= graphs < len(compiled.graphs.shapes), (graphs, compiled.graphs.shapes)
    assert_float32_close(expected, got)


def test_steps_that_fit_no_shape_run_eagerly():
    """Prompt chunks and steps over MAX_GRAPH_TOKENS take the packed path, and agree."""
    target = tiny_llama(5)
    (eager, graphed), (expected, got) = engine_pair(target, prefill_chunk=8)
    graphed.graphs.max_tokens = 32  # 4 rows of up to 8 tokens
    drive([eager, graphed], np.random.default_rng(2), rounds=30, sessions=6)
    assert 0 < graphed.graphs.steps < len(got)  # some steps fit a shape, some did not
    for a, b in zip(expected, got):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-10)


def test_a_steps_forward_reads_only_what_a_replay_refreshes():
    """The forward a graph records syncs nothing with the host and reads only the weights, the KV
    pool, the shape's static inputs and its own results; the negative control, the same forward
    with the first layer's folded mask left from the step before, is caught."""
    target = tiny_llama(6)
    (_, graphed), _ = engine_pair(target)
    rng = np.random.default_rng(3)
    drive([graphed], rng, rounds=4)  # shapes made, the pool allocated
    graphs = graphed.graphs
    seen = []
    checking(graphed, seen)
    drive([graphed], rng, rounds=6)
    assert seen and all(p == [] for p in seen), seen
    # Negative control: keep the fold the last forward made (a replay would read that step's mask).
    shape = next(iter(graphs._shapes.values()))
    layout = shape.layout
    graphed.cache.use_writes(shape.write_rows, shape.write_pos)
    with ReadsOnly(static_inputs(graphed, shape)) as mode, torch.inference_mode():
        graphs.decoder(input_ids=layout.input_ids, attention_mask=layout.mask, position_ids=layout.position_ids,
                       **with_cache(graphs.decoder, graphed.cache), use_cache=True, **{PACKED: layout})
    assert layout.groups[0].folds and any("made before the forward" in p for p in mode.problems)


def draft_rounds(drafters, rounds=6, seed=0, rel=1e-9):
    """Chains (greedy and sampled) and beam trees from each batch draft model alike, with verdicts
    applied between rounds and a request leaving midway; every drafter must draft the same."""
    rng = np.random.default_rng(seed)
    committed = {"a": list(range(1, 9)), "b": [7, 8], "c": [9, 10, 11], "d": [4]}
    for d in drafters:
        for key in committed:
            d.add(key)
    for round_index in range(rounds):
        if round_index == rounds // 2:  # slots move: the last one into the hole
            del committed["b"]
            for d in drafters:
                d.remove("b")
        params = {k: SamplingParams() if (i + round_index) % 2 else SamplingParams(temperature=1.3)
                  for i, k in enumerate(committed)}
        lengths = {k: int(rng.integers(0, 5)) for k in committed}
        chains = [d.draft_chains(committed, lengths, params, torch.Generator().manual_seed(round_index)) for d in drafters]
        trees = [d.draft_trees(committed, depth=3, width=2, sampling=params) for d in drafters]
        for key in committed:
            for chain, tree in zip(chains[1:], trees[1:]):
                assert chain[key].token_ids == chains[0][key].token_ids, (round_index, key)
                assert chain[key].token_probs == pytest.approx(chains[0][key].token_probs, rel=rel, abs=1e-12)
                assert (tree[key].token_ids, tree[key].parents) == (trees[0][key].token_ids, trees[0][key].parents)
                assert tree[key].path_probs == pytest.approx(trees[0][key].path_probs, rel=rel, abs=1e-12)
        for key in committed:  # a verdict: a prefix of the chain accepted, then a correction
            accepted = int(rng.integers(0, lengths[key] + 1))
            before = len(committed[key])
            committed[key] = committed[key] + chains[0][key].token_ids[:accepted] + [int(rng.integers(0, 48))]
            for d in drafters:
                d.rollback(key, before, accepted)


def test_draft_forwards_at_fixed_shapes_draft_what_eager_ones_do():
    """The local draft model's forwards through StepGraphs (catch-up, chain steps, beam levels with
    scratch entries) draft the same chains, q and trees as eager forwards, and read nothing a
    replay would hold stale."""
    model = tiny_llama(8)
    eager, graphed = BatchDraftModel(model), BatchDraftModel(model)
    graphed.graphs = StepGraphs(graphed.model, graphed.cache, capture=False)
    seen = []
    checking(graphed, seen)
    draft_rounds([eager, graphed])
    assert graphed.forwards == eager.forwards and graphed.graphs.steps >= graphed.forwards - 1  # the first made the pool
    assert len(graphed.graphs.shapes) >= 3 and seen and all(p == [] for p in seen), seen


def test_a_draft_models_warm_up_leaves_nothing_but_its_shapes():
    """BatchDraftModel.warm_up with fixed-shape forwards: the plan's synthetic requests draft
    chains and trees through StepGraphs and leave with their KV, and the model then drafts what a
    model that never warmed up does; without fixed shapes, or with nothing to draft, it does
    nothing, and a tree of no depth is refused."""
    model = tiny_llama(9)
    assert BatchDraftModel(model).warm_up(chains=3, tree=(3, 3)) == 0
    eager, graphed = BatchDraftModel(model), BatchDraftModel(model)
    graphed.graphs = StepGraphs(graphed.model, graphed.cache, capture=False)
    assert graphed.warm_up() == 0 and graphed.graphs.steps == 0
    with pytest.raises(ValueError, match="depth and width must be >= 1"):
        graphed.warm_up(tree=(0, 2))
    plan = BatchDraftModel.WARM_UP_PLAN
    assert graphed.warm_up(chains=2) == sum(what == "chain" for _, what in plan)
    assert graphed.warm_up(chains=3, tree=(3, 3)) == len(plan)
    assert max(w for w, _, _ in graphed.graphs.shapes) == 8 and {q for _, q, _ in graphed.graphs.shapes} >= {1, 2, 4, 32}
    assert graphed.slots.keys == [] and graphed.cache.lengths == []
    draft_rounds([eager, graphed])


def test_a_shape_whose_first_forward_fails_is_not_kept_to_run_later():
    """A failed warm-up or capture raises, naming the shape and the way out, and leaves no shape
    behind that a later step would run eagerly unannounced."""
    (_, graphed), _ = engine_pair(tiny_llama(9))
    rng = np.random.default_rng(5)
    drive([graphed], rng, rounds=2)  # the pool made, and shapes
    graphs = graphed.graphs
    graphs._shapes.clear()  # every next step's shape is new

    def failing(shape):
        raise RuntimeError("operation not permitted when stream is capturing")
    graphs._first = failing
    with pytest.raises(RuntimeError, match=r"CUDA graph of shape \(\d+, \d+, \d+\) \(rows, queries, keys\) failed: "
                                           r"operation not permitted .*; run without cuda_graphs"):
        drive([graphed], rng, rounds=1, sessions=2)
    assert graphs.shapes == []


def test_a_model_whose_logits_are_not_its_heads_output_is_refused():
    """Graphs replay the decoder and run the LM head after it: a model without that split, or
    one that transforms its logits after the head, is refused by name."""
    model = tiny_llama(0)
    assert decoder_and_head(model) == (model.model, model.lm_head)
    with pytest.raises(ValueError, match="LlamaModel has no .model"):
        decoder_and_head(model.model)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match=r"LlamaForCausalLM transforms its logits after the head \(final_logit_softcapping\)"):
        StepGraphs(model, SlotKVCache(2), capture=False)


def test_cuda_graphs_are_refused_off_cuda_and_without_packed_forwards():
    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device; this target is on cpu"):
        VerificationEngine(tiny_llama(0), EngineConfig(cuda_graphs=True))
    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device; this draft model is on cpu"):
        BatchDraftModel(tiny_llama(0), cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs needs packed forwards"):
        EngineConfig(cuda_graphs=True, packed=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_replayed_steps_equal_eager_ones(dtype):
    """On CUDA: each shape captured once and replayed after; the replays' logits equal the same
    static steps run eagerly (the same kernels on the same values), over chains, trees, idle rows
    and a freed slot, and in fp32 the packed forward's too."""
    target = tiny_llama(7, hidden=256, heads=4, kv_heads=2, dtype=dtype).cuda()
    (eager, graphed), (expected, got) = engine_pair(target, captures=(False, True))
    drive([eager, graphed], np.random.default_rng(4), rounds=24, leave_at=12)
    graphs = graphed.graphs
    assert graphs.captures >= len(graphs.shapes) >= 1 and graphs.replays >= 10
    for a, b in zip(expected, got):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-4 if dtype == torch.float32 else 2e-2)
    if dtype == torch.float32:
        (packed, graphed), (expected, got) = engine_pair(target, captures=(None, True))
        drive([packed, graphed], np.random.default_rng(5), rounds=12)
        for a, b in zip(expected, got):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_compiled_steps_captured_equal_eager_ones():
    """On CUDA: steps through the compiled decoder (EngineConfig.torch_compile), captured as CUDA
    graphs, give the eager static steps' logits to fp32's rounding and the same verdicts."""
    target = tiny_llama(7, hidden=256, heads=4, kv_heads=2, dtype=torch.float32).cuda()
    (eager, compiled), (expected, got) = engine_pair(target, captures=(False, True))
    compiled.runner.graphs = StepGraphs(compiled.model, compiled.cache, torch_compile=True)
    drive([eager, compiled], np.random.default_rng(4), rounds=12, leave_at=6)
    assert compiled.graphs.captures >= len(compiled.graphs.shapes) >= 1 and compiled.graphs.replays >= 5
    for a, b in zip(expected, got):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_replayed_kv_moves_move_what_eager_ones_do():
    """On CUDA: a step's KV moves captured once per size and replayed over new indices leave the
    pool as the eager moves do."""
    eager, graphed = kv_pair("cuda")
    graphs = StepGraphs(tiny_llama(3).cuda(), graphed)
    for commits in ([(0, 3, [0, 2]), (2, 2, [0, 3, 5])], [(1, 5, [0, 2, 4]), (3, 4, [0, 1, 4])],
                    [(4, 6, [0, 2, 3, 7]), (0, 5, [1, 2])], [(5, 1, [0, 3, 5]), (2, 5, [0, 4, 5, 6])]):
        eager.commit_many(commits)
        graphed.commit_many(commits, mover=graphs.move)
        torch.cuda.synchronize()
        assert_same_pool(eager, graphed)
    assert graphs.captures == 1 and graphs.replays == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_replayed_draft_forwards_draft_what_eager_ones_do():
    """On CUDA: the draft model's forwards captured and replayed draft the same as the same
    fixed-shape forwards run eagerly."""
    model = tiny_llama(8, hidden=256, heads=4, kv_heads=2, dtype=torch.float32).cuda()
    eager, graphed = BatchDraftModel(model), BatchDraftModel(model, cuda_graphs=True)
    eager.graphs = StepGraphs(eager.model, eager.cache, capture=False)
    draft_rounds([eager, graphed], rel=1e-5)  # fp32; a capture may pick other cuBLAS kernels than eager runs
    assert graphed.graphs.captures >= 3 and graphed.graphs.replays >= 10
