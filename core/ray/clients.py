"""Ray placement, the client actors' side: `RayRun`, a `CoreRun` whose clients are Ray actors.

`RayRun.start_clients` starts each client's actors (`clients[].ray.replicas`, `core.ray.actors.ClientActor`),
which reach the gateway by URL (`client_url`), each with its task order and credential; a watcher
thread replaces one whose process died, up to CLIENT_RESTARTS per slot, and fails the run for one
whose agent gave up or that keeps dying. Deliberately not here: the models' actors and their recovery
(`core.ray.driver`), and the agents themselves (`core.clients`).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayActorError

from core.clients.sandbox import code_version
from core.ray.actors import ClientActor
from core.run.loop import CLIENT_DRAIN_S, CoreRun
from core.serve.server import Server

log = logging.getLogger(__name__)

CLIENT_RESTARTS = 3  # client actors started again per slot after their process died, before the run fails


class RayRun(CoreRun):
    """A `CoreRun` whose clients are Ray actors. A client actor whose process dies (node lost, OOM) is
    replaced, up to CLIENT_RESTARTS times per slot; a client whose agent fails (it gives up) or that
    keeps dying ends the run FAILED, as a crashed local client does."""

    _slots: list[_ClientSlot] = []
    _stopping = False
    client_results: list[dict[str, int]] = []  # per client actor once stopped: finished, failed, pid

    def start_clients(self) -> None:
        url = client_url(self.server)
        self._slots = []
        for n, c in enumerate(self.cfg.clients):
            data = {**c.model_dump(), "agent": portable_agent(c.agent)}
            # Each replica its own task order (set by trainer.seed) and its credential (core.episodes.credentials),
            # bound to the code version of the folder the actors load (the same on every machine of a clean checkout).
            version = code_version(data["agent"])
            for i in range(c.ray.replicas):
                slot = _ClientSlot(c.ray.num_cpus, c.ray.resources, (data, url, c.group_size or self.cfg.trainer.group_size,
                                                                     f"{c.sandbox_name}-{i}", f"{self.cfg.trainer.seed}/{n}/{i}",
                                                                     self._credential(c, n, version)))
                slot.start()
                self._slots.append(slot)
        threading.Thread(target=self._watch_clients, daemon=True, name="ray-clients").start()

    def _watch_clients(self) -> None:
        while not self.stop.is_set() and not self._stopping:
            by_ref = {slot.ref: slot for slot in self._slots if not slot.finished}
            if not by_ref:
                return
            done, _ = ray.wait(list(by_ref), num_returns=1, timeout=1.0)
            for ref in done:
                slot = by_ref[ref]
                try:
                    ray.get(ref)
                    slot.finished = True  # its task budget is spent
                except RayActorError as e:
                    if self._stopping:
                        return
                    if slot.restarts < CLIENT_RESTARTS:
                        slot.restarts += 1
                        log.warning("client actor %s died (%s); starting another (%d of %d)",
                                    slot.args[3], e, slot.restarts, CLIENT_RESTARTS)
                        slot.start()
                    else:
                        self._fail(e)
                except Exception as e:  # the agent gave up: no client left would hang the trainer
                    if not self._stopping:
                        self._fail(e)

    def _fail(self, error: BaseException) -> None:
        log.error("a Ray client failed: %s", error)
        self.failure = error
        self.stop.set()

    def stop_clients(self) -> None:
        self._stopping = True
        for slot in self._slots:
            slot.actor.stop.remote()
        if self._slots:
            done, _ = ray.wait([slot.ref for slot in self._slots], num_returns=len(self._slots), timeout=CLIENT_DRAIN_S)
            self.client_results = [r for r in (_result(ref) for ref in done) if r is not None]
            log.info("Ray clients: %s", self.client_results)
        for slot in self._slots:
            ray.kill(slot.actor)


@dataclass
class _ClientSlot:
    """One client actor's place: its resources and `ClientActor.run` arguments, the live actor and its task."""

    num_cpus: float
    resources: dict[str, float]
    args: tuple[Any, ...]
    actor: Any = None
    ref: Any = None
    restarts: int = 0
    finished: bool = False

    def start(self) -> None:
        self.actor = ray.remote(ClientActor).options(num_cpus=self.num_cpus, resources=self.resources or None).remote()
        self.ref = self.actor.run.remote(*self.args)


def _result(ref: Any) -> dict[str, int] | None:
    try:
        return ray.get(ref)
    except Exception:  # the failure was reported by the watcher when it happened
        return None


def client_url(server: Server) -> str:
    """The gateway's URL as a client actor on any node reaches it (a wildcard bind becomes this node's IP)."""
    host = server.cfg.server.host
    if host in ("0.0.0.0", "::", ""):
        host = ray.util.get_node_ip_address()
    return f"http://{host}:{server.port}"


def portable_agent(spec: str) -> str:
    """A sandbox named relative to this folder, as an absolute path an actor finds from any working folder."""
    name = spec.removeprefix("sandbox:")
    folder = Path(name) if Path(name).is_dir() else Path("sandboxes") / name
    return str(folder.resolve()) if (folder / "agent.py").is_file() else spec
