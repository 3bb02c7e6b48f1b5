"""Wire types of the swarm routes (DESIGN §3.2, §3.7): opening, finishing and aborting episodes, client registration and hot swap.

They live with the episode lifecycle, not with the HTTP side, because the registry (`OpenEpisode`),
the client table and the run loop all read them, and none of those may import `core.serve`.
Types only; the routes are `core.serve.swarm_routes`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class OpenEpisode(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sandbox: str = Field("default", min_length=1, max_length=128)  # groups are keyed by (sandbox, task_id, client_version)
    # The client's own task id; None for a judged sandbox, whose tasks the server deals from its judge
    # (`EpisodeOpened.task`). Unjudged sandboxes need one (400 without); judged ones refuse one (409).
    task_id: str | None = Field(None, min_length=1, max_length=512)
    split: str = Field("train", min_length=1, max_length=64)  # the judge's split a dealt task comes from
    group_size: int | None = Field(None, ge=1, le=1024)  # None: the trainer's default
    kind: Literal["train", "eval", "debug"] = "train"
    client_id: str = Field("", max_length=256)
    client_version: str = Field("", max_length=256)  # e.g. the git commit of the client's code
    lease_s: float | None = Field(None, gt=0, le=86400)  # None: the server's default


class EpisodeOpened(BaseModel):
    episode_id: str
    api_key: str  # a random secret: the bearer key that binds OpenAI calls to this episode
    base_url: str  # OpenAI base URL for this episode (path form, usable without the key too)
    lease_expires_at: float  # unix seconds
    model_versions: dict[str, int]
    task_id: str | None = None  # the episode's task id (the client's own, or the one the server dealt)
    task: dict[str, Any] | None = None  # a judged sandbox's task, dealt by the server from its judge; else None


class FinishEpisode(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # One reward, or one per model for multi-model episodes; finite, and within +-trainer.max_abs_reward
    # (1e6 by default; the registry refuses a finish beyond it with 400, the episode staying open).
    reward: float | dict[str, float]
    metrics: dict[str, float] | None = None
    # What rollout returned as its answer (any JSON), handed to a judged sandbox's judge with the server's
    # record of the episode; a judged episode's reward is the judge's score, the one sent here is only logged.
    answer: Any = None

    @field_validator("reward")
    @classmethod
    def _finite(cls, v: float | dict[str, float]) -> float | dict[str, float]:
        values = v.values() if isinstance(v, dict) else [v]
        if any(x != x or x in (float("inf"), float("-inf")) for x in values):
            raise ValueError("reward must be finite")
        return v


class AbortEpisode(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: str = Field("", max_length=2000)


class EpisodeState(BaseModel):
    episode_id: str
    state: str
    lease_expires_at: float
    reward: dict[str, float] | None = None


# -- client registration and hot swap (DESIGN §3.7) ---------------------------------------------------


class RegisterClient(BaseModel):
    """What a client process tells the server about itself; sent again as its heartbeat."""

    model_config = ConfigDict(extra="forbid")
    client_id: str = Field(min_length=1, max_length=256)  # unique per process, e.g. letters-host-1234-ab12
    sandbox: str = Field(min_length=1, max_length=128)  # the sandbox name its episodes carry
    version: str = Field("", max_length=256)  # its code version (the sandbox folder's commit or hash)
    pid: int = Field(ge=0)  # its process id on `host`: for people reading status, never signalled by swap
    host: str = Field("", max_length=256)  # socket.gethostname() of the client
    kind: Literal["train", "eval", "debug"] = "train"  # the kind of episodes it opens
    group_size: int = Field(ge=1, le=1024)  # episodes per task group it opens
    concurrency: int = Field(1, ge=1)  # episodes it keeps in flight
    spec: str = Field("", max_length=4096)  # how it was started (sandbox:NAME or a folder): for people
    failed: int = Field(0, ge=0)  # episodes that failed so far (its code raised, or the server refused)
    # How it draws and runs tasks: `swarm swap` starts the new version with the same (an A/B compares code only).
    seed: str | None = Field(None, max_length=256)  # its task-order seed (None: tasks in file order)
    split: str = Field("train", min_length=1, max_length=64)  # the split its tasks come from
    tasks: int | None = Field(None, ge=1)  # its task budget (None: no limit)
    episode_timeout: float | None = Field(None, ge=0)  # each rollout's deadline in s (None: the default, 0: none)


class ClientOrders(BaseModel):
    """The server's answer to a registration or heartbeat: the client's key and whether to drain."""

    client_id: str
    key: str  # the registration's secret: heartbeats and leaving need it as bearer (401 otherwise)
    drain: bool  # true: open no new episodes, finish those in flight, leave and exit
    heartbeat_s: float  # send the registration again this often; silent for CLIENT_TTL_S, it is dropped


class DrainClients(BaseModel):
    """An admin's order (`swarm swap`) to drain named clients of one sandbox, naming their successor.

    With `ab` nobody drains: the named clients keep serving beside the successor (an A/B inside the
    live run, `swarm swap --ab`) and the order only records the swap; the loser drains by a later order."""

    model_config = ConfigDict(extra="forbid")
    sandbox: str = Field(min_length=1, max_length=128)
    client_ids: list[str] = Field(default_factory=list, max_length=1024)  # [] drains nothing (checks the token)
    successor: str = Field("", max_length=256)  # the registered client that takes over ("" with no ids)
    ab: bool = False  # record the swap, drain nobody: old and new serve side by side


class SwapRecord(BaseModel):
    """One hot swap as the server saw it: logged by the run as tag `swarmrl.sandbox_swap.<n>`."""

    n: int  # 1, 2, ...: the swaps of this server, in order
    sandbox: str
    from_versions: list[str]  # code versions of the clients told to drain
    to_version: str  # the successor's version
    successor: str  # the successor's client id
    to_spec: str = ""  # how the successor was started (its sandbox folder): tools find their swap by it
    drained: list[str]  # client ids told to drain ([] for an A/B: they keep serving beside the successor)
    at: float  # unix seconds
    ab: bool = False  # an A/B start: from_versions keep serving beside to_version until the loser drains
    step: int | None = None  # the trainer step when it happened (set by the run; None without a trainer)


# -- client credentials (issue 38.1): who a client is, as its run or `swarm swap` declared it -------------------


class ClientGrant(BaseModel):
    """What a client credential binds: what the run config (or `swarm swap`) says its client process is.

    An episode opened with the credential takes these values; an open or a registration that states
    anything else is a 403 naming the field (`core.episodes.credentials`)."""

    model_config = ConfigDict(extra="forbid")
    sandbox: str = Field(min_length=1, max_length=128)  # the one sandbox its episodes may name
    version: str = Field("", max_length=256)  # its code version (the sandbox folder's commit or hash)
    kind: Literal["train", "eval", "debug"] = "train"  # debug only in a grant a person (the admin token) made
    split: str = Field("train", min_length=1, max_length=64)
    group_size: int = Field(ge=1, le=1024)
    concurrency: int = Field(1, ge=1)  # episodes it keeps in flight (its registration must say the same)
    seed: str | None = Field(None, max_length=256)  # its task-order seed (its registration must say the same)
    models: list[str] = Field(default_factory=list, max_length=64)  # the models its run serves it ([]: every one)


class CredentialIssued(BaseModel):
    """The answer to `POST /swarm/v1/admin/credentials`: the secret a client sends as `X-Swarm-Grant`."""

    credential: str  # hand it to the client process only (`SWARMRL_CLIENT_GRANT`); the server keeps its grant
    grant: ClientGrant
