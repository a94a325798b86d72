"""Conversions between the draft side and the wire (goodspeed.v1 pb2): drafts, log-probabilities,
the features a verifier applies, and a verifier's refusals as error kinds. No torch import here: a
model's q rows arrive as a tensor and are read through its own methods."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from goodspeed.lm.decoding.params import FEATURES, SamplingParams, TokenLogprob
from goodspeed.proto.goodspeed.v1 import goodspeed_pb2 as pb
from goodspeed.serving.generation import RequestError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DraftOutput:
    token_ids: list[int]  # [S]
    # [S, V] float32 q_j after logits processing: what was sampled from and travels; None: the
    # point mass on each drafted token (a deterministic proposal: goodspeed.lm.decoding.lookup)
    probs: torch.Tensor | None

    def q_to_send(self, sampling: SamplingParams) -> tuple[str, object]:
        """How q travels, exactly: ``("none", None)`` for greedy (q is the point mass) or empty
        drafts; ``("sparse", [(ids, probs), ...])`` — each row's support — when that is smaller
        on the wire (an id and a prob a token against a float for every vocabulary entry: the
        support under half of ``S x V``, as with top-k, top-p or a capped proposal); else
        ``("dense", probs [S, V])``."""
        if sampling.greedy or not self.token_ids:
            return "none", None
        if self.probs is None:  # point masses (a lookup's draft): one (id, 1.0) a position
            return "sparse", [([int(t)], [1.0]) for t in self.token_ids]
        support = self.probs > 0
        if 2 * int(support.sum()) < self.probs.numel():
            rows = []
            for row, keep in zip(self.probs, support):
                ids = keep.nonzero().squeeze(-1)
                rows.append((ids.tolist(), row[ids].tolist()))
            return "sparse", rows
        return "dense", self.probs


def applied_features(reply: pb.StartRequestReply) -> set[str]:
    """The sampling features a StartRequestReply says its verifier applies: its ``features``, or
    from a verifier older than that field, the flags it set (each named as its feature)."""
    if reply.features:
        return set(reply.features)
    return {name for name in FEATURES if pb.StartRequestReply.DESCRIPTOR.fields_by_name.get(name) and getattr(reply, name)}


def unapplied_setting(params: SamplingParams, reply: pb.StartRequestReply) -> str | None:
    """Why a verifier's StartRequestReply cannot be trusted for a request with ``params``: a
    feature the request uses that the verifier does not list (a verifier older than it ignores
    it), or None."""
    for name in sorted(params.features() - applied_features(reply), key=list(FEATURES).index):
        return f"the verifier does not apply {FEATURES[name]} (a version older than it)"
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


def verdict_logprobs(verdict: pb.Verdict) -> list[TokenLogprob] | None:
    """A verdict's log-probabilities, one per token; None when it carries none (a verifier older
    than ``StartRequestRequest.logprobs``, which the HTTP layer then reports)."""
    if len(verdict.logprobs) != len(verdict.token_ids):
        return None
    return logprobs_from_pb(verdict.logprobs)


def refusal(what: str, exc: grpc.aio.AioRpcError) -> RequestError:
    """A verifier's refusal as the kind of error an application should see. A call the verifier
    cancelled is its going away (gRPC cancels what is in flight when a stopping server's grace runs
    out; the node's own cancellations end its tasks, not its calls), so it is unavailable, like
    UNAVAILABLE."""
    code = exc.code()
    kind = {grpc.StatusCode.RESOURCE_EXHAUSTED: "overloaded", grpc.StatusCode.INVALID_ARGUMENT: "invalid",
            grpc.StatusCode.UNAVAILABLE: "unavailable", grpc.StatusCode.CANCELLED: "unavailable",
            grpc.StatusCode.DEADLINE_EXCEEDED: "timeout"}.get(code, "upstream")
    return RequestError(kind, f"the verifier refused {what}: {code.name}: {exc.details()}")
