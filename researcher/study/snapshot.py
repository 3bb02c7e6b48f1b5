"""A study's state read straight from its LangGraph checkpoint, for `researcher study status`.

`runner.read_state` compiles the study graph to ask LangGraph for the state; that loads LangGraph,
the nodes and MLflow (seconds of imports) to read one row. This module reads the latest checkpoint
of the study's thread from `state.db` itself (read-only) and decodes it with LangGraph's own
serializer, which is all `status` needs: the state values, the nodes that run next, and the
proposals the review interrupt waits on.

It understands the checkpoints the study graph leaves between steps: every channel a `LastValue`,
nodes triggered by their `branch:to:<node>` channel (or `__start__`), and pending writes that are
only the review's interrupt. Anything else (a step that crashed after some writes were saved, a
resume in flight, a format it does not know) returns None, and the caller asks LangGraph through
`runner.read_state`, which is always right. It never writes, and it never builds the graph.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from researcher.study.store import StudyPaths

State = tuple[dict[str, Any], tuple[str, ...], list[str]]  # (values, next nodes, proposals the interrupt waits on)

START = "__start__"  # LangGraph's start node, triggered by the channel of the same name
TRIGGER = "branch:to:"  # the channel an edge into node X writes (LangGraph >= 0.3)
INTERRUPT = "__interrupt__"  # the pending write an `interrupt()` leaves


def read_state(paths: StudyPaths, name: str) -> State | None:
    """The study's state as `runner.read_state` gives it, or None when only LangGraph can tell."""
    if not paths.db.exists():
        return {}, (), []
    try:
        con = sqlite3.connect(f"file:{paths.db}?mode=ro", uri=True)
    except sqlite3.Error:
        return None
    try:
        row = con.execute("SELECT checkpoint_id, type, checkpoint FROM checkpoints WHERE thread_id = ? AND "
                          "checkpoint_ns = '' ORDER BY checkpoint_id DESC LIMIT 1", (name,)).fetchone()
        if row is None:
            return {}, (), []
        writes = con.execute("SELECT channel, type, value FROM writes WHERE thread_id = ? AND checkpoint_ns = '' "
                             "AND checkpoint_id = ? ORDER BY task_id, idx", (name, row[0])).fetchall()
    except sqlite3.Error:  # not a checkpoint database this module knows
        return None
    finally:
        con.close()
    if any(channel != INTERRUPT for channel, _, _ in writes):
        return None
    # LangGraph's serializer, as the saver that wrote the rows uses it (loaded here: status only).
    from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

    serde = JsonPlusSerializer()
    checkpoint = serde.loads_typed((row[1], row[2]))
    values = checkpoint.get("channel_values", {})
    versions, seen = checkpoint.get("channel_versions", {}), checkpoint.get("versions_seen", {})
    triggers = {k: k.removeprefix(TRIGGER) for k in values if k.startswith(TRIGGER)}
    if START in values:
        triggers[START] = START
    nxt = tuple(node for channel, node in triggers.items()
                if channel in versions and versions[channel] > seen.get(node, {}).get(channel, ""))
    waiting = []
    for _, kind, blob in writes:
        for interrupt in serde.loads_typed((kind, blob)):
            waiting += (getattr(interrupt, "value", None) or {}).get("pending", [])
    if waiting and not nxt:  # an interrupt belongs to a task that has yet to finish
        return None
    state = {k: v for k, v in values.items() if not k.startswith((TRIGGER, "__"))}
    return state, nxt, waiting
