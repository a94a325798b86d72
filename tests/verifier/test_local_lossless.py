"""Local serving is lossless under sampling for every policy: concurrent sampled requests (so
TETRIS's selection across the batch really happens), the joint distribution of each request's
first two tokens against the target's own (chi-square, p = 1e-5), default seeds.

TETRIS ranking sampled tokens by their own sampled values (``prod q(s_j)``) conditions the sample;
the negative control replays that ranking and must fail the same test at p < 1e-6 (default tier)."""

import numpy as np
import pytest

from goodspeed.lm.runtime.graphs import StepGraphs
from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from goodspeed.verifier.clocks import LatencyProfile, SimulatedClock
from goodspeed.verifier.local import LocalConfig, LocalServing
from goodspeed.verifier.local_policies.tetris import TetrisSelection
from goodspeed.scheduler import LatencyModel
from graphkit import needs_cpp
from modelkit import perturbed, tiny_llama
from statkit import Z_POWER, chi2_critical, chi2_stat, count_first_two, exact_first_two, fits

V = 6
PROMPT = [1, 2, 3]
SAMPLED = SamplingParams(temperature=1.0)
TARGET_COST, DRAFT_COST = LatencyModel(1e-6, 2e-4, 0.010), LatencyModel(1e-7, 2e-5, 0.001)


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(4, vocab=V, init=0.08)
    return target, perturbed(target, 2.0, 5)  # a poor draft: selection and rejection both matter


class ValueRankedTetris(TetrisSelection):
    """The old, biased TETRIS: ranks sampled tokens by their own drafted probability."""

    @staticmethod
    def scores(drafts):
        return [np.cumsum(np.log(np.array(d.token_probs))) for d in drafts]


def generate(models, policy: str, n: int, policy_cls=None, seed=None, per_request_seeds=False, pad_rows=False,
             graphs=False, torch_compile=False) -> list[list[int]]:
    target, draft = models
    if policy == "goodput":  # it drafts only where drafting pays: a draft that pays here, so that it drafts
        draft = perturbed(target, 1.0, 5)
    engine = VerificationEngine(target, EngineConfig(seed=seed, pad_rows=pad_rows, torch_compile=torch_compile))
    if graphs:  # the target's steps at fixed shapes (goodspeed.lm.runtime.graphs): captured on CUDA, eager on CPU
        engine.runner.graphs = StepGraphs(engine.model, engine.cache, capture=engine.device.type == "cuda")
    config = LocalConfig(policy=policy, k=1, extra=2, max_k=3, budget=24, max_requests=8, max_waiting=n, seed=seed,
                         latency=LatencyProfile(TARGET_COST, DRAFT_COST) if policy == "turbospec" else None)
    serving = LocalServing(engine, draft, config, SimulatedClock(TARGET_COST, DRAFT_COST))
    if policy_cls is not None:  # a variant of the policy (a negative control's)
        serving.policy = policy_cls(serving)
    if graphs:  # and the draft's forwards
        serving.draft.graphs = StepGraphs(serving.draft.model, serving.draft.cache, capture=engine.device.type == "cuda")
    for i in range(n):
        serving.submit(PROMPT, SAMPLED, max_new_tokens=4, tpot_slo_ms=None if i % 2 else 12.0,
                       seed=i if per_request_seeds else None)
    while serving.step() is not None:
        pass
    assert len(serving.finished) == n and all(r.finish_reason == "length" for r in serving.finished)
    if policy == "goodput":  # its first step drafts k for each request (nothing measured yet); after that
        # only where drafting pays: 116-1,156 tokens over 600 requests in 25 seeded runs with its draft
        assert serving.stats()["drafted"] >= config.k * min(n, config.max_requests)
    elif policy != "none":  # speculation really happened
        assert serving.stats()["drafted"] > n
    if graphs or torch_compile:  # every step took the fixed shapes, and the draft's forwards but its first (which makes its KV pool)
        assert engine.graphs.steps == serving.totals["steps"], (engine.graphs.steps, serving.totals)
        assert serving.draft.graphs.steps == serving.draft.forwards - 1
    return [r.generated for r in serving.finished]


