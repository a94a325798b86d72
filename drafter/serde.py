"""Conversions between the draft runner's outputs and the wire messages (goodspeed.v1 pb2)."""

from __future__ import annotations

import torch

from goodspeed.drafter.runner import DraftOutput
from goodspeed.lm.sampling import SamplingParams
from goodspeed.proto.goodspeed.v1 import goodspeed_pb2 as pb


def sampling_to_pb(params: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)


def draft_to_pb(session_id: str, round_index: int, out: DraftOutput, sampling: SamplingParams) -> pb.DraftRequest:
    """Greedy drafts carry no q; truncated q travels sparse (exact); otherwise dense ``[S * V]``."""
    msg = pb.DraftRequest(session_id=session_id, round_index=round_index, token_ids=out.token_ids)
    if sampling.greedy or not out.token_ids:
        return msg
    if sampling.truncates:
        rows = []
        for row in out.probs:
            ids = torch.nonzero(row > 0).squeeze(-1)
            rows.append(pb.SparseRow(token_ids=ids.tolist(), probs=row[ids].float().tolist()))
        msg.sparse.rows.extend(rows)
    else:
        msg.dense.probs.extend(out.probs.float().reshape(-1).tolist())
    return msg
