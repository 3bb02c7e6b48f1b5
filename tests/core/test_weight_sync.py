"""The replicas' weight transport (core/engine/weight_sync.py) without replica processes.

Buckets cut by dtype and size, a layout that does not fit the module refused naming the
parameter, and a real gloo transfer between two groups' ranks (two threads of this process): mixed
dtypes, several buckets, a one-tensor bucket received straight into its parameter; and a transfer
to a receiver process that died failing with gloo's error instead of hanging; to one that hangs,
stopping at the sync's deadline; and the two bucket buffers a sync reuses in turn.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time

import pytest
import torch

from core.engine.groups import free_port, process_group
from core.engine.weight_sync import (
    WeightLayoutError,
    _Slots,
    apply_weights,
    buckets,
    check_layout,
    layout_of,
    receive_weights,
    send_weights,
    weights_digest,
)
from tests.core.weight_pairs import group_pair

TIMEOUT_S = 60.0  # a collective on loopback takes milliseconds; a failure must not hang the test
DEADLINE_S = 3.0  # a sync's deadline in the hang test: far below TIMEOUT_S, far above a loopback bucket


class Net(torch.nn.Module):
    def __init__(self, scale: float = 0.0):
        super().__init__()
        self.a = torch.nn.Parameter(torch.full((4, 3), scale))
        self.b = torch.nn.Parameter(torch.full((5,), scale))
        self.low = torch.nn.Parameter(torch.full((6,), scale, dtype=torch.bfloat16))
        self.big = torch.nn.Parameter(torch.full((40,), scale))


def test_buckets_hold_one_dtype_and_at_most_the_cap_and_a_larger_tensor_is_a_bucket_alone():
    layout = [("x", (2, 2), "float32"), ("y", (3,), "float32"), ("h", (4,), "bfloat16"),
              ("z", (100,), "float32"), ("w", (1,), "float32")]
    assert buckets(layout, cap=32) == [[0, 1], [2], [3], [4]]  # 16 + 12 bytes fit 32; bf16 apart; 400 alone


@pytest.mark.parametrize(("layout", "message"), [
    ([("missing", (4, 3), "float32")], "parameter 'missing' of the trainer's weights is not a parameter"),
    ([("b", (6,), "float32")], r"parameter 'b' has shape \[6\] in the trainer's weights but \[5\]"),
    ([("a", (4, 3), "complexity")], "'complexity' is not a torch dtype"),
    ([("a", (4, 3))], "malformed weights layout entry"),
    ([("a", 12, "float32")], "malformed weights layout entry"),
    ("a", "a weights layout is a list"),
])
def test_a_layout_that_does_not_fit_the_module_is_refused_naming_what_is_wrong(layout, message):
    with pytest.raises(WeightLayoutError, match=message):
        check_layout(Net(), layout)


def test_applied_weights_of_another_shape_are_refused_naming_the_parameter():
    with pytest.raises(WeightLayoutError, match="parameter 'a' has shape"):
        apply_weights(Net(), {"a": torch.zeros(3, 4)})


def test_a_gloo_transfer_puts_the_senders_weights_bitwise_into_the_receivers_module():
    sender, receiver = Net(), Net()
    with torch.no_grad():
        for p in sender.parameters():
            p.copy_(torch.randn(p.shape).to(p.dtype))
    weights = {n: p.detach() for n, p in sender.named_parameters()}
    layout = layout_of(weights)
    assert buckets(layout, cap=80) == [[0, 1], [2], [3]]  # a and b flattened together; bf16 apart; big alone
    groups = group_pair(TIMEOUT_S)
    params = check_layout(receiver, layout)
    errors: list[BaseException] = []

    def receive() -> None:
        try:
            receive_weights(groups[1], params, layout, torch.device("cpu"), cap=80)
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)
    t = threading.Thread(target=receive)
    t.start()
    send_weights(groups[0], weights, layout, torch.device("cpu"), cap=80)
    t.join(TIMEOUT_S)
    assert not t.is_alive() and errors == []
    assert weights_digest(receiver.named_parameters()) == weights_digest(sender.named_parameters())
    assert receiver.low.dtype == torch.bfloat16


def _join_and_die(port: int) -> None:
    process_group("gloo", port, 1, 2, TIMEOUT_S)
    os._exit(0)  # a replica killed before it takes the sync


def test_a_transfer_to_a_receiver_that_died_fails_instead_of_waiting():
    port = free_port()
    child = multiprocessing.get_context("spawn").Process(target=_join_and_die, args=(port,), daemon=True)
    child.start()
    group = process_group("gloo", port, 0, 2, TIMEOUT_S)
    child.join(TIMEOUT_S)
    assert child.exitcode == 0
    weights = {"big": torch.zeros(4 * 2**20)}  # 16 MB: more than a socket buffer takes without a reader
    with pytest.raises(RuntimeError):  # gloo's error (a DistBackendError is a RuntimeError)
        send_weights(group, weights, layout_of(weights), torch.device("cpu"))


def test_a_sync_cuts_its_buckets_into_two_buffers_used_in_turn():
    """Memory in flight is bounded: a third bucket reuses the first bucket's buffer, not a fresh one."""
    slots = _Slots(torch.device("cpu"), deadline=None)
    first, second, third = (slots.take(10, torch.float32) for _ in range(3))
    assert [first[0], second[0], third[0]] == [0, 1, 0]
    assert third[1].data_ptr() == first[1].data_ptr() != second[1].data_ptr()
    _, smaller = slots.take(4, torch.bfloat16)  # another dtype views the same bytes
    assert smaller.data_ptr() == second[1].data_ptr() and smaller.dtype == torch.bfloat16


def _join_and_stall(port: int, stalled: float) -> None:
    group = process_group("gloo", port, 1, 2, TIMEOUT_S)
    time.sleep(stalled)  # a hung replica: in the group (kept open), never taking the broadcast
    group.abort()


def test_a_transfer_to_a_receiver_that_hangs_stops_at_the_syncs_deadline_not_the_groups_timeout():
    port = free_port()
    child = multiprocessing.get_context("spawn").Process(target=_join_and_stall, args=(port, TIMEOUT_S), daemon=True)
    child.start()
    try:
        group = process_group("gloo", port, 0, 2, TIMEOUT_S)
        weights = {"big": torch.zeros(4 * 2**20)}  # 16 MB: more than a socket buffer takes without a reader
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="deadline"):
            send_weights(group, weights, layout_of(weights), torch.device("cpu"), deadline=started + DEADLINE_S)
        assert time.monotonic() - started < TIMEOUT_S / 2  # the deadline ended it, long before the group's timeout
    finally:
        child.kill()
        child.join()
