"""Drive a verification engine and draft runners in one process (tests, benchmarks, examples).

This is the distributed protocol without the network: each round every drafter with a request
drafts exactly its allotted ``S_i`` tokens, submits them with their draft distributions (sparse
when their support is small, as over gRPC: :meth:`~goodspeed.drafter.serde.DraftOutput.q_to_send`),
the engine verifies all of them in one forward, and each drafter applies its verdict. With
chunked prefill a drafter whose prompt is being prefilled waits (the steps carry its chunks) and
drafts from the step after its prefill completes.

Links (``delay``): a drafter's draft, drafted right after its verdict, reaches the engine
``delay(drafter)`` steps later; meanwhile the steps go on (for the others, and for transit
decoding of drafters that joined with ``transit``; see :mod:`goodspeed.verifier.engine`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from goodspeed.drafter.runner import DraftRunner
from goodspeed.drafter.serde import DraftOutput
from goodspeed.drafter.session import DrafterError, DraftSession, answers
from goodspeed.serving.generation import GenerationRequest
from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.lm.decoding.seeding import resolve_root_seed, torch_generator
from goodspeed.verifier.engine import VerificationEngine
from goodspeed.verifier.types import Draft, RoundResult, SparseProbs


@dataclass
class InProcessDrafter:
    """A drafter and its queue of prompts; it joins at ``join_round`` and leaves at ``leave_round``."""

    name: str
    runner: DraftRunner
    prompts: list[list[int]]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 32
    seed: int | None = None  # root seed; the drafter samples on the stream (root, 'drafter', name)
    join_round: int = 0
    leave_round: int | None = None
    outputs: list[list[int]] = field(default_factory=list)
    session_id: str | None = None
    request: DraftSession | None = None  # the request in progress; its length None while its prompt is prefilled in pieces
    generator: torch.Generator | None = None
    next_prompt: int = 0
    left: bool = False
    transit: bool = False  # joins with transit decoding (the engine decodes while its draft is delayed)
    held: tuple[int, Draft] | None = None  # a delayed draft: (the step it reaches the engine, the draft)

    @property
    def busy(self) -> bool:
        """A request is in progress."""
        return self.request is not None

    @property
    def done(self) -> bool:
        return self.left or (not self.busy and self.next_prompt >= len(self.prompts))


def to_engine_draft(round_index: int, out: DraftOutput, sampling: SamplingParams) -> Draft:
    """The engine's :class:`Draft`, with q as :meth:`DraftOutput.q_to_send` decides."""
    kind, q = out.q_to_send(sampling)
    if kind == "sparse":
        return Draft(round_index, out.token_ids, sparse_probs=[SparseProbs(ids, probs) for ids, probs in q])
    if kind == "dense":
        return Draft(round_index, out.token_ids, dense_probs=q.cpu().numpy())
    return Draft(round_index, out.token_ids)


def _start_next(engine: VerificationEngine, d: InProcessDrafter, eos_token_ids: Sequence[int]) -> None:
    d.request = None
    if d.next_prompt >= len(d.prompts):
        return
    prompt = [int(t) for t in d.prompts[d.next_prompt]]
    d.next_prompt += 1
    d.request = DraftSession(GenerationRequest(f"{d.name}-{d.next_prompt - 1}", prompt, d.max_new_tokens, d.sampling,
                                               tuple(eos_token_ids)))
    d.runner.start(prompt)
    d.request.started(engine.start(d.session_id, d.request.start_request()), engine.next_round(d.session_id))


def _update_membership(engine: VerificationEngine, drafters: Sequence[InProcessDrafter], t: int, eos_token_ids) -> None:
    for d in drafters:
        if d.session_id is None and not d.done and t >= d.join_round:
            d.session_id = engine.join(d.name, transit=d.transit)
            d.generator = torch_generator(resolve_root_seed(d.seed), "drafter", d.name)
            _start_next(engine, d, eos_token_ids)
        elif d.session_id is not None and d.leave_round is not None and t >= d.leave_round:
            engine.leave(d.session_id)
            d.session_id, d.request, d.left = None, None, True


def _apply_verdict(engine, d: InProcessDrafter, result: RoundResult, eos_token_ids) -> None:
    verdict = result.verdicts[d.session_id]
    if not answers(verdict, d.request.round_index) or not d.request.apply(verdict):
        raise DrafterError(f"{d.name}: the verdict for round {verdict.round_index} does not match this drafter's text")
    d.runner.apply(verdict.token_ids, verdict.num_accepted)
    if verdict.finished:
        d.outputs.append(d.request.output)
        _start_next(engine, d, eos_token_ids)


def run_inprocess(
    engine: VerificationEngine,
    drafters: Sequence[InProcessDrafter],
    eos_token_ids: Sequence[int] = (),
    max_rounds: int = 100_000,
    on_round: Callable[[RoundResult], None] | None = None,
    delay: Callable[[InProcessDrafter], int] | None = None,
) -> list[RoundResult]:
    """Run until every drafter has finished its prompts or left; returns every round's result.
    ``delay(drafter)``: steps its next draft spends on the way (module docstring); None: none."""
    results = []
    for t in range(max_rounds):
        _update_membership(engine, drafters, t, eos_token_ids)
        if all(d.done for d in drafters):
            break
        active = [d for d in drafters if d.session_id is not None and d.busy and d.request.length is not None]
        if not active and not engine.has_prefill:
            continue
        submitted = []
        for d in active:
            if d.held is None:
                out = d.runner.draft(d.request.length, d.sampling, d.generator)
                d.held = (t + (delay(d) if delay is not None else 0), to_engine_draft(d.request.round_index, out, d.sampling))
            if d.held[0] <= t:
                engine.submit(d.session_id, d.held[1])
                d.held = None
                submitted.append(d)
        result = engine.run_round()
        results.append(result)
        for d in submitted:
            _apply_verdict(engine, d, result, eos_token_ids)
        for d in drafters:
            if d.session_id in result.started:  # its prompt's last chunk was in this step
                d.request.length = result.started[d.session_id]
        if on_round:
            on_round(result)
    return results
