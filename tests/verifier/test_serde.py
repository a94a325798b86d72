"""The wire's sampling settings: the verifier reads every SamplingParams field (Generate's first
chunk tells its client it applies each one up to the highest, ``GenerateChunk.sampling_fields``),
and a drafter's settings arrive as they were sent."""

from goodspeed.serving.sampling_wire import sampling_to_pb
from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.lm.decoding.structured import Structure
from goodspeed.proto.goodspeed.v1 import goodspeed_pb2 as pb
from goodspeed.verifier.serde import SAMPLING_FIELDS, sampling_from_pb

# a value off the default for every field; a new field needs one here, or the first test fails
VALUES = {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "min_p": 0.1, "presence_penalty": 0.5, "frequency_penalty": -0.5,
          "repetition_penalty": 1.25, "logit_bias": {3: 1.5}, "min_tokens": 2, "allowed_token_ids": [1, 4],
          "structured": pb.StructuredOutput(kind="regex", spec="[a-z]+"), "bad_words": [pb.TokenSequence(token_ids=[2, 3])]}


def message(name: str, value) -> pb.SamplingParams:
    msg = pb.SamplingParams()
    if isinstance(value, dict):
        getattr(msg, name).update(value)
    elif isinstance(value, list):
        getattr(msg, name).extend(value)
    elif isinstance(value, pb.StructuredOutput):
        getattr(msg, name).CopyFrom(value)
    else:
        setattr(msg, name, value)
    return msg


def test_the_verifier_reads_every_sampling_field_it_says_it_applies():
    fields = pb.SamplingParams.DESCRIPTOR.fields
    assert sorted(f.name for f in fields) == sorted(VALUES)
    assert SAMPLING_FIELDS == max(f.number for f in fields)
    plain = sampling_from_pb(pb.SamplingParams())
    assert plain == SamplingParams(temperature=0.0)
    for name, value in VALUES.items():
        assert sampling_from_pb(message(name, value)) != plain, f"sampling_from_pb ignores {name}"


def test_a_drafters_settings_arrive_as_sent():
    """(Values a float32 holds exactly: the wire carries float32.)"""
    sent = SamplingParams(temperature=0.75, top_k=5, top_p=0.875, min_p=0.125, presence_penalty=0.5, frequency_penalty=-0.5,
                          repetition_penalty=1.25, logit_bias=((3, 1.5),), min_tokens=2, allowed_token_ids=(1, 4),
                          bad_words=((5,), (2, 3, 7)))
    assert sampling_from_pb(sampling_to_pb(sent)) == sent
    for shape in (Structure("json", '{"type": "object"}', any_whitespace=False), Structure("json_object"),
                  Structure("choice", '["a", "b"]'), Structure("grammar", 'start: "x"'), Structure("regex", "a+", after=7)):
        sent = SamplingParams(temperature=0.5, structured=shape)
        assert sampling_from_pb(sampling_to_pb(sent)) == sent


def test_a_grammar_after_the_reasoning_needs_a_verifier_that_says_it_applies_it():
    """A verifier older than StructuredOutput.after_token would hold the reasoning to the grammar:
    its reply, without StartRequestReply.structured_after, is not trusted."""
    from goodspeed.drafter.serde import unapplied_setting

    gated = SamplingParams(structured=Structure("regex", "a+", after=7))
    older = pb.StartRequestReply(structured_output=True)
    assert "after the reasoning" in unapplied_setting(gated, older)
    assert unapplied_setting(SamplingParams(structured=Structure("regex", "a+")), older) is None
    assert unapplied_setting(gated, pb.StartRequestReply(structured_output=True, structured_after=True)) is None


def test_a_reply_lists_its_features_and_an_older_replys_flags_still_count():
    """A verifier names the sampling features it applies (StartRequestReply.features); one older
    than that list is read by its per-feature flags; one older than a feature lists or flags
    nothing for it, and a request that uses it is not trusted."""
    from goodspeed.drafter.serde import applied_features, unapplied_setting
    from goodspeed.lm.decoding.params import FEATURES

    penalised = SamplingParams(presence_penalty=1.0, min_tokens=2)
    assert applied_features(pb.StartRequestReply(features=list(FEATURES))) == set(FEATURES)
    assert unapplied_setting(penalised, pb.StartRequestReply(features=list(FEATURES))) is None
    assert "min_tokens" in unapplied_setting(penalised, pb.StartRequestReply(features=["extended_sampling"]))
    legacy = pb.StartRequestReply(extended_sampling=True, min_tokens=True)  # before the features list
    assert applied_features(legacy) == {"extended_sampling", "min_tokens"} and unapplied_setting(penalised, legacy) is None
    assert "min_p, penalties or logit_bias" in unapplied_setting(penalised, pb.StartRequestReply())
    assert SamplingParams().features() == set()
