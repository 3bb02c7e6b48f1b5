"""The episode registry: keys, leases, states, groups, batches, mix quotas and back-pressure.

Lifecycle: open -> (calls...) -> finished | aborted | expired. Finished train episodes join their
group, keyed by (sandbox, task_id, client code version: `Episode.train_group`, so an A/B never mixes
versions in a group); a group with `group_size` finished episodes is ready, and the
trainer takes ready groups in arrival order. Eval and debug episodes never train.

Mix quotas hold in what trains, not only in what opens: each batch slot goes to the sandbox
furthest below its share of the groups trained so far (`core.episodes.mix.next_group`), and waits
for one under way; a sandbox silent for a lease is skipped, so a dead client costs at most a lease.
Which groups make a batch is `core.episodes.batching`'s job (a pure function the registry calls
under its lock).
Which opens are admitted is `core.episodes.admission`'s job. Staleness counts by the oldest weight
version among an episode's calls. One lock guards all state (HTTP handlers and the trainer thread
both touch it). The registry does not render, generate or train; it only keeps the books.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable

from core.episodes.auth import path_secret, same_secret
from core.engine.routing import EPISODE
from core.episodes.admission import Admission
from core.episodes.errors import Refusal
from core.episodes.batching import Batch, Sieve, assemble
from core.episodes.pairing import Pairs
from core.records import Call, Episode
from core.episodes.wire import OpenEpisode

KEY_PREFIX = "sk-swarm-"
TOMBSTONES = 20_000  # ended episodes remembered so late calls get 409 and repeated finishes stay idempotent
# Finished eval episodes kept for the trainer's metrics: a server without a trainer never takes them,
# so the oldest go first rather than growing for as long as the server lives.
EVAL_KEPT = 10_000


class Registry(Admission):
    def __init__(
        self,
        lease_s: float,
        default_group_size: int,
        batch_groups: int,
        max_open: int = 512,
        mix: dict[str, float] | None = None,
        clock: Callable[[], float] = time.time,
        max_abs_reward: float | None = None,  # `trainer.max_abs_reward`; None: any finite reward
    ):
        self.lease_s = lease_s
        self.max_abs_reward = max_abs_reward
        self.default_group_size = default_group_size
        self.batch_groups = batch_groups
        self.max_open = max_open
        self.mix = dict(mix or {})
        self.clock = clock
        self._lock = threading.RLock()
        self._open: dict[str, Episode] = {}
        self._lease_of: dict[str, float] = {}  # open episode id -> the lease_s it was opened with
        self._keys: dict[str, str] = {}  # api key -> episode id
        self._key_of: dict[str, str] = {}  # episode id -> api key
        self._path_key = secrets.token_bytes(32)  # per server: path secrets cannot be precomputed
        self._paths: dict[str, str] = {}  # path secret -> episode id (the path form's credential)
        self._path_of: dict[str, str] = {}  # episode id -> path secret
        self._ended: OrderedDict[str, Episode] = OrderedDict()  # tombstones, calls dropped
        self._filling: dict[tuple[str, str, str], list[Episode]] = {}  # Episode.train_group -> its finished episodes
        self.pairs = Pairs()  # an A/B's cells (`core.episodes.pairing`): every train episode, from its open to its end
        self._ready: deque[list[Episode]] = deque()
        self._finished_eval: deque[Episode] = deque(maxlen=EVAL_KEPT)
        self._trained_groups: dict[str, int] = {}  # sandbox -> groups trained so far: the mix quotas' ledger
        self.sieve: Sieve | None = None  # dynamic sampling (`trainer.dynamic_sampling: filter`), set by the run
        # sandbox -> its last train open attempt (who shares room, who a batch waits for). A mix sandbox asks from
        # the start for one lease: batches taken before its clients register would give its share away for good.
        self._seen: dict[str, float] = dict.fromkeys(self.mix, clock())
        self.paused = False
        self.max_staleness: int | None = None  # None: no admission control (`admit_within` turns it on)
        self._overlapped_steps = 0  # steps that took their batch while generation goes on, not yet synced
        # generated: train episodes that ended having made a call; wasted: those never trained
        # (stale at batch time, or aborted/expired after generating).
        self.counters = {"opened": 0, "finished": 0, "aborted": 0, "expired": 0, "calls": 0, "trained": 0,
                         "stale": 0, "generated": 0, "wasted": 0, "refused": 0,
                         # finished eval/debug episodes (never trained), and episodes a checkpoint put back
                         # in the buffer: both terms of the books (`unbalanced`)
                         "finished_not_train": 0, "restored": 0}
        self._finished_by: dict[str, int] = {}  # client id -> episodes it finished (a restarted client's record)
        self._opened_of: dict[tuple[str, str], int] = {}  # (sandbox, task_id) -> episodes opened: `Episode.ordinal`
        # Judged sandbox -> its judge's failure value: their train and eval episodes that abort or expire are
        # finished with it instead (counted, never dropped); set by the server from its judges.
        self.failure_scores: dict[str, float] = {}

    # -- client side ---------------------------------------------------------------------------
    def open(self, req: OpenEpisode, versions: dict[str, int]) -> tuple[Episode, str]:
        with self._lock:
            self._expire_due()
            if req.task_id is None:  # the route deals a judged sandbox's task before it opens
                raise Refusal(400, f"sandbox {req.sandbox!r} has no judge on this server, so the client "
                                   "chooses its tasks: give task_id", "missing_task_id")
            if req.kind == "train":
                self._seen[req.sandbox] = self.clock()  # a refused attempt counts: it wants room
            if self.paused:
                raise Refusal(503, "the server is paused", "paused", retry_after=1.0)
            if len(self._open) >= self.max_open:
                raise Refusal(503, "too many open episodes", "busy", retry_after=1.0)
            if req.kind == "train" and self.training_over is not None:
                raise Refusal(409, f"this server takes no more train episodes: {self.training_over}; open "
                                        "kind eval or debug episodes, or start a run with more trainer.steps",
                                   "training_over")
            if req.kind == "train":
                refusal = self._quota_refusal(req.sandbox) or self._admission_refusal(
                    req.sandbox, req.task_id, req.group_size or self.default_group_size, req.client_version)
                if refusal is not None:
                    raise refusal
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
                ordinal=self._opened_of.get((req.sandbox, req.task_id), 0),
            )
            self._opened_of[ep.group_key] = ep.ordinal + 1
            self._lease_of[ep.id] = req.lease_s or self.lease_s
            key = KEY_PREFIX + secrets.token_urlsafe(24)
            self._open[ep.id] = ep
            self._keys[key] = ep.id
            self._key_of[ep.id] = key
            secret = path_secret(self._path_key, key)
            self._paths[secret] = ep.id
            self._path_of[ep.id] = secret
            self.counters["opened"] += 1
            self.pairs.opened(ep)  # its cell is fixed now: the weights it opened on
            return ep, key

    def by_key(self, key: str) -> Episode:
        """The open episode of this key; it becomes the request's episode (`EPISODE`: replicas route on it)."""
        with self._lock:
            episode_id = self._keys.get(key)
            if episode_id is None:
                raise Refusal(401, "unknown or missing episode key", "invalid_api_key")
            return _current(self.get_open(episode_id))

    def is_open(self, episode_id: str) -> bool:
        with self._lock:
            return episode_id in self._open

    def by_path(self, secret: str) -> Episode:
        """The open episode whose path-form secret this is (401 for anything else, a bare id included)."""
        with self._lock:
            episode_id = self._paths.get(secret)
            if episode_id is None:
                raise Refusal(401, "unknown episode path: use the base_url returned on open", "invalid_api_key")
            return _current(self.get_open(episode_id))

    def path_of(self, episode_id: str) -> str:
        with self._lock:
            return self._path_of[episode_id]

    def authorize(self, episode_id: str, key: str) -> None:
        """Check that `key` is this episode's key: 404 for an id never seen (or long forgotten), 401 otherwise."""
        with self._lock:
            expected = self._key_of.get(episode_id)
            if expected is None:
                raise Refusal(404, f"unknown episode {episode_id}", "episode_not_found")
            if not same_secret(key, expected):
                raise Refusal(401, f"episode {episode_id} needs its key (Authorization: Bearer sk-swarm-...)",
                                   "invalid_api_key")

    def get_open(self, episode_id: str) -> Episode:
        with self._lock:
            self._expire_due()
            ep = self._open.get(episode_id)
            if ep is not None:
                return ep
            if episode_id in self._ended:
                state = self._ended[episode_id].state
                raise Refusal(409, f"episode {episode_id} is {state}", f"episode_{state}")
            raise Refusal(404, f"unknown episode {episode_id}", "episode_not_found")

    def record(self, episode: Episode, call: Call) -> None:
        with self._lock:
            if episode.state != "open":
                raise Refusal(409, f"episode {episode.id} is {episode.state}", f"episode_{episode.state}")
            episode.calls.append(call)
            self.counters["calls"] += 1

    def heartbeat(self, episode_id: str, lease_s: float | None = None) -> Episode:
        """Extend the lease by `lease_s`, by default the episode's own (the one it was opened with)."""
        with self._lock:
            ep = self.get_open(episode_id)
            ep.lease_expires_at = self.clock() + (lease_s or self._lease_of.get(ep.id, self.lease_s))
            return ep

    def finish(self, episode_id: str, reward: dict[str, float], body: dict, score: float | None = None,
               metrics: dict[str, float] | None = None) -> Episode:
        """`score`: a judged episode's judge score (its reward already), kept on the record; `metrics`: the
        server's own (a judged episode's `agent_reward`), over the client's."""
        with self._lock:
            ended = self._ended.get(episode_id)
            if ended is not None and ended.state == "finished":
                if ended.finish_body == body:
                    return ended
                if ended.finish_body is None:
                    raise Refusal(409, f"episode {episode_id} ended before its finish ({ended.abort_reason}) and "
                                       "scored its judge's failure value", "episode_failed")
                raise Refusal(409, f"episode {episode_id} was finished with a different body", "conflict")
            ep = self.get_open(episode_id)
            too_big = {m: r for m, r in reward.items() if self.max_abs_reward is not None and abs(r) > self.max_abs_reward}
            if too_big:  # refused, the episode still open: a 1e308 reward would overflow its group's mean
                raise Refusal(400, f"reward {too_big} is beyond trainer.max_abs_reward ({self.max_abs_reward:g}); "
                                   "scale rewards to O(1)", "invalid_reward")
            ep.state, ep.reward, ep.finish_body, ep.score = "finished", reward, body, score
            ep.metrics = {**(body.get("metrics") or {}), **(metrics or {})}
            self._finished(ep)
            return ep

    def _finished(self, ep: Episode) -> None:
        """Close a finished episode and put it where it goes: its group (train), the eval list, or nowhere."""
        self._close(ep)
        self.counters["finished"] += 1
        if ep.client_id:
            self._finished_by[ep.client_id] = self._finished_by.get(ep.client_id, 0) + 1
        if ep.kind != "train":
            self.counters["finished_not_train"] += 1
        if ep.kind == "train":
            group = self._filling.setdefault(ep.train_group, [])
            group.append(ep)
            if len(group) >= ep.group_size:
                self._ready.append(self._filling.pop(ep.train_group))
        elif ep.kind == "eval":
            self._finished_eval.append(ep)

    def _judged_failure(self, ep: Episode, reason: str) -> bool:
        """A judged sandbox's train or eval episode that ends without a finish scores its judge's failure
        value and is finished with it (debug episodes count nowhere: they abort as usual). -> whether it did."""
        failure = self.failure_scores.get(ep.sandbox)
        if failure is None or ep.kind == "debug":
            return False
        ep.state, ep.score, ep.abort_reason = "finished", failure, reason
        ep.reward = {m: failure for m in dict.fromkeys(c.model for c in ep.calls)}
        ep.metrics = {"judge/failed": 1.0}
        self._finished(ep)
        return True

    def abort(self, episode_id: str, reason: str) -> Episode:
        with self._lock:
            ended = self._ended.get(episode_id)
            if ended is not None and (ended.state == "aborted" or ended.abort_reason is not None):
                return ended  # an abort again, also of a judged episode an abort already failed
            ep = self.get_open(episode_id)
            if self._judged_failure(ep, reason or "aborted by its client"):
                return ep
            ep.state, ep.abort_reason = "aborted", reason
            self._close(ep)
            self.counters["aborted"] += 1
            return ep

    def _close(self, ep: Episode) -> None:
        del self._open[ep.id]
        self.pairs.ended(ep)  # counted in the cell it opened in, trained or not (a judged failure included)
        self._lease_of.pop(ep.id, None)
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
            if self._judged_failure(ep, "expired: its lease ran out"):
                continue
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
        """`batch_groups` ready groups, minus episodes generated more than `max_staleness` versions ago.

        Groups are taken in arrival order, or by mix quota (`core.episodes.mix.next_group`); None while there are too
        few ready groups, or while the batch waits for the group of a sandbox owed its share."""
        with self._lock:
            if len(self._ready) < self.batch_groups:
                return None
            # Able to deliver a group soon: one under way, or a client that asked to open within a lease
            # (it may be between two episodes) and would be admitted (waiting on a sandbox the full
            # room keeps out would never end). A dead client stops asking.
            started = self._started_groups()
            coming = {key[0] for key in started}
            coming |= {s for s in self._active_sandboxes() if self._no_room(s, started) is None}
            plan = assemble(list(self._ready), self._trained_groups, self.batch_groups, self.mix, coming,
                            current_versions, max_staleness, self.sieve)
            if plan is None:
                return None  # the plan is dropped, nothing taken: it is made again on the next call
            groups, consumed, dropped = plan.groups, plan.consumed, plan.dropped
            if self.sieve is not None:
                self.sieve.record(plan)
            gone = {id(g) for g in consumed}
            self._ready = deque(g for g in self._ready if id(g) not in gone)
            if groups:
                self._trained_groups = plan.taken
            # A group dynamic sampling kept out was taken by a batch too: it leaves the buffer, never to train.
            self.counters["trained"] += sum(len(g) for g in groups) + sum(len(g) for g in plan.filtered)
            self.counters["stale"] += dropped
            self.counters["wasted"] += dropped
            if not groups:
                return None
            batch = Batch(groups, dropped)
            return self.sieve.take(batch, plan.capped) if self.sieve is not None else batch

    def trained_groups(self) -> dict[str, int]:
        """Groups trained so far per sandbox (the mix quotas' ledger)."""
        with self._lock:
            return dict(self._trained_groups)

    def take_eval(self) -> list[Episode]:
        with self._lock:
            done = list(self._finished_eval)
            self._finished_eval.clear()
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
                    self._filling[group[0].train_group] = group
                self.counters["restored"] += len(group)

    def open_by_client(self) -> dict[str, list[str]]:
        """Ids of the open episodes per client id (the chaos bench kills clients mid-episode)."""
        with self._lock:
            self._expire_due()
            out: dict[str, list[str]] = {}
            for ep in self._open.values():
                out.setdefault(ep.client_id or "", []).append(ep.id)
            return out

    def finished_by(self) -> dict[str, int]:
        """Finished episodes per client id: whether a client that died had done any work (`core.run.supervisor`)."""
        with self._lock:
            return dict(self._finished_by)

    def status(self) -> dict:
        with self._lock:
            self._expire_due()
            return {
                "paused": self.paused,
                "open_episodes": len(self._open),
                "ready_groups": len(self._ready),
                "filling_groups": len(self._filling),
                "buffered_episodes": sum(len(g) for g in self._ready) + sum(len(g) for g in self._filling.values()),
                "oldest_open_s": self.clock() - min(e.opened_at for e in self._open.values()) if self._open else None,
                "clients": sorted({e.client_id for e in self._open.values() if e.client_id}),
                "counters": dict(self.counters),
            }


def _current(ep: Episode) -> Episode:
    """Name `ep` as the current request's episode (`core.engine.routing.EPISODE`) and return it."""
    EPISODE.set(ep.id)
    return ep
