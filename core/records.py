"""What the server remembers about an episode: its calls, at the token level.

These are plain data. The episode registry (`core.episodes.registry`) owns their lifecycle, the timeline
merger (`core.train.timelines`) turns them into training samples, and checkpoints serialise them.
Nothing here talks to a model or the network.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

EpisodeKind = Literal["train", "eval", "debug"]
EpisodeState = Literal["open", "finished", "aborted", "expired"]


class Call(BaseModel):
    """One LLM call made inside an episode, exactly as the engine saw and produced it."""

    model: str  # name of the policy that served the call
    version: int  # weight version that generated the completion
    messages: list[dict[str, Any]] = Field(default_factory=list)  # request messages ([] for /v1/completions)
    prompt_ids: list[int]  # exact ids fed to the engine, template included
    completion_ids: list[int]  # exact ids the engine sampled, EOS included if it stopped on EOS
    # Behaviour logprob of each completion id under softmax(logits / temperature): what sampled it.
    completion_logprobs: list[float]
    temperature: float = 1.0  # the logprobs' temperature; the trainer scores this call's tokens at it
    top_p: float = 1.0  # nucleus mass kept when sampling (< 1: the logprobs ignore the truncation)
    finish_reason: str = "stop"
    reused_prefix: int = 0  # leading prompt ids copied from an earlier call (token-in-token-out)
    reply: dict[str, Any] | None = None  # the assistant message returned to the client


class Episode(BaseModel):
    """An agent's attempt at one task: a lease, a key, a group, its calls and its reward."""

    id: str
    sandbox: str
    task_id: str
    group_size: int
    kind: EpisodeKind = "train"
    client_id: str = ""
    client_version: str = ""  # code version of the client (a git commit for sandboxes)
    state: EpisodeState = "open"
    opened_at: float
    lease_expires_at: float
    opened_versions: dict[str, int] = Field(default_factory=dict)  # model -> version at open (staleness reads the calls')
    # Episodes of its (sandbox, task_id) this server opened before it: its name across runs, which the
    # gateway turns into each call's sampling key (`engine.repeatable_sampling`); its id is random.
    ordinal: int = 0
    ended_at: float | None = None  # when it finished, aborted or expired
    calls: list[Call] = Field(default_factory=list)
    # Model calls (choices) the gateway started for it, ended or not: what a sandbox's `max_calls` bounds, so a
    # call cut off mid-stream or failed still counts (`core.serve.protocol`).
    calls_started: int = 0
    reward: dict[str, float] | None = None  # model -> reward, set by finish
    # A judged sandbox's score from its judge (core.sandbox.judge), which is also the reward of every model
    # that acted; FAILURE when it raised, timed out or expired. None for unjudged sandboxes.
    score: float | None = None
    metrics: dict[str, float] = Field(default_factory=dict)
    finish_body: dict[str, Any] | None = None  # remembered so a repeated finish is idempotent
    abort_reason: str | None = None

    @property
    def group_key(self) -> tuple[str, str]:
        return (self.sandbox, self.task_id)

    @property
    def train_group(self) -> tuple[str, str, str]:
        """The group it trains in: its task's, of its own code version only, so that while two versions
        serve side by side (an A/B) no advantage is computed across them."""
        return (self.sandbox, self.task_id, self.client_version)

    @property
    def weights(self) -> tuple[tuple[str, int, int], ...]:
        """The weights it ran on: (model, oldest, newest version among its calls) per model, sorted; () with no
        call. An A/B compares two episodes only when these are equal (`core.episodes.pairing`)."""
        span: dict[str, tuple[int, int]] = {}
        for c in self.calls:
            low, high = span.get(c.model, (c.version, c.version))
            span[c.model] = (min(low, c.version), max(high, c.version))
        return tuple(sorted((m, low, high) for m, (low, high) in span.items()))

    def calls_of(self, model: str) -> list[Call]:
        return [c for c in self.calls if c.model == model]
