"""Lookup drafts (goodspeed.lm.decoding.lookup) and the hybrid (goodspeed.lm.decoding.draft_source) through the
engine: greedy output equals the target's greedy decoding on edge drafters and in local serving
under every chain policy, and for the hybrid's trees under AdaServe; sampled output follows the target's exact distribution of the first two
tokens (chi-square, p = 1e-5), on an edge drafter, in local serving (chains, the goodput policy's
prefixes cut by evidence, and the hybrid's trees), and after a rejection
(a prompt whose lookup proposes a token the target rarely takes). Power check: a lookup's draft
sent with a ``q`` it was not drawn from (uniform instead of its point mass) fails the same test
at the default sample size with p < 1e-6."""

import numpy as np
import pytest

from goodspeed.drafter import runner as runner_module
from goodspeed.lm.runtime.batch_draft import BatchDraftModel
from goodspeed.lm.decoding.draft_source import HybridDraft
from goodspeed.lm.decoding.lookup import PromptLookup, SuffixDraft
from goodspeed.lm.decoding.params import SamplingParams
from modelkit import greedy_reference, perturbed, tiny_llama
from pathkit import run_edge_source, run_local
from statkit import Z_POWER, chi2_critical, chi2_stat, count_first_two, exact_first_two, fits


V = 6
PROMPT = [1, 2, 3, 4, 1, 2]  # "1 2" occurred before: both lookups propose 3, 4, ... at once
SOURCES = {
    "ngram": lambda target, draft: PromptLookup(target.config.vocab_size),
    "suffix": lambda target, draft: SuffixDraft(target.config.vocab_size),
    "hybrid": lambda target, draft: HybridDraft(SuffixDraft(target.config.vocab_size), BatchDraftModel(draft)),
}


@pytest.fixture(scope="module")
def target():
    return tiny_llama(4, vocab=V, init=0.08)


@pytest.fixture(scope="module")
def loopy():
    """A target whose greedy text repeats itself (as a random tiny model's does), and its draft."""
    model = tiny_llama(3, vocab=24)
    return model, perturbed(model, 0.3, 2)


def greedy_prompts(n: int = 8):
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(0, 24, 6)] * 2 for _ in range(n)]  # each prompt repeats itself once


@pytest.mark.parametrize("name", SOURCES)
def test_greedy_on_edge_drafters_is_the_targets_greedy_decoding(loopy, name):
    target, draft = loopy
    prompts = greedy_prompts()
    outputs, results = run_edge_source(target, lambda: SOURCES[name](target, draft), SamplingParams(), prompts, 24)
    assert outputs == [greedy_reference(target, p, 24) for p in prompts]
    assert sum(v.num_accepted for r in results for v in r.verdicts.values()) > len(prompts)  # the lookups drafted


@pytest.mark.parametrize("policy", ["chain", "tetris", "nightjar", "goodput"])
@pytest.mark.parametrize("name", SOURCES)
def test_greedy_in_local_serving_is_the_targets_greedy_decoding(loopy, name, policy):
    target, draft = loopy
    prompts = greedy_prompts()
    outputs, serving = run_local(target, SOURCES[name](target, draft), SamplingParams(), policy, prompts, 24)
    assert outputs == [greedy_reference(target, p, 24) for p in prompts]
    assert serving.stats()["accepted"] > 0


def test_the_hybrids_trees_under_adaserve_are_the_targets_greedy_decoding(loopy):
    target, draft = loopy
    prompts = greedy_prompts()
    source = SOURCES["hybrid"](target, draft)
    outputs, serving = run_local(target, source, SamplingParams(), "adaserve", prompts, 24)
    assert outputs == [greedy_reference(target, p, 24) for p in prompts]
    assert source.from_lookup["rounds"] > 0 and serving.stats()["accepted"] > len(prompts)


def test_adaserve_refuses_a_source_that_drafts_no_trees(target):
    with pytest.raises(ValueError, match="beam trees"):
        run_local(target, SuffixDraft(V), SamplingParams(), "adaserve", [PROMPT], 4)


