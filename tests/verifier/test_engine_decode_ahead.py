"""Decoding ahead (``Draft.decode_ahead``): a drafter whose drafts do not pay sends one empty draft
and the engine queues the next rounds itself. Each such round is an empty round as any other:
greedy output token for token the target's, a seeded sampled request's output bit for bit what
one empty draft a round gives, the first two sampled tokens in the target's distribution
(chi-square, with a power check); the run stops where the request ends, or with
``decode_ahead_until_match = n`` after the round whose text ends in ``n`` tokens seen before in it
(against a brute-force scan), each verdict counting the rounds left; and a finish or a resync
drops the round it queued."""

import numpy as np
import pytest

from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.proto import MAX_DECODE_AHEAD, MAX_UNTIL_MATCH
from goodspeed.verifier import errors
from goodspeed.verifier.engine import EngineConfig, VerificationEngine, repeats_its_tail
from goodspeed.verifier.types import Draft
from modelkit import greedy_reference, tiny_llama
from statkit import count_first_two, exact_first_two, fits

PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0)


def engine_of(target, **config):
    return VerificationEngine(target, EngineConfig(**({"budget": 8, "max_draft_len": 4, "seed": 3} | config)))


def test_one_empty_draft_decodes_the_rounds_it_asks_for_and_the_text_is_the_targets(target):
    engine = engine_of(target)
    sid = engine.join("d")
    engine.start_request(sid, PROMPT, SamplingParams(), 12)
    first = engine.next_round(sid)
    engine.submit(sid, Draft(first, [], decode_ahead=4))
    results = [engine.run_round() for _ in range(5)]  # no submit between them
    assert [r.ahead for r in results] == [(sid,)] * 4 + [()]
    assert [r.verdicts[sid].round_index for r in results] == list(range(first, first + 5))
    assert all(r.verdicts[sid].num_drafted == 0 and len(r.verdicts[sid].token_ids) == 1 for r in results)
    assert engine.next_round(sid) == first + 5
    assert engine.run_round().verdicts == {}  # the run is over: the engine waits for the drafter again
    engine.submit(sid, Draft(engine.next_round(sid), [], decode_ahead=MAX_DECODE_AHEAD))  # more than the request has left
    rest = []
    while not rest or not rest[-1].finished:
        rest.append(engine.run_round().verdicts[sid])
    assert rest[-1].finish_reason == "length" and len(rest) == 12 - 5
    tokens = [t for r in results for t in r.verdicts[sid].token_ids] + [t for v in rest for t in v.token_ids]
    assert tokens == greedy_reference(target, PROMPT, 12)
    assert engine.cache.num_slots == 0 and engine.run_round().ahead == ()


def test_a_seeded_sampled_request_decoded_ahead_is_the_one_drafted_empty_every_round(target):
    """The rounds the engine queues draw the request's uniforms exactly as the drafter's empty
    drafts would: the same seed gives the same text, token for token (and another seed another
    text: the comparison can fail)."""
    sampling = SamplingParams(temperature=1.0)
    texts = []
    for ahead, seed in ((0, 11), (7, 11), (7, 12)):
        engine = engine_of(target)
        sid = engine.join("d")
        engine.start_request(sid, PROMPT, sampling, 16, seed=seed)
        out = []
        while engine.has_request(sid):
            engine.submit(sid, Draft(engine.next_round(sid), [], decode_ahead=ahead))
            for _ in range(ahead + 1):
                verdict = engine.run_round().verdicts[sid]
                out += verdict.token_ids
                if verdict.finished:
                    break
        texts.append(out)
    assert len(texts[0]) == 16 and texts[0] == texts[1] != texts[2]


def test_sampled_tokens_decoded_ahead_follow_the_target():
    """Chi-square on the first two tokens, both from one empty draft and the round queued after
    it; the power check: the same counts are refused against the target at another temperature."""
    vocab = 6
    target = tiny_llama(4, vocab=vocab, init=0.08)
    sampling = SamplingParams(temperature=1.0)
    engine = engine_of(target, budget=4, max_drafters=8)
    outputs = []
    sessions = [engine.join(f"d{i}") for i in range(8)]
    while len(outputs) < 4000:
        for sid in sessions:
            engine.start_request(sid, PROMPT, sampling, 2)
            engine.submit(sid, Draft(engine.next_round(sid), [], decode_ahead=1))
        got = {sid: [] for sid in sessions}
        for _ in range(2):
            for sid, verdict in engine.run_round().verdicts.items():
                got[sid] += verdict.token_ids
        outputs += got.values()
    counts = count_first_two(outputs, vocab)
    ok, msg = fits(counts, exact_first_two(target, PROMPT, sampling))
    assert ok, msg
    wrong, _ = fits(counts, exact_first_two(target, PROMPT, SamplingParams(temperature=0.7)))
    assert not wrong, "the counts cannot tell the target at T = 1 from T = 0.7"


