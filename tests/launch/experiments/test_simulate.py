"""The simulator: its fitting recovers known acceptance, it runs the verifier's scheduling code,
and its CLI works from a clean clone on the shipped profiles."""

import json

import numpy as np
import pytest

from goodspeed.launch.cli import main
from goodspeed.launch.experiments.sim_profiles import (
    DrafterProfile,
    RunProfile,
    SimulationError,
    fit_profile,
    load_profile,
    parse_range,
    survival_from_rows,
)
from goodspeed.launch.experiments.simulate import SimDrafter, SimSettings, scaled_drafters, simulate
from goodspeed.scheduler import LatencyModel, SmoothingConfig


def geometric_rows(p, n, rng, max_s=6):
    drafted = rng.integers(1, max_s + 1, size=n)
    accepted = np.array([next((k for k in range(s) if rng.random() >= p), s) for s in drafted])
    return drafted, accepted


def test_kaplan_meier_recovers_per_position_acceptance():
    rng = np.random.default_rng(0)
    drafted, accepted = geometric_rows(0.7, 4000, rng)
    p = survival_from_rows(drafted, accepted)
    assert len(p) == 6
    assert np.allclose(p, 0.7, atol=0.04)


def test_thin_positions_pool_into_one_rate():
    drafted = np.array([1] * 100 + [8] * 5)
    accepted = np.array([1] * 50 + [0] * 50 + [8] * 5)
    p = survival_from_rows(drafted, accepted, min_at_risk=30)
    assert p[0] == pytest.approx(55 / 105)
    assert len(p) == 2 and p[1] == 1.0  # positions 2..8 (5 rows at risk) pooled
    with pytest.raises(ValueError):
        survival_from_rows(np.array([1]), np.array([2]))


def rows_from_simulation(p, post, n_rounds, seed=0):
    """Experiment rows from a known drafter under greedy eq. 3 (ratios 1/0)."""
    rng, eta, alpha = np.random.default_rng(seed), 0.2, 0.5
    rows = []
    for t in range(n_rounds):
        s = int(rng.integers(1, 7))
        m = next((k for k in range(s) if rng.random() >= p), s)
        extra = int(rng.binomial(max(s - m - 1, 0), post))
        alpha = 0.8 * alpha + eta * (m + extra) / s
        rows.append({"policy": "fixed", "round": t, "drafter": "d", "S": s, "accepted": m, "alpha_hat": alpha,
                     "drafter_receive_s": 0.01 + 0.002 * s, "verify_s": 0.004 + 0.001 * (s + 1), "send_s": 0.0005})
    return rows


def test_fit_profile_recovers_acceptance_post_match_and_timing():
    prof = fit_profile(rows_from_simulation(0.6, 0.3, 3000), eta=0.2).by_name()["d"]
    assert np.allclose(prof.survival[:3], 0.6, atol=0.04)  # deeper positions have few rows at risk
    assert prof.post_match == pytest.approx(0.3, abs=0.04)
    assert prof.receive_base_s == pytest.approx(0.01) and prof.receive_per_token_s == pytest.approx(0.002)


def make_drafters(ps, max_new_tokens=64):
    return [SimDrafter(f"d{i}", DrafterProfile(f"d{i}", (p,), 0.0, 0.01, 0.001), max_new_tokens) for i, p in enumerate(ps)]


def test_simulation_respects_the_budget_and_is_reproducible():
    drafters = make_drafters([0.9, 0.6, 0.3, 0.1])
    settings = SimSettings("goodspeed", 12, 300, SmoothingConfig(), 8, seed=3)
    a = simulate(drafters, settings, LatencyModel(0, 0, 0.005), 0.001)
    b = simulate(drafters, settings, LatencyModel(0, 0, 0.005), 0.001)
    assert np.array_equal(a.drafted, b.drafted) and np.array_equal(a.x, b.x)
    assert (a.drafted.sum(axis=1) <= 12).all() and (a.drafted <= 8).all()
    assert (a.x >= 1).all() and (a.x <= a.drafted + 1).all()
    per_round = a.x.mean(axis=0)
    assert per_round[0] > per_round[3]  # the better drafter gains more
    m = a.metrics()
    assert m["drafters"] == 4 and m["rounds"] == 300 and 0 < m["jain_index"] <= 1


def test_certain_acceptance_gains_every_drafted_token():
    drafters = make_drafters([1.0, 1.0], max_new_tokens=1000)
    r = simulate(drafters, SimSettings("fixed", 6, 20, max_draft_len=8), LatencyModel(0, 0, 0.005), 0.0)
    assert (r.x == r.drafted + 1).all() and r.drafted[0].tolist() == [6, 0]  # the first to start takes all of C
    assert (r.drafted[1:] == 3).all()


