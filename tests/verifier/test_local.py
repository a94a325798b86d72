"""Local serving: every policy is lossless under greedy decoding (the target's own, trees
included; sampled outputs: test_local_lossless.py), AdaServe meets a tight SLO that fixed-k
chains miss, TurboSpec / Nightjar switch speculation off where it cannot pay and on where it does,
and the goodput policy keeps a lookup's drafts by the evidence behind them."""

import pytest

from goodspeed.lm.runtime.batch_draft import BatchDraftModel
from goodspeed.lm.runtime.graphs import StepGraphs
from goodspeed.lm.decoding.lookup import LookupDraft
from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.scheduler import LatencyModel
from goodspeed.verifier import errors
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from goodspeed.verifier import local as local_module
from goodspeed.verifier.types import Draft
from goodspeed.verifier.clocks import LatencyProfile, SimulatedClock
from goodspeed.verifier.local import LOCAL_POLICIES, LocalConfig, LocalServing
from goodspeed.verifier.local_policies import LocalPolicy
from graphkit import fresh_dynamo, needs_cpp  # noqa: F401 (a fixture)
from modelkit import greedy_reference, perturbed, tiny_llama

# Modeled costs (seconds): a target forward of ~10 ms growing with batched tokens, a draft
# forward 10x cheaper. Used by the simulated clock and by TurboSpec.
TARGET_COST = LatencyModel(1e-6, 2e-4, 0.010)
DRAFT_COST = LatencyModel(1e-7, 2e-5, 0.001)
PROFILE = LatencyProfile(TARGET_COST, DRAFT_COST)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10], [11, 12, 13, 14], [3, 3, 3, 3, 3, 3, 3, 3], [20, 21]]


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(1)
    return target, perturbed(target, 0.3, 2)


def serve(target, draft, policy, clock=None, prefill_chunk=None, pad_rows=False, **kw):
    engine = VerificationEngine(target, EngineConfig(seed=3 if kw.get("seed") is None else kw["seed"], prefill_chunk=prefill_chunk,
                                                     pad_rows=pad_rows))
    config = LocalConfig(policy=policy, latency=PROFILE if policy == "turbospec" else None, **kw)
    return LocalServing(engine, draft, config, clock or SimulatedClock(TARGET_COST, DRAFT_COST))


def drain(serving, max_steps=10_000):
    reports = []
    for _ in range(max_steps):
        report = serving.step()
        if report is None:
            return reports
        reports.append(report)
    raise AssertionError("serving did not finish")


@pytest.mark.parametrize("chunk, pad_rows", [(None, False), (2, False), (2, True)])
@pytest.mark.parametrize("policy", LOCAL_POLICIES)
def test_greedy_outputs_equal_the_targets_own(models, policy, chunk, pad_rows):
    """Also with chunked prefill (2 prompt tokens per step): requests draft from the step after
    their prompt is in, next to others that already do; and with the engine's rows padded where a
    step has no chunk (EngineConfig.pad_rows)."""
    target, draft = models
    serving = serve(target, draft, policy, prefill_chunk=chunk, pad_rows=pad_rows, max_requests=4, budget=12, k=3, extra=2)
    slos = [None, 5.0, 50.0, None, 1.0, 20.0]
    ids = [serving.submit(p, max_new_tokens=10 + i, tpot_slo_ms=slo) for i, (p, slo) in enumerate(zip(PROMPTS, slos))]
    reports = drain(serving)
    by_id = {r.request_id: r for r in serving.finished}
    for rid, prompt, i in zip(ids, PROMPTS, range(len(PROMPTS))):
        req = by_id[rid]
        assert req.finish_reason == "length"
        assert req.generated == greedy_reference(target, prompt, 10 + i), rid
        assert len(req.token_times) == len(req.generated)
    stats = serving.stats()
    if policy != "none":
        assert stats["accepted"] > 0  # speculation really happened
    assert max(r.requests for r in reports) == 4  # continuous batching: up to max_requests together
    assert stats["emitted"] == sum(10 + i for i in range(len(PROMPTS)))
    if chunk is not None:
        assert max(r.round.prefill_tokens for r in reports) == chunk
        assert any(r.round.prefill_tokens and r.requests for r in reports)  # chunks next to drafting requests


