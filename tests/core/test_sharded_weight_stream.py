"""A replica sync from the FSDP2 trainer's shards (`ShardedTrainer.stream_weights`, core/train/shard_weights.py,
and the sender half of core/engine/weight_sync.py), at world size 2 on gloo with the tiny model.

The send makes each weight whole (`DTensor.full_tensor`, every rank joining) only when its bucket
reaches it and drops it once copied: rank 0 never holds more than one weight made whole at a time
(counted on rank 0 while the sync runs, buckets set small), far below the model; the replica ends
with rank 0's gathered weights bit for bit. A send that fails part way still leaves the ranks in
step: rank 0 joins the gathers it skipped, and the next step runs.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from core.engine.weight_sync import (
    check_layout,
    layout_of,
    receive_weights,
    send_weights,
)
from core.models import build_tiny
from core.train.sharded import ShardedTrainer
from core.train.trainer import seed_everything
from tests.core.test_distributed_trainer import CFG, groups_for
from tests.core.test_sharded_trainer import MC
from tests.core.test_weight_sync import TIMEOUT_S
from tests.core.weight_pairs import count_full_tensors, group_pair

pytestmark = pytest.mark.timeout(300)  # spawns a rank; a collective that hangs would wait far longer
CAP = 8192  # bytes: the tiny model's 20 weights in about a dozen buckets, its embedding one of its own
CPU = torch.device("cpu")


def test_a_replica_sync_from_shards_makes_one_weight_whole_at_a_time_and_the_replica_gets_the_trained_weights(
        monkeypatch):
    seed_everything(0)
    base, _ = build_tiny(0)
    replica = build_tiny(1)[0]  # other weights: the sync must overwrite every one
    fsdp = ShardedTrainer(copy.deepcopy(base), CFG, MC, ["cpu", "cpu"])
    try:
        assert fsdp.step(groups_for(base))["train/updated"] == 1.0
        sender, receiver = group_pair(TIMEOUT_S)
        live = count_full_tensors(monkeypatch)
        errors: list[BaseException] = []

        def send(weights: dict) -> None:
            layout = layout_of(weights)
            params = check_layout(replica, layout)

            def receive() -> None:
                try:
                    receive_weights(receiver, params, layout, CPU, cap=CAP)
                except BaseException as e:  # noqa: BLE001 - surfaced by the assertion below
                    errors.append(e)

            thread = threading.Thread(target=receive)
            thread.start()
            send_weights(sender, weights, layout, CPU, cap=CAP)
            thread.join(TIMEOUT_S)

        fsdp.stream_weights(send)
        assert not errors
        sizes = [p.numel() for p in base.parameters()]
        assert live["calls"] == len(sizes)  # each weight made whole once
        assert live["peak"] <= max(sizes) < sum(sizes) / 4  # one at a time, never the model
        trained = dict(fsdp.policy.named_parameters())
        for name, p in replica.named_parameters():
            assert torch.equal(p, trained[name]), name
    finally:
        fsdp.close()


def test_a_sync_that_fails_part_way_leaves_the_ranks_in_step():
    seed_everything(0)
    base, _ = build_tiny(0)
    fsdp = ShardedTrainer(copy.deepcopy(base), CFG, MC, ["cpu", "cpu"])
    try:
        def fail(weights: dict) -> None:
            next(iter(weights.values())).full_tensor()  # the first gather, then the transfer breaks
            raise ConnectionError("replica gone")

        with pytest.raises(ConnectionError, match="replica gone"):
            fsdp.stream_weights(fail)
        assert fsdp.step(groups_for(base))["train/updated"] == 1.0  # no rank was left waiting in a gather
    finally:
        fsdp.close()
