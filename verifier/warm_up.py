"""Compile and capture the engine's fixed-shape steps (``EngineConfig.cuda_graphs`` /
``torch_compile``) before a drafter's round would wait on them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.scheduler import OwnerSizedAllotments
from goodspeed.verifier.types import Draft

if TYPE_CHECKING:
    from goodspeed.verifier.engine import VerificationEngine

# (rows, drafted tokens a row) of each synthetic step, rows from the first slot; requests start in
# two waves, so the KV pool grows from four slots to eight in between; the first request's prompt
# is short and the others' longer, so the keys grow past a power of two (past the 16 a compiled
# step reads at least) as the rows do.
WARM_UP_PROMPTS = (5, 20)
WARM_UP_PLAN = ((1, 0), (1, 3), (4, 3), (4, 0), (2, 1), (1, 0), (8, 3), (8, 0))


def warm_up_steps(engine: VerificationEngine) -> int:
    """Synthetic requests stepped as :data:`WARM_UP_PLAN` says (one row and several, one query a
    row and several, keys growing, the pool growing), which makes each size dynamo saw change
    symbolic (compiled steps are at least 2 rows: :meth:`StepGraphs.shape_for
    <goodspeed.lm.runtime.graphs.StepGraphs.shape_for>`). The sessions are sized by a book of their own
    (not the drafters' budget or ``max_drafters``), drafts at most ``max_draft_len``. Returns the
    steps run; the sessions leave, and nothing of them stays but the graphs. Without fixed-shape
    steps, or where ``max_seq_len`` leaves no room for the plan, it does nothing (0)."""
    short, long = WARM_UP_PROMPTS
    new = 4 * len(WARM_UP_PLAN) + 1  # a row gains at most 4 tokens a step
    if engine.graphs is None or (engine.config.max_seq_len is not None and long + new > engine.config.max_seq_len):
        return 0
    source = OwnerSizedAllotments(engine.config.smoothing)
    sids = [engine.join(f"warm-up-{i}", source=source) for i in range(8)]
    try:
        for rows, drafted in WARM_UP_PLAN:
            drafted = min(drafted, engine.config.max_draft_len)
            for i, sid in enumerate(sids[:rows]):
                if not engine.has_request(sid):
                    engine.start_request(sid, [i + 1] * (short if i == 0 else long), SamplingParams(), new)
            while engine.has_prefill:
                engine.prefill_step()
            for sid in sids[:rows]:
                engine.set_allotment(sid, drafted)
                engine.submit(sid, Draft(engine.next_round(sid), [0] * drafted))
            engine.run_round()
    finally:
        for sid in sids:
            engine.leave(sid)
    return len(WARM_UP_PLAN)
