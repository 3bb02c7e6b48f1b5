"""A replica whose engine holds the weights itself (vLLM): the receiving side of core/engine/weight_sync.py
hands each received bucket to the engine and its module, on the meta device, holds none.

Over a real gloo group between two threads of this process: the layout is still checked against the
module's names and shapes; every bucket reaches the engine's `load` by name, bit for bit, and a bucket
the engine still holds is not overwritten by the next (vLLM keeps a layer's first weights until its
last arrives); a receive that fails part-way leaves the receiver `torn` (the replica then exits rather
than serve a mix of two versions); a module without weights and without an engine to take them refuses.
"""

from __future__ import annotations

import threading

import pytest
import torch

from core.engine.weight_sync import (
    WeightLayoutError,
    WeightReceiver,
    buckets,
    layout_of,
    send_weights,
)
from tests.core.test_weight_sync import TIMEOUT_S, Net
from tests.core.weight_pairs import group_pair

CAP = 80  # bytes: Net's weights in three buckets ([a, b], [low], [big])


def _sync(load) -> tuple[WeightReceiver, dict[str, torch.Tensor], list[BaseException]]:
    """Send a random Net's weights to a receiver whose module is a meta Net and whose engine is `load`."""
    sender = Net()
    with torch.no_grad():
        for p in sender.parameters():
            p.copy_(torch.randn(p.shape).to(p.dtype))
    weights = {n: p.detach() for n, p in sender.named_parameters()}
    layout = layout_of(weights)
    assert buckets(layout, CAP) == [[0, 1], [2], [3]]
    receiver = WeightReceiver(Net().to("meta"), "cpu", load=load)
    receiver.cap = CAP
    assert receiver.expect(layout) == "ok"  # checked against the meta module's names and shapes
    groups = group_pair(TIMEOUT_S)
    receiver.group = groups[1]
    errors: list[BaseException] = []

    def receive() -> None:
        try:
            receiver.receive()
        except BaseException as e:  # noqa: BLE001 - reported by the assertions
            errors.append(e)
    t = threading.Thread(target=receive)
    t.start()
    send_weights(groups[0], weights, layout, torch.device("cpu"), cap=CAP)
    t.join(TIMEOUT_S)
    assert not t.is_alive()
    return receiver, weights, errors


def test_each_bucket_reaches_the_engine_by_name_bit_for_bit_and_a_held_bucket_is_not_overwritten():
    got: list[list[tuple[str, torch.Tensor]]] = []
    receiver, weights, errors = _sync(got.append)  # the engine keeps every tensor it was handed
    assert errors == [] and not receiver.torn
    assert [[n for n, _ in bucket] for bucket in got] == [["a", "b"], ["low"], ["big"]]
    for name, tensor in (pair for bucket in got for pair in bucket):
        assert tensor.dtype == weights[name].dtype and torch.equal(tensor, weights[name])  # after every bucket came
    assert all(p.device.type == "meta" for p in receiver.module.parameters())  # no second copy here


def test_a_receive_that_fails_part_way_leaves_the_receiver_torn():
    def load(bucket):
        if bucket[0][0] == "big":
            raise RuntimeError("the engine could not take it")
    receiver, _, errors = _sync(load)
    assert [str(e) for e in errors] == ["the engine could not take it"]
    assert receiver.torn  # a and b are new, big is old: the replica must not serve this


def test_a_module_without_weights_and_no_engine_to_take_them_refuses_to_receive():
    receiver = WeightReceiver(Net().to("meta"), "cpu")
    receiver.group = object()
    receiver.expect(layout_of(dict(Net().named_parameters())))
    with pytest.raises(RuntimeError, match="holds no weights"):
        receiver.receive()
    assert not receiver.torn
    with pytest.raises(WeightLayoutError, match="parameter 'b' has shape"):
        receiver.expect([("b", (6,), "float32")])
