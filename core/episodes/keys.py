"""Each episode's credentials, one record per episode: its bearer key, its path secret, its lease length and
the index its next call gets; the two lookups a request needs (by key, by path secret), the check that a
key is an episode's own, and the reservation of call indices, each refusing what no record holds.

The registry owns one `Keys` and calls it only under its lock; this module keeps no lock and knows no
episode state (open, ended): a record lives from the open until the episode's tombstone is dropped, so a
late call with an ended episode's key still finds the episode and learns it ended (409). It does not
parse headers or say how secrets are compared (`core.episodes.auth` does).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from core.episodes.auth import path_secret, same_secret
from core.episodes.errors import Refusal

KEY_PREFIX = "sk-swarm-"
KEY_BYTES = 24  # random bytes of an episode key: 192 bits, far beyond guessing


@dataclass
class Held:
    """What the registry holds for one episode beside its record."""

    key: str  # the bearer key (`sk-swarm-...`) its calls, heartbeats, finish and abort need
    path: str  # its path-form secret (`core.episodes.auth.path_secret` of the key)
    lease_s: float  # the lease it was opened with: each heartbeat extends it by this much
    next_call: int = 0  # the index its next call gets (`Registry.reserve_calls`): reserved before sampling


class Keys:
    def __init__(self) -> None:
        self._path_key = secrets.token_bytes(32)  # per server: path secrets cannot be precomputed
        self._held: dict[str, Held] = {}  # episode id -> its record
        self._by_key: dict[str, str] = {}  # api key -> episode id
        self._by_path: dict[str, str] = {}  # path secret -> episode id

    def issue(self, episode_id: str, lease_s: float) -> Held:
        """A fresh key and path secret for a newly opened episode."""
        key = KEY_PREFIX + secrets.token_urlsafe(KEY_BYTES)
        held = Held(key, path_secret(self._path_key, key), lease_s)
        self._held[episode_id] = held
        self._by_key[key], self._by_path[held.path] = episode_id, episode_id
        return held

    def of(self, episode_id: str) -> Held | None:
        return self._held.get(episode_id)

    def by_key(self, key: str) -> str:
        """The episode id of a bearer key (401: no episode has it)."""
        episode_id = self._by_key.get(key)
        if episode_id is None:
            raise Refusal(401, "unknown or missing episode key", "invalid_api_key")
        return episode_id

    def by_path(self, secret: str) -> str:
        """The episode id of a path secret (401 for anything else, a bare id included)."""
        episode_id = self._by_path.get(secret)
        if episode_id is None:
            raise Refusal(401, "unknown episode path: use the base_url returned on open", "invalid_api_key")
        return episode_id

    def authorize(self, episode_id: str, key: str) -> None:
        """Check that `key` is this episode's key: 404 for an id never seen (or long forgotten), 401 otherwise."""
        held = self._held.get(episode_id)
        if held is None:
            raise Refusal(404, f"unknown episode {episode_id}", "episode_not_found")
        if not same_secret(key, held.key):
            raise Refusal(401, f"episode {episode_id} needs its key (Authorization: Bearer sk-swarm-...)",
                          "invalid_api_key")

    def reserve(self, episode_id: str, n: int) -> int:
        """Reserve the indices of `n` calls of the episode (`Registry.reserve_calls`) -> the first; 404 for an
        episode with no record (not this registry's: nothing to reserve against)."""
        held = self._held.get(episode_id)
        if held is None:
            raise Refusal(404, f"unknown episode {episode_id}", "episode_not_found")
        first, held.next_call = held.next_call, held.next_call + n
        return first

    def forget(self, episode_id: str) -> None:
        """Drop an episode's record once its tombstone goes: its key and path then mean nothing (401)."""
        held = self._held.pop(episode_id, None)
        if held is not None:
            self._by_key.pop(held.key, None)
            self._by_path.pop(held.path, None)
