"""The fairness report: GoodSpeed's evaluation metrics and figures, from the raw per-round rows.

Inputs are the rows an experiment records (one per round and drafter: ``policy``, ``round``,
``drafter``, ``S``, ``accepted``, ``x``, ``alpha_hat``, ``X``, ``receive_s``, ``verify_s``,
``send_s``, ``ts``, ``drafter_receive_s``: round open -> that drafter's draft arrived,
``transit``: of ``x``, the tokens decoded while its draft was in transit, and ``transit_steps``:
the steps for transit rows alone since the previous step, whose seconds its receive and verify
seconds include). Everything in the report is computed here and nowhere else
(GoodSpeed, arXiv 2512.09963, Section IV):

* Fig. 2 — estimated goodput (sum of the smoothed ``X_i``, eq. 4) vs real goodput (sum of
  ``x_i(t) = m_i + 1``) per round, with a moving average (window 10) and a std band;
* Fig. 3 — wall time per policy split into receiving, verification and sending;
* Fig. 4 — ``U(xbar(T)) = sum_i log xbar_i(T)``, ``xbar_i(T) = (1/T) sum_{t<=T} x_i(t)`` (a drafter
  absent from a round gained 0 in it), from the first round by which every drafter took part;
* per policy: per-drafter goodput (tokens/round and tokens/s), Jain's fairness index of the
  per-drafter tokens/round, final U, total tokens/s, and the rounds until U stays within 1% of
  its final value; per drafter also its median receive time (what an edge link adds shows here),
  and how often and how long in a row it was allotted ``S = 0`` (starvation, which eq. 3 cannot
  correct while it lasts), and the share of its tokens decoded while its draft was in transit
  (runs with transit decoding, ``--transit``);
* the time-aware utility ``U_s = sum_i log r_i``, ``r_i`` drafter ``i``'s tokens per second over
  the run (what the async round mode and ``goodspeed-time`` optimise,
  :mod:`goodspeed.scheduler.timing`), each drafter's median cycle (its verdict sent -> its next
  draft arrived: link plus drafting, ``drafter_cycle_s``) and Fig. 5, each drafter's tokens per
  second over time (1-second bins).

A run named ``POLICY@async`` ran the verifier in async mode; its "rounds" are verification steps.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

MA_WINDOW = 10


def read_rows(path: Path) -> list[dict]:
    """The rows of one ``rounds.jsonl`` (blank lines skipped)."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def goodput_matrix(rows: list[dict]) -> tuple[list[int], list[str], np.ndarray]:
    """``x[t, i]``: tokens drafter ``i`` gained in the policy's ``t``-th round (0 if absent)."""
    rounds = sorted({r["round"] for r in rows})
    drafters = sorted({r["drafter"] for r in rows})
    t_of, i_of = {t: k for k, t in enumerate(rounds)}, {d: k for k, d in enumerate(drafters)}
    x = np.zeros((len(rounds), len(drafters)))
    for r in rows:
        x[t_of[r["round"]], i_of[r["drafter"]]] += r["x"]
    return rounds, drafters, x


def utility_curve(x: np.ndarray) -> tuple[int, np.ndarray]:
    """``(first_T, U[T])`` for T from the first round by which every drafter had gained tokens."""
    seen = np.cumsum(x, axis=0)  # [T, N]
    ready = np.flatnonzero(np.all(seen > 0, axis=1))
    if ready.size == 0:
        return len(x), np.zeros(0)
    start = int(ready[0])
    t = np.arange(start + 1, len(x) + 1)[:, None]
    return start, np.log(seen[start:] / t).sum(axis=1)


def rounds_to_settle(u: np.ndarray, tolerance: float = 0.01) -> int:
    """How many of the curve's rounds pass before U stays within ``tolerance`` of its final value."""
    if u.size == 0:
        return 0
    outside = np.flatnonzero(np.abs(u - u[-1]) > tolerance * abs(u[-1]))
    return int(outside[-1] + 1) if outside.size else 0


def jain_index(values: np.ndarray) -> float:
    values = np.asarray(values, dtype=np.float64)
    return float(values.sum() ** 2 / (values.size * (values**2).sum())) if values.size and values.any() else 0.0


