"""The checks of issue 41 that need CUDA: one device per process, the NCCL weight sync, a hung replica
on NCCL, and a colocated trainer's offload. One line per check (`check <name>: ok|FAIL|skipped ...`),
then `many_devices: sync_s=.. sync_peak_mib=.. offload_freed_mib=.. peak_gib_gpu0=.. peak_gib_gpu1=..`.

    python bench/many_devices.py                (on the lent GPU image; bench/gpu_check.sh runs it)
    python bench/many_devices.py --device cpu   (the CPU dry run: the pinning and offload checks skip)

Checks:
- pinned: a replica process for cuda:1 sees one GPU, as cuda:0, and it is the run's GPU 1 (by UUID);
- nccl_sync: a `ProcessEngine` (hf, tiny model) on cuda:1 synced from weights on cuda:0 over NCCL: the
  replica's digest equals the sender's, it serves the new version, and the sender's GPU held at most
  two buckets' buffers more than before the sync (`core.engine.weight_sync._Slots`);
- hung_nccl: that replica stopped (SIGSTOP) once it has the weights: killed at the sync's deadline,
  the run process alive, a fresh replica takes a sync;
- offload: a SmolLM2-shaped bf16 trainer with `trainer.offload` frees its GPU memory between steps
  and steps as one without it (`core.train.offload`).
Needs 2 GPUs for the first three; with one they are skipped and say so.
"""

from __future__ import annotations

import argparse
import copy
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from core import models  # noqa: E402
from core.config import EngineConfig, ModelConfig, TrainerConfig  # noqa: E402
from core.engine import process  # noqa: E402
from core.engine.devices import spawn_pinned  # noqa: E402
from core.engine.process import ProcessEngine, ReplicaSpec  # noqa: E402
from core.engine.weight_sync import BUCKET_BYTES, weights_digest, weights_of  # noqa: E402
from core.models import build_tiny  # noqa: E402
from core.train.offload import install  # noqa: E402
from core.train.trainer import Trainer  # noqa: E402

MIB = 2**20
HUNG_SYNC_S = 20.0  # the sync deadline in the hang check: far above a tiny model's sync, far below 300 s
SLACK_MIB = 64  # the sync's own small tensors (digests, events) beside its two bucket buffers


def report(name: str, ok: bool | None, detail: str = "") -> None:
    state = "skipped" if ok is None else ("ok" if ok else "FAIL")
    print(f"check {name}: {state} {detail}".rstrip(), flush=True)


def _uuid(conn) -> None:
    props = torch.cuda.get_device_properties(0)
    conn.send((torch.cuda.device_count(), str(props.uuid), os.environ.get("CUDA_VISIBLE_DEVICES")))


def check_pinned() -> None:
    import multiprocessing
    here, there = multiprocessing.get_context("spawn").Pipe()
    proc = spawn_pinned("cuda:1", _uuid, (there,), "pinned-check")
    count, uuid, visible = here.recv()
    proc.join(60)
    want = str(torch.cuda.get_device_properties(1).uuid)
    report("pinned", count == 1 and uuid == want, f"sees {count} GPU(s), CUDA_VISIBLE_DEVICES={visible}")


def replica(device: str, index: int, lost: list[str] | None = None) -> ProcessEngine:
    """A replica process (hf, tiny model) on `device`, its weights group hosted from cuda:0; `lost`
    collects why it was taken out of service."""
    mc = ModelConfig(device=device)
    spec = ReplicaSpec(index=index, model=mc.model_dump(), engine=EngineConfig(kind="hf").model_dump(),
                       max_context=256, seed=index)
    return ProcessEngine(spec, 600.0, lambda r, why: (lost if lost is not None else []).append(why), "cuda:0")


def check_nccl_sync() -> float:
    model, _ = models.load(ModelConfig(device="cuda:0"))
    r = replica("cuda:1", 0)
    try:
        r.sync(weights_of(model), 0)  # the layout goes first; the group warms up
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.99)
        torch.cuda.synchronize(0)
        torch.cuda.reset_peak_memory_stats(0)
        before = torch.cuda.memory_allocated(0)
        started = time.perf_counter()
        served = r.sync(weights_of(model), 1)
        sync_s = time.perf_counter() - started
        extra_mib = (torch.cuda.max_memory_allocated(0) - before) / MIB
        same = r.weights_digest() == weights_digest(weights_of(model).items())
        bound = 2 * BUCKET_BYTES / MIB + SLACK_MIB
        report("nccl_sync", same and served == 1 and extra_mib <= bound,
               f"version {served}, digest {'equal' if same else 'DIFFERS'}, {sync_s:.3f} s, "
               f"{extra_mib:.0f} MiB extra on cuda:0 (bound {bound:.0f})")
        print(f"# sync_peak_mib={extra_mib:.0f}")
        return sync_s
    finally:
        r.close()


