"""A replica restarted while the trainer's step writes its module catches up with one version, labelled as
that version (core/engine/replicas.py, issue 41 section 8), on 2 real hf replica processes of the tiny model.

Before, the restarted replica's catch-up sync read rank 0's module whenever it was up: in the middle of
an on-policy step (between `hold` and `resume`) or of an overlapped one (inside `swap_weights`), so it
got half the old weights and half the new ones under the old version's label, and was routed to.
Here every sync the restarted replica takes carries exactly the weights of the version it names. And a
replica whose sync fails part-way in its process exits unanswered (so it is restarted and catches up)
instead of answering an error and serving part old, part new weights under its old label.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

from core import models
from core.config_io import load_config
from core.engine import process
from core.engine.process import ProcessEngine, ReplicaSpec
from core.engine.replicas import make_model_engine
from core.engine.weight_sync import weights_digest, weights_of
from tests.core import torn_replica
from tests.core.test_replicas import RESTART_WAIT_S, _digests_match, _wait_all_healthy

# How long the step keeps its module half written once the restarted replica is up: far longer than a
# tiny model's sync (milliseconds), which the catch-up, if it read the module now, would be done with.
HALF_WRITTEN_S = 3.0
EXIT_S = 30.0  # how long a replica whose sync tore may take to exit: it exits at once; this only bounds a hang


@pytest.fixture(scope="module")
def replicas():
    cfg = load_config({"models": [{"device": "cpu", "replicas": 2}], "trainer": {"max_staleness": 0}})
    model, _ = models.load(cfg.models[0])
    engine = make_model_engine(cfg, cfg.models[0], model, None, 256)
    yield engine, model
    engine.close()


def _write(model, half: int) -> None:
    """Half of what a trainer step does to the module: the first or second half of its weights change."""
    tensors = list(weights_of(model).values())
    cut = len(tensors) // 2
    with torch.no_grad():
        for t in tensors[:cut] if half == 0 else tensors[cut:]:
            t.add_(torch.randn_like(t) * 0.05)


def _record_restarts(engine):
    """Every sync a restarted replica takes, as (version, digest of the weights it was sent); and an
    event set when the restarted replica is up (before it catches up)."""
    inner, syncs, started = engine._start, [], threading.Event()

    def start(index, on_lost):
        replica = inner(index, on_lost)
        sync = replica.sync

        def recorded(weights, version):
            syncs.append((version, weights_digest(weights.items())))
            return sync(weights, version)
        replica.sync = recorded
        started.set()
        return replica
    engine._start = start
    return syncs, started


@pytest.mark.parametrize("step", ["on-policy", "overlapped"])
def test_a_replica_restarted_during_a_step_catches_up_with_one_version_under_its_own_label(replicas, step):
    engine, model = replicas
    _wait_all_healthy(engine)
    syncs, started = _record_restarts(engine)
    before, victim = engine.version, 1
    digests = {before: weights_digest(weights_of(model).items())}

    def write() -> bool:  # the step: half the module written, the replica lost and back up, the rest written
        _write(model, 0)
        os.kill(engine.status()[victim]["pid"], signal.SIGKILL)
        assert started.wait(RESTART_WAIT_S), "the lost replica did not come back up"
        threading.Event().wait(HALF_WRITTEN_S)
        _write(model, 1)
        digests[before + 1] = weights_digest(weights_of(model).items())
        return True

    if step == "on-policy":
        engine.hold()
        engine.pause_blocking()
        write()
        engine.resume(before + 1)
    else:
        assert engine.swap_weights(write)
    _wait_all_healthy(engine)
    assert syncs, "the restarted replica never caught up"
    assert [d == digests.get(v) for v, d in syncs] == [True] * len(syncs), \
        f"a sync labelled version {syncs[0][0]} carried other weights (the module mid-step)"
    assert [s["version"] for s in engine.status()] == [before + 1] * 2
    assert _digests_match(engine, model)


def test_a_replica_whose_sync_fails_part_way_exits_unanswered_rather_than_serve_a_mix(monkeypatch):
    monkeypatch.setattr(process, "replica_main", torn_replica.main)
    cfg = load_config({"models": [{"device": "cpu"}]})
    model, _ = models.load(cfg.models[0])
    spec = ReplicaSpec(index=0, model=cfg.models[0].model_dump(), engine=cfg.engine.model_dump(), max_context=256,
                       seed=0, threads=1)
    lost: list[str] = []
    replica = ProcessEngine(spec, 60.0, lambda _, why: lost.append(why))
    try:
        with pytest.raises(RuntimeError, match="could not load the weights"):
            replica.sync(weights_of(model), 1)
        replica.proc.join(EXIT_S)
        assert replica.proc.exitcode == 1, "the replica answered and stayed up with part of the new weights"
        assert replica.lost and lost  # out of service: the router restarts it, and it catches up whole
    finally:
        replica.close()
