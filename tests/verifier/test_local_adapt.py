"""Local serving's --local-draft-adapt (goodspeed.verifier.local_adapt) on a toy pair whose draft
handles the traffic poorly: fine-tunes run in the background and adopt better weights, weights
change only with no local request active (new ones wait meanwhile), and every output is the
target's greedy decoding across the updates; the verifier's metrics report the updates."""

import time

import pytest
from prometheus_client import generate_latest

from goodspeed.lm.models.adapt_config import AdaptConfig
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from goodspeed.verifier.local import LocalConfig, LocalServing
from goodspeed.verifier.observability import Metrics
from modelkit import domain_prompts, far_pair, greedy_reference

NEW = 16


@pytest.fixture(scope="module")
def pair():
    return far_pair()


def test_local_serving_adopts_better_weights_between_requests_and_stays_exact(pair):
    target, draft = pair
    prompts = domain_prompts(24)
    told = []
    serving = LocalServing(VerificationEngine(target, EngineConfig(seed=3)), draft, LocalConfig(policy="chain", k=4, adapt=True,
                                                                                               adapt_every=4), log=told.append)
    adapter = serving.adapting.adapter
    adapter.config = AdaptConfig(every=4, steps=30, lr=3e-3, cpu_share=1.0)
    swaps = []
    swap = adapter.swap

    def watched():
        swaps.append(serving.num_active)
        return swap()

    adapter.swap = watched
    metrics = Metrics()
    metrics.watch_local_adapt(serving.adapting)

    def scraped() -> dict[str, float]:
        lines = generate_latest(metrics.registry).decode().splitlines()
        return {name: float(value) for name, _, value in (line.rpartition(" ") for line in lines)
                if name.startswith("goodspeed:local_draft")}

    assert scraped() == {"goodspeed:local_draft_version": 0.0, "goodspeed:local_draft_adapting": 0.0,
                         **{f'goodspeed:local_draft_adapt_updates_total{{outcome="{o}"}}': 0.0
                            for o in ("adopted", "reverted", "kept", "failed")},
                         "goodspeed:local_draft_adapt_seconds_total": 0.0}  # nothing measured yet: no acceptance
    outputs = {}
    for i in range(0, len(prompts), 3):  # three at a time, a wave after the last one ends
        ids = [serving.submit(p, max_new_tokens=NEW) for p in prompts[i : i + 3]]
        while serving.step() is not None:
            pass
        for rid, p in zip(ids, prompts[i : i + 3]):
            outputs[rid] = (p, next(r for r in serving.finished if r.request_id == rid).generated)
        for _ in range(600):  # let the fine-tune started by this wave end, so later waves see its weights
            if not serving.adapting.training:
                break
            time.sleep(0.05)
    assert all(out == greedy_reference(target, p, NEW) for p, out in outputs.values())
    outcomes = [u.outcome for u in adapter.updates]
    assert "adopted" in outcomes and adapter.version >= 1, outcomes
    assert swaps and all(active == 0 for active in swaps), swaps
    assert any(m.startswith("adapt: adopted") for m in told)
    seen = scraped()  # the verifier's /metrics tells the same story
    assert seen["goodspeed:local_draft_version"] == adapter.version
    assert seen['goodspeed:local_draft_adapt_updates_total{outcome="adopted"}'] == outcomes.count("adopted")
    assert seen['goodspeed:local_draft_adapt_acceptance{weights="after"}'] == pytest.approx(adapter.updates[-1].after)
    assert seen["goodspeed:local_draft_adapt_seconds_total"] == pytest.approx(adapter.seconds) and adapter.seconds > 0


def test_a_lookup_alone_cannot_adapt(pair):
    from goodspeed.lm.decoding.lookup import PromptLookup

    with pytest.raises(ValueError, match="a lookup alone has no draft model"):
        LocalServing(VerificationEngine(pair[0], EngineConfig()), PromptLookup(48), LocalConfig(adapt=True))
