"""``goodspeed experiment``: compare draft-length policies on a real local cluster.

An experiment spec is a launch spec (:mod:`goodspeed.launch.spec`) plus an ``[experiment]``
table::

    [experiment]
    name = "table1-4"
    policies = ["goodspeed", "fixed", "random"]
    modes = ["sync"]      # the verifier's round modes to run each policy in ("sync", "async")
    proactive = [true, false]  # optional: run each with and without proactive drafting (default: as each drafter says)
    concurrency = [1, 4]  # optional: requests each drafter generates at once (default: as each drafter says)
    transit = [0, 8]      # optional: the verifier's transit_tokens (async modes only; default: the spec's)
    rounds = 600          # stop each run after this many verified rounds (verification steps in async mode)
    seed = 0              # 0: every drafter cycles its prompts in file order; else a shuffled order per drafter

Each policy runs once per mode (and per ``proactive``, ``concurrency`` and ``transit`` setting,
when given); a sync run is named after its policy, an async one ``POLICY@async``, a given
proactive setting adds ``+proactive`` or ``+no-proactive``, a given concurrency ``+cN`` and a
given transit setting ``+tN`` (its directory and its rows in the report). Transit decoding
(:mod:`goodspeed.verifier.engine`) needs async rounds: a sync run with it is refused before any
run starts. Concurrency above 1 runs every drafter as an edge device generating that many of its
prompts at once (:func:`goodspeed.launch.daemons.draft_node.generate_concurrently`), one verifier session
per request, all under the drafter's name, so the report's rows stay per device.

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

from goodspeed.launch.cluster.local import launch_local
from goodspeed.launch.experiments.report import read_rows, write_report
from goodspeed.launch.spec import SPECS_DIR, LaunchSpec, SpecError
from goodspeed.launch.spec_files import build_table, load_spec, tomllib
from goodspeed.scheduler import smoothing_of
from goodspeed.verifier.records import ROUND_MODES, RoundRecord
from goodspeed.verifier.server import check_transit

DEFAULT_EXPERIMENT = SPECS_DIR / "experiment-default.toml"
PROMPT_CYCLES = 200  # prompt-file repeats: enough that no drafter runs dry before `rounds`


@dataclass(frozen=True)
class ExperimentSettings:
    name: str = "experiment"
    policies: tuple[str, ...] = ("goodspeed", "fixed", "random")
    modes: tuple[str, ...] = ("sync",)
    proactive: tuple[bool, ...] | None = None  # None: each drafter's own setting
    concurrency: tuple[int, ...] | None = None  # None: each drafter's own setting
    transit: tuple[int, ...] | None = None  # the verifier's transit_tokens per run; None: the spec's
    rounds: int = 600
    seed: int = 0  # prompt order: 0 keeps the files' order, any other value shuffles each drafter's cycle


def load_experiment(path: str | Path | None = None) -> tuple[ExperimentSettings, LaunchSpec]:
    path = Path(path) if path else DEFAULT_EXPERIMENT
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SpecError(f"{path}: {exc}") from None
    table = dict(raw.pop("experiment", {}))
    for key in ("policies", "modes", "proactive", "concurrency", "transit"):
        if key in table:
            table[key] = tuple(table[key])
    settings = build_table(ExperimentSettings, table, f"{path} [experiment]")
    if settings.rounds < 2 or not settings.policies or not settings.modes:
        raise SpecError(f"{path} [experiment]: rounds >= 2, at least one policy and one mode are required")
    if unknown := [m for m in settings.modes if m not in ROUND_MODES]:
        raise SpecError(f"{path} [experiment]: unknown modes {unknown}; known: {', '.join(ROUND_MODES)}")
    check_policies(settings.policies, f"{path} [experiment] policies")
    if settings.concurrency is not None and (not settings.concurrency or min(settings.concurrency) < 1):
        raise SpecError(f"{path} [experiment]: concurrency lists requests per drafter, each >= 1")
    if settings.transit is not None and (not settings.transit or min(settings.transit) < 0):
        raise SpecError(f"{path} [experiment]: transit lists the verifier's transit_tokens, each >= 0")
    spec = load_spec(path, data=raw)
    return settings, spec


def check_policies(names, where: str) -> None:
    """Every name a registered draft-length policy (``SpecError`` naming the unknown ones), so a
    typo fails before any model loads or process starts."""
    from goodspeed.scheduler.policy import POLICIES

    if unknown := [p for p in names if p not in POLICIES]:
        raise SpecError(f"{where}: unknown policies {unknown}; known: {', '.join(sorted(POLICIES))}")


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
    """The experiment's rows (:mod:`goodspeed.launch.experiments.report` documents them) from the verifier's
    round records; a round event this version cannot read raises
    :class:`~goodspeed.verifier.records.RecordError`. A step for transit rows alone
    (``transit_alone``) has no drafter to make a row of: its receive and verification seconds
    are added to the next step's rows (``transit_steps`` says how many were), so the report's
    wall-time split still adds up."""
    rows = []
    # Steps for transit rows alone not yet told in a row: their receive and verify seconds, and how many.
    carried_receive, carried_verify, carried_steps = 0.0, 0.0, 0
    for line in log_path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("{"):
            continue
        event = json.loads(line)
        if event.get("event") != "round":
            continue
        record = RoundRecord.from_event(event)
        if record.closed == "transit" and not record.drafters:  # its tokens reach the drafters' next verdicts
            carried_receive, carried_verify, carried_steps = (carried_receive + record.receive_s,
                                                              carried_verify + record.verify_s, carried_steps + 1)
            continue
        if not record.drafters:  # a step of local serving alone: no row, nothing to carry
            continue
        receive_s, verify_s, transit_steps = record.receive_s + carried_receive, record.verify_s + carried_verify, carried_steps
        carried_receive, carried_verify, carried_steps = 0.0, 0.0, 0
        for d in record.drafters:
            rows.append({
                "policy": policy, "round": record.round, "ts": record.ts, "drafter": d.name,
                "S": d.drafted, "accepted": d.accepted, "x": d.gained, "alpha_hat": d.acceptance, "X": d.goodput, "eta": eta,
                "S_next": d.next_draft_length, "receive_s": receive_s, "verify_s": verify_s, "send_s": record.send_s,
                "transit_steps": transit_steps,  # steps for transit rows alone since the previous one (in its seconds)
                "drafter_receive_s": d.receive_s,  # this drafter's: round open -> its draft arrived
                "drafter_cycle_s": d.cycle_s,  # its previous verdict sent -> this draft arrived
                "mode": record.mode,
                "closed": record.closed,  # why the step closed (goodspeed.verifier.round_loop)
                "transit": d.transit,  # of x, tokens decoded while its draft was in transit
                "finished": d.finished,  # its request ended with this verdict
                "prefill_tokens": record.prefill_tokens,  # prompt tokens prefilled in the step (in its verify_s)
            })
    return rows


def run_name(policy: str, mode: str, proactive: bool | None = None, concurrency: int | None = None,
             transit: int | None = None) -> str:
    return (policy + ("" if mode == "sync" else f"@{mode}") + {None: "", True: "+proactive", False: "+no-proactive"}[proactive]
            + ("" if concurrency is None else f"+c{concurrency}") + ("" if transit is None else f"+t{transit}"))


def runs_of(settings: ExperimentSettings) -> list[tuple[str, str, bool | None, int | None, int | None]]:
    """``(policy, mode, proactive, concurrency, transit)`` of every run, in order."""
    return [(p, m, a, c, tr) for m in settings.modes for tr in (settings.transit or (None,)) for c in (settings.concurrency or (None,))
            for a in (settings.proactive or (None,))
            for p in settings.policies]


def spec_for_run(spec: LaunchSpec, name: str, policy: str, mode: str, proactive: bool | None, concurrency: int | None,
                 transit: int | None) -> LaunchSpec:
    """``spec`` with the run's settings: the verifier's policy, round mode and transit decoding,
    every drafter's proactive drafting and concurrency. A combination that cannot run raises
    :class:`SpecError`."""
    verifier = replace(spec.verifier, policy=policy, rounds=mode,
                       transit_tokens=spec.verifier.transit_tokens if transit is None else transit)
    try:
        check_transit(verifier.rounds, verifier.transit_tokens, verifier.transit_alone)
    except ValueError as exc:
        raise SpecError(f"run {name}: {exc}") from None
    spec = replace(spec, verifier=verifier)
    if proactive is not None:
        spec = replace(spec, drafters=tuple(replace(d, proactive=proactive) for d in spec.drafters))
    if concurrency is not None:
        spec = replace(spec, drafters=tuple(replace(d, concurrency=concurrency) for d in spec.drafters))
    if clash := [d.name for d in spec.drafters if d.concurrency > 1 and d.proactive]:
        raise SpecError(f"run {name}: drafters {clash} draft proactively, one request at a time; concurrency > 1 needs "
                        "proactive drafting off (--proactive off)")
    return spec


def run_policy(settings: ExperimentSettings, spec: LaunchSpec, policy: str, out_dir: Path, mode: str = "sync",
               proactive: bool | None = None, concurrency: int | None = None, transit: int | None = None) -> list[dict]:
    name = run_name(policy, mode, proactive, concurrency, transit)
    run_dir = out_dir / name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "status.json").unlink(missing_ok=True)
    cycled = _cycled(spec_for_run(spec, name, policy, mode, proactive, concurrency, transit), run_dir, settings.seed)
    launch_local(cycled, run_dir, log=lambda *a: None, live=False, max_rounds=settings.rounds)
    eta = smoothing_of(policy, spec.verifier.eta).eta
    rows = measurement_window(rows_from_log(run_dir / "verifier.log", name, eta), [d.name for d in cycled.expanded_drafters()],
                              settings.rounds, per_drafter=mode == "async")
    got = len({r["round"] for r in rows}) if mode == "sync" else min(
        (sum(r["drafter"] == d for r in rows) for d in {r["drafter"] for r in rows}), default=0)
    if got < settings.rounds:
        raise RuntimeError(f"run {name}: only {got} of {settings.rounds} rounds ran; see {run_dir}/verifier.log")
    with open(run_dir / "rounds.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    (run_dir / "proactive.json").write_text(json.dumps(proactive_summary(run_dir, [d.name for d in cycled.expanded_drafters()]), indent=2))
    (run_dir / "status.json").write_text(json.dumps({"policy": policy, "mode": mode, "proactive": proactive, "rounds": got, "ok": True}))
    return rows


PROACTIVE_FIELDS = ("rounds", "predrafted_rounds", "proactive_hits", "predrafted_tokens", "predraft_used_tokens", "hidden_s", "wall_s")


def proactive_summary(run_dir: Path, drafters: list[str]) -> dict[str, dict]:
    """Per drafter, proactive drafting over its finished requests (the drafter's JSONL): rounds,
    rounds that pre-drafted, hits, tokens pre-drafted and sent, seconds hidden, wall seconds."""
    out = {}
    for name in drafters:
        path = run_dir / f"{name}.jsonl"
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()] if path.exists() else []
        records = [json.loads(line) for line in lines[:-1]]
        if lines:
            try:
                records.append(json.loads(lines[-1]))
            except json.JSONDecodeError:
                pass  # the drafter was stopped while writing its last record (the run ends by stopping it)
        out[name] = {k: sum(r.get(k, 0) for r in records) for k in PROACTIVE_FIELDS}
    return out


def proactive_markdown(summaries: dict[str, dict]) -> str:
    lines = ["## Proactive drafting (finished requests)", "",
             "| run | drafter | rounds | pre-drafted | hits | hit rate | tokens pre-drafted / sent | hidden s | of wall |",
             "|---|---|---|---|---|---|---|---|---|"]
    for run, drafters in summaries.items():
        for name, s in drafters.items():
            rate = s["proactive_hits"] / s["predrafted_rounds"] if s["predrafted_rounds"] else 0.0
            share = s["hidden_s"] / s["wall_s"] if s["wall_s"] else 0.0
            lines.append(f"| {run} | {name} | {s['rounds']} | {s['predrafted_rounds']} | {s['proactive_hits']} | {rate:.2f} | "
                         f"{s['predrafted_tokens']} / {s['predraft_used_tokens']} | {s['hidden_s']:.2f} | {share:.1%} |")
    return "\n".join(lines) + "\n"


def measurement_window(rows: list[dict], drafters: list[str], rounds: int, per_drafter: bool = False) -> list[dict]:
    """The ``rounds`` rounds from the first one by which every drafter had taken part.

    GoodSpeed's clients all take part from iteration 1; here processes start at different times,
    and counting the rounds before a slow starter joined as zero goodput for it would charge
    start-up latency to whichever policy happened to run with a slower start.

    ``per_drafter`` (async mode, where a round is one verification step and each drafter takes
    part at its own cadence): the steps from that first one until every drafter has taken part in
    ``rounds`` of them, so the slowest link's drafter gets as many rounds as in a sync run.
    """
    first_seen: dict[str, int] = {}
    for r in rows:
        first_seen[r["drafter"]] = min(first_seen.get(r["drafter"], r["round"]), r["round"])
    if not set(drafters) <= set(first_seen):
        return []
    start = max(first_seen[d] for d in drafters)
    if per_drafter:
        counts, end = dict.fromkeys(drafters, 0), None
        for r in sorted((r for r in rows if r["round"] >= start), key=lambda r: r["round"]):
            if r["drafter"] in counts:
                counts[r["drafter"]] += 1
            if min(counts.values()) >= rounds:
                end = r["round"]
                break
        return [r for r in rows if start <= r["round"] and (end is None or r["round"] <= end)]
    window = set(sorted({r["round"] for r in rows if r["round"] >= start})[:rounds])
    return [r for r in rows if r["round"] in window]


def finished_rows(out_dir: Path, policy: str) -> list[dict] | None:
    """A policy's rows of an experiment directory, once its run finished (its status written); else None."""
    status, rows = out_dir / policy / "status.json", out_dir / policy / "rounds.jsonl"
    if not status.exists() or not rows.exists():
        return None
    return read_rows(rows)


def run_experiment(settings: ExperimentSettings, spec: LaunchSpec, out_dir: Path, only: tuple[str, ...] | None = None,
                   force: bool = False, log=print) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = runs_of(settings)
    todo = [run for run in runs
            if (only is None or run[0] in only) and (force or only or finished_rows(out_dir, run_name(*run)) is None)]
    for run in todo:  # a setting that cannot run is refused before any run starts
        spec_for_run(spec, run_name(*run), *run)
    failed = []
    for run in tqdm(todo, desc=f"experiment {settings.name}", unit="run", file=sys.stderr):
        try:
            run_policy(settings, spec, run[0], out_dir, *run[1:])
        except Exception as exc:  # one run failing must not lose the others' data
            failed.append(run_name(*run))
            log(f"run {run_name(*run)} failed: {exc}; rerun it alone with --policies {run[0]}")
    data = {name: rows for run in runs if (rows := finished_rows(out_dir, name := run_name(*run))) is not None}
    metrics = write_report(settings.name, data, out_dir) if data else {}
    summaries = {name: json.loads(path.read_text()) for name in data if (path := out_dir / name / "proactive.json").exists()}
    if summaries:
        with open(out_dir / "REPORT.md", "a", encoding="utf-8") as f:
            f.write("\n" + proactive_markdown(summaries))
    log(f"report: {out_dir / 'REPORT.md'} ({len(data)} of {len(runs)} runs)")
    return {"metrics": metrics, "failed": failed}
