"""A request on the wire, both directions, for the drafter that sends it and the verifier that
reads it: its :class:`~goodspeed.lm.decoding.params.SamplingParams` (the proto's
``SamplingParams``) and the whole request a ``StartRequest`` carries.

A setting travels by name: every field of :class:`SamplingParams` that the message has under the
same name is copied as it is (repeated fields as tuples), so a new plain setting needs its field in
the dataclass and in the proto and nothing here. Only the settings whose wire form differs are
written out below: ``top_p`` (proto3's 0 is read as 1), ``repetition_penalty`` (optional: unset is
1), ``logit_bias`` (a map), ``structured`` (a message) and ``bad_words`` (nested sequences).
"""

from __future__ import annotations

from dataclasses import fields

from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.lm.decoding.structured import Structure
from goodspeed.proto.goodspeed.v1 import goodspeed_pb2 as pb
from goodspeed.serving.generation import GenerationRequest

SHAPED = ("top_p", "repetition_penalty", "logit_bias", "structured", "bad_words")  # not copied as they are
_WIRE = pb.SamplingParams.DESCRIPTOR.fields_by_name
PLAIN = tuple(f.name for f in fields(SamplingParams) if f.name in _WIRE and f.name not in SHAPED)


def sampling_to_pb(params: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(**{name: getattr(params, name) for name in PLAIN}, top_p=params.top_p,
                            logit_bias=dict(params.logit_bias),
                            bad_words=[pb.TokenSequence(token_ids=w) for w in params.bad_words])
    if params.repetition_penalty != 1.0:
        msg.repetition_penalty = params.repetition_penalty
    if params.structured is not None:
        s = params.structured
        msg.structured.CopyFrom(pb.StructuredOutput(kind=s.kind, spec=s.spec, compact=not s.any_whitespace))
        if s.after is not None:
            msg.structured.after_token = s.after
    return msg


def sampling_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    """The settings a message carries; ``ValueError`` (a :class:`~goodspeed.lm.decoding.structured.StructureError`
    among them) for settings :class:`SamplingParams` refuses."""
    plain = {name: _value(getattr(msg, name)) for name in PLAIN}
    return SamplingParams(**plain, top_p=msg.top_p or 1.0,
                          repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
                          logit_bias=tuple(sorted(msg.logit_bias.items())),
                          structured=structure_from_pb(msg.structured) if msg.HasField("structured") else None,
                          bad_words=tuple(tuple(w.token_ids) for w in msg.bad_words))


def structure_from_pb(msg: pb.StructuredOutput) -> Structure:
    """The constraint as sent, unbound: the verifier compiles it against its own tokenizer."""
    return Structure(msg.kind, msg.spec, any_whitespace=not msg.compact,
                     after=msg.after_token if msg.HasField("after_token") else None)


def _value(value):
    """A scalar as it is; a repeated field as a tuple."""
    return value if isinstance(value, (bool, int, float, str)) else tuple(value)


def request_to_pb(session_id: str, request: GenerationRequest) -> pb.StartRequestRequest:
    """A request to start on a verifier session (the drafter's side of ``StartRequest``)."""
    msg = pb.StartRequestRequest(session_id=session_id, prompt_ids=request.prompt_ids, sampling=sampling_to_pb(request.sampling),
                                 max_new_tokens=request.max_tokens, eos_token_ids=list(request.eos_token_ids),
                                 generated=request.generated)
    for name in ("seed", "logprobs", "prompt_logprobs"):  # optional: unset is None
        if getattr(request, name) is not None:
            setattr(msg, name, getattr(request, name))
    return msg


def request_from_pb(msg: pb.StartRequestRequest, sampling: SamplingParams) -> GenerationRequest:
    """The request a ``StartRequest`` carries, with its ``sampling`` as the verifier reads it
    (:func:`sampling_from_pb`, then bound to the target's tokenizer)."""
    optional = {name: getattr(msg, name) if msg.HasField(name) else None for name in ("seed", "logprobs", "prompt_logprobs")}
    return GenerationRequest(msg.session_id, list(msg.prompt_ids), msg.max_new_tokens, sampling, tuple(msg.eos_token_ids),
                             generated=msg.generated, **optional)
