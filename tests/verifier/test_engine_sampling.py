"""End to end through the engine (KV cache, batching, logits processing, sparse transport):
sampled outputs follow the target's own distribution, for chains (dense and sparse q) and trees."""

import numpy as np
import pytest
import torch

from goodspeed.drafter.runner import DraftRunner
from goodspeed.launch.inprocess import InProcessDrafter, run_inprocess
from goodspeed.lm.sampling import SamplingParams, process_logits
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from goodspeed.verifier.types import Draft
from modelkit import perturbed, tiny_llama

V = 6
PROMPT = [1, 2, 3]
CHI2_35DOF_P001 = 66.6


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(4, vocab=V, init=0.08)
    return target, perturbed(target, 0.5, 5)


def exact_pairs(target, sampling):
    with torch.inference_mode():
        first = process_logits(target(input_ids=torch.tensor([PROMPT])).logits[0, -1], sampling)
        seconds = [process_logits(target(input_ids=torch.tensor([PROMPT + [a]])).logits[0, -1], sampling) for a in range(V)]
    return (first[:, None] * torch.stack(seconds)).numpy()


def check(counts, exact):
    expected = exact * counts.sum()
    live = expected > 0
    assert counts[~live].sum() == 0  # nothing outside the target's support (top-k)
    chi2 = float(((counts[live] - expected[live]) ** 2 / expected[live]).sum())
    tv = 0.5 * np.abs(counts / counts.sum() - exact).sum()
    assert chi2 < CHI2_35DOF_P001 and tv < 0.05, (chi2, tv)


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.9, top_k=3)], ids=["dense", "sparse"])
def test_chain_outputs_follow_target(models, sampling):
    target, draft = models
    engine = VerificationEngine(target, EngineConfig(budget=16, max_draft_len=3, seed=7))
    drafters = [InProcessDrafter(f"d{i}", DraftRunner(draft), [PROMPT] * 500, sampling, max_new_tokens=3, seed=i) for i in range(8)]
    results = run_inprocess(engine, drafters)
    counts = np.zeros((V, V))
    for d in drafters:
        for out in d.outputs:
            counts[out[0], out[1]] += 1
    check(counts, exact_pairs(target, sampling))
    assert sum(v.num_accepted for r in results for v in r.verdicts.values()) > 1000  # speculation really happened


def test_tree_outputs_follow_target(models):
    target, draft = models
    sampling = SamplingParams(temperature=1.0)
    with torch.inference_mode():
        q_root = torch.softmax(draft(input_ids=torch.tensor([PROMPT])).logits[0, -1], -1)
        a1, a2 = torch.topk(q_root, 2).indices.tolist()
        b = [int(draft(input_ids=torch.tensor([PROMPT + [a]])).logits[0, -1].argmax()) for a in (a1, a2)]
    tree = Draft(0, [a1, a2, b[0], b[1]], parents=[-1, -1, 0, 1])  # deterministic candidates
    engine = VerificationEngine(target, EngineConfig(budget=64, max_draft_len=4, seed=11))
    sessions = [engine.join(f"t{i}") for i in range(8)]
    counts, todo = np.zeros((V, V)), 4000
    while todo > 0:
        outs = {}
        for sid in sessions:
            engine.start_request(sid, PROMPT, sampling, max_new_tokens=3)
            engine.set_allotment(sid, 4)
            engine.submit(sid, Draft(engine.next_round(sid), tree.token_ids, parents=tree.parents))
            outs[sid] = []
        while any(len(o) < 2 for o in outs.values()):
            for sid, v in engine.run_round().verdicts.items():
                outs[sid] += v.token_ids
                if len(outs[sid]) < 2:
                    engine.submit(sid, Draft(engine.next_round(sid), []))
        for sid in sessions:  # stop the requests after their first two tokens
            engine.leave(sid)
        sessions = [engine.join(f"t{i}") for i in range(8)]
        for o in outs.values():
            counts[o[0], o[1]] += 1
        todo -= len(sessions)
    check(counts, exact_pairs(target, sampling))