def check(models, outputs, expect_ok=True):
    ok, msg = fits(count_first_two(outputs, V), exact_first_two(models[0], PROMPT, SAMPLED))
    assert ok == expect_ok, msg


@pytest.mark.parametrize("policy", ["none", "chain", "adaserve", "turbospec", "nightjar", "goodput"])
def test_every_local_policy_follows_the_target(models, policy):
    check(models, generate(models, policy, 600))


@pytest.mark.parametrize("policy", ["chain", pytest.param("adaserve", marks=pytest.mark.slow)])  # trees padded: slow (10 s)
def test_padded_rows_keep_sampling_exact(models, policy):
    """The engine's rows padded where a step allows it (EngineConfig.pad_rows): chains and trees."""
    check(models, generate(models, policy, 600, pad_rows=True))


@pytest.mark.slow  # 10 s; test_graphs.py's static steps give the packed forward's logits by default
def test_graph_steps_keep_sampling_exact(models):
    """AdaServe's trees and chains in the fixed-shape steps CUDA graphs replay (run eagerly here),
    its beam search in the draft's fixed-shape forwards."""
    check(models, generate(models, "adaserve", 600, graphs=True))


@needs_cpp
@pytest.mark.slow  # compiling both models' graphs; the compiled engine has a default test (tests/lm/runtime/test_graphs.py)
def test_compiled_steps_keep_sampling_exact(models):
    """The same with the target's steps and the draft's forwards through decoders compiled by
    torch.compile (EngineConfig.torch_compile; the local draft follows the engine's setting)."""
    check(models, generate(models, "adaserve", 600, torch_compile=True))


@pytest.mark.slow  # 26 s; every policy's sampled test above runs by default with the engine's seed
@pytest.mark.parametrize("policy", ["chain", "tetris"])
def test_per_request_seeds_keep_sampling_exact(models, policy):
    """Seeded requests (the API's ``seed``) draft and verify with streams of their own: request
    i with seed i, so the draws differ across requests yet are reproducible."""
    outputs = generate(models, policy, 600, per_request_seeds=True)
    check(models, outputs)
    assert outputs == generate(models, policy, 600, per_request_seeds=True)  # the same seeds, the same schedule


def test_tetris_selection_keeps_sampling_exact(models):
    check(models, generate(models, "tetris", 2000))


def test_value_ranked_tetris_is_caught(models):
    """Negative control: the old ranking fails the same test at p < 1e-6 (5,000 requests, default
    seeds; chi2 231-232 in two runs, against a critical 90.5)."""
    stat, dof = chi2_stat(count_first_two(generate(models, "tetris", 5000, policy_cls=ValueRankedTetris), V),
                          exact_first_two(models[0], PROMPT, SAMPLED))
    assert stat > chi2_critical(dof, z=Z_POWER), f"chi2 {stat:.1f}: the test lacks power at p = 1e-6"


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["none", "chain", "tetris", "adaserve", "turbospec", "nightjar", "goodput"])
def test_every_local_policy_large_sample(models, policy):
    check(models, generate(models, policy, 6000))


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy", ["chain", "tetris", "adaserve"])
def test_local_policies_on_cuda_keep_sampling_exact(models, policy):
    """The same chi-square test with both models on the GPU: drafting draws its tokens on the
    device (``draft_step``), the engine verifies there; the exact distribution is the host's."""
    import copy

    on_gpu = tuple(copy.deepcopy(m).cuda() for m in models)
    check(models, generate(on_gpu, policy, 600))
    if policy == "adaserve":  # and with the target's steps replayed as CUDA graphs
        check(models, generate(on_gpu, policy, 600, graphs=True))
