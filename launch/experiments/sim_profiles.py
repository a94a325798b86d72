"""Profiles of real runs, as :mod:`goodspeed.launch.experiments.simulate` draws its drafters from them: each
drafter's acceptance per position (Kaplan-Meier over ``(S, accepted)`` rows), the share of eq. 3's
ratio mass after the first rejection, and its receive time; the verification step's latency model.
Fitted from an experiment's rows (:func:`fit_profile`), stored as JSON and read back
(:func:`load_profile`); the model behind each field is in the simulator's docstring."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from goodspeed.launch.experiments.report import read_rows
from goodspeed.scheduler import LatencyModel


PROFILES_DIR = Path(__file__).resolve().parent / "profiles"


MIN_AT_RISK = 30  # rows at risk below which a position's acceptance is pooled with the deeper ones


PROFILE_VERSION = 1


class SimulationError(ValueError):
    """A profile, spec or setting the simulator cannot use."""


@dataclass(frozen=True)
class DrafterProfile:
    """One drafter's measured behaviour (see the module docstring)."""

    name: str
    survival: tuple[float, ...]  # p_k for k = 1..K; deeper positions use the last value
    post_match: float
    receive_base_s: float
    receive_per_token_s: float
    rtt_s: float = 0.0  # a link's round trip on top of the measured receive time
    rows: int = 0  # rows the profile was fitted on

    def survival_row(self, depth: int) -> np.ndarray:
        p = np.asarray(self.survival, dtype=np.float64)
        if depth <= p.size:
            return p[:depth]
        return np.concatenate([p, np.full(depth - p.size, p[-1] if p.size else 0.0)])

    def expected_gain(self, depth: int) -> np.ndarray:
        """``E[x | S]`` for ``S = 0..depth``: ``1 + sum_{k <= S} p_1 ... p_k``."""
        return 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(self.survival_row(depth)))])


@dataclass(frozen=True)
class RunProfile:
    """Every drafter's profile, the verifier's step cost and the smoothing the run used."""

    drafters: tuple[DrafterProfile, ...]
    step: LatencyModel
    send_s: float
    source: str = ""
    prompt_tokens: float = 0.0  # prompt tokens prefilled per request (0: not measured; profiles before it)
    # What the step's fit counted: "packed", the tokens a step verifies and prefills (every row's
    # S + 1); "padded", every row padded to the longest (profiles fitted before packed forwards)
    step_tokens: str = "padded"

    def to_dict(self) -> dict:
        return {"version": PROFILE_VERSION, "source": self.source, "send_s": self.send_s, "step": self.step.to_dict(),
                "step_tokens": self.step_tokens, "prompt_tokens": self.prompt_tokens,
                "drafters": [asdict(d) | {"survival": list(d.survival)} for d in self.drafters]}

    @classmethod
    def from_dict(cls, data: dict) -> "RunProfile":
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {data.get('version')!r}; this simulator reads version {PROFILE_VERSION}")
        drafters = tuple(DrafterProfile(**(d | {"survival": tuple(d["survival"])})) for d in data["drafters"])
        step_tokens = data.get("step_tokens", "padded")
        if step_tokens not in ("packed", "padded"):
            raise ValueError(f"step_tokens {step_tokens!r}: packed or padded")
        return cls(drafters, LatencyModel.from_dict(data["step"]), float(data["send_s"]), data.get("source", ""),
                   float(data.get("prompt_tokens", 0.0)), step_tokens)

    def by_name(self) -> dict[str, DrafterProfile]:
        return {d.name: d for d in self.drafters}


