"""Colocated replicas sleep during the trainer's step and serve after it (core/engine/replicas.py).

On a GPU, `layout: colocated` puts replica i on trainer rank i's device, and those replicas give
their memory back while the trainer steps. This machine has no GPU: the replicas here are real hf
replica processes on CPU, named as sleepers the way a colocated GPU layout names them
(`core.engine.devices.sleeping_replicas`), so the call sequence and each child's own sleep state are
checked; the memory a GPU would get back is 0 on CPU (nothing to release there, see the engines).
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
import yaml
from typer.testing import CliRunner

from core import models
from core.engine.devices import sleeping_replicas
from core.config_io import load_config
from core.engine import SamplingParams
from core.engine.process import ProcessEngine, ReplicaSpec
from core.engine.replicas import ReplicaEngine
from core.engine.weight_sync import weights_of
from core.run.cli import app
from core.run.loop import CoreRun
from tests.support import train_in_process

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
HELD_S = 2.0  # how long a call sent to a sleeping replica is watched for (it must not be served meanwhile)
REQUEST_TIMEOUT_S = 300.0  # the hang watchdog's bar: far above a loaded 2-core box's slowest call


def _start(cfg, mc):
    def start(i, on_lost):
        spec = ReplicaSpec(index=i, model=mc.model_dump(), engine=cfg.engine.model_dump(), max_context=256,
                           seed=i, threads=1)
        return ProcessEngine(spec, REQUEST_TIMEOUT_S, on_lost)
    return start


@pytest.fixture(scope="module")
def colocated():
    """Two replica processes; slot 0 shares a trainer rank's device (a sleeper), slot 1 does not."""
    cfg = load_config({"models": [{"device": "cpu", "replicas": 2}], "trainer": {"max_staleness": 0}})
    mc = cfg.models[0]
    model, tok = models.load(mc)
    engine = ReplicaEngine(lambda: weights_of(model), _start(cfg, mc), 2, max_staleness=0,
                           max_context=256, route_wait_s=REQUEST_TIMEOUT_S, sleepers=(0,))
    yield engine, model, tok
    engine.close()


def test_a_colocated_replica_sleeps_through_the_step_and_serves_the_new_weights_after(colocated):
    engine, model, tok = colocated
    prompt = tok.encode("hello", add_special_tokens=False)
    sleeper, awake = engine.replicas
    before = asyncio.run(sleeper.generate(prompt, GREEDY))

    engine.hold()
    engine.pause_blocking()
    assert engine.sleep_during_step() == 1  # only the colocated slot
    assert [r["asleep"] for r in engine.status()] == [True, False]  # each child's own answer

    async def held_call():
        task = asyncio.create_task(sleeper.generate(prompt, GREEDY))
        await asyncio.sleep(HELD_S)
        served_while_asleep = task.done()
        with torch.no_grad():  # the trainer's step, while the replica sleeps
            for p in model.parameters():
                p.mul_(1.5)
        await asyncio.to_thread(engine.wake_after_step)
        await asyncio.to_thread(engine.resume, 1)
        return served_while_asleep, await task

    served_while_asleep, after = asyncio.run(held_call())
    assert not served_while_asleep
    assert [r["asleep"] for r in engine.status()] == [False, False]
    assert [r["version"] for r in engine.status()] == [1, 1]
    assert after.version == 1 and before.version == 0
    assert after.logprobs != pytest.approx(before.logprobs, abs=1e-3)  # generated from the new weights


def test_a_replica_that_still_generates_refuses_to_sleep(colocated):
    engine, _, _ = colocated
    with pytest.raises(RuntimeError, match="sleep needs a drained engine: pause_blocking first"):
        engine.replicas[1].sleep()
    assert engine.status()[1]["asleep"] is False and engine.status()[1]["healthy"]