def policy_metrics(rows: list[dict]) -> dict:
    rounds, drafters, x = goodput_matrix(rows)
    per_round: dict[int, dict] = {}
    for r in rows:
        per_round.setdefault(r["round"], r)  # phase times are per round, repeated on each row
    span_s = max(r["ts"] for r in rows) - min(r["ts"] for r in rows) if rows else 0.0
    start, u = utility_curve(x)
    tokens = x.sum(axis=0)
    return {
        "rounds": len(rounds),
        "drafters": drafters,
        "tokens_per_round": dict(zip(drafters, (tokens / max(len(rounds), 1)).tolist())),
        "tokens_per_s": dict(zip(drafters, (tokens / span_s if span_s else tokens * 0).tolist())),
        "jain_index": jain_index(tokens / max(len(rounds), 1)),
        "utility": float(u[-1]) if u.size else float("nan"),
        "utility_from_round": start + 1,
        "rounds_to_settle": rounds_to_settle(u),
        "total_tokens_per_s": float(tokens.sum() / span_s) if span_s else 0.0,
        "utility_per_s": float(np.log(tokens / span_s).sum()) if span_s and tokens.all() else float("nan"),
        "cycle_ms_median": {d: _median_ms(rows, d, "drafter_cycle_s") for d in drafters},
        "receive_s": float(sum(r["receive_s"] for r in per_round.values())),
        "verify_s": float(sum(r["verify_s"] for r in per_round.values())),
        "send_s": float(sum(r["send_s"] for r in per_round.values())),
        # Steps for transit rows alone (transit_alone), their seconds in the next step's (rows from before: none).
        "transit_steps": int(sum(r.get("transit_steps", 0) for r in per_round.values())),
        "mean_draft_length": {d: float(np.mean([r["S"] for r in rows if r["drafter"] == d])) for d in drafters},
        "acceptance": {d: _acceptance(rows, d) for d in drafters},
        "receive_ms_median": {d: _median_receive_ms(rows, d) for d in drafters},
        "zero_draft_rounds": {d: sum(r["S"] == 0 for r in rows if r["drafter"] == d) for d in drafters},
        "longest_zero_draft_run": {d: _longest_zero_run(rows, d) for d in drafters},
        # Share of each drafter's tokens the verifier decoded while its draft was in transit (rows
        # from before transit decoding existed carry no "transit": none was).
        "transit_share": {d: _share(sum(r.get("transit", 0) for r in rows if r["drafter"] == d), tokens[i])
                          for i, d in enumerate(drafters)},
    }


def _share(part: float, whole: float) -> float:
    return float(part / whole) if whole else 0.0


def longest_run(flags) -> int:
    """The most consecutive true values."""
    longest = run = 0
    for flag in flags:
        run = run + 1 if flag else 0
        longest = max(longest, run)
    return longest


def _longest_zero_run(rows: list[dict], drafter: str) -> int:
    """The most rounds in a row the drafter took part in with ``S = 0`` (allotted nothing: its
    acceptance estimate cannot change meanwhile, eq. 3)."""
    return longest_run(r["S"] == 0 for r in sorted((r for r in rows if r["drafter"] == drafter), key=lambda r: r["round"]))


def _median_receive_ms(rows: list[dict], drafter: str) -> float:
    return _median_ms(rows, drafter, "drafter_receive_s")


def _median_ms(rows: list[dict], drafter: str, key: str) -> float:
    times = [r[key] for r in rows if r["drafter"] == drafter and r.get(key) is not None]
    return float(np.median(times) * 1000) if times else float("nan")


