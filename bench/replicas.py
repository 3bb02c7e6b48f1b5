"""One model on many devices: rollout throughput at 1 and 2 replicas, trainer step time at 1 and 2
ranks, and the time a weight sync takes, side by side in one invocation.

    .venv/bin/python bench/replicas.py                       (the tiny model on CPU: ~2 min quiet, 15+ loaded)
    .venv/bin/python bench/replicas.py --model smollm2-135m  (a real model's shapes)
    python bench/replicas.py --device cuda                   (replicas on cuda:0/1, ranks on NCCL; >= 2 GPUs)
    .venv/bin/python bench/replicas.py --model smollm2-135m --sync-only [--lora]   (the sync alone)

Rollout: the same number of concurrent single-call episodes (each its own pin) against a
`ReplicaEngine` of 1 replica process and of 2, alternating (`--repeats` rounds, medians),
completions per second over the same count of completions. Train: the same batch of merged episodes stepped by one `Trainer` and by a
2-rank `DistributedTrainer` (gloo on CPU, NCCL on GPUs), seconds per step, median of the steps
after a warm-up. Sync: the router's `last_sync_s` over a few pushes of changed weights to 2 replicas
(the broadcast over each replica's group, core.engine.weight_sync: gloo on CPU), and the bytes a push
sends to each replica (every weight, or with `--lora` the adapters alone).

On a 2-core CPU, 2 replicas and 2 ranks share the 2 cores with each other (and with the router
and the data the ranks exchange), so the scaling is bounded by the cores, not by the design: read
it as an upper bound on overhead, not as what 2 GPUs give. The last line is

    replicas: rollout_scaling_2=<x> train_scaling_2=<y> sync_s=<z>
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core import models  # noqa: E402
from core.config import ModelConfig  # noqa: E402
from core.config_io import load_config
from core.engine import SamplingParams  # noqa: E402
from core.engine.replicas import process_replicas  # noqa: E402
from core.engine.routing import EPISODE  # noqa: E402
from core.engine.weight_sync import weights_of  # noqa: E402
from core.records import Call, Episode  # noqa: E402
from core.train.distributed import DistributedTrainer  # noqa: E402
from core.train.trainer import Trainer, seed_everything  # noqa: E402

SYNCS = 5  # weight pushes timed for sync_s
TRAIN_STEPS = 4  # timed steps after one warm-up step


def rollout_rate(cfg, mc, model, tok, replicas: int, completions: int, concurrency: int, max_tokens: int,
                 threads: int | None) -> float:
    engine = process_replicas(cfg, mc.model_copy(update={"replicas": replicas}), model, 512, threads)
    prompt = tok.encode("count the letters", add_special_tokens=False)
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0)
    done = 0

    async def episode(i: int) -> None:
        nonlocal done
        EPISODE.set(f"bench-{replicas}-{i}")
        await engine.generate(prompt, params)
        done += 1

    async def main() -> float:
        await asyncio.gather(*(episode(-1 - i) for i in range(concurrency)))  # warm-up: every replica's first batch
        started = time.perf_counter()
        sem = asyncio.Semaphore(concurrency)

        async def bounded(i: int) -> None:
            async with sem:
                await episode(i)

        await asyncio.gather(*(bounded(i) for i in range(completions)))
        return completions / (time.perf_counter() - started)

    try:
        return asyncio.run(main())
    finally:
        engine.close()


def sync_seconds(cfg, mc, model) -> tuple[float, int]:
    """Median seconds of a sync to 2 replicas, and the bytes each replica receives in one."""
    engine = process_replicas(cfg, mc.model_copy(update={"replicas": 2}), model, 512)
    try:
        times = []
        for v in range(1, SYNCS + 1):
            with torch.no_grad():
                for t in weights_of(model).values():
                    t.add_(1e-4)
            engine.resume(v)
            times.append(engine.last_sync_s)
        return statistics.median(times), sum(t.numel() * t.element_size() for t in weights_of(model).values())
    finally:
        engine.close()


def batch(model, tok, groups: int, size: int, turns: int) -> list[list[Episode]]:
    """Multi-turn episodes with random completions and on-policy logprobs, rewards varied per group."""
    g = torch.Generator().manual_seed(0)
    out = []
    device = next(model.parameters()).device
    for gi in range(groups):
        group = []
        for ei in range(size):
            context, calls = tok.encode(f"task {gi}", add_special_tokens=False), []
            for _ in range(turns):
                completion = torch.randint(3, min(len(tok), 250), (24,), generator=g).tolist()
                with torch.no_grad():
                    logits = model(input_ids=torch.tensor([context + completion], device=device)).logits[0].float()
                logp = torch.log_softmax(logits, -1)
                lps = [logp[len(context) + i - 1, t].item() for i, t in enumerate(completion)]
                calls.append(Call(model="policy", version=0, prompt_ids=list(context), completion_ids=completion,
                                  completion_logprobs=lps))
                context = context + completion + tok.encode(" more", add_special_tokens=False)
            group.append(Episode(id=f"g{gi}e{ei}", sandbox="bench", task_id=f"t{gi}", group_size=size,
                                 state="finished", calls=calls, reward={"policy": float(ei)}, opened_at=0.0,
                                 lease_expires_at=0.0))
        out.append(group)
    return out


def step_time(trainer: Trainer, groups) -> float:
    trainer.step(groups)  # warm-up
    times = []
    for _ in range(TRAIN_STEPS):
        started = time.perf_counter()
        trainer.step(groups)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--completions", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="alternating rounds of 1 and 2 replicas (medians)")
    # 0: as a run does, the cores split between the CPU replicas (1 replica: all of them). 1: one core a
    # replica, "one device each". On an oversubscribed machine a replica with 2 OpenMP threads is ~30x
    # slower than with 1 (its threads wait for each other at every op), which is what 0 shows there.
    ap.add_argument("--threads", type=int, default=0, help="torch threads per CPU replica (0: split the cores)")
    ap.add_argument("--sync-only", action="store_true", help="time the weight sync alone (a real model's size "
                    "in minutes on a 2-core CPU, where the rollout and train parts take far longer)")
    ap.add_argument("--lora", action="store_true", help="LoRA r=16 on the model: the sync sends the adapters")
    args = ap.parse_args()
    if args.lora and not args.sync_only:
        ap.error("--lora goes with --sync-only (the rollout and train parts compare full fine-tunes)")
    seed_everything(0)
    lora = {"lora": {"r": 16, "alpha": 32}} if args.lora else {}
    cfg = load_config({"models": [{"source": args.model, "device": args.device, **lora}],
                       "trainer": {"max_staleness": 0, "micro_batch_tokens": 1024, "lr": 1e-5}})
    mc: ModelConfig = cfg.models[0]
    model, tok = models.load(mc)
    if mc.lora is not None:
        model = models.prepare_policy(model, mc.lora)
    print(f"# bench/replicas.py: model {args.model} on {args.device}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads here, replica threads {args.threads or 'split'}", flush=True)

    if args.sync_only:
        sync_s, size = sync_seconds(cfg, mc, model)
        print("| what | 2 replicas |")
        print("| --- | --- |")
        print(f"| weight sync, s (median of {SYNCS}; {size / 1e6:.1f} MB to each replica) | {sync_s:.4f} |")
        print(f"replicas: sync_s={sync_s:.4f} sync_mb={size / 1e6:.1f}")
        return
    runs: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(args.repeats):  # 1 and 2 alternate, so a change in the machine's load hits both alike
        for n in (1, 2):
            runs[n].append(rollout_rate(cfg, mc, model, tok, n, args.completions, args.concurrency, args.max_tokens,
                                        args.threads or None))
            print(f"# rollout, {n} replica(s): {runs[n][-1]:.1f} completions/s", flush=True)
    rates = {n: statistics.median(r) for n, r in runs.items()}
    sync_s, size = sync_seconds(cfg, mc, model)
    print(f"# sync to 2 replicas: {sync_s:.4f} s, {size / 1e6:.1f} MB to each", flush=True)
    groups = batch(model, tok, args.groups, 4, 3)
    single = Trainer(copy.deepcopy(model), cfg.trainer, "policy", lora=False)
    t1 = step_time(single, groups)
    print(f"# train, 1 rank: {t1:.3f} s a step", flush=True)
    devices = ["cpu", "cpu"] if args.device == "cpu" else ["cuda:0", "cuda:1"]
    dp = DistributedTrainer(copy.deepcopy(model).to(devices[0]), cfg.trainer, mc, devices)
    try:
        t2 = step_time(dp, groups)
    finally:
        dp.close()

    print("| what | 1 | 2 | scaling |")
    print("| --- | --- | --- | --- |")
    print(f"| rollout completions/s (replicas; median of {args.repeats}) | {rates[1]:.1f} | {rates[2]:.1f} | "
          f"{rates[2] / rates[1]:.2f}x |")
    print(f"| trainer step s (ranks) | {t1:.3f} | {t2:.3f} | {t1 / t2:.2f}x |")
    print(f"| weight sync to 2 replicas, s (median of {SYNCS}; {size / 1e6:.1f} MB to each) | | {sync_s:.4f} | |")
    print(f"replicas: rollout_scaling_2={rates[2] / rates[1]:.2f} train_scaling_2={t1 / t2:.2f} sync_s={sync_s:.4f}")


if __name__ == "__main__":
    main()
