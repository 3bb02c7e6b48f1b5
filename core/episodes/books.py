"""The registry's books: its episode counters (`Books`) and the identities they must satisfy at any snapshot.

Every opened episode ends exactly one way or is still open, and every finished one is trained,
dropped or still buffered; `unbalanced` names the identities a snapshot of `Registry.status()`
breaks, for the tests and the chaos bench, which check them after killing clients and servers.
It is deliberately not the registry: `Books` is plain counts that the registry bumps under its lock.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class Books:
    """The registry's counters since the server started (cumulative; `/status` `episodes`, MLflow `episodes/*`)."""

    opened: int = 0
    finished: int = 0
    aborted: int = 0
    expired: int = 0
    calls: int = 0  # calls recorded on episodes
    trained: int = 0  # finished train episodes a batch took
    stale: int = 0  # finished train episodes dropped at batch time, generated on too old weights
    generated: int = 0  # train episodes that ended having made a call
    wasted: int = 0  # of those, never trained: stale at batch time, or aborted/expired after generating
    refused: int = 0  # opens admission control finally refused (after any wait for room)
    finished_not_train: int = 0  # finished eval and debug episodes: they never train
    restored: int = 0  # finished episodes a checkpoint put back in the buffer

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def unbalanced(counters: dict[str, int], open_episodes: int, buffered: int) -> list[str]:
    """The identities the registry's books must satisfy at any snapshot, as the ones that fail (empty: balanced).

    Every opened episode is finished, aborted, expired or still open; every finished (or restored) one
    is trained, dropped as stale, still buffered, or of a kind that never trains (eval, debug)."""
    c = counters
    books = {
        "opened = finished + aborted + expired + open": (
            c["opened"], c["finished"] + c["aborted"] + c["expired"] + open_episodes),
        "finished + restored = trained + stale + buffered + not-train": (
            c["finished"] + c["restored"], c["trained"] + c["stale"] + buffered + c["finished_not_train"]),
    }
    return [f"{rule}: {left} != {right}" for rule, (left, right) in books.items() if left != right]