def rate_over_time(rows: list[dict], bin_s: float = 1.0) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Each drafter's tokens per second in ``bin_s`` bins from the run's first row (bin starts, rates)."""
    if not rows:
        return np.zeros(0), {}
    t0 = min(r["ts"] for r in rows)
    bins = int((max(r["ts"] for r in rows) - t0) // bin_s) + 1
    rates: dict[str, np.ndarray] = {}
    for r in rows:
        rates.setdefault(r["drafter"], np.zeros(bins))[int((r["ts"] - t0) // bin_s)] += r["x"] / bin_s
    return np.arange(bins) * bin_s, dict(sorted(rates.items()))


def _acceptance(rows: list[dict], drafter: str) -> float:
    drafted = sum(r["S"] for r in rows if r["drafter"] == drafter)
    return sum(r["accepted"] for r in rows if r["drafter"] == drafter) / drafted if drafted else 0.0


def moving_average(values: np.ndarray, window: int = MA_WINDOW) -> tuple[np.ndarray, np.ndarray]:
    """Trailing moving average and the square root of the moving variance (the std band)."""
    mean = np.array([values[max(0, k - window + 1) : k + 1].mean() for k in range(len(values))])
    std = np.array([values[max(0, k - window + 1) : k + 1].std() for k in range(len(values))])
    return mean, std


def estimated_vs_real(rows: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """Per round: sum of the smoothed X_i (estimated) and sum of x_i (real)."""
    by_round: dict[int, list[dict]] = defaultdict(list)
    for r in rows:
        by_round[r["round"]].append(r)
    order = sorted(by_round)
    return np.array([sum(r["X"] for r in by_round[t]) for t in order]), np.array([sum(r["x"] for r in by_round[t]) for t in order])


def write_figures(data: dict[str, list[dict]], out_dir: Path) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = {}
    fig, axes = plt.subplots(1, len(data), figsize=(5 * len(data), 3.4), squeeze=False)
    for ax, (policy, rows) in zip(axes[0], data.items()):
        for label, series in zip(("estimated (sum X_i)", "real (sum x_i)"), estimated_vs_real(rows)):
            mean, std = moving_average(series)
            ax.plot(mean, label=label)
            ax.fill_between(np.arange(len(mean)), mean - std, mean + std, alpha=0.25)
        ax.set(title=f"{policy}: goodput per round (MA {MA_WINDOW})", xlabel="round", ylabel="tokens")
        ax.legend(fontsize=8)
    paths["fig2"] = _save(fig, out_dir / "fig2_goodput.png")
    metrics = {p: policy_metrics(r) for p, r in data.items()}
    fig, ax = plt.subplots(figsize=(5, 3.4))
    bottom = np.zeros(len(metrics))
    for part in ("receive_s", "verify_s", "send_s"):
        values = np.array([m[part] for m in metrics.values()])
        ax.bar(list(metrics), values, bottom=bottom, label=part.removesuffix("_s"))
        bottom += values
    ax.set(title="wall time by phase", ylabel="seconds")
    ax.legend(fontsize=8)
    paths["fig3"] = _save(fig, out_dir / "fig3_wall_time.png")
    fig, ax = plt.subplots(figsize=(5, 3.4))
    for policy, rows in data.items():
        start, u = utility_curve(goodput_matrix(rows)[2])
        ax.plot(np.arange(start + 1, start + 1 + len(u)), u, label=policy)
    ax.set(title="U(xbar(T)) = sum_i log xbar_i(T)", xlabel="round T", ylabel="utility")
    ax.legend(fontsize=8)
    paths["fig4"] = _save(fig, out_dir / "fig4_utility.png")
    fig, axes = plt.subplots(1, len(data), figsize=(5 * len(data), 3.4), squeeze=False, sharey=True)
    for ax, (policy, rows) in zip(axes[0], data.items()):
        starts, rates = rate_over_time(rows)
        for drafter, rate in rates.items():
            ax.plot(starts, rate, label=drafter)
        ax.set(title=f"{policy}: tokens/s per drafter", xlabel="seconds", ylabel="tokens/s")
        ax.legend(fontsize=7)
    paths["fig5"] = _save(fig, out_dir / "fig5_rate_over_time.png")
    return paths


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path.name


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """A markdown table's lines: the header, its rule, and a line per row (cells as they are)."""
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows])


def report_markdown(name: str, metrics: dict[str, dict], figures: dict[str, str]) -> str:
    """An experiment's REPORT.md: every policy's headline figures, then each one's per drafter."""
    lines = [f"# Experiment {name}", ""]
    lines += markdown_table(
        ["policy", "rounds", "U(xbar)", "U(tok/s)", "Jain", "total tok/s", "rounds to settle (1%)", "receive s", "verify s",
         "send s"],
        ([policy, m["rounds"], f"{m['utility']:.4f}", f"{m['utility_per_s']:.3f}", f"{m['jain_index']:.4f}",
          f"{m['total_tokens_per_s']:.2f}", m["rounds_to_settle"], f"{m['receive_s']:.3f}", f"{m['verify_s']:.3f}",
          f"{m['send_s']:.3f}"] for policy, m in metrics.items()))
    for policy, m in metrics.items():
        transit = any(m.get("transit_share", {}).values())  # a column only for runs with transit decoding
        lines += ["", f"## {policy}: per drafter", ""]
        lines += markdown_table(
            ["drafter", "tokens/round", "tokens/s", "mean S", "acceptance", "receive ms (median)", "cycle ms (median)",
             "rounds with S = 0", "longest S = 0 run"] + (["decoded in transit"] if transit else []),
            ([d, f"{m['tokens_per_round'][d]:.4f}", f"{m['tokens_per_s'][d]:.2f}", f"{m['mean_draft_length'][d]:.2f}",
              f"{m['acceptance'][d]:.4f}", f"{m['receive_ms_median'][d]:.1f}", f"{m['cycle_ms_median'][d]:.1f}",
              m["zero_draft_rounds"][d], m["longest_zero_draft_run"][d]] + ([f"{m['transit_share'][d]:.2f}"] if transit else [])
             for d in m["drafters"]))
        if m.get("transit_steps"):
            lines += ["", f"{m['transit_steps']} steps decoded for transit rows alone (`transit_alone`); their seconds "
                          "are in the receive and verify columns, their tokens in the drafters' rows."]
    lines += ["", "## Figures", ""] + [f"![{k}]({v})" for k, v in figures.items()]
    return "\n".join(lines) + "\n"


def write_report(name: str, data: dict[str, list[dict]], out_dir: Path) -> dict:
    metrics = {p: policy_metrics(rows) for p, rows in data.items()}
    figures = write_figures(data, out_dir)
    (out_dir / "report.json").write_text(json.dumps(metrics, indent=2, default=_finite))
    (out_dir / "REPORT.md").write_text(report_markdown(name, metrics, figures))
    return metrics


def _finite(value):
    return None if isinstance(value, float) and not math.isfinite(value) else value
