"""Checkpoints of a run: weights, trainer state, versions and the finished-but-untrained episodes.

Layout of one checkpoint, ``<directory>/step-00000012/``::

    manifest.json                 step, versions, run config, the MLflow run, one entry per trained model
    episodes.json                 buffered groups (finished, not yet trained), as Episode records
    models/<name>/model.safetensors    full fine-tune: every weight (tied ones stored once)
    models/<name>/adapter/             LoRA: only the adapter, as a standard PEFT folder
    models/<name>/trainer.pt      optimizer, trainer step, RNG states (loaded with weights_only)
    models/<name>/sharded/        fsdp2: optimizer and fp32 master copies as each rank's DCP shards;
                                  trainer.pt then holds the step, RNG and this folder's name
    samplers.pt                   each engine's sampler state: a resumed run continues its random stream

A checkpoint is written into a hidden temporary folder and renamed into place, then the
``latest`` file is replaced atomically to name it, so a crash at any moment leaves either the old
or the new checkpoint, never half of one. If ``latest`` names a folder that is gone (a crash
between the two renames), ``load_latest`` falls back to the newest complete checkpoint. A
``latest`` that names anything but a checkpoint folder directly inside the directory (``../x``, an
absolute path) is refused: no crash writes that, so it is tampering or a mistake, not a fallback case.

Resuming: build each policy from its BASE model exactly as a fresh run would (``prepare_policy``),
build its ``Trainer`` (which snapshots the KL reference from those base weights), then call
``restore``: it loads the trained weights and the trainer state into them. This module does not
decide when to checkpoint, and does not re-register the buffered episodes (``Registry.restore``).

The manifest names the MLflow run the run logs to (``mlflow``), so ``swarm run --resume`` continues
that run (``core.run.telemetry``); this module only stores the reference.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, Field, ValidationError
from safetensors.torch import load_file, save_model

from core.config_io import redacted
from core.records import Episode
from core.train import sharded_checkpoint
from core.train.trainer import Trainer

log = logging.getLogger(__name__)

# Bumped when the layout changes; a checkpoint of another format is refused rather than misread.
FORMAT = 1
LATEST = "latest"
STEP_PREFIX = "step-"
MANIFEST = "manifest.json"
EPISODES = "episodes.json"
FULL_WEIGHTS = "model.safetensors"
ADAPTER_DIR = "adapter"
TRAINER_STATE = "trainer.pt"
SAMPLERS = "samplers.pt"
# What `latest` may name: one checkpoint folder of this directory, never a path that leaves it.
LATEST_NAME = re.compile(re.escape(STEP_PREFIX) + r"[0-9]+")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, read or applied; the message names the file or model."""


class ModelEntry(BaseModel):
    lora: bool  # True: only the adapter was saved; the base weights come from the model source
    trainer_step: int  # the trainer's own step count at save time


class MlflowRun(BaseModel):
    run_id: str  # the MLflow run the checkpointed run logs to; a resume reopens it
    tracking_uri: str  # its store, with a sqlite path made absolute; another store at resume means a new run


class Manifest(BaseModel):
    format: int = FORMAT
    step: int  # run step at save time; a resumed run continues with step + 1
    versions: dict[str, int] = Field(default_factory=dict)  # model -> weight version served at save time
    config: dict[str, Any] = Field(default_factory=dict)  # the run config, for provenance and resume checks
    models: dict[str, ModelEntry] = Field(default_factory=dict)  # trained models whose weights are saved
    # None in checkpoints of runs without telemetry, and in those written before runs were recorded.
    mlflow: MlflowRun | None = None
    # Where each judged sandbox's deck stood (`core.sandbox.dealer`): a resume deals on from there.
    dealer: dict[str, dict[str, int]] = Field(default_factory=dict)


