"""Screen remedies for starved estimates in simulation, on the shipped Table I profiles.

    python -m bench.screen_remedies [--seeds 20] [--rounds 600] [--drafters N] [--json OUT]

Every candidate runs the verifier's scheduling code (:class:`goodspeed.scheduler.DraftAllotments`)
in :func:`goodspeed.launch.experiments.simulate.simulate` on both shipped specs' drafters (their measured
per-position acceptance, ``launch/experiments/profiles/``), ``--seeds`` times each. Per candidate it prints the
mean ± sd over seeds of the final utility on the realised goodput ``U(x̄)`` and on the expected
goodput ``E[x | S]`` (no draw noise), the rounds until each settles within 1%, and the longest
run of rounds any drafter was allotted ``S = 0``. docs/EXPERIMENT-LOG.md tabulates its output.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from goodspeed.launch.experiments.experiment import load_experiment
from goodspeed.launch.experiments.sim_profiles import PROFILES_DIR, load_profile
from goodspeed.launch.experiments.simulate import SimSettings, scaled_drafters, simulate, spec_drafters
from goodspeed.launch.spec import spec_path
from goodspeed.scheduler import SmoothingConfig, make_policy

# (label, policy name, policy options, smoothing)
CANDIDATES = [
    ("paper: eq. 5, eta 0.2", "goodspeed-paper", {}, SmoothingConfig(eta=0.2)),
    ("paper, eta 0.1", "goodspeed-paper", {}, SmoothingConfig(eta=0.1)),
    ("paper, warm start", "goodspeed-paper", {}, SmoothingConfig(eta=0.2, warm_start=True)),
    ("UCB, eta 0.2", "goodspeed-ucb", {}, SmoothingConfig(eta=0.2)),
    ("UCB, warm start", "goodspeed-ucb", {}, SmoothingConfig(eta=0.2, warm_start=True)),
    ("floor, patience 8, eta 0.2", "goodspeed", {"patience": 8}, SmoothingConfig(eta=0.2)),
    ("floor, patience 8, warm start", "goodspeed", {"patience": 8}, SmoothingConfig(eta=0.2, warm_start=True)),
    ("floor, patience 4, eta 0.2", "goodspeed", {"patience": 4}, SmoothingConfig(eta=0.2)),
    ("floor, patience 2, eta 0.1", "goodspeed", {"patience": 2}, SmoothingConfig(eta=0.1)),
    ("floor, patience 4, eta 0.1 (default)", "goodspeed", {"patience": 4}, SmoothingConfig(eta=0.1)),
    ("floor, patience 4, eta 0.1, beta 0.2", "goodspeed", {"patience": 4}, SmoothingConfig(eta=0.1, beta=0.2)),
    ("floor, patience 4, eta 0.05", "goodspeed", {"patience": 4}, SmoothingConfig(eta=0.05)),
    ("floor, patience 4, eta 0.35", "goodspeed", {"patience": 4}, SmoothingConfig(eta=0.35)),
    ("fixed", "fixed", {}, SmoothingConfig()),
    ("random", "random", {}, SmoothingConfig()),
]
KEYS = ("utility", "expected_utility", "rounds_to_settle", "rounds_to_settle_expected", "longest_zero_draft_run")


def screen(spec_name: str, seeds: int, rounds: int, drafters: int | None) -> list[dict]:
    _, spec = load_experiment(spec_path(spec_name))
    profile = load_profile(PROFILES_DIR / f"{spec_name}.json")
    base = spec_drafters(spec, profile)
    budget = spec.verifier.budget if drafters is None else round(spec.verifier.budget * drafters / len(base))
    out = []
    for label, name, options, smoothing in CANDIDATES:
        per_seed = []
        for seed in range(seeds):
            pool = base if drafters is None else scaled_drafters([d.profile for d in base], [d.max_new_tokens for d in base],
                                                                 drafters, 1.5, (2.0, 200.0), seed)
            settings = SimSettings(make_policy(name, **options), budget, rounds, smoothing, spec.verifier.max_draft_len, seed)
            per_seed.append(simulate(pool, settings, profile.step, profile.send_s).metrics())
        row = {"spec": spec_name, "drafters": len(base) if drafters is None else drafters, "candidate": label}
        for k in KEYS:
            values = [m[k] for m in per_seed]
            row[k] = statistics.fmean(values)
            row[k + "_sd"] = statistics.stdev(values) if len(values) > 1 else 0.0
        out.append(row)
        print(f"{spec_name} N={row['drafters']} {label:40s} U {row['utility']:.3f} ± {row['utility_sd']:.3f}  "
              f"U[E x] {row['expected_utility']:.3f} ± {row['expected_utility_sd']:.3f}  settle {row['rounds_to_settle']:.0f} "
              f"/ on E[x] {row['rounds_to_settle_expected']:.0f}  longest S=0 {row['longest_zero_draft_run']:.1f}",
              file=sys.stderr, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=600)
    ap.add_argument("--drafters", type=int, default=None, help="synthetic drafters drawn from the 8-drafter profiles")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    specs = ("table1-8drafters",) if args.drafters else ("table1-4drafters", "table1-8drafters")
    rows = [r for s in specs for r in screen(s, args.seeds, args.rounds, args.drafters)]
    print("| spec | candidate | U (mean ± sd) | U on E[x\\|S] | rounds to settle | on E[x\\|S] | longest S = 0 run |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['spec']} (N = {r['drafters']}) | {r['candidate']} | {r['utility']:.3f} ± {r['utility_sd']:.3f} "
              f"| {r['expected_utility']:.3f} ± {r['expected_utility_sd']:.3f} | {r['rounds_to_settle']:.0f} "
              f"| {r['rounds_to_settle_expected']:.0f} | {r['longest_zero_draft_run']:.1f} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
