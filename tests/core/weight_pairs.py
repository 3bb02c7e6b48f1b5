"""Test helpers for weight transfers: a two-member gloo group with both ends in this process, and a
count of the whole weights an FSDP2 rank materialises (`DTensor.full_tensor`)."""

from __future__ import annotations

import threading
import weakref

from torch.distributed.tensor import DTensor

from core.engine.groups import free_port, process_group


def group_pair(timeout_s: float) -> list:
    """[sender's end, receiver's end] of one 2-member gloo group, each joined from its own thread."""
    port, groups = free_port(), [None, None]
    joiners = [threading.Thread(target=lambda r=r: groups.__setitem__(r, process_group("gloo", port, r, 2, timeout_s)))
               for r in (0, 1)]
    for t in joiners:
        t.start()
    for t in joiners:
        t.join(timeout_s)
    return groups


def count_full_tensors(monkeypatch) -> dict[str, int]:
    """Count this process's `full_tensor` results of at least one dimension (`calls`), and the most
    elements of them alive at once (`peak`; `now` while it runs)."""
    live = {"now": 0, "peak": 0, "calls": 0}
    gather = DTensor.full_tensor

    def counted(self, *args, **kwargs):
        whole = gather(self, *args, **kwargs)
        if whole.dim() > 0:
            live["calls"] += 1
            live["now"] += whole.numel()
            live["peak"] = max(live["peak"], live["now"])
            weakref.finalize(whole, lambda n=whole.numel(): live.__setitem__("now", live["now"] - n))
        return whole

    monkeypatch.setattr(DTensor, "full_tensor", counted)
    return live