def check_hung_nccl() -> None:
    model, _ = models.load(ModelConfig(device="cuda:0"))
    lost: list[str] = []
    r = replica("cuda:1", 1, lost)
    r.sync(weights_of(model), 0)
    process.SYNC_S, saved = HUNG_SYNC_S, process.SYNC_S
    transfer = r._transfer

    def transfer_then_hang(*args):
        transfer(*args)
        os.kill(r.pid, signal.SIGSTOP)
    r._transfer = transfer_then_hang
    try:
        started = time.perf_counter()
        try:
            r.sync(weights_of(model), 1)
            outcome = "answered"
        except process.ReplicaLost as e:
            outcome = f"lost: {e}"
        waited = time.perf_counter() - started
    finally:
        process.SYNC_S = saved
    fresh = replica("cuda:1", 2)
    try:
        served = fresh.sync(weights_of(model), 1)
    finally:
        fresh.close()
    report("hung_nccl", bool(lost) and outcome.startswith("lost") and served == 1,
           f"{outcome[:80]} after {waited:.1f} s; a fresh replica took version {served}")


def _step(trainer: Trainer, batch) -> None:
    prepared = trainer.prepare(batch)
    trainer.backward(prepared)
    trainer.apply(prepared)


def _allocated(device: str) -> int:
    if not device.startswith("cuda"):
        return 0
    torch.cuda.synchronize(0)
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(0)


def check_offload(device: str, small: bool) -> float:
    """A resident trainer and an offloaded one, one step each from the same weights: the offloaded one
    holds (almost) nothing on the GPU between steps, and its step equals the resident one's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.replicas import batch as episodes  # multi-turn episodes with on-policy logprobs
    shape = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)
    torch.manual_seed(0)
    base = (build_tiny(0)[0] if small else LlamaForCausalLM(LlamaConfig(**shape))).to(device, torch.bfloat16)
    cfg = TrainerConfig(lr=1e-5, share_prompt=False, kl_coef=0.01)
    tiny, tok = build_tiny(0)
    batch = episodes(tiny, tok, 2, 4, 2)  # the batch's logprobs from the tiny model: off-policy here, fine for a step
    empty = _allocated(device)
    plain = Trainer(copy.deepcopy(base), cfg, "policy", lora=False)
    _step(plain, batch)
    resident = _allocated(device) - empty  # a resident trainer's state between steps (and the base)
    offloaded = Trainer(copy.deepcopy(base), cfg, "policy", lora=False)
    install(offloaded, device)
    del base
    before = _allocated(device)
    _step(offloaded, batch)
    held = _allocated(device) - before
    same = all(torch.allclose(p.float().cpu(), q.float().cpu(), rtol=1e-2, atol=1e-3)  # bf16's rounding
               for p, q in zip(plain.policy.parameters(), offloaded.policy.parameters()))
    ok = same and held <= SLACK_MIB * MIB
    report("offload", ok, f"{held / MIB:.0f} MiB held on {device} between steps (a resident trainer: "
                          f"{resident / MIB:.0f} MiB); the step {'equals' if same else 'DIFFERS FROM'} a resident one's")
    return resident / MIB


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    gpus = torch.cuda.device_count() if args.device.startswith("cuda") else 0
    sync_s = float("nan")
    if gpus >= 2:
        check_pinned()
        sync_s = check_nccl_sync()
        check_hung_nccl()
    else:
        for name in ("pinned", "nccl_sync", "hung_nccl"):
            report(name, None, f"needs 2 GPUs, this device has {gpus}")
    freed = check_offload("cuda:0" if gpus else "cpu", small=gpus == 0)  # on cpu: the wiring, nothing moves
    peaks = " ".join(f"peak_gib_gpu{i}={torch.cuda.max_memory_allocated(i) / 2**30:.2f}" for i in range(gpus))
    print(f"many_devices: sync_s={sync_s:.4f} offload_freed_mib={freed:.0f} {peaks}".rstrip())


if __name__ == "__main__":
    main()
