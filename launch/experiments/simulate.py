"""``goodspeed simulate``: GoodSpeed's synchronous round loop at any scale, calibrated on real runs.

The simulator runs the verifier's own scheduling code — :class:`~goodspeed.scheduler.allotments.DraftAllotments`:
smoothing (GoodSpeed, arXiv 2512.09963, eqs. 3-4), the draft-length policy (eq. 5 or a
baseline), first allotments of new requests and per-request caps — on drafters whose behaviour
is sampled from profiles measured on a real experiment (``DIR/<policy>/rounds.jsonl``, every
policy's rows pooled):

* **acceptance per position**: ``p_k = P(draft token k accepted | tokens 1..k-1 accepted)``, the
  Kaplan-Meier estimate from ``(S, accepted)`` rows (a row that accepted all ``S`` drafts says
  only that the first rejection comes later: it is censored at ``S``). Positions with fewer than
  :data:`~goodspeed.launch.experiments.sim_profiles.MIN_AT_RISK` rows at risk take the pooled rate of the deeper positions.
* **eq. 3's input**: ``alpha_hat`` averages ``min(1, p/q)`` over ALL drafted positions, and under
  greedy decoding a position after the first rejection still matches the target with some
  probability. Each round's mean ratio is read back from the logged ``alpha_hat`` (``r = (a_t -
  (1 - eta) a_(t-1)) / eta``), and ``post_match`` is the share of ratio mass on the positions after
  the first rejection (0 for a drafter whose later positions never match).
* **time**: a drafter's receive time (round open -> its draft arrived) is ``base + per_token * S``,
  fitted per drafter by least squares, plus a link round trip for synthetic drafters; the
  verification step is TurboSpec's latency model (arXiv 2406.14066, eq. 3) fitted to the real rounds'
  verification seconds against the tokens each step verifies and prefills: every row's ``S + 1``
  as the packed forward takes them (profiles fitted before it, the shipped ones: ``rows * longest
  row``, as the engine padded every row then; :attr:`RunProfile.step_tokens`). A synchronous round
  lasts its slowest drafter's receive time plus the step plus the measured median send time.

Besides the realised goodput ``x`` each simulated round records ``E[x | S] = 1 + sum_{k <= S}
p_1 ... p_k``, the allocation's worth without the acceptance draws' noise: its utility curve
settles when the allocation does (``rounds_to_settle_expected``), where ``U(x̄(T))`` on the draws
settles only as fast as averages of noisy draws do. Each policy runs with the smoothing it was
chosen with (:func:`goodspeed.scheduler.policy.smoothing_of`) unless the spec sets ``eta``.

Acceptance draws are independent between rounds: the real drafters' acceptance also drifts with
the text (prompt to prompt), which the simulator does not model; the validation table in
docs/EXPERIMENT-LOG.md says how much that matters. Drafters take part in every round (the real
synchronous runs have no missed rounds) and ignore end-of-sequence tokens (requests run to
``max_new_tokens``). Asynchronous rounds (``--rounds async``) are not simulated: every round
here waits for its slowest drafter. Each finished request's simulated seconds per token are
recorded too, which capacity at a TPOT SLO reads (:mod:`goodspeed.launch.experiments.sim_capacity`).

Scaling to ``N`` drafters (``--drafters N``) draws each synthetic drafter from the measured
profiles (round robin), scales its per-position log-acceptance by a factor drawn log-uniformly
from ``[1/spread, spread]`` (heterogeneous acceptance) and gives it a link round trip drawn
log-uniformly from ``--rtt-ms LO,HI``; the budget scales with ``N`` (``C * N / N_spec``).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from goodspeed.launch.experiments.report import goodput_matrix, jain_index, longest_run, markdown_table, read_rows, rounds_to_settle, utility_curve
from goodspeed.launch.experiments.sim_profiles import DrafterProfile, RunProfile, SimulationError
from goodspeed.scheduler import DraftAllotments, LatencyModel, SmoothingConfig, make_policy, smoothing_of
from goodspeed.scheduler.policy import DraftLengthPolicy


# ------------------------------------------------------------------------------------ fitting


# ---------------------------------------------------------------------------------- simulation


@dataclass(frozen=True)
class SimDrafter:
    name: str
    profile: DrafterProfile
    max_new_tokens: int


@dataclass(frozen=True)
class SimSettings:
    policy: str | DraftLengthPolicy  # a registered name, or a policy object (e.g. with options)
    budget: int
    rounds: int
    smoothing: SmoothingConfig = field(default_factory=SmoothingConfig)
    max_draft_len: int = 16
    seed: int = 0


@dataclass
class SimResult:
    """Per round and drafter: ``S`` drafted, ``x`` gained and ``E[x | S]``; per round its simulated
    seconds and the wall seconds the scheduling code took; per finished request its drafter and
    simulated seconds per token (its rounds' seconds over its ``max_new_tokens``)."""

    names: list[str]
    drafted: np.ndarray  # [rounds, N]
    x: np.ndarray  # [rounds, N]
    expected_x: np.ndarray  # [rounds, N]: the allocation's worth without the acceptance draws' noise
    round_s: np.ndarray  # [rounds] simulated
    step_s: np.ndarray  # [rounds] simulated verification step
    schedule_s: np.ndarray  # [rounds] measured: eqs. 3-4 and the policy
    request_drafter: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # [requests finished]
    request_tpot_s: np.ndarray = field(default_factory=lambda: np.zeros(0))  # [requests finished]

    def metrics(self) -> dict:
        start, u = utility_curve(self.x)
        _, expected = utility_curve(self.expected_x)
        tokens = self.x.sum(axis=0)
        rounds = len(self.x)
        per_round = tokens / max(rounds, 1)
        return {
            "rounds": rounds,
            "drafters": len(self.names),
            "utility": float(u[-1]) if u.size else float("nan"),
            "utility_per_drafter": float(u[-1]) / len(self.names) if u.size else float("nan"),
            "rounds_to_settle": rounds_to_settle(u),
            "expected_utility": float(expected[-1]) if expected.size else float("nan"),
            "rounds_to_settle_expected": rounds_to_settle(expected),
            "jain_index": jain_index(per_round),
            "tokens_per_round": dict(zip(self.names, per_round.tolist())),
            "total_tokens_per_s": float(tokens.sum() / self.round_s.sum()) if self.round_s.sum() else 0.0,
            "zero_draft_rounds_mean": float((self.drafted == 0).sum(axis=0).mean()),
            "longest_zero_draft_run": int(max(longest_run((col == 0).tolist()) for col in self.drafted.T)) if self.names else 0,
            "schedule_ms_mean": float(self.schedule_s.mean() * 1000),
            "step_ms_mean": float(self.step_s.mean() * 1000),
            "round_ms_mean": float(self.round_s.mean() * 1000),
            "schedule_share_of_round": float(self.schedule_s.sum() / self.round_s.sum()) if self.round_s.sum() else 0.0,
            "schedule_over_step": float(self.schedule_s.mean() / self.step_s.mean()) if self.step_s.mean() else 0.0,
        }


def simulate(drafters: list[SimDrafter], settings: SimSettings, step: LatencyModel, send_s: float,
             progress: bool = False, prompt_tokens: float = 0.0, packed: bool = False) -> SimResult:
    """Run ``settings.rounds`` synchronous rounds; every drafter takes part in every round. A
    request's prompt (``prompt_tokens``) is prefilled in the step of its first round. ``packed``:
    a step's cost reads the tokens it verifies (every row's ``S + 1``), else every row padded to
    the longest (:attr:`~goodspeed.launch.experiments.sim_profiles.RunProfile.step_tokens`)."""
    n, depth = len(drafters), max(1, settings.max_draft_len)
    if n == 0 or settings.rounds < 1:
        raise SimulationError("need at least one drafter and one round")
    rng = np.random.default_rng([settings.seed, 0])
    book = DraftAllotments(settings.budget, settings.policy, settings.smoothing, settings.max_draft_len,
                           np.random.default_rng([settings.seed, 1]))
    survival = np.stack([d.profile.survival_row(depth) for d in drafters])  # [N, depth]
    gain = np.stack([d.profile.expected_gain(depth) for d in drafters])  # [N, depth + 1]
    post = np.array([d.profile.post_match for d in drafters])
    base = np.array([d.profile.receive_base_s + d.profile.rtt_s for d in drafters])
    per_token = np.array([d.profile.receive_per_token_s for d in drafters])
    length = np.array([d.max_new_tokens for d in drafters], dtype=np.int64)
    remaining = length.copy()
    clock, started = 0.0, np.zeros(n)  # simulated seconds; when each drafter's request began
    done_drafter: list[int] = []
    done_tpot: list[float] = []
    ids = list(range(n))
    for i in ids:
        book.join(i)
    for i in ids:
        book.start(i, int(remaining[i]))
    drafted = np.zeros((settings.rounds, n), dtype=np.int64)
    gained = np.zeros((settings.rounds, n), dtype=np.int64)
    round_s, step_s, schedule_s = (np.zeros(settings.rounds) for _ in range(3))
    positions = np.arange(depth)
    starting = n  # requests whose prompts this round's step prefills
    for t in tqdm(range(settings.rounds), desc=f"simulate {getattr(settings.policy, 'name', settings.policy)} N={n}", unit="round", file=sys.stderr,
                  disable=not progress, leave=False):
        s = np.array([book.allotted(i) for i in ids], dtype=np.int64)
        passed = rng.random((n, depth)) < survival
        run = np.cumprod(passed & (positions < s[:, None]), axis=1).sum(axis=1)  # leading accepted drafts
        extra = rng.binomial(np.maximum(s - run - 1, 0), post)  # later positions that still match
        x = run + 1
        drafted[t], gained[t] = s, x
        remaining -= x
        verified = int(s.sum()) + n if packed else n * (int(s.max()) + 1)
        step_s[t] = float(step.predict_s(0, verified + prompt_tokens * starting))
        round_s[t] = float(np.max(base + per_token * s)) + step_s[t] + send_s
        clock += round_s[t]
        finished = [i for i in ids if remaining[i] <= 0]
        for i in finished:
            done_drafter.append(i)
            done_tpot.append((clock - started[i]) / length[i])
            started[i] = clock
        t0 = time.perf_counter()
        for i, (si, mi, ei) in enumerate(zip(s.tolist(), run.tolist(), extra.tolist())):
            book.observe(i, [1.0] * (mi + ei) + [0.0] * (si - mi - ei), mi)
        for i in finished:
            book.end(i)
        going_on = [i for i in ids if remaining[i] > 0]
        book.schedule(going_on, [book.cap(int(remaining[i])) for i in going_on], t)
        schedule_s[t] = time.perf_counter() - t0
        for i in finished:  # the drafter's next request arrives before the next round
            remaining[i] = length[i]
            book.start(i, int(remaining[i]))
        starting = len(finished)
    expected_x = gain[np.arange(n)[None, :], drafted]
    return SimResult([d.name for d in drafters], drafted, gained, expected_x, round_s, step_s, schedule_s,
                     np.array(done_drafter, dtype=np.int64), np.array(done_tpot))


def scaled_drafters(profiles: list[DrafterProfile], max_new_tokens: list[int], n: int, spread: float,
                    rtt_ms: tuple[float, float], seed: int) -> list[SimDrafter]:
    """``n`` synthetic drafters drawn round robin from the measured profiles (see the module
    docstring): acceptance scaled by a log-uniform factor in ``[1/spread, spread]`` on
    ``log p_k``, a log-uniform link round trip in ``rtt_ms``."""
    if not spread >= 1 or not 0 < rtt_ms[0] <= rtt_ms[1]:
        raise SimulationError("spread must be >= 1 and the RTT range 0 < LO <= HI")
    rng = np.random.default_rng([seed, 2])
    out = []
    for j in range(n):
        k = j % len(profiles)
        prof = profiles[k]
        factor = math.exp(rng.uniform(-math.log(spread), math.log(spread)))
        survival = tuple(float(min(1.0, max(1e-9, p)) ** factor) if p > 0 else 0.0 for p in prof.survival)
        rtt = math.exp(rng.uniform(math.log(rtt_ms[0]), math.log(rtt_ms[1]))) / 1000.0
        out.append(SimDrafter(f"{prof.name}-{j}", replace(prof, survival=survival, rtt_s=rtt), max_new_tokens[k]))
    return out


# ---------------------------------------------------------------------------------- reporting


def summarize(per_seed: list[dict]) -> dict:
    """Mean and sample standard deviation over seeds of every scalar metric; per-drafter means."""
    out: dict = {"seeds": len(per_seed)}
    for key, value in per_seed[0].items():
        if isinstance(value, (int, float)):
            values = [m[key] for m in per_seed]
            out[key] = statistics.fmean(values)
            out[key + "_sd"] = statistics.stdev(values) if len(values) > 1 else 0.0
        elif isinstance(value, dict):
            out[key] = {k: statistics.fmean(m[key][k] for m in per_seed) for k in value}
    return out


def expected_settle(rows: list[dict], profile: RunProfile, depth: int = 16) -> int:
    """Rounds a real run's utility takes to settle within 1% when each round's ``x`` is replaced
    by ``E[x | S]`` under the profile: the allocation's convergence without the draws' noise."""
    gains = {d.name: d.expected_gain(depth) for d in profile.drafters}
    smooth = [r | {"x": float(gains[r["drafter"]][min(r["S"], depth)])} for r in rows]
    _, u = utility_curve(goodput_matrix(smooth)[2])
    return rounds_to_settle(u)


def convergence_table(sim: dict[str, dict], real_reports: dict[str, list[dict]], real_rows: dict[str, list[list[dict]]],
                      profile: RunProfile) -> list[dict]:
    """Per policy: rounds to settle within 1%, raw and on ``E[x | S]``, simulated and real (mean over runs)."""
    out = []
    for policy, s in sim.items():
        runs = real_rows.get(policy) or []
        if not runs:
            continue
        out.append({"policy": policy, "sim": s["rounds_to_settle"], "sim_expected": s["rounds_to_settle_expected"],
                    "real": [r["rounds_to_settle"] for r in real_reports[policy]],
                    "real_expected": [expected_settle(rows, profile) for rows in runs]})
    return out


def validation_table(sim: dict[str, dict], real: dict[str, list[dict]]) -> list[dict]:
    """Per policy and drafter: simulated vs real tokens/round (real: mean over the real runs)."""
    rows = []
    for policy, s in sim.items():
        runs = real.get(policy) or []
        if not runs:
            continue
        for d, sim_tpr in s["tokens_per_round"].items():
            real_tpr = statistics.fmean(r["tokens_per_round"][d] for r in runs)
            rows.append({"policy": policy, "drafter": d, "sim": sim_tpr, "real": real_tpr, "rel_err": sim_tpr / real_tpr - 1.0})
        real_u = statistics.fmean(r["utility"] for r in runs)
        rows.append({"policy": policy, "drafter": "U", "sim": s["utility"], "real": real_u, "rel_err": s["utility"] / real_u - 1.0})
    return rows


def simulation_markdown(title: str, results: dict[str, dict], validation: list[dict] | None,
                        convergence: list[dict] | None = None) -> str:
    """SIMULATION.md: each policy's simulated figures, then the comparisons with real runs."""
    lines = [f"# Simulation {title}", ""]
    lines += markdown_table(
        ["policy", "drafters", "U (mean ± sd)", "U on E[x\\|S]", "U / drafter", "Jain", "tokens/s (simulated)",
         "rounds to settle (1%)", "on E[x\\|S]", "longest S = 0 run", "scheduling ms/round", "scheduling / step",
         "scheduling share of round"],
        ([policy, f"{m['drafters']:.0f}", f"{m['utility']:.3f} ± {m['utility_sd']:.3f}",
          f"{m['expected_utility']:.3f} ± {m['expected_utility_sd']:.3f}", f"{m['utility_per_drafter']:.4f}",
          f"{m['jain_index']:.3f}", f"{m['total_tokens_per_s']:.1f}", f"{m['rounds_to_settle']:.0f}",
          f"{m['rounds_to_settle_expected']:.0f}", f"{m['longest_zero_draft_run']:.0f}", f"{m['schedule_ms_mean']:.3f}",
          f"{m['schedule_over_step']:.4f}", f"{m['schedule_share_of_round']:.4f}"] for policy, m in results.items()))
    if validation:
        lines += ["", "## Against the real runs (tokens per round; U)", ""]
        lines += markdown_table(["policy", "drafter", "simulated", "real", "error"],
                                ([v["policy"], v["drafter"], f"{v['sim']:.3f}", f"{v['real']:.3f}", f"{v['rel_err'] * 100:+.1f}%"]
                                 for v in validation))
    if convergence:
        lines += ["", "## Rounds until U stays within 1% of its final value", ""]
        lines += markdown_table(["policy", "simulated", "real runs", "simulated, on E[x\\|S]", "real runs, on E[x\\|S]"],
                                ([c["policy"], f"{c['sim']:.0f}", ", ".join(map(str, c["real"])), f"{c['sim_expected']:.0f}",
                                  ", ".join(map(str, c["real_expected"]))] for c in convergence))
    return "\n".join(lines) + "\n"


def spec_drafters(spec, profile: RunProfile) -> list[SimDrafter]:
    """The spec's drafters, each with the profile of the same name."""
    known = profile.by_name()
    out = []
    for d in spec.expanded_drafters():
        if d.name not in known:
            raise SimulationError(f"drafter {d.name!r} has no profile (profiled: {', '.join(sorted(known))})")
        out.append(SimDrafter(d.name, known[d.name], d.max_new_tokens))
    return out


def run_simulation(spec_file: str | Path, profile: RunProfile, out_dir: Path | None = None, *, drafters: int | None = None,
                   seeds: int = 3, rounds: int | None = None, policies: tuple[str, ...] | None = None, spread: float = 1.5,
                   rtt_ms: tuple[float, float] = (2.0, 200.0), smoothing: SmoothingConfig | None = None,
                   validate: list[Path] | None = None, log=print) -> dict:
    """Simulate every policy of an experiment spec over ``seeds`` seeds; optionally at ``drafters``
    synthetic drafters, and against real experiment directories (``validate``)."""
    from goodspeed.launch.experiments.experiment import load_experiment

    exp, spec = load_experiment(spec_file)
    base = spec_drafters(spec, profile)
    rounds = rounds or exp.rounds
    policies = policies or exp.policies
    if seeds < 1 or rounds < 2 or (drafters is not None and drafters < 1):
        raise SimulationError("need seeds >= 1, rounds >= 2 and drafters >= 1")
    for policy in policies:
        try:
            make_policy(policy)
        except ValueError as exc:
            raise SimulationError(str(exc)) from None
    budget = spec.verifier.budget
    if drafters is not None and drafters != len(base):
        budget = max(1, round(spec.verifier.budget * drafters / len(base)))
    results = {}
    for policy in policies:
        per_seed = []
        for seed in range(seeds):
            pool = base if drafters is None else scaled_drafters([d.profile for d in base], [d.max_new_tokens for d in base],
                                                                 drafters, spread, rtt_ms, seed)
            settings = SimSettings(policy, budget, rounds, smoothing or smoothing_of(policy, spec.verifier.eta, spec.verifier.beta),
                                   spec.verifier.max_draft_len, seed)
            per_seed.append(simulate(pool, settings, profile.step, profile.send_s, progress=True,
                                     prompt_tokens=profile.prompt_tokens, packed=profile.step_tokens == "packed").metrics())
        results[policy] = summarize(per_seed)
        m = results[policy]
        log(f"{policy}: U {m['utility']:.3f} ± {m['utility_sd']:.3f}, Jain {m['jain_index']:.3f}, "
            f"settles in {m['rounds_to_settle']:.0f} rounds, scheduling {m['schedule_ms_mean']:.2f} ms/round")
    validation = convergence = None
    if validate:
        real: dict[str, list[dict]] = defaultdict(list)
        real_rows: dict[str, list[list[dict]]] = defaultdict(list)
        for run in validate:
            try:
                report = json.loads((Path(run) / "report.json").read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise SimulationError(f"--validate {run}: no report of a real run ({exc})") from None
            for policy, metrics in report.items():
                real[policy].append(metrics)
                rows_file = Path(run) / policy / "rounds.jsonl"
                if rows_file.exists():
                    real_rows[policy].append(read_rows(rows_file))
        validation = validation_table(results, real)
        convergence = convergence_table(results, real, real_rows, profile)
    title = f"{exp.name}: {len(base) if drafters is None else drafters} drafters, C = {budget}, {rounds} rounds, {seeds} seeds"
    summary = {"title": title, "budget": budget, "rounds": rounds, "profile": profile.source, "results": results,
               "validation": validation, "convergence": convergence}
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "simulation.json").write_text(json.dumps(summary, indent=2))
        (out_dir / "SIMULATION.md").write_text(simulation_markdown(title, results, validation, convergence))
        log(f"report: {out_dir / 'SIMULATION.md'}")
    return summary
