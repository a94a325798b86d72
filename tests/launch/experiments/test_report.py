import math

import numpy as np
import pytest

from goodspeed.launch.experiments.report import (
    goodput_matrix, jain_index, moving_average, policy_metrics, rate_over_time, rounds_to_settle, utility_curve,
)


def row(t, drafter, x, S=3, accepted=None, ts=None):
    return {"policy": "p", "round": t, "drafter": drafter, "x": x, "S": S, "accepted": x - 1 if accepted is None else accepted,
            "alpha_hat": 0.5, "X": 1.5, "receive_s": 0.1 * t, "verify_s": 0.01, "send_s": 0.001, "ts": 100.0 + t if ts is None else ts,
            "drafter_receive_s": 0.01 * t + (0.05 if drafter == "b" else 0.0)}


ROWS = [row(1, "a", 2), row(1, "b", 1), row(2, "a", 3), row(3, "a", 1), row(3, "b", 2)]  # b absent in round 2


def test_hand_computed_metrics():
    _, drafters, x = goodput_matrix(ROWS)
    assert drafters == ["a", "b"] and x.tolist() == [[2, 1], [3, 0], [1, 2]]
    start, u = utility_curve(x)
    assert start == 0
    assert u.tolist() == pytest.approx([math.log(2) + math.log(1), math.log(2.5) + math.log(0.5), math.log(2) + math.log(1)])
    assert rounds_to_settle(u) == 2  # U(2) is off by far more than 1%; U(3) is final
    m = policy_metrics(ROWS)
    assert m["tokens_per_round"] == {"a": 2.0, "b": 1.0}
    assert m["jain_index"] == pytest.approx(9 / 10)  # (2 + 1)^2 / (2 * (4 + 1))
    assert m["total_tokens_per_s"] == pytest.approx(9 / 2.0)  # 9 tokens over ts 101 .. 103
    assert (m["receive_s"], m["verify_s"], m["send_s"]) == pytest.approx((0.6, 0.03, 0.003))
    assert m["acceptance"]["b"] == pytest.approx((0 + 1) / 6)
    assert m["receive_ms_median"] == pytest.approx({"a": 20.0, "b": 70.0})  # medians of 10/20/30 and 60/80 ms
    assert m["utility_per_s"] == pytest.approx(math.log(6 / 2.0) + math.log(3 / 2.0))  # tokens per second each


def test_rate_over_time_bins_each_drafters_tokens():
    starts, rates = rate_over_time(ROWS, bin_s=1.0)  # ts 101, 102, 103
    assert starts.tolist() == [0.0, 1.0, 2.0]
    assert rates["a"].tolist() == [2.0, 3.0, 1.0] and rates["b"].tolist() == [1.0, 0.0, 2.0]
    starts, rates = rate_over_time(ROWS, bin_s=2.0)
    assert rates["a"].tolist() == [2.5, 0.5]


def test_starvation_counts_rounds_with_nothing_allotted():
    rows = [row(t, "a", 1, S=s) for t, s in enumerate([0, 0, 2, 0, 0, 0, 1], start=1)] + [row(1, "b", 2)]
    rows = [r for r in rows if not (r["drafter"] == "a" and r["round"] == 5)]  # a missed round 5: the run goes on
    m = policy_metrics(rows)
    assert m["zero_draft_rounds"] == {"a": 4, "b": 0}
    assert m["longest_zero_draft_run"] == {"a": 2, "b": 0}


def test_utility_starts_when_every_drafter_has_tokens():
    start, u = utility_curve(np.array([[1, 0], [2, 0], [1, 1]], dtype=float))
    assert start == 2 and len(u) == 1
    assert jain_index(np.array([1.0, 1.0, 1.0])) == pytest.approx(1.0)
    assert jain_index(np.array([3.0, 0.0, 0.0])) == pytest.approx(1 / 3)


def test_moving_average_and_band():
    mean, std = moving_average(np.array([0.0, 2.0, 4.0]), window=2)
    assert mean.tolist() == [0.0, 1.0, 3.0] and std.tolist() == [0.0, 1.0, 1.0]


def test_measurement_window_starts_when_every_drafter_took_part():
    from goodspeed.launch.experiments.experiment import measurement_window

    rows = [row(1, "a", 1), row(2, "a", 1), row(3, "a", 1), row(3, "b", 1), row(4, "a", 1), row(5, "b", 1)]
    assert [(r["round"], r["drafter"]) for r in measurement_window(rows, ["a", "b"], 2)] == [(3, "a"), (3, "b"), (4, "a")]
    assert measurement_window(rows, ["a", "b", "c"], 2) == []


def test_async_measurement_window_runs_until_every_drafter_had_its_rounds():
    from goodspeed.launch.experiments.experiment import measurement_window

    # steps 1..6: a takes part in every step, b (a slow link) in steps 2, 4 and 6
    rows = [row(t, "a", 1) for t in range(1, 7)] + [row(t, "b", 1) for t in (2, 4, 6)]
    window = measurement_window(rows, ["a", "b"], 2, per_drafter=True)
    assert sorted({r["round"] for r in window}) == [2, 3, 4]  # from b's first step until b had 2
    assert sum(r["drafter"] == "b" for r in window) == 2 and sum(r["drafter"] == "a" for r in window) == 3


def test_proactive_summary_sums_finished_requests_and_skips_a_cut_last_line(tmp_path):
    import json

    from goodspeed.launch.experiments.experiment import proactive_summary

    rec = {"rounds": 4, "predrafted_rounds": 3, "proactive_hits": 1, "predrafted_tokens": 6, "predraft_used_tokens": 2,
           "hidden_s": 0.5, "wall_s": 2.0}
    (tmp_path / "a.jsonl").write_text(json.dumps(rec) + "\n" + json.dumps(rec) + "\n" + '{"rounds": 9, "pre')
    summary = proactive_summary(tmp_path, ["a", "b"])
    assert summary["a"] == {k: 2 * v for k, v in rec.items()} and summary["b"]["rounds"] == 0
    (tmp_path / "a.jsonl").write_text('{"cut\n' + json.dumps(rec) + "\n")  # only the last line may be cut
    with pytest.raises(json.JSONDecodeError):
        proactive_summary(tmp_path, ["a"])
