"""Credit per turn: one advantage per (episode, turn) of a group, unbiased when the policy decides when to stop.

``TrainerConfig.credit: turn`` (``episode``, the default, gives every token its episode's advantage
from ``core.train.advantages``). A *turn* is one call of the trained model, in the order the episode
made them. For episode i of a group of N with reward R_i, at its turn t:

    b_{i,t} = mean of R_j over the OTHER episodes j != i of the group that made a turn t
              (over all other episodes when none did; 0 for a group of one)
    A_{i,t} = (R_i - b_{i,t}) / s        s = the group's reward std + eps (grpo), 1 (rloo)

Why it is unbiased (docs/architecture.md has the full argument): b_{i,t} is a function of the other
episodes only, which are independent rollouts of the same task, so E[grad log pi(a_{i,t} | h_{i,t}) *
b_{i,t}] = E[b_{i,t}] * E[grad log pi(a_{i,t} | h_{i,t})] = 0, however the policy's stopping decided
which of them reached turn t: that event concerns only episodes j != i. The naive per-turn baseline,
the mean over every episode that reached turn t *including i*, holds R_i with weight 1/n_t, which does
depend on a_{i,t}: it shrinks turn t's gradient by (1 - 1/n_t), and since n_t falls with t exactly as
the policy stops earlier, late turns (and the decision to go on) are under-credited; a turn only one
episode reached gets no credit at all. The per-group scale s is the same for every turn of the group,
so it changes the step size, as GRPO's does, not which turns get credit.

What it buys: a turn's baseline is the value of having reached that turn, not of the task's start, so
the late turns of a long episode are judged against the episodes that also got that far (lower variance).

It is pure arithmetic on floats, like ``core.train.advantages``: it does not read episodes or tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from core.train.advantages import STD_EPS

# The estimators whose group scale is per group (turn credit keeps it); reinforce_pp scales by the
# whole batch's std, which per-turn baselines would change, so it is refused with turn credit.
TURN_ESTIMATORS = ("grpo", "rloo")


def _scale(rewards: Sequence[float], kind: str) -> float:
    if kind == "rloo":
        return 1.0
    m = math.fsum(rewards) / len(rewards)
    return math.sqrt(math.fsum((r - m) ** 2 for r in rewards) / len(rewards)) + STD_EPS


def turn_baseline(rewards: Sequence[float], turns: Sequence[int], i: int, t: int) -> float:
    """b_{i,t}: the mean reward of the other episodes that made a turn t (all others when none did)."""
    others = [j for j in range(len(rewards)) if j != i]
    if not others:
        return rewards[i]  # a group of one has no baseline: its advantage is zero
    reached = [j for j in others if turns[j] > t]
    pool = reached or others
    return math.fsum(rewards[j] for j in pool) / len(pool)


def turn_advantages(rewards: Sequence[float], turns: Sequence[int], kind: str = "grpo",
                    usable: bool = True) -> list[list[float]]:
    """A_{i,t} for each episode i (rewards[i], turns[i] calls) and each of its turns t.

    `usable` False (a group the episode-level estimator zeroed: a bad reward) gives zeros."""
    if kind not in TURN_ESTIMATORS:
        raise ValueError(f"credit per turn supports the estimators {TURN_ESTIMATORS}, not {kind!r}")
    if len(rewards) != len(turns):
        raise ValueError(f"{len(rewards)} rewards for {len(turns)} turn counts")
    if not usable or max(rewards) == min(rewards):
        return [[0.0] * n for n in turns]
    s = _scale(rewards, kind)
    return [[(rewards[i] - turn_baseline(rewards, turns, i, t)) / s for t in range(n)] for i, n in enumerate(turns)]
