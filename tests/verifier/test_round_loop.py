"""The round loop's two modes over real gRPC: in async mode no drafter waits for a slow link."""

import asyncio
import threading
import time

import grpc
import pytest

from goodspeed.drafter.client import DrafterClient, DrafterConfig
from goodspeed.drafter.runner import DraftRunner
from goodspeed.launch.cluster.links import DelayProxy, LinkSpec
from goodspeed.proto.goodspeed.v1 import goodspeed_pb2 as pb
from goodspeed.proto.goodspeed.v1 import goodspeed_pb2_grpc as pb_grpc
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from goodspeed.verifier.records import CLOSE_REASONS, RoundRecord
from goodspeed.verifier.edge_drafters import Drafter, DrafterRegistry
from goodspeed.verifier.round_loop import RoundLoop
from goodspeed.verifier.server import ServerConfig
from grpckit import ServerThread
from modelkit import greedy_reference, perturbed, tiny_llama

SLOW_PROMPT, FAST_PROMPTS = [4, 4, 4, 4, 5], [[1, 2, 3], [9, 8]]


def registry_of(*drafters: Drafter) -> DrafterRegistry:
    """A registry holding ``drafters``, for a round loop whose timing alone a test drives."""
    registry = DrafterRegistry(None, None, None, None, None, None)
    registry.by_session.update({d.session_id: d for d in drafters})
    return registry


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(0)
    return target, perturbed(target, 0.05, 1)


def generate(address, name, draft, prompts, max_new, outputs, started=None):
    client = DrafterClient(DrafterConfig(address, name, max_new_tokens=max_new), DraftRunner(draft))
    client.wait_until_serving()
    client.join()
    if started is not None:
        started.set()
    outputs[name] = [client.generate(str(k), p).token_ids for k, p in enumerate(prompts)]
    client.close()


def race(models, rounds, transit_tokens=0):
    """A drafter behind a 150 ms link and one on loopback, in one verifier: each one's steps while
    both are generating, and their outputs."""
    target, draft = models
    engine = VerificationEngine(target, EngineConfig(budget=8, max_draft_len=4, transit_tokens=transit_tokens))
    outputs = {}
    with ServerThread(engine, rounds=rounds, round_deadline_ms=1000) as server:
        proxy = DelayProxy("127.0.0.1", ("127.0.0.1", server.port), LinkSpec(rtt_ms=150))
        port = proxy.start()
        try:
            joined = threading.Event()
            slow = threading.Thread(target=generate, args=(f"127.0.0.1:{port}", "slow", draft, [SLOW_PROMPT], 90, outputs, joined))
            slow.start()
            assert joined.wait(60)
            # The loop knows which drafters the steps decode for (the step's wait counts their tokens).
            assert [d.transit for d in server.server.service.drafters.by_session.values()] == [bool(transit_tokens)]
            measured = threading.Event()  # the slow drafter's cycle was measured once: its next draft can be due
            for _ in range(3000):  # bounded: its second draft comes one 150 ms round trip after its first
                if any(d["name"] == "slow" and d["cycle_s"] is not None for e in server.events("round") for d in e["drafters"]):
                    break
                measured.wait(0.01)
            generate(server.address, "fast", draft, FAST_PROMPTS, 30, outputs)
            slow.join(120)
        finally:
            proxy.stop()
        records = [RoundRecord.from_event(e) for e in server.events("round")]
    assert outputs["slow"] == [greedy_reference(target, SLOW_PROMPT, 90)]
    assert outputs["fast"] == [greedy_reference(target, p, 30) for p in FAST_PROMPTS]
    return records


def steps_while_both_run(records) -> list[tuple[str, str]]:
    """The steps from the fast drafter's first to its last, each as who it verified ("both",
    "fast" or "slow") and why it closed; steps verifying neither (transit-only ones) left out."""
    fast = [r.round for r in records if any(d.name == "fast" for d in r.drafters)]
    out = []
    for r in records:
        names = {d.name for d in r.drafters}
        if fast[0] <= r.round <= fast[-1] and names:
            out.append(("both" if names == {"fast", "slow"} else names.pop(), r.closed))
    return out


def longest_run(steps: list[tuple[str, str]], who: str) -> int:
    best = run = 0
    for name, _ in steps:
        run = run + 1 if name == who else 0
        best = max(best, run)
    return best


