"""What the HTTP routes see of a server: hosted policies, throughput counters, and the state's shape.

The server (`core.serve.server`) owns this state and builds the app; the route modules (`core.serve.gateway`,
`core.serve.swarm_routes`, `core.serve.streaming`) take it as a parameter typed by `ServerState`, so imports run one
way: server → gateway → swarm_routes / streaming → state, episodes. This module holds data only: it
deliberately does not load models, serve HTTP or train.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from core.serve.chat import ChatRenderer
from core.sandbox.dealer import Dealer
from core.sandbox.judge import Judge
from core.episodes.client_table import ClientTable
from core.episodes.credentials import Credentials
from core.config import RunConfig
from core.engine import Engine
from core.episodes.registry import Registry


@dataclass
class Policy:
    """One hosted model: what clients name as `model`, with its tokenizer, renderer and engine."""

    name: str
    model: Any  # the torch.nn.Module its engine generates with and its trainer updates (not imported here)
    tokenizer: object
    renderer: ChatRenderer
    engine: Engine
    trainable: bool = True
    step: int = 0

    @property
    def version(self) -> int:
        return self.engine.version


@dataclass
class Throughput:
    """Counters the gateway bumps and `/status` reads; rates are derived, never stored."""

    started: float = field(default_factory=time.time)
    calls: int = 0
    completion_tokens: int = 0
    tito_reused: int = 0
    tito_drift: int = 0  # a fresh tokenisation would have differed from the exact ids we reused
    tito_broken: int = 0  # history edited by the client: ids re-rendered, no reuse

    def as_dict(self) -> dict:
        elapsed = max(time.time() - self.started, 1e-9)
        return {
            "calls": self.calls,
            "completion_tokens": self.completion_tokens,
            "calls_per_s": self.calls / elapsed,
            "tokens_per_s": self.completion_tokens / elapsed,
            "tito": {"reused": self.tito_reused, "drift": self.tito_drift, "broken": self.tito_broken},
        }

    def tito_metrics(self) -> dict[str, float]:
        """Token-in-token-out counts since the server started, as MLflow metrics (cumulative, like
        `episodes/aborted`): `tito/reused` calls reused exact ids, `tito/drift` of them a re-render
        would have tokenised differently (the reuse mattered), `tito/broken` histories were edited."""
        return {"tito/reused": float(self.tito_reused), "tito/drift": float(self.tito_drift),
                "tito/broken": float(self.tito_broken)}


class ServerState(Protocol):
    """The server as the routes use it (`core.serve.server.Server` is the one implementation)."""

    cfg: RunConfig
    policies: dict[str, Policy]
    registry: Registry
    clients: ClientTable  # registered client processes (hot swap drains through it)
    judges: dict[str, Judge]  # judged sandbox -> its judge, loaded from the folders the run config names
    dealer: Dealer  # deals judged sandboxes' tasks from their judges
    admin_token: str
    credentials: Credentials  # the client credentials this server issued and what each binds
    allow_anonymous: bool  # serve requests without an episode key (unrecorded); False while training
    throughput: Throughput
    on_checkpoint: Callable[[], str] | None  # the run's, given at construction; None: no trainer to checkpoint
    on_shutdown: Callable[[], None] | None  # the run's, given at construction; None: `/admin/shutdown` just stops serving

    def versions(self) -> dict[str, int]: ...

    def status(self) -> dict[str, Any]: ...

    def request_exit(self) -> None: ...

    async def sweep_leases(self) -> None: ...
