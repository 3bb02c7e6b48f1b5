"""Proof that the core learns: SmolLM2-135M on a format-following task, reward curve saved as a PNG.

Runs the real loop (server, sandbox client, trainer) from `configs/smollm2-oneword.yaml` and reports
the mean reward of the first and last 5 steps, the step-to-step noise, and the margin in units of
that noise.

    .venv/bin/python bench/learning.py [--config configs/smollm2-oneword.yaml] [--steps 40] [--out bench/out]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from core.config import load_config  # noqa: E402
from core.run import CoreRun  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/smollm2-oneword.yaml")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--out", default="bench/out")
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    args = ap.parse_args()
    overrides = list(args.overrides) + ([f"trainer.steps={args.steps}"] if args.steps else [])
    cfg = load_config(args.config, overrides)
    core = CoreRun(cfg)
    rewards: list[float] = []
    start = time.time()
    core.server.start()
    try:
        core.start_clients()
        core.train(on_step=lambda step, m: (rewards.append(m["reward/mean"]), print(f"step {step:3d} reward {m['reward/mean']:.3f} "
                                                                                      f"({time.time() - start:.0f}s)", flush=True)))
    finally:
        core.stop_clients()
        core.server.stop()
    wall = time.time() - start
    first, last = statistics.mean(rewards[:5]), statistics.mean(rewards[-5:])
    noise = statistics.pstdev([b - a for a, b in zip(rewards, rewards[1:])]) if len(rewards) > 2 else float("nan")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    png = out / "learning.png"
    plt.figure(figsize=(6, 3.5))
    plt.plot(range(1, len(rewards) + 1), rewards, marker=".")
    plt.xlabel("trainer step")
    plt.ylabel("mean reward")
    plt.title(f"{cfg.models[0].source}: {Path(args.config).stem}")
    plt.grid(alpha=0.3)
    plt.tight_layout()
    plt.savefig(png, dpi=120)
    print(f"\n{'steps':>6} {'wall s':>7} {'first-5':>8} {'last-5':>7} {'noise':>6} {'margin/noise':>13}")
    print(f"{len(rewards):>6} {wall:>7.0f} {first:>8.3f} {last:>7.3f} {noise:>6.3f} {(last - first) / noise:>13.1f}")
    print(f"reward curve: {png}")


if __name__ == "__main__":
    main()
