"""Multi-model step time against single-model, same total tokens: one train step of the run loop.

The duo topology (`configs/tiny-duo.yaml`): every episode has two calls, a drafter's and a
reviewer's. Trained by two policies, each trains on its own call of every episode (two optimizer
steps, two weight syncs); trained by one policy, it trains on both calls (one step). The batches
are the same episodes with the same token ids, so both arms train the same total tokens. Each step
is `CoreRun._train_batch`, the run loop's own step (engine hold or swap, prepare, forward/backward,
optimizer, version bump), on a run with no HTTP and no clients, the arms interleaved step by step.

    .venv/bin/python bench/multi_model.py [--source tiny] [--groups 4] [--group-size 4]
        [--prompt 48] [--completion 24] [--steps 6] [--max-staleness 1]

The last line is `multi_model: ratio=<multi/single step time> tokens=<equal>`.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from core.config_io import load_config  # noqa: E402
from core.episodes.batching import Batch  # noqa: E402
from core.records import Call, Episode  # noqa: E402
from core.run.loop import CoreRun  # noqa: E402

ROLES = ("drafter", "reviewer")


def episodes(args, vocab: int, seed: int) -> list[list[tuple[list[int], list[int], float]]]:
    """Per episode, two calls as (prompt ids, completion ids, reward): the same for both arms."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(1, vocab) for _ in range(n)]  # noqa: E731
    return [[(ids(args.prompt), ids(args.completion), rng.random()) for _ in ROLES]
            for _ in range(args.groups * args.group_size)]


def batch(data, names: tuple[str, str], versions: dict[str, int], group_size: int) -> Batch:
    """The calls of each episode served by `names` (one name twice: the single-policy arm)."""
    eps = []
    for i, calls in enumerate(data):
        recorded = [Call(model=name, version=versions[name], prompt_ids=p, completion_ids=c,
                         completion_logprobs=[-2.0] * len(c)) for name, (p, c, _) in zip(names, calls)]
        reward = {name: 0.0 for name in names}
        for name, (_, _, r) in zip(names, calls):
            reward[name] += r
        eps.append(Episode(id=f"ep{i}", sandbox="duo", task_id=f"t{i // group_size}", group_size=group_size,
                           state="finished", opened_at=0.0, lease_expires_at=1e18, calls=recorded, reward=reward))
    return Batch([eps[i:i + group_size] for i in range(0, len(eps), group_size)])


def arm(args, names: list[str]) -> CoreRun:
    models = [f"models.{i}.name={n}" for i, n in enumerate(names)]
    models += [f"models.{i}.source={args.source}" for i in range(len(names))]
    models += [f"models.{i}.seed={i + 1}" for i in range(len(names))]
    cfg = load_config({"models": [{} for _ in names]}, [
        *models, f"trainer.batch_groups={args.groups}", f"trainer.group_size={args.group_size}",
        f"trainer.max_staleness={args.max_staleness}", "trainer.lr=1e-4", "server.port=0"])
    return CoreRun(cfg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", default="tiny")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=48)
    ap.add_argument("--completion", type=int, default=24)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per arm, after one warm-up step")
    ap.add_argument("--max-staleness", type=int, default=1, help="0: drain and step; >= 1: swap between decode steps")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    runs = {"single": arm(args, ["policy"]), "multi": arm(args, list(ROLES))}
    vocab = min(len(p.tokenizer) for r in runs.values() for p in r.server.policies.values())
    times: dict[str, list[float]] = {k: [] for k in runs}
    tokens: dict[str, float] = {}
    try:
        for step in range(args.steps + 1):  # step 0 warms up both arms
            data = episodes(args, vocab, seed=step)
            for name, core in runs.items():
                names = ("policy", "policy") if name == "single" else ROLES
                b = batch(data, names, core.server.versions(), args.group_size)
                started = time.perf_counter()
                outcomes = core._train_batch(b)
                if step:
                    times[name].append(time.perf_counter() - started)
                tokens[name] = sum(o.metrics.get("train/tokens", 0.0) for o in outcomes.values())
    finally:
        for core in runs.values():
            core.server.close()
    single, multi = statistics.median(times["single"]), statistics.median(times["multi"])
    load = os.getloadavg()[0]
    print(f"source={args.source} episodes/step={args.groups * args.group_size} calls/episode=2 "
          f"prompt={args.prompt} completion={args.completion} max_staleness={args.max_staleness} load={load:.1f}")
    print(f"| arm | policies | optimizer steps/step | tokens/step | step time s (median of {args.steps}) | ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    print(f"| single | 1 | 1 | {tokens['single']:.0f} | {single:.3f} | 1.00 |")
    print(f"| multi | 2 | 2 | {tokens['multi']:.0f} | {multi:.3f} | {multi / single:.2f} |")
    print(f"multi_model: ratio={multi / single:.2f} tokens={'equal' if tokens['single'] == tokens['multi'] else 'DIFFER'}")


if __name__ == "__main__":
    main()