@dataclass
class Checkpoint:
    """A checkpoint read from disk; `restore` applies its weights and trainer state."""

    path: Path
    step: int
    versions: dict[str, int]
    config: dict[str, Any]
    models: dict[str, ModelEntry]
    buffered: list[list[Episode]]
    mlflow: MlflowRun | None = None
    samplers: dict[str, torch.Tensor] | None = None  # model -> engine sampler state; None: not saved
    dealer: dict[str, dict[str, int]] = field(default_factory=dict)  # the dealer's decks (`Dealer.state`)


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def save(directory: str | Path, step: int, trainers: dict[str, Trainer], buffered: list[list[Episode]],
         versions: dict[str, int], config: dict[str, Any], keep: int | None = None, mlflow: MlflowRun | None = None,
         samplers: dict[str, torch.Tensor] | None = None, dealer: dict[str, dict[str, int]] | None = None) -> Path:
    """Write a checkpoint atomically and point `latest` at it; returns its folder.

    `keep`: how many checkpoints to keep (oldest removed first); None keeps all.
    `mlflow`: the MLflow run the run logs to, for a resume to reopen.
    `samplers`: model -> its engine's sampler state (`WorkerEngine.sampler_state`); `dealer`: `Dealer.state`.
    """
    if step < 0:
        raise CheckpointError(f"step must be non-negative, got {step}")
    if keep is not None and keep < 1:
        raise CheckpointError(f"keep must be at least 1 (or None), got {keep}")
    manifest = Manifest(
        step=step,
        versions=dict(versions),
        config=redacted(config),  # provenance without credentials: a checkpoint may be shared
        models={name: ModelEntry(lora=t.lora, trainer_step=t.step_count) for name, t in trainers.items()},
        mlflow=mlflow,
        dealer=dealer or {},
    )
    try:
        manifest_text = manifest.model_dump_json(indent=2)
    except (TypeError, ValueError) as e:  # checked before anything touches the disk
        raise CheckpointError(f"run config is not JSON-serialisable: {e}") from e

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        for name, trainer in trainers.items():
            _save_model(tmp / "models" / name, trainer)
        episodes = [[e.model_dump(mode="json") for e in group] for group in buffered]
        (tmp / EPISODES).write_text(json.dumps(episodes))
        if samplers:
            torch.save(dict(samplers), tmp / SAMPLERS)
        # The manifest goes last: a folder with a manifest is complete.
        (tmp / MANIFEST).write_text(manifest_text)
        _fsync_tree(tmp)  # on disk before the rename makes it the checkpoint: a power cut cannot leave it half-written
        _move_into_place(tmp, final)
        _fsync(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _write_latest(root, final.name)
    if keep is not None:
        _prune(root, keep, final)
    log.info("checkpoint at step %d written to %s", step, final)
    return final


def _save_model(folder: Path, trainer: Trainer) -> None:
    remote = getattr(trainer, "remote_save", None)
    if remote is not None:  # a trainer in a Ray actor (`core.ray.actors`) writes its own files, same layout
        return remote(str(folder))
    save_trainer(folder, trainer)


def save_trainer(folder: Path, trainer: Trainer) -> None:
    """Write one trainer's weights (or adapter) and state into `folder` (a checkpoint's models/<name>)."""
    folder.mkdir(parents=True)
    if trainer.lora:
        trainer.policy.save_pretrained(str(folder / ADAPTER_DIR))
    elif not getattr(trainer, "keeps_module", True):  # an FSDP2 trainer whose replicas stream: from its shards
        trainer.save_weights(str(folder / FULL_WEIGHTS))
    else:
        save_model(trainer.policy, str(folder / FULL_WEIGHTS))
    sharded = getattr(trainer, "save_sharded", None) is not None  # fsdp2: each rank writes its own shards
    state = sharded_checkpoint.save_run(trainer, folder) if sharded else trainer.state_dict()
    torch.save(state, folder / TRAINER_STATE)


def _move_into_place(tmp: Path, final: Path) -> None:
    if not final.exists():
        tmp.rename(final)
        return
    # Same step saved again (e.g. periodic and shutdown checkpoints coincide): swap, then drop the old.
    old = final.with_name(f".old-{final.name}-{uuid.uuid4().hex[:8]}")
    final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def _write_latest(root: Path, name: str) -> None:
    tmp = root / f".{LATEST}-{uuid.uuid4().hex[:8]}"
    tmp.write_text(name + "\n")
    _fsync(tmp)
    os.replace(tmp, root / LATEST)
    _fsync(root)


def _fsync(path: Path) -> None:
    """Flush one file or folder (its entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    """Flush every file under `folder`, then each folder's entries, deepest first."""
    for sub, _, files in sorted(os.walk(folder), key=lambda w: -len(Path(w[0]).parts)):
        for f in files:
            _fsync(Path(sub) / f)
        _fsync(Path(sub))


def _complete(root: Path) -> list[Path]:
    """Complete checkpoint folders, oldest first."""
    found = [p for p in root.glob(f"{STEP_PREFIX}*") if p.is_dir() and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: p.name)


def _prune(root: Path, keep: int, just_written: Path) -> None:
    for old in _complete(root)[:-keep]:
        if old != just_written:
            shutil.rmtree(old, ignore_errors=True)


# -- reading -------------------------------------------------------------------------------------
def load_latest(directory: str | Path) -> Checkpoint | None:
    """The newest checkpoint under `directory`, or None when there is none."""
    root = Path(directory)
    if not root.is_dir():
        return None
    pointer = root / LATEST
    if pointer.is_file():
        name = pointer.read_text().strip()
        if not LATEST_NAME.fullmatch(name):
            raise CheckpointError(f"{pointer} names {name!r}, not a checkpoint folder of {root} "
                                  f"(expected {STEP_PREFIX}<step>); refusing to load it")
        named = root / name
        if (named / MANIFEST).is_file():
            return load(named)
        log.warning("%s names %s, which is missing or incomplete; using the newest complete checkpoint", pointer, named)
    complete = _complete(root)
    return load(complete[-1]) if complete else None


def load(path: str | Path) -> Checkpoint:
    """Read one checkpoint folder's manifest and buffered episodes (weights load in `restore`)."""
    folder = Path(path)
    if folder.is_symlink():  # a link could point a resume at any folder on the machine
        raise CheckpointError(f"{folder} is a symlink (to {os.readlink(folder)}); checkpoint folders must be real "
                              "folders of their directory; refusing to load it")
    manifest_file = folder / MANIFEST
    try:
        manifest = Manifest.model_validate_json(manifest_file.read_text())
    except (OSError, ValidationError) as e:
        raise CheckpointError(f"cannot read checkpoint manifest {manifest_file}: {e}") from e
    if manifest.format != FORMAT:
        raise CheckpointError(f"{manifest_file} has format {manifest.format}; this swarmrl reads format {FORMAT}")
    episodes_file = folder / EPISODES
    try:
        raw = json.loads(episodes_file.read_text())
        buffered = [[Episode.model_validate(e) for e in group] for group in raw]
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"cannot read buffered episodes {episodes_file}: {e}") from e
    samplers_file = folder / SAMPLERS
    try:
        samplers = torch.load(samplers_file, weights_only=True) if samplers_file.is_file() else None
    except Exception as e:  # torch raises many kinds on a damaged file
        raise CheckpointError(f"cannot read sampler states {samplers_file}: {e}") from e
    return Checkpoint(
        path=folder,
        step=manifest.step,
        versions=manifest.versions,
        config=manifest.config,
        models=manifest.models,
        buffered=buffered,
        mlflow=manifest.mlflow,
        samplers=samplers,
        dealer=manifest.dealer,
    )


