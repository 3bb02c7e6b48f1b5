"""A step's rollout metrics: what the run logs of the episodes a batch trained and of the serving side.

Rates since the previous step (`rollout/episodes_per_s`, `rollout/tokens_per_s`), the batch's rollout
time, the registry's episode counters (aborted, expired, refused, `episodes/wasted_frac`), calls and
completion tokens per episode (`episode/calls`, `episode/tokens`, and per code version), per code
version episode counts and rewards, eval means, judged scores (`core.run.scores`), an A/B's paired
scores (`core.episodes.pairing`) and each replica's load and health. `CoreRun` asks for them once per
step. It is deliberately not the loop and not telemetry: it reads the server and the batch, takes the
finished eval episodes and the A/B pairs' step, and logs nothing (`core.run.telemetry` does).
"""

from __future__ import annotations

import time

from core.episodes.batching import Batch
from core.records import Episode
from core.run.scores import judged_metrics, scored, unjudged_reward_metrics
from core.serve.server import Server


def episode_cost(episodes: list[Episode], prefix: str) -> dict[str, float]:
    """`<prefix>/calls` and `<prefix>/tokens`: the mean recorded calls and sampled completion tokens per episode."""
    if not episodes:
        return {}
    calls = sum(len(ep.calls) for ep in episodes)
    tokens = sum(len(c.completion_ids) for ep in episodes for c in ep.calls)
    return {f"{prefix}/calls": calls / len(episodes), f"{prefix}/tokens": tokens / len(episodes)}


class RolloutMeter:
    """The rollout metrics of one run's steps; remembers where the previous step left the rates."""

    def __init__(self, server: Server):
        self.server = server
        self._last = (time.time(), 0)  # (time, completion tokens served) at the previous step

    def metrics(self, batch: Batch) -> dict[str, float]:
        """The step's rollout metrics for `batch`; the rates cover the time since the previous call."""
        now, tokens = time.time(), self.server.throughput.completion_tokens
        then, then_tokens = self._last
        self._last = (now, tokens)
        dt = max(now - then, 1e-9)
        counters = self.server.registry.counters
        episodes = batch.episodes_scored  # with the tied groups dynamic sampling kept out: rolled out, and scored
        out = {
            "rollout/episodes_per_s": len(episodes) / dt,
            "rollout/tokens_per_s": (tokens - then_tokens) / dt,
            # Wall time from the batch's first open to its last finish (overlaps the previous step).
            "time/rollout_s": max(e.ended_at or now for e in episodes) - min(e.opened_at for e in episodes),
            "episodes/aborted": float(counters["aborted"]),
            "episodes/expired": float(counters["expired"]),
            "episodes/refused": float(counters["refused"]),
            # Of the train episodes that generated anything so far, those never trained (stale, or
            # aborted/expired after generating).
            "episodes/wasted_frac": counters["wasted"] / max(counters["generated"], 1),
            **self.server.throughput.tito_metrics(),  # tito/{reused,drift,broken}, cumulative
        }
        by_sandbox: dict[str, list[float]] = {}
        for ep in self.server.registry.take_eval():
            if (value := scored(ep)) is not None:
                by_sandbox.setdefault(ep.sandbox, []).append(value)
        # What an episode cost: recorded model calls and sampled completion tokens, per episode. A harness that
        # buys its score with more compute (resampling until good) shows it here, beside the score (issue 38).
        out.update(episode_cost(episodes, "episode"))
        for (sandbox, version), eps in batch.by_version().items():  # every episode names its code version
            rewards = [v for v in map(scored, eps) if v is not None]
            out[f"episodes/{sandbox}/version/{version}"] = float(len(eps))
            out.update(episode_cost(eps, f"episode/{sandbox}/version/{version}"))
            if rewards:
                out[f"reward/{sandbox}/version/{version}"] = sum(rewards) / len(rewards)
        for sandbox, rewards in by_sandbox.items():
            out[f"eval/{sandbox}/mean"] = sum(rewards) / len(rewards)
        out.update(judged_metrics(episodes))  # reward/mean and reward/<sandbox>/mean: every episode counted
        if batch.kept_out:  # the trainer's reward means cover its groups only: not those dynamic sampling kept out
            out.update(unjudged_reward_metrics(episodes))
        # An A/B: both versions' scores over the (task, weights at open) cells both reached; the registry counts
        # every train episode in its cell when it ends, trained or not (`core.episodes.pairing`).
        out.update(self.server.registry.pairs.take())
        out["episodes/mixed_version_groups"] = float(sum(len({e.client_version for e in g}) > 1 for g in batch.groups))
        for name, p in self.server.policies.items():
            replicas = p.engine.status()  # each replica's load, version and health, per step; none for one engine
            prefix = "" if len(self.server.policies) == 1 else f"{name}/"
            if replicas:
                out[f"{prefix}time/replica_sync_s"] = p.engine.last_sync_s
            for r in replicas:
                for key in ("episodes", "inflight", "healthy", "version", "restarts"):
                    out[f"{prefix}replica/{r['replica']}/{key}"] = float(r[key] if r[key] is not None else -1)
        return out
