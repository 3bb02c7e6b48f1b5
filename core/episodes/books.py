"""The registry's books: the identities its episode counters must satisfy at any snapshot.

Every opened episode ends exactly one way or is still open, and every finished one is trained,
dropped or still buffered; `unbalanced` names the identities a snapshot of `Registry.status()`
breaks, for the tests and the chaos bench, which check them after killing clients and servers.
It is deliberately not the registry: it reads counters and keeps none.
"""

from __future__ import annotations


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
