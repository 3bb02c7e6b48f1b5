"""A client's own tasks of one split, by id: how an A/B's new version runs the task the server hands it.

While `swarm swap --ab` pairs two code versions (`core.episodes.pairing`), the new version's client asks
to open its own next task and the server opens the one its old version drew instead, answering with
that task's id. For a sandbox whose clients choose their tasks, the client then runs its own task of
that id, found here (ids as the runner names them: a task's "id", else its position in `tasks(split)`).
A judged sandbox's task comes with the answer and needs none of this.

It does not draw or order tasks (`core.clients.sandbox.task_order`) and never talks to the server.
"""

from __future__ import annotations

from typing import Any

from core.clients.sandbox import Agent

# Tasks indexed at most: a split that yields more (a generator without end) is cut here, so a lookup
# cannot spin forever; a task past it is reported missing, not searched for.
MAX_INDEXED = 200_000


class TaskIndex:
    def __init__(self, agent: Agent, split: str):
        self.agent, self.split = agent, split
        self._by_id: dict[str, Any] | None = None

    def get(self, task_id: str) -> Any:
        """The task of `task_id`; ValueError (the episode fails, and says why) when this code has none."""
        if self._by_id is None:
            self._by_id = {}
            for index, task in enumerate(self.agent.tasks(self.split)):
                self._by_id.setdefault(str(task.get("id", index)) if isinstance(task, dict) else str(index), task)
                if index + 1 >= MAX_INDEXED:
                    break
        if task_id not in self._by_id:
            raise ValueError(f"the server handed task {task_id!r} (an A/B pairs it with the old version's), but "
                             f"{self.agent.name}'s tasks({self.split!r}) has no task of that id")
        return self._by_id[task_id]
