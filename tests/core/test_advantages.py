"""Group-relative advantages: known values, invariances, and refusals of bad rewards."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.train.advantages import group_advantages

rewards = st.floats(min_value=-100, max_value=100, allow_nan=False)
group = st.lists(rewards, min_size=1, max_size=8)
groups = st.lists(group, min_size=1, max_size=5)


def test_grpo_standardises_within_each_group():
    (adv,) = group_advantages([[1.0, 0.0, 0.0, 1.0]], "grpo")
    assert adv == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)


def test_rloo_subtracts_the_mean_of_the_other_episodes():
    (adv,) = group_advantages([[3.0, 0.0, 0.0]], "rloo")
    assert adv == pytest.approx([3.0, -1.5, -1.5])


def test_reinforce_pp_normalises_over_the_whole_batch_not_the_group():
    # A near-unanimous group keeps its small scale relative to a decisive one.
    small, big = group_advantages([[0.0, 0.1], [0.0, 10.0]], "reinforce_pp")
    assert abs(small[1] - small[0]) < 0.05 * abs(big[1] - big[0])
    flat = small + big
    assert math.sqrt(sum(a * a for a in flat) / len(flat)) == pytest.approx(1.0, rel=1e-4)


@pytest.mark.parametrize("kind", ["grpo", "rloo", "reinforce_pp"])
def test_groups_with_equal_rewards_get_exactly_zero(kind):
    assert group_advantages([[0.1, 0.1, 0.1], [7.0]], kind) == [[0.0, 0.0, 0.0], [0.0]]


@pytest.mark.parametrize("kind", ["grpo", "rloo", "reinforce_pp"])
@given(batch=groups)
def test_advantages_are_centred_per_group_and_rank_like_rewards(kind, batch):
    result = group_advantages(batch, kind)
    assert [len(a) for a in result] == [len(g) for g in batch]
    for rs, adv in zip(batch, result):
        assert all(math.isfinite(a) for a in adv)
        assert sum(adv) == pytest.approx(0.0, abs=1e-6 * max(1.0, sum(abs(a) for a in adv)))
        for i in range(len(rs)):
            for j in range(len(rs)):
                if rs[i] > rs[j]:
                    assert adv[i] >= adv[j]


@given(g=st.lists(rewards, min_size=2, max_size=8), shift=rewards)
def test_grpo_ignores_a_constant_shift_of_the_rewards(g, shift):
    (a,) = group_advantages([g], "grpo")
    (b,) = group_advantages([[r + shift for r in g]], "grpo")
    assert b == pytest.approx(a, abs=1e-3)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_rewards_are_refused_naming_the_group(bad):
    with pytest.raises(ValueError, match="group 1 has non-finite rewards"):
        group_advantages([[1.0], [0.0, bad]], "grpo")


def test_unknown_estimator_and_empty_group_are_refused():
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        group_advantages([[1.0]], "ppo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="group 0 is empty"):
        group_advantages([[]], "grpo")


@pytest.mark.parametrize("kind", ["grpo", "rloo", "reinforce_pp"])
@pytest.mark.parametrize("bad", [1e308, -2e6, math.nan, math.inf])
def test_a_group_beyond_max_abs_reward_gets_zeros_and_the_others_still_train(kind, bad):
    healthy = [0.0, 1.0, 0.5]
    alone = group_advantages([healthy], kind, max_abs_reward=1e6)[0]
    out = group_advantages([healthy, [bad, 0.0, 1.0]], kind, max_abs_reward=1e6)
    assert out[1] == [0.0, 0.0, 0.0]
    assert out[0] == pytest.approx(alone) and any(a != 0 for a in out[0])
    assert all(math.isfinite(a) for g in out for a in g)


def test_group_sums_are_exact_in_float64():
    # Naive left-to-right summing loses the 1.0 against 1e16 (its ulp is 2): the baseline comes out wrong.
    out = group_advantages([[1e16, 1.0, -1e16, 0.0]], "rloo")[0]
    assert out[1] == 1.0  # 1 minus the mean of the others (exactly 0)
