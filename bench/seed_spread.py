"""Seed spread: how far apart the seeds of one config land, to size a study test's effect.

    python bench/seed_spread.py                           # lr 0, 0.01, 0.02, 0.03; seeds 0-5; 3 at once
    python bench/seed_spread.py --lr 0.02 0.1 --seeds 8 --side-by-side 2 --steps 10

Each (lr, seed) is one real `swarm run configs/tiny.yaml` (on-policy: `trainer.max_staleness=0`)
in a temporary folder, scored as a study scores it: the mean of the last `--window` values of
`reward/mean`. One seed's runs of every lr go side by side (`--side-by-side` at once), because a
busy machine changes which episodes fill a batch and so the learning curve: the spread under load
is what a study test meets in CI. It prints one row per lr (every seed's score, mean, sd, the
lowest) and the ratio a paired t-test sees against the first lr (mean difference / its sd), then
`seed_spread: <lr>=<ratio> ...`. It is a bench: it asserts nothing.
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SWARM = Path(sys.executable).with_name("swarm")


def one_run(folder: Path, lr: float, seed: int, steps: int, window: int) -> float:
    folder.mkdir(parents=True)
    sets = {"trainer.steps": steps, "trainer.lr": lr, "trainer.max_staleness": 0, "trainer.seed": seed,
            "server.port": 0, "trainer.checkpoint_dir": folder / "checkpoints"}
    args = [str(SWARM), "run", str(ROOT / "configs" / "tiny.yaml")]
    for key, value in sets.items():
        args += ["--set", f"{key}={value}"]
    with open(folder / "log", "w") as log:
        rc = subprocess.run(args, cwd=folder, stdout=log, stderr=subprocess.STDOUT, timeout=600).returncode
    if rc != 0:
        raise SystemExit(f"lr {lr} seed {seed} exited {rc}: see {folder / 'log'}")
    rows = sqlite3.connect(folder / "mlflow.db").execute(
        "select value from metrics where key = 'reward/mean' order by step").fetchall()
    return statistics.mean(v for (v,) in rows[-window:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lr", type=float, nargs="+", default=[0.0, 0.01, 0.02, 0.03])
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--window", type=int, default=3)
    ap.add_argument("--side-by-side", type=int, default=3)
    a = ap.parse_args()
    scores: dict[float, dict[int, float]] = {lr: {} for lr in a.lr}
    with tempfile.TemporaryDirectory(prefix="seed-spread-") as tmp, ThreadPoolExecutor(a.side_by_side) as pool:
        for seed in range(a.seeds):
            runs = {lr: pool.submit(one_run, Path(tmp) / f"lr{lr}-s{seed}", lr, seed, a.steps, a.window)
                    for lr in a.lr}
            for lr, run in runs.items():
                scores[lr][seed] = run.result()
    base = scores[a.lr[0]]
    print(f"{'lr':>6} | " + " ".join(f"s{s:<5}" for s in range(a.seeds)) + " |  mean     sd    min | diff/sd")
    ratios = {}
    for lr, by_seed in scores.items():
        v = list(by_seed.values())
        diffs = [by_seed[s] - base[s] for s in by_seed]
        ratio = statistics.mean(diffs) / statistics.stdev(diffs) if lr != a.lr[0] else float("nan")
        ratios[lr] = ratio
        print(f"{lr:>6} | " + " ".join(f"{x:.3f} " for x in v)
              + f" | {statistics.mean(v):.3f}  {statistics.stdev(v):.3f}  {min(v):.3f} | {ratio:7.1f}")
    print("seed_spread: " + " ".join(f"{lr}={r:.1f}" for lr, r in ratios.items() if lr != a.lr[0]))


if __name__ == "__main__":
    main()
