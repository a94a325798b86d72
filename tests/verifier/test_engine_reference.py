"""The batched, cached engine gives the same verdicts as a slow per-drafter reference that
recomputes everything from scratch, for the same uniforms — so batching and KV rollback are exact."""

import numpy as np
import pytest
import torch

from goodspeed.drafter.runner import DraftRunner
from goodspeed.launch.cluster.inprocess import to_engine_draft
from goodspeed.lm.runtime.attention import REFERENCE_VARLEN
from goodspeed.lm.runtime.graphs import StepGraphs
from goodspeed.lm.runtime.kv_slots import SlotKVCache
from goodspeed.lm.runtime.prefix import prefix_hash
from goodspeed.lm.decoding.sampling import process_logits
from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from goodspeed.verifier.types import Draft
from modelkit import perturbed, tiny_llama


def reference_verdict(target, committed, drafted, q, sampling, u):
    """Textbook speculative sampling for one drafter: full forward, then a plain loop."""
    with torch.inference_mode():
        logits = target(input_ids=torch.tensor([committed + drafted])).logits[0]
    p = process_logits(logits[len(committed) - 1 :].double(), sampling)  # [S + 1, V]
    for j, tok in enumerate(drafted):
        q_j = q[j] if q is not None else torch.nn.functional.one_hot(torch.tensor(tok), p.shape[-1]).double()
        if not u[j] < min(1.0, float(p[j, tok] / q_j[tok])):
            residual = torch.clamp(p[j] - q_j, min=0)
            return j, inverse_cdf(residual, u[len(drafted)])
    return len(drafted), inverse_cdf(p[len(drafted)], u[len(drafted)])


def inverse_cdf(weights, u):
    cdf = torch.cumsum(weights, 0)
    return int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype), right=True).clamp(max=len(cdf) - 1))


SAMPLINGS = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=5), SamplingParams(temperature=1.2, top_p=0.7)]


# False: the padded reference path; "varlen": packed, chains through the varlen call (its
# plain-torch reference on CPU; flash's on CUDA), with a pool small enough that slots outgrow it;
# "pad": packed with the rows padded where a step allows it (EngineConfig.pad_rows); "graphs": steps
# of fixed shapes as CUDA graphs replay them (goodspeed.lm.runtime.graphs), run eagerly on CPU.
@pytest.mark.parametrize("seed, packed", [(0, True), (1, True), (2, True), (0, False), (1, "varlen"), (2, "pad"),
                                          (0, "graphs")])
def test_batched_rounds_equal_reference(seed, packed):
    rng = np.random.default_rng(seed)
    target = tiny_llama(10 + seed)
    draft = perturbed(target, 0.2, 99)
    engine = VerificationEngine(target, EngineConfig(budget=40, policy="random", max_draft_len=7, seed=seed, packed=bool(packed),
                                                     pad_rows=packed == "pad"))
    if packed == "varlen":
        engine.use_cache(SlotKVCache(engine.cache.num_layers, initial_capacity=16))
        engine.cache.varlen = REFERENCE_VARLEN
    if packed == "graphs":
        engine.runner.graphs = StepGraphs(engine.model, engine.cache, capture=False)
    sessions = []
    for i in range(5):
        sid = engine.join(f"d{i}")
        prompt = rng.integers(0, 48, int(rng.integers(1, 30))).tolist()
        sampling = SAMPLINGS[i % len(SAMPLINGS)]
        runner = DraftRunner(draft)
        runner.start(prompt)
        engine.start_request(sid, prompt, sampling, max_new_tokens=200)
        sessions.append((sid, runner, sampling, torch.Generator().manual_seed(i)))
    for round_index in range(6):
        expected, uniforms = {}, {}
        for sid, runner, sampling, gen in sessions:
            if rng.random() < 0.25:  # some drafters miss a round: their slot idles in the batch
                continue
            out = runner.draft(int(rng.integers(0, 8)), sampling, gen)
            u = rng.random(len(out.token_ids) + 1)
            q = None if sampling.greedy else out.probs
            expected[sid] = reference_verdict(target, list(runner.committed), out.token_ids, q, sampling, u)
            uniforms[sid] = u
            engine.set_allotment(sid, 7)  # random lengths above; allotments are not under test here
            engine.submit(sid, to_engine_draft(engine.next_round(sid), out, sampling))
        result = engine.run_round(uniforms)
        assert set(result.verdicts) == set(expected)
        for sid, runner, _, _ in sessions:
            if sid not in expected:
                continue
            v = result.verdicts[sid]
            m, token = expected[sid]
            assert (v.num_accepted, v.token_ids[-1]) == (m, token), (round_index, sid)
            runner.apply(v.token_ids, v.num_accepted)
            assert v.committed_length == len(runner.committed)
            assert v.prefix_hash == prefix_hash(runner.committed) == runner.prefix_hash  # incremental = from scratch
    if packed == "graphs":
        assert engine.graphs.steps == 6  # every round took the static path


