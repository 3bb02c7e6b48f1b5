"""The numbers a study reads of a step's episodes: judge scores for judged sandboxes, every episode counted.

`scored(ep)` is one episode's number: a judged sandbox's judge score (its judge's failure value when it
raised, timed out or expired: such an episode is finished with it, never dropped), else its reward
averaged over the models that acted. When a batch holds judged episodes, `judged_metrics` turns it into
`reward/<sandbox>/mean` of each judged sandbox and `reward/mean` over every judged episode, each counted once
whichever models acted; an unjudged sandbox's episodes in such a batch are logged as
`unjudged_reward/<sandbox>/mean`, never in reward/mean. The trainer's own means cover only the samples it trained, which leave out an
episode that made no call (an agent that raised before calling the model), so the run logs these in
their place; a batch of unjudged sandboxes keeps the trainer's (per model in a multi-model run),
unless dynamic sampling kept tied groups out of it: `unjudged_reward_metrics` counts those too. Beside them:
`agent_reward/<sandbox>/mean`, what judged agents said of themselves (logged, never decided on),
`judge/<sandbox>/failed`, how many of a sandbox's episodes scored the failure value, and what a judged
sandbox's episodes cost: `calls/<sandbox>/mean` and `completion_tokens/<sandbox>/mean` per episode (a
harness that buys its score with more compute shows it here, whatever its `max_calls` allows).

Deliberately not here: scoring (the server's judges, `core.serve.judging`), logging (`core.run.telemetry`), and
the A/B's cells (`core.episodes.pairing`, which is where `scored` lives, so the episode books can count with it).
"""

from __future__ import annotations

# `scored` has one home, below the run: an A/B's cells read it too.
from core.episodes.pairing import scored
from core.records import Episode


def judged_metrics(episodes: list[Episode]) -> dict[str, float]:
    """reward/mean (judged episodes only), reward/<sandbox>/mean, unjudged_reward/<sandbox>/mean,
    agent_reward/<sandbox>/mean, judge/<sandbox>/failed and each judged sandbox's calls and completion tokens
    per episode, of a batch."""
    judged = {ep.sandbox for ep in episodes if ep.score is not None}
    if not judged:
        return {}
    values = _scores_by_sandbox(episodes)
    agent: dict[str, list[float]] = {}
    failed: dict[str, float] = {}
    cost: dict[str, list[tuple[int, int]]] = {}  # judged sandbox -> (calls, completion tokens) per episode
    for ep in episodes:
        if ep.score is not None:
            failed[ep.sandbox] = failed.get(ep.sandbox, 0.0) + ep.metrics.get("judge/failed", 0.0)
            cost.setdefault(ep.sandbox, []).append((len(ep.calls), sum(len(c.completion_ids) for c in ep.calls)))
            if "agent_reward" in ep.metrics:
                agent.setdefault(ep.sandbox, []).append(ep.metrics["agent_reward"])
    out = {f"reward/{sandbox}/mean": sum(v) / len(v) for sandbox, v in values.items() if sandbox in judged}
    # An unjudged sandbox's episodes in the same batch report a number the agent chose (issue 38: `reward: 1000`
    # from episodes opened under a name nobody judges): logged under a name of their own, never in reward/mean.
    out.update({f"unjudged_reward/{sandbox}/mean": sum(v) / len(v) for sandbox, v in values.items()
                if sandbox not in judged})
    out.update({f"agent_reward/{sandbox}/mean": sum(v) / len(v) for sandbox, v in agent.items()})
    out.update({f"judge/{sandbox}/failed": n for sandbox, n in failed.items()})
    for sandbox, per_episode in cost.items():
        out[f"calls/{sandbox}/mean"] = sum(c for c, _ in per_episode) / len(per_episode)
        out[f"completion_tokens/{sandbox}/mean"] = sum(t for _, t in per_episode) / len(per_episode)
    every = [x for sandbox, v in values.items() if sandbox in judged for x in v]
    out["reward/mean"] = sum(every) / len(every)
    return out


def unjudged_reward_metrics(episodes: list[Episode]) -> dict[str, float]:
    """reward/mean and reward/<sandbox>/mean of a batch without judged episodes, over every episode given:
    in the place of the trainer's, which leave out the groups dynamic sampling kept out
    (`core.episodes.batching`). A batch with judged episodes is `judged_metrics`'s: nothing here."""
    if any(ep.score is not None for ep in episodes):
        return {}
    values = _scores_by_sandbox(episodes)
    out = {f"reward/{sandbox}/mean": sum(v) / len(v) for sandbox, v in values.items()}
    if values:
        every = [x for v in values.values() for x in v]
        out["reward/mean"] = sum(every) / len(every)
    return out


def _scores_by_sandbox(episodes: list[Episode]) -> dict[str, list[float]]:
    """Each sandbox's `scored` values, over the episodes that have one."""
    values: dict[str, list[float]] = {}
    for ep in episodes:
        if (value := scored(ep)) is not None:
            values.setdefault(ep.sandbox, []).append(value)
    return values
