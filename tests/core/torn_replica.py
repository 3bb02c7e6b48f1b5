"""A replica process whose weight sync fails part-way: the child of the torn-sync test (test_replica_restart.py).

`main` is what the test's `ProcessEngine` spawns instead of `replica_main`: the same child, except that
copying a sync's weights into the model fails once every bucket has arrived (the group stays in step,
the module holds part of the new weights), as a device running out of memory mid-copy would.
"""

from __future__ import annotations

from typing import Any

from core.engine import weight_sync
from core.engine.replica_child import ReplicaSpec, replica_main


def main(conn: Any, spec: ReplicaSpec) -> None:
    receive = weight_sync.receive_weights

    def receive_then_fail(*args: Any, **kwargs: Any) -> None:
        receive(*args, **kwargs)
        raise RuntimeError("the copy into the model failed part-way")

    weight_sync.receive_weights = receive_then_fail
    replica_main(conn, spec)
