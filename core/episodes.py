"""The episode registry: keys, leases, states, groups, batch assembly, mix quotas and back-pressure.

Lifecycle: open -> (calls...) -> finished | aborted | expired. Finished train episodes join their
group, keyed by (sandbox, task_id); a group with `group_size` finished episodes is ready, and the
trainer takes ready groups in arrival order. Eval and debug episodes never train.

All state sits behind one lock because HTTP handlers and the trainer thread both touch it. The
registry does not render, generate or train; it only keeps the books.
"""

from __future__ import annotations

import math
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from core.records import Call, Episode
from core.wire import OpenEpisode

KEY_PREFIX = "sk-swarm-"
TOMBSTONES = 20_000  # ended episodes remembered so late calls get 409 and repeated finishes stay idempotent
READY_FACTOR = 2  # more than this many batches of ready groups waiting means clients outrun the trainer


class EpisodeError(Exception):
    """A request the registry refuses; `status` is the HTTP status it maps to."""

    def __init__(self, status: int, message: str, code: str, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.code, self.retry_after = status, code, retry_after


@dataclass
class Batch:
    groups: list[list[Episode]]
    dropped_stale: int = 0

    @property
    def episodes(self) -> list[Episode]:
        return [e for g in self.groups for e in g]


class Registry:
    def __init__(
        self,
        lease_s: float,
        default_group_size: int,
        batch_groups: int,
        max_open: int = 512,
        mix: dict[str, float] | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.lease_s = lease_s
        self.default_group_size = default_group_size
        self.batch_groups = batch_groups
        self.max_open = max_open
        self.mix = dict(mix or {})
        self.clock = clock
        self._lock = threading.RLock()
        self._open: dict[str, Episode] = {}
        self._keys: dict[str, str] = {}  # api key -> episode id
        self._key_of: dict[str, str] = {}  # episode id -> api key
        self._ended: OrderedDict[str, Episode] = OrderedDict()  # tombstones, calls dropped
        self._filling: dict[tuple[str, str], list[Episode]] = {}
        self._ready: deque[list[Episode]] = deque()
        self._finished_eval: list[Episode] = []
        self.paused = False
        self.counters = {"opened": 0, "finished": 0, "aborted": 0, "expired": 0, "calls": 0, "trained": 0}

    # -- client side ---------------------------------------------------------------------------
    def open(self, req: OpenEpisode, versions: dict[str, int]) -> tuple[Episode, str]:
        with self._lock:
            self._expire_due()
            if self.paused:
                raise EpisodeError(503, "the server is paused", "paused", retry_after=1.0)
            if len(self._open) >= self.max_open:
                raise EpisodeError(503, "too many open episodes", "busy", retry_after=1.0)
            if req.kind == "train":
                self._check_quota(req.sandbox)
            now = self.clock()
            ep = Episode(
                id="ep_" + secrets.token_hex(8),
                sandbox=req.sandbox,
                task_id=req.task_id,
                group_size=req.group_size or self.default_group_size,
                kind=req.kind,
                client_id=req.client_id,
                client_version=req.client_version,
                opened_at=now,
                lease_expires_at=now + (req.lease_s or self.lease_s),
                opened_versions=dict(versions),
            )
            key = KEY_PREFIX + secrets.token_urlsafe(24)
            self._open[ep.id] = ep
            self._keys[key] = ep.id
            self._key_of[ep.id] = key
            self.counters["opened"] += 1
            return ep, key

    def _check_quota(self, sandbox: str) -> None:
        """Back-pressure: clients that outrun the trainer, or a sandbox above its mix share, wait."""
        buffered = sum(len(g) for g in self._ready)
        capacity = READY_FACTOR * self.batch_groups * self.default_group_size
        if len(self._ready) >= READY_FACTOR * self.batch_groups:
            raise EpisodeError(503, "the trainer is behind; retry shortly", "backpressure", retry_after=0.5)
        if len(self.mix) < 2 or sandbox not in self.mix:
            return
        share = self.mix[sandbox] / sum(self.mix.values())
        mine = sum(1 for e in self._open.values() if e.sandbox == sandbox and e.kind == "train")
        mine += sum(len(g) for g in self._ready if g[0].sandbox == sandbox)
        mine += sum(len(g) for k, g in self._filling.items() if k[0] == sandbox)
        total = buffered + sum(1 for e in self._open.values() if e.kind == "train")
        total += sum(len(g) for g in self._filling.values())
        if mine >= math.ceil(share * max(total, capacity)) + self.default_group_size:
            raise EpisodeError(503, f"sandbox {sandbox!r} is above its mix share", "mix_quota", retry_after=0.5)

    def by_key(self, key: str) -> Episode:
        with self._lock:
            episode_id = self._keys.get(key)
            if episode_id is None:
                raise EpisodeError(401, "unknown or missing episode key", "invalid_api_key")
            return self.get_open(episode_id)

    def get_open(self, episode_id: str) -> Episode:
        with self._lock:
            self._expire_due()
            ep = self._open.get(episode_id)
            if ep is not None:
                return ep
            if episode_id in self._ended:
                state = self._ended[episode_id].state
                raise EpisodeError(409, f"episode {episode_id} is {state}", f"episode_{state}")
            raise EpisodeError(404, f"unknown episode {episode_id}", "episode_not_found")

    def record(self, episode: Episode, call: Call) -> None:
        with self._lock:
            if episode.state != "open":
                raise EpisodeError(409, f"episode {episode.id} is {episode.state}", f"episode_{episode.state}")
            episode.calls.append(call)
            self.counters["calls"] += 1

    def heartbeat(self, episode_id: str, lease_s: float | None = None) -> Episode:
        with self._lock:
            ep = self.get_open(episode_id)
            ep.lease_expires_at = self.clock() + (lease_s or self.lease_s)
            return ep

    def finish(self, episode_id: str, reward: dict[str, float], body: dict) -> Episode:
        with self._lock:
            ended = self._ended.get(episode_id)
            if ended is not None and ended.state == "finished":
                if ended.finish_body == body:
                    return ended
                raise EpisodeError(409, f"episode {episode_id} was finished with a different body", "conflict")
            ep = self.get_open(episode_id)
            ep.state, ep.reward, ep.finish_body = "finished", reward, body
            ep.metrics = dict(body.get("metrics") or {})
            self._close(ep)
            self.counters["finished"] += 1
            if ep.kind == "train":
                group = self._filling.setdefault(ep.group_key, [])
                group.append(ep)
                if len(group) >= ep.group_size:
                    self._ready.append(self._filling.pop(ep.group_key))
            elif ep.kind == "eval":
                self._finished_eval.append(ep)
            return ep

    def abort(self, episode_id: str, reason: str) -> Episode:
        with self._lock:
            ended = self._ended.get(episode_id)
            if ended is not None and ended.state == "aborted":
                return ended
            ep = self.get_open(episode_id)
            ep.state, ep.abort_reason = "aborted", reason
            self._close(ep)
            self.counters["aborted"] += 1
            return ep

    def _close(self, ep: Episode) -> None:
        del self._open[ep.id]
        # The key stays mapped while the tombstone lives, so late calls learn the episode ended (409).
        self._ended[ep.id] = ep.model_copy(update={"calls": []})
        while len(self._ended) > TOMBSTONES:
            old_id, _ = self._ended.popitem(last=False)
            self._keys.pop(self._key_of.pop(old_id, ""), None)

    def _expire_due(self) -> None:
        now = self.clock()
        for ep in [e for e in self._open.values() if e.lease_expires_at < now]:
            ep.state = "expired"
            self._close(ep)
            self.counters["expired"] += 1

    def expire_due(self) -> None:
        with self._lock:
            self._expire_due()

    # -- trainer side --------------------------------------------------------------------------
    def ready_groups(self) -> int:
        with self._lock:
            return len(self._ready)

    def take_batch(self, current_versions: dict[str, int], max_staleness: int) -> Batch | None:
        """`batch_groups` ready groups, minus episodes generated more than `max_staleness` versions ago."""
        with self._lock:
            if len(self._ready) < self.batch_groups:
                return None
            groups, dropped = [], 0
            while self._ready and len(groups) < self.batch_groups:
                group = self._ready.popleft()
                fresh = [e for e in group if _staleness(e, current_versions) <= max_staleness]
                dropped += len(group) - len(fresh)
                if fresh:
                    groups.append(fresh)
            self.counters["trained"] += sum(len(g) for g in groups)
            return Batch(groups, dropped) if groups else None

    def take_eval(self) -> list[Episode]:
        with self._lock:
            done, self._finished_eval = self._finished_eval, []
            return done

    def buffered(self) -> list[list[Episode]]:
        """Finished but untrained episodes, by group: what a checkpoint must keep."""
        with self._lock:
            return [list(g) for g in self._ready] + [list(g) for g in self._filling.values()]

    def restore(self, groups: list[list[Episode]]) -> None:
        with self._lock:
            for group in groups:
                if group and len(group) >= group[0].group_size:
                    self._ready.append(group)
                elif group:
                    self._filling[group[0].group_key] = group

    def status(self) -> dict:
        with self._lock:
            self._expire_due()
            return {
                "paused": self.paused,
                "open_episodes": len(self._open),
                "ready_groups": len(self._ready),
                "filling_groups": len(self._filling),
                "clients": sorted({e.client_id for e in self._open.values() if e.client_id}),
                "counters": dict(self.counters),
            }


def _staleness(ep: Episode, current: dict[str, int]) -> int:
    """Versions between the oldest weights that served this episode and the current ones."""
    oldest: dict[str, int] = {}
    for call in ep.calls:
        oldest[call.model] = min(oldest.get(call.model, call.version), call.version)
    return max((current.get(m, v) - v for m, v in oldest.items()), default=0)