def test_async_rounds_let_the_fast_drafter_run_ahead_of_a_slow_link(models):
    """Events, not timings: while the slow drafter's draft crosses its 150 ms link, the fast one is
    verified in steps of its own, several in a row."""
    records = race(models, "async")
    steps = steps_while_both_run(records)
    assert any(name != "fast" for name, _ in steps), steps
    assert longest_run(steps, "fast") >= 2, steps
    assert {r.mode for r in records} == {"async"}
    # The budget bounds every step: outstanding allotments never pass C.
    assert all(sum(d.drafted for d in r.drafters) <= r.budget for r in records)
    # A drafter's cycle (verdict sent -> next draft arrived) shows its link: the slow one's spans the RTT.
    slow_cycles = [d.cycle_s for r in records for d in r.drafters if d.name == "slow" and d.cycle_s is not None]
    fast_cycles = [d.cycle_s for r in records for d in r.drafters if d.name == "fast" and d.cycle_s is not None]
    assert slow_cycles and min(slow_cycles) >= 0.15 and fast_cycles and min(fast_cycles) < min(slow_cycles)
    # Once the slow drafter's cycle is known, the fast one's steps stop sitting out windows for a
    # draft still on the wire: some close because no draft is due.
    closed = [r.closed for r in records]
    assert set(closed) <= set(CLOSE_REASONS) and "none-due" in closed, closed


def test_transit_decoding_grows_the_slow_links_text_in_the_fast_drafters_steps(models):
    """With transit decoding, the steps the fast drafter's drafts open also decode the slow one's
    next tokens while its draft is on the wire (outputs stay the target's: ``race`` checks)."""
    records = race(models, "async", transit_tokens=4)
    slow_rows = [d for r in records for d in r.drafters if d.name == "slow"]
    assert all(d.transit <= 4 for r in records for d in r.drafters)
    assert sum(d.transit for d in slow_rows) > 0
    # Tokens decoded in transit reach the drafter in its verdicts, and nothing is delivered twice:
    # its verdicts add up to its whole output.
    assert sum(d.gained for d in slow_rows) == 90
    assert sum(r.transit_tokens for r in records) >= sum(d.transit for d in slow_rows)
    assert longest_run(steps_while_both_run(records), "fast") >= 2


def lone_slow_drafter(models, transit_alone):
    """One drafter behind a 150 ms link, alone on a verifier that decodes up to 4 tokens in transit:
    the round records and its output (checked to be the target's greedy decoding)."""
    target, draft = models
    engine = VerificationEngine(target, EngineConfig(budget=8, max_draft_len=4, transit_tokens=4))
    outputs = {}
    with ServerThread(engine, rounds="async", round_deadline_ms=1000, transit_alone=transit_alone) as server:
        proxy = DelayProxy("127.0.0.1", ("127.0.0.1", server.port), LinkSpec(rtt_ms=150))
        port = proxy.start()
        try:
            generate(f"127.0.0.1:{port}", "slow", draft, [SLOW_PROMPT], 40, outputs)
        finally:
            proxy.stop()
        records = [RoundRecord.from_event(e) for e in server.events("round")]
    assert outputs["slow"] == [greedy_reference(target, SLOW_PROMPT, 40)]
    return records


def test_steps_for_transit_rows_alone_decode_while_the_only_draft_is_on_the_wire(models):
    """With ``transit_alone``, a drafter alone behind a slow link gets tokens decoded while its draft
    is away, in steps that verify nothing (``closed = "transit"``); the cap bounds them: at most 4
    such tokens a verdict, so at most 4 such steps between two of its verdicts."""
    records = lone_slow_drafter(models, transit_alone=True)
    transit_steps = [r for r in records if r.closed == "transit"]
    assert transit_steps and all(not r.drafters and r.transit_tokens == 1 for r in transit_steps)
    rows = [d for r in records for d in r.drafters]
    assert sum(d.transit for d in rows) > 0 and all(d.transit <= 4 for d in rows)
    assert sum(d.gained for d in rows) == 40  # nothing lost or delivered twice
    alone = 0
    for r in records:  # never more transit-only steps between two verdicts than the cap
        alone = 0 if r.drafters else alone + (r.closed == "transit")
        assert alone <= 4


def test_without_transit_alone_no_step_runs_for_transit_rows(models):
    """The control: with the setting off, a lone drafter's text grows only in its own steps."""
    records = lone_slow_drafter(models, transit_alone=False)
    assert records and all(r.closed != "transit" and r.drafters for r in records)
    assert sum(d.transit for r in records for d in r.drafters) == 0