def test_only_replicas_colocated_on_a_trainer_ranks_gpu_sleep():
    def mc(**model):
        return load_config({"models": [{"replicas": 2, **model}]}).models[0]

    assert sleeping_replicas(mc(device="cuda", layout="colocated", trainer={"world_size": 2}), 4) == [0, 1]
    assert sleeping_replicas(mc(device="cuda", layout="colocated"), 4) == [0]  # one rank, on cuda:0
    assert sleeping_replicas(mc(device="auto", layout="colocated"), 4) == [0]
    assert sleeping_replicas(mc(device="cuda", layout="split", trainer={"world_size": 2}), 4) == []
    assert sleeping_replicas(mc(device="cpu", layout="colocated"), 4) == []
    assert sleeping_replicas(mc(device="auto", layout="colocated"), 0) == []  # auto without a GPU is cpu


@pytest.mark.parametrize("layout, device, printed", [
    ("colocated", "cuda", "sleeping during the step: replica(s) 0,1 share a trainer rank's GPU"),
    ("split", "cuda", "not sleeping: layout split"),
    ("colocated", "cpu", "not sleeping: colocated on cpu"),
])
def test_dry_run_says_which_replicas_sleep_during_the_step(tmp_path, monkeypatch, layout, device, printed):
    # The plan of a 4-GPU machine this one is not: the count is torch's answer, not ours.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"engine": {"kind": "vllm"}, "models": [
        {"device": device, "replicas": 2, "layout": layout, "trainer": {"world_size": 2}}]}))
    result = CliRunner().invoke(app, ["run", str(path), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert f"2 vllm replicas ({layout})" in result.output
    assert printed in result.output


def test_the_instant_engine_is_refused_as_replicas(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"engine": {"kind": "instant"}, "models": [{"device": "cpu", "replicas": 2}]}))
    result = CliRunner().invoke(app, ["run", str(path), "--dry-run"])
    assert result.exit_code != 0
    assert "replicas run the hf or vllm engine, not engine.kind 'instant'" in result.output


class Watched(CoreRun):
    """The run, noting each replica's sleep state (its child's answer) when the trainer's backward starts."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.asleep_at_backward: list[list[bool]] = []
        trainer = self.trainers["policy"]
        backward = trainer.backward

        def watched(prepared):
            self.asleep_at_backward.append([r["asleep"] for r in self.server.policies["policy"].engine.status()])
            return backward(prepared)
        trainer.backward = watched


def test_the_run_sleeps_colocated_replicas_for_each_step_and_wakes_them_to_serve(tmp_path):
    cfg = load_config({
        "models": [{"device": "cpu", "replicas": 2, "layout": "colocated"}],
        "server": {"port": 0}, "engine": {"default_max_tokens": 6},
        "trainer": {"steps": 2, "batch_groups": 1, "group_size": 2, "max_staleness": 0, "lr": 0.01,
                    "checkpoint_dir": str(tmp_path / "ckpt")},
        "clients": [{"agent": "tests.core.turns_agent", "isolate": False, "concurrency": 2}],
    })
    core = Watched(cfg)
    engine = core.server.policies["policy"].engine
    assert isinstance(engine, ReplicaEngine) and engine.sleepers == ()  # on cpu nothing sleeps by itself
    engine.sleepers = (0, 1)  # what the same layout on two GPUs sets (test_only_replicas_colocated_...)
    after_step: list[tuple[int, list[bool], list[int]]] = []

    def on_step(step, metrics):
        rows = engine.status()
        after_step.append((core.server.versions()["policy"], [r["asleep"] for r in rows], [r["version"] for r in rows]))

    started = time.monotonic()
    try:
        train_in_process(core, on_step)
    finally:
        core.server.close()
    assert core.failure is None and core.step == 2, time.monotonic() - started
    # A step whose batch has nothing to learn (equal rewards) skips backward and the drain with it.
    assert core.asleep_at_backward and all(asleep == [True, True] for asleep in core.asleep_at_backward)
    for version, asleep, versions in after_step:
        assert asleep == [False, False] and versions == [version, version]
    assert after_step[-1][0] >= 1  # the weights changed and both woken replicas serve them
