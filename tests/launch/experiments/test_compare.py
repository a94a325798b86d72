"""`goodspeed compare`: several runs of one spec side by side."""

import json

import pytest

from goodspeed.launch.cli import main
from goodspeed.launch.experiments.compare import compare_runs
from goodspeed.launch.experiments.sim_profiles import SimulationError


def test_runs_side_by_side_with_mean_spread_and_both_convergence_measures(tmp_path, fake_experiment, capsys):
    names = ["a", "b", "c"]
    runs = [fake_experiment(tmp_path / f"run{k}", names, ("fixed", "random"), seed=k) for k in range(3)]
    assert main(["compare", *map(str, runs), "--out", str(tmp_path / "cmp")]) == 0
    summary = json.loads((tmp_path / "cmp" / "comparison.json").read_text())
    fixed = summary["policies"]["fixed"]
    reports = [json.loads((r / "report.json").read_text()) for r in runs]
    assert fixed["utility"] == [rep["fixed"]["utility"] for rep in reports]
    assert fixed["utility_mean"] == pytest.approx(sum(fixed["utility"]) / 3)
    assert fixed["utility_sd"] > 0
    assert fixed["utility_per_s"] == [rep["fixed"]["utility_per_s"] for rep in reports]  # the time-aware U
    assert fixed["utility_per_s_mean"] == pytest.approx(sum(fixed["utility_per_s"]) / 3)
    assert fixed["rounds_to_settle"] == [rep["fixed"]["rounds_to_settle"] for rep in reports]
    assert fixed["rounds_to_settle_expected"] == [0, 0, 0]  # S never changes: E[x | S] is flat from round 1
    text = (tmp_path / "cmp" / "COMPARISON.md").read_text()
    assert "| fixed |" in text and "| random |" in text
    assert (tmp_path / "cmp" / "fig_utility_by_run.png").stat().st_size > 0
    assert "fixed: U" in capsys.readouterr().out


def test_what_is_not_an_experiment_is_refused(tmp_path, fake_experiment):
    with pytest.raises(SimulationError, match="not an experiment directory"):
        compare_runs([tmp_path])
    run = fake_experiment(tmp_path / "run", ["a"])
    (run / "fixed" / "rounds.jsonl").unlink()
    with pytest.raises(SimulationError, match="missing"):
        compare_runs([run])
    assert main(["compare", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")]) == 2


def test_a_report_without_the_time_aware_utility_is_said_so_not_averaged_away(tmp_path, fake_experiment):
    runs = [fake_experiment(tmp_path / f"run{k}", ["a", "b"], ("fixed",), seed=k) for k in range(2)]
    report = json.loads((runs[0] / "report.json").read_text())
    del report["fixed"]["utility_per_s"]  # written before U(tok/s) was recorded
    (runs[0] / "report.json").write_text(json.dumps(report))
    summary = compare_runs(runs, tmp_path / "cmp")
    assert "utility_per_s" not in summary["policies"]["fixed"] and "utility_per_s_mean" not in summary["policies"]["fixed"]
    assert "not in every run's report" in (tmp_path / "cmp" / "COMPARISON.md").read_text()