def test_sync_rounds_pace_everyone_by_the_slowest_link(models):
    """The control: the paper's lockstep round makes the fast drafter wait for the slow one, which
    is mid-request all along: a round with the fast drafter alone closes only when its deadline
    passes, never because everyone submitted."""
    records = race(models, "sync")
    steps = steps_while_both_run(records)
    assert any(name == "both" for name, _ in steps), steps
    assert all(closed != "all" for name, closed in steps if name == "fast"), steps
    assert {r.mode for r in records} == {"sync"}
    assert {r.closed for r in records} <= {"all", "window"}  # sync waits for everyone, or its deadline


def test_async_never_waits_for_a_frozen_drafter(models):
    """A drafter that stops sending mid-request is never waited for (no missed-round deadline to
    sit out); the idle timeout evicts it, whether or not the live drafter has finished by then."""
    target, draft = models
    engine = VerificationEngine(target, EngineConfig(budget=8, max_draft_len=4))
    with ServerThread(engine, rounds="async", round_deadline_ms=5000, idle_timeout_s=3.0) as server:
        channel = grpc.insecure_channel(server.address)
        stub = pb_grpc.VerifierStub(channel)
        frozen = stub.Join(pb.JoinRequest(protocol_version=1, drafter_name="frozen")).session_id
        verdicts = stub.StreamVerdicts(pb.StreamVerdictsRequest(session_id=frozen))  # listening, so not a squatter
        stub.StartRequest(pb.StartRequestRequest(session_id=frozen, prompt_ids=[3, 4], max_new_tokens=20,
                                                 sampling=pb.SamplingParams(temperature=0.0)))
        outputs = {}
        generate(server.address, "live", draft, FAST_PROMPTS, 30, outputs)
        live_done = len(server.events())
        deadline = threading.Event()
        for _ in range(200):  # bounded: the idle sweep runs every second
            if any(e.get("session") == frozen for e in server.events("drop")):
                break
            deadline.wait(0.05)
        events = server.events()
        verdicts.cancel()
        channel.close()
    assert outputs["live"] == [greedy_reference(target, p, 30) for p in FAST_PROMPTS]
    drops = [i for i, e in enumerate(events) if e["event"] == "drop" and e["session"] == frozen]
    assert drops and events[drops[0]]["reason"].startswith("idle"), events
    # No live step sat out the 5 s round deadline for the frozen drafter (a step waits at most its
    # window, a step's time: RoundLoop._wait_until, unit-tested below). Told by the order of events:
    # the idle sweep runs between steps, so a loop that waited the deadline (longer than the 3 s
    # idle timeout) would verify one live round and then drop the frozen drafter; this one verifies
    # the live drafter's rounds while the frozen one is still joined.
    live_rounds = [RoundRecord.from_event(e) for e in events[: min(drops[0], live_done)] if e["event"] == "round"]
    assert sum(any(d.name == "live" for d in r.drafters) for r in live_rounds) >= 3


