"""Conversions between the wire messages (goodspeed.v1 pb2) and the engine's dataclasses.

pb2 classes stop here: the servicer converts at the edge, the engine never sees them.
"""

from __future__ import annotations

import numpy as np

from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.proto.goodspeed.v1 import goodspeed_pb2 as pb
from goodspeed.serving import sampling_wire as wire
from goodspeed.verifier.errors import MalformedDraftError
from goodspeed.verifier.types import Draft, SparseProbs, Verdict


# The highest SamplingParams field this verifier reads (sampling_from_pb reads every one; a test
# checks), which Generate's first chunk tells its client (GenerateChunk.sampling_fields).
SAMPLING_FIELDS = max(field.number for field in pb.SamplingParams.DESCRIPTOR.fields)


def sampling_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    """The request's sampling settings; settings the verifier refuses are a malformed request."""
    try:
        return wire.sampling_from_pb(msg)
    except ValueError as exc:  # StructureError is one
        raise MalformedDraftError(str(exc)) from None


def draft_from_pb(msg: pb.DraftRequest, vocab_size: int) -> Draft:
    tokens = list(msg.token_ids)
    parents = list(msg.parents) if len(msg.parents) else None
    kind = msg.WhichOneof("draft_probs")
    dense = sparse = None
    if kind == "dense":
        values = np.asarray(msg.dense.probs, dtype=np.float64)
        if values.size != len(tokens) * vocab_size:
            raise MalformedDraftError(f"dense probs hold {values.size} values, expected {len(tokens)} x {vocab_size}")
        dense = values.reshape(len(tokens), vocab_size)
    elif kind == "sparse":
        sparse = [SparseProbs(list(row.token_ids), list(row.probs)) for row in msg.sparse.rows]
    return Draft(int(msg.round_index), tokens, parents=parents, dense_probs=dense, sparse_probs=sparse,
                 decode_ahead=int(msg.decode_ahead), decode_ahead_until_match=int(msg.decode_ahead_until_match))


def verdict_to_pb(v: Verdict) -> pb.Verdict:
    return pb.Verdict(
        session_id=v.session_id,
        round_index=v.round_index,
        num_drafted=v.num_drafted,
        num_accepted=v.num_accepted,
        token_ids=v.token_ids,
        committed_length=v.committed_length,
        prefix_hash=v.prefix_hash,
        next_draft_length=v.next_draft_length,
        finished=v.finished,
        finish_reason=v.finish_reason or "",
        acceptance=v.acceptance,
        goodput=v.goodput,
        num_transit=v.num_transit,
        logprobs=logprobs_to_pb(v.logprobs),
        prompt_logprobs=logprobs_to_pb(v.prompt_logprobs),
        decode_ahead_left=v.decode_ahead_left,
    )


def logprobs_to_pb(logprobs) -> list[pb.TokenLogprob]:
    """:class:`TokenLogprob` s (none: ``[]``) as ``TokenLogprob`` messages."""
    return [pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top_ids=[t for t, _ in lp.top],
                            top_logprobs=[x for _, x in lp.top], rank=lp.rank or 0) for lp in logprobs or ()]
