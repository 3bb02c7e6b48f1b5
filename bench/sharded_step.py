"""The FSDP2 trainer against one rank and against 2 replicated ranks, on the same batch, side by side.

    .venv/bin/python bench/sharded_step.py                       (the tiny model, 2 gloo ranks on CPU)
    .venv/bin/python bench/sharded_step.py --model smollm2-135m  (a real model's shapes)
    python bench/sharded_step.py --device cuda                   (ranks on cuda:0 and cuda:1, NCCL; >= 2 GPUs)

First one backward of the batch (bench/replicas.py's merged multi-turn episodes) by one `Trainer` and
by a 2-rank `ShardedTrainer`: the largest gap between the gradient gathered from the shards and the
single rank's, relative to the gradient's largest element (the check that the reduce-scatter sums
over one normaliser, on the device's own collectives). Then seconds per step (median of the steps
after a warm-up) at 1 rank, 2 fsdp2 ranks and 2 replicated ranks, and on GPUs rank 0's peak memory
(its shard plus the full copy engines read). On a 2-core CPU both ranks share the cores, so the
times there say what the collectives cost, not what 2 GPUs give. The last line is

    sharded: grad_rel_diff=<x> step_s_1=<a> step_s_fsdp2_2=<b> step_s_replicate_2=<c> peak_gib_rank0=<d>
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.replicas import batch, step_time  # noqa: E402
from core import models  # noqa: E402
from core.config_io import load_config  # noqa: E402
from core.train.distributed import DistributedTrainer  # noqa: E402
from core.train.sharded import ShardedTrainer  # noqa: E402
from core.train.trainer import Trainer, seed_everything  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--groups", type=int, default=2)
    args = ap.parse_args()
    seed_everything(0)
    cfg = load_config({"models": [{"source": args.model, "device": args.device}],
                       "trainer": {"max_staleness": 0, "micro_batch_tokens": 1024, "lr": 1e-5}})
    mc = cfg.models[0]
    model, tok = models.load(mc)
    devices = ["cpu", "cpu"] if args.device == "cpu" else ["cuda:0", "cuda:1"]
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        sys.exit(f"--device cuda needs 2 GPUs (NCCL refuses two ranks on one); this machine has {torch.cuda.device_count()}")
    print(f"# bench/sharded_step.py: model {args.model} on {args.device}, torch {torch.__version__}", flush=True)
    groups = batch(model, tok, args.groups, 4, 3)

    single = Trainer(copy.deepcopy(model), cfg.trainer, "policy", lora=False)
    prepared = single.prepare(groups)
    single.backward(prepared)
    want = {n: p.grad.clone() for n, p in single.policy.named_parameters() if p.grad is not None}
    single.discard()
    t1 = step_time(single, groups)
    print(f"# 1 rank: {t1:.3f} s a step", flush=True)

    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats(devices[0])
    fsdp = ShardedTrainer(copy.deepcopy(model).to(devices[0]), cfg.trainer, mc, devices)
    try:
        prepared = fsdp.prepare(groups)
        fsdp.backward(prepared)
        got = fsdp.gradients()
        fsdp.discard()
        scale = max(g.abs().max().item() for g in want.values())
        gap = max((got[n].to(want[n].device) - want[n]).abs().max().item() for n in want) / scale
        print(f"# fsdp2 gradient vs 1 rank: largest gap {gap:.2e} of the largest element", flush=True)
        t_fsdp = step_time(fsdp, groups)
        peak = torch.cuda.max_memory_allocated(devices[0]) / 2**30 if args.device == "cuda" else float("nan")
    finally:
        fsdp.close()
    print(f"# 2 fsdp2 ranks: {t_fsdp:.3f} s a step", flush=True)
    dp = DistributedTrainer(copy.deepcopy(model).to(devices[0]), cfg.trainer, mc, devices)
    try:
        t_dp = step_time(dp, groups)
    finally:
        dp.close()

    print("| what | 1 rank | 2 fsdp2 ranks | 2 replicated ranks |")
    print("| --- | --- | --- | --- |")
    print(f"| trainer step, s | {t1:.3f} | {t_fsdp:.3f} | {t_dp:.3f} |")
    print(f"| gradient gap to 1 rank (of the largest element) | | {gap:.2e} | |")
    print(f"sharded: grad_rel_diff={gap:.2e} step_s_1={t1:.3f} step_s_fsdp2_2={t_fsdp:.3f} "
          f"step_s_replicate_2={t_dp:.3f} peak_gib_rank0={peak:.2f}")


if __name__ == "__main__":
    main()