def test_a_step_waits_for_a_due_draft_only_while_that_pays():
    """Async: a step that opened with drafts queued waits for drafter j's draft, due at its last
    verdict plus its smoothed cycle, only until ``opened + step * w_j / (W_Q + w_j)`` (weights one
    over each drafter's period, verdict to verdict): a drafter with no measured cycle, or one
    already late, may come any moment."""
    def drafter(name, verdict_at=None, cycle=None, in_request=True, deviation=0.0, period="cycle"):
        d = Drafter(name, name, asyncio.Queue(), identity=None, in_request=in_request, verdict_at=verdict_at)
        d.cycle_mean_s, d.cycle_dev_s = cycle, deviation
        d.period_mean_s = cycle if period == "cycle" else period  # here the period is the cycle unless said
        return d

    def loop_with(*drafters, queued=("fast",), step_s=0.1):
        fast = drafter("fast", verdict_at=0.0, cycle=0.02)  # queued: weight 50
        loop = RoundLoop(None, None, ServerConfig(rounds="async"), None, None, registry_of(fast, *drafters), None)
        loop._queued.update(queued)
        loop._step_s = step_s
        return loop

    opened = 1000.0
    # A slow drafter (cycle 0.1 s, weight 10) next to the queued fast one (weight 50) is worth
    # 10 / 60 of a 0.1 s step: its draft due 10 ms after the step opened is waited for, one due
    # in 30 ms is not.
    soon = drafter("slow", verdict_at=opened + 0.01 - 0.1, cycle=0.1)
    assert loop_with(soon)._wait_until(opened, opened) == pytest.approx(opened + 0.1 / 6)
    later = drafter("slow", verdict_at=opened + 0.03 - 0.1, cycle=0.1)
    assert loop_with(later)._wait_until(opened, opened) is None
    assert loop_with(later)._close_reason(opened, opened) == "none-due"
    # ... where the old rule (wait up to a whole step for any draft due within it) would have waited.
    # Equal cycles: a late draft is worth 1 / (|Q| + 1) of a step.
    twin = drafter("twin", verdict_at=opened + 0.02 - 0.02, cycle=0.02)
    assert loop_with(twin)._wait_until(opened, opened) == pytest.approx(opened + 0.05)
    third = drafter("third", verdict_at=opened - 0.02, cycle=0.02)
    assert loop_with(twin, third, queued=("fast", "third"))._wait_until(opened, opened) == pytest.approx(opened + 0.1 / 3)
    # No cycle yet (a request's first draft), or overdue: may come any moment, waited for at the
    # others' mean weight; past its limit, no longer.
    new = drafter("new")
    assert loop_with(new)._wait_until(opened, opened) == pytest.approx(opened + 0.05)
    assert loop_with(new)._wait_until(opened, opened + 0.06) is None
    overdue = drafter("late", verdict_at=opened - 5.0, cycle=0.1)
    assert loop_with(overdue)._wait_until(opened, opened) == pytest.approx(opened + 0.1 / 6)
    # Cycles that vary make a drafter due early: 0.1 s on average (30 ms in, past its limit), +-10 ms.
    erratic = drafter("erratic", verdict_at=opened - 0.07, cycle=0.1, deviation=0.01)
    assert loop_with(erratic)._wait_until(opened, opened) == pytest.approx(opened + 0.1 / 6)
    steady = drafter("steady", verdict_at=opened - 0.07, cycle=0.1)
    assert loop_with(steady)._wait_until(opened, opened) is None
    # The weight is one over the period (link, drafting, waiting and verification), not over the
    # cycle: a drafter whose draft takes 0.1 s but whose verdicts come every 0.2 s weighs 5, so
    # it is waited for 0.1 * 5 / 55 of a step. Before its second verdict its period is taken as
    # its cycle plus a step, the least it can be: the same here.
    assert loop_with(drafter("slow", verdict_at=opened - 0.1, cycle=0.1, period=0.2))._wait_until(opened, opened) == pytest.approx(opened + 0.1 / 11)
    assert loop_with(drafter("slow", verdict_at=opened - 0.1, cycle=0.1, period=None))._wait_until(opened, opened) == pytest.approx(opened + 0.1 / 11)
    # Drafters with no request in progress are not waited for; no step waits past its window.
    assert loop_with(drafter("idle", in_request=False))._close_reason(opened, opened) == "all"
    assert loop_with(soon)._close_reason(opened, opened + 0.1) == "window"
    assert loop_with(soon)._close_reason(opened, opened) is None


def test_with_transit_decoding_an_idle_engine_costs_the_drafters_whose_drafts_are_away():
    """Transit decoding: every step decodes a token for each drafter whose draft is away, worth
    1 / T of its round (T the smoothed tokens its verdicts carry). So the wait for drafter j is bounded by
    ``(f * w_j - v_j) / (W_Q + (V - v_j) / f + w_j)``: less by j's own token, which a step closed
    now decodes for it, and by the tokens the others away lose while the engine waits. A drafter
    that did not opt in, or a loop without transit decoding, waits as before."""
    def drafter(name, verdict_at, cycle, transit=True, x=None, queued=False):
        d = Drafter(name, name, asyncio.Queue(), identity=None, in_request=True, verdict_at=verdict_at, transit=transit)
        d.cycle_mean_s, d.period_mean_s, d.tokens_mean = cycle, cycle, x
        return d

    opened, step = 1000.0, 0.1
    fast = drafter("fast", 0.0, 0.02, transit=False)  # queued, weight 50

    def wait(*others):
        loop = RoundLoop(None, None, ServerConfig(rounds="async"), None, None, registry_of(fast, *others), None)
        loop._queued.add("fast")
        loop._step_s = step
        return loop._wait_until(opened, opened)

    # The slow drafter (cycle 0.1 s: weight 10), due at once. Without transit: 0.1 * 10 / 60.
    assert wait(drafter("slow", opened - 0.1, 0.1, transit=False)) == pytest.approx(opened + 1 / 60)
    # It opted in and gets T = 4 tokens a round: its token is worth 1/4, so (1 - 0.25) / 60.
    assert wait(drafter("slow", opened - 0.1, 0.1, x=4.0)) == pytest.approx(opened + 0.75 / 60)
    # A second drafter away (T = 2: 1/2 a token per step, 5 per second of waiting) adds to W.
    other = drafter("other", opened + 5.0, 1.0, x=2.0)  # not due for seconds: never waited for itself
    assert wait(drafter("slow", opened - 0.1, 0.1, x=4.0), other) == pytest.approx(opened + 0.75 / 65)
    # Before its first verdict (T unknown) a drafter's transit token is a whole round's worth:
    # 0.1 * 10 - 1 = 0, so nothing is worth waiting for.
    assert wait(drafter("slow", opened - 0.1, 0.1)) is None