def restore(ckpt: Checkpoint, trainers: dict[str, Trainer]) -> None:
    """Load saved weights and trainer state into freshly built trainers (see the module doc).

    Every file is read and checked before any trainer changes, so a bad checkpoint leaves the
    trainers as they were.
    """
    if set(trainers) != set(ckpt.models):
        raise CheckpointError(
            f"checkpoint {ckpt.path} holds models {sorted(ckpt.models)}, the run trains {sorted(trainers)}"
        )
    # A trainer in a Ray actor restores itself (the same checks, inside the actor) once the local ones
    # have all been read and checked.
    remote = {name: t for name, t in trainers.items() if getattr(t, "remote_restore", None) is not None}
    loaded = {name: _read_model(ckpt, name, t) for name, t in trainers.items() if name not in remote}
    for name, trainer in trainers.items():
        if name in remote:
            trainer.remote_restore(str(ckpt.path))
        else:
            _load_model(trainer, *loaded[name], name)
    log.info("restored %s from %s (step %d)", sorted(trainers), ckpt.path, ckpt.step)


def restore_samplers(ckpt: Checkpoint, engines: dict[str, Any]) -> None:
    """Put each engine's saved sampler state back; engines without a sampler, or not saved, start fresh."""
    for name, state in (ckpt.samplers or {}).items():
        engine = engines.get(name)
        if engine is not None and hasattr(engine, "restore_sampler"):
            engine.restore_sampler(state)


