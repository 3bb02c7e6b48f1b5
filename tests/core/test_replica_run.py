"""A whole run of one model on 2 replica processes and 2 trainer ranks (gloo), over HTTP, with a chaos kill.

The clients are multi-turn (tests/core/turns_agent.py, three calls an episode). After every step
both replicas serve the policy's new version; both got episodes (routed by the episode key the
gateway resolved); every trained episode is finished and whole. Replica 0 is SIGKILLed after the
first step: its open episodes are aborted, never trained; it comes back synced and the run
finishes. The world-size-2 checkpoint then resumes at world size 1 with one in-process engine
and trains on.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from typer.testing import CliRunner

from core.config_io import load_config
from core.engine.replicas import ReplicaEngine
from core.records import Episode
from core.run.cli import app
from core.run.loop import CoreRun
from core.train.distributed import DistributedTrainer
from tests.core.turns_agent import TURNS
from tests.support import train_in_process

STEPS = 4
RESTART_WAIT_S = 180.0  # a restart spawns a process that imports torch: ~5 s quiet, far more on a loaded 2-core box


class Observed(CoreRun):
    """The run, noting what it trained and what it aborted for a lost replica (then doing exactly that)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.trained: list[Episode] = []
        self.aborted_for_loss: list[str] = []

    def _train_batch(self, batch):
        self.trained += batch.episodes
        return super()._train_batch(batch)

    def abort_lost(self, episode_ids):
        self.aborted_for_loss += episode_ids
        super().abort_lost(episode_ids)


def config(tmp_path, **model):
    return load_config({
        "models": [{"device": "cpu", **model}],
        "server": {"port": 0},
        "engine": {"default_max_tokens": 6},
        "trainer": {"steps": STEPS, "batch_groups": 1, "group_size": 2, "max_staleness": 0, "lr": 0.01,
                    "checkpoint_every": 1, "checkpoint_every_s": 0, "checkpoint_dir": str(tmp_path / "ckpt")},
        "clients": [{"agent": "tests.core.turns_agent", "isolate": False, "concurrency": 4}],
    })


@pytest.fixture(scope="module")
def chaos_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replica-run")
    core = Observed(config(tmp, replicas=2, trainer={"world_size": 2}))
    engine = core.server.policies["policy"].engine
    assert isinstance(engine, ReplicaEngine)
    seen: list[tuple[int, int, list[int | None]]] = []
    killed: list[int] = []
    last: list[dict] = []  # the replicas as the last step left them (the server closes them at the end)
    status_text: list[str] = []

    def on_step(step, metrics):
        if killed:  # replica 0 is restarting (spawn, imports, model): wait for it, the clients go on meanwhile
            deadline = time.monotonic() + RESTART_WAIT_S
            while not all(r["healthy"] for r in engine.status()) and time.monotonic() < deadline:
                time.sleep(0.2)
        if step == 2:  # what `swarm status` shows of the replicas, over HTTP, mid-run
            status_text.append(CliRunner().invoke(app, ["status", core.server.url]).output)
        rows = engine.status()
        seen.append((step, core.server.versions()["policy"], [r["version"] for r in rows]))
        last[:] = rows
        if step == 1:
            killed.append(engine.status()[0]["pid"])
            os.kill(killed[0], signal.SIGKILL)

    try:
        train_in_process(core, on_step)
        yield core, last, seen, killed, tmp, status_text
    finally:
        core.server.close()
        for t in core.trainers.values():
            if isinstance(t, DistributedTrainer):
                t.close()


def test_after_each_step_both_replicas_serve_the_new_version(chaos_run):
    core, _, seen, _, _, _ = chaos_run
    assert core.failure is None and core.step == STEPS
    assert [s for s, _, _ in seen] == list(range(1, STEPS + 1))
    for step, version, replica_versions in seen:
        if step != 1:  # at step 1's end replica 0 is about to be killed; every other step both serve it
            assert replica_versions == [version, version], (step, version, replica_versions)
    assert seen[-1][1] >= 1  # the weights did change


def test_episodes_are_routed_to_both_replicas_and_trained_whole(chaos_run):
    core, last, _, _, _, _ = chaos_run
    assert all(r["episodes_total"] > 0 for r in last)  # the gateway's episode key reached the router
    assert core.trained
    for ep in core.trained:
        assert ep.state == "finished"
        assert len(ep.calls_of("policy")) == TURNS  # an episode cut short by the kill would have fewer
        assert all(c.version is not None for c in ep.calls)  # every call records the version that generated it


def test_swarm_status_shows_each_replicas_health_version_and_load(chaos_run):
    *_, status_text = chaos_run
    assert len(status_text) == 1
    for i in (0, 1):
        assert f"policy replica {i} on cpu" in status_text[0]
    assert status_text[0].count(": up, version ") == 2 and "open episodes" in status_text[0]


def test_a_sigkilled_replica_aborts_its_episodes_and_comes_back_synced(chaos_run):
    core, last, seen, killed, _, _ = chaos_run
    row = last[0]
    assert killed and row["pid"] != killed[0] and row["healthy"]  # a new process serves slot 0
    assert row["version"] == seen[-1][1]  # at the policy's version
    assert core.aborted_for_loss, "replica 0 had open episodes when it was killed (turns pause between calls)"
    trained_ids = {ep.id for ep in core.trained}
    assert not trained_ids & set(core.aborted_for_loss)  # no partial episode trained
    assert core.server.registry.counters["aborted"] >= len(core.aborted_for_loss)


def test_the_world_size_two_checkpoint_resumes_at_world_size_one_and_trains_on(chaos_run):
    _, _, _, _, tmp, _ = chaos_run
    cfg = config(tmp)
    cfg.trainer.steps = STEPS + 1
    core = CoreRun(cfg)
    try:
        ckpt = core.resume()
        assert ckpt is not None and core.step == STEPS
        train_in_process(core)
        assert core.failure is None and core.step == STEPS + 1
    finally:
        core.server.close()