def test_a_step_for_transit_rows_alone_runs_only_while_its_tokens_outweigh_the_delay():
    """``transit_alone``: with no draft queued, a step that only decodes for the drafters away is
    worth ``sum 1 / T_i`` over those the engine can still decode for, and costs each drafter ``j``
    not here ``w_j * max(0, f - d_j)``: the step holds the engine ``f``, and j's draft is due in
    ``d_j`` (0 when late or unmeasured). Times are given, not read from a clock."""
    now = 1000.0

    def drafter(name, due_in, period, transit=True, x=None):
        d = Drafter(name, name, asyncio.Queue(), identity=None, in_request=True, verdict_at=None if due_in is None else now,
                    transit=transit)
        d.cycle_mean_s, d.period_mean_s, d.tokens_mean = due_in, period, x
        return d

    def pays(*drafters, room=("slow",), queued=()):
        loop = RoundLoop(None, None, ServerConfig(rounds="async"), None, None, registry_of(*drafters), None)
        loop._step_s = 0.01
        loop._queued.update(queued)
        return loop._transit_step_worth(set(room), now)

    slow = drafter("slow", 0.0, 0.1, x=4.0)  # due now: a token worth 1/4 against 10 * 0.01 of delay
    assert pays(slow)
    assert not pays(slow, room=())  # the cap is reached: nothing to decode
    assert not pays(slow, queued=("slow",))  # a draft is here: a step verifies it instead
    # A fast drafter (weight 50) whose draft is due now would wait the whole step: 0.5 + 0.1 > 1/4.
    assert not pays(slow, drafter("fast", 0.0, 0.02, transit=False))
    # ... due in 5 ms, it waits half the step: 0.25 + 0.1 > 0.25 still; due in 20 ms, not at all.
    assert not pays(slow, drafter("fast", 0.005, 0.02, transit=False))
    assert pays(slow, drafter("fast", 0.02, 0.02, transit=False))
    # A draft 1 s late costs the whole step, as one due now does, no more: 1/1.5 > 0.1 + 1 * 0.01
    # (counting its lateness too would make it 1.01 and refuse the step).
    late = drafter("other", 0.0, 1.0, transit=False)
    late.verdict_at = now - 1.0
    assert pays(drafter("slow", 0.0, 0.1, x=1.5), late)
    # Unmeasured (no cycle yet) counts as due now.
    assert not pays(slow, drafter("fast", None, 0.02, transit=False))


def test_a_drafters_cycle_is_smoothed_from_the_drafts_it_sends():
    d = Drafter("d", "d", asyncio.Queue(), identity=None)
    loop = RoundLoop(None, None, ServerConfig(rounds="async"), None, None, registry_of(d), None)
    loop.queued("d", time.perf_counter())
    assert d.cycle_s is None and d.due_after_s is None  # a request's first draft has no cycle
    d.verdict_at = 100.0
    loop.queued("d", 100.5)
    assert d.cycle_mean_s == pytest.approx(0.5) and d.due_after_s == pytest.approx(0.5)
    d.verdict_at = 200.0
    loop.queued("d", 201.5)
    mean, dev = 0.8 * 0.5 + 0.2 * 1.5, 0.2 * 1.0
    assert d.cycle_s == pytest.approx(1.5) and (d.cycle_mean_s, d.cycle_dev_s) == pytest.approx((mean, dev))
    assert d.due_after_s == pytest.approx(mean - 2 * dev)


