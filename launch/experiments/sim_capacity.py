"""Capacity at a TPOT SLO in simulation: how many edge drafters one verifier serves with 90% of
their requests within a time-per-output-token SLO, against centralised plain decoding on the
same verifier, at any number of drafters (``goodspeed simulate SPEC --capacity N,... --tpot-slo-ms MS``).

Edge drafters: :func:`~goodspeed.launch.experiments.simulate.simulate`'s synchronous rounds over
``N`` synthetic drafters drawn from the profile (:func:`~goodspeed.launch.experiments.simulate.scaled_drafters`:
each measured drafter's acceptance, scaled by ``--spread``, a link round trip from ``--rtt-ms``),
the budget ``C`` growing with ``N`` at the spec's share per drafter. Each request's prompt (the
profile's prompt tokens per request) is prefilled in its first round's step. A request's TPOT is
its rounds' simulated seconds, that first one included, over its ``max_new_tokens``; a
drafter's next request starts when its last one ends, so every drafter is a client sending one
request after another.

Centralised plain decoding: ``N`` clients, each step one token a client and, on average, the
prompts of the clients starting a request (one every ``max_new_tokens`` steps each), costs the
profile's verification step for those tokens plus its send time (the same fitted latency model,
TurboSpec's eq. 3 over the tokens a forward verifies or prefills): every request's TPOT is that step.

What the model leaves out, so what a figure here is not: the HTTP front and the edge node's own
work per request, context length (the fitted step has no context term), memory, a step's cost
beyond the batch sizes the profile's run measured (the fit is extrapolated linearly), drafters
that draft less than their allotment (the simulated ones draft exactly ``S_i``), and asynchronous
rounds (a synchronous round waits for its slowest drafter, so the widest link round trip sets
every drafter's round). Centralised speculation (the verifier drafting for its own clients) is
not simulated: the real benchmark measures it at the sizes this machine holds.
"""

from __future__ import annotations

import math

import numpy as np

from goodspeed.launch.experiments.sim_profiles import RunProfile, SimulationError
from goodspeed.launch.experiments.simulate import SimSettings, scaled_drafters, simulate
from goodspeed.scheduler import SmoothingConfig, smoothing_of

PHASES = ("edge", "plain")


def nearest_rank(values, q: float) -> float:
    """The nearest-rank ``q`` quantile of ``values`` (the capacity benchmarks' p90, real and simulated)."""
    ordered = np.sort(np.asarray(values, dtype=np.float64))
    return float(ordered[max(0, math.ceil(q * ordered.size) - 1)])


def plain_tpot_s(profile: RunProfile, clients: int, max_new_tokens: int) -> float:
    """Centralised plain decoding's TPOT at ``clients``: one step verifying a token a client and
    prefilling their next prompts (a client starts one every ``max_new_tokens`` steps, so a step
    prefills ``clients * prompt_tokens / max_new_tokens`` on average), and its send."""
    batched = clients * (1.0 + profile.prompt_tokens / max_new_tokens)
    return float(profile.step.predict_s(0, batched)) + profile.send_s


def capacity_cells(profile: RunProfile, clients: list[int], slo_s: float, *, policy: str = "goodspeed",
                   budget_per_drafter: float, max_draft_len: int, max_new_tokens: int, rounds: int, seed: int = 0,
                   spread: float = 1.5, rtt_ms: tuple[float, float] = (2.0, 200.0), smoothing: SmoothingConfig | None = None,
                   progress: bool = False) -> list[dict]:
    """Per number of clients and phase (``edge``: simulated drafters; ``plain``: centralised plain
    decoding): requests counted, TPOT p50 / p90 (ms) and the share of requests within ``slo_s``."""
    if not slo_s > 0 or not clients or min(clients) < 1 or budget_per_drafter <= 0 or max_new_tokens < 1:
        raise SimulationError("capacity needs a positive SLO, clients >= 1, a positive budget per drafter and max_new_tokens >= 1")
    cells = []
    for n in sorted(set(clients)):
        pool = scaled_drafters(list(profile.drafters), [max_new_tokens] * len(profile.drafters), n, spread, rtt_ms, seed)
        settings = SimSettings(policy, max(1, round(budget_per_drafter * n)), rounds, smoothing or smoothing_of(policy),
                               max_draft_len, seed)
        tpot = simulate(pool, settings, profile.step, profile.send_s, progress=progress, prompt_tokens=profile.prompt_tokens,
                        packed=profile.step_tokens == "packed").request_tpot_s
        if tpot.size < n:
            raise SimulationError(f"{n} drafters: {tpot.size} requests finished in {rounds} rounds, fewer than one a "
                                  "drafter; give more --rounds")
        cells.append({"clients": n, "phase": "edge", "requests": int(tpot.size), "tpot_ms_p50": round(1000 * float(np.median(tpot)), 3),
                      "tpot_ms_p90": round(1000 * nearest_rank(tpot, 0.9), 3), "attainment": round(float(np.mean(tpot <= slo_s)), 4)})
        plain = plain_tpot_s(profile, n, max_new_tokens)
        cells.append({"clients": n, "phase": "plain", "requests": n, "tpot_ms_p50": round(1000 * plain, 3),
                      "tpot_ms_p90": round(1000 * plain, 3), "attainment": 1.0 if plain <= slo_s else 0.0})
    return cells


def capacity_at_slo(cells: list[dict], attainment: float = 0.9) -> dict[str, int]:
    """Per phase: the most clients up to which every cell, by clients, meets the SLO at least
    ``attainment`` of the time; 0 where even the fewest do not."""
    capacity = {}
    for phase in dict.fromkeys(c["phase"] for c in cells):
        capacity[phase] = 0
        for cell in sorted((c for c in cells if c["phase"] == phase), key=lambda c: c["clients"]):
            if cell["attainment"] < attainment:
                break
            capacity[phase] = cell["clients"]
    return capacity


def capacity_markdown(title: str, cells: list[dict], slo_ms: float, capacity: dict[str, int]) -> str:
    """CAPACITY.md: attainment and TPOT by clients, then each phase's capacity and their ratio."""
    by = {(c["clients"], c["phase"]): c for c in cells}
    lines = [f"# Capacity at a TPOT SLO of {slo_ms:g} ms (simulated): {title}", "",
             "| clients | edge drafters: attainment (TPOT p50 / p90 ms) | centralised plain decoding: TPOT ms |", "|---|---|---|"]
    for n in sorted({c["clients"] for c in cells}):
        e, p = by[(n, "edge")], by[(n, "plain")]
        lines.append(f"| {n} | {e['attainment']:.3f} ({e['tpot_ms_p50']:.1f} / {e['tpot_ms_p90']:.1f}) | {p['tpot_ms_p50']:.1f} |")
    ratio = capacity_ratio(capacity)
    lines += ["", f"Capacity (the most clients up to which every cell meets the SLO for 90% of requests): edge drafters "
                  f"{capacity['edge']}, centralised plain decoding {capacity['plain']}; ratio "
                  f"{'n/a' if ratio is None else f'{ratio:.2f}'}.", ""]
    return "\n".join(lines)


def capacity_ratio(capacity: dict[str, int]) -> float | None:
    """Edge drafters' capacity over plain decoding's (None when plain decoding meets the SLO at no client count given)."""
    return capacity["edge"] / capacity["plain"] if capacity.get("plain") else None