def samplers_of(engines: dict[str, Any]) -> dict[str, torch.Tensor]:
    """model -> its engine's sampler state, for `save` (engines without a sampler are left out)."""
    return {name: e.sampler_state() for name, e in engines.items() if hasattr(e, "sampler_state")}


def restore_one(ckpt: Checkpoint, name: str, trainer: Trainer) -> None:
    """Load one model's weights and state from `ckpt` (checked first): a restarted Ray actor restores itself."""
    if name not in ckpt.models:
        raise CheckpointError(f"checkpoint {ckpt.path} holds no model {name!r}")
    _load_model(trainer, *_read_model(ckpt, name, trainer), name)


def _read_model(ckpt: Checkpoint, name: str, trainer: Trainer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    entry = ckpt.models[name]
    if entry.lora != trainer.lora:
        raise CheckpointError(
            f"model {name!r} was saved with lora={entry.lora} but is now configured with lora={trainer.lora}"
        )
    folder = ckpt.path / "models" / name
    try:
        state = torch.load(folder / TRAINER_STATE, map_location="cpu", weights_only=True)
        state = sharded_checkpoint.resolve(state, folder, trainer)  # an fsdp2 run's: read from its DCP folder
        trainer.check_state(state)
        if entry.lora:
            from peft.utils import load_peft_weights  # peft loads only for LoRA runs

            weights = load_peft_weights(str(folder / ADAPTER_DIR))
            _check_adapter(trainer.policy, weights, name)
        else:
            weights = load_file(folder / FULL_WEIGHTS)
            _check_full_weights(trainer.policy, weights, name)
    except (OSError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"cannot read model {name!r} from {folder}: {e}") from e
    return weights, state


def _load_model(trainer: Trainer, weights: dict[str, torch.Tensor], state: dict[str, Any], name: str) -> None:
    if trainer.lora:
        _load_adapter(trainer.policy, weights, name)
    else:
        # strict=False only for tied weights, which are stored once and checked above.
        trainer.policy.load_state_dict(weights, strict=False)
    trainer.load_state_dict(state)


def _check_full_weights(policy: torch.nn.Module, weights: dict[str, torch.Tensor], name: str) -> None:
    """Every saved tensor fits the policy; every policy tensor is saved or tied to a saved one."""
    own = policy.state_dict()
    unexpected = sorted(k for k in weights if k not in own)
    wrong = sorted(k for k in weights if k in own and own[k].shape != weights[k].shape)
    saved_storage = {own[k].untyped_storage().data_ptr() for k in weights if k in own}
    missing = sorted(k for k in own if k not in weights and own[k].untyped_storage().data_ptr() not in saved_storage)
    if unexpected or wrong or missing:
        raise CheckpointError(
            f"weights of {name!r} do not fit the model: unexpected {unexpected[:5]}, "
            f"wrong shape {wrong[:5]}, missing {missing[:5]}"
        )


def _check_adapter(policy: torch.nn.Module, adapter: dict[str, torch.Tensor], name: str) -> None:
    """The saved adapter has exactly the policy's adapter tensors, with the same shapes (same r, targets)."""
    from peft import get_peft_model_state_dict

    own = get_peft_model_state_dict(policy)
    if set(own) != set(adapter) or any(own[k].shape != adapter[k].shape for k in own):
        differ = sorted(set(own) ^ set(adapter)) or sorted(k for k in own if own[k].shape != adapter[k].shape)
        raise CheckpointError(
            f"saved adapter of {name!r} does not fit the policy's LoRA config (rank or target modules changed?): "
            f"differs at {differ[:5]}"
        )


def _load_adapter(policy: torch.nn.Module, adapter: dict[str, torch.Tensor], name: str) -> None:
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(policy, adapter)
    if result.unexpected_keys:
        raise CheckpointError(f"adapter of {name!r} does not fit the policy: unexpected {result.unexpected_keys[:5]}")

