"""The episode registry: keys, leases, states, groups, batch assembly, mix quotas and back-pressure.

Lifecycle: open -> (calls...) -> finished | aborted | expired. Finished train episodes join their
group, keyed by (sandbox, task_id); a group with `group_size` finished episodes is ready, and the
trainer takes ready groups in arrival order. Eval and debug episodes never train.

Staleness counts by the weights that generated an episode: the oldest version among its calls.
Admission control (on once a trainer calls `admit_within`) keeps generation from being wasted: an
episode that starts a new group is refused (503 + Retry-After) while the groups already started
would fill every step the staleness budget allows, `max_staleness + 1` steps, one fewer while an
overlapped step is between taking its batch and its weight sync. An episode that completes a
started group is always admitted, so a partial group can never block the trainer.

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

from core.auth import path_secret, same_secret
from core.records import Call, Episode
from core.wire import OpenEpisode

KEY_PREFIX = "sk-swarm-"
TOMBSTONES = 20_000  # ended episodes remembered so late calls get 409 and repeated finishes stay idempotent
READY_FACTOR = 2  # more than this many batches of ready groups waiting means clients outrun the trainer
# Seconds a refused open is told to wait: about one short train step; HTTP allows whole seconds only.
ADMISSION_RETRY_S = 1.0


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
        self._path_key = secrets.token_bytes(32)  # per server: path secrets cannot be precomputed
        self._paths: dict[str, str] = {}  # path secret -> episode id (the path form's credential)
        self._path_of: dict[str, str] = {}  # episode id -> path secret
        self._ended: OrderedDict[str, Episode] = OrderedDict()  # tombstones, calls dropped
        self._filling: dict[tuple[str, str], list[Episode]] = {}
        self._ready: deque[list[Episode]] = deque()
        self._finished_eval: list[Episode] = []
        self.paused = False
        self.max_staleness: int | None = None  # None: no admission control (no trainer consumes steps)
        self._overlapped_steps = 0  # steps that took their batch while generation goes on, not yet synced
        # generated: train episodes that ended having made a call; wasted: those never trained
        # (stale at batch time, or aborted/expired after generating).
        self.counters = {"opened": 0, "finished": 0, "aborted": 0, "expired": 0, "calls": 0, "trained": 0,
                         "stale": 0, "generated": 0, "wasted": 0, "refused": 0}

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
                self._check_admission(req)
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
            secret = path_secret(self._path_key, key)
            self._paths[secret] = ep.id
            self._path_of[ep.id] = secret
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

    def admit_within(self, max_staleness: int) -> None:
        """Turn admission control on, for a trainer that drops episodes older than `max_staleness`."""
        with self._lock:
            self.max_staleness = max_staleness

    def step_started(self) -> None:
        """An overlapped step took its batch: episodes generated now will be one version old at once."""
        with self._lock:
            self._overlapped_steps += 1

    def step_synced(self) -> None:
        with self._lock:
            self._overlapped_steps = max(0, self._overlapped_steps - 1)

    def _check_admission(self, req: OpenEpisode) -> None:
        if self.max_staleness is None:
            return
        size = req.group_size or self.default_group_size
        started: dict[tuple[str, str], int] = {}
        sizes: dict[tuple[str, str], int] = {}
        for e in self._open.values():
            if e.kind == "train":
                started[e.group_key] = started.get(e.group_key, 0) + 1
                sizes[e.group_key] = e.group_size
        abandoned_before = self.clock() - self.lease_s
        for key, group in self._filling.items():
            # A partial group nobody touched for a lease is abandoned: it stops holding a slot.
            if key in started or max(e.ended_at or 0.0 for e in group) > abandoned_before:
                started[key] = started.get(key, 0) + len(group)
                sizes[key] = group[0].group_size
        if started.get((req.sandbox, req.task_id), 0) % size:
            return  # completes a started group
        groups = len(self._ready) + sum(math.ceil(n / sizes[k]) for k, n in started.items())
        budget = self.batch_groups * (self.max_staleness + 1 - self._overlapped_steps)
        if groups >= budget:
            raise EpisodeError(503, f"{groups} groups already fill the next {self.max_staleness + 1} steps; "
                               "retry after the weight sync", "admission", retry_after=ADMISSION_RETRY_S)

    def note_refused(self) -> None:
        """Count an open that admission control finally refused (after any wait for room)."""
        with self._lock:
            self.counters["refused"] += 1

    def by_key(self, key: str) -> Episode:
        with self._lock:
            episode_id = self._keys.get(key)
            if episode_id is None:
                raise EpisodeError(401, "unknown or missing episode key", "invalid_api_key")
            return self.get_open(episode_id)

    def by_path(self, secret: str) -> Episode:
        """The open episode whose path-form secret this is (401 for anything else, a bare id included)."""
        with self._lock:
            episode_id = self._paths.get(secret)
            if episode_id is None:
                raise EpisodeError(401, "unknown episode path: use the base_url returned on open", "invalid_api_key")
            return self.get_open(episode_id)

    def path_of(self, episode_id: str) -> str:
        with self._lock:
            return self._path_of[episode_id]

    def authorize(self, episode_id: str, key: str) -> None:
        """Check that `key` is this episode's key: 404 for an id never seen (or long forgotten), 401 otherwise."""
        with self._lock:
            expected = self._key_of.get(episode_id)
            if expected is None:
                raise EpisodeError(404, f"unknown episode {episode_id}", "episode_not_found")
            if not same_secret(key, expected):
                raise EpisodeError(401, f"episode {episode_id} needs its key (Authorization: Bearer sk-swarm-...)",
                                   "invalid_api_key")

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
        ep.ended_at = self.clock()
        if ep.kind == "train" and ep.calls:
            self.counters["generated"] += 1
            if ep.state != "finished":
                self.counters["wasted"] += 1
        # The key stays mapped while the tombstone lives, so late calls learn the episode ended (409).
        self._ended[ep.id] = ep.model_copy(update={"calls": []})
        while len(self._ended) > TOMBSTONES:
            old_id, _ = self._ended.popitem(last=False)
            self._keys.pop(self._key_of.pop(old_id, ""), None)
            self._paths.pop(self._path_of.pop(old_id, ""), None)

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
            self.counters["stale"] += dropped
            self.counters["wasted"] += dropped
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
    """Versions between the oldest weights that generated this episode's tokens and the current ones.

    A call's version is the one that prefilled it (the oldest behind any of its tokens), so an
    episode opened before a weight sync whose calls all ran after it is not stale."""
    oldest: dict[str, int] = {}
    for call in ep.calls:
        oldest[call.model] = min(oldest.get(call.model, call.version), call.version)
    return max((current.get(m, v) - v for m, v in oldest.items()), default=0)
