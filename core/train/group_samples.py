"""A batch's episodes -> training samples carrying their advantage and weight, per episode or per turn.

Each episode's calls of the trained model are merged into samples (``core.train.timelines``). With
``credit: episode`` an episode's calls merge together and every sample gets the episode's advantage
(``core.train.advantages``). With ``credit: turn`` each call (turn) merges on its own, so that a sample
holds one turn's tokens, and gets that turn's advantage (``core.train.credit``); a multi-turn episode
then re-presents its earlier turns as prompt, which costs training tokens (``merge/ratio`` shows it).
With ``episode_weighting`` each sample's weight is 1 / its episode's trained tokens.

It builds samples; it does not pack them, run a model, or decide which of them go through it.
"""

from __future__ import annotations

from core.config import TrainerConfig
from core.records import Episode
from core.train.credit import turn_advantages
from core.train.timelines import Sample, merge_with_stats


def group_samples(groups: list[list[Episode]], rewards: list[list[float]], advantages: list[list[float]],
                  cfg: TrainerConfig, model_name: str) -> tuple[list[list[Sample]], int, int]:
    """Each group's merged samples with advantage and weight set; plus the merge token counts
    (unmerged, linear) for ``merge/ratio``. `advantages`: one per episode, from the group estimator."""
    grouped: list[list[Sample]] = []
    unmerged = linear = 0
    for group, group_rewards, group_adv in zip(groups, rewards, advantages):
        samples: list[Sample] = []
        grouped.append(samples)
        if cfg.credit == "turn":
            parts = [[[c] for c in e.calls_of(model_name)] for e in group]
            # A group the estimator zeroed (a tie, or a reward past max_abs_reward) stays zero per turn.
            per_part = turn_advantages(group_rewards, [len(p) for p in parts], cfg.advantage, any(group_adv))
        else:
            parts = [[e.calls_of(model_name)] for e in group]
            per_part = [[a] for a in group_adv]
        for episode, episode_parts, part_adv in zip(group, parts, per_part):
            episode_samples: list[Sample] = []
            for calls, advantage in zip(episode_parts, part_adv):
                merged, stats = merge_with_stats(calls, cfg.merge, episode.id)  # one trie build
                unmerged += stats["unmerged_tokens"]
                linear += stats["linear_tokens"]
                for s in merged:
                    s.advantage = advantage
                episode_samples += merged
            tokens = sum(s.num_masked for s in episode_samples)
            for s in episode_samples:
                s.weight = 1.0 / tokens if cfg.episode_weighting else 1.0
            samples.extend(episode_samples)
    return grouped, unmerged, linear
