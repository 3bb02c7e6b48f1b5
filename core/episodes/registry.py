"""The episode registry: episodes from open to end, their groups and the batches the trainer takes.

Lifecycle: open -> (calls...) -> finished | aborted | expired, each change through `_end`, checked
against `TRANSITIONS`. Finished episodes wait for the trainer in the `GroupBuffer` it owns
(`core.episodes.buffer`: train groups filling and ready, eval episodes; debug episodes go nowhere),
which also takes each batch; which opens are admitted is the `Admission` it owns
(`core.episodes.admission`); each episode's key, path secret, lease and next call index are one
record, which `core.episodes.keys` looks up and checks; the counters are `core.episodes.books.Books`. One lock guards all of
it, `paused` included (HTTP handlers and the trainer thread both touch it). The registry does not
render, generate, train or decide who may open (`core.episodes.credentials`); it keeps the books.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from core.engine.routing import EPISODE
from core.episodes.admission import Admission, Pool
from core.episodes.errors import Refusal
from core.episodes.keys import Keys
from core.episodes.batching import Batch, Sieve
from core.episodes.books import Books
from core.episodes.buffer import GroupBuffer
from core.episodes.pairing import Pairs, TaskPairing
from core.records import Call, Episode
from core.episodes.wire import OpenEpisode

TOMBSTONES = 20_000  # ended episodes remembered so late calls get 409 and repeated finishes stay idempotent
# The one place an episode's state changes: from each state, the states it may go to. An ended episode never
# changes again (a late finish or abort is answered from its tombstone).
TRANSITIONS: dict[str, frozenset[str]] = {"open": frozenset({"finished", "aborted", "expired"})}


class Registry:
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
        self._keys = Keys()  # each episode's key, path secret, lease length and next call index, open or tombstoned
        self._ended: OrderedDict[str, Episode] = OrderedDict()  # tombstones, calls dropped
        # An A/B's two halves (`core.episodes.pairing`), kept together: the tasks its new version owes (the opener
        # fills and pays them), and its cells: every train episode, from its open to its end.
        self.pairing = TaskPairing()
        self.pairs = Pairs()
        self._groups = GroupBuffer(batch_groups, self.mix)  # finished episodes until the trainer takes them
        self.sieve: Sieve | None = None  # dynamic sampling (`trainer.dynamic_sampling: filter`), set by the run
        self.admission = Admission(batch_groups, default_group_size, self.mix, lease_s, clock)
        self._paused = False  # changed only under the lock (`pause`, `resume`)
        self.books = Books()
        self._finished_by: dict[str, int] = {}  # client id -> episodes it finished (a restarted client's record)
        self._opened_of: dict[tuple[str, str], int] = {}  # (sandbox, task_id) -> episodes opened: `Episode.ordinal`
        # Judged sandbox -> its judge's failure value: their train and eval episodes that abort or expire are
        # finished with it instead (counted, never dropped); set by the server from its judges.
        self.failure_scores: dict[str, float] = {}

    # -- state an admin or the trainer changes -------------------------------------------------
    @property
    def paused(self) -> bool:
        return self._paused

    def pause(self) -> None:
        """Refuse new episodes (503 `paused`) until `resume`; episodes in flight go on."""
        with self._lock:
            self._paused = True

    def resume(self) -> None:
        with self._lock:
            self._paused = False

    @property
    def counters(self) -> dict[str, int]:
        """A snapshot of the books (`Books`) as a dict: `/status`, MLflow and the books' identities read it."""
        with self._lock:
            return self.books.as_dict()

    def end_training(self, reason: str) -> None:
        """No trainer will consume another batch: new train episodes are refused for good (409), not
        left to wait on back-pressure that can never ease; eval and debug episodes still open."""
        with self._lock:
            self.admission.training_over = reason

    def admit_within(self, max_staleness: int) -> None:
        """Turn admission control on, for a trainer that drops episodes older than `max_staleness`."""
        with self._lock:
            self.admission.max_staleness = max_staleness

    def step_started(self) -> None:
        """An overlapped step took its batch: episodes generated now will be one version old at once."""
        with self._lock:
            self.admission.overlapped_steps += 1

    def step_synced(self) -> None:
        with self._lock:
            self.admission.overlapped_steps = max(0, self.admission.overlapped_steps - 1)

    def note_refused(self) -> None:
        """Count an open that admission control finally refused (after any wait for room)."""
        with self._lock:
            self.books.refused += 1

    def _pool(self) -> Pool:
        return Pool(self._open.values(), self._groups.ready, self._groups.filling)

    # -- client side ---------------------------------------------------------------------------
    def open(self, req: OpenEpisode, versions: dict[str, int]) -> tuple[Episode, str]:
        with self._lock:
            self._expire_due()
            if req.task_id is None:  # the route deals a judged sandbox's task before it opens
                raise Refusal(400, f"sandbox {req.sandbox!r} has no judge on this server, so the client "
                                   "chooses its tasks: give task_id", "missing_task_id")
            if req.kind == "train":
                self.admission.asked(req.sandbox)  # a refused attempt counts: it wants room
            if self._paused:
                raise Refusal(503, "the server is paused", "paused", retry_after=1.0)
            if len(self._open) >= self.max_open:
                raise Refusal(503, "too many open episodes", "busy", retry_after=1.0)
            if req.kind == "train":
                refusal = self.admission.refusal(self._pool(), req.sandbox, req.task_id,
                                                 req.group_size or self.default_group_size, req.client_version)
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
            key = self._keys.issue(ep.id, req.lease_s or self.lease_s).key
            self._open[ep.id] = ep
            self.books.opened += 1
            self.pairs.opened(ep)  # its cell is fixed now: the weights it opened on
            return ep, key

    def by_key(self, key: str) -> Episode:
        """The open episode of this key; it becomes the request's episode (`EPISODE`: replicas route on it)."""
        with self._lock:
            return _current(self.get_open(self._keys.by_key(key)))

    def is_open(self, episode_id: str) -> bool:
        with self._lock:
            return episode_id in self._open

    def by_path(self, secret: str) -> Episode:
        """The open episode whose path-form secret this is (401 for anything else, a bare id included)."""
        with self._lock:
            return _current(self.get_open(self._keys.by_path(secret)))

    def path_of(self, episode_id: str) -> str:
        with self._lock:
            return self._keys.of(episode_id).path

    def authorize(self, episode_id: str, key: str) -> None:
        """Check that `key` is this episode's key: 404 for an id never seen (or long forgotten), 401 otherwise."""
        with self._lock:
            self._keys.authorize(episode_id, key)

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
            self.books.calls += 1

    def reserve_calls(self, episode: Episode, n: int) -> int:
        """Reserve the indices of `n` calls of `episode` (a request's choices) before they are sampled; -> the
        first. Two concurrent calls of one episode get different indices, so different derived seeds
        (`engine.repeatable_sampling`), whichever is recorded first."""
        with self._lock:
            return self._keys.reserve(episode.id, n)

    def heartbeat(self, episode_id: str, lease_s: float | None = None) -> Episode:
        """Extend the lease by `lease_s`, by default the episode's own (the one it was opened with)."""
        with self._lock:
            ep = self.get_open(episode_id)
            ep.lease_expires_at = self.clock() + (lease_s or self._keys.of(ep.id).lease_s)
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
            self._end(ep, "finished")
            ep.reward, ep.finish_body, ep.score = reward, body, score
            ep.metrics = {**(body.get("metrics") or {}), **(metrics or {})}
            self._finished(ep)
            return ep

    def _finished(self, ep: Episode) -> None:
        """Close a finished episode and put it where it goes: its group (train), the eval list, or nowhere."""
        self._close(ep)
        self.books.finished += 1
        if ep.client_id:
            self._finished_by[ep.client_id] = self._finished_by.get(ep.client_id, 0) + 1
        if ep.kind != "train":
            self.books.finished_not_train += 1
        self._groups.add(ep)

    def _judged_failure(self, ep: Episode, reason: str) -> bool:
        """A judged sandbox's train or eval episode that ends without a finish scores its judge's failure
        value and is finished with it (debug episodes count nowhere: they abort as usual). -> whether it did."""
        failure = self.failure_scores.get(ep.sandbox)
        if failure is None or ep.kind == "debug":
            return False
        self._end(ep, "finished")
        ep.score, ep.abort_reason = failure, reason
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
            self._end(ep, "aborted")
            ep.abort_reason = reason
            self._close(ep)
            self.books.aborted += 1
            return ep

    def _end(self, ep: Episode, state: str) -> None:
        """Move `ep` to `state`: the one place an episode's state changes, checked against `TRANSITIONS`."""
        if state not in TRANSITIONS.get(ep.state, ()):
            raise Refusal(409, f"episode {ep.id} is {ep.state}", f"episode_{ep.state}")
        ep.state = state

    def _close(self, ep: Episode) -> None:
        del self._open[ep.id]
        self.pairs.ended(ep)  # counted in the cell it opened in, trained or not (a judged failure included)
        ep.ended_at = self.clock()
        if ep.kind == "train" and ep.calls:
            self.books.generated += 1
            if ep.state != "finished":
                self.books.wasted += 1
        # The key stays mapped while the tombstone lives, so late calls learn the episode ended (409).
        self._ended[ep.id] = ep.model_copy(update={"calls": []})
        while len(self._ended) > TOMBSTONES:
            old_id, _ = self._ended.popitem(last=False)
            self._keys.forget(old_id)

    def _expire_due(self) -> None:
        now = self.clock()
        for ep in [e for e in self._open.values() if e.lease_expires_at < now]:
            if self._judged_failure(ep, "expired: its lease ran out"):
                continue
            self._end(ep, "expired")
            self._close(ep)
            self.books.expired += 1

    def expire_due(self) -> None:
        with self._lock:
            self._expire_due()

    # -- trainer side --------------------------------------------------------------------------
    def ready_groups(self) -> int:
        with self._lock:
            return len(self._groups.ready)

    def take_batch(self, current_versions: dict[str, int], max_staleness: int) -> Batch | None:
        """`batch_groups` ready groups, minus episodes generated more than `max_staleness` versions ago.

        Groups are taken in arrival order, or by mix quota (`core.episodes.mix.next_group`); None while there are too
        few ready groups, or while the batch waits for the group of a sandbox owed its share."""
        with self._lock:
            if len(self._groups.ready) < self.batch_groups:
                return None
            coming = self.admission.coming(self._pool())  # sandboxes able to deliver a group soon
            batch = self._groups.take(coming, current_versions, max_staleness, self.sieve, self.books)
            if self.sieve is not None:  # the ties it just saw move the room for the next refills
                self.admission.extra_groups = self.sieve.extra_groups(self.batch_groups)
            return batch

    def trained_groups(self) -> dict[str, int]:
        """Groups trained so far per sandbox (the mix quotas' ledger)."""
        with self._lock:
            return dict(self._groups.trained)

    def take_eval(self) -> list[Episode]:
        with self._lock:
            return self._groups.take_eval()

    def buffered(self) -> list[list[Episode]]:
        """Finished but untrained episodes, by group: what a checkpoint must keep."""
        with self._lock:
            return self._groups.buffered()

    def restore(self, groups: list[list[Episode]]) -> None:
        with self._lock:
            self.books.restored += self._groups.restore(groups)

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
                "paused": self._paused,
                "open_episodes": len(self._open),
                **self._groups.status(),
                "oldest_open_s": self.clock() - min(e.opened_at for e in self._open.values()) if self._open else None,
                "clients": sorted({e.client_id for e in self._open.values() if e.client_id}),
                "counters": self.books.as_dict(),
            }


def _current(ep: Episode) -> Episode:
    """Name `ep` as the current request's episode (`core.engine.routing.EPISODE`) and return it."""
    EPISODE.set(ep.id)
    return ep
