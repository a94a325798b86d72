"""A small experiment end to end on a real local cluster of tiny models."""

import json
import math
from dataclasses import replace

import pytest

from goodspeed.launch.experiments.experiment import ExperimentSettings, run_experiment
from goodspeed.launch.spec import DrafterSpec, LaunchSpec, VerifierSpec
from modelkit import perturbed, save_models, tiny_llama

VOCAB = 300


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    target = tiny_llama(0, vocab=VOCAB)
    # Acceptance must really differ for the allocation to matter: "good" nearly agrees with the
    # target (at 0.05 noise its greedy acceptance was ~0.3, where S beyond 3 buys nothing and U
    # differed between policies by one token of timing noise), the other two accept nothing.
    models = {"target": target, "good": perturbed(target, 0.01, 1), "noisy": perturbed(target, 0.6, 2), "unrelated": tiny_llama(9, vocab=VOCAB)}
    return save_models(tmp_path_factory.mktemp("models"), models, VOCAB)


def spec_for(paths, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": [5 + i, 6, 7]}) + "\n" for i in range(3)))
    drafters = tuple(DrafterSpec(name=n, draft=str(paths[n]), prompts=str(prompts), max_new_tokens=30) for n in ("good", "noisy", "unrelated"))
    return LaunchSpec(VerifierSpec(target=str(paths["target"]), budget=12, round_deadline_ms=1000, max_missed_rounds=10), drafters)


def recompute(rows):
    """An independent, plain re-derivation of the report's headline numbers from the raw rows."""
    rounds = sorted({r["round"] for r in rows})
    drafters = sorted({r["drafter"] for r in rows})
    totals = {d: sum(r["x"] for r in rows if r["drafter"] == d) for d in drafters}
    per_round = {d: totals[d] / len(rounds) for d in drafters}
    jain = sum(per_round.values()) ** 2 / (len(drafters) * sum(v * v for v in per_round.values()))
    utility = sum(math.log(totals[d] / len(rounds)) for d in drafters)
    return per_round, jain, utility


def test_experiment_end_to_end_report_matches_raw_data(model_dirs, tmp_path):
    settings = ExperimentSettings(name="tiny", policies=("goodspeed", "fixed"), rounds=40)
    result = run_experiment(settings, spec_for(model_dirs, tmp_path), tmp_path / "out", log=lambda *a: None)
    out = tmp_path / "out"
    assert result["failed"] == []
    for name in ("REPORT.md", "report.json", "fig2_goodput.png", "fig3_wall_time.png", "fig4_utility.png", "fig5_rate_over_time.png"):
        assert (out / name).stat().st_size > 0, name
    report = json.loads((out / "report.json").read_text())
    markdown = (out / "REPORT.md").read_text()
    for policy in settings.policies:
        rows = [json.loads(line) for line in (out / policy / "rounds.jsonl").read_text().splitlines()]
        assert len({r["round"] for r in rows}) == 40
        assert {"S", "accepted", "x", "alpha_hat", "X", "eta", "receive_s", "verify_s", "send_s", "drafter_receive_s"} <= set(rows[0])
        assert rows[0]["eta"] == {"goodspeed": 0.1, "fixed": 0.2}[policy]  # the smoothing the run used
        assert all(r["drafter_receive_s"] >= 0 for r in rows)
        per_round, jain, utility = recompute(rows)
        m = report[policy]
        assert m["tokens_per_round"] == pytest.approx(per_round)
        assert m["jain_index"] == pytest.approx(jain) and m["utility"] == pytest.approx(utility)
        assert all(m["receive_ms_median"][d] >= 0 for d in m["drafters"]) and "receive ms (median)" in markdown
        assert f"| {policy} | 40 | {m['utility']:.4f} | {m['utility_per_s']:.3f} | {m['jain_index']:.4f} |" in markdown
    # Greedy and lossless: whatever the policy, a drafter's finished requests are the same tokens.
    for drafter in ("good", "noisy", "unrelated"):
        runs = [{r["id"]: r["token_ids"] for r in map(json.loads, (out / p / f"{drafter}.jsonl").read_text().splitlines())} for p in settings.policies]
        common = set(runs[0]) & set(runs[1])
        assert common and all(runs[0][k] == runs[1][k] for k in common), drafter
    # GoodSpeed maximises sum_i log xbar_i; on drafters this different it must not lose to Fixed-S.
    assert report["goodspeed"]["utility"] >= report["fixed"]["utility"]


@pytest.mark.slow  # another experiment run; the default suite runs the end-to-end one above
def test_a_policy_rerun_alone_keeps_the_others_data(model_dirs, tmp_path):
    """A policy can be rerun alone; the other's data stays and the report is rebuilt from both."""
    settings = ExperimentSettings(name="tiny", policies=("goodspeed", "fixed"), rounds=8)
    out = tmp_path / "out"
    assert run_experiment(settings, spec_for(model_dirs, tmp_path), out, log=lambda *a: None)["failed"] == []
    before = (out / "goodspeed" / "rounds.jsonl").read_text()
    fixed_before = (out / "fixed" / "rounds.jsonl").read_text()
    run_experiment(settings, spec_for(model_dirs, tmp_path), out, only=("fixed",), log=lambda *a: None)
    assert (out / "goodspeed" / "rounds.jsonl").read_text() == before
    assert (out / "fixed" / "rounds.jsonl").read_text() != fixed_before  # rerun: new timings at least
    assert set(json.loads((out / "report.json").read_text())) == {"goodspeed", "fixed"}


@pytest.mark.slow  # a cluster per policy and mode (56 s); async rounds are tested by default in tests/verifier/test_round_loop.py
@pytest.mark.parametrize("modes", [("async",), ("sync", "async")])
def test_one_spec_runs_each_policy_in_each_round_mode_with_and_without_proactive_drafting(model_dirs, tmp_path, modes):
    """Every (mode, proactive) run of the matrix (slow: the default suite runs sync experiments in
    test_experiment_end_to_end_report_matches_raw_data, and async rounds in tests/verifier)."""
    settings = ExperimentSettings(name="modes", policies=("goodspeed",), modes=modes, proactive=(True, False), rounds=12)
    result = run_experiment(settings, spec_for(model_dirs, tmp_path), tmp_path / "out", log=lambda *a: None)
    out = tmp_path / "out"
    assert result["failed"] == []
    names = {("goodspeed+proactive", "sync", True), ("goodspeed+no-proactive", "sync", False),
             ("goodspeed@async+proactive", "async", True), ("goodspeed@async+no-proactive", "async", False)}
    names = {n for n in names if n[1] in modes}
    assert set(json.loads((out / "report.json").read_text())) == {n for n, _, _ in names}
    for name, mode, proactive in names:
        rows = [json.loads(line) for line in (out / name / "rounds.jsonl").read_text().splitlines()]
        assert {r["mode"] for r in rows} == {mode} and {r["policy"] for r in rows} == {name}
        assert any(r["drafter_cycle_s"] is not None for r in rows)
        if mode == "async":  # the window gives every drafter its rounds
            assert min(sum(r["drafter"] == d for r in rows) for d in ("good", "noisy", "unrelated")) == 12
        summary = json.loads((out / name / "proactive.json").read_text())
        predrafted = sum(s["predrafted_rounds"] for s in summary.values())
        assert (predrafted > 0) == proactive, (name, summary)
    assert "## Proactive drafting" in (out / "REPORT.md").read_text()
    # lossless in every run: a request finished in several runs is the same tokens
    for drafter in ("good", "noisy", "unrelated"):
        runs = [{r["id"]: r["token_ids"] for r in map(json.loads, (out / n / f"{drafter}.jsonl").read_text().splitlines())}
                for n, _, _ in sorted(names)]
        for other in runs[1:]:
            common = set(runs[0]) & set(other)
            assert all(runs[0][k] == other[k] for k in common), drafter


@pytest.mark.slow  # a third experiment (30 s); tests/launch/daemons/test_draft_node.py runs several requests per device by default
def test_concurrency_runs_each_drafter_as_a_device_with_several_requests_at_once(model_dirs, tmp_path):
    from goodspeed.launch.spec import SpecError

    settings = ExperimentSettings(name="devices", policies=("goodspeed",), modes=("async",), concurrency=(2,), rounds=24)
    # Short requests, so each device finishes some within the run (a record is written per
    # finished request): at least one token per step a session takes part in, three at most.
    spec = spec_for(model_dirs, tmp_path)
    spec = replace(spec, drafters=tuple(replace(d, max_new_tokens=3) for d in spec.drafters))
    result = run_experiment(settings, spec, tmp_path / "out", log=lambda *a: None)
    assert result["failed"] == []
    run = tmp_path / "out" / "goodspeed@async+c2"
    rows = [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines()]
    assert {r["drafter"] for r in rows} == {"good", "noisy", "unrelated"}  # rows stay per device
    per_step = {}
    for r in rows:
        per_step[(r["round"], r["drafter"])] = per_step.get((r["round"], r["drafter"]), 0) + 1
    assert max(per_step.values()) == 2  # a device's two requests verified in one step
    joins = [json.loads(line) for line in (run / "verifier.log").read_text().splitlines()
             if line.startswith("{") and json.loads(line).get("event") == "join"]
    assert sorted(j["name"] for j in joins) == sorted(["good", "noisy", "unrelated"] * 2)
    records = [json.loads(line) for line in (run / "good.jsonl").read_text().splitlines() if line.strip()]
    assert records and all(r["rounds"] >= 1 for r in records)
    # proactive drafting is per request: refused with concurrency, before anything runs
    with pytest.raises(SpecError, match="proactive"):
        run_experiment(ExperimentSettings(name="x", policies=("goodspeed",), proactive=(True,), concurrency=(2,), rounds=12),
                       spec_for(model_dirs, tmp_path), tmp_path / "refused", log=lambda *a: None)
    assert not (tmp_path / "refused" / "goodspeed+proactive+c2").exists()


@pytest.mark.slow  # a fourth experiment (29 s); the report's transit share is checked below by default
def test_transit_runs_give_the_verifier_transit_decoding_and_report_its_share(model_dirs, tmp_path):
    from goodspeed.launch.spec import SpecError

    settings = ExperimentSettings(name="transit", policies=("goodspeed",), modes=("async",), proactive=(False,),
                                  transit=(4,), rounds=24)
    result = run_experiment(settings, spec_for(model_dirs, tmp_path), tmp_path / "out", log=lambda *a: None)
    assert result["failed"] == []
    run = tmp_path / "out" / "goodspeed@async+no-proactive+t4"
    rows = [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines()]
    assert all(0 <= r["transit"] <= min(4, r["x"]) for r in rows) and sum(r["transit"] for r in rows) > 0
    share = result["metrics"]["goodspeed@async+no-proactive+t4"]["transit_share"]
    assert set(share) == {"good", "noisy", "unrelated"} and 0 < max(share.values()) < 1
    assert "decoded in transit" in (tmp_path / "out" / "REPORT.md").read_text()
    # transit decoding needs async rounds: refused before anything runs
    with pytest.raises(SpecError, match="asynchronous rounds"):
        run_experiment(ExperimentSettings(name="x", policies=("goodspeed",), modes=("sync",), transit=(4,), rounds=12),
                       spec_for(model_dirs, tmp_path), tmp_path / "refused", log=lambda *a: None)
    assert not (tmp_path / "refused" / "goodspeed+t4").exists()
    # steps for transit rows alone need transit decoding: a run without it is refused, by name
    alone = replace(spec_for(model_dirs, tmp_path), verifier=replace(spec_for(model_dirs, tmp_path).verifier, transit_alone=True))
    with pytest.raises(SpecError, match=r"run goodspeed@async\+t0: .*needs transit_tokens > 0"):
        run_experiment(ExperimentSettings(name="x", policies=("goodspeed",), modes=("async",), transit=(0,), rounds=12),
                       alone, tmp_path / "refused-alone", log=lambda *a: None)


def test_steps_for_transit_rows_alone_fold_into_the_next_steps_rows(tmp_path):
    """A step that verified no draft (``closed = "transit"``) makes no row; its receive and verify
    seconds go into the next step's, so the report's wall-time split still adds up."""
    from goodspeed.launch.experiments.experiment import rows_from_log
    from goodspeed.launch.experiments.report import policy_metrics, report_markdown
    from goodspeed.verifier.records import DrafterRound, RoundRecord

    def step(index, receive, verify, drafters, closed):
        rows = tuple(DrafterRound(f"{n}#1", n, 2, 1, 3, 0.5, 1.5, 2, False, 0.01, transit=t) for n, t in drafters)
        return RoundRecord(index, receive, verify, verify / 2, 0.001, len(rows), 8, rows, mode="async", closed=closed,
                           transit_tokens=1 if closed == "transit" else 0, ts=100.0 + index).to_json()

    log = tmp_path / "verifier.log"
    log.write_text("\n".join([step(0, 0.010, 0.002, [("a", 0), ("b", 0)], "all"),
                               step(1, 0.001, 0.003, [], "transit"), step(2, 0.002, 0.004, [], "transit"),
                               step(3, 0.005, 0.006, [("a", 2)], "none-due")]) + "\n")
    rows = rows_from_log(log, "goodspeed@async")
    assert [(r["round"], r["drafter"], r["transit_steps"]) for r in rows] == [(0, "a", 0), (0, "b", 0), (3, "a", 2)]
    assert rows[2]["receive_s"] == pytest.approx(0.008) and rows[2]["verify_s"] == pytest.approx(0.013)
    m = policy_metrics(rows)
    assert m["verify_s"] == pytest.approx(0.015) and m["receive_s"] == pytest.approx(0.018) and m["transit_steps"] == 2
    assert "2 steps decoded for transit rows alone" in report_markdown("x", {"goodspeed@async": m}, {})


def test_a_seed_shuffles_each_drafters_prompt_cycle(tmp_path):
    from goodspeed.launch.experiments.experiment import PROMPT_CYCLES, _cycled

    prompts = tmp_path / "p.jsonl"
    lines = [json.dumps({"prompt_ids": [i]}) for i in range(6)]
    prompts.write_text("\n".join(lines) + "\n")
    spec = LaunchSpec(VerifierSpec(), (DrafterSpec("a", "demo:draft-tiny", str(prompts)), DrafterSpec("b", "demo:draft-tiny", str(prompts))))

    def cycle(seed, name):
        cycled = _cycled(spec, tmp_path, seed)
        path = next(d.prompts for d in cycled.drafters if d.name == name)
        return open(path).read().splitlines()

    assert cycle(0, "a") == lines * PROMPT_CYCLES  # seed 0: the file's order
    shuffled = cycle(3, "a")
    assert len(shuffled) == 6 * PROMPT_CYCLES
    assert all(sorted(shuffled[k:k + 6]) == sorted(lines) for k in range(0, len(shuffled), 6))  # every cycle: each prompt once
    assert shuffled != lines * PROMPT_CYCLES and shuffled == cycle(3, "a")  # reproducible
    assert cycle(3, "b") != shuffled and cycle(4, "a") != shuffled  # per drafter, per seed


def test_an_unknown_policy_fails_before_anything_runs(tmp_path, capsys):
    """A typo in --policies is an error at once: no model is built, no process starts, no
    directory is written (it used to start a verifier, which refused the name)."""
    from goodspeed.launch.cli import main

    out = tmp_path / "runs"
    assert main(["experiment", "table1-4drafters", "--policies", "goodspeeed,fixed", "--out", str(out)]) == 2
    assert "--policies: unknown policies ['goodspeeed']; known: fixed, goodspeed" in capsys.readouterr().err
    assert not out.exists()
