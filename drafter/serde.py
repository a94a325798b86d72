"""Conversions between the draft runner's outputs and the wire messages (goodspeed.v1 pb2)."""

from __future__ import annotations

from goodspeed.drafter.runner import DraftOutput
from goodspeed.lm.sampling import SamplingParams, TokenLogprob
from goodspeed.proto.goodspeed.v1 import goodspeed_pb2 as pb


def sampling_to_pb(params: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
                            presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
                            logit_bias=dict(params.logit_bias), min_tokens=params.min_tokens,
                            allowed_token_ids=params.allowed_token_ids,
                            bad_words=[pb.TokenSequence(token_ids=w) for w in params.bad_words])
    if params.repetition_penalty != 1.0:
        msg.repetition_penalty = params.repetition_penalty
    if params.structured is not None:
        s = params.structured
        msg.structured.CopyFrom(pb.StructuredOutput(kind=s.kind, spec=s.spec, compact=not s.any_whitespace))
        if s.after is not None:
            msg.structured.after_token = s.after
    return msg


def unapplied_setting(params: SamplingParams, reply: pb.StartRequestReply) -> str | None:
    """Why a verifier's StartRequestReply cannot be trusted for a request with ``params``: a setting
    the request uses whose reply flag is false (a verifier older than it ignores it), or None."""
    for used, applied, what in ((params.extended, reply.extended_sampling, "min_p, penalties or logit_bias"),
                                (bool(params.min_tokens), reply.min_tokens, "min_tokens"),
                                (bool(params.allowed_token_ids), reply.allowed_token_ids, "allowed_token_ids"),
                                (params.structured is not None, reply.structured_output, "structured output"),
                                (params.structured is not None and params.structured.after is not None,
                                 reply.structured_after, "structured output after the reasoning"),
                                (bool(params.bad_words), reply.bad_words, "bad_words")):
        if used and not applied:
            return f"the verifier does not apply {what} (a version older than it)"
    return None


def draft_to_pb(session_id: str, round_index: int, out: DraftOutput, sampling: SamplingParams) -> pb.DraftRequest:
    """Token ids plus q as :meth:`DraftOutput.q_to_send` decides (dense flattens to ``[S * V]``)."""
    msg = pb.DraftRequest(session_id=session_id, round_index=round_index, token_ids=out.token_ids)
    kind, q = out.q_to_send(sampling)
    if kind == "sparse":
        msg.sparse.rows.extend(pb.SparseRow(token_ids=ids, probs=probs) for ids, probs in q)
    elif kind == "dense":
        msg.dense.probs.extend(q.float().reshape(-1).tolist())
    return msg


def logprobs_from_pb(logprobs) -> list[TokenLogprob]:
    """``TokenLogprob`` messages (a verdict's, a Generate chunk's) as :class:`TokenLogprob` s; a
    rank of 0 (a verifier older than the field sent none) is None."""
    return [TokenLogprob(lp.token_id, lp.logprob, tuple(zip(lp.top_ids, lp.top_logprobs)), lp.rank or None)
            for lp in logprobs]
