"""The cost of Ray placement: the same `swarm run` in one process, and with its model and clients as Ray actors.

Arms (each a fresh `swarm run` process on the same config, same seed, same steps):
- `local`: model, trainer and clients in the `swarm run` process (the default);
- `ray`: `--ray-address local`: a private Ray instance on this machine; the model's engine+trainer
  is one actor, each client one actor; the gateway stays in the driver. Every generation, every
  control call of a step and the episodes of a batch cross process boundaries through Ray.

It reads the runs' MLflow metrics and prints, per arm: process wall time, time to step 1, median
step time (`time/step_s`, steps 2..N), median train time inside a step, and median rollout
episodes/s and tokens/s. The arms alternate when `--repeats` > 1 so they share the machine's load.

    .venv/bin/python bench/placement.py [--config configs/tiny.yaml] [--steps 6] [--repeats 1]

It measures; it changes nothing (MLflow store and checkpoints go to a temporary folder).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mlflow.tracking import MlflowClient

ROOT = Path(__file__).resolve().parents[1]
SWARM = Path(sys.executable).with_name("swarm")
STEP_LINE = "step 1 reward"  # what `swarm run --quiet` logs when its first step is done
ARMS = {"local": [], "ray": ["--ray-address", "local"]}


def run_arm(arm: str, config: str, steps: int, tmp: Path, index: int) -> dict[str, float]:
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    name = f"{arm}-{index}"
    argv = [str(SWARM), "run", config, "--quiet", "--run-name", name, "--experiment", "bench-placement",
            "--set", f"trainer.steps={steps}", "--set", f"trainer.checkpoint_dir={tmp / name}",
            "--set", f"telemetry.tracking_uri={uri}", *ARMS[arm]]
    ray_tmp = tempfile.mkdtemp(prefix="rb-", dir="/tmp")  # short: Ray's socket paths must stay under ~107 chars
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "RAY_TMPDIR": ray_tmp,
           "RAY_memory_monitor_refresh_ms": "0"}  # a shared machine's memory use must not kill the arm's actors
    started = time.perf_counter()
    first_step = float("nan")
    lines: list[str] = []
    with subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            lines.append(line)
            if STEP_LINE in line and first_step != first_step:
                first_step = time.perf_counter() - started
        code = proc.wait()
    wall = time.perf_counter() - started
    shutil.rmtree(ray_tmp, ignore_errors=True)
    if code != 0:
        raise SystemExit(f"arm {arm} exited {code}:\n" + "".join(lines[-40:]))
    client = MlflowClient(uri)
    run = client.search_runs([client.get_experiment_by_name("bench-placement").experiment_id],
                             filter_string=f"attributes.run_name = '{name}'")[0]

    def median(key: str) -> float:
        values = [m.value for m in client.get_metric_history(run.info.run_id, key) if m.step >= 2]
        return statistics.median(values) if values else float("nan")

    return {"wall_s": wall, "first_step_s": first_step, "step_s": median("time/step_s"),
            "train_s": median("time/train_s"), "episodes_per_s": median("rollout/episodes_per_s"),
            "tokens_per_s": median("rollout/tokens_per_s")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    results: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory(prefix="bench-placement-") as tmp:
        for i in range(args.repeats):
            for arm in ARMS:
                results[arm].append(run_arm(arm, args.config, args.steps, Path(tmp), i))
    keys = ["wall_s", "first_step_s", "step_s", "train_s", "episodes_per_s", "tokens_per_s"]
    print(f"config {args.config}, {args.steps} steps, {args.repeats} repeat(s); medians over repeats")
    print("| arm | " + " | ".join(keys) + " |")
    print("| --- " * (len(keys) + 1) + "|")
    med = {arm: {k: statistics.median(r[k] for r in rs) for k in keys} for arm, rs in results.items()}
    for arm in ARMS:
        print(f"| {arm} | " + " | ".join(f"{med[arm][k]:.2f}" for k in keys) + " |")
    print(f"ray / local: step time {med['ray']['step_s'] / med['local']['step_s']:.2f}x, "
          f"episodes/s {med['ray']['episodes_per_s'] / med['local']['episodes_per_s']:.2f}x, "
          f"wall {med['ray']['wall_s'] / med['local']['wall_s']:.2f}x")


if __name__ == "__main__":
    main()
