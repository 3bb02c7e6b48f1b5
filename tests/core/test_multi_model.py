"""Two distinct trainable policies in one job: `configs/tiny-duo.yaml` (a drafter and a reviewer).

One real run is shared by the slow tests: a server with two `tiny` models of different seeds, the
`duo` sandbox as a local client over real HTTP, three train steps logged to a throwaway MLflow
store, and a checkpoint. The tests then read that run: each policy's reward is its own, each
update touches only its own weights, each has its own optimizer, version and checkpoint, metrics
sit under `<model>/`, and a fresh run resumed from the checkpoint restores both. The finish route's
checks on per-model rewards run against a live server without a trainer.
"""

from __future__ import annotations

import copy
import string
from pathlib import Path

import httpx
import pytest
import torch
from mlflow import MlflowClient

from core.run import checkpoint
from core.config_io import flatten, load_config
from core.run.loop import CoreRun
from core.serve.server import Server
from core.run.telemetry import Telemetry
from tests.support import train_in_process

ROOT = Path(__file__).resolve().parents[2]
MODELS = ("drafter", "reviewer")
STEPS = 3


def _duo(tmp_path: Path, *extra: str):
    return load_config(ROOT / "configs" / "tiny-duo.yaml", [
        f"trainer.checkpoint_dir={tmp_path / 'ckpt'}", f"trainer.steps={STEPS}", "trainer.batch_groups=2",
        "telemetry.experiment=multi-model-test", "clients.0.concurrency=8", *extra])


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.fixture(scope="module")
def duo_run(tmp_path_factory):
    """The shared run: (core, config, batches trained, per-step metrics, state right after the checkpoint)."""
    tmp_path = tmp_path_factory.mktemp("duo")
    cfg = _duo(tmp_path)
    core = CoreRun(cfg)
    initial = {n: _weights(core.server.policies[n].model) for n in MODELS}
    batches, steps = [], []
    take = core.server.registry.take_batch

    def recording_take(*args, **kwargs):  # the real batch assembly, with what it hands the trainer kept
        batch = take(*args, **kwargs)
        if batch is not None:
            batches.append(batch)
        return batch

    core.server.registry.take_batch = recording_take
    core.telemetry = Telemetry(cfg.telemetry, flatten(cfg), {"swarmrl.kind": "core-run"})
    train_in_process(core, on_step=lambda step, m: steps.append(dict(m)))
    path = core.checkpoint()
    core.telemetry.close("FINISHED")
    assert core.failure is None and core.step == STEPS, f"the shared run stopped at step {core.step}: {core.failure!r}"
    saved = {
        "path": path,
        "initial": initial,
        "weights": {n: _weights(core.server.policies[n].model) for n in MODELS},
        "optimizer": {n: copy.deepcopy(core.trainers[n].optimizer.state_dict()) for n in MODELS},
        "versions": core.server.versions(),
        "trainer_steps": {n: core.trainers[n].step_count for n in MODELS},
    }
    return core, cfg, batches, steps, saved


@pytest.mark.slow
def test_each_policy_acts_in_every_episode_and_gets_its_own_reward(duo_run):
    core, _, batches, steps, _ = duo_run
    assert len(batches) == len(steps) == STEPS
    for batch, metrics in zip(batches, steps):
        for ep in batch.episodes:
            assert [c.model for c in ep.calls] == list(MODELS)  # the drafter, then the reviewer, one episode
            draft, review = (c.reply["content"] or "" for c in ep.calls)
            assert ep.reward == pytest.approx({
                "drafter": sum(ch in string.ascii_lowercase for ch in draft) / max(len(draft), 12),
                "reviewer": sum(ch in string.ascii_uppercase for ch in review) / max(len(review), 12)})
        for name in MODELS:  # each trainer's reward metric is the mean of its own rewards in the batch
            mine = [ep.reward[name] for ep in batch.episodes]
            assert metrics[f"{name}/reward/mean"] == pytest.approx(sum(mine) / len(mine))
    assert any(ep.reward["drafter"] != ep.reward["reviewer"] for b in batches for ep in b.episodes)


@pytest.mark.slow
def test_each_update_touches_only_its_own_weights(duo_run):
    core, _, batches, _, saved = duo_run
    for name in MODELS:  # distinct modules: no tensor shared between the two policies
        other = next(n for n in MODELS if n != name)
        mine = {p.data_ptr() for p in core.server.policies[name].model.parameters()}
        assert mine.isdisjoint(p.data_ptr() for p in core.server.policies[other].model.parameters())
        # the run changed both, each from its own seed
        assert any(not torch.equal(saved["initial"][name][k], saved["weights"][name][k]) for k in saved["initial"][name])
    assert any(not torch.equal(saved["initial"]["drafter"][k], saved["initial"]["reviewer"][k])
               for k in saved["initial"]["drafter"])  # different seeds, different policies
    # One more real update of each policy alone, on the run's own last batch: only its weights move.
    groups = batches[-1].groups
    for name in MODELS:
        other = next(n for n in MODELS if n != name)
        before = {n: _weights(core.server.policies[n].model) for n in MODELS}
        metrics = core.trainers[name].step(groups)
        assert metrics["train/updated"] == 1.0
        after = {n: _weights(core.server.policies[n].model) for n in MODELS}
        assert any(not torch.equal(before[name][k], after[name][k]) for k in before[name])
        assert all(torch.equal(before[other][k], after[other][k]) for k in before[other])
        # its samples train only its own calls' tokens
        prepared = core.trainers[name].prepare(groups)
        trained = sorted(t for s in prepared.samples for t, m in zip(s.input_ids, s.loss_mask) if m)
        assert trained == sorted(t for g in groups for ep in g for c in ep.calls_of(name) for t in c.completion_ids)


