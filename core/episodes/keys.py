"""Each episode's credentials, one record per episode: its bearer key, its path secret, its lease length and
the index its next call gets; and the two lookups a request needs (by key, by path secret).

The registry owns one `Keys` and calls it only under its lock; this module keeps no lock and knows no
episode state (open, ended): a record lives from the open until the episode's tombstone is dropped, so a
late call with an ended episode's key still finds the episode and learns it ended (409). It does not
parse headers or compare secrets for routes (`core.episodes.auth` does).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from core.episodes.auth import path_secret

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

    def by_key(self, key: str) -> str | None:
        """The episode id of a bearer key (None: no episode has it)."""
        return self._by_key.get(key)

    def by_path(self, secret: str) -> str | None:
        """The episode id of a path secret (None: no episode has it)."""
        return self._by_path.get(secret)

    def forget(self, episode_id: str) -> None:
        """Drop an episode's record once its tombstone goes: its key and path then mean nothing (401)."""
        held = self._held.pop(episode_id, None)
        if held is not None:
            self._by_key.pop(held.key, None)
            self._by_path.pop(held.path, None)
