"""Speculation policies of the five papers, as pure code (stdlib + numpy; no torch, grpc or
transformers), with randomness and time passed in.

- :mod:`.goodspeed` — smoothing (eqs. 3-4) and the draft-length allocation (eq. 5) of GoodSpeed
- :mod:`.baselines` — Fixed-S and Random-S
- :mod:`.tetris` — TETRIS token selection (Alg. 1)
- :mod:`.adaserve` — AdaServe's SLO-customized tree selection (Alg. 2, eqs. 8-9)
- :mod:`.turbospec` — TurboSpec's latency model and goodput-maximising proposal length
- :mod:`.nightjar` — Nightjar's switching-cost-aware bandit (Alg. 1, eq. 3)
- :mod:`.paying` — a drafter's own length rule: draft only what pays (TurboSpec's goodput, per request)
- :mod:`.policy` — the by-name interface the verifier uses
- :mod:`.allotments` — the verifier's per-round draft-length bookkeeping (engine and simulator)
"""

from goodspeed.scheduler.adaserve import (
    CandidateTree,
    TreeSelection,
    select_tree_nodes,
    slo_need,
    speculation_shape,
)
from goodspeed.scheduler.baselines import fixed_draft_lengths, random_draft_lengths
from goodspeed.scheduler.goodspeed import (
    GoodputEstimator,
    SmoothingConfig,
    allocate_draft_lengths,
    allocation_objective,
    expected_goodput,
)
from goodspeed.scheduler.nightjar import NightjarBandit
from goodspeed.scheduler.paying import (
    EvidenceAcceptance,
    PayingLength,
    paying_batch_lengths,
    paying_draft_length,
    paying_lengths,
    plain_steps,
)
from goodspeed.scheduler.policy import AllocationInputs, DraftLengthPolicy, default_eta, make_policy, POLICIES, smoothing_of
from goodspeed.scheduler.allotments import DraftAllotments, OwnerSizedAllotments
from goodspeed.scheduler.tetris import presample_scores, select_by_scores, select_tokens, verification_success_rate
from goodspeed.scheduler.turbospec import LatencyModel, ProposalChoice, choose_proposal_length, fit_latency_model

__all__ = [
    "AllocationInputs",
    "CandidateTree",
    "DraftAllotments",
    "DraftLengthPolicy",
    "EvidenceAcceptance",
    "GoodputEstimator",
    "LatencyModel",
    "NightjarBandit",
    "PayingLength",
    "OwnerSizedAllotments",
    "POLICIES",
    "ProposalChoice",
    "SmoothingConfig",
    "TreeSelection",
    "allocate_draft_lengths",
    "allocation_objective",
    "choose_proposal_length",
    "default_eta",
    "expected_goodput",
    "fit_latency_model",
    "fixed_draft_lengths",
    "make_policy",
    "paying_batch_lengths",
    "paying_draft_length",
    "paying_lengths",
    "plain_steps",
    "random_draft_lengths",
    "select_tokens",
    "presample_scores",
    "select_by_scores",
    "select_tree_nodes",
    "slo_need",
    "smoothing_of",
    "speculation_shape",
    "verification_success_rate",
]