def test_requests_restart_with_a_first_allotment():
    drafters = make_drafters([1.0], max_new_tokens=5)
    r = simulate(drafters, SimSettings("fixed", 6, 6, max_draft_len=8), LatencyModel(0, 0, 0.005), 0.0)
    # 5 new tokens: S = 4 (cap) gains 5, then the next request starts over with S = 4 again.
    assert r.drafted[:, 0].tolist() == [4] * 6 and r.x[:, 0].tolist() == [5] * 6


def test_scaled_drafters_vary_acceptance_and_links():
    base = make_drafters([0.8, 0.4])
    out = scaled_drafters([d.profile for d in base], [64, 64], 50, spread=2.0, rtt_ms=(2, 200), seed=1)
    assert len(out) == 50 and len({d.name for d in out}) == 50
    rtts = [d.profile.rtt_s for d in out]
    assert 0.002 <= min(rtts) and max(rtts) <= 0.2
    firsts = [d.profile.survival[0] for d in out[::2]]  # all drawn from the 0.8 drafter
    assert 0.8**2 - 1e-9 <= min(firsts) < max(firsts) <= 0.8**0.5 + 1e-9
    with pytest.raises(SimulationError):
        scaled_drafters([base[0].profile], [64], 2, spread=0.5, rtt_ms=(2, 200), seed=0)


def test_parse_range():
    assert parse_range("2,200") == (2.0, 200.0) and parse_range("5") == (5.0, 5.0)
    for bad in ("a,b", "0,5", "9,3"):
        with pytest.raises(SimulationError):
            parse_range(bad)


def test_profile_round_trips_through_json(tmp_path):
    prof = RunProfile(tuple(d.profile for d in make_drafters([0.5, 0.7])), LatencyModel(0, 1e-4, 0.003), 0.001, "x")
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof.to_dict()))
    assert load_profile(path) == prof
    path.write_text(json.dumps(prof.to_dict() | {"version": 99}))
    with pytest.raises(SimulationError):
        load_profile(path)


def test_cli_simulates_a_shipped_spec_on_its_shipped_profile(tmp_path, capsys):
    out = tmp_path / "sim"
    assert main(["simulate", "table1-4drafters", "--rounds", "60", "--seeds", "2", "--policies", "goodspeed,fixed",
                 "--out", str(out)]) == 0
    summary = json.loads((out / "simulation.json").read_text())
    assert set(summary["results"]) == {"goodspeed", "fixed"}
    assert summary["results"]["fixed"]["drafters"] == 4 and summary["results"]["fixed"]["seeds"] == 2
    assert "| goodspeed | 4 |" in (out / "SIMULATION.md").read_text()
    assert main(["simulate", "table1-8drafters", "--drafters", "40", "--rounds", "30", "--seeds", "1",
                 "--policies", "goodspeed", "--out", str(tmp_path / "big")]) == 0
    big = json.loads((tmp_path / "big" / "simulation.json").read_text())
    assert big["budget"] == 100 and big["results"]["goodspeed"]["drafters"] == 40  # C scales with N: 20 * 40 / 8


def test_cli_refuses_what_it_cannot_simulate(tmp_path, capsys):
    assert main(["simulate", "table1-4drafters", "--policies", "nope", "--out", str(tmp_path / "a")]) == 2
    assert "unknown policy" in capsys.readouterr().err
    assert main(["simulate", "default", "--out", str(tmp_path / "b")]) == 2  # no shipped profile for it
    assert "no profile shipped" in capsys.readouterr().err
    assert main(["simulate", "table1-4drafters", "--profile", str(tmp_path), "--out", str(tmp_path / "c")]) == 2
    assert not (tmp_path / "a").exists()


def test_expected_gain_is_one_plus_the_survival_sums():
    prof = DrafterProfile("d", (0.5, 0.4), 0.0, 0.0, 0.0)
    assert prof.expected_gain(3).tolist() == pytest.approx([1.0, 1.5, 1.7, 1.78])


def test_cli_fits_a_real_run_and_validates_against_it(tmp_path, fake_experiment):
    run = fake_experiment(tmp_path / "run", ["code", "docstrings", "comments", "project"])
    out = tmp_path / "sim"
    assert main(["simulate", "table1-4drafters", "--profile", str(run), "--save-profile", str(tmp_path / "p.json"),
                 "--validate", str(run), "--policies", "fixed", "--rounds", "300", "--seeds", "2", "--out", str(out)]) == 0
    summary = json.loads((out / "simulation.json").read_text())
    errors = {v["drafter"]: v["rel_err"] for v in summary["validation"]}
    assert set(errors) == {"code", "docstrings", "comments", "project", "U"}
    (conv,) = summary["convergence"]
    assert conv["policy"] == "fixed" and len(conv["real"]) == len(conv["real_expected"]) == 1
    assert conv["real_expected"][0] <= 5  # Fixed-S's E[x | S] never changes: nothing to converge
    assert load_profile(tmp_path / "p.json").by_name()["code"].rows == 300
