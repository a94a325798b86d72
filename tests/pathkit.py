"""The engine's serving paths on a toy target, for exactness tests: in-process edge drafters
(chains, optionally delayed so the engine decodes in transit) and local serving under a policy."""

from goodspeed.drafter.runner import DraftRunner
from goodspeed.launch.cluster.inprocess import InProcessDrafter, run_inprocess
from goodspeed.scheduler import LatencyModel
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from goodspeed.verifier.clocks import SimulatedClock
from goodspeed.verifier.local import LocalConfig, LocalServing

TARGET_COST, DRAFT_COST = LatencyModel(1e-6, 2e-4, 0.010), LatencyModel(1e-7, 2e-5, 0.001)
PATHS = ["edge", "edge-transit", "local-none", "local-chain", "local-tetris", "local-adaserve"]


def run_edge(target, draft, sampling, prompts, max_new_tokens, transit=False, drafters=4, eos=()):
    """``prompts`` over ``drafters`` in-process edge drafters in one engine; outputs in prompt order
    per drafter. ``transit``: every other draft is delayed a step and the engine decodes meanwhile.
    ``eos``: the requests' ending tokens (the drafters' runners draft without them)."""
    engine = VerificationEngine(target, EngineConfig(budget=8 * drafters, max_draft_len=4, transit_tokens=2 if transit else 0))
    ds = [InProcessDrafter(f"d{i}", DraftRunner(draft), prompts[i::drafters], sampling, max_new_tokens, transit=transit)
          for i in range(drafters)]
    results = run_inprocess(engine, ds, eos, delay=(lambda d: d.request.round_index % 2) if transit else None)
    return [out for d in ds for out in d.outputs], results


def run_local(target, draft, sampling, policy, prompts, max_new_tokens, eos=(), min_drafted=None, seed=None):
    """``prompts`` through local serving under ``policy``; outputs in prompt order, and the serving.
    ``min_drafted``: the fewest tokens it must have drafted (default: more than one a prompt).
    ``seed``: the engine's root seed (default: fresh entropy), for a run whose counts must repeat."""
    engine = VerificationEngine(target, EngineConfig(seed=seed))
    config = LocalConfig(policy=policy, k=2, extra=2, budget=24, max_requests=8, max_waiting=len(prompts))
    serving = LocalServing(engine, draft, config, SimulatedClock(TARGET_COST, DRAFT_COST))
    for i, prompt in enumerate(prompts):
        serving.submit(prompt, sampling, max_new_tokens=max_new_tokens, eos_token_ids=eos, tpot_slo_ms=None if i % 2 else 12.0)
    while serving.step() is not None:
        pass
    assert len(serving.finished) == len(prompts)
    if policy != "none":
        assert serving.stats()["drafted"] >= (len(prompts) + 1 if min_drafted is None else min_drafted)
    return [r.generated for r in sorted(serving.finished, key=lambda r: int(r.request_id.split("-")[1]))], serving


def on_path(path, target, draft, sampling, prompts, max_new_tokens, eos=()):
    """Each prompt's output on ``path`` (one of :data:`PATHS`: four edge drafters, or local serving
    under ``local-<policy>``), in prompt order, and how many drafted tokens were accepted."""
    if path.startswith("edge"):
        flat, results = run_edge(target, draft, sampling, prompts, max_new_tokens, transit=path == "edge-transit", eos=eos)
        order = [i for d in range(4) for i in range(d, len(prompts), 4)]  # run_edge's: drafter by drafter
        outputs = [None] * len(prompts)
        for i, out in zip(order, flat):
            outputs[i] = out
        return outputs, sum(v.num_accepted for r in results for v in r.verdicts.values())
    outputs, serving = run_local(target, draft, sampling, path.removeprefix("local-"), prompts, max_new_tokens, eos=eos)
    return outputs, serving.stats()["accepted"]


class SourceRunner:
    """One request at a time over a batched draft source (a lookup, or a hybrid): the runner's
    ``start`` / ``draft`` / ``apply`` as the in-process driver calls them, sending what an edge
    node sends (a lookup's point masses as one ``(id, 1.0)`` a position when sampled)."""

    KEY = "request"

    def __init__(self, source) -> None:
        self.source = source
        self.committed: list[int] = []

    def start(self, prompt_ids, generated: int = 0) -> None:
        if self.KEY in self.source.slots:
            self.source.remove(self.KEY, self.committed)  # the last request's text, for a source that learns from it
        self.source.add(self.KEY)
        self.committed = [int(t) for t in prompt_ids]

    def draft(self, num_tokens, sampling, generator):
        from goodspeed.drafter.serde import DraftOutput

        d = self.source.draft_chains({self.KEY: self.committed}, {self.KEY: num_tokens}, {self.KEY: sampling}, generator)
        return DraftOutput(d[self.KEY].token_ids, d[self.KEY].probs)

    def apply(self, emitted, num_accepted) -> bool:
        self.source.rollback(self.KEY, len(self.committed), num_accepted)
        self.committed.extend(int(t) for t in emitted)
        return False


def run_edge_source(target, make_source, sampling, prompts, max_new_tokens, drafters=4, eos=()):
    """``prompts`` over ``drafters`` in-process edge drafters drafting with ``make_source()`` each;
    outputs in prompt order, and the rounds' results."""
    engine = VerificationEngine(target, EngineConfig(budget=8 * drafters, max_draft_len=4))
    ds = [InProcessDrafter(f"d{i}", SourceRunner(make_source()), prompts[i::drafters], sampling, max_new_tokens)
          for i in range(drafters)]
    results = run_inprocess(engine, ds, eos)
    outputs = [None] * len(prompts)
    for i, d in enumerate(ds):
        for j, out in enumerate(d.outputs):
            outputs[i + j * drafters] = out
    return outputs, results
