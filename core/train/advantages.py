"""Group-relative advantages: each group's rewards -> one advantage per episode.

Three estimators, chosen by ``TrainerConfig.advantage``:

- ``grpo``: (r - group mean) / (group std + eps). The std is the population std, so a group of
  one (or one whose rewards are all equal) gives zero advantage instead of a division by zero.
- ``rloo``: r minus the mean of the *other* episodes of its group (leave-one-out baseline), not
  scaled. A group of one has no baseline and gives zero.
- ``reinforce_pp``: REINFORCE++ with a group baseline: r - group mean, then divided by the std of
  those centred values over the whole batch. Normalising over the batch, not the group, keeps a
  nearly-unanimous group from being blown up to unit scale.

This module is pure arithmetic on floats. It does not read episodes, broadcast to tokens, or
decide which groups train; the trainer does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

AdvantageKind = Literal["grpo", "rloo", "reinforce_pp"]
ADVANTAGE_KINDS: tuple[AdvantageKind, ...] = ("grpo", "rloo", "reinforce_pp")

# Added to a std before dividing: large enough that a group whose rewards differ by float noise
# does not produce huge advantages, small enough not to shrink real reward gaps (rewards are O(1)).
STD_EPS = 1e-6


def _mean(xs: Sequence[float]) -> float:
    # Exact for equal values, so a unanimous group is centred to exactly zero, not float noise.
    return xs[0] if max(xs) == min(xs) else sum(xs) / len(xs)


def _std(xs: Sequence[float]) -> float:
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def _grpo(rewards: Sequence[float]) -> list[float]:
    m, s = _mean(rewards), _std(rewards)
    return [(r - m) / (s + STD_EPS) for r in rewards]


def _rloo(rewards: Sequence[float]) -> list[float]:
    n = len(rewards)
    if n == 1 or max(rewards) == min(rewards):
        return [0.0] * n
    total = sum(rewards)
    return [r - (total - r) / (n - 1) for r in rewards]


def _check(groups: Sequence[Sequence[float]], kind: str) -> None:
    if kind not in ADVANTAGE_KINDS:
        raise ValueError(f"unknown advantage estimator {kind!r}; expected one of {ADVANTAGE_KINDS}")
    for i, group in enumerate(groups):
        if not group:
            raise ValueError(f"group {i} is empty; every group needs at least one reward")
        bad = [r for r in group if not math.isfinite(r)]
        if bad:
            raise ValueError(f"group {i} has non-finite rewards {bad}; a NaN or inf reward would poison the update")


def group_advantages(groups: Sequence[Sequence[float]], kind: AdvantageKind = "grpo") -> list[list[float]]:
    """One advantage per reward, shaped like `groups`. Groups whose rewards are all equal get zeros."""
    _check(groups, kind)
    if kind == "grpo":
        return [_grpo(g) for g in groups]
    if kind == "rloo":
        return [_rloo(g) for g in groups]
    centred = [[r - _mean(g) for r in g] for g in groups]
    flat = [a for g in centred for a in g]
    # The centred values have mean zero per group, hence over the batch; their std is the scale.
    scale = math.sqrt(sum(a * a for a in flat) / len(flat)) + STD_EPS
    return [[a / scale for a in g] for g in centred]