def test_a_finish_or_a_resync_drops_the_round_queued_ahead(target):
    engine = engine_of(target)
    sid = engine.join("d")
    engine.start_request(sid, PROMPT, SamplingParams(), 20)
    engine.submit(sid, Draft(engine.next_round(sid), [], decode_ahead=9))
    assert engine.run_round().ahead == (sid,)
    committed, round_index, _ = engine.resync(sid)
    assert engine.run_round().verdicts == {} and round_index == engine.next_round(sid)
    engine.submit(sid, Draft(round_index, [], decode_ahead=9))  # the drafter's own draft for the round is taken
    assert engine.run_round().ahead == (sid,)
    engine.finish_request(sid)
    result = engine.run_round()
    assert result.verdicts == {} and result.ahead == () and engine.cache.num_slots == 0


@pytest.mark.parametrize("tokens,ahead", [([5], 2), ([], MAX_DECODE_AHEAD + 1), ([], -1)],
                         ids=["with-tokens", "too-far", "negative"])
def test_decode_ahead_goes_with_an_empty_draft_and_a_bound(target, tokens, ahead):
    engine = engine_of(target)
    sid = engine.join("d")
    engine.start_request(sid, PROMPT, SamplingParams(), 20)
    with pytest.raises(errors.MalformedDraftError, match="decode_ahead"):
        engine.submit(sid, Draft(engine.next_round(sid), tokens, decode_ahead=ahead))
    engine.submit(sid, Draft(engine.next_round(sid), [5]))  # nothing was queued: a good draft is taken
    assert engine.run_round().verdicts[sid].num_drafted == 1


def brute_repeats(tokens, n):
    return 0 < n < len(tokens) and any(tokens[i : i + n] == tokens[-n:] for i in range(len(tokens) - n))


def test_repeats_its_tail_is_a_brute_force_scan():
    rng = np.random.default_rng(0)
    for _ in range(400):
        tokens = [int(t) for t in rng.integers(0, 4, size=int(rng.integers(0, 14)))]
        for n in range(0, 6):
            assert repeats_its_tail(tokens, n) == brute_repeats(tokens, n), (tokens, n)


@pytest.mark.parametrize("until", [1, 2, 3])
def test_decoding_ahead_until_a_match_stops_after_the_round_whose_text_repeats_its_tail(target, until):
    """The engine decodes ahead while the text does not end in ``until`` tokens seen before in it
    (with a successor there), and stops after the first round whose text does; every verdict
    counts the rounds still queued. The greedy text is the target's either way."""
    window = 40
    engine = engine_of(target)
    sid = engine.join("d")
    engine.start_request(sid, PROMPT, SamplingParams(), 2 * window + 1)  # room for a whole window after the stop
    reference = greedy_reference(target, PROMPT, window)
    stop = next((k for k in range(1, window) if brute_repeats(PROMPT + reference[:k], until)), window)  # its tokens
    assert stop < window, "the target's text must repeat within the window for this test to see a stop"
    first = engine.next_round(sid)
    engine.submit(sid, Draft(first, [], decode_ahead=window, decode_ahead_until_match=until))
    verdicts = [engine.run_round().verdicts[sid] for _ in range(stop)]
    assert [v.decode_ahead_left for v in verdicts] == list(range(window, window - stop + 1, -1)) + [0]
    assert [t for v in verdicts for t in v.token_ids] == reference[:stop]
    assert engine.run_round().verdicts == {} and engine.next_round(sid) == first + stop  # the drafter's turn
    engine.submit(sid, Draft(first + stop, [], decode_ahead=window))  # no match asked for: the whole window
    left = [engine.run_round().verdicts[sid].decode_ahead_left for _ in range(window + 1)]
    assert left == list(range(window, -1, -1))


def test_decoding_ahead_until_a_match_that_never_comes_decodes_every_round(target):
    """A match longer than the text (negative control for the stop): all the rounds asked for."""
    engine = engine_of(target)
    sid = engine.join("d")
    engine.start_request(sid, PROMPT, SamplingParams(), 30)
    engine.submit(sid, Draft(engine.next_round(sid), [], decode_ahead=10, decode_ahead_until_match=MAX_UNTIL_MATCH))
    assert [engine.run_round().verdicts[sid].decode_ahead_left for _ in range(11)] == list(range(10, -1, -1))


@pytest.mark.parametrize("ahead,until", [(0, 2), (4, MAX_UNTIL_MATCH + 1), (4, -1)], ids=["alone", "too-long", "negative"])
def test_until_match_goes_with_decode_ahead_and_a_bound(target, ahead, until):
    engine = engine_of(target)
    sid = engine.join("d")
    engine.start_request(sid, PROMPT, SamplingParams(), 20)
    with pytest.raises(errors.MalformedDraftError, match="decode_ahead_until_match"):
        engine.submit(sid, Draft(engine.next_round(sid), [], decode_ahead=ahead, decode_ahead_until_match=until))


def test_a_retried_draft_that_asked_to_decode_ahead_hears_the_rounds_left(target):
    """An idempotent retry of the draft returns its verdict as sent, rounds left included."""
    engine = engine_of(target)
    sid = engine.join("d")
    engine.start_request(sid, PROMPT, SamplingParams(), 20)
    draft = Draft(engine.next_round(sid), [], decode_ahead=5, decode_ahead_until_match=MAX_UNTIL_MATCH)
    engine.submit(sid, draft)
    assert engine.run_round().verdicts[sid].decode_ahead_left == 5
    assert engine.submit(sid, draft).decode_ahead_left == 5
