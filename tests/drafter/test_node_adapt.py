"""An edge node's --adapt (goodspeed.drafter.node_adapt) on a toy pair: weights change only with
no request admitted, and outputs stay the target's (greedy token for token; sampled in
distribution) across weight updates."""

import asyncio
import time

import pytest

from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.lm.models.adapt_config import AdaptConfig
from goodspeed.serving.generation import GenerationRequest
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from grpckit import NodeThread, ServerThread
from modelkit import copy_of, domain_prompts, far_pair, greedy_reference, perturbed
from statkit import count_first_two, exact_first_two, fits

VOCAB, NEW = 48, 16


@pytest.fixture(scope="module")
def pair():
    return far_pair()


def test_through_a_node_weights_change_only_between_requests_and_outputs_stay_exact(pair):
    """Greedy requests one after another through a node that fine-tunes every 2: each output is
    the target's greedy decoding, across weight updates; every swap ran with no request admitted.
    Each fine-tune overlaps the request after the one that set it off; the next request waits for
    it to end, so none is skipped for running into another (a toy request is far quicker than a
    fine-tune: otherwise how many run, and so whether one is adopted, would be a race; CI lost it
    once). Each fine-tune is long enough (60 steps) for the guard to see a gain on held-back text."""
    target, shipped = pair
    engine = VerificationEngine(target, EngineConfig(budget=8, max_draft_len=4, seed=3))
    prompts = domain_prompts(10, seed=1)
    swaps = []
    with ServerThread(engine, round_deadline_ms=500, target_name="tiny") as server, \
            NodeThread(server.address, copy_of(shipped), None, adapt=True, adapt_every=2) as edge:
        node = edge.node
        node.adapting.adapter.config = AdaptConfig(every=2, steps=60, lr=1e-2, cpu_share=1.0)
        swap = node.adapting.adapter.swap

        def watched():
            swaps.append((node.holding, list(node.drafter.slots.keys)))
            return swap()

        node.adapting.adapter.swap = watched

        async def generate(i, prompt):
            tokens = []
            async for delta in await node.open(GenerationRequest(f"r{i}", prompt, NEW, SamplingParams(), ())):
                tokens += delta.token_ids
            return tokens

        async def settled(recorded):  # on the node's loop, where a request is recorded and its fine-tune set off at once
            return node.adapting.adapter.kept_requests >= recorded and node.adapting._training is None

        def fine_tunes_done(recorded):
            """Wait until ``recorded`` requests are kept and no fine-tune runs (bounded: its steps are few)."""
            for _ in range(600):
                if edge.run(settled(recorded)):
                    return
                time.sleep(0.05)
            raise AssertionError("a fine-tune did not end within 30 s")

        outputs = []
        for i, prompt in enumerate(prompts):
            if i % 2 == 1 and i > 1:  # the fine-tune set off two requests ago, which the last one overlapped, has ended
                fine_tunes_done(i)
            outputs.append(edge.run(generate(i, prompt)))
        fine_tunes_done(len(prompts))
        edge.run(asyncio.sleep(0))
        updates = node.adapting.adapter.updates
    assert outputs == [greedy_reference(target, p, NEW) for p in prompts]
    assert [u.requests for u in updates] == [4, 6, 8, 10], updates  # at 2 nothing is held back yet to judge by
    assert any(u.outcome == "adopted" and u.candidate > u.before for u in updates), updates
    assert swaps and all(held == (0, []) for held in swaps), swaps


def test_sampled_outputs_through_a_node_changing_weights_keep_the_targets_distribution(pair):
    """Sampled requests, four at a time, through a node whose draft changes weights every 40
    requests (to arbitrary ones: the guard is bypassed, the verifier verifies whatever is
    drafted): the first two tokens follow the target's own distribution (chi-square, p = 1e-5)."""
    target = pair[0]
    sampling, prompt, n = SamplingParams(temperature=1.0), [1, 2, 3, 4, 5, 6], 1200
    engine = VerificationEngine(target, EngineConfig(budget=8, max_draft_len=4, seed=11))
    with ServerThread(engine, round_deadline_ms=500, target_name="tiny") as server, \
            NodeThread(server.address, copy_of(pair[1]), None, adapt=True, adapt_every=40, max_concurrency=4, seed=5) as edge:
        adapter = edge.node.adapting.adapter
        weights = [perturbed(target, scale, 20 + i).state_dict() for i, scale in enumerate((0.05, 0.5, 1.0, 0.2))]

        def fine_tune():
            adapter.pending = weights[adapter.version % len(weights)]

        adapter.fine_tune = fine_tune

        async def run_all():
            gate = asyncio.Semaphore(4)

            async def one(i):
                async with gate:
                    tokens = []
                    async for delta in await edge.node.open(GenerationRequest(f"s{i}", prompt, 2, sampling, ())):
                        tokens += delta.token_ids
                    return tokens

            return await asyncio.gather(*(one(i) for i in range(n)))

        outputs = edge.run(run_all(), timeout=900)
        version = adapter.version
    assert version >= n // 40 - 2, version
    ok, msg = fits(count_first_two(outputs, VOCAB), exact_first_two(target, prompt, sampling))
    assert ok, msg