def sampled_edge(target, name, sampling, n=800):
    outputs, _ = run_edge_source(target, lambda: SOURCES[name](target, perturbed(target, 1.0, 5)), sampling, [PROMPT] * n, 3,
                                 drafters=8)
    return outputs


@pytest.mark.parametrize("name", ["ngram", "suffix"])
def test_sampled_lookup_drafts_on_edge_drafters_follow_the_target(target, name):
    sampling = SamplingParams(temperature=1.0)
    ok, msg = fits(count_first_two(sampled_edge(target, name, sampling), V), exact_first_two(target, PROMPT, sampling))
    assert ok, msg


@pytest.mark.parametrize("name", ["ngram", "suffix"])
def test_sampled_lookup_drafts_under_the_goodput_policy_follow_the_target(target, name):
    """The goodput policy looks a lookup's longest draft up, then verifies the prefix that pays by
    its evidence: the cut reads only past verdicts, so the output keeps the target's distribution.
    The run has a fixed root seed: how much the policy drafts feeds back on its first verdicts
    (unseeded, accepted tokens ranged 9-79 over 16 runs), and the power check below needs the
    same run every time."""
    sampling = SamplingParams(temperature=1.0)
    prompt = [3, 2, 4, 5, 3, 2]  # the lookups propose 4, 5, ...: the target's 4 has p = 0.39, so drafting pays at times
    outputs, serving = run_local(target, SOURCES[name](target, None), sampling, "goodput", [prompt] * 1600, 3, min_drafted=40,
                                 seed=0)
    ok, msg = fits(count_first_two(outputs, V), exact_first_two(target, prompt, sampling))
    assert ok, msg
    assert serving.stats()["accepted"] >= 10


def test_sampled_hybrid_drafts_in_local_serving_follow_the_target(target):
    sampling = SamplingParams(temperature=0.8, top_k=4)
    source = SOURCES["hybrid"](target, perturbed(target, 1.0, 5))
    outputs, serving = run_local(target, source, sampling, "chain", [PROMPT] * 800, 3)
    ok, msg = fits(count_first_two(outputs, V), exact_first_two(target, PROMPT, sampling))
    assert ok, msg
    assert source.from_lookup["rounds"] > 0 and source.model.forwards > 0  # both halves drafted


def test_sampled_hybrid_trees_under_adaserve_follow_the_target(target):
    """Each node of the tree (the beam's and the lookup's branch alike) is a deterministic
    candidate, verified as a point mass by recursive rejection over its siblings."""
    sampling = SamplingParams(temperature=1.0)
    source = SOURCES["hybrid"](target, perturbed(target, 1.0, 5))
    outputs, serving = run_local(target, source, sampling, "adaserve", [PROMPT] * 800, 3)
    ok, msg = fits(count_first_two(outputs, V), exact_first_two(target, PROMPT, sampling))
    assert ok, msg
    assert source.from_lookup["rounds"] > 0 and serving.stats()["accepted"] > 0


def test_a_lookups_draft_sent_with_a_q_it_was_not_drawn_from_is_caught(target, monkeypatch):
    """The bug this guards against: a deterministic draft sent with a made-up ``q`` (here uniform)
    is accepted with ``min(1, p / q)`` instead of ``p``, which skews the output toward the lookup."""
    real = runner_module.DraftOutput.q_to_send

    def uniform(self, sampling):
        if self.probs is None and self.token_ids and not sampling.greedy:
            return "sparse", [(list(range(V)), [1.0 / V] * V) for _ in self.token_ids]
        return real(self, sampling)

    monkeypatch.setattr(runner_module.DraftOutput, "q_to_send", uniform)
    sampling = SamplingParams(temperature=1.0)
    stat, dof = chi2_stat(count_first_two(sampled_edge(target, "ngram", sampling), V), exact_first_two(target, PROMPT, sampling))
    assert stat > chi2_critical(dof, z=Z_POWER), f"a made-up q gave chi2 {stat:.1f}: the test lacks power at p = 1e-6"
