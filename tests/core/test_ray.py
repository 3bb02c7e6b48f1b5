"""Ray placement (issue 11): the dry-run plan, no Ray in a local run, and a run on a local Ray cluster.

The cluster tests share one `ray start --head` (2 CPUs) and one two-model run: its clients are Ray
actors (one is killed and replaced), it trains to the end, and a model actor killed mid-run
(SIGKILL) is detected and restored from the last checkpoint while the run goes on; then, with the
restart budget spent, a second death ends the run as failed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from core.run.cli import app
from core.config_io import ConfigError, load_config
from core.engine import SamplingParams
from core.run.plan import describe, plan
from core.ray.actors import ModelActor, NotAdopted
from tests.ray_cluster import local_ray_cluster

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_CONFIGS = sorted((ROOT / "configs" / "cluster").glob("*.yaml"))


# -- the plan (no cluster) -------------------------------------------------------------------------
@pytest.mark.parametrize("path", CLUSTER_CONFIGS, ids=lambda p: p.name)
def test_cluster_configs_pass_the_dry_run_and_print_their_placement(path):
    result = CliRunner().invoke(app, ["run", str(path), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "placement: ray" in result.output
    assert "a Ray actor" in result.output and "gpu 1" in result.output  # the model reserves its GPU
    assert "Ray actor(s)" in result.output  # clients spread as actors


def test_cluster_configs_exist_one_full_weight_and_one_lora():
    cfgs = [load_config(p) for p in CLUSTER_CONFIGS]
    assert sorted(any(m.lora is not None for m in c.models) for c in cfgs) == [False, True]
    assert all(c.engine.kind == "vllm" and c.placement.kind == "ray" for c in cfgs)


def test_dry_run_with_a_ray_address_places_models_and_clients_as_actors():
    result = CliRunner().invoke(app, ["run", str(ROOT / "configs/tiny-duo.yaml"), "--dry-run", "--ray-address", "auto",
                                      "--set", "clients.0.ray.replicas=3", "--set", "clients.0.ray.num_cpus=0.5"])
    assert result.exit_code == 0, result.output
    assert "placement: ray (Ray cluster at auto)" in result.output
    assert result.output.count("a Ray actor") == 2  # drafter and reviewer
    assert "3 Ray actor(s)" in result.output and "48 episodes in flight" in result.output
    assert "reserves: 3.5 CPUs, 0 GPUs" in result.output


@pytest.mark.parametrize(("device", "gpus", "key"), [("cuda", 0, "models.0.ray.num_gpus"),
                                                      ("cuda:1", 1, "models.0.device"),
                                                      ("cpu", 1, "models.0.ray.num_gpus")])
def test_a_placement_that_cannot_work_is_refused_naming_the_key(device, gpus, key):
    cfg = load_config(overrides=["placement.kind=ray", f"models=[{{source: tiny, device: '{device}', ray: {{num_gpus: {gpus}}}}}]"])
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        plan(cfg)
    result = CliRunner().invoke(app, ["run", str(ROOT / "configs/tiny.yaml"), "--dry-run", "--ray-address", "local",
                                      "--set", f"models.0.device={device}", "--set", f"models.0.ray.num_gpus={gpus}"])
    assert result.exit_code == 2 and key in result.output


def test_unknown_placement_keys_are_config_errors():
    with pytest.raises(ConfigError, match="placement.where"):
        load_config(overrides=["placement.where=moon"])
    with pytest.raises(ConfigError, match=r"clients\.0\.ray\.num_gpus"):
        load_config(overrides=["clients=[{agent: 'sandbox:letters', ray: {num_gpus: 1}}]"])


def test_swarm_serve_refuses_a_ray_placement_it_would_ignore():
    result = CliRunner().invoke(app, ["serve", str(ROOT / "configs/tiny.yaml"), "--set", "placement.kind=ray"])
    assert result.exit_code == 2 and "placement.kind ray is for `swarm run`" in result.output


def test_a_local_plan_says_everything_runs_here():
    text = describe(load_config(ROOT / "configs/tiny.yaml"))
    assert text.startswith("placement: local (this machine)")
    model_line = next(line for line in text.splitlines() if "model policy (tiny): engine hf + trainer" in line)
    assert "this process" in model_line and "Ray" not in text


@pytest.mark.slow  # a fresh interpreter importing the core: ~10 s quiet, over a minute on a busy machine
def test_a_local_run_never_imports_ray():
    code = ("import sys; from core.config_io import load_config; from core.run.placement import core_run; "
            "r = core_run(load_config('configs/tiny.yaml', ['trainer.checkpoint_dir=/nonexistent'])); "
            "r.server.close(); print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


# -- on a local Ray cluster --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_address():
    with local_ray_cluster(num_cpus=2) as (address, _):
        yield address


def test_a_model_actor_serves_and_trains_only_once_the_driver_adopts_it(tmp_path):
    # What Ray's restart of a dead actor looks like from inside: `__init__` runs again, with initial
    # weights. Until adopted, it must not generate, train or write a checkpoint.
    cfg = load_config(ROOT / "configs/tiny.yaml", [f"trainer.checkpoint_dir={tmp_path}"])
    actor = ModelActor(cfg.model_dump(), "policy")
    try:
        for call in (actor.generate([1, 2, 3], SamplingParams(max_tokens=2)), actor.hold(), actor.prepare([]),
                     actor.save(str(tmp_path / "step-1"))):
            with pytest.raises(NotAdopted, match="restarted and is not restored yet"):
                asyncio.run(call)
        assert not (tmp_path / "step-1").exists()
        assert asyncio.run(actor.info())["step_count"] == 0  # the driver can still find and restore it
        assert asyncio.run(actor.adopt())["trainable"] is True
        assert len(asyncio.run(actor.generate([1, 2, 3], SamplingParams(max_tokens=2))).token_ids) == 2
    finally:
        asyncio.run(actor.close())


@pytest.mark.slow
def test_a_two_model_run_on_ray_trains_survives_a_killed_model_actor_and_fails_past_its_budget(ray_address, tmp_path):
    import ray

    from core.run.placement import core_run
    from core.ray.driver import ModelLost

    cfg = load_config(ROOT / "configs/tiny-duo.yaml", [
        "placement.kind=ray", f"placement.address={ray_address}", "placement.max_restarts=1",
        "trainer.steps=4", "trainer.checkpoint_every=1", f"trainer.checkpoint_dir={tmp_path / 'ckpt'}",
        "models.0.ray.num_cpus=0.25", "models.1.ray.num_cpus=0.25",
        "clients.0.ray.num_cpus=0.25", "clients.0.ray.replicas=2", "clients.0.concurrency=8",
    ])
    core = core_run(cfg)
    drafter = core.trainers["drafter"].link
    before = drafter.info["pid"]
    trained_after_kill: list[int] = []  # run steps after the kill in which the drafter took a step

    def on_step(step, metrics):
        if step == 1:  # a client actor's process dies: another takes its slot
            os.kill(ray.get(core._slots[0].actor.pid.remote()), signal.SIGKILL)
        if step == 2:  # just checkpointed: kill the drafter's engine+trainer process outright
            os.kill(drafter.info["pid"], signal.SIGKILL)
        elif step > 2 and "drafter/train/updated" in metrics:  # absent if it had no groups or failed
            trained_after_kill.append(step)

    try:
        core.server.start()
        core.start_clients()
        core.train(on_step=on_step)
        core.stop_clients()

        assert core.step == 4 and core.failure is None  # trained to completion
        assert drafter.restarts == 1 and drafter.info["pid"] != before  # detected, and a new process serves
        # Restored from step 2's checkpoint (a fresh actor would count only the steps after the kill).
        assert core.trainers["drafter"].step_count == 2 + len(trained_after_kill)
        assert core.trainers["reviewer"].step_count == 4  # the other model never noticed
        versions = core.server.versions()
        assert versions["drafter"] >= 3  # restored weights were served under a new version
        assert [slot.restarts for slot in core._slots] == [1, 0]  # the killed client was replaced
        assert len(core.client_results) == 2 and all(r["pid"] != os.getpid() for r in core.client_results)
        assert all(r["finished"] > 0 for r in core.client_results)  # the replacement worked too
        # 4 steps x 4 groups x 4 episodes filled the batches, with what the killed client actor finished
        # before it died (in no actor's result). An episode the killed drafter generated can be stale
        # for the restored one's new version: dropped from its group, so counted stale, not trained.
        counters = core.server.registry.counters
        assert counters["trained"] <= 4 * 4 * 4 <= counters["trained"] + counters["stale"], counters

        # Budget spent (max_restarts 1): the next death ends the run as failed, with the reason.
        os.kill(drafter.info["pid"], signal.SIGKILL)
        with pytest.raises(ModelLost, match="died during hold"):
            core.server.policies["drafter"].engine.hold()
        assert core.stop.is_set() and "died 2 times (placement.max_restarts 1)" in str(core.failure)
    finally:
        core.stop_clients()
        core.server.stop()
    assert not ray.is_initialized()  # the driver left the cluster
