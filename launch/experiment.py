"""``goodspeed experiment``: compare draft-length policies on a real local cluster.

An experiment spec is a launch spec (:mod:`goodspeed.launch.spec`) plus an ``[experiment]``
table::

    [experiment]
    name = "table1-4"
    policies = ["goodspeed", "fixed", "random"]
    rounds = 600          # stop each policy's run after this many verified rounds
    seed = 0              # 0: every drafter cycles its prompts in file order; else a shuffled order per drafter

For each policy the cluster of ``goodspeed launch`` runs (verifier + drafter processes, each
drafter cycling through its prompt set so it never runs dry) until ``rounds`` rounds have run
since every drafter took part (start-up rounds, while some processes still load, are not
measured: see :func:`measurement_window`), and those rounds of the verifier's JSON log become
rows of ``DIR/<policy>/rounds.jsonl`` (one per drafter in the round: S, accepted, x, alpha_hat,
X, eta, receive/verify/send seconds). ``DIR/<policy>/status.json``
marks a finished run; a policy that failed can be rerun alone with ``--policies``, and the report
(``DIR/REPORT.md``, ``DIR/report.json``, PNG figures) is rebuilt from every policy's data.
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm import tqdm

from goodspeed.launch.local import launch_local
from goodspeed.launch.report import read_rows, write_report
from goodspeed.launch.spec import SPECS_DIR, LaunchSpec, SpecError, build_table, load_spec, tomllib
from goodspeed.scheduler import smoothing_of
from goodspeed.verifier.records import RoundRecord

DEFAULT_EXPERIMENT = SPECS_DIR / "experiment-default.toml"
PROMPT_CYCLES = 200  # prompt-file repeats: enough that no drafter runs dry before `rounds`


@dataclass(frozen=True)
class ExperimentSettings:
    name: str = "experiment"
    policies: tuple[str, ...] = ("goodspeed", "fixed", "random")
    rounds: int = 600
    seed: int = 0  # prompt order: 0 keeps the files' order, any other value shuffles each drafter's cycle


def load_experiment(path: str | Path | None = None) -> tuple[ExperimentSettings, LaunchSpec]:
    path = Path(path) if path else DEFAULT_EXPERIMENT
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SpecError(f"{path}: {exc}") from None
    table = dict(raw.pop("experiment", {}))
    if "policies" in table:
        table["policies"] = tuple(table["policies"])
    settings = build_table(ExperimentSettings, table, f"{path} [experiment]")
    if settings.rounds < 2 or not settings.policies:
        raise SpecError(f"{path} [experiment]: rounds >= 2 and at least one policy are required")
    spec = load_spec(path, data=raw)
    return settings, spec


def _cycled(spec: LaunchSpec, out_dir: Path, seed: int = 0) -> LaunchSpec:
    """Point every drafter at a prompt file that repeats its set, so it drafts until stopped.

    ``seed != 0`` shuffles each cycle (per drafter, from the seed and the drafter's name), so
    repeated experiments see the text in different orders; every policy of one experiment sees
    the same order."""
    drafters = []
    for d in spec.drafters:
        lines = [line for line in d.prompt_path().read_text(encoding="utf-8").splitlines() if line.strip()][: d.max_prompts]
        cycle = lines * PROMPT_CYCLES
        if seed:
            rng = random.Random(f"{seed}/{d.name}")
            cycle = [line for _ in range(PROMPT_CYCLES) for line in rng.sample(lines, len(lines))]
        path = out_dir / f"{d.name}.cycled.jsonl"
        path.write_text("\n".join(cycle) + "\n", encoding="utf-8")
        drafters.append(replace(d, prompts=str(path), max_prompts=None))
    return replace(spec, drafters=tuple(drafters))


def rows_from_log(log_path: Path, policy: str, eta: float | None = None) -> list[dict]:
    """The experiment's rows (:mod:`goodspeed.launch.report` documents them) from the verifier's
    round records; a round event this version cannot read raises
    :class:`~goodspeed.verifier.records.RecordError`."""
    rows = []
    for line in log_path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("{"):
            continue
        event = json.loads(line)
        if event.get("event") != "round":
            continue
        record = RoundRecord.from_event(event)
        for d in record.drafters:
            rows.append({
                "policy": policy, "round": record.round, "ts": record.ts, "drafter": d.name,
                "S": d.drafted, "accepted": d.accepted, "x": d.gained, "alpha_hat": d.acceptance, "X": d.goodput, "eta": eta,
                "S_next": d.next_draft_length, "receive_s": record.receive_s, "verify_s": record.verify_s, "send_s": record.send_s,
                "drafter_receive_s": d.receive_s,  # this drafter's: round open -> its draft arrived
            })
    return rows


def run_policy(settings: ExperimentSettings, spec: LaunchSpec, policy: str, out_dir: Path) -> list[dict]:
    run_dir = out_dir / policy
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "status.json").unlink(missing_ok=True)
    cycled = _cycled(replace(spec, verifier=replace(spec.verifier, policy=policy)), run_dir, settings.seed)
    launch_local(cycled, run_dir, log=lambda *a: None, live=False, max_rounds=settings.rounds)
    eta = smoothing_of(policy, spec.verifier.eta).eta
    rows = measurement_window(rows_from_log(run_dir / "verifier.log", policy, eta), [d.name for d in cycled.expanded_drafters()], settings.rounds)
    got = len({r["round"] for r in rows})
    if got < settings.rounds:
        raise RuntimeError(f"policy {policy}: only {got} of {settings.rounds} rounds ran; see {run_dir}/verifier.log")
    with open(run_dir / "rounds.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    (run_dir / "status.json").write_text(json.dumps({"policy": policy, "rounds": got, "ok": True}))
    return rows


def measurement_window(rows: list[dict], drafters: list[str], rounds: int) -> list[dict]:
    """The ``rounds`` rounds from the first one by which every drafter had taken part.

    GoodSpeed's clients all take part from iteration 1; here processes start at different times,
    and counting the rounds before a slow starter joined as zero goodput for it would charge
    start-up latency to whichever policy happened to run with a slower start.
    """
    first_seen: dict[str, int] = {}
    for r in rows:
        first_seen[r["drafter"]] = min(first_seen.get(r["drafter"], r["round"]), r["round"])
    if not set(drafters) <= set(first_seen):
        return []
    start = max(first_seen[d] for d in drafters)
    window = set(sorted({r["round"] for r in rows if r["round"] >= start})[:rounds])
    return [r for r in rows if r["round"] in window]


def load_rows(out_dir: Path, policy: str) -> list[dict] | None:
    status, rows = out_dir / policy / "status.json", out_dir / policy / "rounds.jsonl"
    if not status.exists() or not rows.exists():
        return None
    return read_rows(rows)


def run_experiment(settings: ExperimentSettings, spec: LaunchSpec, out_dir: Path, only: tuple[str, ...] | None = None,
                   force: bool = False, log=print) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    todo = [p for p in settings.policies if (only is None or p in only) and (force or only or load_rows(out_dir, p) is None)]
    failed = []
    for policy in tqdm(todo, desc=f"experiment {settings.name}", unit="policy", file=sys.stderr):
        try:
            run_policy(settings, spec, policy, out_dir)
        except Exception as exc:  # one policy failing must not lose the others' data
            failed.append(policy)
            log(f"policy {policy} failed: {exc}; rerun it alone with --policies {policy}")
    data = {p: rows for p in settings.policies if (rows := load_rows(out_dir, p)) is not None}
    metrics = write_report(settings.name, data, out_dir) if data else {}
    log(f"report: {out_dir / 'REPORT.md'} ({len(data)} of {len(settings.policies)} policies)")
    return {"metrics": metrics, "failed": failed}
