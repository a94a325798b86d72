"""Every misuse raises its own exception, changes nothing, and other sessions keep working."""

import numpy as np
import pytest

from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.verifier import errors
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from goodspeed.verifier.types import Draft, SparseProbs
from modelkit import greedy_reference, tiny_llama

V = 48
SAMPLED = SamplingParams(temperature=1.0)


@pytest.fixture
def engine():
    eng = VerificationEngine(tiny_llama(0), EngineConfig(budget=8, policy="fixed", max_drafters=3, max_seq_len=64), tokenizer_fingerprint="abc")
    eng.good = eng.join("good")
    eng.start_request(eng.good, [1, 2, 3], SamplingParams(), 10)
    eng.bad = eng.join("bad")
    eng.start_request(eng.bad, [4, 5], SAMPLED, 10)
    assert eng.next_round(eng.bad) == 0
    eng.set_allotment(eng.good, 4)  # the first joiner held the whole budget; split it for the test
    eng.set_allotment(eng.bad, 4)
    return eng


def one_hot_rows(tokens):
    rows = np.zeros((len(tokens), V))
    rows[np.arange(len(tokens)), tokens] = 1.0
    return rows


def bad_drafts():
    dense_nan = one_hot_rows([1, 2]); dense_nan[0, 5] = np.nan
    dense_zero = one_hot_rows([1, 2]); dense_zero[1] = 0; dense_zero[1, 3] = 1.0
    dense_big = one_hot_rows([1, 2]) * 1.5
    dense_sum = one_hot_rows([1, 2]) * 0.5
    return [
        (Draft(0, [1, V]), errors.InvalidTokenError),
        (Draft(0, [1, -1]), errors.InvalidTokenError),
        (Draft(0, [1, 2], dense_probs=dense_nan), errors.InvalidProbabilityError),
        (Draft(0, [1, 2], dense_probs=dense_zero), errors.InvalidProbabilityError),
        (Draft(0, [1, 2], dense_probs=dense_big), errors.InvalidProbabilityError),
        (Draft(0, [1, 2], dense_probs=dense_sum), errors.InvalidProbabilityError),
        (Draft(0, [1], sparse_probs=[SparseProbs([1, 2], [0.0, 1.0])]), errors.InvalidProbabilityError),
        (Draft(0, [1], sparse_probs=[SparseProbs([2, 3], [0.5, 0.5])]), errors.InvalidProbabilityError),
        (Draft(0, [1], sparse_probs=[SparseProbs([1, 99], [0.5, 0.5])]), errors.InvalidTokenError),
        (Draft(0, [1], dense_probs=np.ones((1, 7))), errors.MalformedDraftError),
        (Draft(0, [1, 2]), errors.MalformedDraftError),  # sampled chain without q
        (Draft(0, list(range(5)), dense_probs=one_hot_rows(list(range(5)))), errors.DraftTooLongError),
        (Draft(1, [1], dense_probs=one_hot_rows([1])), errors.FutureRoundError),
        (Draft(0, [1, 2], parents=[-1, 1], dense_probs=one_hot_rows([1, 2])), errors.MalformedDraftError),
    ]


def test_draft_reaching_past_the_request_end_is_refused(engine):
    engine.leave(engine.bad)
    short = engine.join("short")
    engine.start_request(short, [1, 2], SamplingParams(), max_new_tokens=3)
    engine.set_allotment(short, 3)
    with pytest.raises(errors.DraftTooLongError, match="depth 3"):
        engine.submit(short, Draft(0, [4, 5, 6]))
    engine.submit(short, Draft(0, [4, 5, 6], parents=[-1, -1, 0]))  # 3 nodes, depth 2: fine
    with pytest.raises(errors.DraftTooLongError):
        engine.set_allotment(short, 9)


@pytest.mark.parametrize("draft,error", bad_drafts())
def test_bad_draft_raises_specific_error_and_others_keep_working(engine, draft, error):
    with pytest.raises(error):
        engine.submit(engine.bad, draft)
    engine.submit(engine.good, Draft(0, [7, 7]))
    result = engine.run_round()
    assert list(result.verdicts) == [engine.good]
    assert result.verdicts[engine.good].token_ids[-1] in range(V)
    # The rejected drafter can still submit a valid draft for the same round.
    engine.submit(engine.bad, Draft(0, [1], dense_probs=one_hot_rows([1])))
    assert engine.bad in engine.run_round().verdicts


