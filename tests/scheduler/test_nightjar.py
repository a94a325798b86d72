import numpy as np
import pytest

from goodspeed.scheduler.nightjar import NightjarBandit

MEANS = np.array([10.0, 14.0, 20.0, 16.0, 12.0])  # goodput per arm; arm 2 is best


def run(steps, seed):
    rng = np.random.default_rng(seed)
    bandit = NightjarBandit(max_length=4)
    regret, exploit_best, exploit = 0.0, 0, 0
    for _ in range(steps):
        arm = bandit.choose_arm(batch_size=8, rng=rng)
        if not bandit.is_exploring(8):
            exploit += 1
            exploit_best += arm == 2
        regret += MEANS.max() - MEANS[arm]
        bandit.observe(8, arm, float(rng.normal(MEANS[arm], 2.0)))
    return regret, exploit_best / max(exploit, 1)


def test_exploit_share_on_best_arm_tends_to_one_and_regret_is_sublinear():
    short = [run(2000, s) for s in range(5)]
    long = [run(8000, s) for s in range(5)]
    assert np.mean([r[1] for r in long]) > 0.97
    ratio = np.mean([r[0] for r in long]) / np.mean([r[0] for r in short])
    assert ratio < 3.4  # linear regret would give 4


def test_deterministic_given_generator():
    def arms(seed):
        rng = np.random.default_rng(seed)
        b = NightjarBandit(3)
        out = []
        for t in range(200):
            arm = b.choose_arm(1 + t % 3, rng)
            b.observe(1 + t % 3, arm, float(arm + 1))
            out.append(arm)
        return out

    assert arms(4) == arms(4)


def test_switching_cost_keeps_speculation_off_when_gain_is_small():
    b = NightjarBandit(2)
    for arm, g in [(0, 10.0), (1, 10.5), (2, 10.4)]:
        b.observe(4, arm, g)
    b.previous_length = 0
    assert b.exploit(4, prefill_cost_s=0.0) == 1
    assert b.exploit(4, prefill_cost_s=0.05) == 0  # 1/10 < 1/10.5 + 0.05
    b.previous_length = 1  # already on: no switching cost
    assert b.exploit(4, prefill_cost_s=0.05) == 1


def test_unplayed_arms_are_not_exploited_and_bad_input():
    b = NightjarBandit(3)
    b.observe(2, 3, 5.0)
    assert b.exploit(2) == 3
    with pytest.raises(ValueError):
        b.observe(2, 4, 1.0)
    with pytest.raises(ValueError):
        b.choose_arm(0, np.random.default_rng(0))
    with pytest.raises(ValueError):
        NightjarBandit(0)
