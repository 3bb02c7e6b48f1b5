"""Checkpoints: a resumed run continues exactly where it stopped, and a bad checkpoint harms nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from core.config import LoraConfig, TrainerConfig
from core.models import build_tiny, prepare_policy
from core.run import checkpoint
from core.run.checkpoint import CheckpointError, load_latest, restore, save
from core.train.trainer import Trainer, seed_everything
from tests.core.test_trainer import MODEL, completion_logprob, x_groups

# Dropout makes the LoRA run draw from the RNG every step, so only a restored RNG reproduces it.
LORA = LoraConfig(r=4, alpha=8, dropout=0.1)
CONFIG = {"trainer": {"lr": 0.003}, "models": [{"name": MODEL, "source": "tiny"}]}


def fresh(lora: LoraConfig | None = None, kl_coef: float = 0.1) -> Trainer:
    """What a (re)started run builds before anything else: the seeded base model and its trainer."""
    seed_everything(0)
    model, _ = build_tiny(seed=0)
    cfg = TrainerConfig(lr=2e-2 if lora else 3e-3, kl_coef=kl_coef)
    return Trainer(prepare_policy(model, lora), cfg, MODEL, lora=lora is not None)


def state(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()}


def comparable(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k != "train/step_time_s"}


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_resumed_run_matches_uninterrupted(tmp_path: Path, lora: LoraConfig | None):
    uninterrupted = fresh(lora)
    for step in range(2):
        uninterrupted.step(x_groups(uninterrupted.policy, step=step))
    expected = uninterrupted.step(x_groups(uninterrupted.policy, step=2))

    interrupted = fresh(lora)
    for step in range(2):
        interrupted.step(x_groups(interrupted.policy, step=step))
    # Finished but untrained when the run stopped: they must come back and train as step 3.
    buffered = x_groups(interrupted.policy, step=2)
    save(tmp_path, 2, {MODEL: interrupted}, buffered, {MODEL: 2}, CONFIG)
    del interrupted

    resumed = fresh(lora)  # a new process would start from the base model and a reseeded RNG
    ckpt = load_latest(tmp_path)
    assert ckpt is not None
    restore(ckpt, {MODEL: resumed})
    assert (ckpt.step, ckpt.versions, ckpt.config, resumed.step_count) == (2, {MODEL: 2}, CONFIG, 2)
    assert ckpt.buffered == buffered
    got = resumed.step(ckpt.buffered)

    assert comparable(got) == comparable(expected)
    after, reference = state(resumed), state(uninterrupted)
    assert all(torch.equal(after[k], reference[k]) for k in reference)
    assert resumed.step_count == uninterrupted.step_count == 3


def test_lora_checkpoint_holds_only_the_adapter_and_restores_the_policy(tmp_path: Path):
    trained = fresh(LORA, kl_coef=0.0)
    for step in range(2):
        trained.step(x_groups(trained.policy, step=step))
    folder = save(tmp_path, 2, {MODEL: trained}, [], {MODEL: 2}, CONFIG)

    files = {p.name for p in (folder / "models" / MODEL).rglob("*") if p.is_file()}
    assert "adapter_model.safetensors" in files and "adapter_config.json" in files
    assert "model.safetensors" not in files
    adapter_bytes = (folder / "models" / MODEL / "adapter" / "adapter_model.safetensors").stat().st_size
    base_bytes = sum(p.numel() * p.element_size() for p in trained.policy.get_base_model().parameters())
    assert adapter_bytes < base_bytes / 4

    restored = fresh(LORA, kl_coef=0.0)
    assert completion_logprob(restored.policy, "xxab") != completion_logprob(trained.policy, "xxab")
    restore(load_latest(tmp_path), {MODEL: restored})
    restored.policy.eval(), trained.policy.eval()
    assert completion_logprob(restored.policy, "xxab") == completion_logprob(trained.policy, "xxab")


def test_latest_names_the_newest_and_keep_prunes_the_oldest(tmp_path: Path):
    trainer = fresh(kl_coef=0.0)
    for step in (1, 2, 3):
        save(tmp_path, step, {MODEL: trainer}, [], {MODEL: step}, CONFIG, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000002", "step-00000003"]
    assert load_latest(tmp_path).step == 3
    assert not list(tmp_path.glob(".tmp-*"))


def test_every_file_of_a_checkpoint_is_on_disk_before_it_is_renamed_into_place(tmp_path: Path, monkeypatch):
    events: list[tuple[str, Path]] = []
    real_fsync, real_move = checkpoint._fsync, checkpoint._move_into_place
    monkeypatch.setattr(checkpoint, "_fsync", lambda p: (events.append(("fsync", Path(p))), real_fsync(p)))
    monkeypatch.setattr(checkpoint, "_move_into_place",
                        lambda tmp, final: (events.append(("rename", tmp)), real_move(tmp, final)))
    final = save(tmp_path, 1, {MODEL: fresh(kl_coef=0.0)}, [], {MODEL: 1}, CONFIG)
    (rename_at,) = [i for i, (what, _) in enumerate(events) if what == "rename"]
    tmp = events[rename_at][1]
    synced = {p.relative_to(tmp) for what, p in events[:rename_at] if what == "fsync" and p.is_relative_to(tmp)}
    written = {p.relative_to(final) for p in final.rglob("*")} | {Path(".")}
    assert written <= synced
    assert ("fsync", tmp_path) in events[rename_at:]  # the rename itself is flushed too


def test_saving_the_same_step_again_replaces_it(tmp_path: Path):
    trainer = fresh(kl_coef=0.0)
    groups = x_groups(trainer.policy)
    save(tmp_path, 5, {MODEL: trainer}, [], {MODEL: 5}, CONFIG)
    save(tmp_path, 5, {MODEL: trainer}, groups, {MODEL: 5}, CONFIG)
    assert load_latest(tmp_path).buffered == groups
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_crash_between_the_renames_falls_back_to_the_newest_complete_checkpoint(tmp_path: Path):
    trainer = fresh(kl_coef=0.0)
    save(tmp_path, 1, {MODEL: trainer}, [], {MODEL: 1}, CONFIG)
    save(tmp_path, 2, {MODEL: trainer}, [], {MODEL: 2}, CONFIG)
    (tmp_path / "latest").write_text("step-00000009\n")  # named, never renamed into place
    (tmp_path / ".tmp-step-00000009-dead").mkdir()  # what the crashed save left behind
    assert load_latest(tmp_path).step == 2


def test_no_checkpoint_directory_means_a_fresh_start(tmp_path: Path):
    assert load_latest(tmp_path / "nowhere") is None
    assert load_latest(tmp_path) is None


def test_a_save_that_fails_leaves_the_previous_checkpoint_in_charge(tmp_path: Path):
    trainer = fresh(kl_coef=0.0)
    save(tmp_path, 1, {MODEL: trainer}, [], {MODEL: 1}, CONFIG)
    with pytest.raises(CheckpointError, match="not JSON-serialisable"):
        save(tmp_path, 2, {MODEL: trainer}, [], {MODEL: 2}, {"callback": object()})
    assert load_latest(tmp_path).step == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001"]


def test_a_checkpoint_that_does_not_fit_the_run_is_refused_before_touching_the_trainers(tmp_path: Path):
    full = fresh(kl_coef=0.0)
    full.step(x_groups(full.policy))
    save(tmp_path, 1, {MODEL: full}, [], {MODEL: 1}, CONFIG)
    ckpt = load_latest(tmp_path)

    lora_trainer = fresh(LORA, kl_coef=0.0)
    before = state(lora_trainer)
    with pytest.raises(CheckpointError, match="lora=False but is now configured with lora=True"):
        restore(ckpt, {MODEL: lora_trainer})
    with pytest.raises(CheckpointError, match=r"holds models \['policy'\], the run trains \['critic'\]"):
        restore(ckpt, {"critic": lora_trainer})
    assert all(torch.equal(v, before[k]) for k, v in state(lora_trainer).items())
    assert lora_trainer.step_count == 0


def test_an_adapter_of_another_rank_is_refused(tmp_path: Path):
    save(tmp_path, 1, {MODEL: fresh(LORA, kl_coef=0.0)}, [], {MODEL: 1}, CONFIG)
    other = fresh(LoraConfig(r=8, alpha=8), kl_coef=0.0)
    before = state(other)
    with pytest.raises(CheckpointError, match="rank or target modules changed"):
        restore(load_latest(tmp_path), {MODEL: other})
    assert all(torch.equal(v, before[k]) for k, v in state(other).items())


def test_a_damaged_manifest_is_reported_by_path(tmp_path: Path):
    folder = save(tmp_path, 1, {MODEL: fresh(kl_coef=0.0)}, [], {MODEL: 1}, CONFIG)
    (folder / checkpoint.MANIFEST).write_text("{not json")
    with pytest.raises(CheckpointError, match="manifest.json"):
        load_latest(tmp_path)


def test_the_checkpoint_names_the_mlflow_run_and_older_checkpoints_name_none(tmp_path: Path):
    trainer = fresh(kl_coef=0.0)
    run = checkpoint.MlflowRun(run_id="abc123", tracking_uri="sqlite:////runs/mlflow.db")
    save(tmp_path / "new", 1, {MODEL: trainer}, [], {MODEL: 1}, CONFIG, mlflow=run)
    assert load_latest(tmp_path / "new").mlflow == run
    folder = save(tmp_path / "old", 1, {MODEL: trainer}, [], {MODEL: 1}, CONFIG)
    manifest = json.loads((folder / checkpoint.MANIFEST).read_text())
    assert manifest["mlflow"] is None
    del manifest["mlflow"]  # as written before runs were recorded
    (folder / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    assert load_latest(tmp_path / "old").mlflow is None


def test_a_step_folder_that_is_a_symlink_is_refused(tmp_path: Path):
    elsewhere = tmp_path / "elsewhere"
    save(elsewhere, 7, {MODEL: fresh(kl_coef=0.0)}, [], {MODEL: 7}, CONFIG)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "step-00000009").symlink_to(elsewhere / "step-00000007")
    with pytest.raises(CheckpointError, match=r"step-00000009 is a symlink .*refusing to load it"):
        load_latest(run_dir)  # found as the newest step folder
    (run_dir / "latest").write_text("step-00000009\n")
    with pytest.raises(CheckpointError, match=r"is a symlink"):
        load_latest(run_dir)  # named by `latest`