def survival_from_rows(drafted: np.ndarray, accepted: np.ndarray, min_at_risk: int = MIN_AT_RISK) -> tuple[float, ...]:
    """Kaplan-Meier ``p_k`` from per-round ``(S, accepted)``; positions with fewer than
    ``min_at_risk`` rows at risk share one pooled rate (so ``p`` ends where evidence ends)."""
    drafted, accepted = np.asarray(drafted), np.asarray(accepted)
    if np.any(accepted > drafted) or np.any(accepted < 0):
        raise ValueError("accepted must lie in [0, S]")
    depth = int(drafted.max(initial=0))
    at_risk = np.array([np.sum((accepted >= k - 1) & (drafted >= k)) for k in range(1, depth + 1)], dtype=np.float64)
    passed = np.array([np.sum(accepted >= k) for k in range(1, depth + 1)], dtype=np.float64)
    reliable = int(np.argmin(at_risk >= min_at_risk)) if np.any(at_risk < min_at_risk) else depth
    if reliable == 0:
        if at_risk.sum() == 0:
            raise ValueError("no drafted tokens to fit acceptance on")
        return (float(passed.sum() / at_risk.sum()),)
    p = list(passed[:reliable] / at_risk[:reliable])
    if reliable < depth and at_risk[reliable:].sum() > 0:
        p.append(float(passed[reliable:].sum() / at_risk[reliable:].sum()))
    return tuple(float(v) for v in p)


def fit_profile(rows: list[dict], eta: float = 0.2, source: str = "", prefill_steps_tokens: int = 0) -> RunProfile:
    """Fit every drafter's profile and the step cost from experiment rows (all policies pooled).
    ``prefill_steps_tokens``: prompt tokens prefilled in steps of their own (a verifier log's
    ``prefill`` events), counted in the prompt tokens per request with those the rows' steps prefilled."""
    by_run: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in rows:
        by_run[(r.get("policy", ""), r["drafter"])].append(r)
    per_drafter: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for (_, name), rs in by_run.items():
        rs.sort(key=lambda r: r["round"])
        acc = per_drafter[name]
        for prev, r in zip([None] + rs[:-1], rs):
            acc["S"].append(r["S"])
            acc["m"].append(r["accepted"])
            if r.get("drafter_receive_s") is not None:
                acc["recv_S"].append(r["S"])
                acc["recv"].append(r["drafter_receive_s"])
            if prev is not None and r["S"] > r["accepted"] + 1:
                run_eta = r.get("eta") or eta  # rows record the run's eta (older runs: the given one)
                ratio = (r["alpha_hat"] - (1.0 - run_eta) * prev["alpha_hat"]) / run_eta
                acc["extra"].append(max(0.0, ratio * r["S"] - r["accepted"]))
                acc["room"].append(r["S"] - r["accepted"] - 1)
    drafters = []
    for name in sorted(per_drafter):
        acc = per_drafter[name]
        post = min(1.0, sum(acc["extra"]) / sum(acc["room"])) if sum(acc["room"]) else 0.0
        base, per_token = _line(*_usual(acc["recv_S"], acc["recv"]))
        drafters.append(DrafterProfile(name, survival_from_rows(np.array(acc["S"]), np.array(acc["m"])), post,
                                       base, per_token, rows=len(acc["S"])))
    step, send = _fit_step(rows)
    return RunProfile(tuple(drafters), step, send, source, _prompt_tokens(rows, prefill_steps_tokens), "packed")


def _prompt_tokens(rows: list[dict], elsewhere: int = 0) -> float:
    """Prompt tokens prefilled per finished request: those the rows' steps prefilled and
    ``elsewhere``, over the requests the rows finished (0 when none did)."""
    finished = sum(bool(r.get("finished")) for r in rows)
    prefilled = {(r.get("policy", ""), r["round"]): r.get("prefill_tokens") or 0 for r in rows}
    return float(sum(prefilled.values()) + elsewhere) / finished if finished else 0.0


RECEIVE_OUTLIER_RATIO = 4.0  # receive times over this many times the median at their S stay out of the fit


def _usual(s: list, receive: list) -> tuple[list, list]:
    """The receive samples without those over :data:`RECEIVE_OUTLIER_RATIO` times the median at
    their ``S``: a round that waited for a drafter between two of its requests (a client's
    pause, a prompt's prefill) says nothing of its drafting and link, which is what the
    simulator's drafters model (their next request arrives before the next round)."""
    median = {v: float(np.median([r for t, r in zip(s, receive) if t == v])) for v in set(s)}
    kept = [(t, r) for t, r in zip(s, receive) if r <= RECEIVE_OUTLIER_RATIO * median[t]]
    return [t for t, _ in kept], [r for _, r in kept]


