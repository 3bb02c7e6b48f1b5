"""Group-relative advantages: known values, invariances, and refusals of bad rewards."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.train.advantages import group_advantages
from core.train.credit import turn_advantages

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


def test_turn_advantages_equal_the_written_estimator_on_a_fixed_set_of_episodes():
    # Five episodes of one task; the policy stopped them after 1, 3, 2, 3 and 1 turns.
    rewards, turns = [0.0, 1.0, 0.5, 0.0, 1.0], [1, 3, 2, 3, 1]
    got = turn_advantages(rewards, turns, "rloo")
    # b_{i,t}: mean reward of the OTHER episodes with more than t turns (all others if none).
    assert got[0] == pytest.approx([0.0 - (1.0 + 0.5 + 0.0 + 1.0) / 4])
    assert got[1] == pytest.approx([1.0 - (0.0 + 0.5 + 0.0 + 1.0) / 4, 1.0 - (0.5 + 0.0) / 2, 1.0 - 0.0])
    assert got[2] == pytest.approx([0.5 - 2.0 / 4, 0.5 - (1.0 + 0.0) / 2])
    assert got[3] == pytest.approx([0.0 - 2.5 / 4, 0.0 - (1.0 + 0.5) / 2, 0.0 - 1.0])
    assert got[4] == pytest.approx([1.0 - 1.5 / 4])
    # grpo scales every turn of the group by one factor, the population std + eps.
    std = math.sqrt(sum((r - 0.5) ** 2 for r in rewards) / 5)
    scaled = turn_advantages(rewards, turns, "grpo")
    assert [a for ep in scaled for a in ep] == pytest.approx([a / (std + 1e-6) for ep in got for a in ep])


def test_turn_advantages_are_zero_for_a_tied_group_and_a_group_of_one():
    assert turn_advantages([1.0, 1.0], [2, 1]) == [[0.0, 0.0], [0.0]]
    assert turn_advantages([1.0], [3]) == [[0.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="reinforce_pp"):
        turn_advantages([1.0, 0.0], [1, 1], "reinforce_pp")


def test_the_naive_per_turn_baseline_that_includes_the_episode_itself_loses_the_credit_the_estimator_keeps():
    # Only episode 1 reached turn 2: a baseline over the episodes that reached it, itself included, is
    # its own reward, so its third turn (and its choice to go on) would get no credit at all.
    rewards, turns = [0.0, 1.0, 0.0], [1, 3, 1]
    naive_turn_2 = rewards[1] - rewards[1]
    assert naive_turn_2 == 0.0
    assert turn_advantages(rewards, turns, "rloo")[1][2] == pytest.approx(1.0)
