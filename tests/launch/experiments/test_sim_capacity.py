"""Capacity at a TPOT SLO in simulation: each request's TPOT is its rounds' seconds over its
tokens, centralised plain decoding's is the fitted step at one token a client, capacity is where
the SLO first fails, and a verifier's own log calibrates a profile."""

import json

import numpy as np
import pytest

from goodspeed.launch.cli import main
from goodspeed.launch.experiments.sim_capacity import capacity_at_slo, capacity_cells, plain_tpot_s
from goodspeed.launch.experiments.sim_profiles import DrafterProfile, RunProfile, SimulationError, load_profile
from goodspeed.launch.experiments.simulate import SimDrafter, SimSettings, simulate
from goodspeed.scheduler import LatencyModel
from goodspeed.verifier.records import DrafterRound, RoundRecord


def drafter(name, p, base_s=0.0, max_new_tokens=64):
    return SimDrafter(name, DrafterProfile(name, (p,), 0.0, base_s, 0.0), max_new_tokens)


def test_a_request_s_tpot_is_its_rounds_seconds_over_its_tokens():
    # Certain acceptance, S = 4 (the cap of 5 tokens): every request ends in one round of 5 tokens.
    r = simulate([drafter("d", 1.0, base_s=0.002, max_new_tokens=5)], SimSettings("fixed", 6, 6, max_draft_len=8),
                 LatencyModel(0, 0, 0.005), 0.001)
    assert r.request_tpot_s.tolist() == pytest.approx([(0.002 + 0.005 + 0.001) / 5] * 6)
    assert r.request_drafter.tolist() == [0] * 6
    # Two drafters share every round's time; the one that accepts less takes more rounds a request.
    r = simulate([drafter("good", 0.95), drafter("poor", 0.2)], SimSettings("fixed", 8, 400, max_draft_len=8),
                 LatencyModel(0, 0, 0.005), 0.0)
    good, poor = (r.request_tpot_s[r.request_drafter == i] for i in (0, 1))
    assert good.size > poor.size > 0 and good.mean() < poor.mean()
    assert r.round_s.sum() >= good.sum() * 64  # no request is counted for time it did not spend
    # A packed step costs the tokens its rows verify; a padded one, every row at the longest's length.
    rows = [drafter("long", 1.0, max_new_tokens=5), drafter("short", 1.0, max_new_tokens=1)]  # S = 4 and S = 0
    for packed, tokens in ((True, 5 + 1), (False, 2 * 5)):
        r = simulate(rows, SimSettings("fixed", 8, 3, max_draft_len=8), LatencyModel(0, 0.001, 0.0), 0.0, packed=packed)
        assert r.drafted[1:].tolist() == [[4, 0]] * 2 and r.step_s[1:].tolist() == pytest.approx([0.001 * tokens] * 2)
    # A request's prompt is prefilled in its first round's step: 5 ms + 1 ms for each of 5 + 100 tokens.
    r = simulate([drafter("d", 1.0, max_new_tokens=5)], SimSettings("fixed", 6, 3, max_draft_len=8),
                 LatencyModel(0, 0.001, 0.005), 0.0, prompt_tokens=100)
    assert r.request_tpot_s.tolist() == pytest.approx([0.110 / 5] * 3)


def profile(p, gamma_s, delta_s=0.010, receive_s=0.0, send_s=0.0):
    return RunProfile((DrafterProfile("d", (p,), 0.0, receive_s, 0.0),), LatencyModel(0, gamma_s, delta_s), send_s)


def test_plain_decoding_s_tpot_is_the_fitted_step_at_one_token_a_client():
    prof = profile(0.5, gamma_s=0.001, send_s=0.0005)
    assert plain_tpot_s(prof, 10, 32) == pytest.approx(0.010 + 0.010 + 0.0005)
    # Prompts of 64 tokens for 32 new ones: each step also prefills two tokens a client.
    prompted = RunProfile(prof.drafters, prof.step, prof.send_s, prompt_tokens=64)
    assert plain_tpot_s(prompted, 10, 32) == pytest.approx(0.010 + 0.030 + 0.0005)
    cells = capacity_cells(prof, [1, 5, 9, 10, 20], 0.0196, budget_per_drafter=2, max_draft_len=4, max_new_tokens=32,
                           rounds=200, rtt_ms=(1, 1))
    plain = {c["clients"]: c["attainment"] for c in cells if c["phase"] == "plain"}
    assert plain == {1: 1.0, 5: 1.0, 9: 1.0, 10: 0.0, 20: 0.0}
    assert capacity_at_slo(cells)["plain"] == 9


def test_speculation_s_capacity_beats_plain_decoding_s_only_where_a_step_is_flat_in_its_tokens():
    slo, clients = 0.013, [1, 2, 4, 8, 16, 32, 48, 64, 96]
    kwargs = dict(budget_per_drafter=4, max_draft_len=4, max_new_tokens=64, rounds=300, rtt_ms=(1, 1), spread=1.0)
    # Nearly flat (a GPU's regime): 10 ms a step, 0.05 ms a verified token; drafts accepted 0.8.
    # Plain decoding meets 13 ms up to 60 clients; drafters, at about 3.4 tokens a round of
    # 5 verified tokens each, up to about 130.
    flat = capacity_at_slo(capacity_cells(profile(0.8, gamma_s=0.00005), clients, slo, **kwargs))
    # Steep (this CPU's regime): 1 ms a verified token; drafts accepted 0.3 (1.4 tokens a round).
    steep = capacity_at_slo(capacity_cells(profile(0.3, gamma_s=0.001), clients, slo, **kwargs))
    assert flat == {"edge": 96, "plain": 48}
    assert steep["edge"] < steep["plain"] == 2