@pytest.mark.parametrize("pad_rows", [False, True, "graphs"])
def test_tree_round_equals_reference_tree_walk(pad_rows):
    """A tree draft is verified with an ancestor mask in the same forward as a chain; its logits
    must equal separate forwards along each root-to-node path (with the rows padded, too, and in
    the static steps CUDA graphs replay)."""
    target = tiny_llama(20)
    engine = VerificationEngine(target, EngineConfig(budget=40, max_draft_len=8, pad_rows=pad_rows is True))
    if pad_rows == "graphs":
        engine.runner.graphs = StepGraphs(engine.model, engine.cache, capture=False)
    a, b = engine.join("tree"), engine.join("chain")
    engine.start_request(a, [3, 4, 5], SamplingParams(), 50)
    engine.start_request(b, [9] * 11, SamplingParams(), 50)
    for sid in (a, b):
        engine.set_allotment(sid, 8)
    parents = [-1, -1, 0, 0, 2, 1]
    tokens = [7, 8, 9, 10, 11, 12]
    # Greedy target path from [3, 4, 5]: which nodes match it decides the accepted path.
    with torch.inference_mode():
        def argmax_after(seq):
            return int(target(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
        first = argmax_after([3, 4, 5])
    tokens[0] = first  # make node 0 the right first token, so the walk goes below it
    engine.submit(a, Draft(0, tokens, parents=parents))
    engine.submit(b, Draft(0, [1, 2, 3]))
    v = engine.run_round().verdicts[a]
    seq, node_path, node = [3, 4, 5], [], -1
    while True:  # the reference walk: first child matching the target's argmax
        nxt = argmax_after(seq)
        child = next((k for k in range(len(tokens)) if parents[k] == node and tokens[k] == nxt), None)
        if child is None:
            break
        node_path.append(child)
        seq.append(nxt)
        node = child
    assert v.num_accepted == len(node_path) >= 1
    assert v.token_ids == [tokens[k] for k in node_path] + [argmax_after(seq)]
    # The KV now holds the accepted path compacted: the next round must still match the reference.
    engine.submit(a, Draft(engine.next_round(a), []))
    v2 = engine.run_round().verdicts[a]
    assert v2.token_ids == [argmax_after(seq + v.token_ids[-1:])]
    if pad_rows == "graphs":
        assert engine.graphs.steps == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_rounds_through_flash_varlen_equal_masked_ones():
    """GPU: a bf16 target on CUDA, whose engine picks flash's varlen kernel, against the same
    engine with masked SDPA, fed the same drafts (a CPU draft model, greedy and sampled, prompts
    that grow the pool past its first 256 positions) and the same uniforms for 8 rounds: the same
    verdicts. The two kernels round bf16 differently (tests/lm/runtime/test_kv_slots.py bounds the logits'
    difference), which can flip a token where two are within rounding of each other, so the target
    here is peaked (init 1.0: its top token leads by far more than bf16's rounding); a kernel
    reading wrong keys or lengths changes verdicts all the same."""
    from goodspeed.lm.runtime.attention import varlen_kernel_for

    target = tiny_llama(21, hidden=256, heads=4, kv_heads=2, init=1.0, dtype=torch.bfloat16).cuda()
    if varlen_kernel_for(target) is None:
        pytest.skip("this torch's flash varlen op takes no per-sequence key lengths")
    draft = perturbed(tiny_llama(21, hidden=256, heads=4, kv_heads=2, init=1.0), 0.03, 5)
    engines = {path: VerificationEngine(target, EngineConfig(budget=40, policy="fixed", max_draft_len=6, seed=3,
                                                             attention=path)) for path in ("varlen", "masked")}
    assert "flash" in engines["varlen"].attention and engines["masked"].attention == "masked SDPA"
    assert VerificationEngine(target).attention == engines["varlen"].attention  # "auto" takes it on CUDA
    rng = np.random.default_rng(4)
    sessions = []
    for i in range(4):
        prompt = rng.integers(0, 48, 200 + 40 * i).tolist()  # 200-320 tokens: the pool grows past 256
        sampling = SAMPLINGS[i % 2]
        sids = {path: e.join(f"d{i}") for path, e in engines.items()}
        for path, e in engines.items():
            e.start_request(sids[path], prompt, sampling, max_new_tokens=100)
        runner = DraftRunner(draft)
        runner.start(prompt)
        sessions.append((sids, runner, sampling, torch.Generator().manual_seed(i)))
    accepted = []
    for _ in range(8):
        uniforms = {path: {} for path in engines}
        for sids, runner, sampling, gen in sessions:
            out = runner.draft(5, sampling, gen)
            u = rng.random(len(out.token_ids) + 1)
            for path, e in engines.items():
                e.submit(sids[path], to_engine_draft(e.next_round(sids[path]), out, sampling))
                uniforms[path][sids[path]] = u
        results = {path: e.run_round(uniforms[path]) for path, e in engines.items()}
        for sids, runner, _, _ in sessions:
            got, want = (results[p].verdicts[sids[p]] for p in ("varlen", "masked"))
            assert (got.num_accepted, got.token_ids) == (want.num_accepted, want.token_ids)
            runner.apply(got.token_ids, got.num_accepted)
            accepted.append(got.num_accepted)
    assert sum(accepted) >= len(accepted)  # drafts are accepted too (~1 of 5 or more): not only corrections compared