def test_a_drafters_period_and_tokens_are_smoothed_from_its_verdicts():
    """The weights of the async wait are one over the period between two verdicts of a request,
    and a transit token is worth one over the tokens a verdict carries: both smoothed."""
    d = Drafter("d", "d", asyncio.Queue(), identity=None)
    d.observe_verdict(10.0, 3)  # a request's first verdict: no period yet
    assert d.period_mean_s is None and d.tokens_mean == 3
    d.verdict_at = 10.0
    d.observe_verdict(10.5, 1)
    assert d.period_mean_s == pytest.approx(0.5) and d.tokens_mean == pytest.approx(0.8 * 3 + 0.2 * 1)
    d.verdict_at = 10.5
    d.observe_verdict(11.5, 1)
    assert d.period_mean_s == pytest.approx(0.8 * 0.5 + 0.2 * 1.0)


def test_transit_decoding_is_refused_in_sync_rounds_and_transit_steps_without_it(models):
    from goodspeed.launch.daemons.serve import server_config
    from goodspeed.launch.spec import SpecError, VerifierSpec
    from goodspeed.verifier.daemon import make_server

    engine = VerificationEngine(models[0], EngineConfig(transit_tokens=2))
    with pytest.raises(ValueError, match="needs asynchronous rounds"):
        make_server(engine, ServerConfig(rounds="sync"))
    make_server(engine, ServerConfig(rounds="async"))
    with pytest.raises(SpecError, match="needs asynchronous rounds"):
        server_config(VerifierSpec(transit_tokens=2))  # before any model loads
    server_config(VerifierSpec(transit_tokens=2, rounds="async"))
    # Steps for transit rows alone need transit decoding.
    with pytest.raises(ValueError, match="needs transit_tokens > 0"):
        make_server(VerificationEngine(models[0], EngineConfig()), ServerConfig(rounds="async", transit_alone=True))
    with pytest.raises(SpecError, match="needs transit_tokens > 0"):
        server_config(VerifierSpec(rounds="async", transit_alone=True))
    server_config(VerifierSpec(transit_tokens=2, rounds="async", transit_alone=True))


def test_unknown_round_mode_is_refused():
    with pytest.raises(ValueError, match="rounds must be one of"):
        ServerConfig(rounds="lockstep")


@pytest.mark.parametrize("rounds", ["sync", "async"])
def test_a_long_prompt_is_prefilled_in_chunks_while_the_others_keep_drafting(models, rounds):
    """Chunked prefill through the service: a 300-token prompt arrives while another drafter is
    generating. Its StartRequest returns once the steps have prefilled it; no step carries more
    than one chunk; the other drafter's rounds go on meanwhile (rounds carrying chunks verify its
    drafts); both outputs are the target's greedy decoding."""
    target, draft = models
    chunk, long_prompt = 16, [(7 * i) % 47 + 1 for i in range(300)]
    engine = VerificationEngine(target, EngineConfig(budget=8, max_draft_len=4, prefill_chunk=chunk))
    outputs = {}
    with ServerThread(engine, rounds=rounds, round_deadline_ms=1000) as server:
        joined = threading.Event()
        steady = threading.Thread(target=generate, args=(server.address, "steady", draft, [[1, 2, 3]], 200, outputs, joined))
        steady.start()
        assert joined.wait(60)
        generate(server.address, "long", draft, [long_prompt], 20, outputs)
        steady.join(120)
        records = [RoundRecord.from_event(e) for e in server.events("round")]
        prefill_only = server.events("prefill")
    assert outputs["long"] == [greedy_reference(target, long_prompt, 20)]
    assert outputs["steady"] == [greedy_reference(target, [1, 2, 3], 200)]
    assert all(r.prefill_tokens <= chunk for r in records) and all(e["tokens"] <= chunk for e in prefill_only)
    assert sum(r.prefill_tokens for r in records) + sum(e["tokens"] for e in prefill_only) == len(long_prompt) - 1 + 2  # + steady's
    steady_with_chunk = [r for r in records if r.prefill_tokens and any(d.name == "steady" for d in r.drafters)]
    assert steady_with_chunk, "no round verified the steady drafter next to a prompt chunk"