def test_adaserve_really_verifies_trees(models):
    """AdaServe's drafts reach the engine as trees: some node has a sibling (two children of one
    parent, or two roots), and its output is still the target's greedy decoding."""
    target, draft = models
    serving = serve(target, draft, "adaserve", budget=16, max_width=3)
    submitted = []
    submit = serving.engine.submit
    serving.engine.submit = lambda sid, d: submitted.append(d) or submit(sid, d)
    for p in PROMPTS[:2]:
        serving.submit(p, max_new_tokens=12, tpot_slo_ms=5.0)
    while serving.step() is not None:
        pass
    branching = [d for d in submitted if d.parents is not None and len(set(d.parents)) < len(d.parents)]
    assert branching, [d.parents for d in submitted]
    assert all(r.generated == greedy_reference(target, p, 12) for r, p in zip(serving.finished, PROMPTS[:2]))


def test_adaserve_drafts_nothing_once_the_roots_take_the_whole_budget(models):
    """``B = 3``: with 3 or more requests every unit of the budget goes to a root (Alg. 2), so no
    node could be selected and the draft model must not run; with fewer, trees are verified."""
    target, draft = models
    serving = serve(target, draft, "adaserve", budget=3, max_requests=4)
    lengths = [4, 5, 12, 14]
    ids = [serving.submit(p, max_new_tokens=n) for p, n in zip(PROMPTS, lengths)]
    drafted_with = set()
    while True:
        forwards = serving.draft.forwards
        report = serving.step()
        if report is None:
            break
        if report.requests >= 3:
            assert serving.draft.forwards == forwards and report.drafted == 0
        elif report.requests and report.drafted:
            drafted_with.add(report.requests)
    assert drafted_with  # the last requests, fewer than B, did draft trees
    by_id = {r.request_id: r for r in serving.finished}
    assert [by_id[i].generated for i in ids] == [greedy_reference(target, p, n) for p, n in zip(PROMPTS, lengths)]


def test_eos_cancel_and_streaming_callbacks(models):
    target, draft = models
    serving = serve(target, draft, "chain")
    reference = greedy_reference(target, PROMPTS[0], 12)
    events = []
    rid = serving.submit(PROMPTS[0], max_new_tokens=12, eos_token_ids=[reference[5]], on_event=events.append)
    other = serving.submit(PROMPTS[1], max_new_tokens=30)
    serving.step()
    assert serving.cancel(other) and not serving.cancel(other)
    drain(serving)
    streamed = [t for e in events for t in e.token_ids]
    cut = reference.index(reference[5]) + 1
    assert streamed == reference[:cut]
    assert events[-1].finished and events[-1].finish_reason == "eos" and events[-1].request_id == rid
    reasons = {r.request_id: r.finish_reason for r in serving.finished}
    assert reasons[other] == "cancelled"
    assert serving.engine.session_ids == []  # every local session left; no KV held


def test_bad_requests_fail_at_submit(models):
    target, draft = models
    serving = serve(target, draft, "chain")
    with pytest.raises(errors.InvalidTokenError):
        serving.submit([999], max_new_tokens=4)
    with pytest.raises(errors.LengthLimitError):
        serving.submit([1, 2], max_new_tokens=10_000)
    with pytest.raises(errors.MalformedDraftError, match="tpot"):
        serving.submit([1], max_new_tokens=4, tpot_slo_ms=0)
    with pytest.raises(ValueError, match="latency profile"):
        LocalConfig(policy="turbospec")
    with pytest.raises(ValueError, match="unknown local policy"):
        LocalConfig(policy="medusa")
    with pytest.raises(ValueError, match="vocabulary"):
        LocalServing(VerificationEngine(target), tiny_llama(0, vocab=50), LocalConfig())


# Sampled outputs of every policy: tests/verifier/test_local_lossless.py.


# ----------------------------------------------------------------------------------- SLOs


