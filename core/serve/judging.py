"""Scoring a judged sandbox's finished episode in the server: its judge over the server's record.

`judged_finish` is what the finish route does for a judged sandbox (DESIGN §3.7): the judge
(`core.sandbox.judge`, loaded from the sandbox folder the run config names) scores the task the
server dealt and every call the server recorded of the episode, in order, plus the answer `rollout`
returned; an episode with more calls than its sandbox's `max_calls` scores the failure value (the
gateway refuses such a call in the first place, `core.serve.protocol`). That score is the reward of every model that acted and the number `reward/*` and `eval/*`
report; the reward the agent sent is kept only as the metric `agent_reward`. A judge that raises
or returns no finite number scores its failure value, logged with the reason.

It deliberately does not decide what happens to an episode that never finishes (the registry finishes
a judged one with the failure value, `core.episodes.registry`) nor deal tasks (`core.sandbox.dealer`).
"""

from __future__ import annotations

import logging

from core.sandbox.judge import judge_episode
from core.episodes.wire import FinishEpisode
from core.records import Call, Episode
from core.serve.state import ServerState

log = logging.getLogger(__name__)


def judged_finish(server: ServerState, ep: Episode, body: FinishEpisode) -> tuple[dict[str, float], float, dict[str, float]]:
    """-> (reward per model that acted, the judge's score, server-side metrics) for a judged episode's finish."""
    judge = server.judges[ep.sandbox]
    agent = body.reward.values() if isinstance(body.reward, dict) else [body.reward]
    metrics = {"agent_reward": sum(agent) / max(len(agent), 1)}  # logged as agent_reward/*, never decided on
    task = server.dealer.task_of(ep.id)
    limit = judge.protocol.max_calls
    if task is None:
        score, why = judge.failure, "the server has no record of the task it dealt this episode"
    elif limit is not None and len(ep.calls) > limit:  # the gateway refuses such a call; this holds whatever path
        score, why = judge.failure, f"{len(ep.calls)} calls recorded, beyond sandbox.toml max_calls = {limit}"
    else:
        score, why = judge.score(task, judge_episode(ep, body.answer, lambda call: _text(server, call)))
    if why is not None:
        log.warning("episode %s of %s scores the judge's failure value %g: %s", ep.id, ep.sandbox, judge.failure, why)
        metrics["judge/failed"] = 1.0
    return {m: score for m in dict.fromkeys(c.model for c in ep.calls)}, score, metrics


def _text(server: ServerState, call: Call) -> str:
    """A call's completion text: its reply's content, or (a /v1/completions call records no reply) its ids decoded."""
    if call.reply is not None:
        return call.reply.get("content") or ""
    return server.policies[call.model].tokenizer.decode(call.completion_ids, skip_special_tokens=True)
