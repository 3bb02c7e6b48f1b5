"""The FSDP2 checks of the GPU script (issue 41 item 8): a sharded run's DCP checkpoint resumed at
another world size, and a replica sync streamed from the shards. One line per check
(`check <name>: ok|FAIL|skipped ...`), then `fsdp2_check: stream_peak_mib=.. model_mib=.. peak_gib_rank0=..`
(rank 0 is this process, on cuda:0; rank 1 and the replica are other processes, unseen here).

    python bench/fsdp2_check.py                   (on the lent GPU image; bench/gpu_check.sh runs it)
    .venv/bin/python bench/fsdp2_check.py --device cpu   (the dry run: 2 gloo ranks, a CPU replica)

Checks:
- fsdp2_resume: a 2-rank `ShardedTrainer` (NCCL on cuda:0/1, gloo on CPU), KL on (a sharded
  reference), the tiny model, 2 steps, then `save_sharded` (DCP, each rank its own shards); the
  checkpoint loads into one plain `Trainer` (world size 1) and into 2 fresh fsdp2 ranks, each with
  weights equal, bit for bit, to the ones the run trained;
- fsdp2_stream: 2 fsdp2 ranks and 1 hf replica process (cuda:1 on GPUs, with the sync on NCCL from
  cuda:0; a CPU process on CPU) whose syncs stream from the shards (`ShardedTrainer.stream_to`,
  `core.engine.replica_sync`): after a step the replica's digest equals the weights gathered from
  the shards, and rank 0's peak extra memory during the sync (`stream_peak_mib`) stays below the
  model's size. On GPUs that is the allocator's peak on cuda:0 over the sync, for a random
  SmolLM2-360M-shaped fp32 model (~1.4 GiB, well above the sync's two 256 MiB buckets plus one
  whole weight); on CPU, where the allocator is not measured, the most bytes of whole weights
  (`DTensor.full_tensor` results) alive at once on rank 0, for the tiny model;
- vllm_replicas: skipped unless `import vllm` works. The GPU image has no vLLM, and bench/replicas.py
  has no vLLM mode yet (its replicas are hf processes), so even with vLLM present this says skipped
  and why; 2 vLLM replicas with a sync and a version check are not built into the script.
- colocated: `layout: colocated`, 2 fsdp2 ranks and 2 hf replicas on the ranks' GPUs (cuda:0, cuda:1),
  the tiny model, 3 steps as the run loop drives them (hold, drain, `sleep_during_step`, step,
  `wake_after_step`, a streamed sync): both replicas asleep during each step, awake after, each at
  the new version with the shards' digest. On CPU no replica sleeps (nothing to give back): the
  dry run checks the sequence, the syncs and the versions.
FSDP2 over NCCL needs 2 GPUs (NCCL refuses two ranks on one): with fewer these checks skip.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
import tempfile
import time
import traceback
import weakref
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.replicas import batch  # noqa: E402
from core import models  # noqa: E402
from core.config_io import load_config  # noqa: E402
from core.engine.replicas import process_replicas  # noqa: E402
from core.engine.weight_sync import weights_digest  # noqa: E402
from core.train import sharded_checkpoint  # noqa: E402
from core.train.sharded import ShardedTrainer  # noqa: E402
from core.train.trainer import Trainer, seed_everything  # noqa: E402

try:  # only whether it imports: absent (the GPU image) or broken, either way no vLLM here
    import vllm  # noqa: F401
    HAS_VLLM = True
except Exception:  # noqa: BLE001
    HAS_VLLM = False

MIB = 2**20
STEPS = 2
COLOCATED_STEPS = 3
RANK0_PEAKS: list[int] = []  # rank 0's (this process's) allocator peaks on cuda:0 before each reset
# SmolLM2-360M's shape: fp32 ~1.4 GiB, so two 256 MiB sync buckets and its largest weight fit under it.
SHAPE_360M = {"hidden_size": 960, "intermediate_size": 2560, "num_hidden_layers": 32, "num_attention_heads": 15,
              "num_key_value_heads": 5, "vocab_size": 49152, "tie_word_embeddings": True}


def report(name: str, ok: bool | None, detail: str = "") -> None:
    state = "skipped" if ok is None else ("ok" if ok else "FAIL")
    print(f"check {name}: {state} {detail}".rstrip(), flush=True)


def run_config(source: str, device: str, replicas: int = 1, **model):
    return load_config({"models": [{"source": source, "device": device, "dtype": "float32", "replicas": replicas,
                                    **model}],
                        "trainer": {"max_staleness": 0, "micro_batch_tokens": 1024, "lr": 1e-5, "kl_coef": 0.01}})


def _equal(module: torch.nn.Module, want: dict[str, torch.Tensor]) -> list[str]:
    """The names whose weights differ from `want` (bit for bit)."""
    return [n for n, p in module.named_parameters() if not torch.equal(p.detach().cpu(), want[n])]


def check_resume(devices: list[str], folder: Path) -> None:
    cfg = run_config("tiny", devices[0])
    mc = cfg.models[0]
    seed_everything(0)
    base, tok = models.load(mc)
    groups = batch(base, tok, 2, 2, 2)
    path = str(folder / "dcp")
    fsdp = ShardedTrainer(copy.deepcopy(base), cfg.trainer, mc, devices)
    try:
        updated = [fsdp.step(groups)["train/updated"] for _ in range(STEPS)]
        fsdp.save_sharded(path)
        trained = {n: p.detach().cpu().clone() for n, p in fsdp.policy.named_parameters()}
    finally:
        fsdp.close()
    moved = any(not torch.equal(p.detach().cpu(), trained[n]) for n, p in base.named_parameters())
    one = Trainer(copy.deepcopy(base), cfg.trainer, mc.name, lora=False)
    sharded_checkpoint.load(one, path)
    off_one = _equal(one.policy, trained)
    again = ShardedTrainer(copy.deepcopy(base), cfg.trainer, mc, devices)
    try:
        again.load_sharded(path)
        off_two = _equal(again.policy, trained)
        after = again.step(groups)["train/updated"]  # the resumed ranks train on
    finally:
        again.close()
    files = sorted(p.name for p in Path(path).iterdir())
    ok = updated == [1.0] * STEPS and moved and not off_one and not off_two and after == 1.0
    report("fsdp2_resume", ok, f"{STEPS} steps on {'+'.join(devices)} with KL, DCP {files}; resumed at world "
                               f"size 1: {len(off_one)} weights differ, at 2: {len(off_two)} (then a step: "
                               f"updated={after})")


class WholeWeights:
    """The most bytes of whole weights (`DTensor.full_tensor` results) alive at once in this process."""

    def __init__(self):
        self.now = self.peak = 0
        self.gather = DTensor.full_tensor

    def __enter__(self) -> WholeWeights:
        gather, counter = self.gather, self

        def counted(tensor, *args, **kwargs):
            whole = gather(tensor, *args, **kwargs)
            size = whole.numel() * whole.element_size()
            counter.now += size
            counter.peak = max(counter.peak, counter.now)
            weakref.finalize(whole, lambda: setattr(counter, "now", counter.now - size))
            return whole
        DTensor.full_tensor = counted
        return self

    def __exit__(self, *exc) -> None:
        DTensor.full_tensor = self.gather


def model_folder(folder: Path, on_gpu: bool) -> Path:
    """A HF folder the ranks and the replica load: tiny on CPU, SmolLM2-360M-shaped (random) on GPUs."""
    torch.manual_seed(0)
    model, tok = models.build_tiny(0)
    if on_gpu:
        model = LlamaForCausalLM(LlamaConfig(**SHAPE_360M))
    out = folder / "model"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _gathered(trainer: ShardedTrainer) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    trainer.stream_weights(lambda weights: out.update({n: t.full_tensor().cpu() for n, t in weights.items()}))
    return out


@contextlib.contextmanager
def streamed(cfg, devices: list[str]):
    """(model, a batch of groups, its replicas' engine, an FSDP2 trainer streaming their syncs) for the
    run config `cfg`'s one model; the replicas and ranks closed after."""
    mc = cfg.models[0]
    model, tok = models.load(mc)
    groups = batch(model, tok, 2, 2, 2)
    engine = process_replicas(cfg, mc, model, 256)
    trainer = None
    try:
        trainer = ShardedTrainer(model, cfg.trainer, mc, devices)
        trainer.stream_to(engine)
        yield model, groups, engine, trainer
    finally:
        engine.close()
        if trainer is not None:
            trainer.close()


def check_stream(devices: list[str], folder: Path) -> tuple[float, float]:
    on_gpu = devices[0].startswith("cuda")
    cfg = run_config(str(model_folder(folder, on_gpu)), devices[0])
    with streamed(cfg, devices) as (model, groups, engine, trainer):
        model_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / MIB  # tied weights once
        dropped = not trainer.keeps_module and all(p.is_meta for p in trainer.policy.parameters())
        engine.hold()
        engine.pause_blocking()
        updated = trainer.step(groups)["train/updated"]
        if on_gpu:
            torch.cuda.synchronize(devices[0])
            RANK0_PEAKS.append(torch.cuda.max_memory_allocated(devices[0]))  # the steps' peak, before the reset
            torch.cuda.reset_peak_memory_stats(devices[0])
            before = torch.cuda.memory_allocated(devices[0])
        started = time.perf_counter()
        with WholeWeights() as whole:
            engine.resume(engine.version + 1)
        sync_s = time.perf_counter() - started
        peak_mib = ((torch.cuda.max_memory_allocated(devices[0]) - before) if on_gpu else whole.peak) / MIB
        digest = weights_digest(_gathered(trainer).items())
        got = [r.weights_digest() for r in engine.replicas]
        versions = [row["version"] for row in engine.status()]
        ok = dropped and updated == 1.0 and got == [digest] and versions == [engine.version] and peak_mib < model_mib
        what = "allocator peak on " + devices[0] if on_gpu else "whole weights alive at once on rank 0"
        report("fsdp2_stream", ok, f"replica on {engine.status()[0].get('device', '?')} at version {versions}, digest "
                                   f"{'equal' if got == [digest] else 'DIFFERS'}; rank 0 module dropped: {dropped}; "
                                   f"stream_peak_mib={peak_mib:.1f} ({what}) < model {model_mib:.1f} MiB; "
                                   f"{sync_s:.3f} s")
        return peak_mib, model_mib


def check_colocated(devices: list[str]) -> None:
    cfg = run_config("tiny", devices[0], 2, layout="colocated", trainer={"world_size": 2, "sharding": "fsdp2"})
    with streamed(cfg, devices) as (_, groups, engine, trainer):
        slept, equal, updated = [], [], []
        for _ in range(COLOCATED_STEPS):
            engine.hold()
            engine.pause_blocking()
            slept.append(engine.sleep_during_step())
            updated.append(trainer.step(groups)["train/updated"])
            engine.wake_after_step()
            engine.resume(engine.version + 1)
            digest = weights_digest(_gathered(trainer).items())
            equal.append([r.weights_digest() for r in engine.replicas] == [digest] * 2)
        rows = engine.status()
        devices_of = [row.get("device", "?") for row in rows]
        ok = (all(equal) and updated == [1.0] * COLOCATED_STEPS and slept == [len(engine.sleepers)] * COLOCATED_STEPS
              and [r["version"] for r in rows] == [COLOCATED_STEPS] * 2 and not any(r["asleep"] for r in rows))
        versions = [r["version"] for r in rows]
        report("colocated", ok, f"{COLOCATED_STEPS} steps, 2 fsdp2 ranks on {'+'.join(devices)}, replicas on "
                                f"{devices_of}: asleep during each step {slept} (sleepers {list(engine.sleepers)}; "
                                f"none on CPU), digests equal after each: {equal}, versions {versions}")


def check_vllm() -> None:
    if not HAS_VLLM:
        report("vllm_replicas", None, "(vLLM is not on the GPU image)")
    else:
        report("vllm_replicas", None, "(vLLM imports, but bench/replicas.py has no vLLM mode yet: see this docstring)")


def guarded(name: str, check, *args):
    """Run one check; an exception is its FAIL line (the others still run)."""
    try:
        return check(*args)
    except Exception as e:  # noqa: BLE001 - a check's failure is a line, not the end of the script
        traceback.print_exc()
        report(name, False, f"{type(e).__name__}: {str(e)[:200]}")
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    args = ap.parse_args()
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    print(f"# bench/fsdp2_check.py on {args.device} ({gpus} GPUs), torch {torch.__version__}", flush=True)
    stream = None
    if args.device == "cuda" and gpus < 2:
        for name in ("fsdp2_resume", "fsdp2_stream", "colocated"):
            report(name, None, f"(FSDP2 on NCCL needs 2 GPUs, this device has {gpus})")
    else:
        devices = ["cpu", "cpu"] if args.device == "cpu" else ["cuda:0", "cuda:1"]
        with tempfile.TemporaryDirectory(prefix="fsdp2_check_") as tmp:
            guarded("fsdp2_resume", check_resume, devices, Path(tmp))
            stream = guarded("fsdp2_stream", check_stream, devices, Path(tmp))
        guarded("colocated", check_colocated, devices)
    check_vllm()
    peak_mib, model_mib = stream if stream else (float("nan"), float("nan"))
    peaks = f"peak_gib_rank0={max([*RANK0_PEAKS, torch.cuda.max_memory_allocated(0)]) / 2**30:.2f}" if gpus else ""
    print(f"fsdp2_check: stream_peak_mib={peak_mib:.1f} model_mib={model_mib:.1f} {peaks}".rstrip())


if __name__ == "__main__":
    main()