class Roofline:
    """A forward costs ``delta`` up to ``knee`` batched tokens (memory-bound), then ``gamma`` per
    extra token (compute-bound): the regime AdaServe's budget ``B`` is about (its Section 3)."""

    def __init__(self, delta, knee, gamma):
        self.delta, self.knee, self.gamma = delta, knee, gamma

    def predict_s(self, context_tokens, batched_tokens):
        return self.delta + self.gamma * max(0, batched_tokens - self.knee)


def test_adaserve_meets_a_tight_slo_that_fixed_chains_miss(models):
    """One trace in simulated time: 2 strict requests (TPOT SLO well below plain decoding's
    per-token latency) among 14 relaxed ones. Fixed-k chains give everyone the same k; AdaServe
    spends the budget on the strict requests' trees first. The draft is an exact copy of the
    target, so the test measures the scheduling, not the draft's quality."""
    target, _ = models
    draft = perturbed(target, 0.0, 2)
    strict_ms, relaxed_ms, knee = 7.2, 100.0, 32
    attained = {}
    for name, policy, kw in [(f"chain{k}", "chain", {"k": k}) for k in range(4)] + [("adaserve", "adaserve", {"budget": knee})]:
        clock = SimulatedClock(Roofline(0.010, knee, 2e-3), Roofline(0.001, 10**9, 0.0))
        serving = serve(target, draft, policy, clock=clock, max_requests=16, max_depth=8, max_width=3, max_slo_tree_size=8, **kw)
        strict = {serving.submit(PROMPTS[i % 6], max_new_tokens=64, tpot_slo_ms=strict_ms) for i in range(2)}
        for i in range(14):
            serving.submit(PROMPTS[(i + 2) % 6], max_new_tokens=64, tpot_slo_ms=relaxed_ms)
        drain(serving)
        met = [r.slo_met for r in serving.finished if r.request_id in strict]
        relaxed_met = [r.slo_met for r in serving.finished if r.request_id not in strict]
        attained[name] = (sum(met) / len(met), sum(relaxed_met) / len(relaxed_met))
    assert attained["adaserve"] == (1.0, 1.0), attained
    assert all(attained[f"chain{k}"][0] == 0.0 for k in range(4)), attained


# ---------------------------------------------------------------------- speculation on/off


