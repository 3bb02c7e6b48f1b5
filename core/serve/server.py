"""The swarm server: hosted policies, the episode registry, and the HTTP app, started with uvicorn.

A `Policy` is one trainable model with its tokenizer, chat renderer and engine. A `Server` hosts one
or more policies behind one gateway (multi-model RL), owns the registry, and can run uvicorn in the
foreground (`swarm serve`) or in a background thread (`swarm run`, tests). Training is not here: the
run loop (`core.run.loop`) pauses the engines, steps the trainers and bumps versions through this object.
The server owns the state; the route modules (`core.serve.gateway` and what it includes) take it as a
parameter typed by `core.serve.state.ServerState` and never import this module.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn

from core import models
from core.serve.chat import ChatRenderer
from core.episodes.auth import masked
from core.sandbox.dealer import Dealer
from core.sandbox.judge import load_judges
from core.episodes.client_table import ClientTable
from core.episodes.credentials import Credentials
from core.config import ModelConfig, RunConfig
from core.engine.replicas import make_model_engine
from core.episodes.registry import Registry
from core.episodes.wire import SwapRecord
from core.serve.gateway import build_app
from core.serve.state import Policy, Throughput  # noqa: F401 (Policy: re-exported, callers build policies from here)

log = logging.getLogger(__name__)

EXPIRY_SWEEP_S = 1.0  # how often leases are checked when nobody is calling


class Server:
    def __init__(self, cfg: RunConfig, policies: dict[str, Policy] | None = None, *,
                 on_checkpoint: Callable[[], str] | None = None, on_shutdown: Callable[[], None] | None = None,
                 on_swap: Callable[[SwapRecord], None] | None = None,
                 on_lost: Callable[[list[str]], None] | None = None):
        """`policies`: given (built elsewhere, their engines with their own callbacks), else loaded from `cfg`.
        What the run that trains through this server is told, each None when nothing trains:
        `on_checkpoint` writes a checkpoint for `/admin/checkpoint` and returns its path; `on_shutdown`
        stops after the current step (`/admin/shutdown`; None: the server just stops serving); `on_swap`
        hears of a hot swap (`swarm swap` drained old clients); `on_lost` takes the open episodes of a lost
        replica of a loaded model (`core.engine.replicas`) to abort them."""
        self.cfg = cfg
        self.registry = Registry(
            lease_s=cfg.server.lease_s,
            default_group_size=cfg.trainer.group_size,
            batch_groups=cfg.trainer.batch_groups,
            max_open=cfg.server.max_open_episodes,
            mix={c.sandbox_name: c.mix for c in cfg.clients if c.kind == "train"},
            max_abs_reward=cfg.trainer.max_abs_reward,
        )
        self.policies = policies if policies is not None else load_policies(cfg, on_lost, self.registry.is_open)
        # registered client processes (`swarm swap` drains through it); an A/B's end voids its owed tasks
        self.clients = ClientTable(on_swap=on_swap, on_ab_end=self.registry.pairing.close)
        # Judged sandboxes score and deal tasks by the judges in the folders this config names, never by code
        # a client brings (a hot-swapped client's checkout included): core.sandbox.judge, DESIGN §3.7.
        self.judges = load_judges(cfg)
        self.dealer = Dealer(self.judges, cfg.trainer.seed)
        self.registry.failure_scores = {name: judge.failure for name, judge in self.judges.items()}
        self.admin_token = cfg.server.admin_token or secrets.token_urlsafe(24)
        # Client credentials (core.episodes.credentials): a run and `swarm swap` issue one per client process.
        self.credentials = Credentials()
        # Requests without an episode key: served (unrecorded) only while nothing trains; the run loop
        # turns this off when it has trainers (see `core.run.loop`, docs/architecture.md "Anonymous use").
        self.allow_anonymous = cfg.server.allow_anonymous
        self.throughput = Throughput()
        self.on_checkpoint, self.on_shutdown = on_checkpoint, on_shutdown
        self.stalled: str | None = None  # the hang watchdog's diagnostic while nothing progresses (`core.run.watchdog`)
        self._uvicorn: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.port = cfg.server.port

    @property
    def url(self) -> str:
        return f"http://{self.cfg.server.host}:{self.port}"

    def versions(self) -> dict[str, int]:
        return {name: p.version for name, p in self.policies.items()}

    def app(self):
        return build_app(self)

    def _uvicorn_server(self) -> uvicorn.Server:
        if self.port == 0:
            self.port = free_port(self.cfg.server.host)
        config = uvicorn.Config(
            self.app(), host=self.cfg.server.host, port=self.port, log_level="warning", access_log=False,
            timeout_graceful_shutdown=self.cfg.server.shutdown_s,  # then requests in flight are cancelled
        )
        return uvicorn.Server(config)

    def serve_forever(self) -> None:
        """Serve in the foreground until interrupted (`swarm serve`)."""
        self._uvicorn = self._uvicorn_server()
        log.info("serving %s at %s (admin token %s)", ", ".join(self.policies), self.url, masked(self.admin_token))
        try:
            self._uvicorn.run()
        finally:
            self.close()

    def start(self) -> str:
        """Serve from a background thread; returns the base URL once the socket accepts connections."""
        self._uvicorn = self._uvicorn_server()
        self._thread = threading.Thread(target=self._uvicorn.run, name="swarm-http", daemon=True)
        self._thread.start()
        deadline = time.time() + 30
        while not self._uvicorn.started:
            if time.time() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"server did not start on {self.url}")
            time.sleep(0.02)
        return self.url

    def request_exit(self) -> None:
        """Ask the serving uvicorn to shut down gracefully; safe from any thread, `serve_forever` then returns."""
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True

    def stop(self) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.close()

    def close(self) -> None:
        for p in self.policies.values():
            p.engine.close()

    async def sweep_leases(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_SWEEP_S)
            self.registry.expire_due()

    def status(self) -> dict:
        reg = self.registry.status()
        finished = self.registry.finished_by()
        return {
            "state": "paused" if reg["paused"] else "stalled" if self.stalled else "serving",
            "stalled": self.stalled,
            "models": {n: self._model_status(p) for n, p in self.policies.items()},
            "trainer": {"group_size": self.cfg.trainer.group_size, "batch_groups": self.cfg.trainer.batch_groups},
            # Sandboxes this server judges: their clients open episodes without a task id and run the task dealt.
            "judged": sorted(self.judges),
            "buffer": {"ready_groups": reg["ready_groups"], "filling_groups": reg["filling_groups"],
                       "episodes": reg["buffered_episodes"]},
            "open_episodes": reg["open_episodes"],
            # Registered client processes (DESIGN §3.7), each with the episodes it finished: `swarm swap`
            # waits for its new client's first one before it drains the old.
            "clients": [{**c, "finished": finished.get(c["client_id"], 0)} for c in self.clients.listing()],
            "swaps": [s.model_dump() for s in self.clients.swaps],
            # Open A/Bs (sandbox -> swap number), the tasks their new versions still owe or dropped unpaid, and
            # the latest compared pairs: (task, weights) cells both versions reached (core.episodes.pairing).
            "ab": {"open": self.clients.ab_open(), "owed": self.registry.pairing.owed(),
                   "dropped": dict(self.registry.pairing.dropped), "pairs": self.registry.pairs.status()},
            "episodes": reg["counters"],
            "throughput": self.throughput.as_dict(),
        }


    @staticmethod
    def _model_status(p: Policy) -> dict:
        """A hosted model's line: version, trainer step, trainable, and its replicas' rows when it has them."""
        replicas = p.engine.status()
        return {"version": p.version, "step": p.step, "trainable": p.trainable,
                **({"replicas": replicas} if replicas else {})}


def load_policies(cfg: RunConfig, on_lost: Callable[[list[str]], None] | None = None,
                  is_open: Callable[[str], bool] | None = None) -> dict[str, Policy]:
    """Every model `cfg` names, loaded, each behind its engine; `on_lost` and `is_open` go to replica engines."""
    policies = {}
    for mc in cfg.models:
        model, tok, max_context = load_model(mc)
        # one engine, or replicas (core.engine.replicas)
        engine = make_model_engine(cfg, mc, model, tok, max_context, on_lost=on_lost, is_open=is_open)
        policies[mc.name] = Policy(mc.name, model, tok, ChatRenderer(tok), engine, trainable=mc.trainable)
    return policies


def load_model(mc: ModelConfig) -> tuple[Any, Any, int]:
    """`mc`'s module (with its LoRA adapters when it trains them), tokenizer and context length, no engine."""
    model, tok = models.load(mc)
    if mc.trainable and mc.lora is not None:
        model = models.prepare_policy(model, mc.lora)  # peft is imported only for LoRA runs
    return model, tok, mc.max_context or min(getattr(model.config, "max_position_embeddings", 2048), 1 << 16)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
