"""``goodspeed compare``: one experiment spec run several times (e.g. ``--seed 1, 2, 3``), side by side.

Each run directory is what ``goodspeed experiment --out DIR`` wrote (``report.json`` and
``<policy>/rounds.jsonl``). Per policy the comparison gives every run's final utility
``U(x̄(T))`` (GoodSpeed, arXiv 2512.09963, Fig. 4) with the mean and sample standard
deviation, the same for ``U`` on each drafter's tokens per second (the time-aware utility; a report
written before it was recorded says so instead), Jain's index, the longest run of rounds any
drafter was allotted ``S = 0``, and the
rounds until U stays within 1% of its final value, measured twice:

* on the realised goodput ``x_i(t)``, as the experiment report does. With a few drafters this is
  mostly the noise of the acceptance draws: ``x̄_i(T)`` is an average of ``T`` draws, so even a
  policy that never changes its allocation (Fixed-S) takes hundreds of rounds to settle;
* on the expected goodput of the allocation, ``E[x_i | S_i(t)] = 1 + sum_{k <= S} p_1 ... p_k`` with
  each drafter's per-position acceptance ``p_k`` fitted on all the runs together
  (:func:`goodspeed.launch.experiments.sim_profiles.fit_profile`): the same curve without the draws' noise, so it
  settles when the allocation does.

``COMPARISON.md``, ``comparison.json`` and ``fig_utility_by_run.png`` (U per run and policy; U(x̄(T))
of every run) go to ``--out``.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

import numpy as np

from goodspeed.launch.experiments.report import goodput_matrix, markdown_table, read_rows, utility_curve
from goodspeed.launch.experiments.sim_profiles import SimulationError, fit_profile
from goodspeed.launch.experiments.simulate import expected_settle


def load_run(run_dir: Path) -> tuple[dict, dict[str, list[dict]]]:
    """``(report, rows by policy)`` of one experiment directory."""
    try:
        report = json.loads((run_dir / "report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SimulationError(f"{run_dir}: not an experiment directory ({exc})") from None
    rows = {}
    for policy in report:
        path = run_dir / policy / "rounds.jsonl"
        if not path.exists():
            raise SimulationError(f"{path}: missing (the report names policy {policy!r})")
        rows[policy] = read_rows(path)
    return report, rows


def compare_runs(run_dirs: list[Path], out_dir: Path | None = None) -> dict:
    if not run_dirs:
        raise SimulationError("give at least one experiment directory")
    runs = [load_run(Path(d)) for d in run_dirs]
    profile = fit_profile([r for _, rows in runs for policy_rows in rows.values() for r in policy_rows])
    table: dict[str, dict] = defaultdict(lambda: defaultdict(list))
    for report, rows in runs:
        for policy, m in report.items():
            t = table[policy]
            t["utility"].append(m["utility"])
            t["utility_per_s"].append(m.get("utility_per_s"))  # None: a report from before it was recorded
            t["jain_index"].append(m["jain_index"])
            t["total_tokens_per_s"].append(m["total_tokens_per_s"])
            t["rounds_to_settle"].append(m["rounds_to_settle"])
            t["rounds_to_settle_expected"].append(expected_settle(rows[policy], profile))
            t["longest_zero_draft_run"].append(max(m["longest_zero_draft_run"].values(), default=0))
    summary = {"runs": [str(d) for d in run_dirs], "policies": {}}
    for policy, t in table.items():
        entry = dict(t) | _mean_sd("utility", t["utility"])
        if None in t["utility_per_s"]:
            del entry["utility_per_s"]  # not in every run's report: shown as such, never averaged over fewer runs
        else:
            entry |= _mean_sd("utility_per_s", t["utility_per_s"])
        summary["policies"][policy] = entry
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "comparison.json").write_text(json.dumps(summary, indent=2))
        (out_dir / "COMPARISON.md").write_text(comparison_markdown(summary))
        _figure(runs, out_dir / "fig_utility_by_run.png")
    return summary


def _mean_sd(key: str, values: list[float]) -> dict:
    return {f"{key}_mean": statistics.fmean(values), f"{key}_sd": statistics.stdev(values) if len(values) > 1 else 0.0}


def comparison_markdown(summary: dict) -> str:
    """COMPARISON.md: each policy's figures in every run compared, and their mean and spread."""
    def joined(values, fmt="{}"):
        return ", ".join(fmt.format(v) for v in values)

    def per_second(t):
        if "utility_per_s" not in t:
            return ["not in every run's report", "-"]
        return [joined(t["utility_per_s"], "{:.3f}"), f"{t['utility_per_s_mean']:.3f} ± {t['utility_per_s_sd']:.3f}"]

    lines = ["# Runs compared", "", "Runs: " + ", ".join(f"`{r}`" for r in summary["runs"]), ""]
    lines += markdown_table(
        ["policy", "U(x̄) per run", "mean ± sd", "U(tok/s) per run", "mean ± sd", "rounds to settle (1%)", "on E[x\\|S]",
         "Jain (mean)", "tok/s (mean)", "longest S = 0 run"],
        ([policy, joined(t["utility"], "{:.3f}"), f"{t['utility_mean']:.3f} ± {t['utility_sd']:.3f}", *per_second(t),
          joined(t["rounds_to_settle"]), joined(t["rounds_to_settle_expected"]), f"{statistics.fmean(t['jain_index']):.3f}",
          f"{statistics.fmean(t['total_tokens_per_s']):.0f}", joined(t["longest_zero_draft_run"])]
         for policy, t in summary["policies"].items()))
    return "\n".join(lines + ["", "![U per run](fig_utility_by_run.png)", ""])


def _figure(runs: list[tuple[dict, dict[str, list[dict]]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(runs[0][0])
    colors = {p: f"C{i}" for i, p in enumerate(policies)}
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for i, policy in enumerate(policies):
        u = [report[policy]["utility"] for report, _ in runs if policy in report]
        left.scatter([i] * len(u), u, color=colors[policy], s=14)
        left.errorbar(i + 0.15, np.mean(u), yerr=np.std(u, ddof=1) if len(u) > 1 else 0, fmt="_", color=colors[policy], capsize=4)
    left.set_xticks(range(len(policies)), policies, rotation=20, fontsize=8)
    left.set(title="U(x̄) per run (bar: mean ± sd)", ylabel="utility")
    for k, (report, rows) in enumerate(runs):
        for policy in report:
            start, u = utility_curve(goodput_matrix(rows[policy])[2])
            right.plot(np.arange(start + 1, start + 1 + len(u)), u, color=colors.get(policy, "k"), alpha=0.6, lw=1,
                       label=policy if k == 0 else None)
    lo = min(min(r[p]["utility"] for p in r) for r, _ in runs)
    right.set_ylim(lo - 0.3, None)
    right.set(title="U(x̄(T)), every run", xlabel="round T")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