def _line(x: list, y: list) -> tuple[float, float]:
    """Least-squares ``y = a + b x`` (non-negative ``a``, ``b``); constant when ``x`` never varies."""
    if not y:
        return 0.0, 0.0
    xs, ys = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if np.ptp(xs) == 0:
        return float(np.median(ys)), 0.0
    b, a = np.polyfit(xs, ys, 1)
    return max(0.0, float(a)), max(0.0, float(b))


def _fit_step(rows: list[dict]) -> tuple[LatencyModel, float]:
    rounds: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for r in rows:
        rounds[(r.get("policy", ""), r["round"])].append(r)
    # A packed step's tokens: every row's S + 1, and the prompt tokens it prefills.
    batched = [sum(r["S"] + 1 for r in rs) + (rs[0].get("prefill_tokens") or 0) for rs in rounds.values()]
    verify = [rs[0]["verify_s"] for rs in rounds.values()]
    send = float(np.median([rs[0]["send_s"] for rs in rounds.values()]))
    if len(set(batched)) < 2:
        return LatencyModel(0.0, 0.0, float(np.median(verify))), send
    # The rounds do not record context lengths: the fit is eq. (3) with alpha = 0.
    gamma, delta = _line(batched, verify)[::-1]
    return LatencyModel(0.0, gamma, delta), send


def every_policys_rows(run_dir: Path) -> list[dict]:
    """Every policy's rows of an experiment directory (``DIR/<policy>/rounds.jsonl``)."""
    files = sorted(Path(run_dir).glob("*/rounds.jsonl"))
    if not files:
        raise FileNotFoundError(f"{run_dir}: no <policy>/rounds.jsonl (the output of `goodspeed experiment`)")
    return [r for f in files for r in read_rows(f)]


def fit_log(path: Path, eta: float = 0.2) -> RunProfile:
    """A profile from a verifier's JSON log: its round events with drafters in them, and the
    prompt tokens of its ``prefill`` events (edge sessions' prompts, prefilled in steps of their own)."""
    from goodspeed.launch.experiments.experiment import rows_from_log

    rows = rows_from_log(path, "log")
    if not rows:
        raise ValueError("no round with a drafter in it")
    prefilled = 0
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("{") and '"prefill"' in line and (event := json.loads(line)).get("event") == "prefill":
            prefilled += int(event["tokens"])
    return fit_profile(rows, eta, source=str(path), prefill_steps_tokens=prefilled)


def profile_path(given: str | Path | None, experiment: str) -> Path:
    """``given`` (an experiment directory or a profile JSON), else the profile shipped for the
    experiment (``launch/experiments/profiles/<name>.json``)."""
    if given is not None:
        return Path(given)
    shipped = PROFILES_DIR / f"{experiment}.json"
    if not shipped.exists():
        known = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.json"))) or "none"
        raise SimulationError(f"no profile shipped for {experiment!r} (shipped: {known}); pass --profile DIR "
                              "with a real run of the spec (`goodspeed experiment SPEC --out DIR`)")
    return shipped


def load_profile(path: str | Path, eta: float = 0.2) -> RunProfile:
    """A profile JSON (``--save-profile``), or an experiment directory or a verifier's JSON log
    (its round events: any deployment's) to fit one from."""
    path = Path(path)
    try:
        if path.is_dir():
            return fit_profile(every_policys_rows(path), eta, source=str(path))
        text = path.read_text(encoding="utf-8")
        try:
            data = json.loads(text)
        except ValueError:  # not one JSON document: a log, one event a line
            return fit_log(path, eta)
        return RunProfile.from_dict(data)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SimulationError(f"{path}: not a usable profile: {exc}") from None


def parse_range(text: str) -> tuple[float, float]:
    """``"LO,HI"`` (or one number) as a float pair with ``0 < LO <= HI``."""
    lo, _, hi = text.partition(",")
    try:
        pair = (float(lo), float(hi or lo))
    except ValueError:
        raise SimulationError(f"expected LO,HI in ms, got {text!r}") from None
    if not 0 < pair[0] <= pair[1]:
        raise SimulationError(f"expected 0 < LO <= HI, got {text!r}")
    return pair
