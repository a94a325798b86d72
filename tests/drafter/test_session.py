"""The drafter's side of the round protocol without a transport (goodspeed.drafter.session): what
a verdict must match, how a lost session restarts and a drift resynchronises. The drivers that
use it (client, edge node, in-process) are checked end to end in their own tests."""

from types import SimpleNamespace

import pytest

from goodspeed.drafter.session import DrafterError, DraftSession, VerdictAhead, answers
from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.lm.runtime.prefix import prefix_hash
from goodspeed.proto.goodspeed.v1 import goodspeed_pb2 as pb
from goodspeed.serving.generation import GenerationRequest
from goodspeed.serving.sampling_wire import request_from_pb, request_to_pb

PROMPT = [5, 6, 7]


def request(**kw) -> GenerationRequest:
    return GenerationRequest("r", list(PROMPT), kw.pop("max_tokens", 10), kw.pop("sampling", SamplingParams()), (2,), **kw)


def verdict(committed, tokens, round_index=0, finished=False, **kw):
    """A verdict as the verifier would send it after ``committed`` grew by ``tokens``."""
    text = committed + tokens
    fields = dict(round_index=round_index, token_ids=tokens, num_drafted=3, num_accepted=len(tokens) - 1, num_transit=0,
                  committed_length=len(text), prefix_hash=prefix_hash(text), next_draft_length=4, finished=finished)
    return SimpleNamespace(**(fields | kw))


def test_a_verdict_commits_its_tokens_and_sets_the_next_round():
    s = DraftSession(request())
    s.started(3, 7)
    assert s.apply(verdict(PROMPT, [1, 2, 3], round_index=7))
    assert s.output == [1, 2, 3] and s.committed == PROMPT + [1, 2, 3] and s.prefix_hash == prefix_hash(PROMPT + [1, 2, 3])
    assert (s.length, s.round_index, s.in_progress) == (4, 8, True)
    assert (s.stats.rounds, s.stats.drafted_tokens, s.stats.accepted_tokens) == (1, 3, 2)
    assert s.apply(verdict(PROMPT + [1, 2, 3], [4], round_index=8, finished=True)) and not s.in_progress


def test_a_verdict_that_does_not_match_the_drafters_text_is_reported():
    """Negative controls: a token the verifier did not commit, or a length that differs."""
    s = DraftSession(request())
    other = verdict(PROMPT, [1, 2, 9])
    other.token_ids = [1, 2, 3]  # the drafter's copy differs from what the verifier hashed
    assert not s.apply(other)
    s = DraftSession(request())
    assert not s.apply(verdict(PROMPT, [1, 2], committed_length=len(PROMPT) + 3))


def test_answers_skips_an_earlier_rounds_verdict_and_raises_on_a_later_one():
    assert answers(SimpleNamespace(round_index=4), 4)
    assert not answers(SimpleNamespace(round_index=3), 4)
    with pytest.raises(VerdictAhead):
        answers(SimpleNamespace(round_index=5), 4)


def test_a_lost_session_restarts_from_the_committed_text():
    s = DraftSession(request(max_tokens=10, prompt_logprobs=2, logprobs=1, seed=9))
    assert s.start_request().prompt_logprobs == 2
    s.started(3, 0)
    s.apply(verdict(PROMPT, [1, 2, 3]))
    s.prompt_scored = True
    s.lost()
    again = s.start_request()
    assert again.prompt_ids == PROMPT + [1, 2, 3] and again.generated == 3 and again.max_tokens == 7
    assert again.prompt_logprobs is None and (again.logprobs, again.seed) == (1, 9)  # scores are not asked twice
    assert s.stats.repairs == 1 and not s.in_progress


def test_a_resumed_request_counts_its_earlier_output():
    s = DraftSession(request(max_tokens=6, generated=1))  # PROMPT's last token is output already
    assert s.generated == 1 and s.output == [7]
    s.apply(verdict(PROMPT, [1, 2]))
    assert s.start_request().generated == 3 and s.start_request().max_tokens == 4


def test_resync_takes_the_verifiers_text_and_refuses_another_prompt():
    s = DraftSession(request())
    s.apply(verdict(PROMPT, [1, 2, 3]))
    s.resync(PROMPT + [1, 2, 4], 2, 5)
    assert s.output == [1, 2, 4] and s.prefix_hash == prefix_hash(PROMPT + [1, 2, 4]) and (s.length, s.round_index) == (2, 5)
    with pytest.raises(DrafterError, match="does not start with this request's prompt"):
        s.resync([5, 6, 8, 1], 2, 6)


def test_penalties_history_follows_the_committed_text():
    s = DraftSession(request(sampling=SamplingParams(repetition_penalty=1.3)))
    s.apply(verdict(PROMPT, [1, 1]))
    assert s.history is not None and s.history.prompt.tolist() == PROMPT and s.history.output == [1, 1]
    assert s.history.counts[1] == 2 and DraftSession(request()).history is None


def test_a_request_survives_the_wire():
    sent = request(prompt_logprobs=3, seed=4, generated=1)
    msg = request_to_pb("sid", sent)
    assert isinstance(msg, pb.StartRequestRequest) and msg.session_id == "sid"
    back = request_from_pb(msg, sent.sampling)
    assert back == GenerationRequest("sid", sent.prompt_ids, 10, sent.sampling, (2,), seed=4, prompt_logprobs=3, generated=1)
    assert request_from_pb(request_to_pb("sid", request()), SamplingParams()).seed is None  # unset stays unset