def _decided_ks(serving, max_steps=10_000) -> list[int]:
    """Drain ``serving``; the ``k`` of every step the policy DECIDED: Nightjar's exploration
    steps (a uniform arm, Alg. 1 line 9) are left out: they explore by design, and in a run this
    short its doubling schedule explores ~half of the steps, whatever it has learnt."""
    ks = []
    for _ in range(max_steps):
        report = serving.step()
        if report is None:
            return ks
        exploring = hasattr(serving.policy, "bandit") and serving.policy.bandit.is_exploring(report.requests)
        if report.k is not None and not exploring:
            ks.append(report.k)
    raise AssertionError("serving did not finish")


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])  # seed 0 by default
@pytest.mark.parametrize("policy", ["turbospec", "nightjar"])
def test_speculation_switches_off_where_it_cannot_pay_and_on_where_it_does(models, policy, seed):
    target, _ = models
    useless_draft = tiny_llama(99)  # unrelated: its drafts are almost never accepted
    good_draft = perturbed(target, 0.0, 2)  # agrees with the target: every draft is accepted
    ks = {}
    for name, draft in (("useless", useless_draft), ("good", good_draft)):
        serving = serve(target, draft, policy, max_requests=4, max_k=4, seed=seed)
        for i in range(24):
            serving.submit(PROMPTS[i % 6], max_new_tokens=40)
        chosen = _decided_ks(serving)
        ks[name] = chosen[len(chosen) // 2 :]  # after learning / smoothing settles
    off = sum(k == 0 for k in ks["useless"]) / len(ks["useless"])
    on = sum(k > 0 for k in ks["good"]) / len(ks["good"])
    assert off > 0.8 and on > 0.8, (off, on, ks)


class OracleLookup(LookupDraft):
    """A lookup that knows each prompt's greedy continuation: after a text of even length it
    proposes it, backed by a long match (evidence 6); after an odd one, the wrong tokens, backed by
    one matched token (evidence 1). One request's acceptance is the mix of both."""

    name = "oracle"

    def __init__(self, vocab_size, truth):
        super().__init__(vocab_size)
        self.truth = truth

    def _new_state(self):
        return []

    def _sync(self, state, committed):
        state[:] = [int(t) for t in committed]

    def _propose(self, state, max_tokens):
        prompt = next(p for p in self.truth if tuple(state[: len(p)]) == p)
        done = len(state) - len(prompt)
        tokens = self.truth[prompt][done : done + max_tokens]
        if len(state) % 2 == 0:
            return tokens, 6
        return [(t + 1) % self.vocab_size for t in tokens], 1


@pytest.mark.parametrize("by_evidence", [True, False])
def test_the_goodput_policy_keeps_a_lookups_drafts_by_their_evidence(models, by_evidence):
    """Proposals backed by a long match are always taken, those backed by one matched token never,
    in the same requests: the policy learns each class's acceptance and drafts the first at full
    length and the second little (its first steps, then backed-off probes); the output is the
    target's greedy decoding. Negative control: by one acceptance a request (the lookup's
    proposals taken as a model's, ``free_proposals`` off), most drafted tokens are wasted."""
    target, _ = models
    prompts = [tuple(p) for p in PROMPTS]
    truth = {p: greedy_reference(target, list(p), 40) for p in prompts}
    source = OracleLookup(target.config.vocab_size, truth)
    source.free_proposals = by_evidence
    serving = serve(target, source, "goodput", max_requests=6, k=4, max_k=4)
    for p in prompts:
        serving.submit(list(p), max_new_tokens=40)
    while serving.step() is not None:
        pass
    done = {tuple(r.prompt_ids): r for r in serving.finished}
    assert all(done[p].generated == truth[p] for p in prompts)
    drafted, accepted = serving.stats()["drafted"], serving.stats()["accepted"]
    if by_evidence:
        assert accepted >= 0.8 * drafted and accepted >= 6 * 12, (drafted, accepted)
    else:
        assert accepted < 0.6 * drafted, (drafted, accepted)


class SplitLookup(OracleLookup):
    """A lookup that knows the greedy continuation of some prompts (``good``: proposed, backed by a
    long match) and proposes wrong tokens for the others (backed by one matched token)."""

    name = "split"

    def __init__(self, vocab_size, truth, good):
        super().__init__(vocab_size, truth)
        self.good = good

    def _propose(self, state, max_tokens):
        prompt = next(p for p in self.truth if tuple(state[: len(p)]) == p)
        done = len(state) - len(prompt)
        tokens = self.truth[prompt][done : done + max_tokens]
        if prompt in self.good:
            return tokens, 6
        return [(t + 1) % self.vocab_size for t in tokens], 1


def _split_batch(target, policy, **kw):
    """Three requests whose lookups are always right beside three whose are always wrong, under the
    simulated clock (each drafted token adds 2% to a step): each request's decoding time a token."""
    prompts = [tuple(p) for p in PROMPTS]
    truth = {p: greedy_reference(target, list(p), 96) for p in prompts}
    source = SplitLookup(target.config.vocab_size, truth, good=set(prompts[:3]))
    source.free_proposals = True
    serving = serve(target, source, policy, max_requests=6, k=4, max_k=4, **kw)
    for i, p in enumerate(prompts):
        serving.submit(list(p), max_new_tokens=96 if i < 3 else 32)
    drain(serving)
    done = {tuple(r.prompt_ids): r for r in serving.finished}
    assert all(done[p].generated == truth[p][: len(done[p].generated)] for p in prompts)
    return [done[p].tpot_s for p in prompts], serving.stats()


def test_the_goodput_floor_keeps_a_request_whose_drafts_do_not_pay_at_plain_decodings_pace(models):
    """A floor of 0.97: the requests whose lookups never pay decode at least 0.97x as fast as
    under plain decoding in the same batch (TPOT in modelled time: deterministic), their first
    steps' losses (drafts of their own, taken at the lookup's prior acceptance) paid back by the
    others drafting less, while the others still draft and run faster. Negative control: with
    the floor off (the default), the batch's most tokens a second has the paying requests draft
    all they can, and the others run more than 5% slower than plain decoding."""
    target, _ = models
    plain, _ = _split_batch(target, "none")
    floored, stats = _split_batch(target, "goodput", floor=0.97)
    free, free_stats = _split_batch(target, "goodput")
    assert all(f <= p / 0.97 for f, p in zip(floored[3:], plain[3:])), (floored, plain)
    assert all(f < 0.6 * p for f, p in zip(floored[:3], plain[:3])) and stats["accepted"] > 0
    assert all(f > 1.05 * p for f, p in zip(free[3:], plain[3:])), (free, plain)
    assert free_stats["drafted"] > stats["drafted"]


def test_the_policy_learns_a_steps_cost_without_the_prompts_prefilled_at_admission(models):
    """Prompts prefilled whole as they are admitted (no chunking) run before the step's planning;
    the goodput policy's fitted step cost leaves them out (modelled time: a step of six requests
    costs about 11 ms here, the six prefills some 65 ms more)."""
    target, draft = models
    serving = serve(target, draft, "goodput", max_requests=6, k=2, max_k=2)
    for p in PROMPTS:
        serving.submit(p, max_new_tokens=8)
    report = serving.step()
    step_s = serving.policy.costs.batch_costs()[0]
    assert report.duration_s > 0.05 and step_s < 0.02, (report.duration_s, step_s)
    drain(serving)

def test_the_wait_queue_is_bounded(models):
    """1,000 queued Generate requests used to be accepted (+130 MB); past max_waiting they are refused."""
    target, draft = models
    serving = serve(target, draft, "chain", max_requests=1, max_waiting=2)
    ids = [serving.submit(PROMPTS[0], max_new_tokens=2) for _ in range(2)]
    with pytest.raises(errors.QueueFullError, match="waiting") as full:
        serving.submit(PROMPTS[0], max_new_tokens=2)
    assert full.value.retry_after_s == 1.0  # nothing measured yet: a second
    serving.step()  # admits one: room for one more
    ids.append(serving.submit(PROMPTS[0], max_new_tokens=2))
    drain(serving)
    assert sorted(r.request_id for r in serving.finished) == sorted(ids)


def test_the_doors_check_counts_the_requests_it_let_through_that_are_not_queued_yet(models):
    """queue_full(arriving): a door's check off the engine thread counts what it has let through
    but the engine thread has not queued yet, and answers with the last step's retry estimate."""
    target, draft = models
    serving = serve(target, draft, "chain", max_requests=1, max_waiting=2)
    serving.submit(PROMPTS[0], max_new_tokens=8)
    assert serving.queue_full() is None and serving.queue_full(arriving=0) is None
    refusal = serving.queue_full(arriving=1)  # one waiting and one on its way: full
    assert isinstance(refusal, errors.QueueFullError) and refusal.retry_after_s == serving.retry_hint_s == 1.0
    serving.step()  # admits the waiting one (its prefill)
    serving.step()  # a drafting step: its time measured, the retry estimate left for the doors
    assert serving.queue_full(arriving=1) is None and serving.retry_hint_s == serving.retry_after_s() < 1.0
    drain(serving)


def test_fail_all_ends_every_request_and_frees_its_state(models):
    """After a failed iteration (the server's round loop calls this) nothing half-applied stays."""
    target, draft = models
    serving = serve(target, draft, "chain", max_requests=1)
    events = []
    for p in PROMPTS[:3]:
        serving.submit(p, max_new_tokens=6, on_event=events.append)
    serving.step()  # one active, two waiting
    serving.fail_all("error: the round failed (injected)")
    assert not serving.has_work and serving.engine.session_ids == [] and serving.draft.cache.num_slots == 0
    finals = [e for e in events if e.finished]
    assert len(finals) == 3 and {e.finish_reason for e in finals} == {"error: the round failed (injected)"}


def test_a_local_policy_is_one_registered_class(models, monkeypatch):
    """Adding a policy: one LocalPolicy subclass in the registry; the config checks it, serving uses it."""
    assert LOCAL_POLICIES == ("none", "chain", "tetris", "adaserve", "turbospec", "nightjar", "goodput")

    class EveryOtherStep(LocalPolicy):
        name = "every-other"
        seen = []

        @staticmethod
        def check(config):
            if config.k < 1:
                raise ValueError("every-other needs k >= 1")

        def plan(self, reqs):
            k = self.serving.config.k if self.serving.totals["steps"] % 2 else 0
            return self.serving.chains(reqs, {r.request_id: min(k, r.cap) for r in reqs}), k

        def observe(self, batch_size, k, emitted, duration_s, prefill_tokens=0):
            self.seen.append(k)

    with pytest.raises(ValueError, match="unknown local policy 'every-other'"):
        LocalConfig(policy="every-other")
    monkeypatch.setitem(local_module.LOCAL_POLICY_CLASSES, "every-other", EveryOtherStep)
    with pytest.raises(ValueError, match="k >= 1"):
        LocalConfig(policy="every-other", k=0)
    target, draft = models
    serving = serve(target, draft, "every-other", k=2)
    serving.submit(PROMPTS[0], max_new_tokens=12)
    drain(serving)
    assert serving.finished[0].generated == greedy_reference(target, PROMPTS[0], 12)
    assert EveryOtherStep.seen[:4] == [0, 2, 0, 2]


@pytest.mark.parametrize("policy", ["chain", "adaserve"])
def test_iteration_time_is_split_into_drafting_and_the_target_round(models, policy):
    """totals["drafting_s"] is the clock time of the policy's draft forwards and selection, and
    totals["round_s"] that of the engine's rounds: under the simulated clock, every draft forward's
    modeled cost and every round's (prompt prefills at admission excluded)."""
    charged = {"draft": 0.0, "target": 0.0}
    admitting = []

    class Counting(SimulatedClock):
        def charge(self, which, context_tokens, batched_tokens):
            before = self.t
            super().charge(which, context_tokens, batched_tokens)
            if not admitting:
                charged[which] += self.t - before

    target, draft = models
    serving = serve(target, draft, policy, clock=Counting(TARGET_COST, DRAFT_COST), k=3)
    admit = serving._admit

    def counted_admit():
        admitting.append(True)
        try:
            admit()
        finally:
            admitting.pop()

    serving._admit = counted_admit
    serving.submit(PROMPTS[1], max_new_tokens=12)
    drain(serving)
    assert serving.totals["drafting_s"] == pytest.approx(charged["draft"]) and charged["draft"] > 0
    assert serving.totals["round_s"] == pytest.approx(charged["target"]) and charged["target"] > 0


def test_local_serving_is_a_draft_source_of_its_own(models):
    """Local sessions are sized by local serving's own book: the edge drafters keep the whole
    budget C and the max_drafters limit, and local drafts may exceed C; both are verified in one
    forward, each verdict carrying its own book's acceptance."""
    target, draft = models
    engine = VerificationEngine(target, EngineConfig(seed=3, budget=4, max_drafters=1, max_draft_len=4))
    serving = LocalServing(engine, draft, LocalConfig(policy="chain", k=6), SimulatedClock(TARGET_COST, DRAFT_COST))
    for prompt in PROMPTS[:3]:
        serving.submit(prompt, max_new_tokens=20)
    serving.step()  # three local sessions joined and drafted 6 each
    assert serving.totals["drafted"] == 18
    edge = engine.join("edge")  # the only edge drafter max_drafters allows, local sessions beside
    with pytest.raises(errors.TooManyDraftersError):
        engine.join("edge-2")
    assert engine.start_request(edge, PROMPTS[3], SamplingParams(), 20) == 4  # the whole C: local holds none of it
    reference = greedy_reference(target, PROMPTS[3], 20)
    engine.submit(edge, Draft(0, reference[:4]))
    report = serving.step()
    verdict = report.round.verdicts[edge]
    assert verdict.num_accepted == 4 and verdict.token_ids == reference[:5]
    assert verdict.next_draft_length <= 4 and report.round.draft_lengths == {edge: verdict.next_draft_length}
    assert report.drafted == 18  # local drafts of 6 each, beyond C, in the same forward
    assert verdict.acceptance == engine.estimator.get(edge).acceptance
    for req in serving._active.values():
        assert serving.allotments.allotted(req.session_id) == 6
        assert req.acceptance == serving.allotments.estimator.get(req.session_id).acceptance


@pytest.mark.parametrize("policy", LOCAL_POLICIES)
def test_the_warm_up_drafts_what_the_policy_drafts_and_changes_nothing(models, policy):
    """LocalServing.warm_up: with fixed-shape draft forwards, the draft model drafts the policy's
    chains or trees for synthetic requests (LocalPolicy.drafting; nothing for plain decoding); no
    request, statistic, clock charge or forward count changes, and the outputs stay the target's
    own. Without fixed shapes it does nothing; once requests are in it is refused."""
    target, draft = models
    serving = serve(target, draft, policy, k=3, extra=1)
    assert serving.warm_up() == 0
    serving.draft.graphs = StepGraphs(serving.draft.model, serving.draft.cache, capture=False)
    now = serving.clock.now()
    kind = {"none": None, "adaserve": "tree"}.get(policy, "chain")
    assert serving.warm_up() == sum(what == kind for _, what in BatchDraftModel.WARM_UP_PLAN)
    assert (serving.draft.graphs.steps > 0) == (kind is not None)
    assert serving.draft.forwards == 0 and serving.clock.now() == now and serving.totals["steps"] == 0
    assert serving.draft.slots.keys == [] and serving.engine.session_ids == []
    serving.submit(PROMPTS[1], max_new_tokens=12)
    with pytest.raises(RuntimeError, match="before it takes requests"):
        serving.warm_up()
    drain(serving)
    assert serving.finished[0].generated == greedy_reference(target, PROMPTS[1], 12)


@needs_cpp
@pytest.mark.slow  # compiles the engine's and the draft's graphs (about a minute cold here)
@pytest.mark.parametrize("policy", ["adaserve", "chain"])
def test_after_the_warm_ups_compiled_local_serving_compiles_nothing_more(models, policy, fresh_dynamo):
    """EngineConfig.torch_compile: after the engine's warm-up steps and local serving's, requests
    with prompts of 1 to 29 tokens, batches of 1 to 6, trees of up to 24 nodes (or chains) and
    requests leaving compile no graph more; the outputs are the target's own."""
    from torch._dynamo.utils import counters

    target, draft = models
    engine = VerificationEngine(target, EngineConfig(seed=3, torch_compile=True))
    serving = LocalServing(engine, draft, LocalConfig(policy=policy, k=3, max_requests=6, budget=24),
                           SimulatedClock(TARGET_COST, DRAFT_COST))
    assert engine.warm_up_steps() > 0 and serving.warm_up() > 0
    before = counters["stats"]["unique_graphs"]
    prompts = PROMPTS + [list(range(1, 30)), [5] * 17, [7]]
    ids = [serving.submit(p, max_new_tokens=6 + 2 * i) for i, p in enumerate(prompts)]
    drain(serving)
    assert counters["stats"]["unique_graphs"] == before
    by_id = {r.request_id: r for r in serving.finished}
    for i, (rid, prompt) in enumerate(zip(ids, prompts)):
        assert by_id[rid].generated == greedy_reference(target, prompt, 6 + 2 * i), rid


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy", LOCAL_POLICIES)
def test_cuda_greedy_outputs_equal_the_targets_own(models, policy):
    """Both models on the GPU (drafting's batched step, catch-up and tree masks on the device):
    every policy's greedy output is still the target's own, decoded on the host."""
    import copy

    target, draft = models
    serving = serve(copy.deepcopy(target).cuda(), copy.deepcopy(draft).cuda(), policy, prefill_chunk=2, max_requests=4,
                    budget=12, k=3, extra=2)
    slos = [None, 5.0, 50.0, None, 1.0, 20.0]
    ids = [serving.submit(p, max_new_tokens=10 + i, tpot_slo_ms=slo) for i, (p, slo) in enumerate(zip(PROMPTS, slos))]
    drain(serving)
    by_id = {r.request_id: r for r in serving.finished}
    for i, (rid, prompt) in enumerate(zip(ids, PROMPTS)):
        assert by_id[rid].generated == greedy_reference(target, prompt, 10 + i), rid
    if policy != "none":
        assert serving.stats()["accepted"] > 0
