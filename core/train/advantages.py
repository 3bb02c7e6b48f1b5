"""Group-relative advantages: each group's rewards -> one advantage per episode.

Three estimators, chosen by ``TrainerConfig.advantage``:

- ``grpo``: (r - group mean) / (group std + eps). The std is the population std, so a group of
  one (or one whose rewards are all equal) gives zero advantage instead of a division by zero.
- ``rloo``: r minus the mean of the *other* episodes of its group (leave-one-out baseline), not
  scaled. A group of one has no baseline and gives zero.
- ``reinforce_pp``: REINFORCE++ with a group baseline: r - group mean, then divided by the std of
  those centred values over the whole batch. Normalising over the batch, not the group, keeps a
  nearly-unanimous group from being blown up to unit scale.

All sums are float64 and exact (`math.fsum`). With a reward bound (`trainer.max_abs_reward`), a
group holding a reward beyond it, or a non-finite one, gets zero advantages and a warning: one bad
group never voids the step of the healthy ones. Without a bound such a reward is refused.

This module is pure arithmetic on floats. It does not read episodes, broadcast to tokens, or
decide which groups train; the trainer does.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Literal

AdvantageKind = Literal["grpo", "rloo", "reinforce_pp"]
ADVANTAGE_KINDS: tuple[AdvantageKind, ...] = ("grpo", "rloo", "reinforce_pp")

# Added to a std before dividing: large enough that a group whose rewards differ by float noise
# does not produce huge advantages, small enough not to shrink real reward gaps (rewards are O(1)).
STD_EPS = 1e-6

log = logging.getLogger(__name__)


def _mean(xs: Sequence[float]) -> float:
    # Exact for equal values, so a unanimous group is centred to exactly zero, not float noise.
    return xs[0] if max(xs) == min(xs) else math.fsum(xs) / len(xs)


def _std(xs: Sequence[float]) -> float:
    m = _mean(xs)
    return math.sqrt(math.fsum((x - m) * (x - m) for x in xs) / len(xs))


def _grpo(rewards: Sequence[float]) -> list[float]:
    m, s = _mean(rewards), _std(rewards)
    return [(r - m) / (s + STD_EPS) for r in rewards]


def _rloo(rewards: Sequence[float]) -> list[float]:
    n = len(rewards)
    if n == 1 or max(rewards) == min(rewards):
        return [0.0] * n
    total = math.fsum(rewards)
    return [r - (total - r) / (n - 1) for r in rewards]


def _check(groups: Sequence[Sequence[float]], kind: str, max_abs_reward: float | None) -> list[bool]:
    """Which groups can train; raises on a bad estimator, an empty group, or (unbounded) a non-finite reward."""
    if kind not in ADVANTAGE_KINDS:
        raise ValueError(f"unknown advantage estimator {kind!r}; expected one of {ADVANTAGE_KINDS}")
    usable = []
    for i, group in enumerate(groups):
        if not group:
            raise ValueError(f"group {i} is empty; every group needs at least one reward")
        bad = [r for r in group if not math.isfinite(r)]
        if bad and max_abs_reward is None:
            raise ValueError(f"group {i} has non-finite rewards {bad}; a NaN or inf reward would poison the update")
        if max_abs_reward is not None:
            bad = [r for r in group if not (math.isfinite(r) and abs(r) <= max_abs_reward)]
            if bad:
                log.warning("group %d has rewards %s beyond trainer.max_abs_reward (%g): it trains nothing this step",
                            i, bad, max_abs_reward)
        usable.append(not bad)
    return usable


def group_advantages(groups: Sequence[Sequence[float]], kind: AdvantageKind = "grpo",
                     max_abs_reward: float | None = None) -> list[list[float]]:
    """One advantage per reward, shaped like `groups`. Groups whose rewards are all equal get zeros, and
    so do groups with a reward beyond `max_abs_reward` (or non-finite) when it is given."""
    usable = _check(groups, kind, max_abs_reward)
    out = [[0.0] * len(g) for g in groups]
    good = [i for i, ok in enumerate(usable) if ok]
    if kind == "grpo":
        computed = [_grpo(groups[i]) for i in good]
    elif kind == "rloo":
        computed = [_rloo(groups[i]) for i in good]
    else:
        centred = [[r - _mean(groups[i]) for r in groups[i]] for i in good]
        flat = [a for g in centred for a in g]
        # The centred values have mean zero per group, hence over the batch; their std is the scale.
        scale = math.sqrt(math.fsum(a * a for a in flat) / max(len(flat), 1)) + STD_EPS
        computed = [[a / scale for a in g] for g in centred]
    for i, advantages in zip(good, computed):
        out[i] = advantages
    return out