def test_capacity_is_where_the_slo_first_fails_not_the_largest_cell_that_meets_it():
    cells = [{"phase": "plain", "clients": n, "attainment": a} for n, a in ((1, 1.0), (4, 0.95), (8, 0.5), (16, 0.92))]
    cells += [{"phase": "edge", "clients": n, "attainment": a} for n, a in ((4, 0.89), (1, 0.9))]
    assert capacity_at_slo(cells) == {"plain": 4, "edge": 1}  # 16's lucky 0.92 does not count past 8's failure
    assert capacity_at_slo(cells, attainment=0.99) == {"plain": 1, "edge": 0}


def test_capacity_refuses_settings_it_cannot_measure():
    prof = profile(0.5, gamma_s=0.001)
    for bad in (dict(slo_s=0.0), dict(clients=[0]), dict(rounds=2)):
        args = dict(clients=[4], slo_s=0.05, budget_per_drafter=2, max_draft_len=4, max_new_tokens=64, rounds=200) | bad
        with pytest.raises(SimulationError):
            capacity_cells(prof, args.pop("clients"), args.pop("slo_s"), **args)


def test_cli_reports_capacity_on_a_shipped_profile(tmp_path, capsys):
    out = tmp_path / "cap"
    assert main(["simulate", "table1-4drafters", "--capacity", "1,4,16", "--tpot-slo-ms", "40", "--rtt-ms", "5,20",
                 "--rounds", "200", "--out", str(out)]) == 0
    report = json.loads((out / "capacity.json").read_text())
    assert {(c["clients"], c["phase"]) for c in report["cells"]} == {(n, p) for n in (1, 4, 16) for p in ("edge", "plain")}
    assert set(report["capacity_at_slo"]) == {"edge", "plain"} and report["policy"] == "goodspeed"
    assert "| 16 |" in (out / "CAPACITY.md").read_text() and "Capacity" in capsys.readouterr().out
    assert main(["simulate", "table1-4drafters", "--capacity", "1,4", "--out", str(tmp_path / "a")]) == 2
    assert "--tpot-slo-ms" in capsys.readouterr().err
    assert main(["simulate", "table1-4drafters", "--tpot-slo-ms", "40", "--out", str(tmp_path / "b")]) == 2
    assert "goes with --capacity" in capsys.readouterr().err
    assert main(["simulate", "table1-4drafters", "--capacity", "4", "--tpot-slo-ms", "40", "--drafters", "8",
                 "--out", str(tmp_path / "c")]) == 2
    assert "drop --drafters" in capsys.readouterr().err


def verifier_log(path, rounds, drafters=("a", "b"), p=0.6, seed=1):
    """A verifier's stderr: a progress line, then round events with these drafters (S = 1..4,
    received after 10 ms + 2 ms a drafted token, and every 25th round after 5 s: a drafter
    between two of its requests). Drafter ``a``'s request ends every 20th round and its next
    prompt, 60 tokens, is prefilled in the next step (both first prompts in the first); a step
    takes 5 ms + 0.5 ms a token it verifies or prefills."""
    rng, lines = np.random.default_rng(seed), ["Loading weights: 100%|##########| 38/38"]
    for t in range(rounds):
        rows = []
        for name in drafters:
            s = int(rng.integers(1, 5))
            m = next((k for k in range(s) if rng.random() >= p), s)
            receive = 5.0 if t % 25 == 0 else 0.01 + 0.002 * s
            rows.append(DrafterRound(f"s-{name}", name, s, m, m + 1, 0.5, 2.0, s, name == "a" and t % 20 == 19, receive))
        prefill = 60 * len(drafters) if t == 0 else 60 if t % 20 == 0 else 0
        verify = 0.005 + 0.0005 * (sum(r.drafted + 1 for r in rows) + prefill)
        lines.append(RoundRecord(t, 0.01, verify, verify, 0.0005, len(rows), 8, tuple(rows), prefill_tokens=prefill).to_json())
    lines.append(json.dumps({"ts": 1.0, "event": "prefill", "tokens": 120, "seconds": 0.065, "started": 1}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_verifier_s_own_log_calibrates_a_profile(tmp_path):
    prof = load_profile(verifier_log(tmp_path / "verifier.log", 400))
    assert set(prof.by_name()) == {"a", "b"}
    assert prof.by_name()["a"].survival[0] == pytest.approx(0.6, abs=0.06)
    # The rounds that waited 5 s for a drafter between requests stay out of its receive line.
    assert prof.by_name()["a"].receive_base_s == pytest.approx(0.01)
    assert prof.by_name()["a"].receive_per_token_s == pytest.approx(0.002)
    # The step's fit counts the prompt tokens it prefilled. Prompts: 21 of 60 tokens in the rounds'
    # steps and one of 120 in a prefill step of its own, for 20 requests finished.
    assert prof.step.delta_s == pytest.approx(0.005) and prof.step.gamma_s_per_batched_token == pytest.approx(0.0005)
    assert prof.prompt_tokens == pytest.approx((21 * 60 + 120) / 20) and prof.send_s == pytest.approx(0.0005)
    with pytest.raises(SimulationError, match="no round with a drafter"):
        load_profile(verifier_log(tmp_path / "empty.log", 3, drafters=()))
