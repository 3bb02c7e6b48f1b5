"""Proof that the core learns: SmolLM2-135M on a format-following task, reward curve saved as a PNG.

Runs the real loop (server, sandbox client, trainer) from `configs/smollm2-oneword.yaml` and reports
the mean reward of the first and last 5 steps, the step-to-step noise, and the margin in units of
that noise. `--from-log` makes the same table and curve from the printed log of a run that was
stopped early (its `step N reward R (Ts)` lines), so a run cut short by a deadline still reports
exactly what it reached.

    .venv/bin/python bench/learning.py [--config configs/smollm2-oneword.yaml] [--steps 40] [--out bench/out]
    .venv/bin/python bench/learning.py --config configs/smollm2-guess.yaml --from-log run.log
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from core.config_io import load_config  # noqa: E402

STEP_LINE = re.compile(r"^step +(\d+) reward (-?[\d.]+) \((\d+)s\)")  # what a run prints per step


def run(config: str, overrides: list[str]) -> tuple[list[float], float]:
    """Train from `config` through the real server, clients and trainer: (reward per step, wall seconds)."""
    from core.run.loop import CoreRun  # the whole core (torch, the server): only a live run needs it, not --from-log

    cfg = load_config(config, overrides)
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
    return rewards, time.time() - start


def from_log(path: Path) -> tuple[list[float], float]:
    """(reward per step, wall seconds at the last step) from the printed log of a run."""
    steps = [STEP_LINE.match(line) for line in path.read_text().splitlines()]
    found = [(int(m.group(1)), float(m.group(2)), float(m.group(3))) for m in steps if m]
    if not found or [s for s, _, _ in found] != list(range(1, len(found) + 1)):
        raise SystemExit(f"{path}: no consecutive `step N reward R (Ts)` lines from step 1")
    return [r for _, r, _ in found], found[-1][2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/smollm2-oneword.yaml")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--out", default="bench/out")
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--from-log", type=Path, help="report a stopped run from its printed log instead of training")
    args = ap.parse_args()
    overrides = list(args.overrides) + ([f"trainer.steps={args.steps}"] if args.steps else [])
    cfg = load_config(args.config, overrides)
    rewards, wall = from_log(args.from_log) if args.from_log else run(args.config, overrides)
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