@pytest.mark.slow
def test_each_policy_has_its_own_optimizer_version_and_checkpoint(duo_run):
    core, _, _, steps, saved = duo_run
    opts = {n: core.trainers[n].optimizer for n in MODELS}
    assert opts["drafter"] is not opts["reviewer"]
    for name in MODELS:
        own = {id(p) for p in core.server.policies[name].model.parameters()}
        held = {id(p) for group in opts[name].param_groups for p in group["params"]}
        assert held == own
        assert saved["optimizer"][name]["state"]  # Adam moments exist for its parameters
        updates = sum(m.get(f"{name}/train/updated", 0.0) for m in steps)
        assert saved["versions"][name] == updates >= 1  # the version counts this policy's weight changes
        assert saved["trainer_steps"][name] == STEPS
    ckpt = checkpoint.load(saved["path"])
    assert ckpt.versions == saved["versions"] and ckpt.step == STEPS
    folder = Path(saved["path"]) / "models"
    assert sorted(p.name for p in folder.iterdir()) == sorted(MODELS)
    for name in MODELS:
        assert (folder / name / checkpoint.FULL_WEIGHTS).is_file() and (folder / name / checkpoint.TRAINER_STATE).is_file()


@pytest.mark.slow
def test_per_model_metrics_are_logged_under_the_model_name(duo_run):
    core, _, _, _, _ = duo_run
    client = MlflowClient()
    run = client.get_run(core.telemetry.run_id)
    for name in MODELS:
        for metric in ("reward/mean", "reward/duo/mean", "train/loss", "train/grad_norm", "train/tokens", "merge/ratio"):
            history = client.get_metric_history(run.info.run_id, f"{name}/{metric}")
            assert [m.step for m in history] == list(range(1, STEPS + 1)), f"{name}/{metric}"
    assert "train/loss" not in run.data.metrics and "reward/mean" not in run.data.metrics
    assert {"rollout/episodes_per_s", "time/train_s", "episodes/wasted_frac"} <= set(run.data.metrics)
    assert run.data.params["models.0.name"] == "drafter" and run.data.params["models.1.seed"] == "2"


@pytest.mark.slow
def test_resume_restores_both_policies(duo_run):
    _, cfg, _, _, saved = duo_run
    resumed = CoreRun(cfg)  # a fresh process's view: both models rebuilt from their seeds
    try:
        ckpt = resumed.resume()
        assert ckpt is not None and resumed.step == STEPS
        assert resumed.server.versions() == saved["versions"]
        for name in MODELS:
            weights = _weights(resumed.server.policies[name].model)
            assert all(torch.equal(weights[k], saved["weights"][name][k]) for k in weights), name
            state = resumed.trainers[name].optimizer.state_dict()["state"]
            for index, moments in saved["optimizer"][name]["state"].items():
                assert torch.equal(state[index]["exp_avg"], moments["exp_avg"]), name
            assert resumed.trainers[name].step_count == saved["trainer_steps"][name]
    finally:
        resumed.server.close()


@pytest.fixture(scope="module")
def duo_server():
    """Two tiny policies served without a trainer: the finish route's reward checks."""
    server = Server(load_config(ROOT / "configs" / "tiny-duo.yaml", ["server.port=0", "engine.default_max_tokens=4"]))
    server.start()
    yield server
    server.stop()


def _episode_with_both_models(url: str) -> tuple[str, str]:
    opened = httpx.post(f"{url}/swarm/v1/episodes", json={"sandbox": "duo", "task_id": "t", "group_size": 1}).json()
    key = opened["api_key"]
    for model in MODELS:
        r = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                       json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200, r.text
    return opened["episode_id"], key


def test_a_reward_that_leaves_out_a_model_that_acted_is_refused_and_the_episode_stays_open(duo_server):
    url = duo_server.url
    episode_id, key = _episode_with_both_models(url)
    auth = {"Authorization": f"Bearer {key}"}
    missing = httpx.post(f"{url}/swarm/v1/episodes/{episode_id}/finish", headers=auth, json={"reward": {"drafter": 1.0}})
    assert missing.status_code == 400 and "reviewer" in missing.text
    unknown = httpx.post(f"{url}/swarm/v1/episodes/{episode_id}/finish", headers=auth,
                         json={"reward": {"drafter": 1.0, "reviewer": 0.0, "judge": 1.0}})
    assert unknown.status_code == 400 and "judge" in unknown.text
    assert duo_server.registry.get_open(episode_id).state == "open"  # nothing was recorded
    done = httpx.post(f"{url}/swarm/v1/episodes/{episode_id}/finish", headers=auth,
                      json={"reward": {"drafter": 1.0, "reviewer": 0.25}})
    assert done.status_code == 200 and done.json()["reward"] == {"drafter": 1.0, "reviewer": 0.25}


def test_a_single_reward_goes_to_every_model_that_acted(duo_server):
    url = duo_server.url
    episode_id, key = _episode_with_both_models(url)
    done = httpx.post(f"{url}/swarm/v1/episodes/{episode_id}/finish", headers={"Authorization": f"Bearer {key}"},
                      json={"reward": 0.5})
    assert done.status_code == 200 and done.json()["reward"] == {"drafter": 0.5, "reviewer": 0.5}