def test_session_and_request_errors(engine):
    with pytest.raises(errors.UnknownSessionError):
        engine.submit("nobody", Draft(0, []))
    with pytest.raises(errors.RequestInProgressError):
        engine.start_request(engine.good, [1], SamplingParams(), 5)
    with pytest.raises(errors.TokenizerMismatchError):
        engine.join("x", tokenizer_fingerprint="zzz")
    third = engine.join("third", tokenizer_fingerprint="abc")
    with pytest.raises(errors.TooManyDraftersError):
        engine.join("fourth")
    with pytest.raises(errors.NoActiveRequestError):
        engine.submit(third, Draft(0, []))
    with pytest.raises(errors.PromptTooLongError):
        engine.start_request(third, [1] * 64, SamplingParams(), 1)
    with pytest.raises(errors.LengthLimitError):
        engine.start_request(third, [1] * 60, SamplingParams(), 5)
    with pytest.raises(errors.InvalidTokenError):
        engine.start_request(third, [V], SamplingParams(), 5)
    engine.leave(engine.bad)
    with pytest.raises(errors.UnknownSessionError):
        engine.submit(engine.bad, Draft(0, []))


def test_stale_and_duplicate_rounds(engine):
    engine.submit(engine.good, Draft(0, [7]))
    assert engine.submit(engine.good, Draft(0, [7])) is None  # duplicate while queued: accepted once
    with pytest.raises(errors.MalformedDraftError):
        engine.submit(engine.good, Draft(0, [8]))
    verdict = engine.run_round().verdicts[engine.good]
    assert engine.submit(engine.good, Draft(0, [7])) == verdict  # retry after the verdict: same answer
    with pytest.raises(errors.StaleRoundError):
        engine.submit(engine.good, Draft(0, [9]))


def test_generation_continues_correctly_after_errors(engine):
    target = engine.model
    for draft, error in bad_drafts()[:4]:
        with pytest.raises(error):
            engine.submit(engine.good, draft)
    out = []
    for r in range(10):
        engine.submit(engine.good, Draft(r, []))
        v = engine.run_round().verdicts[engine.good]
        out += v.token_ids
        if v.finished:
            break
    assert out == greedy_reference(target, [1, 2, 3], 10)


def test_finish_request_early(engine):
    engine.submit(engine.good, Draft(0, [7]))
    assert engine.finish_request(engine.good)[:3] == [1, 2, 3]
    assert engine.cache.num_slots == 1 and engine.run_round().verdicts == {}  # the queued draft is gone
    with pytest.raises(errors.NoActiveRequestError):
        engine.finish_request(engine.good)


def test_an_empty_tokenizer_fingerprint_is_refused(engine):
    """The proto says the fingerprint must equal the target's; an empty one used to skip the check."""
    with pytest.raises(errors.TokenizerMismatchError, match="no tokenizer fingerprint"):
        engine.join("anonymous", "")
    with pytest.raises(errors.TokenizerMismatchError):
        engine.join("other", "def")
    right = engine.join("right", "abc")
    engine.leave(right)  # max_drafters = 3
    assert engine.join("in-process", None) in engine.session_ids  # an in-process caller vouches for its draft


def test_the_engine_smooths_with_its_policys_eta_unless_told():
    from goodspeed.scheduler import SmoothingConfig

    assert EngineConfig(policy="goodspeed").smoothing.eta == 0.1
    assert EngineConfig(policy="goodspeed-paper").smoothing.eta == 0.2
    assert EngineConfig(policy="goodspeed", smoothing=SmoothingConfig(eta=0.3)).smoothing.eta == 0.3
    with pytest.raises(ValueError, match="unknown policy"):
        EngineConfig(policy="goodspeed-explore")


def test_the_attention_path_is_chosen_by_the_config_and_an_impossible_varlen_is_refused():
    """auto: masked SDPA on CPU (flash's varlen kernel is CUDA, half precision); masked: always;
    varlen: refused where the kernel cannot run, naming the model's device and dtype, and for
    padded forwards; an unknown path is refused by name."""
    with pytest.raises(ValueError, match="attention must be one of auto, varlen, masked"):
        EngineConfig(attention="flash")
    with pytest.raises(ValueError, match="'varlen' needs packed forwards"):
        EngineConfig(attention="varlen", packed=False)
    assert VerificationEngine(tiny_llama(0)).attention == "masked SDPA"
    assert VerificationEngine(tiny_llama(0), EngineConfig(attention="masked")).attention == "masked SDPA"
    assert VerificationEngine(tiny_llama(0), EngineConfig(packed=False)).attention == "masked SDPA (padded forwards)"
    assert VerificationEngine(tiny_llama(0), EngineConfig(pad_rows=True)).attention == "masked SDPA, rows padded where a step allows"
    with pytest.raises(ValueError, match="pad_rows needs packed forwards"):
        EngineConfig(pad_rows=True, packed=False)
    with pytest.raises(ValueError, match=r"needs flash's varlen kernel.*\(this model: cpu, torch.float64"):
        VerificationEngine(tiny_llama(0), EngineConfig(attention="varlen"))
